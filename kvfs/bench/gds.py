"""``kvfs bench gds``: fast-path read throughput beside raw O_DIRECT reads of the same files.

For each page size, a session's layer pages are written to a fresh striped store, then read
in the same run, interleaved round by round so drift hits every method alike:

* ``raw``: O_DIRECT ``preadv`` of exactly the page's extents with the same thread count,
  into aligned memory: no index, no lease, no checksum (the ceiling for the host path);
* ``fastpath``: :meth:`gds.FastPath.read_many` into aligned host memory, leases held and
  every byte checked against its BLAKE3 leaves (``fastpath-noverify``: checks off);
* ``store.get``: the object API's ``get(into=)``, one page at a time (the path the fast
  path improves on);
* ``mount`` (with ``--mount``): 1 MiB O_DIRECT reads of the same pages through a kvfs FUSE
  mount of the scratch store, served in this process;
* on a GPU: ``kvikio`` and ``staged`` into cupy arrays, and ``h2d``, a pinned host to device
  copy of the same bytes (the ceiling for anything that crosses PCIe through the host).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import kvfs
from kvfs._aligned import open_direct
from kvfs.bench._common import (
    DirectUse,
    at_least,
    machine,
    need_room,
    new_parser,
    positive_ints,
    progress,
    scratch_base,
)

MiB = 1 << 20


def layers_for(size_mib: int, layers: int) -> int:
    """Layer pages for one page size: ``layers`` when given, else 4 to 32 (~256 MiB)."""
    return layers if layers > 0 else max(4, min(32, 256 // max(1, size_mib)))


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "gds",
        help="fast-path reads vs raw O_DIRECT reads of the same files",
        doc=__doc__,
        run=run,
    )
    p.add_argument("--sizes", default="1,16,128,512", help="page sizes in MiB (comma list)")
    p.add_argument(
        "--layers",
        type=at_least(0),
        default=0,
        help="layer pages per size (a session); default: 32 for small pages, fewer for "
        "large ones (about 256 MiB a size, at least 4), so a small size is not timed on a "
        "few milliseconds of I/O",
    )
    p.add_argument("--ndev", type=at_least(1), default=2, help="device directories to stripe over")
    p.add_argument("--stripe-unit", default="4MiB", help="stripe unit (default 4MiB)")
    p.add_argument(
        "--threads", type=at_least(1), default=8, help="reader threads (raw and fast path)"
    )
    p.add_argument(
        "--rounds", type=at_least(1), default=3, help="timed rounds; the median is shown"
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where the scratch store goes (default: the "
        "system's temporary directory); put it on the NVMe to measure",
    )
    p.add_argument(
        "--mount",
        action="store_true",
        help="also mount the scratch store with "
        "FUSE and read the same pages through the mount (O_DIRECT, 1 MiB reads)",
    )
    p.add_argument(
        "--gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="GPU rows (kvikio, staged, h2d): auto = when cupy sees a GPU",
    )


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _raw_reader(
    pool: ThreadPoolExecutor,
    plans: list[list[tuple[str, int, int, int]]],
    dests: list[np.ndarray],
    direct: DirectUse,
) -> Callable[[], None]:
    """O_DIRECT reads of each page's extents into its buffer: one task per piece (buffered
    where the file system refuses O_DIRECT: ``direct`` records it)."""

    def piece(path: str, foff: int, doff: int, n: int, dest: memoryview) -> None:
        fd = direct.open(path, os.O_RDONLY)
        try:
            span = -(-n // 4096) * 4096
            view = dest[doff : doff + span]
            done = 0
            while done < n:
                got = os.preadv(fd, [view[done:]], foff + done)
                if got == 0:
                    break
                done += got
        finally:
            os.close(fd)

    def run() -> None:
        futs = [
            pool.submit(piece, path, foff, doff, n, d.data)
            for plan, d in zip(plans, dests, strict=True)
            for path, foff, doff, n in plan
        ]
        for f in futs:
            f.result()

    return run


def _plan(info: kvfs.PageInfo, max_piece: int) -> list[tuple[str, int, int, int]]:
    out, pos = [], 0
    for e in info.extents:
        for o in range(0, e.length, max_piece):
            out.append((e.path, e.offset + o, pos + o, min(max_piece, e.length - o)))
        pos += e.length
    return out


def _gpu(mode: str) -> Any:
    if mode == "off":
        return None
    import gds

    st = gds.gpu_status()
    if st["cupy"] is not None:
        if mode == "on":
            raise RuntimeError(st["cupy"])
        return None
    import cupy

    return cupy


def run(args: argparse.Namespace) -> int:
    import gds
    from cli._util import print_json, print_table

    sizes = positive_ints(args.sizes, "--sizes")
    base = scratch_base(args.dir, "--dir")
    need_room(base, max(n * MiB * layers_for(n, args.layers) for n in sizes), "bench gds")
    cp = _gpu(args.gpu)
    rows: list[dict[str, Any]] = []
    direct = DirectUse()
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-gds-", dir=base) as tmp:
        cfg = kvfs.StoreConfig(
            data_dirs=tuple(Path(tmp) / f"nvme{i}" for i in range(args.ndev)),
            stripe_unit=kvfs.parse_size(args.stripe_unit),
        )
        mp = Path(tmp) / "mnt" if args.mount else None
        with _open(cfg, mp) as store, gds.FastPath(store, threads=args.threads) as fp:
            pool = ThreadPoolExecutor(args.threads)
            for i, size_mib in enumerate(sizes):
                progress(
                    f"kvfs bench gds: [{i + 1}/{len(sizes)}] {size_mib} MiB pages x "
                    f"{layers_for(size_mib, args.layers)} layers..."
                )
                rows += _bench_size(store, fp, pool, cp, size_mib, args, mp, direct)
                store.delete_session("bench")
            pool.shutdown()
    conditions = machine(
        ndev=args.ndev,
        stripe_unit=args.stripe_unit,
        threads=args.threads,
        layers=args.layers or "auto",
        rounds=args.rounds,
        gpu=cp is not None,
        dir=str(base),
        raw_o_direct=direct.o_direct,
    )
    direct.warn(base)
    if args.json:
        print_json({"conditions": conditions, "results": rows})
        return 0
    how = "O_DIRECT" if direct.o_direct else "buffered (O_DIRECT refused)"
    print(f"kvfs bench gds: {conditions}; raw reads {how}")
    print_table(
        ["page", "layers", "method", "GB/s", "vs raw"],
        [
            [
                f"{r['size_mib']} MiB",
                r["layers"],
                r["method"],
                f"{r['gbps']:.2f}",
                f"{r['vs_raw']:.2f}x" if r["vs_raw"] is not None else "-",
            ]
            for r in rows
        ],
    )
    return 0


def _bench_size(
    store: kvfs.SyncStore,
    fp: Any,
    pool: ThreadPoolExecutor,
    cp: Any,
    size_mib: int,
    args: argparse.Namespace,
    mp: Path | None,
    direct: DirectUse,
) -> list[dict[str, Any]]:
    n = size_mib * MiB
    layers = layers_for(size_mib, args.layers)
    keys = [kvfs.PageKey.semantic("bench", f"s{size_mib}", i) for i in range(layers)]
    data = np.random.default_rng(size_mib).integers(0, 256, size=n, dtype=np.uint8)
    for i, k in enumerate(keys):
        data[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)  # distinct: no dedup
        store.put(k, data)
    infos = [store.stat(k) for k in keys]
    dests = [np.frombuffer(kvfs.aligned_buffer(n), np.uint8) for _ in keys]
    for d in dests:
        d.fill(1)  # first touch of fresh memory is slow here: keep it out of the timings
    plans = [_plan(i, fp.max_piece) for i in infos]
    methods: dict[str, Callable[[], None]] = {
        "raw": _raw_reader(pool, plans, dests, direct),
        "fastpath": lambda: _all(fp.read_many(keys, dests)),
        "fastpath-noverify": lambda: _all(fp.read_many(keys, dests, verify=False)),
        "store.get": lambda: _each(store.get, keys, dests),
    }
    if mp is not None:
        methods["mount"] = _mount_reader(mp, infos, dests)
    if cp is not None:
        methods.update(_gpu_methods(cp, fp, keys, n, dests))
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m, fn in methods.items():
            times[m].append(_timed(fn))
    _verify_bytes(fp, keys, dests, data)
    total = n * len(keys)
    raw = statistics.median(times["raw"])
    return [
        {
            "size_mib": size_mib,
            "layers": len(keys),
            "method": m,
            "seconds": statistics.median(t),
            "gbps": total / statistics.median(t) / 1e9,
            "vs_raw": (raw / statistics.median(t)) if not m.startswith("h2d") else None,
            "all_seconds": t,
        }
        for m, t in times.items()
    ]


def _all(futs: list[Any]) -> None:
    for f in futs:
        f.result()


def _each(get: Callable[..., Any], keys: list[Any], dests: list[Any]) -> None:
    for k, d in zip(keys, dests, strict=True):
        get(k, into=d)


def _verify_bytes(fp: Any, keys: list[Any], dests: list[np.ndarray], data: np.ndarray) -> None:
    """Read once more through the fast path and compare with what was written: a benchmark
    of wrong bytes is worthless."""
    for d in dests:
        d.fill(0)
    _all(fp.read_many(keys, dests))
    for i, d in enumerate(dests):
        if d[:8].tobytes() != i.to_bytes(8, "little") or not np.array_equal(d[8:], data[8:]):
            raise AssertionError(f"layer {i}: the fast path read wrong bytes")


def _mount_reader(
    mount: Path, infos: list[kvfs.PageInfo], dests: list[np.ndarray]
) -> Callable[[], None]:
    def run() -> None:
        for info, d in zip(infos, dests, strict=True):
            view = d.data
            fd, _ = open_direct(mount / info.path, os.O_RDONLY)
            try:
                done = 0
                while done < info.size:
                    got = os.preadv(fd, [view[done : done + MiB]], done)
                    if not got:
                        raise OSError(f"{info.path}: short read through the mount")
                    done += got
            finally:
                os.close(fd)

    return run


@contextmanager
def _open(cfg: kvfs.StoreConfig, mp: Path | None) -> Iterator[kvfs.SyncStore]:
    """The scratch store; with ``mp``, also FUSE-mounted there by a trio loop in a thread
    (one process owns a store, so the benchmark and the mount share its engine)."""
    if mp is None:
        with kvfs.open_store_sync(cfg) as s:
            yield s
        return
    import threading

    import trio

    from kvfs._mount import MountOptions, serve_mount

    mp.mkdir()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with kvfs.open_store(cfg) as store, trio.open_nursery() as nursery:
            box["engine"], box["token"] = store.engine, trio.lowlevel.current_trio_token()
            box["scope"] = nursery.cancel_scope
            await nursery.start(serve_mount, store, mp, MountOptions())
            ready.set()

    def serve() -> None:
        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 - handed to the benchmark thread
            box["error"] = e
            ready.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    if not ready.wait(60) or "error" in box:
        raise RuntimeError(f"mounting the scratch store failed: {box.get('error')!r}")
    try:
        yield kvfs.SyncStore(box["engine"])
    finally:
        trio.from_thread.run_sync(box["scope"].cancel, trio_token=box["token"])
        t.join(60)


def _gpu_methods(
    cp: Any, fp: Any, keys: list[Any], n: int, host: list[np.ndarray]
) -> dict[str, Callable[[], None]]:
    import cupyx

    dev = [cp.empty((n,), dtype=cp.uint8) for _ in keys]
    pinned = cupyx.empty_pinned((n,), dtype=np.uint8)
    pinned[:] = host[0]

    def h2d() -> None:
        for d in dev:
            d.set(pinned)
        cp.cuda.Device().synchronize()

    out: dict[str, Callable[[], None]] = {"h2d-pinned": h2d}
    for b in ("kvikio", "staged"):
        try:
            fp.backend_for(dev[0], b)
        except Exception:  # noqa: BLE001 - a backend that cannot run here is left out
            continue
        out[b] = _gpu_reader(fp, keys, dev, b, True)
        out[f"{b}-noverify"] = _gpu_reader(fp, keys, dev, b, False)
    return out


def _gpu_reader(
    fp: Any, keys: list[Any], dev: list[Any], backend: str, verify: bool
) -> Callable[[], None]:
    def run() -> None:
        _all(fp.read_many(keys, dev, backend=backend, verify=verify))
        for d in dev[:1]:
            d.device.synchronize()

    return run


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfs.bench.gds [flags]``: the same benchmark without the rest of the CLI
    (for a GPU machine that lacks the CLI's other dependencies)."""
    parser = argparse.ArgumentParser(prog="python -m kvfs.bench.gds")
    register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["gds", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
