"""Waiting on fast-path futures from trio, and the layer-wise loader.

Fast-path calls return :class:`concurrent.futures.Future` objects, resolved from worker
threads. Threaded code calls ``.result()``; trio code awaits :func:`wait`, which parks the
task (no thread is held while waiting) until the future is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as _wait_all
from typing import Any, Generic, TypeVar

import trio

__all__ = ["LayerLoader", "wait"]

T = TypeVar("T")


async def wait(fut: Future[T]) -> T:
    """Await a fast-path future from trio; returns its result or raises its error.

    Cancellation: a read or write already in flight cannot be stopped, and its destination
    is still being written. So a cancelled ``wait`` first waits (shielded) until the future
    is done, then lets the cancellation through: when ``wait`` returns or raises, nothing
    writes into the caller's buffer any more.
    """
    if fut.done():
        await trio.lowlevel.checkpoint()  # an await is always a checkpoint in trio
    else:
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: Future[T]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        fut.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await done.wait()
            raise
    return fut.result()


class LayerLoader(Generic[T]):
    """Yields ``(index, destination)`` for each layer in order, as soon as that layer is in.

    Reads for the next ``ahead`` layers are in flight while the caller computes on the one
    just yielded; ``ahead=None`` starts them all at once. Iterate with ``for`` (threads) or
    ``async for`` (trio: the reads after the first ones start from a worker thread; make
    the loader in one too, ``await FastPath.aload_layers(...)``, as the first ones start
    when it is made). A failed layer raises from the iteration at its turn: a read
    that failed (CorruptPage...) or one that could not start (PageNotFound: ``submit``
    raised); iterating on goes on with the next layer. Use as a context manager: leaving
    it waits for every read already started, so no destination is written after the
    ``with`` block (reads not yet started never start).
    """

    def __init__(
        self, submit: Callable[[int], Future[int]], dests: Sequence[T], ahead: int | None
    ) -> None:
        if ahead is not None and ahead < 0:
            raise ValueError("ahead must be >= 0 or None")
        self._submit = submit
        self._dests = list(dests)
        self._ahead = len(self._dests) if ahead is None else ahead
        self._futures: list[Future[int]] = []
        self._next = 0
        self._closed = False
        try:
            self._top_up()
        except BaseException:
            # (interrupted): the reads already started are still writing into their
            # buffers, and the caller, with no loader to leave, would reuse them at once
            self.close()
            raise

    @property
    def submitted(self) -> int:
        """How many layer reads have been started so far."""
        return len(self._futures)

    def future(self, i: int) -> Future[int]:
        """The future of layer ``i`` (IndexError if it is not started yet)."""
        return self._futures[i]

    def _top_up(self) -> None:
        # Layers 0..i are taken; i+1..i+ahead should be in flight (layer 0 + ahead at first).
        want = min(len(self._dests), max(self._next, 1) + self._ahead)
        while not self._closed and len(self._futures) < want:
            try:
                f = self._submit(len(self._futures))
            except Exception as e:  # noqa: BLE001 - a layer that cannot start (its page is
                # missing) raises at its turn, as a failed read does, not at an earlier
                # layer's (which was then never yielded)
                f = Future()
                f.set_running_or_notify_cancel()
                f.set_exception(e)
            self._futures.append(f)

    def _take(self) -> tuple[int, Future[int]]:
        if self._next >= len(self._dests) or self._closed:
            raise StopIteration
        i = self._next
        self._next += 1
        self._top_up()
        return i, self._futures[i]

    def _take_or_none(self) -> tuple[int, Future[int]] | None:
        # (a StopIteration out of a worker thread would reach the coroutine as a
        # RuntimeError: PEP 479)
        try:
            return self._take()
        except StopIteration:
            return None

    def __iter__(self) -> LayerLoader[T]:
        return self

    def __next__(self) -> tuple[int, T]:
        try:
            i, fut = self._take()
        except StopIteration:
            raise
        fut.result()
        return i, self._dests[i]

    def __aiter__(self) -> LayerLoader[T]:
        return self

    async def __anext__(self) -> tuple[int, T]:
        # The next reads start in a worker thread: starting one looks its page up in the
        # index, and restores a page only the archive holds, a download; on the trio
        # thread, every other task of the loop waited for that.
        taken = await trio.to_thread.run_sync(self._take_or_none)
        if taken is None:
            raise StopAsyncIteration
        i, fut = taken
        await wait(fut)
        return i, self._dests[i]

    def close(self) -> None:
        """Start no more reads and wait for those in flight (their errors are dropped)."""
        self._closed = True
        _wait_all(self._futures)

    async def aclose(self) -> None:
        self._closed = True
        for f in self._futures:
            if not f.done():
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await wait(f)  # its error is dropped, as in close()

    def __enter__(self) -> LayerLoader[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> LayerLoader[T]:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
