"""What pyfuse3 itself allows for writes on this machine: a do-nothing pyfuse3 file system
beside a kvfs mount and plain files, measured in one run.

A diagnostic for the write goal of issue 3 (``kvfs bench fuse``: writes through the mount
>= 0.7 of plain ext4 writes). The *null* file system here accepts every write at once and
keeps nothing, so it costs only what every pyfuse3 daemon pays: the kernel's FUSE round trip
per request, libfuse's copy into its buffer, pyfuse3's copy into a ``bytes`` and trio's
dispatch (``kvfs/bench/_nullfs.py``). Whatever kvfs does, its mount cannot write faster than
that. ``kvfs bench fuse`` has it as a column; this script adds rounds in rotating order and
the kernel's writeback cache.

Each round every client writes ``--pages`` new pages of ``--mib`` MiB with 1 MiB ``write``
calls and closes them, through each target in turn (rotating order): plain files on the
same file system (buffered, then with ``fsync`` before close), the null mount, and a
``kvfs mount`` daemon (a close commits the page: checksums, fsync, index commit). A first
round warms memory and is not counted (fresh memory is slow to touch in these VMs). Prints
the medians of the rounds and the ratios.

    .venv/bin/python scripts/fuse_ceiling.py --mib 64 --pages 8 --rounds 5
    .venv/bin/python scripts/fuse_ceiling.py --clients 4
    .venv/bin/python scripts/fuse_ceiling.py --writeback   # the kernel's writeback cache too
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

MiB = 1 << 20


def write_pages(where: Path, tag: str, mib: int, pages: int, clients: int, sync: bool) -> float:
    """Every client writes its own ``pages`` files as ``kvfs bench fuse`` writes them (1 MiB
    calls, each page distinct); returns GB/s for all of them together."""
    from kvfs.bench.fuse import _parallel, _write_files

    src = memoryview(os.urandom(mib * MiB))
    jobs = [
        partial(
            _write_files, [where / f"{tag}-{c}-{i}" for i in range(pages)], mib * MiB, src, sync
        )
        for c in range(clients)
    ]
    return _parallel(jobs) / 1e9


def empty(where: Path, tag: str, pages: int, clients: int) -> None:
    for c in range(clients):
        for i in range(pages):
            (where / f"{tag}-{c}-{i}").unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="page size in MiB (64)")
    ap.add_argument("--pages", type=int, default=8, help="pages per client per round (8)")
    ap.add_argument("--clients", type=int, default=1, help="concurrent writers (1)")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds (5)")
    ap.add_argument("--dir", default="/var/tmp", help="scratch directory on a disk (/var/tmp)")
    ap.add_argument(
        "--writeback",
        action="store_true",
        help="also a null file system with the kernel's FUSE writeback cache on",
    )
    args = ap.parse_args()

    from kvfs.bench._nullfs import null_mount
    from kvfs.bench.fuse import _mounted

    root = Path(tempfile.mkdtemp(dir=args.dir))
    plain = root / "plain"
    plain.mkdir()
    nulls = {"null pyfuse3": (root / "null", False)}
    if args.writeback:
        nulls["null, writeback"] = (root / "null-wb", True)
    try:
        with contextlib.ExitStack() as stack:
            targets: dict[str, tuple[Path, bool]] = {"plain": (plain, False)}
            targets["plain+fsync"] = (plain, True)
            for name, (mp, writeback) in nulls.items():
                mp.mkdir()
                targets[name] = (stack.enter_context(null_mount(mp, writeback)), False)
            kv = stack.enter_context(_mounted(root, False)) / "pages"
            kv.mkdir()
            targets["kvfs mount"] = (kv, False)
            got: dict[str, list[float]] = {k: [] for k in targets}
            names = list(targets)
            for r in range(args.rounds + 1):
                order = names[r % len(names) :] + names[: r % len(names)]
                line = []
                for name in order:
                    where, sync = targets[name]
                    gbps = write_pages(where, f"r{r}", args.mib, args.pages, args.clients, sync)
                    empty(where, f"r{r}", args.pages, args.clients)
                    if r > 0:
                        got[name].append(gbps)
                    line.append(f"{name} {gbps:.2f}")
                print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(line), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med: Callable[[str], float] = lambda k: statistics.median(got[k])  # noqa: E731
    print(
        f"\n{args.clients} client(s) x {args.pages} pages x {args.mib} MiB, 1 MiB writes; "
        f"GB/s, medians of {args.rounds} rounds"
    )
    for k in names:
        print(f"  {k:15s} {med(k):6.2f}")
    print(
        f"  null pyfuse3 / plain {med('null pyfuse3') / med('plain'):.2f}x, "
        f"/ plain+fsync {med('null pyfuse3') / med('plain+fsync'):.2f}x\n"
        f"  kvfs mount / plain {med('kvfs mount') / med('plain'):.2f}x, "
        f"/ plain+fsync {med('kvfs mount') / med('plain+fsync'):.2f}x, "
        f"/ null pyfuse3 {med('kvfs mount') / med('null pyfuse3'):.2f}x"
    )


if __name__ == "__main__":
    main()
