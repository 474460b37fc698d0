"""``kvfs bench control``: the control channel beside the in-process API, in the same run.

One store in a scratch directory (``durable=False`` unless ``--durable``, so the figures are
about the channel rather than fsync), served on a control socket by
:func:`kvfs._control.control_service` in the same trio run. For small pages (``--small``,
default 16 KiB) and large ones (``--large``, default 8 MiB):

* **in-process put/get**: :class:`kvfs.Store` calls from ``--clients`` concurrent tasks;
* **remote put/get**: the same calls through :class:`kvfs._remote.RemoteStore` (msgpack over
  the Unix socket, one connection per in-flight call) from the same number of tasks in the
  same process (the two ends share one trio thread);
* **worker process put/get** (on unless ``--no-worker-process``): a separate Python
  process, as an engine worker would be, making the calls through
  :class:`kvfs._remote.SyncRemoteStore` from ``--clients`` threads.

Small pages are reported in pages/s, large ones in GB/s (10^9 bytes/s); the ratio is
remote / in-process. Every page is distinct (no deduplication) and the bytes read back are
checked after the timed phases. ``--repeat N`` alternates the phases N times: the
throughputs are the best of each, a ratio the median of the rounds' own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import kvfs
from kvfs._control import control_service
from kvfs._remote import RemoteStore
from kvfs.bench._common import at_least, log, machine, need_room, new_parser, progress, scratch_base

__all__ = ["register", "run_control_bench"]


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "control",
        help="control-channel throughput beside the in-process API",
        doc=__doc__,
        run=_main,
    )
    p.add_argument("--small", default="16KiB", help="small page size (16KiB)")
    p.add_argument(
        "--small-pages", type=at_least(1), default=2000, help="small pages per phase (2000)"
    )
    p.add_argument("--large", default="8MiB", help="large page size (8MiB)")
    p.add_argument("--large-pages", type=at_least(1), default=48, help="large pages per phase (48)")
    p.add_argument("--clients", type=at_least(1), default=4, help="concurrent calls (4)")
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=2,
        help="alternate rounds: best throughputs, median ratios (2)",
    )
    p.add_argument("--durable", action="store_true", help="fsync every put (default off)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument(
        "--no-worker-process",
        dest="worker_process",
        action="store_false",
        help="skip the separate worker process phases",
    )


_WORKER = """
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
import kvfs
sock, label, size, count, clients = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
base = os.urandom(size)
payloads = [i.to_bytes(8, "little") + base[8:] for i in range(count)]
keys = [f"sessions/bench-{label}-worker/p/layer-{i:05d}" for i in range(count)]
with kvfs.open_remote_store_sync(sock) as s:
    out = []
    for op in ("put", "get"):
        def one(i):
            if op == "put":
                s.put(keys[i], payloads[i], replace=True)
            else:
                assert s.get(keys[i]) == payloads[i]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(count)))
        out.append(time.perf_counter() - t0)
    s.delete_session(f"bench-{label}-worker")
print(*out)
"""


async def _worker_phase(
    sock: Path, label: str, size: int, count: int, clients: int
) -> tuple[float, float]:
    """(put seconds, get seconds) measured by a separate worker process. The worker checks
    every page it reads inside its get phase (a comparison, cheap beside the transfer).
    Raises RuntimeError when the worker fails."""
    r = await trio.run_process(
        [sys.executable, "-c", _WORKER, str(sock), label, str(size), str(count), str(clients)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"bench worker failed: {r.stderr.decode(errors='replace')[-500:]}")
    put, get = (float(x) for x in r.stdout.split())
    return put, get


async def _phase(api: Any, op: str, keys: list[str], payloads: list[bytes], clients: int) -> float:
    """Seconds for ``op`` ('put' or 'get') of every key by ``clients`` tasks."""
    it = iter(range(len(keys)))

    async def worker() -> None:
        for i in it:
            if op == "put":
                await api.put(keys[i], payloads[i], replace=True)
            else:
                await api.get(keys[i])

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(clients):
            n.start_soon(worker)
    return time.perf_counter() - t0


def _ratios(local: list[float], other: list[float]) -> list[float]:
    """Each round's throughput ratio other / in-process, from the rounds' seconds."""
    return [a / b for a, b in zip(local, other, strict=True)]


def _median_ratio(local: list[float], other: list[float]) -> float:
    return statistics.median(_ratios(local, other))


def _payloads(size: int, count: int) -> list[bytes]:
    """``count`` pages of ``size`` (>= 8) bytes, unlike each other and any other call's."""
    base = os.urandom(size)
    return [i.to_bytes(8, "little") + base[8:] for i in range(count)]


async def run_control_bench(
    root: Path,
    *,
    small: int,
    small_pages: int,
    large: int,
    large_pages: int,
    clients: int,
    repeat: int,
    durable: bool,
    worker_process: bool = True,
) -> list[dict[str, Any]]:
    """Rows of results (see the module doc). Raises AssertionError if bytes read back differ."""
    cfg = kvfs.StoreConfig(data_dirs=(root / "data",), durable=durable, direct_io=False)
    rows: list[dict[str, Any]] = []
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as nursery:
        sock = await nursery.start(control_service, store, root / "bench.sock")
        remote = RemoteStore(sock)
        for label, size, count in (("small", small, small_pages), ("large", large, large_pages)):
            # seconds of each round, per (who, op): the best gives the throughputs, a ratio is
            # the median of the rounds' own (the phases of a round ran back to back)
            times: dict[tuple[str, str], list[float]] = {}
            for r in range(repeat):
                progress(f"kvfs bench control: {label} pages, round {r + 1}/{repeat}: put, get...")
                for who, api in (("in-process", store), ("remote", remote)):
                    # Fresh bytes for every client and round: a put of bytes the store holds
                    # already writes nothing (162 of 216 puts were deduplicated).
                    payloads = _payloads(size, count)
                    keys = [f"sessions/bench-{label}-{who}/p/layer-{i:05d}" for i in range(count)]
                    for op in ("put", "get"):
                        t = await _phase(api, op, keys, payloads, clients)
                        times.setdefault((who, op), []).append(t)
                    for i in (0, count // 2, count - 1):
                        assert await api.get(keys[i]) == payloads[i], (who, keys[i])
                    await store.delete_session(f"bench-{label}-{who}")
                    del payloads
                if worker_process:
                    put, get = await _worker_phase(sock, label, size, count, clients)
                    for op, t in (("put", put), ("get", get)):
                        times.setdefault(("worker", op), []).append(t)
            for op in ("put", "get"):
                local = count / min(times["in-process", op])
                rem = count / min(times["remote", op])
                row = {
                    "pages": label,
                    "size": size,
                    "op": op,
                    "clients": clients,
                    "in_process_pages_s": local,
                    "remote_pages_s": rem,
                    "in_process_gb_s": local * size / 1e9,
                    "remote_gb_s": rem * size / 1e9,
                    "ratio": _median_ratio(times["in-process", op], times["remote", op]),
                    "round_ratios": _ratios(times["in-process", op], times["remote", op]),
                }
                if worker_process:
                    wk = count / min(times["worker", op])
                    row.update(
                        worker_pages_s=wk,
                        worker_gb_s=wk * size / 1e9,
                        worker_ratio=_median_ratio(times["in-process", op], times["worker", op]),
                        worker_round_ratios=_ratios(times["in-process", op], times["worker", op]),
                    )
                rows.append(row)
        await remote.aclose()
        nursery.cancel_scope.cancel()
    return rows


def _main(args: argparse.Namespace) -> int:
    from cli._util import fmt_bytes, print_json, print_table

    small, large = kvfs.parse_size(args.small), kvfs.parse_size(args.large)
    for flag, n in (("--small", small), ("--large", large)):
        if n < 8:  # (pages of 0 or 5 bytes were made of 8, and reported as 0 B or 5 B)
            raise ValueError(f"{flag} {n}: pages need 8 bytes or more (their first 8 differ)")
    base = scratch_base(args.dir, "--dir")
    need_room(base, max(small * args.small_pages, large * args.large_pages), "bench control")
    with tempfile.TemporaryDirectory(dir=base, prefix="kvfs-bench-control-") as d:
        rows = trio.run(
            lambda: run_control_bench(
                Path(d),
                small=small,
                small_pages=args.small_pages,
                large=large,
                large_pages=args.large_pages,
                clients=args.clients,
                repeat=args.repeat,
                durable=args.durable,
                worker_process=args.worker_process,
            )
        )
    where = machine(durable=args.durable)
    if args.json:
        print_json({"machine": where, "results": rows})
        return 0
    log(f"# {where}")

    def fig(r: dict[str, Any], who: str) -> str:
        if r["pages"] == "small":
            return f"{r[f'{who}_pages_s']:,.0f} pages/s"
        return f"{r[f'{who}_gb_s']:.2f} GB/s"

    worker = args.worker_process
    print_table(
        [
            "PAGES",
            "SIZE",
            "OP",
            "IN-PROCESS",
            "REMOTE (SAME PROC)",
            "RATIO",
            *(["WORKER PROCESS", "RATIO"] if worker else []),
        ],
        [
            [
                r["pages"],
                fmt_bytes(r["size"]),
                r["op"],
                fig(r, "in_process"),
                fig(r, "remote"),
                f"{r['ratio']:.2f}x",
                *([fig(r, "worker"), f"{r['worker_ratio']:.2f}x"] if worker else []),
            ]
            for r in rows
        ],
        align="lrlrrrrr",
    )
    return 0
