"""Where the time of one durable put goes, beside raw O_DIRECT writes of the same buffer.

A diagnostic, not a benchmark with a goal (that is ``kvfs bench store``): it alternates a
raw ``open + pwrite(O_DIRECT) + fsync + close`` and a ``SyncStore.put`` of the same bytes
(each page distinct), and prints the medians. ``--steps`` wraps the put's steps with
timers; ``--no-dir-fsync``, ``--index-normal`` and ``--no-fdatasync`` take flushes away to
show what each one costs (never do that to a store you keep: it is for measuring only).

    .venv/bin/python scripts/put_breakdown.py --mib 4 --puts 300 --steps
    .venv/bin/python scripts/put_breakdown.py --no-dir-fsync --index-normal --no-fdatasync
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import kvfs
import kvfs._engine as E
import kvfs._index as I
import kvfs._local as L
import kvfs._writes as W
from kvfs._aligned import aligned_buffer

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name].append(time.perf_counter() - t)

    return wrapper


def wrap_steps() -> None:
    L.BlobWriter.write_whole = timed("data write", L.BlobWriter.write_whole)  # type: ignore[method-assign]
    L.BlobWriter.finish = timed("finish", L.BlobWriter.finish)  # type: ignore[method-assign]
    L.fsync_dir = timed("  directory fsync", L.fsync_dir)
    L.os.fdatasync = timed("  fdatasync", os.fdatasync)  # type: ignore[attr-defined]
    I.Index.page = timed("existence check", I.Index.page)  # type: ignore[method-assign]
    I.Index.commit_page = timed("index commit", I.Index.commit_page)  # type: ignore[method-assign]
    E.Engine._reserve = timed("reservation", E.Engine._reserve)  # type: ignore[method-assign]
    L.LocalTier.writer = timed("writer", L.LocalTier.writer)  # type: ignore[method-assign]
    W._hash_beside_write = timed("hash hand-off", W._hash_beside_write)
    W.commit = timed("commit + accounting", W.commit)
    W.page_info = timed("PageInfo", W.page_info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4, help="page size in MiB (4)")
    ap.add_argument("--puts", type=int, default=150, help="puts (and raw writes) timed (150)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--steps", action="store_true", help="time the put's steps")
    ap.add_argument("--no-dir-fsync", action="store_true")
    ap.add_argument("--index-normal", action="store_true", help="index synchronous=NORMAL")
    ap.add_argument("--no-fdatasync", action="store_true")
    args = ap.parse_args()
    size = args.mib << 20
    d = tempfile.mkdtemp(dir=args.dir)
    rng = np.random.default_rng(0)
    bufs = []
    for _ in range(8):
        b = aligned_buffer(size)
        np.frombuffer(b, dtype=np.uint8)[:] = rng.integers(0, 255, size, dtype=np.uint8)
        bufs.append(b)
    raw_dir = os.path.join(d, "raw")
    os.makedirs(raw_dir)
    raw, kv = [], []
    try:
        with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(os.path.join(d, "store"),))) as s:
            if args.steps:
                wrap_steps()
            if args.no_dir_fsync:
                L.fsync_dir = lambda path: None
            if args.index_normal:
                s.engine.index._db.execute("PRAGMA synchronous=NORMAL")
            if args.no_fdatasync:
                L.os.fdatasync = lambda fd: None  # type: ignore[attr-defined]
            for i in range(args.puts):
                b = bufs[i % len(bufs)]
                b[0:8] = i.to_bytes(8, "little")
                t = time.perf_counter()
                fd = os.open(os.path.join(raw_dir, str(i)), os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
                os.pwrite(fd, b, 0)
                os.fsync(fd)
                os.close(fd)
                raw.append(time.perf_counter() - t)
                b[8:16] = i.to_bytes(8, "little")  # distinct from the raw copy's bytes too
                t = time.perf_counter()
                s.put(kvfs.PageKey.semantic("s", "p", i), b)
                kv.append(time.perf_counter() - t)
                if i % 20 == 19:  # keep the directories small, as a fresh store's are
                    s.delete_session("s")
                    for f in os.listdir(raw_dir):
                        os.unlink(os.path.join(raw_dir, f))
    finally:
        shutil.rmtree(d)
    for name, ts in TIMES.items():
        print(f"  {name:22s} median {statistics.median(ts) * 1e3:.3f} ms")
    r, k = statistics.median(raw) * 1e3, statistics.median(kv) * 1e3
    print(
        f"raw {r:.3f} ms  put {k:.3f} ms  put/raw throughput {r / k:.2f}x  overhead {k - r:.3f} ms"
    )


if __name__ == "__main__":
    main()
