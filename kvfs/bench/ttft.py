"""``kvfs bench ttft``: time to first token, full prefill vs the prefix loaded from kvfs.

For each context length N, in one run and on one model:

* **prefill**: the model computes all N tokens and picks the first output token;
* **kvfs**: the KV of the prefix is loaded from a local kvfs store (object API, checksums
  verified), then the model computes only the last token (its logits are needed) and picks
  the first output token; ``load`` is the loading part alone;
* **raw read**: the same page bytes read straight from the store's data files with
  O_DIRECT, in parallel, with no checksum and no tensor assembly: the floor any loader
  on this disk can reach.

``--sharing`` runs the prefix-sharing scenario instead (:mod:`kvfs.bench._sharing`).
The model is a randomly initialised Llama-shaped transformer (no download), by default the
field notes' 8 layers x 1024 hidden x 8 KV heads of 128, fp32 (64 KiB of KV per token).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvfs.bench._common import (
    DirectUse,
    at_least,
    machine,
    new_parser,
    positive_ints,
    progress,
    scratch_base,
)

__all__ = ["register", "run_ttft"]

DEFAULT_TOKENS = "512,1024,2048,4096"


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "ttft",
        help="time to first token: full prefill vs prefix from kvfs",
        doc=__doc__,
        run=_main,
    )
    p.add_argument(
        "--tokens",
        default=DEFAULT_TOKENS,
        help=f"context lengths, comma-separated (default {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--model",
        choices=["field", "small"],
        default="field",
        help="field: 8 layers/1024 hidden/fp32 (64 KiB/token); small: a quick check",
    )
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=3,
        help="prefills, loads and raw reads per length; the best of each is reported (default 3)",
    )
    p.add_argument(
        "--no-archive",
        action="store_true",
        help="skip the column restored from a file:// archive (spill, then load)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="parent directory for the scratch store (default: the system temp dir)",
    )
    p.add_argument(
        "--sharing",
        action="store_true",
        help="run the prefix-sharing scenario instead (many sessions, one system prompt)",
    )
    p.add_argument(
        "--sessions", type=at_least(1), default=8, help="--sharing: sessions (default 8)"
    )
    p.add_argument(
        "--system-tokens",
        type=at_least(1),
        default=1024,
        help="--sharing: common system prompt length (default 1024)",
    )
    p.add_argument(
        "--user-tokens",
        type=at_least(1),
        default=256,
        help="--sharing: each session's own tokens (default 256)",
    )


def _main(args: argparse.Namespace) -> int:
    from cli._util import print_json

    # (before torch loads, seconds: "--tokens abc" was a raw int() error after it, and
    # "--tokens ," an empty table and exit 0)
    lengths = [] if args.sharing else positive_ints(args.tokens, "--tokens")
    base = scratch_base(args.dir, "--dir")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "kvfs bench ttft needs the engines extra: "
            "pip install -e .[engines] (torch==2.13.0 first)"
        ) from e
    scratch = Path(tempfile.mkdtemp(prefix="kvfs-bench-ttft-", dir=base))
    try:
        if args.sharing:
            from ._sharing import print_sharing, run_sharing

            res = run_sharing(
                scratch,
                model=args.model,
                sessions=args.sessions,
                system_tokens=args.system_tokens,
                user_tokens=args.user_tokens,
            )
            print_json(res) if args.json else print_sharing(res)
        else:
            res = run_ttft(
                scratch, lengths, model=args.model, repeat=args.repeat, archive=not args.no_archive
            )
            print_json(res) if args.json else print_ttft(res)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def conditions(scratch: Path, model_desc: str) -> dict[str, Any]:
    import torch

    return machine(
        model=model_desc,
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        store=str(scratch),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


def load_model(which: str) -> tuple[Any, Any]:
    from kvfs.integrations._models import BENCH_MODEL, ModelShape, random_llama

    shape = (
        BENCH_MODEL
        if which == "field"
        else ModelShape(
            layers=4, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=704, vocab=32000
        )
    )
    return shape, random_llama(shape)


def run_ttft(
    scratch: Path,
    lengths: list[int],
    *,
    model: str = "field",
    repeat: int = 3,
    archive: bool = True,
) -> dict[str, Any]:
    """Measure every length in ``lengths``; returns conditions and one row per length.

    With ``archive``, the store has a ``file://`` archive tier in ``scratch``; after the
    local measurements each session is spilled (local copies dropped) and loaded once more,
    which restores it page by page on access.
    """
    import torch

    import kvfs
    from kvfs.integrations import FastPathPages
    from kvfs.integrations._hfcompat import cache_of, forward
    from kvfs.integrations.transformers import TransformersKV

    shape, m = load_model(model)
    cfg = kvfs.StoreConfig(data_dirs=(scratch / "nvme0",))
    if archive:
        cfg = cfg.replace(
            archive_url=f"file://{scratch / 'archive'}", extra={"archive": {"interval": 0}}
        )
    rows = []
    direct = DirectUse()
    with (
        torch.inference_mode(),
        kvfs.open_store_sync(cfg) as store,
        TransformersKV(store, m, model_id=shape.model_id) as kv,
    ):
        fast = FastPathPages(store)
        kv_fast = TransformersKV(fast, m, model_id=shape.model_id)
        g = kv.geometry
        C = g.chunk_tokens
        short = [n for n in lengths if n < C]
        if short:  # no whole page to save, so nothing to load
            raise ValueError(
                f"--tokens {','.join(map(str, short))}: a context length must be at least "
                f"{C} tokens (one KV page holds {C})"
            )
        m(input_ids=torch.randint(0, shape.vocab, (1, 128)))  # warm up kernels and memory
        for i, n in enumerate(lengths):
            progress(
                f"kvfs bench ttft: [{i + 1}/{len(lengths)}] {n} tokens: prefill, save, load..."
            )
            ids = torch.randint(0, shape.vocab, (1, n), generator=torch.Generator().manual_seed(n))
            # The prefill is timed as the loads are, best of --repeat: once, the first
            # length's ran cold (4x slower than the same length later in a run).
            prefills = []
            for _ in range(max(1, repeat)):
                out = None  # (the last run's cache is the one saved)
                t0 = time.perf_counter()
                out = m(input_ids=ids, use_cache=True)
                first = int(out.logits[0, -1].argmax())
                prefills.append(time.perf_counter() - t0)
            prefill = min(prefills)
            session = f"ttft-{n}"
            saved = kv.save(session, ids, cache_of(out))
            del out
            extents = [e for p in store.list(session=session) for e in p.extents]
            raws: list[float] = []
            loads: dict[str, list[float]] = {"kvfs": [], "fast": []}
            ttfts: dict[str, list[float]] = {"kvfs": [], "fast": []}
            same = True
            # what loads: the prefix up to the last token, in the whole pages saved
            want = min(n - 1, n // C * C)
            for _ in range(max(1, repeat)):
                raws.append(raw_read(extents, direct=direct))
                for name, loader in (("kvfs", kv), ("fast", kv_fast)):
                    t0 = time.perf_counter()
                    hit = loader.load(session, ids, max_tokens=n - 1)
                    loaded = time.perf_counter() - t0
                    res = forward(m, ids[:, hit.tokens :], hit.cache)
                    tok = int(res.logits[0, -1].argmax())
                    ttfts[name].append(time.perf_counter() - t0)
                    loads[name].append(loaded)
                    same = same and tok == first and hit.tokens == want
                    del hit, res
            kv_bytes = sum(e.length for e in extents)
            arch: dict[str, Any] = {}
            if archive:
                t0 = time.perf_counter()
                store.spill(session)
                arch["spill_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                hit = kv.load(session, ids, max_tokens=n - 1)
                arch["archive_load_s"] = time.perf_counter() - t0
                res = forward(m, ids[:, hit.tokens :], hit.cache)
                arch["archive_ttft_s"] = time.perf_counter() - t0
                arch["archive_speedup"] = prefill / arch["archive_ttft_s"]
                same = same and int(res.logits[0, -1].argmax()) == first and hit.tokens == want
                del hit, res
            best = {k: min(v) for k, v in loads.items()}
            rows.append(
                {
                    **arch,
                    "tokens": n,
                    "kv_bytes": kv_bytes,
                    "prefill_s": prefill,
                    "kvfs_ttft_s": min(ttfts["kvfs"]),
                    "speedup": prefill / min(ttfts["kvfs"]),
                    "load_s": best["kvfs"],
                    "raw_read_s": min(raws),
                    "load_over_raw": best["kvfs"] / min(raws),
                    "fast_ttft_s": min(ttfts["fast"]),
                    "fast_load_s": best["fast"],
                    "fast_load_over_raw": best["fast"] / min(raws),
                    "load_median_s": statistics.median(loads["kvfs"]),
                    "fast_load_median_s": statistics.median(loads["fast"]),
                    "raw_median_s": statistics.median(raws),
                    "save_s": saved.seconds,
                    "same_first_token": same,
                }
            )
        kv_fast.close()
        fast.close()
    direct.warn(scratch)
    return {
        "benchmark": "ttft",
        "conditions": {**conditions(scratch, g.describe()), "raw_o_direct": direct.o_direct},
        "bytes_per_token": g.bytes_per_token,
        "rows": rows,
    }


def raw_read(extents: list[Any], threads: int = 8, direct: DirectUse | None = None) -> float:
    """Seconds to read ``extents`` with O_DIRECT into aligned buffers, ``threads`` at a time
    (buffered where the file system refuses O_DIRECT: ``direct`` records it)."""
    import numpy as np

    from kvfs._aligned import aligned_buffer, round_up

    direct = direct or DirectUse()

    biggest = round_up(max(e.length for e in extents))
    bufs = [aligned_buffer(biggest) for _ in range(threads)]
    for b in bufs:  # touch the memory first: fresh pages are slow to fault in on these VMs
        np.frombuffer(b, dtype=np.uint8)[::4096] = 1
    fds: dict[str, int] = {}
    for e in extents:
        if e.path not in fds:
            fds[e.path] = direct.open(e.path, os.O_RDONLY)

    def one(i: int) -> int:
        e = extents[i]
        buf = bufs[i % threads]
        return os.preadv(fds[e.path], [buf[: round_up(e.length)]], e.offset)

    try:
        t0 = time.perf_counter()
        # Each worker takes every threads-th extent, so no two share a buffer at once.
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda w: [one(i) for i in range(w, len(extents), threads)], range(threads)
                )
            )
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def print_ttft(res: dict[str, Any]) -> None:
    from cli._util import fmt_bytes, print_table

    c = res["conditions"]
    print(f"model: {c['model']} ({fmt_bytes(res['bytes_per_token'])} of KV per token)")
    print(
        f"machine: {c['cpus']} CPUs, torch {c['torch']} ({c['torch_threads']} threads); "
        f"store: one local directory, object API, checksums verified; raw read: "
        f"{'O_DIRECT' if c.get('raw_o_direct', True) else 'buffered (O_DIRECT refused)'}"
    )
    print_table(
        [
            "tokens",
            "KV bytes",
            "prefill TTFT",
            "kvfs TTFT",
            "speedup",
            "kvfs load",
            "raw read",
            "load/raw",
            "fast path load",
            "/raw",
            "archive TTFT",
            "speedup ",
            "same token",
        ],
        [
            [
                r["tokens"],
                fmt_bytes(r["kv_bytes"]),
                f"{r['prefill_s']:.3f} s",
                f"{r['kvfs_ttft_s']:.3f} s",
                f"{r['speedup']:.1f}x",
                f"{r['load_s']:.3f} s",
                f"{r['raw_read_s']:.3f} s",
                f"{r['load_over_raw']:.2f}x",
                f"{r['fast_load_s']:.3f} s",
                f"{r['fast_load_over_raw']:.2f}x",
                f"{r['archive_ttft_s']:.3f} s" if "archive_ttft_s" in r else "-",
                f"{r['archive_speedup']:.1f}x" if "archive_speedup" in r else "-",
                "yes" if r["same_first_token"] else "NO",
            ]
            for r in res["rows"]
        ],
    )
    print(
        "kvfs TTFT = load the prefix (n-1 tokens, as far as whole pages were saved) through "
        "the object API + compute the rest; same token: the first token as the prefill's, "
        "from that many tokens loaded; fast path load = the same pages read by gds.FastPath (O_DIRECT host "
        "backend); archive TTFT = object API after the session was spilled to a file:// "
        "archive (restored on access)"
    )
