"""Run calls concurrently and raise the first error as it is (no ExceptionGroup); the
async clients' batched put and get, built on it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import operator
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import trio

from ._aligned import as_bytes_view
from ._keys import as_key
from ._types import PageInfo

T = TypeVar("T")


def calls_at_once(concurrency: object, n: int) -> int:
    """How many of ``n`` calls a batch runs at once for ``concurrency`` (an int; 0 or less
    is 1). Raises TypeError for anything else: None and 2.5 failed deep in the batch with
    "'<' not supported" or trio's "initial_value must be an int"."""
    if isinstance(concurrency, bool) or not hasattr(concurrency, "__index__"):
        raise TypeError(f"concurrency is an int, not {concurrency!r}")
    return max(1, min(operator.index(concurrency), n or 1))


async def gather_first_error(calls: list[Callable[[], Awaitable[T]]], concurrency: int) -> list[T]:
    """Await ``calls``, at most ``concurrency`` (at least 1) at a time; results in input
    order. The first error cancels the calls not yet finished and is raised as it is
    (PageExists, not an ExceptionGroup holding it); what finished before stays done."""
    results: list[Any] = [None] * len(calls)
    sem = trio.Semaphore(calls_at_once(concurrency, len(calls)))  # (0 would start none)
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
    spans = []
    for i, b in enumerate(bufs):
        if b is not None:
            with _naming(i, keys[i]):
                mv = as_bytes_view(b, "the buffer to read into", writable=True)
            if mv.nbytes:
                at = ctypes.addressof(ctypes.c_char.from_buffer(mv))
                spans.append((at, at + mv.nbytes, i))
    spans.sort()
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:  # both reads would land there, each checked against the other's bytes
            raise ValueError(f"the buffers of items {min(i, j)} and {max(i, j)} overlap")
    return bufs


def pairs(items: Iterable[Any]) -> list[tuple[Any, object]]:
    """``put_many``'s items as (key, data) pairs, checked before any put: each a pair, of a
    valid key (no other item's) and a buffer. Raises TypeError, ValueError, InvalidKey,
    naming the item; nothing is stored then."""
    out = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"put_many takes (key, data) pairs; item {i} is {item!r:.80}")
        with _naming(i, item[0]):
            path = as_key(item[0]).path
            as_bytes_view(item[1])
        if path in seen:  # which put wins would depend on timing
            raise ValueError(f"put_many item {i} repeats the key of item {seen[path]}: {path!r}")
        seen[path] = i
        out.append((item[0], item[1]))
    return out


@contextlib.contextmanager
def _naming(i: int, key: object) -> Iterator[None]:
    """An argument error about one item of a batch, said of that item."""
    try:
        yield
    except (TypeError, ValueError) as e:  # InvalidKey is a ValueError
        raise type(e)(f"item {i} ({key!s:.200}): {e}") from None


class BatchCalls:
    """``put_many``/``get_many`` over a class's own ``put``/``get`` (Store, RemoteStore)."""

    put: Callable[..., Awaitable[PageInfo]]
    get: Callable[..., Awaitable[bytes | int]]

    async def put_many(
        self,
        items: Iterable[tuple[Any, object]],
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
        concurrency: int = 4,
    ) -> list[PageInfo]:
        """Put several pages concurrently; results in input order. Every item is checked
        first (see :func:`pairs`): a bad one stores nothing. The first error cancels
        the rest and is raised as it is: the pages stored before it stay stored, and which
        of the others were depends on timing (``exists`` says)."""
        return await gather_first_error(
            [
                functools.partial(self.put, k, d, attrs=attrs, pin=pin, replace=replace)
                for k, d in pairs(items)
            ],
            concurrency,
        )

    async def get_many(
        self, keys: Iterable[Any], into: Iterable[object] | None = None, *, concurrency: int = 4
    ) -> list[bytes | int]:
        """Get several pages concurrently, optionally each into its own buffer (one per key,
        else ValueError before any read)."""
        ks = list(keys)
        bufs = one_buffer_per_key(ks, into)
        return await gather_first_error(
            [functools.partial(self.get, k, b) for k, b in zip(ks, bufs, strict=True)],
            concurrency,
        )
