"""What the fast-path tests share (``test_gds.py``, ``test_gds_gpu.py``, ``test_gds_mount.py``):
page data, aligned buffers, page keys, a store with a page held only in the archive and no
room to restore it, and the striped store and :class:`gds.FastPath` fixtures.

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

__all__ = ["KiB", "MiB", "aligned", "archive_only_with_no_room", "fastpath_fixtures", "key", "rand"]

KiB = 1024
MiB = 1024 * KiB


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def aligned(n: int) -> np.ndarray:
    return np.frombuffer(kvfs.aligned_buffer(n), dtype=np.uint8)


def key(layer: int, prefix: str = "p0") -> kvfs.PageKey:
    return kvfs.PageKey.semantic("sess", prefix, layer)


def archive_only_with_no_room(
    make_config: Callable[..., kvfs.StoreConfig], archive_url: str, data: np.ndarray, **kw: Any
) -> kvfs.StoreConfig:
    """A store (one device, 4 MiB, ``make_config(**kw)``) whose key(0) holds ``data`` only in
    the archive at ``archive_url``, its capacity filled with pinned pages so that nothing
    can make room for a restore of it: a read of key(0) is served from the archive's memory
    copy. The tests of that path on the host, on a GPU and by path through a mount share it."""
    cfg = make_config(
        ndev=1,
        capacity=4 * MiB,
        archive_url=archive_url,
        extra={"archive": {"interval": 0}},
        **kw,
    )
    with kvfs.open_store_sync(cfg) as s:
        s.put(key(0), data)
        s.spill("sess")
        s.pin_session("hold")
        for i in range(1 << 20):
            try:
                s.put(kvfs.PageKey.semantic("hold", "p", i), rand(512 * KiB, seed=100 + i))
            except kvfs.CapacityExceeded:
                break
    return cfg


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
