"""Where the time of a cold whole-page read goes, through a kvfs mount and from its backing
files directly.

A diagnostic for the cold-read gap of ``kvfs bench fuse`` (``docs/benchmarks.md``, FUSE
mount): mounts a fresh store with a ``kvfs mount`` daemon, writes ``--pages`` pages through
it, then, with the page cache dropped before each pass (``drop_caches`` as root), reads
every page with 1 MiB reads, alternately through the mount and from the backing files its
``user.kvfs.extents`` name, and prints the medians per page of: the ``open``, the first 1 MiB
read, the rest of the page, and the ``close``.

    .venv/bin/python scripts/cold_read_phases.py --mib 16 --pages 16 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvfs.bench.fuse import _drop_caches, _extents, _mounted

MiB = 1 << 20


def through_mount(path: Path, buf: bytearray, t: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    t1 = time.perf_counter()
    os.readv(fd, [buf])
    t2 = time.perf_counter()
    while os.readv(fd, [buf]):
        pass
    t3 = time.perf_counter()
    os.close(fd)
    t4 = time.perf_counter()
    for k, a, b in (("open", t0, t1), ("first", t1, t2), ("rest", t2, t3), ("close", t3, t4)):
        t[k].append(b - a)


def from_backing(
    extents: list[tuple[str, int, int]], buf: bytearray, t: dict[str, list[float]]
) -> None:
    view = memoryview(buf)
    for path, off, length in extents:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        t1 = time.perf_counter()
        os.preadv(fd, [view[: min(MiB, length)]], off)
        t2 = time.perf_counter()
        pos, end = off + MiB, off + length
        while pos < end:
            pos += os.preadv(fd, [view[: min(MiB, end - pos)]], pos)
        t3 = time.perf_counter()
        os.close(fd)
        t4 = time.perf_counter()
        for k, a, b in (("open", t0, t1), ("first", t1, t2), ("rest", t2, t3), ("close", t3, t4)):
            t[k].append(b - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=16, help="page size in MiB (16)")
    ap.add_argument("--pages", type=int, default=16, help="pages (16)")
    ap.add_argument("--rounds", type=int, default=2, help="passes of each kind (2)")
    ap.add_argument("--dir", default="/var/tmp", help="scratch directory on a disk (/var/tmp)")
    args = ap.parse_args()
    size = args.mib * MiB
    root = Path(tempfile.mkdtemp(dir=args.dir))
    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    buf = bytearray(MiB)
    try:
        with _mounted(root, False) as mp:
            (mp / "pages").mkdir()
            pages = [mp / "pages" / f"p{i}" for i in range(args.pages)]
            for i, p in enumerate(pages):
                with open(p, "wb") as f:
                    f.write(i.to_bytes(8, "little") + src[8:])
            extents = [_extents(p) for p in pages]
            print(f"{args.pages} pages of {args.mib} MiB; medians per page in ms")
            for _ in range(args.rounds):
                for label in ("mount", "backing"):
                    method = _drop_caches([])
                    t: dict[str, list[float]] = {"open": [], "first": [], "rest": [], "close": []}
                    t0 = time.perf_counter()
                    for p, e in zip(pages, extents, strict=True):
                        if label == "mount":
                            through_mount(p, buf, t)
                        else:
                            from_backing(e, buf, t)
                    gbps = args.pages * size / (time.perf_counter() - t0) / 1e9
                    cols = "  ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in t.items())
                    print(f"  {label:8s} {gbps:.2f} GB/s  {cols}  (cache: {method})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
