"""What every ``kvfs bench`` command shares: its parser, progress lines and machine facts.

Each benchmark module defines ``register(sub)`` (called by ``cli``) and builds its parser with
:func:`new_parser`, prints progress with :func:`log` (stderr, so ``--json`` output on stdout
stays clean) and records :func:`machine` beside its results, so every figure in
docs/benchmarks.md says where it was measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["log", "machine", "new_parser"]


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
    p.set_defaults(func=run)
    return p


def log(msg: str) -> None:
    """A progress line on stderr, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


def machine(**extra: Any) -> dict[str, Any]:
    """Where a benchmark ran: host, CPUs, kernel, Python, and what the caller adds."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        **extra,
    }
