"""Spill and restore through a real FUSE mount (served in this process): a spilled page keeps
its place in ``ls`` and reading it with ordinary file I/O restores it transparently."""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import kvfs
from kvfs import PageKey
from kvfs._mount import MountOptions, serve_mount

if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:  # pragma: no cover
    pytest.fail("these tests need /dev/fuse and fusermount3", pytrace=False)


def spilling_store(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, ndev: int
) -> tuple[kvfs.StoreConfig, Path]:
    """A store with a file:// archive whose spiller runs every 50 ms but finds nothing cold
    (spills are asked for), and an empty mountpoint."""
    cfg = make_config(
        ndev=ndev,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0.05, "idle_seconds": 3600}},
    )
    mp = tmp_path / "mnt"
    mp.mkdir()
    return cfg, mp


async def test_read_spilled_pages_through_mount(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    cfg, mp = spilling_store(make_config, tmp_path, ndev=2)
    pages = {PageKey.semantic("agent", "p0", i): os.urandom(300_000 + i) for i in range(3)}
    async with kvfs.open_store(cfg) as store:
        for k, v in pages.items():
            await store.put(k, v)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_mount, store, mp, MountOptions(auto_unmount=False))
            try:
                assert await store.spill("agent") > 0
                assert all(i.tier == "archive" for i in await store.list(session="agent"))
                d = mp / "sessions" / "agent" / "p0"
                names = await trio.to_thread.run_sync(os.listdir, d)
                assert sorted(names) == ["layer-000", "layer-001", "layer-002"]
                st = await trio.to_thread.run_sync(os.stat, d / "layer-001")
                assert st.st_size == len(pages[PageKey.semantic("agent", "p0", 1)])
                for k, v in pages.items():
                    got = await trio.to_thread.run_sync((mp / k.path).read_bytes)
                    assert got == v
                assert all(i.tier == "local+archive" for i in await store.list(session="agent"))
                tier = await trio.to_thread.run_sync(os.getxattr, d / "layer-000", "user.kvfs.tier")
                assert tier == b"local+archive"
                # a corrupted archive object is an I/O error on the mount, never bad bytes
                k2 = PageKey.semantic("agent", "p1", 0)  # never read: not in the page cache
                await store.put(k2, os.urandom(200_000))
                await store.spill("agent")
                obj = tmp_path / "archive" / "blobs" / (await store.stat(k2)).checksum
                raw = bytearray(obj.read_bytes())
                raw[-100] ^= 0xFF
                obj.write_bytes(bytes(raw))
                with pytest.raises(OSError) as ei:
                    await trio.to_thread.run_sync((mp / k2.path).read_bytes)
                assert ei.value.errno == errno.EIO
            finally:
                nursery.cancel_scope.cancel()


async def test_a_damaged_local_copy_heals_through_the_mount(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A flipped byte in the local copy of an archived page: reading the file through the
    mount returns the right bytes (the copy comes back from the archive), twice over."""
    from _corrupt import flip_stored_byte

    cfg = make_config(ndev=1, archive_url=f"file://{tmp_path / 'archive'}")
    mp = tmp_path / "mnt"
    mp.mkdir()
    k, data = PageKey.semantic("agent", "p0", 0), os.urandom(3 << 20)
    async with kvfs.open_store(cfg) as store:
        await store.put(k, data)
        await store.spill("agent")
        await store.restore("agent")
        flip_stored_byte(await store.stat(k), (2 << 20) + 5)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_mount, store, mp, MountOptions(auto_unmount=False))
            try:
                for _ in range(2):
                    assert await trio.to_thread.run_sync((mp / k.path).read_bytes) == data
                st = await store.statistics()
                assert st.corrupt_reads >= 1 and st.extra["archive"]["blobs_healed"] == 1
            finally:
                nursery.cancel_scope.cancel()


async def test_an_open_spilled_file_stays_readable_after_its_unlink(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """POSIX keeps an unlinked file readable through the descriptors open on it. For a page
    held only in the archive, the object outlives the unlink while the file is open, the
    read brings back a copy no index row names, and that copy goes with the last close."""
    cfg, mp = spilling_store(make_config, tmp_path, ndev=1)
    k, data = PageKey.semantic("agent", "p0", 0), os.urandom(3 << 20)
    async with kvfs.open_store(cfg) as store:
        await store.put(k, data)
        obj = tmp_path / "archive" / "blobs" / (await store.stat(k)).checksum
        await store.spill("agent")
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_mount, store, mp, MountOptions(auto_unmount=False))
            try:

                def unlink_then_read() -> tuple[bytes, bytes]:
                    # (no mmap here: copying from a mapping holds the GIL through the page
                    # faults this process's own mount must answer; see _kvfs_mount.py)
                    with open(mp / k.path, "rb") as f, open(mp / k.path, "rb") as g:
                        os.unlink(mp / k.path)
                        assert not (mp / k.path).exists()
                        tail = os.pread(g.fileno(), 1 << 20, len(data) - (1 << 20))
                        return f.read(), tail

                got, tail = await trio.to_thread.run_sync(unlink_then_read)
                assert got == data and tail == data[-(1 << 20) :]
                assert not await store.exists(k)
                assert obj.exists()
                # closed (the kernel sends the release after close returns): the unnamed
                # copy goes, and the object with the spiller's next pass
                with trio.fail_after(10):
                    while (await store.statistics()).used_bytes or obj.exists():
                        await trio.sleep(0.05)
                blobs = cfg.data_dirs[0] / "blobs"
                assert not [f for f in blobs.rglob("*") if f.is_file()]
            finally:
                nursery.cancel_scope.cancel()


async def test_a_spilled_page_reads_through_the_mount_with_no_local_room(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """Every byte of the capacity held by pinned pages: ``cat`` and ``mmap`` of a spilled
    file still read it, from a verified copy in memory (before: ENOSPC, and SIGBUS through
    a mapping)."""
    import mmap

    cfg = make_config(
        ndev=1,
        capacity=4 << 20,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0}},
    )
    mp = tmp_path / "mnt"
    mp.mkdir()
    k = PageKey.semantic("cold", "p", 0)
    want = os.urandom(3 << 20)
    async with kvfs.open_store(cfg) as store:
        await store.put(k, want)
        await store.spill("cold")
        await store.pin_session("hold")
        i = 0
        while True:  # nothing evictable left
            try:
                await store.put(PageKey.semantic("hold", "p", i), os.urandom(512 << 10))
            except kvfs.CapacityExceeded:
                break
            i += 1
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_mount, store, mp, MountOptions(auto_unmount=False))
            try:
                got = await trio.to_thread.run_sync((mp / k.path).read_bytes)
                assert got == want

                def mapped() -> bytes:
                    with (
                        open(mp / k.path, "rb") as f,
                        mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m,
                    ):
                        return bytes(m[-4096:])

                assert await trio.to_thread.run_sync(mapped) == want[-4096:]
                assert (await store.stat(k)).tier == "archive"
                assert (await store.statistics()).extra["archive"]["memory_reads"] >= 1
            finally:
                nursery.cancel_scope.cancel()


async def test_an_open_spilled_file_unlinked_while_its_read_downloads_it_reads(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """The unlink of an open file whose page only the archive holds, landing while the
    read downloads the page: the download was adopted as the page's local copy, found no
    row left to adopt it, and the read failed (the page was "deleted during its restore"),
    where an unlink before the read left it readable. The object is a FIFO here, so the
    download waits until the test writes it, after the unlink; it is read once."""
    cfg, mp = spilling_store(make_config, tmp_path, ndev=1)
    k, data = PageKey.semantic("agent", "p0", 0), os.urandom(1 << 20)
    async with kvfs.open_store(cfg) as store:
        await store.put(k, data)
        obj = tmp_path / "archive" / "blobs" / (await store.stat(k)).checksum
        await store.spill("agent")
        body = obj.read_bytes()
        obj.unlink()
        os.mkfifo(obj)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_mount, store, mp, MountOptions(auto_unmount=False))
            try:
                f = await trio.to_thread.run_sync(open, mp / k.path, "rb")
                try:
                    reading = trio.Event()
                    got: list[bytes] = []

                    async def read() -> None:
                        reading.set()
                        got.append(await trio.to_thread.run_sync(f.read))

                    async with trio.open_nursery() as readers:
                        readers.start_soon(read)
                        await reading.wait()
                        with trio.fail_after(30):  # the read waits for the object (its FIFO)
                            while not _waiting_in("_restore_one"):
                                await trio.sleep(0.01)
                        await trio.to_thread.run_sync(os.unlink, mp / k.path)
                        assert not await store.exists(k)

                        def feed() -> None:
                            with open(obj, "wb") as w:
                                # one download: a later get finds no object (the read-ahead
                                # asked again after the failure, and hid it)
                                obj.unlink()
                                w.write(body)

                        await trio.to_thread.run_sync(feed)
                    assert got == [data]
                finally:
                    await trio.to_thread.run_sync(f.close)
                with trio.fail_after(10):  # closed: the unnamed copy goes
                    while (await store.statistics()).used_bytes:
                        await trio.sleep(0.05)
            finally:
                nursery.cancel_scope.cancel()


def _waiting_in(caller: str) -> bool:
    """Whether a thread of this process is in function ``caller`` while it waits for the
    trio loop to run something for it (``trio.from_thread.run``)."""
    for frame in sys._current_frames().values():
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if caller in names and "from_thread_run" in names:
            return True
    return False
