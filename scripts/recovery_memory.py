"""What an open after a crash and an offline fsck cost in memory, at several store sizes.

For each ``--pages`` N: a child process fills a store (two data directories,
``StoreConfig(durable=False, direct_io=False)``) with N pages of 64 bytes, all of distinct
content, in sessions of 40 (``put_many`` in batches of 2,000), and is killed with SIGKILL:
the index is left unclean, as after a crash, and a few leftover data files are added for
the sweep to find. Then, each in a fresh process: the open (the sweep of every data file,
the accounting recounted from every blob row) and, once that open closed cleanly, an
offline fsck (``Engine.fsck``, what ``kvfs fsck`` runs: it reads and verifies every page).
Printed for each: the peak resident memory of the process (``VmHWM``) above its resident
memory just before the call (``/proc/self/clear_refs`` resets the peak there), and the
time the call took (a single run: informational).

    .venv/bin/python scripts/recovery_memory.py --pages 20000 80000

The growth between two sizes, divided by the pages added, is what each page costs. Needs
about 8 KiB of disk per page (a 4 KiB header and a 4 KiB block for each page's file).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _memory import as_child, child_output, measured, page_counts, per_page

MiB = 1 << 20
BATCH = 2000


def _config(tmp: str) -> object:
    import kvfs

    return kvfs.StoreConfig(
        data_dirs=(Path(tmp, "d0"), Path(tmp, "d1")), durable=False, direct_io=False
    )


def _fill(tmp: str, n: int) -> None:
    """The child that fills the store, then waits to be killed (the index stays unclean)."""
    import kvfs

    with kvfs.open_store_sync(_config(tmp)) as store:
        for first in range(0, n, BATCH):
            store.put_many(
                (f"sessions/s{i // 40:05d}/p/layer-{i % 40:03d}", i.to_bytes(8, "little") * 8)
                for i in range(first, min(n, first + BATCH))
            )
        print("filled", flush=True)
        time.sleep(3600)


def _measure(tmp: str, what: str) -> None:
    """The child that opens the store, or fscks it, and prints its memory and time."""
    import kvfs

    cfg = _config(tmp)
    if what == "open":
        eng, before, peak, took = measured(lambda: kvfs.Engine(cfg))
        print(f"{before} {peak} {took} {len(eng.recovered_orphans)}")
    else:
        eng = kvfs.Engine(cfg)
        found, before, peak, took = measured(eng.fsck)
        problems = sum(len(v) for k, v in found.items() if k != "repaired")
        print(f"{before} {peak} {took} {problems}")
    eng.close()


def main() -> int:
    if as_child({"--child-fill": lambda tmp, n: _fill(tmp, int(n)), "--child": _measure}):
        return 0
    args = page_counts(__doc__, [20000, 80000], session=False)
    print("pages    open: peak above RSS, time    fsck: peak above RSS, time")
    rows = []
    for n in args.pages:
        with tempfile.TemporaryDirectory(prefix="kvfs-recmem-") as tmp:
            fill = subprocess.Popen(
                [sys.executable, __file__, "--child-fill", tmp, str(n)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert fill.stdout is not None
            if fill.stdout.readline().strip() != "filled":
                raise SystemExit("the filling process failed")
            fill.send_signal(signal.SIGKILL)
            fill.wait()
            for i in range(5):  # leftovers of writes never committed, for the sweep
                Path(tmp, "d1", "blobs", "ab", f"leftover-{i}").write_bytes(b"\0" * 8192)
            b0, p0, t0, removed = child_output(__file__, "--child", tmp, "open")
            b1, p1, t1, problems = child_output(__file__, "--child", tmp, "fsck")
            if removed != "5" or problems != "0":
                raise SystemExit(f"the open removed {removed} files, fsck found {problems}")
            rows.append((n, int(p0) - int(b0), int(p1) - int(b1)))
            print(
                f"{n:>7,}  {(int(p0) - int(b0)) / MiB:10.1f} MiB {float(t0):7.2f} s"
                f"     {(int(p1) - int(b1)) / MiB:10.1f} MiB {float(t1):7.2f} s",
                flush=True,
            )
    if len(rows) > 1:
        print(per_page(rows, ["open", "fsck"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
