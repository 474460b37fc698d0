"""A do-nothing pyfuse3 file system: the write ceiling of any pyfuse3 daemon, as a baseline.

It answers every write at once and keeps nothing but each file's size, so a write through it
costs only what every pyfuse3 daemon pays: the kernel's round trip per request, libfuse's
copy into its buffer, pyfuse3's copy into a ``bytes`` and trio's dispatch. ``kvfs bench
fuse`` writes through it beside the kvfs mount, and ``scripts/fuse_ceiling.py`` with more
variants: a mount cannot write faster than this on the same machine.

It is mounted with the options kvfs uses, in a process of its own
(``python -m kvfs.bench._nullfs MOUNTPOINT [writeback]``), by :func:`null_mount`. It only
creates, writes, looks up and unlinks files in its root: enough for the benchmark.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["null_mount"]


def serve(mountpoint: str, writeback: bool) -> None:
    """Mount the null file system on ``mountpoint`` and serve it until it is unmounted."""
    import pyfuse3
    import trio

    class Null(pyfuse3.Operations):  # type: ignore[misc]
        enable_writeback_cache = writeback

        def __init__(self) -> None:
            super().__init__()
            self.names: dict[bytes, int] = {}
            self.sizes: dict[int, int] = {}
            self.last = pyfuse3.ROOT_INODE

        def _attr(self, ino: int) -> Any:
            a = pyfuse3.EntryAttributes()
            a.st_ino = ino
            root = ino == pyfuse3.ROOT_INODE
            a.st_mode = (stat.S_IFDIR | 0o755) if root else (stat.S_IFREG | 0o644)
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
            self.names[name] = self.last
            self.sizes[self.last] = 0
            return pyfuse3.FileInfo(fh=self.last), self._attr(self.last)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            self.sizes[fh] = max(self.sizes[fh], off + len(buf))
            return len(buf)

        async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
            if fields.update_size:  # the writeback cache sets sizes itself
                self.sizes[inode] = attr.st_size
            return self._attr(inode)

        async def flush(self, fh: int) -> None:
            """Nothing was kept, so nothing to write out."""

        async def release(self, fh: int) -> None:
            """No state per open file."""

        async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
            self.sizes.pop(self.names.pop(name, 0), None)

    # as kvfs, auto_unmount too: the mount goes with this process (a killed benchmark
    # kills it, see null_mount) instead of staying, dead, on the benchmark's scratch
    opts = {"default_permissions", "fsname=kvfs-null", "subtype=null", "noatime", "auto_unmount"}
    pyfuse3.init(Null(), mountpoint, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


@contextlib.contextmanager
def null_mount(mountpoint: Path, writeback: bool = False) -> Iterator[Path]:
    """The null file system mounted on ``mountpoint`` (an empty directory) for the block.
    Raises RuntimeError if it does not mount within 30 s."""
    mode = "writeback" if writeback else "plain"
    from kvfs.bench._common import WITH_PARENT

    # (it exits with the benchmark: a killed one left it serving its mount)
    run = (
        WITH_PARENT + "import runpy\nrunpy.run_module('kvfs.bench._nullfs', run_name='__main__')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", run, str(mountpoint), mode])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the null file system did not mount on {mountpoint}")
            time.sleep(0.05)
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    # Ctrl-C reaches the benchmark's whole process group: it unmounts this file system,
    # which ends the serve (here the signal only printed a traceback).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.argv[1], sys.argv[2:] == ["writeback"])
