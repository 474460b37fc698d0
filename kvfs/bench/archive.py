"""``kvfs bench archive``: the archive tier beside plain boto3, in the same run.

* **spill vs boto3 put**: a session of real KV pages is spilled (read + verify + compress +
  conditional put + manifest + drop local) and, alternately, the same page bytes are
  uploaded with plain ``boto3 put_object`` at the same concurrency to the same endpoint;
  throughput is page bytes / wall time for both (goal: spill >= 0.8 x boto3).
* **restore vs boto3 get**: the session is restored (download + decompress + verify + local
  write) and the same objects are downloaded with ``get_object``.
* **compression**: K/V tensors from a random-initialised Llama-shaped model's cache
  (transformers, CPU torch; ``--numpy-kv`` uses one random attention layer in numpy
  instead), as fp16, bf16 and fp32, with zstd alone and byte-shuffle + zstd.
* **foreground latency**: p50/p99 of 256 KiB page reads from the local tier while idle,
  while a spill runs (goal: p99 <= 1.5 x idle), and, as the machine's floor, while another
  process uploads the same bytes with plain boto3 at the same concurrency (what any upload
  to this endpoint costs a reader here: CPUs shared with the uploader and, for moto, the
  server), timed from its first upload to its last (not while its Python starts).

Throughputs are the best of ``--repeat`` rounds; each ratio is the median of the rounds' own
kvfs / boto3 (the two ran back to back in a round). Without ``--endpoint`` a moto S3 server
is started on loopback in a separate process.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import kvfs
from kvfs._codec import CODECS, encode, shuffle
from kvfs.bench._common import WITH_PARENT, at_least, log, machine, new_parser, progress

__all__ = ["register", "run_archive_bench"]

MiB = 1 << 20


def _mib(text: str) -> float:
    """``--page-mib``: a size of at least one byte (0 ran the whole benchmark, then failed
    with "float division by zero")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):  # (int() of inf raised OverflowError, a traceback)
        raise argparse.ArgumentTypeError(f"a finite number of MiB is needed, not {text}")
    if not int(value * MiB) >= 1:
        raise argparse.ArgumentTypeError(f"a page of at least one byte is needed, not {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "archive",
        help="spill/restore vs plain boto3, compression, read latency",
        doc=__doc__,
        run=_main,
    )
    p.add_argument("--endpoint", default=None, help="S3 endpoint URL (default: start moto)")
    p.add_argument(
        "--bucket",
        default=None,
        help="bucket (default: a new one, moto only); needs s3:ListBucket besides "
        "Put/Get/DeleteObject",
    )
    p.add_argument(
        "--server-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="N",
        help="run the moto server at nice N (1-19): it then yields the CPUs to kvfs and to "
        "the reads timed, as an S3 endpoint on other machines would (default 0)",
    )
    p.add_argument(
        "--pages", type=at_least(1), default=24, help="pages in the spilled session (24)"
    )
    p.add_argument("--page-mib", type=_mib, default=2.0, help="page size in MiB (2)")
    p.add_argument(
        "--concurrency", type=at_least(1), default=8, help="uploads/downloads at once (8)"
    )
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=2,
        help="alternate rounds: best throughputs, median ratios (2)",
    )
    p.add_argument(
        "--tokens", type=at_least(1), default=512, help="tokens prefilled for the KV (512)"
    )
    p.add_argument("--layers", type=at_least(1), default=4, help="model layers (4)")
    p.add_argument(
        "--numpy-kv",
        action="store_true",
        help="KV from one random attention layer in numpy instead of transformers",
    )
    p.add_argument("--latency-reads", type=at_least(1), default=400, help="reads per latency phase")
    p.add_argument("--level", type=_zstd_level, default=1, help="zstd level, 1-19 (1, the default)")
    p.add_argument(
        "--codec",
        choices=["auto", *CODECS],
        default="auto",
        help="how spilled pages are encoded (auto, the default; raw shows what decoding costs)",
    )
    p.add_argument(
        "--cpu-slots",
        type=at_least(0),
        default=0,
        help="pages compressed at once (default 0: half the CPUs)",
    )
    p.add_argument(
        "--upload-processes",
        type=at_least(0),
        default=2,
        help="spill and restore worker processes (default 2; 0: threads in the store's process)",
    )


@contextmanager
def _moto(nice: int = 0, info: dict[str, int] | None = None) -> Any:
    """A moto S3 server on a free loopback port, in its own process; ``nice`` > 0 runs it
    at that lower CPU priority. ``info`` (if given) gets the server's ``pid`` and the
    ``nice`` value it really runs at. Raises RuntimeError when the server does not start.

    The server runs in a session of its own: a Ctrl-C at the terminal reaches only the
    benchmark, which then ends its run (deleting what it uploaded) against a server still
    up and stops it last, instead of failing on the network first. It also exits when the
    benchmark's process dies (``PR_SET_PDEATHSIG``), so a killed benchmark leaves no server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _NICE_MOTO, str(nice), str(os.getpid())]
        + ["-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"the moto server exited with status {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"the moto server did not listen on port {port} within 15 s")
        if info is not None:
            info["pid"] = proc.pid
            info["nice"] = os.getpriority(os.PRIO_PROCESS, proc.pid)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


_NICE_MOTO = (
    WITH_PARENT
    + """
import os, sys
n, parent = int(sys.argv.pop(1)), int(sys.argv.pop(1))
if os.getppid() != parent:
    sys.exit(1)
if n > os.nice(0):  # nice N itself, not N more than this command's (never less nice)
    os.nice(n - os.nice(0))
from moto.server import main
sys.argv[0] = "moto_server"
main()
"""
)


# -- KV tensors ---------------------------------------------------------------------------
def kv_tensors(tokens: int, layers: int, numpy_kv: bool) -> tuple[list[Any], str]:
    """Per-layer K and V as float32 numpy arrays, and where they came from."""
    if not numpy_kv:
        try:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            from kvfs.integrations._hfcompat import cache_of

            torch.manual_seed(0)
            cfg = LlamaConfig(
                hidden_size=1024,
                intermediate_size=2816,
                num_hidden_layers=layers,
                num_attention_heads=8,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=32000,
                max_position_embeddings=max(4096, tokens),
            )
            model = LlamaForCausalLM(cfg).eval()
            ids = torch.randint(0, cfg.vocab_size, (1, tokens))
            with torch.no_grad():
                out = model(ids, use_cache=True)
            cache = cache_of(out)
            arrs = []
            for i in range(layers):
                if hasattr(cache, "layers"):
                    k, v = cache.layers[i].keys, cache.layers[i].values
                else:
                    k, v = cache[i]
                arrs += [k.float().numpy(), v.float().numpy()]
            return arrs, (
                f"random-initialised Llama (transformers), {layers} layers, hidden "
                f"1024, 8 KV heads x 128, {tokens} random tokens"
            )
        except ImportError:
            pass
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, 1024)).astype(np.float32)
    arrs = []
    for _ in range(layers):
        wk, wv = (rng.standard_normal((1024, 1024)).astype(np.float32) / 32 for _ in range(2))
        arrs += [(x @ wk).reshape(tokens, 8, 128), (x @ wv).reshape(tokens, 8, 128)]
        x = np.tanh(x + 0.1 * rng.standard_normal(x.shape).astype(np.float32))
    return arrs, f"numpy random attention projections, {layers} layers, {tokens} tokens"


def _as_dtype(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "fp32":
        return a.astype(np.float32).tobytes()
    if dtype == "fp16":
        return a.astype(np.float16).tobytes()
    # bf16: the top 16 bits of fp32, rounded to nearest even
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def compression(arrs: list[np.ndarray], level: int) -> list[dict[str, Any]]:
    import zstandard

    c = zstandard.ZstdCompressor(level=level)
    c.compress(shuffle(_as_dtype(arrs[0], "fp16"), 2))  # warm up: first calls allocate
    rows = []
    for dtype, elem in (("fp16", 2), ("bf16", 2), ("fp32", 4)):
        raw = b"".join(_as_dtype(a, dtype) for a in arrs)
        t0 = time.perf_counter()
        plain = len(c.compress(raw))
        t1 = time.perf_counter()
        shuf = len(c.compress(shuffle(raw, elem)))
        t2 = time.perf_counter()
        _obj, chosen = encode(raw, level=level, codec="auto", elem=elem)
        rows.append(
            {
                "dtype": dtype,
                "raw_bytes": len(raw),
                "zstd_ratio": plain / len(raw),
                "shuffle_zstd_ratio": shuf / len(raw),
                "zstd_mbps": len(raw) / (t1 - t0) / 1e6,
                "shuffle_zstd_mbps": len(raw) / (t2 - t1) / 1e6,
                "auto_chose": chosen,
            }
        )
    return rows


def baseline_client(endpoint: str, concurrency: int) -> Any:
    """The plain boto3 client of the baselines, its connection pool sized to the concurrency
    as kvfs sizes its own (boto3's default of 10 throttled the baseline above 10 and the
    ratio favoured kvfs)."""
    import boto3
    import botocore.config

    cfg = botocore.config.Config(max_pool_connections=concurrency)
    return boto3.client("s3", endpoint_url=endpoint, config=cfg)


def _zstd_level(text: str) -> int:
    """An argparse ``type``: a zstd level the archive tier takes (``archive.zstd_level``,
    1-19). Checked here: 23 failed only after the model had run, and 0 or -3 measured a
    level no store can be set to."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= 19:
        raise argparse.ArgumentTypeError(f"must be 1 to 19 (as archive.zstd_level), not {n}")
    return n


# -- throughput and latency -----------------------------------------------------------------
def _pages_from(arrs: list[np.ndarray], n: int, size: int) -> list[bytes]:
    pool = b"".join(_as_dtype(a, "fp16") for a in arrs)
    out = []
    for i in range(n):
        off = (i * 7919 * 4096) % max(1, len(pool) - size)
        page = bytearray((pool * (1 + size // len(pool)))[off : off + size])
        page[:8] = i.to_bytes(8, "little")  # distinct pages: nothing is deduplicated
        out.append(bytes(page))
    return out


def run_archive_bench(
    endpoint: str, bucket: str, args: argparse.Namespace, arrs: list[np.ndarray]
) -> dict[str, Any]:
    client = baseline_client(endpoint, args.concurrency)
    size = int(args.page_mib * MiB)
    pages = _pages_from(arrs, args.pages, size)
    total = size * len(pages)
    scratch = Path(tempfile.mkdtemp(prefix="kvfs-bench-archive-"))
    best = {"spill": 0.0, "put": 0.0, "restore": 0.0, "get": 0.0}
    # the ratios are the median of each round's kvfs / boto3: a round's two ran back to back,
    # so a noisy neighbour shifts both, while the best throughputs may come from two rounds
    ratios: dict[str, list[float]] = {"spill": [], "restore": []}
    lat: dict[str, list[float]] = {}
    floor: dict[str, Any] = {}
    # CPU of this (the store's) process: what a spill or restore takes from foreground work
    # in the same process; upload workers are other processes and are not counted
    cpu: dict[str, list[float]] = {"spill": [], "restore": []}
    # Each round's key prefixes: the store's archive (blobs, manifests), the boto3 baseline's
    # and the latency floor's. All are deleted when the run ends, however it ends: the bucket
    # may be the user's, and a default run uploads ~250 MB.
    prefixes: list[str] = []
    try:
        for r in range(args.repeat):
            shutil.rmtree(scratch / "store", ignore_errors=True)
            prefix = _fresh_prefix(client, bucket)
            prefixes += [f"{prefix}/", f"{prefix}-raw/", f"{prefix}-floor/"]
            cfg = kvfs.StoreConfig(
                data_dirs=(scratch / "store",),
                archive_url=f"s3://{bucket}/{prefix}?endpoint={endpoint}",
                extra={
                    "archive": {
                        "interval": 0,
                        "concurrency": args.concurrency,
                        "zstd_level": args.level,
                        "codec": args.codec,
                        "cpu_slots": args.cpu_slots,
                        "upload_processes": args.upload_processes,
                    }
                },
            )
            with ThreadPoolExecutor(args.concurrency) as ex:
                t0 = time.perf_counter()
                list(
                    ex.map(
                        lambda ip, pre=prefix: client.put_object(
                            Bucket=bucket, Key=f"{pre}-raw/{ip[0]}", Body=ip[1]
                        ),
                        enumerate(pages),
                    )
                )
                put = total / (time.perf_counter() - t0) / 1e6
                t0 = time.perf_counter()
                list(
                    ex.map(
                        lambda i, pre=prefix: client.get_object(
                            Bucket=bucket, Key=f"{pre}-raw/{i}"
                        )["Body"].read(),
                        range(len(pages)),
                    )
                )
                get = total / (time.perf_counter() - t0) / 1e6
            with kvfs.open_store_sync(cfg) as s:
                for i, pg in enumerate(pages):
                    s.put(kvfs.PageKey.semantic("cold", "p", i), pg, attrs={"dtype": "fp16"})
                # Untimed: a page per worker starts the upload workers and their connections,
                # as a running daemon has them (it starts them when it opens).
                for w in range(max(1, args.upload_processes)):
                    s.put(
                        kvfs.PageKey.semantic("warm", "p", w),
                        pages[w % len(pages)][1:] + bytes([r]),
                        attrs={"dtype": "fp16"},
                    )
                s.spill("warm")
                t0, c0 = time.perf_counter(), time.process_time()
                s.spill("cold")
                spill = total / (time.perf_counter() - t0) / 1e6
                cpu["spill"].append(time.process_time() - c0)
                t0, c0 = time.perf_counter(), time.process_time()
                s.restore("cold")
                restore = total / (time.perf_counter() - t0) / 1e6
                cpu["restore"].append(time.process_time() - c0)
                if r == args.repeat - 1:
                    lat = _latency(s, pages, args.latency_reads)
                    floor = _latency_beside_boto3(
                        s, endpoint, bucket, f"{prefix}-floor", pages, args.concurrency, scratch
                    )
                    lat["boto3"] = floor["reads"]
            for k, v in (("put", put), ("get", get), ("spill", spill), ("restore", restore)):
                best[k] = max(best[k], v)
            ratios["spill"].append(spill / put)
            ratios["restore"].append(restore / get)
            progress(
                f"  round {r + 1}/{args.repeat}: spill {spill:.0f} vs put {put:.0f} MB/s, "
                f"restore {restore:.0f} vs get {get:.0f} MB/s"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _delete_prefixes(client, bucket, prefixes)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {
        "pages": len(pages),
        "page_bytes": size,
        "concurrency": args.concurrency,
        "repeat": args.repeat,
        "spill_mbps": best["spill"],
        "boto3_put_mbps": best["put"],
        "spill_ratio": statistics.median(ratios["spill"]),
        "restore_mbps": best["restore"],
        "boto3_get_mbps": best["get"],
        "restore_ratio": statistics.median(ratios["restore"]),
        "round_ratios": ratios,
        "upload_processes": args.upload_processes,
        "spill_store_cpu_ms": min(cpu["spill"]) * 1e3,
        "restore_store_cpu_ms": min(cpu["restore"]) * 1e3,
        "read_p50_idle_ms": pct(lat["idle"], 0.5),
        "read_p99_idle_ms": pct(lat["idle"], 0.99),
        "read_p50_spill_ms": pct(lat["spill"], 0.5),
        "read_p99_spill_ms": pct(lat["spill"], 0.99),
        "reads_during_spill": len(lat["spill"]),
        "p99_ratio": pct(lat["spill"], 0.99) / pct(lat["idle"], 0.99),
        "read_p50_boto3_ms": pct(lat["boto3"], 0.5),
        "read_p99_boto3_ms": pct(lat["boto3"], 0.99),
        "reads_during_boto3": len(lat["boto3"]),
        "boto3_upload_s": floor["upload_s"],
        "p99_ratio_vs_boto3": pct(lat["spill"], 0.99) / pct(lat["boto3"], 0.99),
    }


def _fresh_prefix(client: Any, bucket: str) -> str:
    """A ``run-<id>`` under which the bucket holds nothing yet (``run-<id>``, ``-raw`` and
    ``-floor`` all start with it), so that deleting the run's prefixes afterwards deletes
    only what this run wrote."""
    while True:
        prefix = f"run-{uuid.uuid4().hex[:8]}"
        if not client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount"):
            return prefix


def _delete_prefixes(client: Any, bucket: str, prefixes: list[str]) -> None:
    """Delete every object under ``prefixes``. A failure (the endpoint gone) is reported on
    stderr with what is left, never raised: it must not hide why the run ended."""
    left = []
    for prefix in prefixes:
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for page in pages:
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if not keys:  # (a listing page holds at most 1000 keys, as a delete may)
                    continue
                done = client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                if done.get("Errors"):
                    raise RuntimeError(done["Errors"][0].get("Message", "delete refused"))
        except Exception as e:  # noqa: BLE001 - reported, and the other prefixes still tried
            left.append(f"{prefix} ({e})")
    if left:
        log(
            f"warning: could not delete the benchmark's objects in {bucket} under "
            + ", ".join(left)
        )


_HOT = [kvfs.PageKey.semantic("hot", "p", i) for i in range(32)]


def _reader(s: kvfs.SyncStore) -> Any:
    """A function timing one 256 KiB read of a hot local page (seconds)."""
    buf = kvfs.aligned_buffer(256 * 1024 + 4096)

    def read(i: int) -> float:
        t0 = time.perf_counter()
        s.get(_HOT[i % len(_HOT)], into=buf)
        return time.perf_counter() - t0

    return read


def _reads_until(read: Any, done: Any, n: int) -> list[float]:
    """Read until ``done()`` (at least 20 reads, at most 50 n)."""
    busy: list[float] = []
    while not done() or len(busy) < 20:
        busy.append(read(len(busy)))
        if len(busy) >= 50 * n:
            break
    return busy


def _latency(s: kvfs.SyncStore, pages: list[bytes], n: int) -> dict[str, list[float]]:
    for i, k in enumerate(_HOT):
        s.put(k, pages[i % len(pages)][: 256 * 1024] + i.to_bytes(8, "little"))
    read = _reader(s)

    idle = [read(i) for i in range(n)]
    s.evict(session="cold")  # archived already: restore everything, then spill it again
    s.restore("cold")
    for i, pg in enumerate(pages):  # fresh content so the spill really uploads
        s.put(kvfs.PageKey.semantic("cold2", "p", i), pg[::-1])
    done = threading.Event()

    def spill() -> None:
        s.spill("cold2")
        done.set()

    t = threading.Thread(target=spill)
    t.start()
    busy = _reads_until(read, done.is_set, n)
    t.join()
    return {"idle": idle, "spill": busy}


#: The latency floor's uploader: plain boto3 only, configured as baseline_client is. It says
#: ``start <monotonic time>`` on stdout once it is about to upload and ``done <time>`` once
#: every object is up: the floor's reads are timed between the two, not while the
#: interpreter starts and imports boto3.
_UPLOADER = (
    WITH_PARENT
    + """
import sys, time
from concurrent.futures import ThreadPoolExecutor
import boto3, botocore.config
endpoint, bucket, prefix, path, size, conc = sys.argv[1:4] + [sys.argv[4], *map(int, sys.argv[5:7])]
data = open(path, "rb").read()
client = boto3.client(
    "s3", endpoint_url=endpoint, config=botocore.config.Config(max_pool_connections=conc)
)
pages = [data[o : o + size] for o in range(0, len(data), size)]
print("start", time.monotonic(), flush=True)
with ThreadPoolExecutor(conc) as ex:
    list(ex.map(lambda ip: client.put_object(Bucket=bucket, Key=f"{prefix}/{ip[0]}", Body=ip[1]),
                enumerate(pages)))
print("done", time.monotonic(), flush=True)
"""
)


def _latency_beside_boto3(
    s: kvfs.SyncStore,
    endpoint: str,
    bucket: str,
    prefix: str,
    pages: list[bytes],
    concurrency: int,
    scratch: Path,
) -> dict[str, Any]:
    """Reads while another process uploads the same bytes with plain boto3: ``reads`` (their
    seconds), timed from when the uploader starts its uploads until they are done (its
    interpreter's start and boto3's import, longer than the uploads of a small session,
    are not a time of uploading), ``upload_s`` (the uploads' own seconds), and
    ``upload_started`` and ``first_read`` (``time.monotonic``, the same clock in both
    processes). Raises RuntimeError when the uploader fails."""
    blob = scratch / "floor.bin"
    blob.write_bytes(b"".join(pages))
    read = _reader(s)
    proc = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER, endpoint, bucket, prefix, str(blob)]
        + [str(len(pages[0])), str(concurrency)],
        stdout=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C is the benchmark's to handle: it stops this one
    )
    assert proc.stdout is not None
    said: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        """Note the uploader's "done" line; set ``done`` then, or when it ends without."""
        assert proc.stdout is not None
        for line in proc.stdout:
            word, _, when = line.decode().partition(" ")
            said[word] = float(when)
            if word == "done":
                break
        done.set()

    busy: list[float] = []
    first_read = math.nan
    try:
        word, _, when = proc.stdout.readline().decode().partition(" ")
        if word == "start":  # (else it failed before uploading: said below)
            said["start"] = float(when)
            threading.Thread(target=watch, daemon=True).start()
            first_read = time.monotonic()
            busy = _reads_until(read, done.is_set, len(pages) * 100)
    finally:
        if proc.poll() is None and not done.is_set():  # (the reads failed or were interrupted)
            proc.terminate()
        proc.wait()
        proc.stdout.close()
        blob.unlink()
    if proc.returncode or "done" not in said:
        raise RuntimeError(f"the plain boto3 uploader failed (exit {proc.returncode})")
    return {
        "reads": busy,
        "upload_s": said["done"] - said["start"],
        "upload_started": said["start"],
        "first_read": first_read,
    }


def _check_listing(endpoint: str, bucket: str) -> None:
    """Refuse at once, saying what is missing, a bucket the user may not list: kvfs's
    archive lists its manifests (and checks the bucket at open with a listing), and the
    benchmark lists each run's prefix before and after it, to delete only what it wrote. A
    user who may only put, get and delete got botocore's AccessDenied for ListObjectsV2,
    exit 1, after the KV tensors were made. Raises ArchiveAccessDenied."""
    import botocore.exceptions

    try:
        baseline_client(endpoint, 1).list_objects_v2(Bucket=bucket, Prefix="run-", MaxKeys=1)
    except botocore.exceptions.ClientError as e:
        meta = e.response.get("ResponseMetadata", {})
        if meta.get("HTTPStatusCode") != 403:
            raise
        code = e.response.get("Error", {}).get("Code", "403")
        raise kvfs.ArchiveAccessDenied(
            f"listing bucket {bucket!r} at {endpoint} was refused ({code}): kvfs bench "
            "archive needs s3:ListBucket on it (a policy may limit it to keys under run-*: "
            "the run's prefixes), besides s3:PutObject, s3:GetObject and s3:DeleteObject "
            "there; kvfs's archive tier lists its manifests, and the benchmark lists its "
            "own keys to delete only those"
        ) from e


def _main(args: argparse.Namespace) -> int:
    if args.endpoint and not args.bucket:  # (before minutes of work)
        raise ValueError("--endpoint needs --bucket (a new bucket is made only on moto)")
    if args.endpoint:  # (before minutes of work too)
        _check_listing(args.endpoint, args.bucket)
    t0 = time.perf_counter()
    progress("generating KV tensors...")
    arrs, source = kv_tensors(args.tokens, args.layers, args.numpy_kv)
    comp = compression(arrs, args.level)
    if args.endpoint:
        res = run_archive_bench(args.endpoint, args.bucket, args, arrs)
        where = args.endpoint
    else:
        server: dict[str, int] = {}
        with _moto(args.server_nice, server) as ep:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            import boto3

            boto3.client("s3", endpoint_url=ep).create_bucket(Bucket="kvfs-bench")
            res = run_archive_bench(ep, "kvfs-bench", args, arrs)
            where = "moto server on loopback (separate process" + (
                f", nice {server['nice']})" if server["nice"] > 0 else ")"
            )
    out = {
        "machine": machine(),
        "endpoint": where,
        "kv_source": source,
        "zstd_level": args.level,
        "codec": args.codec,
        "compression": comp,
        **res,
        "wall_s": time.perf_counter() - t0,
    }
    if args.json:
        from cli._util import print_json

        print_json(out)
    else:
        _print(out)
    return 0


def _print(o: dict[str, Any]) -> None:
    from cli._util import print_table

    print(
        f"kvfs bench archive: {o['endpoint']}; {o['pages']} pages x "
        f"{o['page_bytes'] / MiB:.1f} MiB, concurrency {o['concurrency']}, codec {o['codec']}; "
        f"MB/s (1e6 B/s), best of {o['repeat']} rounds; ratio: median of the rounds' kvfs/boto3"
    )
    print_table(
        ["", "kvfs", "boto3 alone", "ratio"],
        [
            [
                "spill / put",
                f"{o['spill_mbps']:.0f}",
                f"{o['boto3_put_mbps']:.0f}",
                f"{o['spill_ratio']:.2f}",
            ],
            [
                "restore / get",
                f"{o['restore_mbps']:.0f}",
                f"{o['boto3_get_mbps']:.0f}",
                f"{o['restore_ratio']:.2f}",
            ],
        ],
    )
    print(
        f"CPU of the store's process: spill {o['spill_store_cpu_ms']:.0f} ms, restore "
        f"{o['restore_store_cpu_ms']:.0f} ms (worker processes: {o['upload_processes']}, "
        "not counted)"
    )
    print(f"\ncompression (compressed/raw, zstd level {o['zstd_level']}), KV from {o['kv_source']}")
    print_table(
        ["dtype", "zstd", "shuffle+zstd", "zstd MB/s", "shuffle MB/s", "auto keeps"],
        [
            [
                c["dtype"],
                f"{c['zstd_ratio']:.3f}",
                f"{c['shuffle_zstd_ratio']:.3f}",
                f"{c['zstd_mbps']:.0f}",
                f"{c['shuffle_zstd_mbps']:.0f}",
                c["auto_chose"],
            ]
            for c in o["compression"]
        ],
    )
    print(
        f"\nforeground 256 KiB reads: p50 {o['read_p50_idle_ms']:.2f} ms / p99 "
        f"{o['read_p99_idle_ms']:.2f} ms idle; p50 {o['read_p50_spill_ms']:.2f} ms / p99 "
        f"{o['read_p99_spill_ms']:.2f} ms during a spill ({o['reads_during_spill']} reads); "
        f"p99 ratio {o['p99_ratio']:.2f}"
    )
    print(
        f"while another process uploads the same bytes with plain boto3: p50 "
        f"{o['read_p50_boto3_ms']:.2f} ms / p99 {o['read_p99_boto3_ms']:.2f} ms "
        f"({o['reads_during_boto3']} reads, {o['boto3_upload_s']:.2f} s of uploads); "
        "spill p99 / this floor "
        f"{o['p99_ratio_vs_boto3']:.2f}"
    )
