"""What every ``kvfs bench`` command shares: its parser, progress lines and machine facts.

Each benchmark module defines ``register(sub)`` (called by ``cli``) and builds its parser with
:func:`new_parser` (a sweep over page sizes and client counts declares its options with
:func:`add_sweep`), prints progress with :func:`progress` (on a terminal's stderr, and not
with ``--json``, as the other commands' progress bars), warnings with :func:`log` (stderr,
always; ``--json`` output on stdout stays clean) and records :func:`machine` beside its
results, so every figure in docs/benchmarks.md says where it was measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

__all__ = [
    "WITH_PARENT",
    "DirectUse",
    "add_sweep",
    "log",
    "machine",
    "new_parser",
    "progress",
    "scratch_base",
]

#: The first lines of a helper process a benchmark starts (``python -c WITH_PARENT +
#: code``): it gets SIGTERM when the benchmark dies (PR_SET_PDEATHSIG), so a killed
#: benchmark, whose own clean-up never runs, leaves no helper behind (a server, a mount).
WITH_PARENT = """
import ctypes, signal
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
"""


def new_parser(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    doc: str | None,
    run: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """A ``kvfs bench NAME`` parser whose description is the module's docstring, with
    ``--json`` and ``run`` as its entry point; the caller adds its own options."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=partial(_run, run))
    return p


#: Whether :func:`progress` prints: set for each run by :func:`_run` (a benchmark function
#: called by itself, not through its command, shows its progress).
_progress_shown = True


def _run(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``, its progress lines shown as the other commands show their progress
    bars: on a terminal, never with ``--json`` (cli._store_cmds._progress). They came with
    ``--json`` too, and into a file or pipe that took stderr: a script asking for JSON got
    a line per round in its log."""
    global _progress_shown
    before = _progress_shown
    _progress_shown = not args.json and sys.stderr.isatty()
    try:
        return run(args)
    finally:
        _progress_shown = before


def add_sweep(
    p: argparse.ArgumentParser, *, sizes: str, clients: str, total: int, total_help: str
) -> None:
    """The ``--sizes`` / ``--clients`` comma lists and the ``--total`` MiB of a sweep over page
    sizes and client counts; each help line ends with its own default, taken from the value
    given here, so the help cannot drift from the defaults."""
    p.add_argument("--sizes", default=sizes, help=f"page sizes in MiB (default {sizes})")
    p.add_argument("--clients", default=clients, help=f"concurrent clients (default {clients})")
    p.add_argument(
        "--total", type=at_least(1), default=total, help=f"{total_help} (default {total})"
    )


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no smaller than ``low`` (a count of rounds, pages,
    clients...), so that 0 or -3 is a usage error, not a division by zero deep in a run or a
    silently different benchmark."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, not {n}")
        return n

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def positive_ints(text: str, flag: str) -> list[int]:
    """A comma list of positive integers (``--sizes 1,16``). Raises ValueError naming the
    flag."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{flag} takes positive integers separated by commas, not {text!r}")
    return out


def scratch_base(where: str | os.PathLike[str] | None, flag: str) -> Path:
    """The directory a benchmark makes its scratch directory in: ``where``, as given with
    ``flag`` (``--dir``, ``--data``), or the temporary directory for None. It must exist and
    be a directory: it is never created (a typo made a tree of parents, left behind); it
    must be writable (a read-only one failed only when the run made its scratch there, with
    "Read-only file system", exit 10, as for a failing disk); and it must not be on a kvfs
    mount (a store cannot live on one, a mount cannot serve from
    one, and the figures would be kvfs against kvfs: it failed half-way with EINVAL or
    "Directory not empty" and left its scratch on the mount). Raises ValueError, a usage
    error."""
    from kvfs._mountinfo import kvfs_mount_of

    base = Path(where) if where is not None else Path(tempfile.gettempdir())
    said = f"{flag} {where}" if where is not None else f"the temporary directory {base}"
    if not base.exists():
        raise ValueError(f"{said}: no such directory (it is not created)")
    if not base.is_dir():
        raise ValueError(f"{said}: not a directory")
    if not os.access(base, os.W_OK | os.X_OK):  # (EROFS for root too, on a read-only mount)
        raise ValueError(f"{said}: not writable (a benchmark makes its scratch directory there)")
    mp = kvfs_mount_of(base)
    if mp is not None:
        raise ValueError(
            f"{said} is on the kvfs mount {mp}: a benchmark runs its own store and compares "
            "it with the disk, so give it a directory on a disk file system"
        )
    return base


def need_room(
    where: str | os.PathLike[str] | None, nbytes: int, what: str, flag: str = "--dir"
) -> None:
    """Refuse to start a benchmark whose pages would not fit the file system it writes to
    (``where``; None: the temporary directory; ``flag`` is the option that chooses it).
    There the store's capacity eviction deleted the benchmark's own pages, and it failed
    half-way with "no page ...". Raises ValueError.
    """
    where = where or tempfile.gettempdir()
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < nbytes * 1.25:  # (the store keeps headroom, and its index grows too)
        raise ValueError(
            f"{what} writes about {nbytes / (1 << 20):.0f} MiB into {where}, which has "
            f"{free / (1 << 20):.0f} MiB free: give {flag} on a larger file system, or fewer "
            "or smaller pages"
        )


class DirectUse:
    """How a raw baseline's files were opened: :func:`kvfs._aligned.open_direct` falls back
    to buffered I/O where the file system refuses O_DIRECT (tmpfs, some overlays), and the
    "raw O_DIRECT" baseline then silently measured the page cache. ``o_direct`` (for the
    JSON) is True when every open got O_DIRECT; :meth:`warn` says so on stderr otherwise."""

    def __init__(self) -> None:
        self.refused = False

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o640) -> int:
        """An fd, with O_DIRECT where the file system takes it (see :func:`open_direct`)."""
        from kvfs._aligned import open_direct

        fd, direct = open_direct(path, flags, mode)
        if not direct:
            self.refused = True
        return fd

    @property
    def o_direct(self) -> bool:
        return not self.refused

    def warn(self, where: str | os.PathLike[str]) -> None:
        if self.refused:
            log(
                f"warning: the file system of {where} refused O_DIRECT: the raw baseline used "
                "buffered I/O (the page cache), not the device"
            )


def log(msg: str) -> None:
    """A line on stderr, flushed at once, whatever the output: a warning, say."""
    print(msg, file=sys.stderr, flush=True)


def progress(msg: str) -> None:
    """A progress line (a round begun or done) on stderr, flushed at once: only on a
    terminal and without ``--json`` (see :func:`_run`)."""
    if _progress_shown:
        log(msg)


def machine(**extra: Any) -> dict[str, Any]:
    """Where a benchmark ran: host, CPUs, kernel, Python, and what the caller adds."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        **extra,
    }
