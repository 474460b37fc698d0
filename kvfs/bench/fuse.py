"""``kvfs bench fuse``: sequential page I/O through the mount beside the same I/O without it.

One run, one scratch directory on one file system, for every page size and client count:

* **write**: each client writes its pages (each distinct, so nothing is deduplicated) with
  1 MiB ``write`` calls and closes them:
  through the mount (a close commits the page: checksums, fsync, index commit), into a
  plain directory on the same file system, once without and once with ``fsync`` before close,
  and through a do-nothing pyfuse3 file system (``kvfs/bench/_nullfs.py``: it answers every
  write and keeps nothing), the most any pyfuse3 mount can write on this machine;
* **cold read**: page cache dropped first (``/proc/sys/vm/drop_caches`` as root, else
  ``posix_fadvise(DONTNEED)`` on every file); each client reads its pages with 1 MiB
  ``readinto`` calls: through the mount, from the mount's backing files directly (the
  extents ``user.kvfs.extents`` names, the same bytes), and from the plain directory;
* **warm read**: the same reads again with the caches left full.

Throughput is bytes / wall time for all clients together. Ratios: cold mount / cold backing
files, warm mount / warm plain files, write mount / plain write (and / plain write+fsync,
/ the null pyfuse3 file system).
With ``--repeat N`` each cell is measured N times over (fresh pages each round): every
throughput and ratio shown is the median of the rounds, and ``--json`` has each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from kvfs.bench._common import (
    WITH_PARENT,
    add_sweep,
    at_least,
    machine,
    need_room,
    new_parser,
    positive_ints,
    progress,
    scratch_base,
)
from kvfs.bench._nullfs import null_mount

__all__ = ["register", "run_fuse_bench"]

MiB = 1 << 20
IO = MiB


def register(sub: argparse._SubParsersAction) -> None:
    p = new_parser(
        sub,
        "fuse",
        help="reads and writes through the mount vs backing files and plain files, in the same run",
        doc=__doc__,
        run=_main,
    )
    add_sweep(
        p,
        sizes="16,64,256",
        clients="1,4",
        total=512,
        total_help="MiB per size and client count; at least one page per client",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="scratch directory (default: under the system "
        "temp dir); it must be on a disk file system, not tmpfs",
    )
    p.add_argument("--direct-io", action="store_true", help="mount with --direct-io")
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=1,
        help="measure each cell N times; show the medians (default 1)",
    )


#: ``python -c`` code that runs the ``kvfs`` command (``python -m cli``) with its arguments.
_CLI = "import runpy\nrunpy.run_module('cli', run_name='__main__', alter_sys=True)\n"


@contextlib.contextmanager
def _mounted(root: Path, direct_io: bool) -> Iterator[Path]:
    """A ``kvfs mount`` daemon serving a store in ``root`` on ``root/mnt`` for the block;
    stopped (and the mount gone) after it, however the block ends, and when the benchmark
    is killed (it gets SIGTERM then, see WITH_PARENT: a killed benchmark left it serving
    its mount). Raises RuntimeError if it does not mount."""
    from kvfs._daemon import READY_FD_ENV

    mp, data = root / "mnt", root / "data"
    mp.mkdir()
    r, w = os.pipe()
    cmd = [sys.executable, "-c", WITH_PARENT + _CLI]
    cmd += ["mount", "--foreground", "--data", str(data), str(mp)]
    if direct_io:
        cmd.insert(-1, "--direct-io")
    with open(root / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=log,
            pass_fds=(w,),
            env={**os.environ, READY_FD_ENV: str(w)},
        )
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:  # (in the try: a Ctrl-C while it mounts stops it too)
            msg = f.read().decode().strip()
        if msg != "ok":
            raise RuntimeError(f"mount failed: {msg or (root / 'daemon.log').read_text()}")
        yield mp
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        finally:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def _drop_caches(files: list[str]) -> str:
    """Empty the page cache: the whole machine's as root, else ``files``' own."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        return _fadvise_dontneed(files)


def _fadvise_dontneed(files: list[str]) -> str:
    """Drop the cached pages of ``files`` only (after a sync, so none are dirty)."""
    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def _parallel(jobs: list[Callable[[], int]]) -> float:
    """Run the jobs at once; return bytes per second over the wall time of all of them."""
    with ThreadPoolExecutor(len(jobs)) as ex:
        t0 = time.perf_counter()
        n = sum(f.result() for f in [ex.submit(j) for j in jobs])
        return n / (time.perf_counter() - t0)


def _write_files(paths: list[Path], size: int, src: memoryview, fsync: bool) -> int:
    """Write each page with 1 MiB calls; a page's number is stamped into its first bytes so
    no two pages are equal (the store would deduplicate them)."""
    for p in paths:
        head = bytearray(src[:IO])
        head[: len(p.name)] = p.name.encode()
        with open(p, "wb", buffering=0) as f:
            f.write(head)
            for off in range(IO, size, IO):
                f.write(src[off : off + IO])
            if fsync:
                os.fsync(f.fileno())
    return size * len(paths)


def _read_files(paths: list[Path]) -> int:
    buf = bytearray(IO)
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def _read_extents(extents: list[list[tuple[str, int, int]]]) -> int:
    """Read pages from their backing files (buffered, 1 MiB preads): the no-FUSE baseline."""
    buf = bytearray(IO)
    view = memoryview(buf)
    n = 0
    for page in extents:
        for path, off, length in page:
            fd = os.open(path, os.O_RDONLY)
            try:
                end = off + length
                while off < end:
                    k = os.preadv(fd, [view[: min(IO, end - off)]], off)
                    if k <= 0:
                        break
                    n, off = n + k, off + k
            finally:
                os.close(fd)
    return n


def _extents(page: Path) -> list[tuple[str, int, int]]:
    from gds._source import decode_extents

    files, runs = decode_extents(os.getxattr(page, "user.kvfs.extents"))
    return [(files[f], off, n) for f, off, n in runs]


def _split(items: list[Any], clients: int) -> list[list[Any]]:
    return [items[c::clients] for c in range(clients)]


def run_fuse_bench(
    sizes: list[int],
    clients: list[int],
    total_mib: int,
    root: Path,
    direct_io: bool = False,
    repeat: int = 1,
) -> dict[str, Any]:
    import numpy as np

    plain = root / "plain"
    plain.mkdir()
    rows: list[dict[str, Any]] = []
    method = ""
    (root / "null").mkdir()
    with _mounted(root, direct_io) as mp, null_mount(root / "null") as null:
        for size_mib in sizes:
            size = size_mib * MiB
            src = memoryview(
                np.random.default_rng(size_mib).integers(0, 256, size, dtype=np.uint8).tobytes()
            )
            for c in clients:
                per = max(1, total_mib // (size_mib * c))
                rounds: list[dict[str, Any]] = []
                for rnd in range(max(1, repeat)):
                    names = [f"page-{size_mib}-{c}-{rnd}-{i}" for i in range(per * c)]
                    progress(
                        f"fuse bench: {size_mib} MiB pages, {c} clients, {len(names)} pages"
                        + (f", round {rnd + 1}/{repeat}" if repeat > 1 else "")
                    )
                    cell, method = _cell(mp, plain, null, names, size, src, c)
                    rounds.append(cell)
                r = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
                r.update(size_mib=size_mib, clients=c, pages=per * c)
                if repeat > 1:
                    r["rounds"] = rounds
                rows.append(r)
    return {
        "machine": machine(),
        "direct_io": direct_io,
        "cache_drop": method,
        "io_size": IO,
        "repeat": max(1, repeat),
        "results": rows,
    }


def _cell(
    mp: Path, plain: Path, null: Path, names: list[str], size: int, src: memoryview, c: int
) -> tuple[dict[str, float], str]:
    """One round of one cell: the writes, the cold and the warm reads (``*_gbps``: GB/s),
    and the ratios (the pages are removed afterwards); and how the page cache was emptied."""
    mine = [mp / "bench" / n for n in names]
    theirs = [plain / n for n in names]
    nothing = [null / n for n in names]
    (mp / "bench").mkdir(exist_ok=True)
    r: dict[str, float] = {}
    method = ""

    def write(paths: list[Path], fsync: bool = False) -> float:
        """One write phase: the ``c`` clients write their shares of ``paths`` at once (bytes/s).
        The four phases differ only in where they write and whether they fsync."""
        return _parallel([partial(_write_files, ps, size, src, fsync) for ps in _split(paths, c)])

    r["write_plain"] = write(theirs)
    for p in theirs:
        p.unlink()
    r["write_plain_fsync"] = write(theirs, fsync=True)
    r["write_null"] = write(nothing)
    for p in nothing:
        p.unlink()
    r["write_mount"] = write(mine)
    extents = [_extents(p) for p in mine]
    backing = sorted({e[0] for page in extents for e in page})
    all_files = [str(p) for p in theirs] + backing
    for label, fn, group in (
        ("plain", _read_files, theirs),
        ("backing", _read_extents, extents),
        ("mount", _read_files, mine),
    ):
        method = _drop_caches(all_files + [str(p) for p in mine])
        r[f"cold_{label}"] = _parallel([partial(fn, g) for g in _split(group, c)])
    for label, fn, group in (
        ("plain", _read_files, theirs),
        ("mount", _read_files, mine),
    ):
        fn(group)  # fill the caches
        r[f"warm_{label}"] = _parallel([partial(fn, g) for g in _split(group, c)])
    for p in mine + theirs:
        p.unlink()
    # GB/s (1e9 bytes/s) as in the table and the other benchmarks, and the keys say so: the
    # JSON had bytes/s under the names of the table's GB/s columns
    out = {f"{k}_gbps": v / 1e9 for k, v in r.items()}
    out["ratio_cold_vs_backing"] = r["cold_mount"] / r["cold_backing"]
    out["ratio_warm_vs_plain"] = r["warm_mount"] / r["warm_plain"]
    out["ratio_write_vs_plain"] = r["write_mount"] / r["write_plain"]
    out["ratio_write_vs_plain_fsync"] = r["write_mount"] / r["write_plain_fsync"]
    out["ratio_write_vs_null"] = r["write_mount"] / r["write_null"]
    return out, method


def _main(args: argparse.Namespace) -> int:
    sizes = positive_ints(args.sizes, "--sizes")
    clients = positive_ints(args.clients, "--clients")
    base = scratch_base(args.dir, "--dir")
    from kvfs._mountinfo import fs_type

    if fs_type(base) in ("tmpfs", "ramfs"):  # (no cold read there: memory is the disk)
        raise ValueError(
            f"{base} is on {fs_type(base)}: the reads it compares need a disk file system "
            "(give one with --dir)"
        )
    # the largest cell's plain files and its pages in the mount's store are there together
    cell = max(max(1, args.total // (s * c)) * c * s for s in sizes for c in clients) * MiB
    need_room(base, 2 * cell, "bench fuse")
    root = Path(tempfile.mkdtemp(prefix="kvfs-bench-fuse-", dir=base))
    try:
        out = run_fuse_bench(sizes, clients, args.total, root, args.direct_io, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from cli._util import print_table

    print_table(
        [
            "MiB",
            "clients",
            "write plain",
            "+fsync",
            "null FUSE",
            "mount",
            "ratio",
            "vs +fsync",
            "vs null",
            "cold backing",
            "mount",
            "ratio",
            "warm plain",
            "mount",
            "ratio",
        ],
        [
            [
                r["size_mib"],
                r["clients"],
                f"{r['write_plain_gbps']:.2f}",
                f"{r['write_plain_fsync_gbps']:.2f}",
                f"{r['write_null_gbps']:.2f}",
                f"{r['write_mount_gbps']:.2f}",
                f"{r['ratio_write_vs_plain']:.2f}x",
                f"{r['ratio_write_vs_plain_fsync']:.2f}x",
                f"{r['ratio_write_vs_null']:.2f}x",
                f"{r['cold_backing_gbps']:.2f}",
                f"{r['cold_mount_gbps']:.2f}",
                f"{r['ratio_cold_vs_backing']:.2f}x",
                f"{r['warm_plain_gbps']:.2f}",
                f"{r['warm_mount_gbps']:.2f}",
                f"{r['ratio_warm_vs_plain']:.2f}x",
            ]
            for r in out["results"]
        ],
    )
    print(
        "\nwrite ratio: mount / plain writes; vs +fsync: / plain writes with fsync before close, "
        "as durable as a close through the mount (it commits the page)"
    )
    print(
        f"GB/s; cold caches dropped with {out['cache_drop']}; "
        f"{'direct_io' if out['direct_io'] else 'page cache'} mount; 1 MiB I/O calls"
        + (f"; medians of {out['repeat']} rounds." if out["repeat"] > 1 else ".")
    )
    return 0
