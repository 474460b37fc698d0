"""``kvfs bench control``: the control channel beside the in-process API, in the same run.

One store in a scratch directory (``durable=False`` unless ``--durable``, so the figures are
about the channel rather than fsync), served on a control socket by
:func:`kvfs._control.control_service` in the same trio run. For small pages (``--small``,
default 16 KiB) and large ones (``--large``, default 8 MiB):

* **in-process put/get**: :class:`kvfs.Store` calls from ``--clients`` concurrent tasks;
* **remote put/get**: the same calls through :class:`kvfs._remote.RemoteStore` (msgpack over
  the Unix socket, one connection per in-flight call) from the same number of tasks.

Small pages are reported in pages/s, large ones in GB/s (10^9 bytes/s); the ratio is
remote / in-process. Every page is distinct (no deduplication) and the bytes read back are
checked after the timed phases. ``--repeat N`` alternates the phases N times and keeps the
best of each.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import kvfs
from kvfs._control import control_service
from kvfs._remote import RemoteStore

__all__ = ["register", "run_control_bench"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control", help="control-channel throughput beside the in-process API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", default="16KiB", help="small page size (16KiB)")
    p.add_argument("--small-pages", type=int, default=2000, help="small pages per phase (2000)")
    p.add_argument("--large", default="8MiB", help="large page size (8MiB)")
    p.add_argument("--large-pages", type=int, default=48, help="large pages per phase (48)")
    p.add_argument("--clients", type=int, default=4, help="concurrent calls (4)")
    p.add_argument("--repeat", type=int, default=2, help="alternate rounds, best kept (2)")
    p.add_argument("--durable", action="store_true", help="fsync every put (default off)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_main)


async def _phase(api: Any, op: str, keys: list[str], payloads: list[bytes],
                 clients: int) -> float:
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


def _payloads(size: int, count: int) -> list[bytes]:
    base = os.urandom(size)
    return [i.to_bytes(8, "little") + base[8:] for i in range(count)]


async def run_control_bench(root: Path, *, small: int, small_pages: int, large: int,
                            large_pages: int, clients: int, repeat: int,
                            durable: bool) -> list[dict[str, Any]]:
    """Rows of results (see the module doc). Raises AssertionError if bytes read back differ."""
    cfg = kvfs.StoreConfig(data_dirs=(root / "data",), durable=durable, direct_io=False)
    rows: list[dict[str, Any]] = []
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as nursery:
        sock = await nursery.start(control_service, store, root / "bench.sock")
        remote = RemoteStore(sock)
        for label, size, count in (("small", small, small_pages), ("large", large, large_pages)):
            payloads = _payloads(size, count)
            best: dict[tuple[str, str], float] = {}
            for r in range(repeat):
                for who, api in (("in-process", store), ("remote", remote)):
                    keys = [f"sessions/bench-{label}-{who}/p/layer-{i:05d}" for i in range(count)]
                    for op in ("put", "get"):
                        t = await _phase(api, op, keys, payloads, clients)
                        best[who, op] = min(best.get((who, op), t), t)
                    if r == repeat - 1:
                        for i in (0, count // 2, count - 1):
                            assert await api.get(keys[i]) == payloads[i], (who, keys[i])
                        await store.delete_session(f"bench-{label}-{who}")
            for op in ("put", "get"):
                local, rem = count / best["in-process", op], count / best["remote", op]
                rows.append({"pages": label, "size": size, "op": op, "clients": clients,
                             "in_process_pages_s": local, "remote_pages_s": rem,
                             "in_process_gb_s": local * size / 1e9, "remote_gb_s": rem * size / 1e9,
                             "ratio": rem / local})
        await remote.aclose()
        nursery.cancel_scope.cancel()
    return rows


def _main(args: argparse.Namespace) -> int:
    from cli._util import print_json, print_table

    small, large = kvfs.parse_size(args.small), kvfs.parse_size(args.large)
    if min(args.small_pages, args.large_pages, args.clients, args.repeat) < 1:
        raise ValueError("--small-pages, --large-pages, --clients and --repeat must be >= 1")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvfs-bench-control-") as d:
        rows = trio.run(lambda: run_control_bench(
            Path(d), small=small, small_pages=args.small_pages, large=large,
            large_pages=args.large_pages, clients=args.clients, repeat=args.repeat,
            durable=args.durable))
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
               "kernel": platform.release(), "durable": args.durable}
    if args.json:
        print_json({"machine": machine, "results": rows})
        return 0
    print(f"# {machine}", file=sys.stderr)

    def fig(r: dict[str, Any], who: str) -> str:
        if r["pages"] == "small":
            return f"{r[f'{who}_pages_s']:,.0f} pages/s"
        return f"{r[f'{who}_gb_s']:.2f} GB/s"
    print_table(["PAGES", "SIZE", "OP", "IN-PROCESS", "REMOTE", "RATIO"],
                [[r["pages"], f"{r['size'] // 1024} KiB", r["op"],
                  fig(r, "in_process"), fig(r, "remote"), f"{r['ratio']:.2f}x"] for r in rows],
                align="lrlrrr")
    return 0
