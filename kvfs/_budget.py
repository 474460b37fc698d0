"""A count of bytes shared by many trio tasks, each waiting for room before it holds more:
what bounds the memory of the mount's write-behind over every file being written, and of
the pages in flight over the control channel over every connection. And :func:`waiting`,
which a thread of a bounded pool wraps around a wait for what other threads must do."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator

import trio

__all__ = ["ByteBudget", "on_wait", "waiting"]

_local = threading.local()


def on_wait(hook: Callable[[bool], None] | None) -> None:
    """Have this thread's :func:`waiting` call ``hook(True)`` as a wait begins and
    ``hook(False)`` as it ends (None: nothing). A pool of threads sets it on its own, so
    that a thread waiting for what another of its files must do first does not count."""
    _local.hook = hook


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a wait that other threads end (room that writes in flight give back): tells
    this thread's pool, if it has asked (:func:`on_wait`)."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        hook(True)
    try:
        yield
    finally:
        if hook is not None:
            hook(False)


class _Waiter:
    """A take waiting in line: granted (its bytes held for it) by a give, then woken."""

    __slots__ = ("event", "granted", "n", "token")

    def __init__(self, n: int) -> None:
        self.n = n
        self.event = trio.Event()
        self.token = trio.lowlevel.current_trio_token()
        self.granted = False


class ByteBudget:
    """Bytes held, at most ``limit`` of them. :meth:`take` waits (in trio) for room;
    :meth:`give` returns bytes, from trio or from any thread, and grants the takes waiting
    that now fit.

    ``fair`` (the control channel's pages): takes are served in line, the first to wait
    first, and a take that would fit waits too while others are in line. Each take that
    fitted went ahead before: a get of a 512 MiB page waited for as long as smaller gets
    kept the budget more than half full, which a busy daemon's could be for ever. Not fair
    (the mount's write-behind, whose takes are one FUSE write each, 1 MiB at most): a take
    that fits goes at once. There the bytes held drain through the disk, and a small write
    held behind a large one could keep a file open that a stalled writer waits on (its
    streaming write holds room the other's needs, until it is closed)."""

    def __init__(self, limit: int, *, fair: bool = True) -> None:
        self.limit = limit
        self.fair = fair
        self.held = 0
        self._lock = threading.Lock()
        self._line: deque[_Waiter] = deque()

    @property
    def in_line(self) -> int:
        """How many takes are in line."""
        return len(self._line)

    def _fits(self, n: int) -> bool:
        # (more than the limit alone, once nothing else is held)
        return self.held == 0 or self.held + n <= self.limit

    def _grant(self) -> list[_Waiter]:
        """Under the lock: hold the bytes of the takes waiting that fit now, in order (fair:
        only those at the head of the line); returns them, to be woken (outside the lock)."""
        granted: list[_Waiter] = []
        for w in list(self._line):
            if not self._fits(w.n):
                if self.fair:
                    break
                continue
            self._line.remove(w)
            self.held += w.n
            w.granted = True
            granted.append(w)
        return granted

    @staticmethod
    def _wake(granted: list[_Waiter]) -> None:
        for w in granted:
            # RunFinishedError: its loop is gone, and nobody waits any more
            with contextlib.suppress(trio.RunFinishedError):
                w.token.run_sync_soon(w.event.set)

    async def take(self, n: int) -> None:
        """Hold ``n`` more bytes once they fit (fair: and every take in line before it
        went; more than the limit alone, once nothing else is held). Cancelled while it
        waits, it holds nothing."""
        with self._lock:
            if (not self._line or not self.fair) and self._fits(n):
                self.held += n
                return
            w = _Waiter(n)
            self._line.append(w)
        try:
            await w.event.wait()
        except BaseException:
            with self._lock:
                if w.granted:  # (granted as it was cancelled: given back)
                    self.held -= n
                else:  # (out of line: the takes behind it may fit now)
                    self._line.remove(w)
                granted = self._grant()
            self._wake(granted)
            raise

    def give(self, n: int) -> None:
        """Give ``n`` bytes back (from any thread)."""
        with self._lock:
            self.held -= n
            granted = self._grant()
        self._wake(granted)
