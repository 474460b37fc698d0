"""Spill uploads in worker processes (kvfs/_uploader.py): a worker killed mid-spill costs a
retry on a fresh worker, never a page; local copies go only after a confirmed upload; the
in-process mode (``upload_processes = 0``) still spills and restores. S3 is moto over HTTP,
through a TCP proxy that a test takes down to hold a spill in flight."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _corrupt import CLEAN_FSCK

import kvfs
from kvfs import PageKey

KiB = 1024


def page(i: int) -> bytes:
    rng = np.random.default_rng(i)
    return (rng.standard_normal(64 * KiB) * 0.5).astype(np.float16).tobytes()


def wait_for(cond: Callable[[], bool], what: str) -> None:
    """Poll until ``cond()`` holds; a generous bound only turns a hang into a failure."""
    end = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def start_call(fn: Callable[[str], object], session: str) -> tuple[threading.Thread, list[object]]:
    """Run ``fn(session)`` (a spill or a restore) in a thread; its result or error lands in
    the list."""
    result: list[object] = []

    def call() -> None:
        try:
            result.append(fn(session))
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            result.append(e)

    t = threading.Thread(target=call)
    t.start()
    return t, result


def kill_workers_mid_job(s: kvfs.SyncStore) -> None:
    uploads = s.engine.policy.uploads  # type: ignore[attr-defined]
    wait_for(lambda: uploads.running() > 0 and uploads.pids(), "an upload job in a worker")
    for pid in uploads.pids():
        os.kill(pid, signal.SIGKILL)


def behind_proxy(  # noqa: ANN001
    proxy, make_config, bucket: str, ndev: int, name: str = "store", **archive: object
) -> kvfs.StoreConfig:
    """A store whose archive ``bucket`` is reached through the test's TCP proxy (to take
    it down), retrying for up to a minute."""
    url = f"s3://{bucket}?endpoint={proxy.endpoint}&deadline=60&connect_timeout=1"
    return make_config(
        ndev=ndev, name=name, archive_url=url, extra={"archive": {"interval": 0, **archive}}
    )


def all_local(s: kvfs.SyncStore, session: str) -> bool:
    info = s.session_info(session)
    return info.local_bytes == info.bytes and all(
        i.tier == "local" for i in s.list(session=session)
    )


def test_worker_killed_mid_spill_is_replaced_and_nothing_is_lost(
    s3_server, proxy, make_config
) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    cfg = behind_proxy(proxy, make_config, bucket, ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        for i in range(8):
            s.put(PageKey.semantic("cold", "p", i), page(i), attrs={"dtype": "fp16"})
        restarts = s.engine.policy.uploads.restarts  # type: ignore[attr-defined]
        proxy.down()  # the spill's uploads wait in the workers, retrying
        t, result = start_call(s.spill, "cold")
        kill_workers_mid_job(s)
        assert not result, "the spill finished while the endpoint was down"
        assert all_local(s, "cold")  # nothing dropped without a confirmed upload
        proxy.up()
        t.join(timeout=120)
        assert not t.is_alive()
        assert isinstance(result[0], int) and result[0] > 0, result
        assert s.engine.policy.uploads.restarts > restarts  # type: ignore[attr-defined]
        assert s.session_info("cold").local_bytes == 0
        assert len(s3_server.keys(bucket, "blobs/")) == 8
        for i in range(8):
            assert s.get(PageKey.semantic("cold", "p", i)) == page(i)
        assert s.fsck()["orphans"] == []


def test_a_sigterm_to_the_process_group_leaves_the_workers_to_their_store(
    s3_server, proxy, make_config
) -> None:  # noqa: ANN001
    """A SIGTERM to the daemon's whole process group (systemd's stop, ``kill -- -PGID``)
    reaches its upload workers too: it killed them mid-upload, under a daemon about to
    close its store. They leave stopping to the store, as for Ctrl-C."""
    bucket = s3_server.new_bucket()
    cfg = behind_proxy(proxy, make_config, bucket, ndev=1)
    with kvfs.open_store_sync(cfg) as s:
        for i in range(8):
            s.put(PageKey.semantic(f"s{i % 2}", "p", i), page(i), attrs={"dtype": "fp16"})
        uploads = s.engine.policy.uploads  # type: ignore[attr-defined]
        s.spill("s0")  # workers that have answered: past their start, serving
        pids, restarts = uploads.pids(), uploads.restarts
        proxy.down()  # the spill's uploads wait in the workers, retrying
        t, result = start_call(s.spill, "s1")
        wait_for(lambda: uploads.running() > 0, "an upload job in a worker")
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        proxy.up()
        t.join(timeout=120)
        assert isinstance(result[0], int) and result[0] > 0, result
        assert uploads.restarts == restarts  # no job's worker died
        for pid in pids:
            os.kill(pid, 0)  # (ProcessLookupError: it died)
        assert len(s3_server.keys(bucket, "blobs/")) == 8


def test_worker_dying_twice_fails_the_spill_and_drops_nothing(
    s3_server, proxy, make_config
) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    cfg = behind_proxy(proxy, make_config, bucket, ndev=1, upload_processes=1)
    with kvfs.open_store_sync(cfg) as s:
        for i in range(4):
            s.put(PageKey.semantic("a", "p", i), page(i))
        proxy.down()
        t, result = start_call(s.spill, "a")
        kill_workers_mid_job(s)
        wait_for(lambda: s.engine.policy.uploads.restarts > 0, "the first retry")  # type: ignore[attr-defined]
        kill_workers_mid_job(s)
        t.join(timeout=120)
        assert not t.is_alive()
        assert isinstance(result[0], kvfs.ArchiveUnavailable), result
        assert all_local(s, "a")
        assert s.session_info("a").archived_bytes == 0
        proxy.up()
        assert s.spill("a") > 0  # a fresh worker takes the next spill
        assert s.session_info("a").local_bytes == 0
        for i in range(4):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)


def test_corrupt_local_copy_is_not_uploaded_by_a_worker(s3_server, make_config) -> None:  # noqa: ANN001
    from _corrupt import flip_stored_byte

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    cfg = make_config(ndev=1, archive_url=url, extra={"archive": {"interval": 0}})
    with kvfs.open_store_sync(cfg) as s:
        k = PageKey.semantic("bad", "p", 0)
        s.put(k, page(0))
        flip_stored_byte(s.stat(k), 100)
        with pytest.raises(kvfs.CorruptPage):
            s.spill("bad")
        assert s3_server.keys(bucket, "blobs/") == []
        assert s.stat(k).tier == "local"


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "workers"])
def test_what_a_failed_spill_stored_is_collected_with_its_session(
    s3_server,  # noqa: ANN001
    make_config,  # noqa: ANN001
    processes: int,
) -> None:
    """A spill that fails part-way (here: one damaged local page) has stored some objects;
    deleting the session collects them (they were never recorded, so nothing ever deleted
    them: leaked, with threads and with workers, whose other batches were abandoned)."""
    from _corrupt import flip_stored_byte

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    cfg = make_config(
        ndev=1,
        archive_url=url,
        extra={
            "archive": {
                "interval": 0,
                "upload_processes": processes,
                "gc_grace": 0,
                "concurrency": 1,
            }
        },
    )
    with kvfs.open_store_sync(cfg) as s:
        for i in range(8):
            s.put(PageKey.semantic("victim", "p", i), page(i))
        flip_stored_byte(s.stat(PageKey.semantic("victim", "p", 7)), 100)
        # The damaged page can be the first one read (the order is not fixed): then nothing
        # was stored and the spill is tried again (what a failed one stored stays recorded).
        for _ in range(10):
            with pytest.raises(kvfs.CorruptPage):
                s.spill("victim")
            if s3_server.keys(bucket, "blobs/"):
                break
        assert s3_server.keys(bucket, "blobs/")  # some were stored before it stopped
        s.delete_session("victim")
        policy = s.engine.policy  # type: ignore[attr-defined]
        policy.call(policy.spiller.flush_pending)
        assert s3_server.keys(bucket, "blobs/") == []


def disk_and_failing_disk(
    tmp_path: Path,
    loop_disk,  # noqa: ANN001
    processes: int,
    concurrency: int,
) -> tuple[kvfs.StoreConfig, Path]:
    """A store on a plain directory and ``loop_disk`` (which a test shuts down to fail with
    EIO), archiving to a ``file://`` directory: (its config, the archive directory)."""
    archive = tmp_path / "archive"
    cfg = kvfs.StoreConfig(
        data_dirs=(tmp_path / "d0", loop_disk.path / "data"),
        archive_url=f"file://{archive}",
        extra={
            "archive": {
                "interval": 0,
                "upload_processes": processes,
                "concurrency": concurrency,
            }
        },
    )
    return cfg, archive


def put_pages(s: kvfs.SyncStore, n: int) -> None:
    """Pages ``a/p0`` ... of 100,000 bytes each, the same bytes in every run."""
    import random

    for i in range(n):
        s.put(f"a/p{i}", random.Random(i).randbytes(100_000))


def test_what_a_spill_failed_by_a_disk_error_stored_is_collected_with_its_session(
    tmp_path: Path,
    loop_disk,  # noqa: ANN001
) -> None:
    """One page of the session is on a disk that fails (EIO), between two on a disk that
    works. A worker's batch answered nothing when a job's error was not one it returned
    (the archive's, a checksum's): the object it had stored for the page before was never
    recorded, and deleting the session left it in the archive for good."""
    from _archive_dir import objects

    # one job at a time: the batch (one) takes its pages in checksum order, forwards or
    # backwards (trio's scheduling), so a page of the working disk always goes first
    cfg, archive = disk_and_failing_disk(tmp_path, loop_disk, processes=1, concurrency=1)
    with kvfs.open_store_sync(cfg) as s:
        put_pages(s, 16)
        order = sorted(
            (s.stat(k).checksum, s.stat(k).extents[0].device, k)
            for k in (f"a/p{i}" for i in range(16))
        )
        devs = [d for _, d, _ in order]
        mid = next(i for i, d in enumerate(devs) if d == 1 and 0 in devs[:i] and 0 in devs[i + 1 :])
        keep = {
            order[mid][2],
            next(k for _, d, k in reversed(order[:mid]) if d == 0),
            next(k for _, d, k in order[mid + 1 :] if d == 0),
        }
        for k in [k for _, _, k in order if k not in keep]:
            s.delete(k)
        os.sync()
        loop_disk.shut_down()
        with pytest.raises(OSError) as e:
            s.spill("a")
        assert not isinstance(e.value, kvfs.KvfsError)
        assert len(objects(archive)) == 1  # the page read before the failing one
        stored = next(k for k in keep if s.stat(k).checksum in objects(archive))
        assert s.stat(stored).tier == "local+archive"  # recorded: nothing dropped
        assert {s.stat(k).tier for k in keep - {stored}} == {"local"}
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        s.delete_session("a")  # (collected at once: no background task, no gc_grace)
        assert objects(archive) == set()


def test_an_upload_in_this_process_under_way_when_another_fails_is_recorded(
    tmp_path: Path,
    loop_disk,  # noqa: ANN001
) -> None:
    """Uploads in this process (no workers), side by side: one page's read fails (its
    disk's EIO) while another is under way. The first error cancelled the other upload:
    before its object was stored, or once it had landed but before it was recorded, and
    then deleting the session left the object in the archive for good. The other upload
    finishes now, and is recorded."""
    import trio
    from _archive_dir import objects

    cfg, archive = disk_and_failing_disk(tmp_path, loop_disk, processes=0, concurrency=2)
    with kvfs.open_store_sync(cfg) as s:
        put_pages(s, 8)
        by_dev: dict[int, str] = {}
        for i in range(8):
            by_dev.setdefault(s.stat(f"a/p{i}").extents[0].device, f"a/p{i}")
        for i in range(8):
            if f"a/p{i}" not in by_dev.values():
                s.delete(f"a/p{i}")
        works, fails = by_dev[0], by_dev[1]
        store = s.engine.policy.store  # type: ignore[attr-defined]
        real_put = store.put

        async def put_then_linger(key: str, *args: object, **kw: object) -> object:
            stored = await real_put(key, *args, **kw)
            # (the other page's read fails meanwhile: a cancel here lost the record)
            await trio.sleep(1)
            return stored

        store.put = put_then_linger
        os.sync()
        loop_disk.shut_down()
        with pytest.raises(OSError) as e:
            s.spill("a")
        assert not isinstance(e.value, kvfs.KvfsError)
        assert objects(archive) == {s.stat(works).checksum}
        assert s.stat(works).tier == "local+archive"  # recorded: nothing dropped
        assert s.stat(fails).tier == "local"
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        s.delete_session("a")  # (collected at once: no background task, no gc_grace)
        assert objects(archive) == set()


def test_a_session_deleted_while_it_spills_leaves_nothing_in_the_archive(
    s3_server,  # noqa: ANN001
    make_config,  # noqa: ANN001
) -> None:
    """An engine's rm races a spill: the objects uploaded for pages deleted meanwhile are
    collected (they stayed forever: a blob's object is forgotten only once it is recorded as
    archived, which a deleted blob never was)."""
    import trio

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    cfg = make_config(
        ndev=1,
        archive_url=url,
        extra={"archive": {"interval": 0, "upload_processes": 0, "gc_grace": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        for i in range(6):
            s.put(PageKey.semantic("victim", "p", i), page(i))
        policy = s.engine.policy  # type: ignore[attr-defined]
        real_put, gate, reached = policy.store.put, threading.Event(), threading.Event()

        async def gated(key: str, data: bytes, **kw: object) -> object:
            r = await real_put(key, data, **kw)
            if key.startswith("blobs/"):
                reached.set()
                await trio.to_thread.run_sync(gate.wait)
            return r

        policy.store.put = gated
        t, result = start_call(s.spill, "victim")
        assert reached.wait(30)
        s.delete_session("victim")
        gate.set()
        t.join(60)
        policy.store.put = real_put
        policy.call(policy.spiller.flush_pending)
        assert s3_server.keys(bucket, "blobs/") == [], result


@pytest.mark.parametrize(
    ("processes", "direct"),
    [(0, True), (1, True), (1, False)],
    ids=["threads", "workers", "buffered"],
)
def test_spill_and_restore_with_or_without_workers(
    s3_server, make_config, processes: int, direct: bool
) -> None:  # noqa: ANN001
    """Both modes spill and restore, and fsck finds the restored files sound; so do workers
    for a store configured without O_DIRECT (``direct_io=False``): they write the files with
    the store's own settings."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/kv?endpoint={s3_server.endpoint}"
    cfg = make_config(
        ndev=2,
        archive_url=url,
        direct_io=direct,
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(cfg) as s:
        data = {PageKey.semantic("s", "p", i): page(i) for i in range(6)}
        for k, v in data.items():
            s.put(k, v, attrs={"dtype": "fp16"})
        s.put(PageKey.semantic("t", "p", 0), page(0))  # shared content: one object
        spilled: list[tuple[int, int]] = []
        size = sum(map(len, data.values()))
        assert 0 < s.spill("s", progress=lambda d, t: spilled.append((d, t))) < size  # compressed
        assert spilled[0] == (0, size) and spilled[-1] == (size, size)
        assert s.spill("t") == 0  # already archived by the first spill
        assert len(s3_server.keys(bucket, "kv/blobs/")) == 6
        assert s.session_info("s").local_bytes == 0
        seen: list[tuple[int, int]] = []
        total = sum(map(len, data.values()))
        assert s.restore("s", progress=lambda d, t: seen.append((d, t))) == total
        assert seen[0] == (0, total) and seen[-1] == (total, total)  # bytes, as pages came
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == 7
        for k, v in data.items():
            assert s.get(k) == v
        assert s.fsck() == CLEAN_FSCK
    other = make_config(
        ndev=1,
        name="other",
        archive_url=url,
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(other) as s2:  # another host: its conditional put finds it
        s2.put(PageKey.semantic("u", "p", 0), page(3))
        assert s2.spill("u") == 0
        assert s2.statistics().extra["archive"]["dedup_skipped"] == 1
        assert s2.session_info("u").local_bytes == 0
        assert s2.get(PageKey.semantic("u", "p", 0)) == page(3)


def test_spill_uploads_in_process_when_no_worker_can_start(
    s3_server, make_config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # noqa: ANN001
    import sys

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    # a worker count no other test uses: these workers have not been started yet
    cfg = make_config(
        ndev=1, archive_url=url, extra={"archive": {"interval": 0, "upload_processes": 3}}
    )
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with kvfs.open_store_sync(cfg) as s:
        for i in range(3):
            s.put(PageKey.semantic("a", "p", i), page(i))
        assert s.spill("a") > 0
        assert s.engine.policy.uploads is None  # type: ignore[attr-defined]
        assert len(s3_server.keys(bucket, "blobs/")) == 3
        assert s.session_info("a").local_bytes == 0
        for i in range(3):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)


def test_restore_runs_in_process_when_no_worker_can_start(
    s3_server, make_config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # noqa: ANN001
    """The workers that spilled a session are gone and none can start again: the restore
    falls back to the store's own threads and brings every page back."""
    import sys

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    # a worker count no other test uses: this test's workers are its own
    cfg = make_config(
        ndev=2, archive_url=url, extra={"archive": {"interval": 0, "upload_processes": 5}}
    )
    with kvfs.open_store_sync(cfg) as s:
        total = spilled(s, "a", 6)
        uploads = s.engine.policy.uploads  # type: ignore[attr-defined]
        assert uploads is not None and uploads.pids()
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
        for pid in uploads.pids():
            os.kill(pid, signal.SIGKILL)
        assert s.restore("a") == total
        assert s.engine.policy.uploads is None  # type: ignore[attr-defined]
        assert restored(s, "a")
        for i in range(6):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)
        nothing_left_behind(s)


@pytest.mark.parametrize("processes", [0, 1])
def test_spill_probes_only_shared_content(s3_server, proxy, make_config, processes: int) -> None:  # noqa: ANN001
    """A blob one page references is uploaded without a HEAD (a conditional put says whether
    it was there); content several pages share is HEADed first, so an object another host
    stored is not sent again. Either way nothing is stored twice and every page restores."""
    bucket = s3_server.new_bucket()
    cfg = make_config(
        ndev=1,
        archive_url=f"s3://{bucket}?endpoint={s3_server.endpoint}",
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(cfg) as s:  # the first host archives pages 1 and 2
        s.put(PageKey.semantic("a", "p", 1), page(1))
        s.put(PageKey.semantic("a", "p", 2), page(2))
        s.spill("a")
    other = make_config(
        ndev=1,
        name="other",
        archive_url=f"s3://{bucket}?endpoint={proxy.endpoint}",
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(other) as s2:
        s2.put(PageKey.semantic("u", "p", 0), page(1))  # held once here: no HEAD
        before = proxy.sent
        assert s2.spill("u") == 0
        assert proxy.sent - before > len(page(1)) // 2  # the body went out, was refused
        s2.put(PageKey.semantic("v", "p", 0), page(2))  # shared by two pages here
        s2.put(PageKey.semantic("w", "p", 0), page(2))
        before = proxy.sent
        assert s2.spill("v") == 0
        assert proxy.sent - before < len(page(2)) // 4  # a HEAD found it: no body sent
        assert s2.statistics().extra["archive"]["dedup_skipped"] == 2
        assert len(s3_server.keys(bucket, "blobs/")) == 2
        assert s2.session_info("u").local_bytes == 0
        assert s2.session_info("v").local_bytes == len(page(2))  # w, not spilled, holds it
        s2.spill("w")
        for sess in ("u", "v", "w"):
            assert s2.session_info(sess).local_bytes == 0
        for sess, i in (("u", 1), ("v", 2), ("w", 2)):
            assert s2.get(PageKey.semantic(sess, "p", 0)) == page(i)


@pytest.mark.parametrize("processes", [0, 1])
def test_evicting_a_restored_page_again_sends_no_body(
    s3_server, proxy, make_config, processes: int
) -> None:  # noqa: ANN001
    """A page restored from the archive and evicted again: its object is there, a HEAD says
    so. The upload workers sent every byte again (a conditional put), and on an archive that
    can be read but not written, such an eviction failed."""
    bucket = s3_server.new_bucket()
    cfg = make_config(
        ndev=1,
        archive_url=f"s3://{bucket}?endpoint={proxy.endpoint}",
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(cfg) as s:
        for i in range(3):
            s.put(PageKey.semantic("a", "p", i), page(i))
        s.spill("a")
        for i in range(3):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)  # restored: local again
        before = proxy.sent
        s.evict(session="a")
        assert proxy.sent - before < len(page(0)) // 4  # HEADs and a manifest, no body
        assert s.session_info("a").local_bytes == 0


def test_a_job_whose_object_should_be_there_reads_nothing_when_it_is(tmp_path: Path) -> None:
    """Before local copies are dropped (an eviction of restored pages), the workers check
    that each object is there. They read and compressed each page beside the HEAD, and
    dropped the work when it was there: an eviction of a restored 512 MiB page read it and
    held it three times in a worker for nothing. Here the job's data file does not exist:
    reading it would fail the job."""
    from kvfs import _uploader
    from kvfs._checksum import leaves_of, tree_hash
    from kvfs._codec import encode
    from kvfs._manifest import blob_key

    data = page(5)
    h = tree_hash(len(data), leaves_of(data))
    archive = tmp_path / "archive"
    (archive / blob_key(h)).parent.mkdir(parents=True)
    (archive / blob_key(h)).write_bytes(encode(data)[0])
    gone = ((str(tmp_path / "no-such-file"), 4096, 0, len(data)),)
    job = _uploader.BlobJob(h, len(data), 2, gone, probe=True, expected=True)
    url = f"file://{archive}"
    assert _uploader.upload_batch(url, {}, [job], 1, "auto", 4) == (
        [_uploader.Uploaded(h, False, 0, None)],
        None,
    )
    # missing after all: then the page is read (here: the file is missing too)
    (archive / blob_key(h)).unlink()
    done, error = _uploader.upload_batch(url, {}, [job], 1, "auto", 4)
    assert done == [] and isinstance(error, kvfs.CorruptPage), error


class Overlap:
    """A function called from threads, counting how many calls run at once (``most``): each
    lingers a moment, so calls that may run together do."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn, self.now, self.most = fn, 0, 0
        self.lock = threading.Lock()

    def __call__(self, *args: object) -> object:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)
            return self.fn(*args)
        finally:
            with self.lock:
                self.now -= 1


def test_a_workers_jobs_hold_at_most_transfer_bytes_of_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job holds its page two or three times until it is stored or written, and a
    worker ran ``concurrency`` of them at once (a restore: every job of its batch) whatever
    their size: a spill of eight 1 GiB pages had both workers OOM-killed. The limit on
    their page bytes (TRANSFER_BYTES, 512 MiB) is lowered here to one page: one job at a
    time, of the four that may run."""
    from kvfs import _uploader
    from kvfs._checksum import leaves_of, tree_hash
    from kvfs._codec import encode
    from kvfs._manifest import blob_key

    monkeypatch.setattr(_uploader, "TRANSFER_BYTES", len(page(0)))
    pages = {tree_hash(len(d), leaves_of(d)): d for d in map(page, range(4))}
    url = f"file://{tmp_path / 'archive'}"
    reads = Overlap(lambda job, level, *_: encode(pages[job.h], level=level))
    monkeypatch.setattr(_uploader, "_read_encode", reads)
    jobs = [_uploader.BlobJob(h, len(d), 2, (), probe=False) for h, d in pages.items()]
    done, error = _uploader.upload_batch(url, {}, jobs, 1, "auto", 4)
    assert error is None and sorted(u.h for u in done if u.stored) == sorted(pages)
    assert reads.most == 1
    writes = Overlap(lambda spec, job, obj: _uploader.Restored(job.h, (), 0, ()))
    monkeypatch.setattr(_uploader, "_restore_one", writes)
    spec = _uploader.TierSpec((str(tmp_path / "d0"),), 64 * KiB, direct=False, durable=False)
    back = [_uploader.RestoreJob(h, len(d), blob_key(h), 0, h.hex()) for h, d in pages.items()]
    got = _uploader.restore_batch(url, {}, spec, back, 4)
    assert [r.error for r in got] == [None] * 4
    assert writes.most == 1


def test_fsck_of_the_archive_and_a_restore_in_the_store_hold_at_most_transfer_bytes(
    make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """fsck --check-archive downloaded and decoded ``concurrency`` (8) objects at once in the
    store's process, the daemon, whatever their size: 16 pages of 512 MiB at its peak. A
    restore in the store's process held up to 10. The limit on their page bytes is lowered
    here to one page: one object at a time."""
    from kvfs import _archive, _uploader

    monkeypatch.setattr(_uploader, "TRANSFER_BYTES", len(page(0)))
    cfg = make_config(
        ndev=1,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        for i in range(4):
            s.put(PageKey.semantic("a", "p", i), page(i))
        s.spill("a")
        checks = Overlap(_archive.decode_verified)
        monkeypatch.setattr(_archive, "decode_verified", checks)
        assert s.fsck(archive=True)["archive_corrupt"] == []
        assert checks.most == 1
        checks.most = 0
        assert s.restore("a") == 4 * len(page(0))
        assert checks.most == 1
        for i in range(4):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)


# -- restores in the workers ----------------------------------------------------------------
def down_after_manifest(s: kvfs.SyncStore, proxy) -> None:  # noqa: ANN001
    """Take the endpoint down once a restore has read the session's manifest (in the store's
    process), so the restore waits in the workers' downloads. For a session this store's
    index does not know (see :func:`spilled_by_another_host`): the downloads then start only
    after the manifest is in; a known session's pages start while it is fetched."""
    spiller = s.engine.policy.spiller  # type: ignore[attr-defined]
    imported = spiller.import_session

    async def then_down(d: str) -> object:
        out = await imported(d)
        proxy.down()
        spiller.import_session = imported  # once: later restores read their manifest
        return out

    spiller.import_session = then_down


def spilled(s: kvfs.SyncStore, session: str, n: int) -> int:
    """Put ``n`` pages in ``session`` and spill it; returns their bytes."""
    for i in range(n):
        s.put(PageKey.semantic(session, "p", i), page(i), attrs={"dtype": "fp16"})
    assert s.spill(session) > 0
    assert s.session_info(session).local_bytes == 0
    return sum(len(page(i)) for i in range(n))


def spilled_by_another_host(proxy, make_config, bucket: str, session: str, n: int) -> int:  # noqa: ANN001
    """Spill ``n`` pages of ``session`` from another store sharing ``bucket``."""
    with kvfs.open_store_sync(behind_proxy(proxy, make_config, bucket, 1, "first-host")) as a:
        return spilled(a, session, n)


def restored(s: kvfs.SyncStore, session: str) -> bool:
    info = s.session_info(session)
    return info.local_bytes == info.bytes and all(
        i.tier == "local+archive" for i in s.list(session=session)
    )


def nothing_left_behind(s: kvfs.SyncStore) -> None:
    assert s.fsck()["orphans"] == []  # no file a failed or retried job wrote
    assert s.statistics().reserved_bytes == 0  # no room held for it either


def test_worker_killed_mid_restore_is_replaced_and_every_page_comes_back(
    s3_server, proxy, make_config
) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    total = spilled_by_another_host(proxy, make_config, bucket, "cold", 8)
    cfg = behind_proxy(proxy, make_config, bucket, ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        restarts = s.engine.policy.uploads.restarts  # type: ignore[attr-defined]
        down_after_manifest(s, proxy)  # then the workers' downloads wait, retrying
        t, result = start_call(s.restore, "cold")
        kill_workers_mid_job(s)
        assert not result, "the restore finished while the endpoint was down"
        proxy.up()
        t.join(timeout=120)
        assert not t.is_alive()
        assert result == [total]
        assert s.engine.policy.uploads.restarts > restarts  # type: ignore[attr-defined]
        assert restored(s, "cold")
        for i in range(8):
            assert s.get(PageKey.semantic("cold", "p", i)) == page(i)
        nothing_left_behind(s)


def test_restore_worker_dying_twice_fails_and_leaves_nothing(s3_server, proxy, make_config) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    total = spilled_by_another_host(proxy, make_config, bucket, "a", 4)
    cfg = behind_proxy(proxy, make_config, bucket, ndev=1, upload_processes=1)
    with kvfs.open_store_sync(cfg) as s:
        restarts = s.engine.policy.uploads.restarts  # type: ignore[attr-defined]
        down_after_manifest(s, proxy)
        t, result = start_call(s.restore, "a")
        kill_workers_mid_job(s)
        wait_for(lambda: s.engine.policy.uploads.restarts > restarts, "the first retry")  # type: ignore[attr-defined]
        kill_workers_mid_job(s)
        t.join(timeout=120)
        assert not t.is_alive()
        assert isinstance(result[0], kvfs.ArchiveUnavailable), result
        assert s.session_info("a").local_bytes == 0  # still archived only, still listed
        assert len(s.list(session="a")) == 4
        nothing_left_behind(s)
        proxy.up()
        assert s.restore("a") == total  # a fresh worker takes the next restore
        assert restored(s, "a")


def test_corrupt_or_missing_object_restored_by_a_worker_is_refused(s3_server, make_config) -> None:  # noqa: ANN001
    from kvfs._codec import encode

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    cfg = make_config(ndev=2, archive_url=url, extra={"archive": {"interval": 0}})
    with kvfs.open_store_sync(cfg) as s:
        spilled(s, "a", 3)
        good, bad, gone = (PageKey.semantic("a", "p", i) for i in range(3))
        c = s3_server.client()
        forged, _ = encode(bytes(len(page(1))), codec="zstd")  # a valid object, wrong bytes
        c.put_object(Bucket=bucket, Key=f"blobs/{s.stat(bad).checksum}", Body=forged)
        c.delete_object(Bucket=bucket, Key=f"blobs/{s.stat(gone).checksum}")
        with pytest.raises(kvfs.CorruptPage):
            s.restore("a")
        assert s.stat(good).tier == "local+archive"  # the sound page came back
        assert s.stat(bad).tier == "archive" and s.stat(gone).tier == "archive"
        with pytest.raises(kvfs.CorruptPage, match="checksum"):
            s.get(bad)
        with pytest.raises(kvfs.CorruptPage, match="missing"):
            s.get(gone)
        st = s.statistics()
        assert st.corrupt_reads >= 4
        assert st.extra["archive"]["corrupt_objects"] >= 2
        nothing_left_behind(s)


def test_a_worker_whose_store_died_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore workers are processes of their own: once the store that asked is gone
    (SIGKILL), a worker writes no more files, and removes one it was writing (they appeared
    after the store, opened again, had swept its directories: orphans outside the cap)."""
    import os as _os
    import uuid

    from kvfs import _uploader
    from kvfs._checksum import leaves_of, tree_hash
    from kvfs._codec import encode

    data = page(3)
    h = tree_hash(len(data), leaves_of(data))
    obj = encode(data, level=1)[0]
    root = tmp_path / "d0"
    root.mkdir()
    spec = _uploader.TierSpec((str(root),), 64 * KiB, direct=False, durable=False)

    def job() -> _uploader.RestoreJob:
        return _uploader.RestoreJob(h, len(data), "blobs/x", 0, uuid.uuid4().hex)

    monkeypatch.setattr(_uploader, "_PARENT", _os.getppid())  # the store: alive
    assert _uploader._restore_one(spec, job(), obj).extents
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert len(files) == 1
    monkeypatch.setattr(_uploader, "_PARENT", _os.getppid() + 1)  # it died, before or during
    with pytest.raises(kvfs.ArchiveUnavailable, match="is gone"):
        _uploader._restore_one(spec, job(), obj)
    assert sorted(p for p in root.rglob("*") if p.is_file()) == files
    died = iter([False, True])  # alive when the write starts, gone when it ends
    monkeypatch.setattr(_uploader, "_store_gone", lambda: next(died))
    with pytest.raises(kvfs.ArchiveUnavailable, match="is gone"):
        _uploader._restore_one(spec, job(), obj)
    assert sorted(p for p in root.rglob("*") if p.is_file()) == files


def test_workers_stopped_mid_job_are_reaped() -> None:
    """Stopping the workers (at exit, or when the credentials change) with one busy past the
    grace killed it and left it unreaped: pytest's exit printed "ResourceWarning:
    subprocess N is still running" (2 of 4 CI runs). Every worker has exited and been
    waited for once ``shutdown`` returns."""
    from kvfs import _uploader

    w = _uploader._Workers(2)
    busy = w.submit(time.sleep, 60)
    assert w.submit(abs, -1).result(timeout=60) == 1  # both workers started
    procs = [s.proc for s in w.slots]
    assert all(p is not None and p.poll() is None for p in procs)
    w.shutdown()
    assert [p.returncode for p in procs if p is not None and p.returncode is None] == []
    with pytest.raises(_uploader.WorkerDied):
        busy.result(timeout=60)


def test_a_worker_killed_says_by_what() -> None:
    """A worker the OOM killer took (a spill of 1 GiB pages) failed the spill with "upload
    worker ended (exit status None), twice": its status was read before it was reaped."""
    from kvfs import _uploader

    w = _uploader._Workers(1)
    try:
        assert w.submit(abs, -1).result(timeout=60) == 1
        (pid,) = w.pids()
        with pytest.raises(_uploader.WorkerDied, match=r"killed by SIGKILL \(out of memory\?\)"):
            w.submit(os.kill, pid, signal.SIGKILL).result(timeout=60)
    finally:
        w.shutdown()
