"""``kvfs bench <what>``: each benchmark lives in ``kvfs.bench.<what>`` with ``register``."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = ["store", "ttft", "archive", "fuse", "gds", "control"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure kvfs against baselines in the same run")
    bs = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHMARKS:
        importlib.import_module(f"kvfs.bench.{name}").register(bs)
