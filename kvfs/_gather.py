"""Run calls concurrently and raise the first error as it is (no ExceptionGroup)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


async def gather_first_error(calls: list[Callable[[], Awaitable[T]]], concurrency: int) -> list[T]:
    """Await ``calls``, at most ``concurrency`` (at least 1) at a time; results in input
    order. The first error cancels the calls not yet finished and is raised as it is
    (PageExists, not an ExceptionGroup holding it); what finished before stays done."""
    results: list[Any] = [None] * len(calls)
    sem = trio.Semaphore(max(1, concurrency))  # 0 would never start a call
    first: list[Exception] = []

    async def one(i: int) -> None:
        async with sem:
            try:
                results[i] = await calls[i]()
            except Exception as e:
                if not first:
                    first.append(e)
                n.cancel_scope.cancel()

    async with trio.open_nursery() as n:
        for i in range(len(calls)):
            n.start_soon(one, i)
    if first:
        raise first[0]
    return results


def one_buffer_per_key(keys: list[Any], into: Iterable[object] | None) -> list[Any]:
    """The buffers of a get_many: ``into`` as a list, or None for each key. Raises
    ValueError unless there is exactly one per key (checked before any read starts)."""
    bufs = list(into) if into is not None else [None] * len(keys)
    if len(bufs) != len(keys):
        raise ValueError("need one buffer per key")
    return bufs
