"""The fast path's host backend: O_DIRECT preadv from the striped files, verified, leased.

Everything here runs without a GPU; ``test_gds_gpu.py`` holds the kvikio tests.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import trio
from _corrupt import flip_stored_byte
from _gds import KiB, MiB, aligned, archive_only_with_no_room, fastpath_fixtures, key, rand

import gds
import kvfs

store, fp = fastpath_fixtures(threads=4)


class HoldAfter(Executor):
    """Runs the first ``k`` submitted tasks on a real pool and holds the rest until
    :meth:`release`: a deterministic way to keep a read in flight."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.pool = ThreadPoolExecutor(2)
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.lock = threading.Lock()
        self.count = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        with self.lock:
            self.count += 1
            if self.count > self.k:
                self.held.append((fn, args))
                return Future()
        return self.pool.submit(fn, *args)

    def release(self) -> None:
        with self.lock:
            self.k = 1 << 30
            held, self.held = self.held, []
        for fn, args in held:
            self.pool.submit(fn, *args)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.release()
        self.pool.shutdown(wait=wait)


# -- reads ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_piece", [8 * KiB, 4 * MiB])
def test_striped_page_reads_bit_exact(store: kvfs.SyncStore, max_piece: int) -> None:
    data = rand(5 * MiB + 123)  # odd tail: the last 4 KiB goes through a bounce buffer
    info = store.put(key(0), data)
    assert len({e.device for e in info.extents}) == 3
    with gds.FastPath(store, threads=4, max_piece=max_piece) as fp:
        dest = aligned(data.nbytes)
        assert fp.read(key(0), dest).result() == data.nbytes
    assert np.array_equal(dest, data)


def test_batch_of_pages_overlaps_and_is_exact(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    sizes = [0, 1, 4096, 64 * KiB + 1, MiB, 3 * MiB + 5, 2 * MiB]
    datas = [rand(n, seed=i) for i, n in enumerate(sizes)]
    for i, d in enumerate(datas):
        store.put(key(i), d)
    dests = [aligned(n) for n in sizes]
    futs = fp.read_many([key(i) for i in range(len(sizes))], dests)
    assert [f.result() for f in futs] == sizes
    for d, got in zip(datas, dests, strict=True):
        assert np.array_equal(d, got)


def test_layer_keys_of_a_prefix_in_layer_order(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    for i in (10, 2, 0, 1):
        store.put(key(i), rand(4096, seed=i))
    store.put(key(0, prefix="other"), rand(4096))
    keys = fp.layer_keys("sess", "p0")
    assert keys == [key(i).path for i in (0, 1, 2, 10)]
    dests = [aligned(4096) for _ in keys]
    assert [f.result() for f in fp.read_many(keys, dests)] == [4096] * 4
    assert np.array_equal(dests[3], rand(4096, seed=10))


@contextmanager
def archive_only_page(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> Iterator[tuple[kvfs.SyncStore, gds.FastPath, np.ndarray]]:
    """A store, its fast path and the bytes of its page key(0), which only the archive holds."""
    url = f"file://{tmp_path / 'archive'}"
    cfg = make_config(ndev=2, name="arch", archive_url=url, extra={"archive": {"interval": 0}})
    with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as fp:
        data = rand(3 * MiB + 1)
        s.put(key(0), data)
        assert s.spill("sess") > 0
        assert s.stat(key(0)).tier == "archive"
        yield s, fp, data


def test_archived_page_is_restored_then_read(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    with archive_only_page(make_config, tmp_path) as (s, fp, data):
        dest = aligned(data.nbytes)
        assert fp.read(key(0), dest).result() == data.nbytes
        assert np.array_equal(dest, data)
        assert s.stat(key(0)).tier == "local+archive"


def test_a_bad_destination_is_refused_before_an_archive_only_page_is_restored(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """A read into an unaligned, too small or read-only destination of a page only the
    archive held restored the page (a download, and local room) before refusing it."""
    with archive_only_page(make_config, tmp_path) as (s, fp, data):
        for dest, error in (
            (aligned(data.nbytes + 1)[1:], gds.UnalignedDestination),
            (aligned(data.nbytes - 1), ValueError),
            (bytes(data.nbytes), TypeError),
        ):
            with pytest.raises(error):
                fp.read(key(0), dest)
            assert s.stat(key(0)).tier == "archive", error
        assert s.statistics().used_bytes == 0 and not s.engine._leases
        dest = aligned(data.nbytes)
        assert fp.read(key(0), dest).result() == data.nbytes
        assert np.array_equal(dest, data)


def test_destination_may_be_larger_and_any_dtype(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    data = rand(MiB)
    store.put(key(0), data)
    dest = aligned(2 * MiB).view(np.float16).reshape(2, -1)
    assert fp.read(key(0), dest).result() == MiB
    assert np.array_equal(dest.reshape(-1).view(np.uint8)[:MiB], data)


def test_missing_page_raises_at_call(fp: gds.FastPath) -> None:
    with pytest.raises(kvfs.PageNotFound):
        fp.read(key(9), aligned(4096))


def test_bad_destinations(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    store.put(key(0), rand(8192))
    with pytest.raises(ValueError, match="smaller"):
        fp.read(key(0), aligned(4096))
    with pytest.raises(TypeError, match="read-only"):
        fp.read(key(0), bytes(8192))
    with pytest.raises(ValueError, match="GPU memory"):
        fp.read(key(0), aligned(8192), backend="kvikio")
    # A failed call holds no lease: the page can still be deleted for good.
    store.delete(key(0))
    assert not store.engine._leases


def test_unaligned_destination_is_refused_or_bounced(
    store: kvfs.SyncStore, fp: gds.FastPath
) -> None:
    data = rand(3 * MiB + 17)
    store.put(key(0), data)
    backing = aligned(data.nbytes + 4096)
    dest = backing[1 : 1 + data.nbytes]
    with pytest.raises(gds.UnalignedDestination):
        fp.read(key(0), dest)
    assert fp.read(key(0), dest, allow_unaligned=True).result() == data.nbytes
    assert np.array_equal(dest, data)
    assert backing[0] == 0 and not backing[1 + data.nbytes :].any()


def test_verify_off_returns_raw_bytes(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    data = rand(2 * MiB)
    store.put(key(0), data)
    dest = aligned(data.nbytes)
    assert fp.read(key(0), dest, verify=False).result() == data.nbytes
    assert np.array_equal(dest, data)


# -- checksums -----------------------------------------------------------------------
@pytest.mark.parametrize("where", [0, 1_500_000, 4 * MiB + 100])
def test_flipped_byte_is_an_error(store: kvfs.SyncStore, fp: gds.FastPath, where: int) -> None:
    data = rand(4 * MiB + 200)
    info = store.put(key(0), data)
    flip_stored_byte(info, where)
    with pytest.raises(kvfs.CorruptPage, match=f"bytes {where // MiB * MiB}-"):
        fp.read(key(0), aligned(data.nbytes)).result()
    # The check is what caught it: unverified, the flipped byte comes through.
    dest = aligned(data.nbytes)
    fp.read(key(0), dest, verify=False).result()
    assert dest[where] == data[where] ^ 0xFF
    assert not store.engine._leases  # failed reads release their lease


def test_missing_data_file_is_corrupt(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    info = store.put(key(0), rand(MiB))
    os.unlink(info.extents[-1].path)
    with pytest.raises(kvfs.CorruptPage, match="missing"):
        fp.read(key(0), aligned(MiB)).result()


# -- leases --------------------------------------------------------------------------
def test_delete_during_read_keeps_files_until_done(store: kvfs.SyncStore) -> None:
    data = rand(MiB + 4096)
    info = store.put(key(0), data)
    files = {e.path for e in info.extents}
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    pool.submit(gate.wait)  # the I/O thread is busy: the read is queued, lease held
    with gds.FastPath(store, io_pool=pool) as fp:
        dest = aligned(data.nbytes)
        fut = fp.read(key(0), dest)
        try:
            assert store.evict(key(0)) == 0  # leased: not evicted
            assert store.exists(key(0))
            store.delete(key(0))
            assert not store.exists(key(0))
            assert all(os.path.exists(f) for f in files)
        finally:
            gate.set()  # (else leaving the block waits for the read for ever)
        assert fut.result() == data.nbytes
    assert np.array_equal(dest, data)
    assert not any(os.path.exists(f) for f in files)  # unlinked when the lease ended
    pool.shutdown()


def test_lease_released_after_read(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    store.put(key(0), rand(64 * KiB))
    fp.read(key(0), aligned(64 * KiB)).result()
    assert not store.engine._leases
    assert store.evict(key(0)) > 0


def test_a_batch_keeps_no_data_file_open_while_its_hashing_waits(store: kvfs.SyncStore) -> None:
    """Each read kept its data files open until its last leaf was hashed: a batch read
    faster than it was hashed (read_many of many layers) held a descriptor per page and
    device, and ran out of them (EMFILE) under a limit a few pages above what was open.
    A file is closed once its last piece is read."""
    n, size = 40, 3 * 64 * KiB + 1  # every page on all three devices
    datas = [rand(size, seed=i) for i in range(n)]
    for i, d in enumerate(datas):
        store.put(key(i), d)
    io, hashing = ThreadPoolExecutor(1), HoldAfter(0)  # the hashing waits for every read
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
    try:
        with gds.FastPath(store, io_pool=io, hash_pool=hashing) as fp:
            dests = [aligned(size) for _ in range(n)]
            futs = fp.read_many([key(i) for i in range(n)], dests)
            io.submit(lambda: None).result()  # (one thread: every piece is read by now)
            hashing.release()
            assert [f.result(timeout=60) for f in futs] == [size] * n
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        io.shutdown()
        hashing.shutdown()
    for d, got in zip(datas, dests, strict=True):
        assert np.array_equal(d, got)


# -- the layer-wise loader -------------------------------------------------------------
def test_layer_loader_yields_a_layer_while_the_next_is_in_flight(store: kvfs.SyncStore) -> None:
    datas = [rand(32 * KiB, seed=i) for i in range(4)]  # one piece each
    for i, d in enumerate(datas):
        store.put(key(i), d)
    io = HoldAfter(1)  # layer 0's only piece runs, layer 1's is held
    with gds.FastPath(store, io_pool=io) as fp:
        dests = [aligned(32 * KiB) for _ in datas]
        keys = [key(i) for i in range(4)]
        try:
            with fp.load_layers(keys, dests, ahead=1) as layers:
                it = iter(layers)
                i, buf = next(it)
                assert i == 0 and np.array_equal(buf, datas[0])
                assert layers.submitted == 2  # layer 1 started, 2 and 3 not yet
                assert not layers.future(1).done()
                io.release()
                rest = list(it)
        finally:
            io.release()
        assert [i for i, _ in rest] == [1, 2, 3]
        for i, buf in rest:
            assert np.array_equal(buf, datas[i])
    io.shutdown()


def test_a_missing_layer_raises_at_its_turn(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    """With ahead=1, taking layer 1 starts layer 2: its page missing, PageNotFound came at
    layer 1's turn, and layer 1, read, was never yielded (and iterating on skipped layer 3).
    Before that, load_layers raised from its constructor while layer 0 was still being
    written into its buffer."""
    datas = [rand(8 * KiB, seed=i) for i in range(4)]
    for i, d in enumerate(datas):
        store.put(key(i), d)
    keys = [key(i) for i in range(4)]
    store.delete(key(2))
    dests = [aligned(8 * KiB) for _ in keys]
    with fp.load_layers(keys, dests, ahead=1) as layers:
        it = iter(layers)
        for want in (0, 1):
            i, buf = next(it)
            assert i == want and np.array_equal(buf, datas[i])
        with pytest.raises(kvfs.PageNotFound):
            next(it)
        i, buf = next(it)  # the layers after it go on
        assert i == 3 and np.array_equal(buf, datas[3])
        with pytest.raises(StopIteration):
            next(it)
    assert not store.engine._leases


def test_read_many_waits_for_the_started_reads_before_raising(store: kvfs.SyncStore) -> None:
    """read_many raised PageNotFound (a later key missing) while the earlier reads still
    wrote into their buffers: the caller, told it failed, reused a buffer being written."""
    data = rand(64 * KiB, seed=7)
    store.put(key(0), data)
    io = HoldAfter(0)  # every read waits until released
    with gds.FastPath(store, io_pool=io) as fp:
        dest = aligned(64 * KiB)
        release = threading.Timer(0.3, io.release)
        release.start()
        try:
            with pytest.raises(kvfs.PageNotFound):
                fp.read_many([key(0), "no/such-page"], [dest, aligned(4 * KiB)])
            assert np.array_equal(dest, data)  # its read had ended when the error came
        finally:
            release.cancel()
            io.release()
        assert not store.engine._leases
    io.shutdown()


def test_layer_loader_raises_at_the_corrupt_layer(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    infos = [store.put(key(i), rand(256 * KiB, seed=i)) for i in range(3)]
    flip_stored_byte(infos[1], 5)
    seen = []
    with (
        pytest.raises(kvfs.CorruptPage),
        fp.load_layers(
            [key(i) for i in range(3)], [aligned(256 * KiB) for _ in range(3)]
        ) as layers,
    ):
        for i, _buf in layers:
            seen.append(i)
    assert seen == [0]
    assert not store.engine._leases  # leaving the block waited for every read


async def test_layer_loader_async(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    async with kvfs.open_store(make_config(ndev=2, stripe_unit=64 * KiB)) as s:
        datas = [rand(200 * KiB, seed=i) for i in range(5)]
        for i, d in enumerate(datas):
            await s.put(key(i), d)
        with gds.FastPath(s) as fp:
            dests = [aligned(200 * KiB) for _ in datas]
            got = []
            async with fp.load_layers([key(i) for i in range(5)], dests, ahead=2) as layers:
                async for i, buf in layers:
                    assert np.array_equal(buf, datas[i])
                    got.append(i)
            assert got == [0, 1, 2, 3, 4]
            assert await fp.aread(key(3), dests[0]) == 200 * KiB
            assert np.array_equal(dests[0], datas[3])


async def test_an_async_layer_loader_starts_its_reads_off_the_trio_thread(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Starting a layer's read looks its page up, and restores a page only the archive
    holds: ``async for`` started each next read on the trio thread, and every other task of
    the loop waited for it (a whole download, for such a page). They start from worker
    threads now, the first ones too when the loader is made by ``aload_layers``."""
    loop_thread = threading.get_ident()
    async with kvfs.open_store(make_config(ndev=2, stripe_unit=64 * KiB)) as s:
        datas = [rand(200 * KiB, seed=i) for i in range(4)]
        for i, d in enumerate(datas):
            await s.put(key(i), d)
        with gds.FastPath(s) as fp:
            started: list[tuple[int, bool]] = []
            real = fp.read

            def read(k: Any, into: object, **kw: Any) -> Future[int]:  # (the real read)
                started.append(
                    (int(str(k).rsplit("-", 1)[1]), threading.get_ident() == loop_thread)
                )
                return real(k, into, **kw)

            fp.read = read  # type: ignore[method-assign]
            dests = [aligned(200 * KiB) for _ in datas]
            keys = [key(i) for i in range(4)]
            async with await fp.aload_layers(keys, dests, ahead=1) as layers:
                async for i, buf in layers:
                    assert np.array_equal(buf, datas[i])
            assert sorted(started) == [(i, False) for i in range(4)], started


async def test_cancelled_wait_returns_only_after_the_io(store: kvfs.SyncStore) -> None:
    store.put(key(0), rand(MiB))
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    pool.submit(gate.wait)
    with gds.FastPath(store, io_pool=pool) as fp:
        fut = fp.read(key(0), aligned(MiB))
        with trio.CancelScope() as cs:
            cs.cancel()
            trio.lowlevel.current_trio_token().run_sync_soon(gate.set)
            await gds.wait(fut)
        assert cs.cancelled_caught
        assert fut.done()  # the cancellation came through only once the read was over
    pool.shutdown()


# -- writes --------------------------------------------------------------------------
def test_write_host_buffer_commits_with_right_checksum(
    store: kvfs.SyncStore, fp: gds.FastPath
) -> None:
    data = rand(3 * MiB + 7)
    info = fp.write(key(0), data, attrs={"dtype": "u8"}).result()
    assert info.checksum == kvfs.checksum(data.tobytes()).hex()
    assert info.size == data.nbytes and info.attrs == {"dtype": "u8"}
    dest = aligned(data.nbytes)
    fp.read(key(0), dest).result()
    assert np.array_equal(dest, data)
    with pytest.raises(kvfs.PageExists):
        fp.write(key(0), data).result()


# -- by path (the mount's xattrs) -----------------------------------------------------
def fake_xattrs(info: kvfs.PageInfo) -> dict[str, bytes]:
    """The xattrs a kvfs mount shows on a page (the extents as the explicit list)."""
    import json

    return {
        "user.kvfs.extents": json.dumps(
            [[e.path, e.offset, e.length] for e in info.extents]
        ).encode(),
        "user.kvfs.size": str(info.size).encode(),
        "user.kvfs.checksum": info.checksum.encode(),
    }


def fake_mount_file(tmp_path: Any, info: kvfs.PageInfo, name: str = "page") -> str:
    """A plain file carrying the xattrs a kvfs mount shows on a page, as long as the page
    (sparse) as a page file on the mount is."""
    p = str(tmp_path / name)
    with open(p, "wb") as f:
        f.truncate(info.size)
    for attr, value in fake_xattrs(info).items():
        os.setxattr(p, attr, value)
    return p


def test_read_by_path_through_xattrs(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    # ext4 keeps all of a file's xattrs in one 4 KiB block: a 1 MiB stripe unit keeps the
    # extents list short enough for this stand-in (a FUSE mount allows 64 KiB).
    cfg = make_config(ndev=3, stripe_unit=MiB, name="bypath")
    with kvfs.open_store_sync(cfg) as store, gds.FastPath() as fp:
        data = rand(2 * MiB + 4096 + 9)
        info = store.put(key(0), data)
        assert len({e.device for e in info.extents}) == 3
        p = fake_mount_file(tmp_path, info)
        dest = aligned(data.nbytes)
        assert fp.read_path(p, dest).result() == data.nbytes
        assert np.array_equal(dest, data)
        flip_stored_byte(info, MiB + 3)
        with pytest.raises(kvfs.CorruptPage):
            fp.read_path(p, aligned(data.nbytes)).result()


def close_waits_for(fp: gds.FastPath, fut: Any, held: HoldAfter, nbytes: int) -> None:
    """``fp.close()`` from another thread waits while ``fut`` (held back by ``held``) is in
    flight, and returns once it resolved with ``nbytes``."""
    closing = threading.Thread(target=fp.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # close waits for the read in flight
    held.release()
    assert fut.result(timeout=60) == nbytes
    closing.join(60)
    assert not closing.is_alive()


def test_close_waits_for_a_read_by_path(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """With the caller's io_pool, close() returned at once while a read by path was in
    flight (only reads by key were waited for); the read then failed on the hash pool
    close() had shut down."""
    cfg = make_config(ndev=1, stripe_unit=MiB, name="bypath-close")
    with kvfs.open_store_sync(cfg) as store:
        data = rand(2 * MiB + 9)
        p = fake_mount_file(tmp_path, store.put(key(0), data))
        held = HoldAfter(0)
        fp = gds.FastPath(io_pool=held)
        dest = aligned(data.nbytes)
        close_waits_for(fp, fp.read_path(p, dest), held, data.nbytes)
        assert np.array_equal(dest, data)
        held.shutdown()


class SubmitWaits(Executor):
    """A real pool whose ``submit`` waits until :meth:`go`: holds a call that submits work
    (a read queueing its pieces) at that point. ``entered`` is set once one waits there."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.pool = ThreadPoolExecutor(2)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        self.entered.set()
        self.gate.wait()
        return self.pool.submit(fn, *args, **kw)

    def go(self) -> None:
        self.gate.set()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.go()
        self.pool.shutdown(wait=wait)


@pytest.mark.parametrize("by", ["key", "path"])
def test_close_waits_for_a_read_whose_call_is_under_way(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any, by: str
) -> None:
    """close() waited only for the reads whose call had returned: one still queueing its
    pieces when close() was called was missed, close() stopped the hash pool under it, and
    the read failed with a bare RuntimeError (cannot schedule new futures after shutdown)."""
    with kvfs.open_store_sync(make_config(ndev=1, stripe_unit=MiB, name="close")) as store:
        data = rand(2 * MiB + 9)
        p = fake_mount_file(tmp_path, store.put(key(0), data))
        pool = SubmitWaits()
        fp = gds.FastPath(store, io_pool=pool)
        dest = aligned(data.nbytes)
        futs: list[Future[int]] = []
        call = (lambda: fp.read(key(0), dest)) if by == "key" else (lambda: fp.read_path(p, dest))
        reading = threading.Thread(target=lambda: futs.append(call()))
        reading.start()
        try:
            assert pool.entered.wait(60)  # the read's call is queueing its first piece
            closing = threading.Thread(target=fp.close)
            closing.start()
            closing.join(0.5)  # (gives a close that does not wait the time to finish)
        finally:
            pool.go()
        reading.join(60)
        assert futs[0].result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)
        closing.join(60)
        assert not closing.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            fp.read(key(0), dest)
        pool.shutdown()


def test_closing_the_store_waits_for_a_fast_path_read(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """The store closed before its FastPath (against the documented order) did not wait for
    the read's lease: it unlinked the files of the page deleted meanwhile under the read,
    closed the index and released its lock, and the read failed with ProgrammingError. Now
    close waits for it as for any call, and a read begun after is StoreClosed at the call."""
    with kvfs.open_store_sync(make_config(ndev=3, stripe_unit=64 * KiB)) as store:
        data = rand(MiB + 4096)
        files = {e.path for e in store.put(key(0), data).extents}
        store.put(key(1), data[:4096])
        held = HoldAfter(0)
        fp = gds.FastPath(store, io_pool=held)
        dest = aligned(data.nbytes)
        fut = fp.read(key(0), dest)
        store.delete(key(0))  # (its files wait for the read's lease)
        closing = threading.Thread(target=store.close)
        closing.start()
        closing.join(0.5)
        assert closing.is_alive()  # close waits for the read in flight
        assert all(os.path.exists(f) for f in files)
        held.release()
        assert fut.result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)
        closing.join(60)
        assert not closing.is_alive()
        assert not any(os.path.exists(f) for f in files)  # unlinked when the lease ended
        with pytest.raises(kvfs.StoreClosed):
            fp.read(key(1), aligned(4096))
        fp.close()
        held.shutdown()


def test_read_by_path_needs_the_xattr(fp: gds.FastPath, tmp_path: Any) -> None:
    p = tmp_path / "plain"
    p.write_bytes(b"x" * 10)
    with pytest.raises(gds.NotAKvfsPage):
        fp.read_path(p, aligned(4096))
    with pytest.raises(FileNotFoundError):
        fp.read_path(tmp_path / "absent", aligned(4096))


def test_a_file_on_no_mount_is_never_read_through(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """A file on no kvfs mount whose attributes say its page is archive-only (extents
    ``[]``), or whose size is not what its extents cover, was read through as if a mount
    had verified it: its own bytes came back as the page, checked against nothing."""
    cfg = make_config(ndev=1, stripe_unit=MiB, name="plain")
    with kvfs.open_store_sync(cfg) as store, gds.FastPath() as fp:
        info = store.put(key(0), rand(8 * KiB))
        p = fake_mount_file(tmp_path, info)
        with open(p, "wb") as f:
            f.write(b"not the page: nothing checks these bytes".ljust(info.size, b"."))
        for name, value in (("user.kvfs.extents", b"[]"), ("user.kvfs.size", b"4096")):
            os.setxattr(p, name, value)
            dest = aligned(8 * KiB)
            with pytest.raises(kvfs.CorruptPage, match="no kvfs mount"):
                fp.read_path(p, dest).result()
            assert not dest.any()
            os.setxattr(p, "user.kvfs.extents", fake_xattrs(info)["user.kvfs.extents"])
            os.setxattr(p, "user.kvfs.size", fake_xattrs(info)["user.kvfs.size"])
        assert fp.read_path(p, dest).result() == info.size  # its own attributes: read


# -- no GPU library on the host path --------------------------------------------------
def test_host_path_never_imports_gpu_libraries(tmp_path: Any) -> None:
    code = f"""
import sys, numpy as np, kvfs, gds
cfg = kvfs.StoreConfig(data_dirs=[{str(tmp_path / "a")!r}, {str(tmp_path / "b")!r}],
                       stripe_unit=65536)
with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as fp:
    d = np.arange(300000, dtype=np.uint32).view(np.uint8)
    fp.write("sessions/s/p/layer-000", d).result()
    out = np.frombuffer(kvfs.aligned_buffer(d.nbytes), np.uint8)
    assert fp.backend_for(out) == "host"
    fp.read("sessions/s/p/layer-000", out).result()
    assert (out == d).all()
bad = [m for m in ("kvikio", "cupy", "torch") if m in sys.modules]
assert not bad, bad
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_damaged_local_copy_of_archived_data_heals_on_the_fast_path(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """As with ``get``: the fast path's read of a page whose local copy fails its checksum,
    while the archive holds it, replaces the copy from the archive and reads it again."""
    cfg = make_config(ndev=2, archive_url=f"file://{tmp_path / 'archive'}")
    with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as path:
        k, data = kvfs.PageKey.semantic("a", "p", 0), rand(3 * MiB + 5)
        s.put(k, data)
        s.spill("a")
        s.restore("a")
        flip_stored_byte(s.stat(k), MiB + 3)
        dest = aligned(len(data))
        assert path.read(k, dest).result(timeout=60) == len(data)
        assert np.array_equal(dest[: len(data)], data)
        assert s.statistics().extra["archive"]["blobs_healed"] == 1
        other = kvfs.PageKey.semantic("b", "p", 0)
        s.put(other, rand(MiB))  # local only: nothing to heal from
        flip_stored_byte(s.stat(other), 10)
        with pytest.raises(kvfs.CorruptPage):
            path.read(other, aligned(MiB)).result(timeout=60)


def test_an_archive_only_page_with_no_local_room_is_read_from_memory(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """``get`` serves such a page from the archive's verified memory copy; the fast path
    crashed on it (AttributeError: the restore gave bytes, not a local copy)."""
    data = rand(MiB + 5)
    cfg = archive_only_with_no_room(make_config, f"file://{tmp_path / 'archive'}", data)
    with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as fp:
        dest = aligned(data.nbytes)
        assert fp.read(key(0), dest).result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)
        assert s.stat(key(0)).tier == "archive"  # served from memory: nothing written locally
        with pytest.raises(gds.UnalignedDestination):  # refused as for a read from files
            fp.read(key(0), np.zeros(data.nbytes + 1, np.uint8)[1:])


def test_relative_data_directories_give_absolute_extents(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path (and any process reading user.kvfs.extents) was handed paths relative
    to the store's working directory."""
    monkeypatch.chdir(tmp_path)
    cfg = make_config(ndev=2).replace(data_dirs=("rel0", "rel1"), index_dir=None)
    with kvfs.open_store_sync(cfg) as s:
        data = rand(3 * MiB)
        info = s.put(key(0), data)
        assert all(os.path.isabs(e.path) for e in info.extents)
        monkeypatch.chdir("/")
        with gds.FastPath(s) as fp:
            dest = aligned(data.nbytes)
            assert fp.read(key(0), dest).result() == data.nbytes
            assert np.array_equal(dest, data)


def test_a_heal_replaces_the_copy_that_was_read_not_the_keys_current_one(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """A read of damaged archived data whose key was replaced meanwhile healed the key's
    new data (not archived: the read failed) instead of the data it read (which key(1)
    still holds: it must be healed)."""
    cfg = make_config(ndev=2, archive_url=f"file://{tmp_path / 'archive'}")
    old, new = rand(2 * MiB, seed=1), rand(2 * MiB, seed=2)
    with kvfs.open_store_sync(cfg) as s:
        s.put(key(0), old)
        s.put(key(1), old)  # the same data (stored once)
        s.spill("sess")
        s.restore("sess")
        flip_stored_byte(s.stat(key(0)), 5)
        held = HoldAfter(0)
        with gds.FastPath(s, io_pool=held) as fp:
            dest = aligned(old.nbytes)
            fut = fp.read(key(0), dest)  # leased, its pieces held
            s.put(key(0), new, replace=True)  # local only: no archived copy
            held.release()
            assert fut.result(timeout=60) == new.nbytes  # healed the old copy, read again
            assert np.array_equal(dest, new)
        held.shutdown()
        assert s.statistics().extra["archive"]["blobs_healed"] == 1
        assert s.get(key(1)) == old.tobytes()  # the healed copy


def test_close_waits_for_a_read_that_heals(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Any
) -> None:
    """close() during a read that needed a heal turned the read into RuntimeError (its
    second attempt found the FastPath closed)."""
    cfg = make_config(ndev=2, archive_url=f"file://{tmp_path / 'archive'}")
    data = rand(2 * MiB)
    with kvfs.open_store_sync(cfg) as s:
        s.put(key(0), data)
        s.spill("sess")
        s.restore("sess")
        flip_stored_byte(s.stat(key(0)), 5)
        held = HoldAfter(0)
        fp = gds.FastPath(s, io_pool=held)
        dest = aligned(data.nbytes)
        close_waits_for(fp, fp.read(key(0), dest), held, data.nbytes)
        assert np.array_equal(dest, data)
        with pytest.raises(RuntimeError, match="closed"):
            fp.read(key(0), dest)
        held.shutdown()


def test_fast_path_arguments_and_counters(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    with pytest.raises(ValueError, match="max_piece"):  # at construction, not at first read
        gds.FastPath(store, max_piece=1000)
    with pytest.raises(TypeError, match="needs a store"):  # it failed at the first read
        gds.FastPath("not-a-store")
    # a write's argument errors come at the call, as a read's do (they came in the future)
    with pytest.raises(kvfs.InvalidKey):
        fp.write("../x", b"abc")
    with pytest.raises(kvfs.InvalidKey):
        fp.write(key(7), b"abc", attrs={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="buffer"):
        fp.write(key(7), 123)
    with pytest.raises(ValueError, match="C-contiguous"):
        fp.write(key(7), rand(100)[::2])
    assert not store.exists(key(7))
    for layer in (1000, 999, 5):
        store.put(key(layer), rand(4096, seed=layer))
    assert fp.layer_keys("sess", "p0") == [key(i).path for i in (5, 999, 1000)]
    before = store.statistics()
    fp.read(key(5), aligned(4096)).result()
    after = store.statistics()
    assert (after.gets, after.hits) == (before.gets + 1, before.hits + 1)
