"""Shared CLI plumbing: output as tables or JSON, progress bars, sizes, exit codes.

Exit codes (documented in docs/cli.md) are decided here and only here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import kvfs
from kvfs._control import DaemonUnavailable
from kvfs._local import is_disk_error

__all__ = [
    "EXIT",
    "Progress",
    "exit_code_for",
    "fmt_bytes",
    "fmt_time",
    "name_order",
    "print_json",
    "print_table",
    "printable",
    "to_jsonable",
]

#: Exit codes: 0 ok, 1 error, 2 bad usage, 3 not found, 4 no space, 5 corrupt data,
#: 6 store busy/locked, 7 daemon not running, 8 archive unavailable or denied, 9 refused (needs --force),
#: 10 a disk failing (an I/O error from the index's disk or a data directory's).
EXIT = {
    "ok": 0,
    "error": 1,
    "usage": 2,
    "not_found": 3,
    "no_space": 4,
    "corrupt": 5,
    "locked": 6,
    "no_daemon": 7,
    "archive": 8,
    "refused": 9,
    "disk": 10,
}


class Refused(kvfs.KvfsError):
    """An operation that would lose data was refused; ``--force`` overrides."""


class NoDaemon(kvfs.KvfsError, ConnectionError):
    """No daemon answers on the control socket."""


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a positive number of seconds is needed, not {text!r}")
    return value


def exit_code_for(e: BaseException) -> int:
    """The exit code of a command that failed with ``e``. A failing disk (``disk``) is
    IndexUnavailable, or a disk's own error (kvfs._local.DISK_ERRORS: EIO...) raised as it
    is or as the cause of a KvfsError that says it (a data directory's ``.kvfs-device``
    that cannot be read at open); a corrupt page, an archive's error and a full disk keep
    their codes."""
    table: list[tuple[type[BaseException], str]] = [
        (Refused, "refused"),
        (NoDaemon, "no_daemon"),
        (DaemonUnavailable, "no_daemon"),
        (kvfs.InvalidKey, "usage"),
        (kvfs.PageNotFound, "not_found"),
        (kvfs.SessionNotFound, "not_found"),
        (kvfs.CapacityExceeded, "no_space"),
        (kvfs.CorruptPage, "corrupt"),
        (kvfs.StoreLocked, "locked"),
        (kvfs.ArchiveUnavailable, "archive"),
        (kvfs.IndexUnavailable, "disk"),
        (FileNotFoundError, "not_found"),
        (ValueError, "usage"),
    ]
    for typ, name in table:
        if isinstance(e, typ):
            return EXIT[name]
    if is_disk_error(e) or (isinstance(e, kvfs.KvfsError) and is_disk_error(e.__cause__)):
        return EXIT["disk"]
    return EXIT["error"]


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    return obj


def name_order(name: str) -> list[Any]:
    """Sort key putting numbers in names in numeric order: ``layer-999`` before
    ``layer-1000``, ``agent-9`` before ``agent-10`` (plain string order has them the other
    way round). Digit runs and text alternate, so keys always compare."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


def print_json(obj: Any, *, line: bool = False) -> None:
    """``obj`` as indented JSON, or with ``line`` as one line (JSON Lines: a stream of
    records, such as a watch's refreshes, that a reader parses line by line)."""
    json.dump(to_jsonable(obj), sys.stdout, indent=None if line else 2, sort_keys=False)
    sys.stdout.write("\n")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 session", "3 sessions"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_duration(seconds: float) -> str:
    """``604800`` -> ``7d``: the largest unit that divides the duration, else seconds."""
    for unit, n in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:g}s"


def fmt_span(seconds: float) -> str:
    """A rough length of time: ``93784`` -> ``26h``, in the largest unit that gives 2 or more."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


def fmt_time(t: float) -> str:
    if not t:
        return "-"
    age = time.time() - t
    if age < 120:
        return f"{age:.0f}s ago"
    if age < 7200:
        return f"{age / 60:.0f}m ago"
    if age < 172800:
        return f"{age / 3600:.0f}h ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def print_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    align: str | None = None,
    file: Any = None,
    empty: str | None = None,
) -> None:
    """A plain text table: columns padded, numbers right-aligned (or per ``align``: 'l'/'r').
    With no rows, ``empty`` is printed instead where given ("no sessions"): the headers
    alone read as output cut short."""
    out = file or sys.stdout
    rows = [[("" if c is None else printable(str(c))) for c in r] for r in rows]
    if not rows and empty is not None:
        print(empty, file=out)
        return
    widths = [_width(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], _width(c))
    if align is None:
        align = "".join(
            "r" if rows and all(_numeric(r[i]) for r in rows) else "l" for i in range(len(headers))
        )

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            " " * (w - _width(c)) + c if a == "r" else c + " " * (w - _width(c))
            for c, w, a in zip(cells, widths, align, strict=False)
        ).rstrip()

    print(line(list(headers)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


def _width(s: str) -> int:
    """Terminal columns: East Asian wide and fullwidth characters take two, combining
    marks none."""
    if s.isascii():  # (every ASCII character one: a 50,000-row ls spent a third here)
        return len(s)
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        for ch in s
    )


def printable(s: str) -> str:
    """A cell or a listed name on one line: control characters (a newline in a page name)
    escaped, and so backslashes too (``a\\nb`` and ``a``, newline, ``b`` are two names, which
    printed alike)."""
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(ch if ch.isprintable() and ch != "\\" else repr(ch)[1:-1] for ch in s)


def _numeric(s: str) -> bool:
    s = s.split(" ")[0].rstrip("x%")
    try:
        float(s)
        return True
    except ValueError:
        return s in ("-", "")


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal, or when forced)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool | None = None,
        unit: str = "",
        fmt: Callable[[float], str] = str,
    ) -> None:
        self.label, self.total, self.unit, self.fmt = label, max(total, 1), unit, fmt
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.done = 0
        self._last = 0.0
        self._shown = False
        self._drawn = 0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        self._shown, self._drawn = True, self.done
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        # \x1b[K clears what a longer line drawn before left ("3.0 MiBMiB")
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {self.fmt(self.done)}/{self.fmt(self.total)}{self.unit}"
            "\x1b[K"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._shown and self._drawn != self.done:  # where it stopped (an error, say)
            self._draw()
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
