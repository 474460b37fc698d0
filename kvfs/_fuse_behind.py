"""Write-behind for one file being written through the mount.

A writer's ``write`` calls reach the daemon one at a time (each waits for its reply), so
answering only after the bytes are in the data file would serialize every write on the disk
and a thread hop. Instead each write is accepted at once and written by a task in the mount's
nursery, at most ``depth`` at a time per file (the rest wait: memory stays bounded).
Overlapping writes wait for the earlier ones, so the file ends up as written. The first
failure is kept and raised by the next write, and by ``drain`` (which the commit calls), so a
file that lost a write is never published: the error comes back from a later ``write`` or
from ``close``.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import trio

__all__ = ["WriteBehind"]


class WriteBehind:
    def __init__(
        self, write: Callable[[int, bytes], Awaitable[object]], depth: int, nursery: trio.Nursery
    ) -> None:
        self._write = write
        self._nursery = nursery
        self._slots = trio.Semaphore(depth)
        self._inflight: dict[int, tuple[int, int]] = {}
        self._ids = itertools.count()
        self._idle = trio.Event()
        self._idle.set()
        #: the first write that failed; nothing after it matters any more
        self.error: BaseException | None = None

    async def submit(self, off: int, buf: bytes) -> None:
        """Queue a write. Raises the error of an earlier write, if one failed."""
        if self.error is not None:
            raise self.error
        end = off + len(buf)
        while any(o < end and off < e for o, e in self._inflight.values()):
            await self._idle.wait()
        await self._slots.acquire()
        if self.error is not None:
            self._slots.release()
            raise self.error
        i = next(self._ids)
        if not self._inflight:
            self._idle = trio.Event()
        self._inflight[i] = (off, end)
        self._nursery.start_soon(self._run, i, off, buf)

    async def _run(self, i: int, off: int, buf: bytes) -> None:
        try:
            await self._write(off, buf)
        except Exception as e:
            if self.error is None:
                self.error = e
        finally:
            del self._inflight[i]
            self._slots.release()
            if not self._inflight:
                self._idle.set()

    async def drain(self) -> None:
        """Wait until every queued write is in the file. Raises the first failure."""
        await self._idle.wait()
        if self.error is not None:
            raise self.error
