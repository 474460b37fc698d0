"""What the fast-path tests share (``test_gds.py`` and ``test_gds_gpu.py``): page data,
aligned buffers, page keys, and the striped store and :class:`gds.FastPath` fixtures.

A module declares the two fixtures in one line, with the reader threads it wants::

    store, fp = fastpath_fixtures(threads=4)

(assigned, not imported by name: a test parameter named like an imported fixture reads to
ruff as a redefinition of an unused import).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import gds
import kvfs

__all__ = ["KiB", "MiB", "aligned", "fastpath_fixtures", "key", "rand"]

KiB = 1024
MiB = 1024 * KiB


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def aligned(n: int) -> np.ndarray:
    return np.frombuffer(kvfs.aligned_buffer(n), dtype=np.uint8)


def key(layer: int, prefix: str = "p0") -> kvfs.PageKey:
    return kvfs.PageKey.semantic("sess", prefix, layer)


def fastpath_fixtures(threads: int) -> tuple[Any, Any]:
    """The fixtures ``store`` (three devices and a tiny stripe unit: every page over 64 KiB is
    striped) and ``fp`` (a :class:`gds.FastPath` with ``threads`` readers on that store)."""

    @pytest.fixture
    def store(make_config: Callable[..., kvfs.StoreConfig]) -> Iterator[kvfs.SyncStore]:
        with kvfs.open_store_sync(make_config(ndev=3, stripe_unit=64 * KiB)) as s:
            yield s

    @pytest.fixture
    def fp(store: kvfs.SyncStore) -> Iterator[gds.FastPath]:
        with gds.FastPath(store, threads=threads) as f:
            yield f

    return store, fp
