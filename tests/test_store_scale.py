"""The metadata work of a call on one session or page does not grow with the store.

Timing is not asserted (docs/benchmarks.md has the figures, "Metadata at scale"): these
tests count the SQLite work the index does for a call (virtual-machine instructions, or
statements) in a smaller store and a larger one. A call that scans every row of the store,
or runs a statement per row, costs more in the larger one; one that reads by key costs
the same. The passes over every row (the open after a crash, fsck) are checked the same
way for memory: the peak of the Python allocations they make, which is the same in both
when they hold a chunk of rows at a time, not every row.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import kvfs
from kvfs._index import SCAN_ROWS, _pack

# Slack for what the larger store may cost beyond the smaller one's (a deeper B-tree is
# the same instructions; this is far below the 4x of a scan)
SLACK = 1.5
T = TypeVar("T")


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


def _python_peak(call: Callable[[], T]) -> tuple[int, T]:
    """The peak of the Python allocations (tracemalloc) made while ``call()`` ran, and
    what it returned."""
    tracemalloc.start()
    try:
        got = call()
        return tracemalloc.get_traced_memory()[1], got
    finally:
        tracemalloc.stop()


def test_an_open_after_a_crash_and_fsck_do_not_hold_every_blob_at_once(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    # (an open after a crash held every blob row, and the names of every data file in two
    # sets and a list, at once: about 1 KB a page, 315 MB peak RSS at 250,000 pages, and
    # fsck as much). tracemalloc counts Python's allocations, not SQLite's page caches.
    cfg = make_config(ndev=2, durable=False, direct_io=False)
    n = 2 * SCAN_ROWS
    peaks = []
    for total in (n, 4 * n):
        with kvfs.open_store_sync(cfg) as store:
            have = store.statistics().pages
            store.put_many(
                (f"s{i % 4}/p{i}", i.to_bytes(8, "little") * 8) for i in range(have, total)
            )
            used = store.statistics().used_bytes
        leftover = cfg.data_dirs[1] / "blobs" / "ab" / f"leftover-{total}"
        leftover.write_bytes(b"\0" * 8192)
        db = sqlite3.connect(str(cfg.index_path))
        with db:  # as a crash leaves it: not clean, its byte count to be recounted
            db.execute("UPDATE meta SET v=? WHERE k='clean'", (_pack(False),))
            db.execute("DELETE FROM meta WHERE k='accounting'")
        db.close()
        at_open, eng = _python_peak(lambda: kvfs.Engine(cfg))
        try:
            assert eng.recovered_orphans == [str(leftover)]
            assert eng.used == used
            at_fsck, found = _python_peak(eng.fsck)
            assert not any(found.values()), found
        finally:
            eng.close()
        peaks.append((at_open, at_fsck))
    (open_n, fsck_n), (open_4n, fsck_4n) = peaks
    assert open_4n < open_n * SLACK and fsck_4n < fsck_n * SLACK, peaks


def _archive_config(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, **archive: object
) -> kvfs.StoreConfig:
    return make_config(  # type: ignore[no-any-return]
        ndev=1,
        durable=False,
        direct_io=False,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "upload_processes": 0, **archive}},
    )


def test_a_check_of_the_archive_does_not_hold_every_archived_blob_at_once(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    # (fsck --check-archive read every archived blob row at once and started a task for
    # each before the first download: about 4 KB a page, 164 MB peak RSS at 40,000 pages)
    cfg = _archive_config(make_config, tmp_path)
    n = 2 * SCAN_ROWS
    peaks = []
    with kvfs.open_store_sync(cfg) as store:
        for total in (n, 4 * n):
            for first in range(store.statistics().pages, total, n):
                store.put_many(
                    (f"s{first // n}/p{i}", i.to_bytes(8, "little") * 8)
                    for i in range(first, first + n)
                )
                store.spill(f"s{first // n}")
            assert sum(1 for _ in store.engine.index.archived_blobs()) == total
            peak, found = _python_peak(lambda: store.fsck(archive=True))
            assert not any(found.values()), found
            peaks.append(peak)
    assert peaks[1] < peaks[0] * SLACK, peaks


def test_the_statistics_of_an_archive_count_its_queue_of_deletes_without_listing_it(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    # (statistics(), which `kvfs stats` and every scrape of the metrics read, listed every
    # queued deletion of an archive object to count them: an entry for each page deleted
    # while gc_grace keeps its object, or while the archive is down)
    cfg = _archive_config(make_config, tmp_path, gc_grace=3600)
    n = SCAN_ROWS // 2
    peaks = []
    with kvfs.open_store_sync(cfg) as store:
        deleted = 0
        for total in (n, 4 * n):
            for s in range(deleted // n, total // n):
                store.put_many((f"s{s}/p{i}", os.urandom(64)) for i in range(n))
                store.spill(f"s{s}")
                store.delete_session(f"s{s}")
            deleted = total
            peak, stats = _python_peak(store.statistics)
            assert stats.extra["archive"]["pending_deletes"] == total
            peaks.append(peak)
    assert peaks[1] < peaks[0] * SLACK, peaks


def test_listing_archived_sessions_and_collecting_do_not_hold_every_manifest_at_once(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    # (archived_sessions() and a collection's read of the manifests parsed every manifest
    # into one dict before using any: in proportion to every archived page, ~700 bytes
    # each; a collection did that after every delete on a file:// archive)
    cfg = _archive_config(make_config, tmp_path, concurrency=2)
    per_session, n = 256, 2 * SCAN_ROWS
    peaks = []
    with kvfs.open_store_sync(cfg) as store:
        pol = store.engine._archive()
        for total in (n, 4 * n):
            for first in range(len(store.list(path_prefix="s")), total, per_session):
                s = f"s{first // per_session:03d}"
                store.put_many(
                    (f"{s}/p{i}", i.to_bytes(8, "little") * 8)
                    for i in range(first, first + per_session)
                )
                store.spill(s)
            at_ls, listed = _python_peak(store.archived_sessions)
            assert sorted(x["session"] for x in listed) == sorted(
                f"s{i:03d}" for i in range(total // per_session)
            )
            assert sum(int(x["pages"]) for x in listed) == total
            # a page put and spilled, then deleted: its object waits in the queue
            store.put("gone/p", total.to_bytes(8, "little") * 16)
            store.spill("gone")
            gone = tmp_path / "archive" / "blobs" / store.stat("gone/p").checksum
            assert gone.exists()
            # (no background task: the delete collects the object, for at most
            # sync_cleanup_seconds)
            at_flush, _ = _python_peak(lambda: store.delete_session("gone"))
            assert pol.aindex.pending_count("forget") == 0
            assert not gone.exists()
            peaks.append((at_ls, at_flush))
    (ls_n, flush_n), (ls_4n, flush_4n) = peaks
    assert ls_4n < ls_n * SLACK and flush_4n < flush_n * SLACK, peaks


def test_a_collection_reads_its_queue_of_deletes_in_chunks(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a collection took every queued deletion at once, and named them all in one intent:
    # the queue holds an entry for every page deleted while gc_grace or an archive outage
    # held its object. Here deletions whose objects are already gone, as a crash between
    # the delete and the queue's update leaves them)
    import kvfs._spill

    n = 2048  # (chunks of it here, not of 50,000: the same code at a size a test can fill)
    monkeypatch.setattr(kvfs._spill, "COLLECT_ROWS", n)
    cfg = _archive_config(make_config, tmp_path)
    peaks = []
    with kvfs.open_store_sync(cfg) as store:
        store.put("kept/p", b"k" * 64)
        store.spill("kept")
        pol = store.engine._archive()
        for total in (n, n, 4 * n):  # (the first sets up what a first collection does, once)
            pol.aindex.enqueue("forget", [os.urandom(32).hex() for _ in range(total)])
            peak, _ = _python_peak(lambda: pol.call(pol.spiller.flush_pending))
            assert pol.aindex.pending_count("forget") == 0
            peaks.append(peak)
        assert store.get("kept/p") == b"k" * 64
    assert peaks[2] < peaks[1] * SLACK, peaks
