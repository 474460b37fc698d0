"""Writer process for tests/test_store_crash.py: puts pages until it is killed.

Usage: ``python _crash_writer.py ROUND DIR [DIR...]``. Prints ``ready`` once the store is
open, then the key of every page whose put returned (the acknowledgement), one per line,
flushed. Page ``crash/r<ROUND>/p<i>`` always holds :func:`page_data` (ROUND, i): the checker
can recompute what any page must contain, acknowledged or not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import kvfs

KiB, MiB = 1024, 1 << 20
STRIPE = 256 * KiB


def page_size(rnd: int, i: int) -> int:
    r = np.random.default_rng(rnd * 100_003 + i)
    kind = r.integers(0, 4)
    if kind == 0:
        return int(r.integers(0, 8 * KiB))
    if kind == 1:
        return int(r.integers(8 * KiB, STRIPE + 1))
    return int(r.integers(STRIPE, 5 * MiB))  # striped over every device, several leaves


def page_data(rnd: int, i: int) -> bytes:
    if i % 7 == 3:  # some pages repeat earlier content: dedup under crashes too
        return page_data(rnd, i - 3)
    n = page_size(rnd, i)
    return np.random.default_rng(rnd * 7_919 + i).integers(0, 256, n, dtype=np.uint8).tobytes()


def main() -> None:
    rnd = int(sys.argv[1])
    dirs = tuple(Path(d) for d in sys.argv[2:])
    # (CRASH_DURABLE=0: a durable=False store, tests/test_power_cut.py)
    durable = os.environ.get("CRASH_DURABLE", "1") == "1"
    cfg = kvfs.StoreConfig(data_dirs=dirs, stripe_unit=STRIPE, io_threads=4, durable=durable)
    with kvfs.open_store_sync(cfg) as store:
        print("ready", flush=True)
        i = 0
        while True:
            key = f"crash/r{rnd}/p{i}"
            store.put(key, page_data(rnd, i), attrs={"round": str(rnd)})
            print(key, flush=True)
            i += 1


if __name__ == "__main__":
    main()
