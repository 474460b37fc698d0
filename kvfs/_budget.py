"""A count of bytes shared by many trio tasks, each waiting for room before it holds more:
what bounds the memory of the mount's write-behind over every file being written, and of
the pages in flight over the control channel over every connection. And :func:`waiting`,
which a thread of a bounded pool wraps around a wait for what other threads must do."""

from __future__ import annotations

import contextlib
import threading
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


class ByteBudget:
    """Bytes held, at most ``limit`` of them. :meth:`take` waits (in trio) for room;
    :meth:`give` returns them, from trio or from any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._wake: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    async def take(self, n: int) -> None:
        """Hold ``n`` more bytes once they fit (more than the limit alone, once nothing
        else is held)."""
        while True:
            with self._lock:
                if self.held == 0 or self.held + n <= self.limit:
                    self.held += n
                    return
                if self._wake is None:
                    self._wake = trio.Event()
                    self._token = trio.lowlevel.current_trio_token()
                ev = self._wake
            await ev.wait()  # every waiter wakes at the next give, and looks again

    def give(self, n: int) -> None:
        """Give ``n`` bytes back (from any thread)."""
        with self._lock:
            self.held -= n
            ev, self._wake = self._wake, None
            token = self._token
        if ev is not None and token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(ev.set)
