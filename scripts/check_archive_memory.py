"""What ``kvfs fsck --check-archive`` costs in memory, at several numbers of archived pages.

For each ``--pages`` N: a child process fills a store (two data directories,
``StoreConfig(durable=False, direct_io=False)``, a ``file://`` archive in the same temporary
directory, upload threads rather than worker processes) with N pages of 64 bytes, all of
distinct content, in sessions of ``--session`` pages (400), and spills each session (its
local copies dropped: every page is held by the archive alone). Then, in a fresh process,
an offline ``fsck --check-archive`` (``Engine.fsck(archive=True)``, what the command runs:
the local check, then a download and verification of every archived object). Printed: the
peak resident memory of that process (``VmHWM``) above its resident memory just before the
call (``/proc/self/clear_refs`` resets the peak there), and the time the call took (a
single run: informational).

    .venv/bin/python scripts/check_archive_memory.py --pages 10000 40000

The growth between two sizes, divided by the pages added, is what each archived page
costs. Needs about 8 KiB of disk per page while it fills, then a few hundred bytes.
"""

from __future__ import annotations

import sys
import tempfile

from _memory import (
    archive_config,
    as_child,
    child_output,
    fill_spilled,
    measured,
    page_counts,
    per_page,
)

MiB = 1 << 20


def _fill(tmp: str, n: int, per_session: int) -> None:
    """The child that fills the store and spills every session of it."""
    import kvfs

    with kvfs.open_store_sync(archive_config(tmp)) as store:
        fill_spilled(store, n, per_session)


def _measure(tmp: str) -> None:
    """The child that checks the archive, and prints its memory, time and findings."""
    import kvfs

    eng = kvfs.Engine(archive_config(tmp))
    found, before, peak, took = measured(lambda: eng.fsck(archive=True))
    eng.close()
    problems = sum(len(v) for v in found.values())
    print(f"{before} {peak} {took} {problems}")


def main() -> int:
    if as_child(
        {
            "--child-fill": lambda tmp, n, session: _fill(tmp, int(n), int(session)),
            "--child": _measure,
        }
    ):
        return 0
    args = page_counts(__doc__, [10000, 40000])
    print("pages    fsck --check-archive: peak above RSS, time")
    rows = []
    for n in args.pages:
        with tempfile.TemporaryDirectory(prefix="kvfs-chkarch-") as tmp:
            child_output(__file__, "--child-fill", tmp, str(n), str(args.session))
            before, peak, took, problems = child_output(__file__, "--child", tmp)
            if problems != "0":
                raise SystemExit(f"fsck --check-archive found {problems} problems")
            rows.append((n, int(peak) - int(before)))
            print(f"{n:>7,}  {rows[-1][1] / MiB:10.1f} MiB {float(took):7.2f} s", flush=True)
    if len(rows) > 1:
        print(per_page(rows, ["fsck --check-archive"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
