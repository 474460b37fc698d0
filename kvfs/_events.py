"""Structured event log lines: one per spill, restore, eviction and error.

``log_event("spill", target="sessions/a", bytes=123, seconds=0.5)`` logs
``event=spill target=sessions/a bytes=123 seconds=0.500`` on the ``kvfs.events`` logger
(INFO; errors at ERROR unless a lower level is given), and attaches the fields to the record
(``kvfs_event``, ``kvfs_fields``) for handlers such as journald's. Cheap and import-light:
the engine and the archive tier call it from worker threads.
"""

from __future__ import annotations

import logging

__all__ = ["log_event"]

events = logging.getLogger("kvfs.events")


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
