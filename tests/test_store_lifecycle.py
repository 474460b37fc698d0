"""Ownership lock, restart without scanning, leases, the async API and the streaming writer."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from _corrupt import CLEAN_FSCK

import kvfs
from kvfs import PageKey
from kvfs._aligned import open_direct
from kvfs._local import LocalTier

KiB, MiB = 1024, 1 << 20


# -- the directory lock ------------------------------------------------------------------
def test_second_opener_in_another_process_is_told_the_owner(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg):
        code = textwrap.dedent(f"""
            import kvfs
            from pathlib import Path
            cfg = kvfs.StoreConfig(data_dirs={tuple(str(d) for d in cfg.data_dirs)!r})
            try:
                kvfs.open_store_sync(cfg).__enter__()
            except kvfs.StoreLocked as e:
                assert isinstance(e, BlockingIOError)
                print("LOCKED", e)
            """)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.startswith("LOCKED"), out.stderr
        assert f"pid {os.getpid()}" in out.stdout
        with pytest.raises(kvfs.StoreLocked):  # a second opener in this process too
            kvfs.Engine(cfg)
    with kvfs.open_store_sync(cfg) as store:  # released on close
        store.put("x", b"1")


@pytest.mark.parametrize("content", [b"[]", b"7", b'"x"', b"\xff\xfe", b'{"pid": 1'])
def test_a_lock_file_that_names_no_owner_still_says_locked(tmp_path: Path, content: bytes) -> None:
    """The lock held by another open file whose contents are no owner kvfs writes (JSON
    that is no object, bytes that are no JSON): StoreLocked naming an unknown owner, not
    an AttributeError from reading it."""
    from kvfs._lock import DirLock

    path = tmp_path / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, content)
        with pytest.raises(kvfs.StoreLocked, match=r"in use by pid \? on \?"):
            DirLock(path).acquire()
    finally:
        os.close(fd)


# -- restart -----------------------------------------------------------------------------
def test_clean_restart_does_not_scan_data_files(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(ndev=3, stripe_unit=64 * KiB)
    pages = {f"s{i % 3}/p{i}": os.urandom(i * 37 * KiB + 5) for i in range(12)}
    with kvfs.open_store_sync(cfg) as store:
        for k, v in pages.items():
            store.put(k, v, attrs={"i": k})
        store.pin("s0/p0")
        used = store.statistics().used_bytes

    def no_scan(*a: object, **k: object) -> None:
        raise AssertionError("a clean restart must not scan the data directories")

    with monkeypatch.context() as m:
        m.setattr(LocalTier, "all_files", no_scan)
        m.setattr(LocalTier, "sweep", no_scan)
        with kvfs.open_store_sync(cfg) as store:
            assert store.engine.recovered_orphans == []
            assert store.statistics().used_bytes == used
            for k, v in pages.items():
                assert store.get(k) == v and store.stat(k).attrs == {"i": k}
            assert store.stat("s0/p0").pinned


@pytest.mark.parametrize("name", ["abandoned", b"\xff\xfe-not-utf8"])
def test_unclean_restart_sweeps_orphans(
    make_config: Callable[..., kvfs.StoreConfig], name: str | bytes
) -> None:
    """A file no row names, left by a crash, is swept by the next open (fsck finds it
    before). One whose name is not UTF-8 failed fsck and that open (UnicodeEncodeError)."""
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/b", b"kept")
        orphan = cfg.data_dirs[1] / "blobs" / "ab" / os.fsdecode(name)
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"x" * 8192)
    with kvfs.open_store_sync(cfg) as store:  # clean: left alone, but fsck sees it
        assert orphan.exists() and store.fsck()["orphans"] == [str(orphan)]
        store.engine.index.set_meta("clean", False)  # as after a crash
        store.engine._closed = True  # skip the clean close: the next open is unclean
        store.engine._lock.release()
        store.engine.index.close()
        store.engine.dirs.close()  # (left open, Python 3.13 warned of it in a later test)
        store.engine.io_pool.shutdown()
        store.engine.hash_pool.shutdown()
    with kvfs.open_store_sync(cfg) as store:
        assert store.engine.recovered_orphans == [str(orphan)] and not orphan.exists()
        assert store.get("a/b") == b"kept"


def test_the_sweep_finds_the_same_orphans_without_room_for_its_temporary_database() -> None:
    """The names of the data files and of the files the index names go to a temporary
    SQLite database, not to Python sets (an open after a crash held about 1 KB a page).
    Where that cannot be written (here: a file size limit, as a full disk), they are read
    again into one in memory, and the answer is the same; the files are listed before
    what names them is asked for (fsck relies on it)."""
    code = textwrap.dedent("""
        import logging, resource, signal
        from kvfs._local import unnamed_files
        logging.basicConfig(format="%(message)s")
        files = [(i % 2, f"blobs/{i % 256:02x}/f{i:08x}") for i in range(40_000)]
        done = []
        def listed():
            yield from files
            done.append(True)
        def named():
            assert done, "named before the listing ended"
            return (f for i, f in enumerate(files) if i % 1000)
        first = list(unnamed_files(listed, named))
        print("WRITING", flush=True)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (EFBIG instead)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
        done.clear()
        again = list(unnamed_files(listed, named))
        assert first == again == files[::1000], (first[:3], again[:3])
        print("SAME", len(again))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["WRITING", "SAME", "40"], out.stderr
    assert out.stderr.count("could not be written to SQLite's temporary") == 1, out.stderr


# -- leases ------------------------------------------------------------------------------
def test_leased_files_survive_delete_and_evict(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=64 * KiB)) as store:
        data = os.urandom(200 * KiB)
        info = store.put("s/p", data)
        files = [e.path for e in info.extents]
        eng = store.engine
        with eng.lease("s/p") as (page, blob):
            assert store.evict("s/p") == 0 and store.exists("s/p")  # leased: not evicted
            store.delete("s/p")
            assert not store.exists("s/p")
            assert all(os.path.exists(f) for f in files)
            assert bytes(eng.read_held(page, blob, 0, len(data))) == data
            # The same content put and dropped again while the first lease is held.
            store.put("s/q", data)
            again = [e.path for e in store.stat("s/q").extents]
            store.delete("s/q")
            assert all(os.path.exists(f) for f in files + again)
        assert not any(os.path.exists(f) for f in files + again)
        assert store.statistics().used_bytes == 0
        assert store.fsck()["orphans"] == []


def test_capacity_eviction_skips_leased_pages(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=3 * (64 * KiB + 4 * KiB))
    with kvfs.open_store_sync(cfg) as store:
        for name in "abc":  # one directory each: one burst would go newest first
            store.put(f"{name}/p", os.urandom(64 * KiB))
        with store.engine.lease("a/p"):
            store.put("d/p", os.urandom(64 * KiB))  # a is the oldest, but leased: b goes
        assert {p.path for p in store.list(path_prefix="")} == {"a/p", "c/p", "d/p"}


# -- the async API -----------------------------------------------------------------------
async def test_async_many_tasks(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    async with kvfs.open_store(make_config(ndev=3, stripe_unit=32 * KiB)) as store:
        pages = {
            kvfs.PageKey.semantic(f"s{i % 4}", f"p{i // 4}", i % 3): os.urandom(i * 3001)
            for i in range(40)
        }
        infos = await store.put_many(pages.items(), attrs={"model": "m"}, concurrency=8)
        assert [i.path for i in infos] == [k.path for k in pages]
        got = await store.get_many(list(pages), concurrency=8)
        assert got == list(pages.values())
        bufs = [kvfs.aligned_buffer(len(v)) for v in pages.values()]
        assert await store.get_many(list(pages), into=bufs) == [len(v) for v in pages.values()]
        assert [bytes(b) for b in bufs] == list(pages.values())

        results: dict[str, bytes] = {}

        async def reader(k: kvfs.PageKey) -> None:
            results[k.path] = await store.get(k)  # type: ignore[assignment]

        async with trio.open_nursery() as n:
            for k in pages:
                n.start_soon(reader, k)
        assert results == {k.path: v for k, v in pages.items()}
        assert {s.session for s in await store.sessions()} == {"s0", "s1", "s2", "s3"}
        assert (await store.session_info("s1")).model == "m"
        with pytest.raises(ValueError, match="one buffer per key"):
            await store.get_many(list(pages), into=bufs[:1])
        with pytest.raises(kvfs.PageExists):
            await store.put_many(list(pages.items())[:3])
    with pytest.raises(kvfs.StoreClosed):
        await store.get(next(iter(pages)))
    await store.aclose()  # idempotent


async def test_async_errors_leave_the_block_as_they_are(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """The body of ``async with open_store()`` runs in the store's nursery; its errors used to
    leave it wrapped in an ExceptionGroup, which ``except PageNotFound`` does not catch."""
    with pytest.raises(kvfs.PageNotFound):
        async with kvfs.open_store(make_config(ndev=1)) as store:
            await store.get("a/missing")
    async with kvfs.open_store(make_config(ndev=1)) as store:
        with trio.fail_after(30):  # concurrency 0 never started a call
            infos = await store.put_many([("a/1", b"x"), ("a/2", b"y")], pin=True, concurrency=0)
        assert [i.pinned for i in infos] == [True, True]
        await store.put_many([("a/1", b"z")], replace=True)
        assert await store.get_many(["a/1", "a/2"], concurrency=0) == [b"z", b"y"]


async def test_async_overrides_and_lock(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    cfg = make_config(ndev=1)
    async with kvfs.open_store(cfg, stripe_unit=8 * KiB) as store:
        assert store.config.stripe_unit == 8 * KiB
        with pytest.raises(kvfs.StoreLocked):
            async with kvfs.open_store(cfg):
                pass


# -- the streaming writer ----------------------------------------------------------------
def test_page_writer_out_of_order_and_abort(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    with kvfs.open_store_sync(make_config(ndev=3, stripe_unit=16 * KiB)) as store:
        data = os.urandom(100 * KiB + 7)
        w = store.begin_write("eng/file.bin")
        chunks = [(o, data[o : o + 9000]) for o in range(0, len(data), 9000)]
        for o, c in reversed(chunks):
            w.write(o, c)
        assert w.read(5, 20000) == data[5:20005]
        info = w.commit(attrs={"mode": "644"})
        assert store.get("eng/file.bin") == data and info.attrs == {"mode": "644"}
        w2 = store.begin_write("eng/aborted.bin")
        w2.write(0, b"x" * 50_000)
        w2.abort()
        assert not store.exists("eng/aborted.bin")
        st = store.statistics()
        assert st.reserved_bytes == 0 and store.fsck()["orphans"] == []


def test_page_writer_counts_bytes_and_refuses_negative_offsets(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A float32 array of 1000 items made a 1000-byte page (len() counts items), and a
    negative offset overwrote the data file's header."""
    import numpy as np

    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=16 * KiB)) as store:
        arr = np.arange(1000, dtype=np.float32)
        grid = np.arange(4000, dtype=np.uint8).reshape(40, 100)
        w = store.begin_write("eng/typed.bin")
        assert w.write(0, arr) == 4000
        assert w.write(4000, memoryview(grid)) == 4000
        with pytest.raises(ValueError, match="non-negative"):
            w.write(-4096, b"Z" * 16)
        with pytest.raises(ValueError, match="C-contiguous"):
            w.write(8000, np.arange(64, dtype=np.uint8)[::2])
        with pytest.raises(ValueError, match="non-negative"):
            w.truncate(-1)
        info = w.commit()
        assert info.size == 8000
        assert store.get("eng/typed.bin") == arr.tobytes() + grid.tobytes()
        assert store.fsck()["corrupt"] == []


def test_a_page_writer_shrinks_and_grows_with_truncate(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """truncate to a smaller size cuts the page being written (ValueError before: the
    mount answered EINVAL and published the uncut bytes), over stripes on two devices; a
    later write past the new end leaves zeros between, not the bytes cut."""
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=16 * KiB)) as store:
        data = os.urandom(100 * KiB)
        for cut in (0, 20 * KiB + 5, 32 * KiB, 48 * KiB + 1):
            w = store.begin_write(f"eng/cut-{cut}")
            w.write(0, data)
            w.truncate(cut)
            assert w.size == cut
            assert w.read(0, 200 * KiB) == data[:cut]
            w.write(70 * KiB, b"tail")
            w.truncate(70 * KiB + 10)  # grows with zeros
            w.commit()
            want = data[:cut] + bytes(70 * KiB - cut) + b"tail" + bytes(6)
            assert store.get(f"eng/cut-{cut}") == want
        assert store.fsck()["corrupt"] == []
        assert store.engine.reserved == 0  # the room the cut bytes held was given back


def test_a_page_writer_truncated_past_the_cap_raises_capacity_exceeded(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Growing by truncate allocated the zeros before the cap was checked: ``truncate -s
    1P`` on the mount raised MemoryError (2**64: OverflowError), which the mount answers
    as an unexpected EIO, not ENOSPC; and a write that far took minutes to be refused. A
    growth within the cap goes in pieces."""
    cap = 40 * MiB
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=1 * MiB, capacity=cap)) as store:
        w = store.begin_write("eng/grown")
        w.write(0, b"head")
        held = store.engine.reserved
        for size in (2**50, 2**64, cap + 1):
            with pytest.raises(kvfs.CapacityExceeded, match="larger than the capacity"):
                w.truncate(size)
            assert (w.size, store.engine.reserved) == (4, held)
        with pytest.raises(kvfs.CapacityExceeded):  # (it counted 2**30 stripe units first)
            w.write(2**50, b"x")
        w.truncate(17 * MiB + 3)  # (more than one piece of zeros)
        w.commit()
        assert store.get("eng/grown") == b"head" + bytes(17 * MiB - 1)
        assert store.engine.reserved == 0


# -- group commit ------------------------------------------------------------------------
def test_concurrent_commits_one_winner_per_key(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Commits from many threads share transactions; each page still succeeds or fails alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    start = threading.Barrier(16)

    def put(i: int) -> str:
        start.wait()
        try:
            store.put("contended/key", bytes([i]) * (300 * KiB))
            won = "won"
        except kvfs.PageExists:
            won = "lost"
        store.put(f"own/{i}", bytes([i]) * (200 * KiB + i))
        return won

    with kvfs.open_store_sync(cfg) as store:
        with ThreadPoolExecutor(16) as ex:
            assert sorted(ex.map(put, range(16))) == ["lost"] * 15 + ["won"]
        winner = store.get("contended/key")
        assert winner == winner[:1] * (300 * KiB)
        assert store.statistics().pages == 17
    with kvfs.open_store_sync(cfg) as store:  # all of it committed
        assert all(store.get(f"own/{i}") == bytes([i]) * (200 * KiB + i) for i in range(16))
        assert store.fsck() == CLEAN_FSCK


def test_listing_sessions_while_others_are_deleted_leaves_the_deleted_ones_out(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """sessions() listed the rows, then read each one's figures: a session deleted between
    the two made the whole call fail with SessionNotFound (`kvfs ls` beside an engine
    dropping sessions; a soak's daemon log had five such warnings)."""
    import threading

    with kvfs.open_store_sync(make_config(ndev=1)) as store:
        store.put("kept/a", b"k" * 4096)
        stop = threading.Event()

        def churn() -> None:
            i = 0
            while not stop.is_set():
                store.put(PageKey.semantic(f"s{i % 5}", "p", 0), b"x" * 4096)
                store.delete_session(f"s{i % 5}")
                i += 1

        t = threading.Thread(target=churn)
        t.start()
        try:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                assert "kept" in {x.session for x in store.sessions()}
        finally:
            stop.set()
            t.join()


def test_index_reads_do_not_wait_for_another_threads_transaction(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A lookup sees the last committed state while another thread's transaction is open
    (it used to queue behind the whole transaction, its fsync included); the thread inside
    the transaction sees its own rows; everyone sees them once committed."""
    import threading

    with kvfs.open_store_sync(make_config()) as store:
        store.put("s/a", b"a" * 5000)
        index = store.engine.index
        inside, release, seen_inside = threading.Event(), threading.Event(), []

        def writer() -> None:
            with index.transaction() as db:
                db.execute("UPDATE pages SET pinned=1 WHERE path='s/a'")
                seen_inside.append(index.page("s/a"))
                inside.set()
                release.wait(30)

        t = threading.Thread(target=writer)
        t.start()
        try:
            assert inside.wait(30)
            outside: list[object] = []
            reader = threading.Thread(target=lambda: outside.append(index.page("s/a")))
            reader.start()
            reader.join(30)  # a reader queued behind the open transaction would hang here
            assert not reader.is_alive(), "a read waited for another thread's transaction"
            assert outside[0] is not None and not outside[0].pinned  # type: ignore[attr-defined]
            assert index.page_and_blob("s/a") is not None
        finally:
            release.set()
            t.join(30)
        assert seen_inside[0] is not None and seen_inside[0].pinned
        assert index.page("s/a").pinned  # type: ignore[union-attr]


def test_close_waits_for_calls_in_flight_and_refuses_new_ones(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """close() lets a put already running commit before it saves the byte count: the count
    saved once went to disk without that page, the next open trusted it, and the cap was
    overrun. A call made once close() began is told StoreClosed (it got sqlite errors)."""
    import threading

    cfg = make_config(ndev=1, capacity=64 * MiB)
    opened = kvfs.open_store_sync(cfg)
    store = opened.__enter__()
    index, committing, results = store.engine.index, threading.Event(), []
    commit_page = index.commit_page

    def slow_commit(c, **kw):  # noqa: ANN001, ANN003, ANN202
        committing.set()
        time.sleep(0.5)  # close() starts meanwhile
        return commit_page(c, **kw)

    index.commit_page = slow_commit  # type: ignore[method-assign]

    def put() -> None:
        try:
            results.append(store.put("s/late", b"x" * (3 * MiB)))
        except Exception as e:  # noqa: BLE001
            results.append(e)

    t = threading.Thread(target=put)
    t.start()
    assert committing.wait(30)
    store.close()
    t.join(30)
    assert isinstance(results[0], kvfs.PageInfo), results
    with pytest.raises(kvfs.StoreClosed):
        store.put("s/after", b"y")
    with pytest.raises(kvfs.StoreClosed):
        store.stat("s/late")
    with kvfs.open_store_sync(cfg) as again:
        on_disk = sum(
            f.stat().st_size for d in cfg.data_dirs for f in d.rglob("blobs/**/*") if f.is_file()
        )
        assert again.statistics().used_bytes == on_disk > 3 * MiB
        assert again.get("s/late") == b"x" * (3 * MiB)


def test_a_lookup_racing_a_put_sees_the_page_or_nothing(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A page and its blob are looked up in one snapshot: a reader racing the put of the very
    key it asks for gets PageNotFound or the page (two queries once let a put land between
    them and raised 'index inconsistent')."""
    import threading

    n, errors = 1500, []
    with kvfs.open_store_sync(make_config(ndev=1, durable=False)) as store:
        done = threading.Event()

        def chase() -> None:
            i = 0
            while not done.is_set():
                try:
                    store.stat(f"race/p{i}")
                    i += 1
                except kvfs.PageNotFound:
                    pass
                except Exception as e:  # noqa: BLE001 (any other error fails the test)
                    errors.append(e)
                    return

        readers = [threading.Thread(target=chase) for _ in range(2)]
        for t in readers:
            t.start()
        for i in range(n):
            store.put(f"race/p{i}", b"%d" % i)
        done.set()
        for t in readers:
            t.join(30)
    assert errors == []


# -- O_DIRECT into the caller's buffer -----------------------------------------------------
def test_aligned_buffers_are_read_directly(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page-aligned target of whole 4 KiB blocks is read with O_DIRECT straight into it; only
    an unaligned target (or a partial last block) goes through the bounce buffers."""
    with kvfs.open_store_sync(make_config(ndev=3, stripe_unit=64 * KiB)) as store:
        data = os.urandom(MiB + 8192)
        info = store.put("s/p", data)
        fd, direct = open_direct(info.extents[0].path, os.O_RDONLY)
        os.close(fd)
        if not direct:
            pytest.skip(
                "this filesystem refuses O_DIRECT (tmpfs?): kvfs reads through the page "
                "cache there; runs wherever the temp dir is on ext4/xfs (the dev VM)"
            )
        pool = store.engine.tier.bounce
        taken: list[int] = []
        real_take = pool.take

        def counting_take() -> memoryview:
            taken.append(1)
            return real_take()

        monkeypatch.setattr(pool, "take", counting_take)
        buf = kvfs.aligned_buffer(len(data))
        assert store.get("s/p", into=buf) == len(data) and bytes(buf) == data
        assert taken == []  # no bounce buffer: straight into the caller's memory
        unaligned = memoryview(bytearray(len(data) + 1))[1:]
        assert store.get("s/p", into=unaligned) == len(data) and bytes(unaligned) == data
        assert taken  # the unaligned target went through bounce buffers


def test_put_writes_each_device_file_in_one_vectored_write(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An aligned put buffer goes to each device file as one pwritev (its header and all of its
    chunks: more than IOV_MAX chunks are batched), and the bytes land where the extents say;
    an unaligned buffer and a ragged tail go through the bounce buffers and read back the same."""
    import kvfs._local as local

    calls: list[int] = []
    real_pwritev = os.pwritev

    def counting_pwritev(fd: int, bufs: list[memoryview], off: int) -> int:
        calls.append(len(bufs))
        return real_pwritev(fd, bufs, off)

    monkeypatch.setattr(local.os, "pwritev", counting_pwritev)
    unit = 4 * KiB
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=unit)) as store:
        chunks = 2 * local._IOV_MAX + 7  # over IOV_MAX per device file
        data = os.urandom(chunks * unit + 100)  # and a tail of 100 bytes
        src = kvfs.aligned_buffer(len(data))
        src[:] = data
        info = store.put("s/many", src)
        # device files: ceil(chunks/2) full chunks (+1 for the header) in IOV_MAX batches
        assert sum(calls) == chunks + 2 and len(calls) == 2 + 2
        assert max(calls) == local._IOV_MAX
        pos = 0
        for ext in info.extents:  # the bytes are where the extents say
            with open(ext.path, "rb") as f:
                f.seek(ext.offset)
                assert f.read(ext.length) == data[pos : pos + ext.length]
            pos += ext.length
        assert pos == len(data)
        assert store.get("s/many") == data
        calls.clear()
        odd = memoryview(bytearray(len(data) + 1))[1:]  # not 4 KiB aligned: piece by piece
        odd[:] = data[::-1]
        store.put("s/odd", odd)
        assert calls == []
        assert store.get("s/odd") == data[::-1]


# -- data directories and the index that do not fit together ------------------------------
def two_device_store(tmp_path) -> tuple[kvfs.StoreConfig, dict[str, bytes]]:  # noqa: ANN001
    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "n0", tmp_path / "n1"), stripe_unit=MiB)
    data = {f"p/{i}": os.urandom(3 * MiB) for i in range(3)}  # striped over both devices
    with kvfs.open_store_sync(cfg) as s:
        for k, v in data.items():
            s.put(k, v)
    return cfg, data


def reads_back(cfg: kvfs.StoreConfig, data: dict[str, bytes]) -> None:
    with kvfs.open_store_sync(cfg) as s:
        assert all(s.get(k) == v for k, v in data.items())
        assert not any(s.fsck()[k] for k in ("missing", "corrupt", "orphans"))


def test_a_missing_device_is_refused_not_made_again(tmp_path) -> None:  # noqa: ANN001
    """An NVMe whose disk is not mounted: its directory is gone (or empty). The store does
    not open, and creates nothing in its place, nor changes the index's directory: its
    reserve stays (it was removed for the open, not made again), and no directory table
    is made for a store from before there was one."""
    cfg, data = two_device_store(tmp_path)
    reserve, dirs = tmp_path / "n0" / "kvfs-index.reserve", tmp_path / "n0" / "kvfs-dirs.sqlite3"
    assert reserve.exists()
    dirs.unlink()
    (tmp_path / "n1").rename(tmp_path / "n1.unmounted")
    with pytest.raises(
        kvfs.KvfsError, match=r"n1 is device 1 of this store .* is its disk mounted"
    ):
        kvfs.open_store_sync(cfg).__enter__()
    assert not (tmp_path / "n1").exists()
    assert reserve.exists() and not list(tmp_path.glob("n0/kvfs-dirs*"))
    (tmp_path / "n1").mkdir()  # an empty mount point: the same
    with pytest.raises(kvfs.KvfsError, match="is its disk mounted"):
        kvfs.open_store_sync(cfg).__enter__()
    (tmp_path / "n1").rmdir()
    with pytest.raises(kvfs.KvfsError, match="2 data directories, but only 1 configured"):
        kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "n0",))).__enter__()
    (tmp_path / "n1.unmounted").rename(tmp_path / "n1")
    reads_back(cfg, data)


def test_reordered_data_directories_are_refused(tmp_path) -> None:  # noqa: ANN001
    cfg, data = two_device_store(tmp_path)
    swapped = kvfs.StoreConfig(data_dirs=(tmp_path / "n1", tmp_path / "n0"), stripe_unit=MiB)
    with pytest.raises(kvfs.KvfsError, match="out of their original order"):
        kvfs.open_store_sync(swapped).__enter__()
    assert not (tmp_path / "n1" / "kvfs-index.sqlite3").exists()  # no stray index made
    index_elsewhere = kvfs.StoreConfig(
        data_dirs=(tmp_path / "n1", tmp_path / "n0"), index_dir=tmp_path / "n0"
    )
    with pytest.raises(kvfs.KvfsError, match="keep the data directories in their original"):
        kvfs.open_store_sync(index_elsewhere).__enter__()
    reads_back(cfg, data)


def test_a_refused_device_list_makes_no_device_before_it(tmp_path) -> None:  # noqa: ANN001
    """A new directory listed before one the open refuses (another store's device, or one
    named twice) was made a device of the store, its marker written, before the refusal:
    an open that failed changed the store, and the directory was taken for good."""
    cfg, data = two_device_store(tmp_path)
    other = tmp_path / "other"
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(other,))) as s:
        s.put("x", b"x")
    added, link = tmp_path / "n2", tmp_path / "link"
    link.symlink_to(added)  # (dangling until the open makes n2)
    for last, why in ((other, "is device 0 of another store"), (link, "named twice")):
        wrong = kvfs.StoreConfig(data_dirs=(*cfg.data_dirs, added, last), stripe_unit=MiB)
        with pytest.raises(kvfs.KvfsError, match=why):
            kvfs.open_store_sync(wrong).__enter__()
        assert not added.exists()
    reads_back(cfg, data)
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(other,))) as s:
        assert s.get("x") == b"x"


def test_a_device_can_be_added(tmp_path) -> None:  # noqa: ANN001
    cfg, data = two_device_store(tmp_path)
    grown = kvfs.StoreConfig(data_dirs=(*cfg.data_dirs, tmp_path / "n2"), stripe_unit=MiB)
    with kvfs.open_store_sync(grown) as s:
        s.put("p/new", os.urandom(3 * MiB))
        data["p/new"] = s.get("p/new")  # type: ignore[assignment]
    reads_back(grown, data)
    with pytest.raises(kvfs.KvfsError, match="3 data directories, but only 2 configured"):
        kvfs.open_store_sync(cfg).__enter__()


def test_an_unreadable_or_lost_index_is_named(tmp_path) -> None:  # noqa: ANN001
    cfg, data = two_device_store(tmp_path)
    index = tmp_path / "n0" / "kvfs-index.sqlite3"
    good = index.read_bytes()
    index.write_bytes(b"not an index" * 1000)
    with pytest.raises(kvfs.KvfsError, match=r"kvfs-index.sqlite3 is unreadable \(file is not"):
        kvfs.open_store_sync(cfg).__enter__()
    assert index.read_bytes() == b"not an index" * 1000  # kept for inspection
    index.unlink()
    with pytest.raises(kvfs.KvfsError, match="no index at .* was the index lost or moved"):
        kvfs.open_store_sync(cfg).__enter__()
    assert not index.exists()
    index.write_bytes(good)
    reads_back(cfg, data)


def test_an_index_of_a_newer_schema_is_refused_unchanged(tmp_path) -> None:  # noqa: ANN001
    """An index a newer kvfs made: this one ran its own schema's statements on it first, so
    a newer table failed them with SQLite's bare "no such column: atime", and an index
    whose tables still fit raised a RuntimeError, no KvfsError."""
    cfg, data = two_device_store(tmp_path)
    index = cfg.index_path
    good = index.read_bytes()
    newer = [
        "UPDATE meta SET v=X'02' WHERE k='schema'",  # (msgpack's 2)
        "DROP INDEX blobs_evict",
        "ALTER TABLE blobs RENAME COLUMN atime TO used",
    ]
    for n in (1, len(newer)):
        db = sqlite3.connect(index)
        with db:
            for stmt in newer[:n]:
                db.execute(stmt)
        db.close()
        made = index.read_bytes()
        with pytest.raises(
            kvfs.KvfsError, match=r"has schema version 2, .* reads version 1 only: a newer kvfs"
        ):
            kvfs.open_store_sync(cfg).__enter__()
        assert index.read_bytes() == made
        assert not Path(f"{index}-wal").exists() or not Path(f"{index}-wal").stat().st_size
        index.write_bytes(good)
    reads_back(cfg, data)


def test_a_data_directory_that_is_a_file_is_named(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "f").write_bytes(b"not a directory")
    with pytest.raises(kvfs.KvfsError, match=r"f is not a directory"):
        kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "f",))).__enter__()
    assert (tmp_path / "f").read_bytes() == b"not a directory"


def test_an_unreadable_device_marker_is_named(tmp_path) -> None:  # noqa: ANN001
    cfg, data = two_device_store(tmp_path)
    marker = tmp_path / "n1" / ".kvfs-device"
    good = marker.read_bytes()
    marker.write_bytes(b"garbage")
    with pytest.raises(kvfs.KvfsError, match=r"n1/.kvfs-device is unreadable .* will not guess"):
        kvfs.open_store_sync(cfg).__enter__()
    assert marker.read_bytes() == b"garbage"
    marker.write_bytes(good)
    reads_back(cfg, data)  # the failed open left the store as it was (and its lock free)


# -- fork ---------------------------------------------------------------------------------
# Engines fork (multiprocessing's default start method on Linux, pre-fork servers). A child
# inherits the store object but not its threads; before, its first put of a page hashed on
# the pool hung for ever, and its exit unwound the parent's store (lock, index).
_FORKED = """
import os, signal, sys, kvfs
root = sys.argv[1]

def cfg(name):
    return kvfs.StoreConfig(
        data_dirs=[f"{root}/{name}"],
        archive_url=f"file://{root}/archive-{name}",
        extra={"archive": {"interval": 0, "upload_processes": 1}},
    )

def key(s, i):
    return kvfs.PageKey.semantic(s, "p", i)
"""


def _run_forked(tmp_path, body: str) -> list[str]:  # noqa: ANN001
    script = tmp_path / "forked.py"
    script.write_text(_FORKED + textwrap.dedent(body))
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_a_forked_child_is_refused_and_leaves_the_parents_store_be(tmp_path) -> None:  # noqa: ANN001
    lines = _run_forked(
        tmp_path,
        """
        with kvfs.open_store_sync(cfg("parent")) as s:
            s.put(key("a", 0), os.urandom(3 << 20))
            s.spill("a")  # the upload worker runs
            s.restore("a")
            pid = os.fork()
            if pid == 0:
                signal.alarm(60)  # a child that hangs (as before) must not outlive the test
                for what, call in (
                    ("get", lambda: s.get(key("a", 0))),
                    ("put", lambda: s.put(key("a", 1), os.urandom(8 << 20))),  # hash pool
                    ("spill", lambda: s.spill("a")),
                ):
                    try:
                        call()
                        print("CHILD", what, "served")
                    except kvfs.StoreClosed as e:
                        print("CHILD", what, "refused:", e)
                sys.stdout.flush()
                sys.exit(0)  # unwinds the with block and runs the exit handlers, in the child
            assert os.waitpid(pid, 0)[1] == 0
            print("OWNER", open(cfg("parent").lock_path).read())
            s.put(key("a", 2), os.urandom(8 << 20))
            print("SPILLED", s.spill("a"))
        with kvfs.open_store_sync(cfg("parent")) as s:
            print("PAGES", sorted(p.path for p in s.list(session="a")))
        """,
    )
    child = [ln for ln in lines if ln.startswith("CHILD")]
    assert len(child) == 3, lines
    for ln in child:
        assert " refused: this store was opened by process " in ln, ln
        assert "is a fork of it and cannot use it" in ln
    owner = next(ln for ln in lines if ln.startswith("OWNER"))
    assert '"pid": ' in owner  # the child's exit did not clear the parent's lock file
    assert int(next(ln for ln in lines if ln.startswith("SPILLED")).split()[1]) > 8 << 20
    assert lines[-1] == ("PAGES ['sessions/a/p/layer-000', 'sessions/a/p/layer-002']")


def test_a_killed_owners_forked_child_does_not_keep_the_store_locked(tmp_path) -> None:  # noqa: ANN001
    """An owner that forked a long-lived child (a worker pool) and was then SIGKILLed left
    the store locked, "in use by" its dead pid, until that child exited: the flock's open
    file was the child's too."""
    lines = _run_forked(
        tmp_path,
        """
        import time
        plain = kvfs.StoreConfig(data_dirs=[f"{root}/shared"])  # (no upload workers)
        r, w = os.pipe()
        owner = os.fork()
        if owner == 0:
            held = kvfs.open_store_sync(plain)
            s = held.__enter__()
            s.put(key("a", 0), b"x" * 100)
            r2, w2 = os.pipe()
            kid = os.fork()
            if kid == 0:  # unrelated work that never touches the store
                signal.alarm(60)
                os.write(w2, b"up")  # (after the fork handlers ran)
                time.sleep(60)
                os._exit(0)
            os.read(r2, 2)
            os.write(w, f"{kid}\\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
        kid = int(os.read(r, 100))
        os.waitpid(owner, 0)
        try:
            with kvfs.open_store_sync(plain) as s:
                print("REOPENED", [p.path for p in s.list(session="a")])
        except kvfs.StoreLocked as e:
            print("LOCKED", e)
        os.kill(kid, signal.SIGKILL)
        """,
    )
    assert lines == ["REOPENED ['sessions/a/p/layer-000']"], lines


def test_a_forked_child_can_open_a_store_of_its_own_and_spill(tmp_path) -> None:  # noqa: ANN001
    # The parent's upload workers are fed by threads the child does not have: the child
    # must start its own, not queue behind dead threads (it hung before).
    lines = _run_forked(
        tmp_path,
        """
        with kvfs.open_store_sync(cfg("parent")) as s:
            s.put(key("a", 0), os.urandom(3 << 20))
            s.spill("a")
            pid = os.fork()
            if pid == 0:
                signal.alarm(60)
                with kvfs.open_store_sync(cfg("child")) as c:
                    c.put(key("b", 0), os.urandom(3 << 20))
                    print("CHILD", c.spill("b"), flush=True)
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            s.put(key("a", 1), os.urandom(3 << 20))
            print("PARENT", s.spill("a"))
        """,
    )
    assert [ln.split()[0] for ln in lines] == ["CHILD", "PARENT"]
    assert all(int(ln.split()[1]) >= 3 << 20 for ln in lines), lines  # bytes uploaded


def test_a_top_level_engine_directory_is_named_as_ls_shows_it(
    sync_store: kvfs.SyncStore,
) -> None:
    """LMCache writes ``lmcache/<file>`` at the mount's top: its session is ``lmcache``, as
    ``ls`` shows it, though a name without '/' means a semantic session. The semantic
    session wins when both exist; ``lmcache/`` always means the directory."""
    s = sync_store
    s.put("lmcache/llama@1@0@5e0c@bf16.data", b"x" * 5000)
    assert [i.session for i in s.sessions()] == ["lmcache"]
    assert s.session_info("lmcache").pages == 1
    assert [p.path for p in s.list(session="lmcache")] == ["lmcache/llama@1@0@5e0c@bf16.data"]
    s.pin_session("lmcache")
    assert s.session_info("lmcache/").pinned
    s.unpin_session("lmcache")
    assert s.evict(session="lmcache") > 0  # no archive: eviction deletes
    s.put("lmcache/a.data", b"a" * 10)
    s.put(PageKey.semantic("lmcache", "p", 0), b"b" * 10)  # now both exist
    assert s.session_info("lmcache").session == "lmcache" and [
        p.path for p in s.list(session="lmcache")
    ] == [PageKey.semantic("lmcache", "p", 0).path]
    assert s.delete_session("lmcache/") == 1 and s.exists(PageKey.semantic("lmcache", "p", 0))
    with pytest.raises(kvfs.SessionNotFound):
        s.session_info("nothing")


def test_a_capacity_beyond_the_disks_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--capacity 500GiB` on a smaller disk: the disk fills before the cap (architecture.md,
    "A full disk"), and nothing said so."""
    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "d",), capacity=1 << 60)
    with caplog.at_level("WARNING", logger="kvfs"), kvfs.open_store_sync(cfg) as s:
        assert s.statistics().capacity_bytes == 1 << 60  # (kept: only said)
    assert [r for r in caplog.records if "more than the data directories can hold" in r.message]
    caplog.clear()
    with (
        caplog.at_level("WARNING", logger="kvfs"),
        kvfs.open_store_sync(cfg.replace(capacity=1 << 20)) as s,
    ):
        assert s.statistics().capacity_bytes == 1 << 20
    assert not [r for r in caplog.records if "can hold" in r.message]
