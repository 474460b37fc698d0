"""What pyfuse3 itself allows for writes on this machine: a do-nothing pyfuse3 file system
beside a kvfs mount and plain files, measured in one run.

A diagnostic for the write goal of issue 3 (``kvfs bench fuse``: writes through the mount
>= 0.7 of plain ext4 writes). The *null* file system here accepts every write at once and
keeps nothing, so it costs only what every pyfuse3 daemon pays: the kernel's FUSE round trip
per request, libfuse's copy into its buffer, pyfuse3's copy into a ``bytes`` and trio's
dispatch. Whatever kvfs does, its mount cannot write faster than that.

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
import errno
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20


def serve_null(mountpoint: str, writeback: bool) -> None:
    """Mount the null file system on ``mountpoint`` and serve it until unmounted."""
    import pyfuse3
    import trio

    class Null(pyfuse3.Operations):
        enable_writeback_cache = writeback

        def __init__(self) -> None:
            super().__init__()
            self.names: dict[bytes, int] = {}
            self.sizes: dict[int, int] = {}
            self.last = pyfuse3.ROOT_INODE

        def _attr(self, ino: int) -> Any:
            a = pyfuse3.EntryAttributes()
            a.st_ino = ino
            a.st_mode = (
                (stat.S_IFDIR | 0o755) if ino == pyfuse3.ROOT_INODE else (stat.S_IFREG | 0o644)
            )
            a.st_size = self.sizes.get(ino, 0)
            a.st_blksize = 4096
            a.entry_timeout = a.attr_timeout = 1.0
            return a

        async def getattr(self, inode: int, ctx: Any = None) -> Any:
            return self._attr(inode)

        async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> Any:
            if name not in self.names:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(self.names[name])

        async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
            self.last += 1  # inode numbers never come back: the kernel may still know one
            ino = self.names[name] = self.last
            self.sizes[ino] = 0
            return pyfuse3.FileInfo(fh=ino), self._attr(ino)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            self.sizes[fh] = max(self.sizes[fh], off + len(buf))
            return len(buf)

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            if fields.update_size:  # the writeback cache sets sizes and times itself
                self.sizes[inode] = attr.st_size
            return self._attr(inode)

        async def flush(self, fh: int) -> None:
            pass

        async def release(self, fh: int) -> None:
            pass

        async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
            self.sizes.pop(self.names.pop(name, 0), None)

    opts = {"default_permissions", "fsname=null", "subtype=null", "noatime"}  # as kvfs mounts
    pyfuse3.init(Null(), mountpoint, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


def write_pages(where: Path, tag: str, mib: int, pages: int, clients: int, sync: bool) -> float:
    """Every client writes its own ``pages`` files; returns GB/s for all of them together."""
    buf = os.urandom(MiB)

    def client(c: int) -> None:
        for i in range(pages):
            fd = os.open(where / f"{tag}-{c}-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for _ in range(mib):
                    os.write(fd, buf)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients * pages * mib * MiB / (time.perf_counter() - t0) / 1e9


def empty(where: Path, tag: str, pages: int, clients: int) -> None:
    for c in range(clients):
        for i in range(pages):
            (where / f"{tag}-{c}-{i}").unlink()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-null":
        serve_null(sys.argv[2], sys.argv[3] == "writeback")
        return
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

    from kvfs.bench.fuse import _mounted

    root = Path(tempfile.mkdtemp(dir=args.dir))
    plain = root / "plain"
    plain.mkdir()
    nulls = {"null pyfuse3": root / "null"}
    if args.writeback:
        nulls["null, writeback"] = root / "null-wb"
    procs = []
    try:
        for name, mp in nulls.items():
            mp.mkdir()
            mode = "writeback" if "writeback" in name else "plain"
            procs.append(
                subprocess.Popen([sys.executable, __file__, "--serve-null", str(mp), mode])
            )
            deadline = time.monotonic() + 30
            while not os.path.ismount(mp):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} file system did not mount")
                time.sleep(0.05)
        with _mounted(root, False) as kv_mp:
            (kv_mp / "pages").mkdir()
            kv = kv_mp / "pages"
            targets: dict[str, tuple[Path, bool]] = {
                "plain": (plain, False),
                "plain+fsync": (plain, True),
                **{name: (mp, False) for name, mp in nulls.items()},
                "kvfs mount": (kv, False),
            }
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
        for mp in nulls.values():
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
        for p in procs:
            p.wait(timeout=30)
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
