"""Puts into a full store with an archive: the steady state of a KV cache.

A diagnostic for the eviction path under capacity pressure. One session grows page by page
far past the capacity cap; every put that does not fit makes room by evicting the least
recently used pages to the archive (upload, name them in the session's manifest, drop the
local copies). It prints the time per put in eighths of the run, so a cost that grows with
the session's size shows as a rising column, beside the same puts into a store without a
cap (nothing evicted) measured in the same run.

    .venv/bin/python scripts/put_under_pressure.py --pages 4000 --kib 64
    .venv/bin/python scripts/put_under_pressure.py --evict-ahead 0   # one page per eviction
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import kvfs
from kvfs import PageKey


def run(root: Path, pages: int, size: int, capacity: int, ahead: int | None) -> list[float]:
    """ms per put in each eighth of the run."""
    archive: dict[str, object] = {"interval": 0}
    if ahead is not None:  # (left out, the script also runs on kvfs before the setting)
        archive["evict_ahead"] = ahead
    cfg = kvfs.StoreConfig(
        data_dirs=(root / "d0",),
        capacity=capacity,
        archive_url=f"file://{root / 'archive'}",
        extra={"archive": archive},
    )
    blocks = [os.urandom(size) for _ in range(8)]
    out, step = [], max(1, pages // 8)
    with kvfs.open_store_sync(cfg) as s:
        t = time.perf_counter()
        for i in range(pages):
            data = blocks[i % 8][:-8] + i.to_bytes(8, "little")  # every page distinct
            s.put(PageKey.semantic("agent", f"p{i:06d}", 0), data)
            if (i + 1) % step == 0:
                now = time.perf_counter()
                out.append((now - t) / step * 1e3)
                t = now
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=4000)
    ap.add_argument("--kib", type=int, default=64, help="page size")
    ap.add_argument("--capacity-mib", type=int, default=16)
    ap.add_argument("--evict-ahead", type=int, default=None, help="bytes (default: the store's)")
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    a = ap.parse_args()
    size = a.kib * 1024
    rows = {}
    for name, cap in (("no cap", 0), (f"cap {a.capacity_mib} MiB", a.capacity_mib << 20)):
        root = Path(tempfile.mkdtemp(prefix="kvfs-pressure-", dir=a.dir))
        try:
            t0 = time.perf_counter()
            rows[name] = run(root, a.pages, size, cap, a.evict_ahead)
            print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        finally:
            shutil.rmtree(root)
    print(f"\n{a.pages} puts of {a.kib} KiB, one session, evict_ahead {'default' if a.evict_ahead is None else a.evict_ahead}; ms/put")
    names = list(rows)
    print("pages   " + "".join(f"{n:>14}" for n in names) + "     ratio")
    for i in range(len(rows[names[0]])):
        upto = (i + 1) * max(1, a.pages // 8)
        vals = [rows[n][i] for n in names]
        print(f"{upto:6d}  " + "".join(f"{v:14.2f}" for v in vals) + f"{vals[1] / vals[0]:9.1f}x")


if __name__ == "__main__":
    main()
