"""Write-behind for one file being written through the mount.

A writer's ``write`` calls reach the daemon one at a time (each waits for its reply), so
answering only after the bytes are in the data file would serialize every write on the disk
and a thread hop. Instead each write is accepted at once and queued for a thread, which
writes the file's queue in order (one thread at a time a file): overlapping writes land in
the order they came, so the file ends up as written. At most ``depth`` writes wait per file
(a further ``submit`` waits for room: memory stays bounded).

The FUSE loop is the mount's bottleneck, so a queued write costs it no trio task and no
thread round trip: the thread takes the queue under a lock and calls back into trio only
when the loop is waiting for room or for the queue to drain. The thread (from trio's thread
cache) exits when the queue has been empty for a moment.

The first failure is kept and raised by the next ``submit``, and by ``drain`` (which the
commit calls), so a file that lost a write is never published: the error comes back from a
later ``write`` or from ``close``. Writes queued after a failure are dropped.

A mount-wide :class:`~kvfs._budget.ByteBudget` bounds the bytes queued over all files: a
writer that spreads its writes over many files at once (a layer per file) waits for room as
one that fills one file's queue does, instead of the daemon holding ``depth`` writes for
every file.

The mount's :class:`WriterThreads` bounds how many such threads run at once over all files
(the mount's ``threads``, 16): one a file, a writer of hundreds of files at once started
hundreds, and in a container whose cgroup caps its processes (Kubernetes' pid limit) the
writes that found no thread failed. A file whose writes are queued while all are busy waits
in line; a thread takes the next file in line once its own has nothing queued, or has had
``depth`` writes while others wait. A thread whose write waits for room that other files'
writes hold (near the cap) does not count while it waits (:func:`kvfs._budget.waiting`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable

import trio

from ._budget import ByteBudget, on_wait

__all__ = ["WriteBehind", "WriterThreads"]

#: How long an idle writer thread waits for the next write before it exits.
LINGER = 0.05


class WriterThreads:
    """The threads that write queued writes, at most ``limit`` at once over every file."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        #: threads started and not yet exited, but those waiting for room (:meth:`_wait`)
        self.running = 0
        #: files with writes queued, waiting for a thread
        self._line: collections.deque[WriteBehind] = collections.deque()
        self._lock = threading.Lock()

    def start(self, wb: WriteBehind) -> None:
        """Have ``wb``'s queue written: by a new thread, or with ``limit`` running, by the
        first one free. Raises what starting a thread raises when none can be started."""
        with self._lock:
            if self.running >= self.limit:
                self._line.append(wb)
                return
            self.running += 1
        try:
            trio.lowlevel.start_thread_soon(functools.partial(self._serve, wb), _ignore)
        except BaseException:
            with self._lock:
                self.running -= 1
            raise

    def _waiting(self) -> bool:
        return bool(self._line)

    def _serve(self, wb: WriteBehind | None) -> None:
        """A thread: write ``wb``'s queue, then the queues of the files in line."""
        on_wait(self._wait)
        try:
            while wb is not None:
                gave_way = wb._write_queue(self._waiting)
                with self._lock:
                    if gave_way:  # (its writes still queued: back in line, behind the others)
                        self._line.append(wb)
                    if self._line and self.running <= self.limit:
                        wb = self._line.popleft()
                    else:  # (the others, limit of them at least, take the line)
                        self.running -= 1
                        wb = None
        finally:
            on_wait(None)  # (trio's thread cache runs other work on this thread)

    def _wait(self, begins: bool) -> None:
        """A thread's write waits for room that other files' writes give back once they
        are committed (the engine's reserve): it does not count while it waits, and a file
        in line gets a thread of its own. With every thread waiting so, the files whose
        commit would end their wait stayed in line until the wait timed out (10 s) and the
        writes failed with ENOSPC."""
        start = None
        with self._lock:
            if not begins:
                self.running += 1  # (over the limit for a while, perhaps: see _serve)
                return
            self.running -= 1
            if self._line and self.running < self.limit:
                start = self._line.popleft()
                self.running += 1
        if start is not None:
            try:
                trio.lowlevel.start_thread_soon(functools.partial(self._serve, start), _ignore)
            except BaseException:  # (no thread: it waits in line for one, as before)
                with self._lock:
                    self.running -= 1
                    self._line.appendleft(start)


class WriteBehind:
    def __init__(
        self,
        write: Callable[[int, bytes], object],
        depth: int,
        budget: ByteBudget | None = None,
        threads: WriterThreads | None = None,
    ) -> None:
        self._write = write
        self._depth = max(1, depth)
        self._budget = budget or ByteBudget(1 << 62, fair=False)
        self._threads = threads or WriterThreads(1 << 30)
        self._token = trio.lowlevel.current_trio_token()
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()
        #: writes queued or being written
        self._pending = 0
        self._running = False
        #: the loop's tasks waiting until at most so many writes are pending, each with
        #: its event: a write waiting for room, and a flush or two draining (a child's
        #: close of an inherited descriptor flushes beside the writer's own). One slot,
        #: the later waiter took it and the earlier one was never woken: its close hung.
        self._waiters: list[tuple[int, trio.Event]] = []
        #: the first write that failed; nothing after it matters any more
        self.error: BaseException | None = None

    async def submit(self, off: int, buf: bytes) -> None:
        """Queue a write. Raises the error of an earlier write, if one failed, and
        what starting a thread raises when no thread can be started to write it (nothing
        is queued then)."""
        if self.error is not None:
            raise self.error
        await self._wait_until(self._depth - 1)
        await self._budget.take(len(buf))
        if self.error is not None:
            self._budget.give(len(buf))
            raise self.error
        with self._cond:
            self._queue.append((off, buf))
            self._pending += 1
            if self._running:
                self._cond.notify()
                return
            self._running = True
        try:
            self._threads.start(self)
        except BaseException:
            # No thread to write it (the process may start no more: a cgroup's pids.max,
            # RLIMIT_NPROC, memory): take the write back, as if never queued. Left queued,
            # drain waited for it forever: the writer's close hung, and the daemon's stop.
            with self._cond:
                self._queue.pop()
                self._pending -= 1
                self._running = False
            self._budget.give(len(buf))
            raise

    async def drain(self) -> None:
        """Wait until every queued write is in the file. Raises the first failure."""
        await self._wait_until(0)
        if self.error is not None:
            raise self.error

    async def _wait_until(self, most: int) -> None:
        with self._cond:
            if self._pending <= most:
                return
            waiter = (most, trio.Event())
            self._waiters.append(waiter)
        try:
            await waiter[1].wait()
        finally:
            with self._cond, contextlib.suppress(ValueError):  # (gone once it was set)
                self._waiters.remove(waiter)

    def _write_queue(self, others_waiting: Callable[[], bool]) -> bool:
        """On a writer thread: write the queue in order, until it stays empty (False) or,
        with ``others_waiting()``, until ``depth`` writes are done (True: give way; writes
        are still queued, and the file still counts as running)."""
        done = 0
        while True:
            with self._cond:
                if not self._queue:
                    if not others_waiting():
                        self._cond.wait(LINGER)
                    if not self._queue:
                        self._running = False
                        return False
                if done >= self._depth and others_waiting():
                    return True
                off, buf = self._queue.popleft()
            self._write_one(off, buf)
            del buf  # (not held while this thread lingers, or writes another file)
            done += 1

    def _write_one(self, off: int, buf: bytes) -> None:
        if self.error is None:
            try:
                self._write(off, buf)
            except BaseException as e:  # kept for submit/drain, which raise it
                self.error = e
        self._budget.give(len(buf))
        with self._cond:
            self._pending -= 1
            done = [w for w in self._waiters if self._pending <= w[0]]
            if not done:
                return
            self._waiters = [w for w in self._waiters if self._pending > w[0]]
        # RunFinishedError: the loop is gone, nobody waits any more
        with contextlib.suppress(trio.RunFinishedError):
            for _, ev in done:
                self._token.run_sync_soon(ev.set)


def _ignore(_outcome: object) -> None:
    pass
