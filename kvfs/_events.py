"""Structured event log lines: one per spill, restore, eviction and error.

``log_event("spill", target="sessions/a", bytes=123, seconds=0.5)`` logs
``event=spill target=sessions/a bytes=123 seconds=0.500`` on the ``kvfs.events`` logger
(INFO; errors at ERROR unless a lower level is given), and attaches the fields to the record
(``kvfs_event``, ``kvfs_fields``) for handlers such as journald's. Cheap and import-light:
the engine and the archive tier call it from worker threads.

:func:`disk_error_due` is the one limiter for a failing disk's errors, which every request
meets while it lasts: the mount (:mod:`kvfs._fuse_guard`), the control channel and the
archive's background passes (:mod:`kvfs._spill`) each log one line per
DEVICE_ERROR_LOG_SECONDS, counting the rest. :func:`files_error_due` is the same for a
daemon out of file descriptors (EMFILE, ENFILE).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable

__all__ = [
    "DEVICE_ERROR_LOG_SECONDS",
    "Throttle",
    "disk_error_due",
    "files_error_due",
    "log_event",
]

events = logging.getLogger("kvfs.events")

#: a failing disk fails every request: one line per this many seconds, with a count
DEVICE_ERROR_LOG_SECONDS = 10.0


def log_event(event: str, *, level: int | None = None, **fields: object) -> None:
    """Log one event line. Never raises for odd field values (they are ``str()``-ed)."""
    if level is None:
        level = logging.ERROR if event == "error" else logging.INFO
    if not events.isEnabledFor(level):
        return
    text = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
    events.log(
        level, "event=%s %s", event, text, extra={"kvfs_event": event, "kvfs_fields": fields}
    )


def _value(v: object) -> str:
    s = f"{v:.3f}" if isinstance(v, float) else str(v)
    return f'"{s}"' if (" " in s or not s) else s


class Throttle:
    """One log line per ``seconds``, the lines between counted: for an error that comes
    back with every request (a failing disk's), where a line each flooded the log."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._last = -math.inf
        self._held = 0
        self._lock = threading.Lock()

    def due(self) -> int | None:
        """None: hold this line back (it is counted). Otherwise log it: the number of lines
        held back since the last one logged (0: none)."""
        with self._lock:
            now = self._clock()
            if now - self._last < self.seconds:
                self._held += 1
                return None
            held, self._last, self._held = self._held, now, 0
            return held


#: per owner (a mount's Operations, a control channel's store), per kind of error
#: ("disk", "files"): its throttle
_throttles: weakref.WeakKeyDictionary[object, dict[str, Throttle]] = weakref.WeakKeyDictionary()
_throttles_lock = threading.Lock()


def _due(owner: object, kind: str) -> int | None:
    with _throttles_lock:
        mine = _throttles.setdefault(owner, {})
        throttle = mine.get(kind)
        if throttle is None:
            throttle = mine[kind] = Throttle(DEVICE_ERROR_LOG_SECONDS)
    return throttle.due()


def disk_error_due(owner: object) -> int | None:
    """:meth:`Throttle.due` for a failing disk's error answered by ``owner`` (the mount
    and the control channel each say it in their own log, one line per
    DEVICE_ERROR_LOG_SECONDS)."""
    return _due(owner, "disk")


def files_error_due(owner: object) -> int | None:
    """:meth:`Throttle.due` for an error ``owner`` answered because the process ran out of
    file descriptors (EMFILE, ENFILE: every request that opens a file meets it while it
    lasts), counted apart from a disk's."""
    return _due(owner, "files")


def threads_error_due(owner: object) -> int | None:
    """:meth:`Throttle.due` for an error ``owner`` answered because no thread could be
    started (a cgroup's pids.max, RLIMIT_NPROC), counted apart from the others."""
    return _due(owner, "threads")
