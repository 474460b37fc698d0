"""The one retry helper: exponential backoff with full jitter, bounded by a deadline.

Whether a failure is worth retrying is decided by the store's classifier (one function per
backend), never by callers: a caller gets either the result or a final error.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from kvfs._errors import ArchiveUnavailable

__all__ = ["Backoff", "retry"]

T = TypeVar("T")
log = logging.getLogger("objectstore")


@dataclass(frozen=True)
class Backoff:
    """Retry schedule: sleep ``uniform(0, min(cap, base * 2**n))`` between attempts, and give
    up when ``deadline`` seconds have passed since the first attempt."""

    base: float = 0.05
    cap: float = 2.0
    deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.base <= 0 or self.cap < self.base or self.deadline < 0:
            raise ValueError("Backoff needs 0 < base <= cap and deadline >= 0")


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    is_temporary: Callable[[BaseException], bool],
    backoff: Backoff,
    what: str,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Run ``op`` until it succeeds, a permanent error occurs, or the deadline passes.

    Raises the permanent error as it is, or ArchiveUnavailable (the last temporary error in
    ``__cause__``) when the deadline passes. ``what`` names the operation in that message.
    Cancellation is delivered between attempts and during sleeps.
    """
    start = trio.current_time()
    attempt = 0
    while True:
        try:
            return await op()
        except Exception as e:
            if not is_temporary(e):
                raise
            attempt += 1
            elapsed = trio.current_time() - start
            left = backoff.deadline - elapsed
            if left <= 0:
                raise ArchiveUnavailable(
                    f"{what}: still failing after {attempt} attempts over {elapsed:.1f}s "
                    f"({type(e).__name__}: {e})"
                ) from e
            if on_retry is not None:
                on_retry(e)
            delay = random.uniform(0, min(backoff.cap, backoff.base * 2 ** min(attempt, 30)))
            log.debug("%s failed (%s), retry %d in %.2fs", what, type(e).__name__, attempt, delay)
            await trio.sleep(min(delay, left))
