"""The metadata work of a call on one session or page does not grow with the store.

Timing is not asserted (docs/benchmarks.md has the figures, "Metadata at scale"): these
tests count the SQLite work the index does for a call (virtual-machine instructions, or
statements) in a smaller store and a larger one. A call that scans every row of the store,
or runs a statement per row, costs more in the larger one; one that reads by key costs
the same.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterator

import kvfs

# Slack for what the larger store may cost beyond the smaller one's (a deeper B-tree is
# the same instructions; this is far below the 4x of a scan)
SLACK = 1.5


@contextlib.contextmanager
def sqlite_steps(store: kvfs.SyncStore) -> Iterator[list[int]]:
    """Count, in ``[0]``, the SQLite instructions the store's index runs on its writer
    connection and on this thread's reader (the sync facade calls on the caller's thread)."""
    index = store.engine.index
    count = [0]

    def step() -> int:
        count[0] += 1
        return 0

    conns: list[sqlite3.Connection] = [index._db, index._reader()]
    for db in conns:
        db.set_progress_handler(step, 1)
    try:
        yield count
    finally:
        for db in conns:
            db.set_progress_handler(None, 1)


def _fill(store: kvfs.SyncStore, first: int, n: int) -> None:
    """``n`` pages of distinct content in sessions of 10, numbered from ``first``."""
    store.put_many(
        (f"sessions/s{i // 10:05d}/p/layer-{i % 10:03d}", i.to_bytes(8, "little") * 8)
        for i in range(first, first + n)
    )


def _steps_at_n_and_4n(
    make_config: Callable[..., kvfs.StoreConfig], call: Callable[[kvfs.SyncStore, str], object]
) -> tuple[int, int]:
    """The instructions ``call(store, session)`` ran on a session of 4 pages, beside n and
    beside 4n other pages."""
    out = []
    with kvfs.open_store_sync(make_config(ndev=1)) as store:
        n = 300
        for total, target in ((n, "target-a"), (4 * n, "target-b")):
            _fill(store, len(store.list(path_prefix="sessions/s")), total - n * (total > n))
            for layer in range(4):
                store.put(kvfs.PageKey.semantic(target, "p", layer), os.urandom(64))
            with sqlite_steps(store) as steps:
                call(store, target)
            out.append(steps[0])
    return out[0], out[1]


def test_evicting_a_session_does_not_read_every_blob_of_the_store(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    # (it read every local blob row of the store to learn which of the session's were
    # evictable: 3 s for a 40-page session among 250,000 pages)
    small, big = _steps_at_n_and_4n(make_config, lambda s, t: s.evict(session=t))
    assert big < small * SLACK, (small, big)


def test_listing_a_directory_reads_its_pages_in_one_statement(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    # (it read each page's blob row with a query of its own: 50,000 statements for
    # `kvfs ls` of one LMCache directory)
    counts = []
    with kvfs.open_store_sync(make_config(ndev=1)) as store:
        reader = store.engine.index._reader()
        for n in (50, 100):
            store.put_many((f"engine/c-{i:04d}", i.to_bytes(8, "little")) for i in range(n - 50, n))
            statements: list[str] = []
            reader.set_trace_callback(statements.append)
            try:
                by_session = store.list(session="engine")
                by_prefix = store.list(path_prefix="engine/c-")
            finally:
                reader.set_trace_callback(None)
            assert len(by_session) == len(by_prefix) == n
            counts.append(len(statements))
    assert counts[0] == counts[1], counts
