"""What listing the archive's sessions and collecting deleted pages' objects cost in memory,
at several numbers of archived pages.

For each ``--pages`` N: a child process fills a store (two data directories,
``StoreConfig(durable=False, direct_io=False)``, a ``file://`` archive in the same temporary
directory, upload threads rather than worker processes) with N pages of 64 bytes, all of
distinct content, in sessions of ``--session`` pages (400), spills each session (every page
is held by the archive alone), then deletes every other session with ``gc_grace`` of an
hour: half the pages' objects wait in the queue of deletions, as after deletes made while
``gc_grace`` or an archive outage held them. Then, in a fresh process with ``gc_grace`` 0:

- ``kvfs ls --archived`` (``Engine.archived_sessions()``): reads every manifest;
- one pass of the background task's archive step (``Spiller.flush_pending``): reads every
  manifest and deletes the queued objects none names.

Printed for each: the peak resident memory of that process (``VmHWM``) above its resident
memory just before the call (``/proc/self/clear_refs`` resets the peak there), and the time
the call took (a single run: informational).

    .venv/bin/python scripts/archive_flush_memory.py --pages 10000 40000

The growth between two sizes, divided by the pages added, is what each archived page
costs. Needs about 8 KiB of disk per page while it fills, then a few hundred bytes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

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
    """The child that fills the store, spills every session and deletes every other one."""
    import kvfs

    with kvfs.open_store_sync(archive_config(tmp, gc_grace=3600.0)) as store:
        for session in fill_spilled(store, n, per_session)[::2]:
            store.delete_session(session)


def _measure(tmp: str) -> None:
    """The child that lists the archived sessions and collects the deleted pages' objects,
    and prints the memory and time of each."""
    import kvfs

    eng = kvfs.Engine(archive_config(tmp, gc_grace=0.0))
    pol = eng._archive()
    queued = pol.aindex.pending_count("forget")
    out: list[object] = []
    listed = 0
    for call in (eng.archived_sessions, lambda: pol.call(pol.spiller.flush_pending)):
        got, before, peak, took = measured(call)
        out += [before, peak, took]
        if isinstance(got, list):
            listed = sum(int(s["pages"]) for s in got)
    left = pol.aindex.pending_count("forget")
    objects = sum(1 for _ in Path(tmp, "archive", "blobs").rglob("*") if _.is_file())
    eng.close()
    print(*out, queued, left, listed, objects)


def main() -> int:
    if as_child(
        {
            "--child-fill": lambda tmp, n, session: _fill(tmp, int(n), int(session)),
            "--child": _measure,
        }
    ):
        return 0
    args = page_counts(__doc__, [10000, 40000])
    print("pages    ls --archived: peak above RSS, time   flush_pending: peak above RSS, time")
    rows = []
    for n in args.pages:
        with tempfile.TemporaryDirectory(prefix="kvfs-flush-") as tmp:
            child_output(__file__, "--child-fill", tmp, str(n), str(args.session))
            f = child_output(__file__, "--child", tmp)
            b0, p0, t0, b1, p1, t1 = (float(x) for x in f[:6])
            queued, left, listed, objects = (int(x) for x in f[6:])
            if left or objects != listed or queued + listed != n:
                raise SystemExit(
                    f"{queued} deletions queued, {left} left; {listed} pages listed, "
                    f"{objects} objects in the archive, of {n} pages"
                )
            rows.append((n, p0 - b0, p1 - b1))
            print(
                f"{n:>7,}  {rows[-1][1] / MiB:10.1f} MiB {t0:7.2f} s"
                f"          {rows[-1][2] / MiB:10.1f} MiB {t1:7.2f} s",
                flush=True,
            )
    if len(rows) > 1:
        print(per_page(rows, ["ls --archived", "flush_pending"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
