"""Where the time of writing a page through a kvfs mount goes: open, the writes, the close.

A diagnostic for the write gap of ``kvfs bench fuse`` (``docs/benchmarks.md``, FUSE mount):
mounts a fresh store with a ``kvfs mount`` daemon and writes ``--pages`` distinct pages of
``--mib`` MiB one after the other with 1 MiB ``write`` calls, printing per page the time of
the ``open``, of all the writes (and the median and slowest single write) and of the
``close`` (which commits the page: the data made durable, the index row written).

    .venv/bin/python scripts/fuse_write_phases.py --mib 64 --pages 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kvfs.bench.fuse import _mounted

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--pages", type=int, default=8)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        with _mounted(root, False) as mp:
            (mp / "w").mkdir()
            for i in range(args.pages):
                src = memoryview(os.urandom(args.mib * MiB))
                t0 = time.perf_counter()
                fd = os.open(mp / "w" / f"p{i}", os.O_WRONLY | os.O_CREAT, 0o644)
                t1 = time.perf_counter()
                each = []
                for off in range(0, len(src), MiB):
                    a = time.perf_counter()
                    os.write(fd, src[off : off + MiB])
                    each.append(time.perf_counter() - a)
                t2 = time.perf_counter()
                os.close(fd)
                t3 = time.perf_counter()
                print(
                    f"page {i}: open {(t1 - t0) * 1e3:.2f} ms, writes {(t2 - t1) * 1e3:.1f} ms "
                    f"(median {statistics.median(each) * 1e3:.2f}, slowest "
                    f"{max(each) * 1e3:.2f} ms per MiB), close {(t3 - t2) * 1e3:.1f} ms: "
                    f"{len(src) / (t3 - t0) / 1e9:.2f} GB/s"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
