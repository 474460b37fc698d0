"""Per-call latency of metadata on a kvfs mount, beside a plain ext4 directory.

A diagnostic beside ``kvfs bench fuse`` (which measures throughput): mounts a scratch store
with a ``kvfs mount`` daemon and times, as medians, ``os.open`` + ``os.close`` of a cached
16 MiB page, a warm read of the whole page, a check for a name that does not exist (what a
cache asks for every chunk it lacks) and a ``stat`` of a name the kernel has not cached
(entries expire after the mount's 1 s entry timeout), with the same calls on a plain file.

    .venv/bin/python scripts/mount_metadata_latency.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import kvfs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _kvfs_mount import daemon_mount  # noqa: E402  (the tests' daemon-mount helper)


def median_ms(fn: Callable[[int], object], n: int) -> float:
    ts = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def read_all(path: Path, buf: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def measure(root: Path, buf: bytearray) -> dict[str, float]:
    page = root / "page"
    page.write_bytes(os.urandom(16 << 20))
    (root / "lm").mkdir()
    for i in range(200):
        (root / "lm" / f"k{i}").write_bytes(b"x" * 4096)
    for _ in range(3):
        read_all(page, buf)
    time.sleep(1.2)  # the mount's entries expire: the stats below ask the daemon
    return {
        "stat of an uncached name": median_ms(lambda i: os.stat(root / "lm" / f"k{i}"), 200),
        "check a missing name": median_ms(lambda i: os.path.exists(root / f"no{i}"), 200),
        "open + close": median_ms(lambda i: os.close(os.open(page, os.O_RDONLY)), 300),
        "warm 16 MiB read": median_ms(lambda i: read_all(page, buf), 50),
    }


def main() -> None:
    d = Path(tempfile.mkdtemp())
    buf = bytearray(1 << 20)
    try:
        plain = d / "plain"
        plain.mkdir()
        base = measure(plain, buf)
        with daemon_mount(kvfs.StoreConfig(data_dirs=(d / "data",)), d / "mnt"):
            mount = measure(d / "mnt", buf)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{'call':26s} {'mount ms':>9s} {'plain ms':>9s}")
    for k in mount:
        print(f"{k:26s} {mount[k]:9.3f} {base[k]:9.3f}")


if __name__ == "__main__":
    main()
