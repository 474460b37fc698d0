"""``kvfs bench store``: page put/get throughput beside raw O_DIRECT, in the same run.

For every page size and client count, on the same directories and with the same bytes:

* **raw put**: each client writes whole pages to new files with ``O_DIRECT`` (one
  ``pwrite`` of the page from a 4 KiB-aligned buffer) and ``fsync``s each file, the same
  durability a put gives; files go round-robin over the data directories;
* **kvfs put**: each client calls ``SyncStore.put`` (checksums, striping, fsync, index
  commit) from the same buffers; every page is distinct (a counter is stamped into it), so
  nothing is deduplicated;
* **raw get**: each client reads the raw files back with ``O_DIRECT`` into an aligned buffer;
* **kvfs get**: each client calls ``SyncStore.get(key, into=aligned buffer)`` (O_DIRECT,
  every leaf verified).

Throughput is bytes moved / wall time for all clients together; the ratio is kvfs / raw.
With ``--repeat N`` the phases alternate N times: throughputs are the best of each, the
ratio is the median of the per-round ratios (raw and kvfs of a round run back to back).
``--index N`` measures the SQLite index instead (see :mod:`kvfs.bench._index_bench`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kvfs
from kvfs._aligned import aligned_buffer
from kvfs.bench._common import (
    DirectUse,
    add_sweep,
    at_least,
    machine,
    need_room,
    new_parser,
    positive_ints,
    progress,
    scratch_base,
)

__all__ = ["register", "run_store_bench"]

MiB = 1 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "store",
        help="page put/get throughput vs raw O_DIRECT in the same run",
        doc=__doc__,
        run=_main,
    )
    add_sweep(
        p,
        sizes="1,4,16,64",
        clients="1,4",
        total=256,
        total_help="MiB written per size and client count",
    )
    p.add_argument(
        "--data",
        default=None,
        help="comma-separated data directories, one per device (default: one "
        "scratch directory under the system temp dir)",
    )
    p.add_argument(
        "--stripe-unit", type=at_least(1), default=4, help="stripe unit in MiB (default 4)"
    )
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=1,
        help="alternate raw and kvfs phases N times, report the best (default 1)",
    )
    p.add_argument(
        "--no-durable",
        action="store_true",
        help="kvfs without fsync and with SQLite synchronous=NORMAL (raw still fsyncs)",
    )
    p.add_argument(
        "--index",
        type=at_least(0),
        default=0,
        metavar="N",
        help="measure the SQLite index with N pages instead (commits/s, lookups/s, restart time)",
    )


def _stamp(buf: memoryview, n: int) -> None:
    """Make the page distinct: a counter in the first and last 8 bytes."""
    b = n.to_bytes(8, "little")
    buf[:8] = b
    buf[len(buf) - 8 :] = b


def _timed(clients: int, work: Callable[[int], int]) -> float:
    """Run ``work(client)`` on ``clients`` threads; returns seconds for all of them."""
    with ThreadPoolExecutor(clients) as ex:
        t0 = time.perf_counter()
        total = sum(ex.map(work, range(clients)))
        dt = time.perf_counter() - t0
    assert total >= 0
    return dt


def _raw_write(path: str, buf: memoryview, direct: DirectUse) -> None:
    fd = direct.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        done = 0
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path: str, buf: memoryview, direct: DirectUse) -> None:
    fd = direct.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], done)
            if n == 0:
                raise OSError(f"{path} is short")
            done += n
    finally:
        os.close(fd)


def _cell(
    dirs: list[Path],
    size: int,
    clients: int,
    total: int,
    stripe: int,
    repeat: int,
    durable: bool,
    direct: DirectUse,
) -> dict[str, Any]:
    per_client = max(1, total // (size * clients))
    pages = per_client * clients
    moved = pages * size
    bufs = [aligned_buffer(size) for _ in range(clients)]
    for b in bufs:
        b[:] = os.urandom(min(size, 1 << 16)) * (size // min(size, 1 << 16))
    raw_dirs = [d / "raw" for d in dirs]
    store_dirs = tuple(d / "store" for d in dirs)
    best = {"raw_put": 0.0, "kvfs_put": 0.0, "raw_get": 0.0, "kvfs_get": 0.0}
    ratios: dict[str, list[float]] = {"put": [], "get": []}

    def gbps(dt: float) -> float:
        return moved / dt / 1e9

    for rnd in range(repeat):
        for d in raw_dirs:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        for d in store_dirs:
            shutil.rmtree(d, ignore_errors=True)
        cfg = kvfs.StoreConfig(data_dirs=store_dirs, stripe_unit=stripe, durable=durable)

        def raw_put(c: int) -> int:
            for i in range(per_client):
                j = c * per_client + i
                _stamp(bufs[c], j + 1)
                _raw_write(str(raw_dirs[j % len(raw_dirs)] / f"p{j}"), bufs[c], direct)
            return per_client

        def raw_get(c: int) -> int:
            for i in range(per_client):
                j = c * per_client + i
                _raw_read(str(raw_dirs[j % len(raw_dirs)] / f"p{j}"), bufs[c], direct)
            return per_client

        rp = gbps(_timed(clients, raw_put))
        with kvfs.open_store_sync(cfg) as store:

            def kv_put(c: int, base: int = (1 << 40) + rnd * pages) -> int:
                for i in range(per_client):
                    _stamp(bufs[c], base + c * per_client + i)
                    store.put(f"bench/c{c}/p{i}", bufs[c])
                return per_client

            def kv_get(c: int) -> int:
                for i in range(per_client):
                    store.get(f"bench/c{c}/p{i}", into=bufs[c])
                return per_client

            kp = gbps(_timed(clients, kv_put))
            rg = gbps(_timed(clients, raw_get))
            kg = gbps(_timed(clients, kv_get))
            st = store.statistics()
            if st.dedup_puts:
                raise RuntimeError("benchmark pages were deduplicated: the figures would lie")
        for k, v in (("raw_put", rp), ("kvfs_put", kp), ("raw_get", rg), ("kvfs_get", kg)):
            best[k] = max(best[k], v)
        ratios["put"].append(kp / rp)
        ratios["get"].append(kg / rg)
        progress(
            f"  {size // MiB:>3} MiB x {clients} clients, round {rnd + 1}/{repeat}: "
            f"put {kp:.2f}/{rp:.2f} GB/s, get {kg:.2f}/{rg:.2f} GB/s (kvfs/raw)"
        )
    for d in [*raw_dirs, *store_dirs]:
        shutil.rmtree(d, ignore_errors=True)
    # The ratio is the median of the rounds' ratios: raw and kvfs of one round ran back to
    # back, so a noisy neighbour shifts both; best-of throughputs come from different rounds.
    return {
        "size_mib": size // MiB,
        "clients": clients,
        "pages": pages,
        "bytes": moved,
        **best,
        "put_ratio": statistics.median(ratios["put"]),
        "get_ratio": statistics.median(ratios["get"]),
        "round_ratios": ratios,
    }


def run_store_bench(
    dirs: list[Path],
    sizes_mib: list[int],
    clients: list[int],
    total_mib: int,
    *,
    stripe_mib: int = 4,
    repeat: int = 1,
    durable: bool = True,
) -> dict[str, Any]:
    """Run every (size, clients) cell; returns the figures (GB/s = 1e9 bytes/s)."""
    rows = []
    direct = DirectUse()
    for size in sizes_mib:
        for c in clients:
            rows.append(
                _cell(
                    dirs,
                    size * MiB,
                    c,
                    total_mib * MiB,
                    stripe_mib * MiB,
                    max(1, repeat),
                    durable,
                    direct,
                )
            )
    direct.warn(", ".join(map(str, dirs)))
    return {
        "machine": machine(),
        "data_dirs": [str(d) for d in dirs],
        "stripe_unit_mib": stripe_mib,
        "durable": durable,
        "raw_o_direct": direct.o_direct,
        "total_mib": total_mib,
        "repeat": repeat,
        "rows": rows,
    }


def print_store_bench(res: dict[str, Any]) -> None:
    from cli._util import print_table

    print(
        f"kvfs bench store: {len(res['data_dirs'])} data dir(s), stripe unit "
        f"{res['stripe_unit_mib']} MiB, durable={res['durable']}, raw "
        f"{'O_DIRECT' if res['raw_o_direct'] else 'buffered (O_DIRECT refused)'}; GB/s (1e9 B/s), best of "
        f"{res['repeat']} rounds; ratio: median of the rounds' kvfs/raw"
    )
    print_table(
        [
            "page MiB",
            "clients",
            "raw put",
            "kvfs put",
            "put ratio",
            "raw get",
            "kvfs get",
            "get ratio",
        ],
        [
            (
                r["size_mib"],
                r["clients"],
                f"{r['raw_put']:.2f}",
                f"{r['kvfs_put']:.2f}",
                f"{r['put_ratio']:.2f}x",
                f"{r['raw_get']:.2f}",
                f"{r['kvfs_get']:.2f}",
                f"{r['get_ratio']:.2f}x",
            )
            for r in res["rows"]
        ],
    )


def _need_room(bases: list[Path], sizes: list[int], clients: list[int], total: int) -> None:
    """Refuse a sweep whose largest cell does not fit: its raw files and its kvfs pages are
    on disk together, spread evenly over the data directories (those on one file system
    add up). An 8 MiB file system failed with "no page 'bench/c0/p0'" (exit 3): the
    store's capacity eviction had deleted the benchmark's own pages."""
    cell = max(max(1, total // (s * c)) * c * s for s in sizes for c in clients) * MiB
    by_fs: dict[int, list[Path]] = {}
    for d in bases:
        by_fs.setdefault(os.stat(d).st_dev, []).append(d)
    for same in by_fs.values():
        need_room(same[0], 2 * cell * len(same) // len(bases), "bench store", "--data")


def _main(args: argparse.Namespace) -> int:
    from cli._util import print_json

    sizes = positive_ints(args.sizes, "--sizes")
    clients = positive_ints(args.clients, "--clients")
    if args.total < 1:
        raise ValueError("--total must be positive")
    bases = [scratch_base(d.strip(), "--data") for d in (args.data or "").split(",") if d.strip()]
    if not args.index:
        _need_room(bases or [scratch_base(None, "--data")], sizes, clients, args.total)
    # A fresh directory in each: a "kvfs-bench-store" of the user's there was deleted
    dirs: list[Path] = []
    try:
        for base in bases or [scratch_base(None, "--data")]:
            dirs.append(Path(tempfile.mkdtemp(prefix="kvfs-bench-store-", dir=base)))
        if args.index:
            from ._index_bench import print_index_bench, run_index_bench

            res = run_index_bench(dirs[0], args.index, progress=progress)
            print_json(res) if args.json else print_index_bench(res)
            return 0
        res = run_store_bench(
            dirs,
            sizes,
            clients,
            args.total,
            stripe_mib=args.stripe_unit,
            repeat=args.repeat,
            durable=not args.no_durable,
        )
        print_json(res) if args.json else print_store_bench(res)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return 0
