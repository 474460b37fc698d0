"""One process owns a data directory: an flock'ed file that names its owner."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ._errors import StoreLocked

__all__ = ["DirLock"]


class DirLock:
    """Exclusive, advisory, released by the kernel when the process dies (even by SIGKILL)."""

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
            except ValueError:
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

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)
            os.close(fd)
