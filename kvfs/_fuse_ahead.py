"""Daemon-side read-ahead for one open page.

The kernel sends a sequential reader's requests one or two at a time, so each would wait for
one disk read and one checksum at a time. A page is immutable, so the bytes after a
sequential read can be fetched (and verified) before they are asked for; the next requests
are then answered from memory. The window is refilled both when a request arrives and when
a fetch completes (the reader may be waiting on the kernel, sending nothing), with at most
MAX_FETCHES fetches of one file in flight, so the disk streams a page without the first
request's fetch competing with many others. Fetches run as tasks in the mount's nursery;
what a closed file had prefetched is dropped. A failed prefetch is forgotten: the request
reads again and reports its own error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["AheadBudget", "ReadAhead"]

#: Prefetches are fetched this many requests at a time (one thread hop, one larger pread and
#: the leaves hashed together), and each request is then answered with its slice.
GROUP = 4
#: Fetches of one open file in flight at once. Measured with O_DIRECT fetches on the dev VM
#: (scripts/fuse_cold_cpu.py, depth 16): 2 and 3 read 64 MiB pages alike, 2 reads 16 MiB
#: pages faster (the first request's fetch waits behind fewer others).
MAX_FETCHES = 2

log = logging.getLogger("kvfs.fuse")


class _Slot:
    __slots__ = ("data", "done", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self.data: Any = None
        self.done = trio.Event()


class AheadBudget:
    """Bytes prefetched (or being fetched) and not yet asked for, over every open file of a
    mount. Read-ahead stops at ``limit``: an engine that holds many pages open and reads
    only the start of each (a safetensors header) must not make the daemon hold a window
    for every one of them. Touched only from the trio thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0


class ReadAhead:
    """Prefetch up to ``depth`` requests past the last sequential read of a ``size``-byte page,
    in fetches that end at multiples of ``align`` (the stripe unit) where requests allow,
    while the mount's ``budget`` has room."""

    def __init__(
        self,
        fetch: Callable[[int, int], Awaitable[Any]],
        size: int,
        depth: int,
        nursery: trio.Nursery,
        align: int = 0,
        budget: AheadBudget | None = None,
    ) -> None:
        self._budget = budget or AheadBudget(1 << 62)
        self._fetch = fetch
        self._align = align
        self._size = size
        self._depth = depth
        self._nursery = nursery
        self._slots: dict[int, _Slot] = {}
        self._last_end = 0
        self._ahead_end = 0
        self._closed = False
        self._fetching = 0
        self._sequential = False
        self._n = 0  # the sequential reader's request size

    async def read(self, off: int, n: int) -> Any:
        slot = self._slots.pop(off, None)
        if slot is not None:
            self._budget.held -= slot.n
        sequential = slot is not None or off in (0, self._last_end)
        if not sequential:
            self._drop()  # fetches in flight finish; their results are dropped
            self._ahead_end = 0
        self._last_end = max(self._last_end, off + n) if sequential else off + n
        self._sequential, self._n = sequential and n > 0, n
        if self._sequential:
            self._schedule(off + n, n)
        if slot is not None and slot.n == n:
            if not slot.done.is_set():  # already in: answer without a trip through the loop
                await slot.done.wait()
            if slot.data is not None:
                return slot.data
        return await self._fetch(off, n)

    def _schedule(self, start: int, n: int) -> None:
        pos = max(start, self._ahead_end)
        limit = min(self._size, start + self._depth * n)
        group = max(1, min(GROUP, self._depth // 2))
        # Whole groups only, except at the end of the page: the window refills in steps.
        while (
            pos < limit
            and (limit - pos >= group * n or limit == self._size)
            and self._fetching < MAX_FETCHES
            and self._budget.held + min(group * n, limit - pos) <= self._budget.limit
        ):
            slots: list[_Slot] = []
            while pos < limit and len(slots) < group:
                slot = _Slot(n)
                self._slots[pos] = slot
                self._budget.held += n
                slots.append(slot)
                pos += n
                if self._align > n and pos % self._align == 0:
                    break  # a fetch within one stripe unit: one pread, no joining of pieces
            self._fetching += 1
            self._nursery.start_soon(self._fill, pos - len(slots) * n, slots)
        self._ahead_end = max(self._ahead_end, pos)

    async def _fill(self, off: int, slots: list[_Slot]) -> None:
        try:
            if not self._closed:
                n = slots[0].n
                data = memoryview(await self._fetch(off, n * len(slots)))
                for i, slot in enumerate(slots):
                    slot.data = data[i * n : (i + 1) * n]
        except Exception as e:  # the request itself will read again and report it
            log.debug("read-ahead at %d failed: %s", off, e)
        finally:
            self._fetching -= 1
            for slot in slots:
                slot.done.set()
            if self._sequential and not self._closed:
                self._schedule(self._last_end, self._n)

    def _drop(self) -> list[_Slot]:
        """Forget every prefetched request (and give its room back); returns them."""
        slots, self._slots = list(self._slots.values()), {}
        self._budget.held -= sum(slot.n for slot in slots)
        return slots

    async def aclose(self) -> None:
        """Stop prefetching and wait for fetches in flight (they read under the file's lease)."""
        self._closed = True
        for slot in self._drop():
            await slot.done.wait()
