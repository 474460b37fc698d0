"""One process owns a data directory: an flock'ed file that names its owner."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

from ._errors import StoreLocked

__all__ = ["DirLock"]


class DirLock:
    """Exclusive, advisory, released by the kernel when the process dies (even by SIGKILL).

    A child forked without exec does not hold it: a flock belongs to the open file, which
    a fork shares, so an owner's long-lived child (a worker pool forked by an engine) kept
    the store locked after the owner was killed, "in use by" a dead pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (ValueError, OSError):  # (half written; a disk's error reading it)
                owner = {}
            if not isinstance(owner, dict):  # (no kvfs wrote it: named as unknown)
                owner = {}
            os.close(fd)
            who = (
                f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} "
                f"({owner.get('cmd', '?')}, since {owner.get('since', '?')})"
            )
            raise StoreLocked(f"{self.path.parent} is in use by {who}") from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cmd": " ".join(sys.argv)[:200],
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as e:  # a full disk: the lock holds all the same, unnamed
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                raise
        self._fd = fd
        _HELD.add(self)

    def release(self) -> None:
        """Release the lock, erasing the owner's name. Never raises: a disk that fails
        the erase (EIO) keeps a stale name in the file, not the lock (the file is closed)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass  # (closing the file releases the lock all the same)
            finally:
                os.close(fd)


_HELD: weakref.WeakSet[DirLock] = weakref.WeakSet()


def _drop_in_child() -> None:
    """After a fork, in the child: close its copies of the locks' files (without release:
    that would erase the owner's name from the file the parent still locks)."""
    for lock in list(_HELD):
        if lock._fd is not None:
            fd, lock._fd = lock._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)
