"""A data device that fails while the store runs: a real ext4 file system on a loop device,
mounted for each test (root, as CI runs) as one of two data directories, then shut down
with ext4's own ioctl (``EXT4_IOC_SHUTDOWN``: every later I/O on it fails with EIO, as a
device that dropped off the bus) and, for what a comeback finds, mounted again. What
each failure leaves is in docs/architecture.md, "A device that fails"."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyfuse3
import pytest
from _loop_disk import LoopDisk

import kvfs
from kvfs._fuse import KvfsOperations


def two_devices(tmp_path: Path, disk: LoopDisk) -> kvfs.StoreConfig:
    """A store on a plain directory (its index there too) and on ``disk``."""
    return kvfs.StoreConfig(data_dirs=(tmp_path / "d0", disk.path / "data"))


def put_all(s: kvfs.SyncStore, pages: dict[str, bytes]) -> None:
    for k, v in pages.items():
        s.put(k, v)


def test_a_device_cut_off_after_the_store_was_made_opens_again(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # The device marker was renamed into place, its directory synced, but its bytes were
    # never: the comeback found an empty marker, and every open refused the store ("is
    # unreadable ... kvfs will not guess"), its pages lost with it.
    cfg = two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        loop_disk.shut_down()
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        assert {k: s.get(k) for k in pages} == pages


def test_fsck_repair_keeps_the_pages_of_a_device_that_cannot_be_read(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # An I/O error was "corrupt": the copy was marked damaged and --repair deleted its
    # pages (then stopped on an EIO of its own), so the device came back to find them gone.
    cfg = two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000) for i in range(6)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        on_disk = {k: s.stat(k).extents[0].device for k in pages}
        cut = sorted(k for k, dev in on_disk.items() if dev == 1)
        assert cut and len(cut) < len(pages)  # (pages on both devices)
        os.sync()
        loop_disk.shut_down()
        found = s.fsck()
        assert found["corrupt"] == [] and found["missing"] == []
        assert found["unreadable"] and all(
            p.startswith(str(loop_disk.path)) for p in found["unreadable"]
        )
        assert found["damaged_pages"] == cut
        repaired = s.fsck(repair=True)
        assert repaired["unrecoverable"] == cut
        assert sorted(p.path for p in s.list()) == sorted(pages)  # nothing deleted
        for k in pages:
            if k not in cut:
                assert s.get(k) == pages[k]
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        assert {k: s.get(k) for k in pages} == pages
        found = s.fsck()
        assert not any(found[k] for k in ("unreadable", "corrupt", "orphans", "damaged_pages"))


async def test_the_mount_says_in_its_log_that_a_disk_fails(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # cat on the mount got EIO and the daemon's log said nothing (a failing disk was
    # news only to the programs it failed): one warning now, and a count of the rest
    from types import SimpleNamespace

    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
    cfg = kvfs.StoreConfig(data_dirs=(loop_disk.path / "data",), index_dir=tmp_path / "index")
    async with kvfs.open_store(cfg) as store:
        for i in range(3):
            await store.put(f"a/p{i}", os.urandom(100_000))
        ops = KvfsOperations(store)
        try:
            a = (await ops.lookup(pyfuse3.ROOT_INODE, b"a", ctx)).st_ino
            inodes = [(await ops.lookup(a, f"p{i}".encode(), ctx)).st_ino for i in range(3)]
            os.sync()
            loop_disk.shut_down()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvfs.fuse"):
                for ino in inodes:
                    with pytest.raises(pyfuse3.FUSEError) as e:
                        fi = await ops.open(ino, os.O_RDONLY, ctx)
                        try:
                            await ops.read(fi.fh, 0, 100_000)
                        finally:
                            await ops.release(fi.fh)
                    assert e.value.errno == errno.EIO
        finally:
            await ops.aclose()
    said = [r.getMessage() for r in caplog.records if r.name == "kvfs.fuse"]
    assert len(said) == 1 and "Input/output error" in said[0], said  # (then counted)


def test_an_open_while_a_device_fails_says_so(tmp_path: Path, loop_disk: LoopDisk) -> None:
    # the open stopped at the marker with a bare "[Errno 5] Input/output error" (kvfs ls
    # printed only that, exit 1)
    cfg = two_devices(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p", b"x" * 100_000)
    loop_disk.shut_down()
    with pytest.raises(kvfs.KvfsError, match=r"cannot be read \(Input/output error; is its disk"):
        kvfs.open_store_sync(cfg).__enter__()
    # kvfs ls says it in one line, and exits with a failing disk's code (it was 1, as for
    # any error)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    data = ",".join(str(d) for d in cfg.data_dirs)
    r = subprocess.run(
        [sys.executable, "-m", "cli", "ls", "--offline", "--data", data],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 10 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is its disk failing?" in r.stderr
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:  # nothing changed by the failed open
        assert s.get("a/p") == b"x" * 100_000


def test_puts_go_to_the_devices_that_work_while_one_fails(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # Placement did not skip a failing device: about every other put of a small page failed
    # with EIO, and `kvfs stats` showed the device as healthy.
    from cli._store_cmds import render_stats
    from kvfs._metrics import render_metrics

    cfg = two_devices(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/before", os.urandom(100_000))
        os.sync()
        loop_disk.shut_down()
        # engine pages, and semantic layers, which otherwise land on consecutive devices:
        # the put that meets the failing disk is written again on the other one
        pages = {f"b/p{i}": os.urandom(100_000) for i in range(6)}
        pages |= {f"sessions/s/p/layer-{i:03d}": os.urandom(100_000) for i in range(6)}
        put_all(s, pages)
        assert {k for k in pages if s.stat(k).extents[0].device != 0} == set()
        assert {k: s.get(k) for k in pages} == pages
        ok, bad = s.statistics().devices
        assert (ok.errors, ok.failing) == (0, False)
        assert bad.errors >= 1 and bad.failing
        assert bad.last_error is not None and "Input/output error" in bad.last_error
        text = render_stats(s.statistics())
        assert "failing" in text and "device 1: last disk error" in text, text
        metrics = render_metrics(s.statistics(), [])
        assert 'kvfs_device_failing{device="1"' in metrics
        assert [ln for ln in metrics.splitlines() if ln.startswith("kvfs_device_failing{")] == [
            f'kvfs_device_failing{{device="{d.index}",path="{d.path}"}} {int(d.failing)}'
            for d in (ok, bad)
        ]


def archived_on_two_devices(tmp_path: Path, disk: LoopDisk) -> kvfs.StoreConfig:
    """:func:`two_devices` with a file:// archive beside the plain directory."""
    import dataclasses

    return dataclasses.replace(
        two_devices(tmp_path, disk),
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0}},
    )


def test_a_page_on_a_failing_disk_is_read_from_the_archive(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # A read of a page whose local copy is on the failing disk got EIO even where the
    # archive held the page (local+archive): only a checksum mismatch healed from it.
    cfg = archived_on_two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000 + i) for i in range(6)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        s.spill("a")
        s.restore("a")  # held locally and in the archive
        put_all(s, {f"b/p{i}": os.urandom(100_000) for i in range(4)})
        on_disk = {k: s.stat(k).extents[0].device for k in pages}
        assert set(on_disk.values()) == {0, 1}
        only_here = next(f"b/p{i}" for i in range(4) if s.stat(f"b/p{i}").extents[0].device)
        os.sync()
        loop_disk.shut_down()
        for k, v in pages.items():
            assert s.get(k) == v
            buf = bytearray(len(v))
            assert s.get(k, into=buf) == len(v) and buf == v
            assert s.read_range(k, 5_000, 10_000) == v[5_000:15_000]
        with pytest.raises(OSError) as e:  # nothing else holds it: the disk's error
            s.get(only_here)
        assert e.value.errno == errno.EIO and not isinstance(e.value, kvfs.KvfsError)
        assert s.statistics().devices[1].errors >= 1
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:  # the local copies were kept: the disk is back
        assert {k: s.stat(k).tier for k in pages} == dict.fromkeys(pages, "local+archive")
        assert {k: s.get(k) for k in pages} == pages


def test_a_restore_while_a_disk_fails_goes_to_the_other_devices(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # A restore was placed on the failing device as on any other, and failed with EIO: in
    # the restore workers, whose errors taught this process nothing, and in a read's.
    cfg = archived_on_two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000 + i) for i in range(6)}
    reads = {f"b/p{i}": os.urandom(100_000 + i) for i in range(6)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages | reads)
        s.spill("a")
        s.spill("b")
        os.sync()
        loop_disk.shut_down()
        assert s.restore("a") == sum(map(len, pages.values()))
        assert {s.stat(k).tier for k in pages} == {"local+archive"}
        assert {s.stat(k).extents[0].device for k in pages} == {0}
        assert {k: s.get(k) for k in pages} == pages
        assert s.statistics().devices[1].errors >= 1
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:  # a fresh store knows no failing device
        loop_disk.shut_down()
        assert {k: s.get(k) for k in reads} == reads
        assert {s.stat(k).extents[0].device for k in reads if s.stat(k).tier != "archive"} == {0}


async def test_the_mount_reads_a_page_on_a_failing_disk_from_the_archive(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # cat on the mount got EIO for a page the archive held too
    from types import SimpleNamespace

    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
    cfg = archived_on_two_devices(tmp_path, loop_disk)
    pages = {f"p{i}": os.urandom(300_000 + i) for i in range(4)}
    async with kvfs.open_store(cfg) as store:
        for k, v in pages.items():
            await store.put(f"a/{k}", v)
        await store.spill("a")
        await store.restore("a")
        assert {(await store.stat(f"a/{k}")).extents[0].device for k in pages} == {0, 1}
        ops = KvfsOperations(store)
        try:
            a = (await ops.lookup(pyfuse3.ROOT_INODE, b"a", ctx)).st_ino
            inodes = {k: (await ops.lookup(a, k.encode(), ctx)).st_ino for k in pages}
            os.sync()
            loop_disk.shut_down()
            for k, ino in inodes.items():
                fi = await ops.open(ino, os.O_RDONLY, ctx)
                try:
                    got = bytes(await ops.read(fi.fh, 0, 131072))
                    got += bytes(await ops.read(fi.fh, 131072, 1 << 20))
                finally:
                    await ops.release(fi.fh)
                assert got == pages[k]
        finally:
            await ops.aclose()


def test_deletes_and_evictions_go_on_while_a_disk_fails(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # A delete of a page on the failing disk was done in the index, then raised the disk's
    # EIO at the unlink (a retry found no page); an eviction to the archive of a session
    # with one page there evicted none of the others.
    cfg = archived_on_two_devices(tmp_path, loop_disk)
    doomed = {f"a/p{i}": os.urandom(100_000 + i) for i in range(4)}
    cold = {f"c/p{i}": os.urandom(100_000 + i) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, doomed | cold)
        cold_on = {k: s.stat(k).extents[0].device for k in cold}
        assert set(cold_on.values()) == {0, 1}
        os.sync()
        loop_disk.shut_down()
        for k in doomed:
            s.delete(k)
        assert s.list(session="a") == []
        assert s.evict(session="c") > 0
        tiers = {k: s.stat(k).tier for k in cold}
        assert tiers == {k: "local" if dev == 1 else "archive" for k, dev in cold_on.items()}
        assert {k: s.get(k) for k in cold if cold_on[k] == 0} == {
            k: v for k, v in cold.items() if cold_on[k] == 0
        }
        assert s.statistics().devices[1].errors >= 1
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:  # what could not be removed is an orphan
        assert {k: s.get(k) for k in cold} == cold
        found = s.fsck(repair=True)
        assert found["orphans"] and all(p.startswith(str(loop_disk.path)) for p in found["orphans"])
        assert not s.fsck()["orphans"]


def test_the_fast_path_reads_a_page_on_a_failing_disk_from_the_archive(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # The GDS fast path (host backend here) read the backing files, got EIO from the
    # failing disk and failed, where get served the archive's copy.
    import gds
    from kvfs._aligned import aligned_buffer

    cfg = archived_on_two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(300_000 + i) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as fp:
        put_all(s, pages)
        s.spill("a")
        s.restore("a")
        put_all(s, {f"b/p{i}": os.urandom(100_000) for i in range(4)})
        assert {s.stat(k).extents[0].device for k in pages} == {0, 1}
        only_here = next(f"b/p{i}" for i in range(4) if s.stat(f"b/p{i}").extents[0].device)
        os.sync()
        loop_disk.shut_down()
        for k, v in pages.items():
            dest = aligned_buffer(len(v))
            assert fp.read(k, dest).result(timeout=60) == len(v)
            assert bytes(dest[: len(v)]) == v
        with pytest.raises(OSError) as e:  # no other copy: the disk's error
            fp.read(only_here, aligned_buffer(100_000)).result(timeout=60)
        assert e.value.errno == errno.EIO


async def test_a_disk_error_through_the_daemon_keeps_its_errno(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # A client of the daemon got a bare OSError for the failing disk's EIO: its errno was
    # None (an engine telling a failing disk from other errors could not). And each such
    # call was an ERROR event line in the daemon's log: one WARNING now, the rest counted
    import trio

    from kvfs._control import control_service
    from kvfs._remote import open_remote_store, open_remote_store_sync

    sock = tmp_path / "c.sock"
    async with (
        kvfs.open_store(two_devices(tmp_path, loop_disk)) as store,
        trio.open_nursery() as n,
    ):
        await n.start(control_service, store, sock)
        for i in range(4):
            await store.put(f"a/p{i}", os.urandom(100_000))
        devices = {f"a/p{i}": (await store.stat(f"a/p{i}")).extents[0].device for i in range(4)}
        cut = next(k for k, dev in devices.items() if dev)
        os.sync()
        loop_disk.shut_down()
        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="kvfs.events")
        async with open_remote_store(sock) as r:
            with pytest.raises(OSError) as e:
                await r.get(cut)
            assert e.value.errno == errno.EIO and "Input/output error" in str(e.value)

        def sync_get() -> None:
            with open_remote_store_sync(sock) as r:
                r.get(cut)

        for _ in range(3):
            with pytest.raises(OSError) as e:
                await trio.to_thread.run_sync(sync_get)
            assert e.value.errno == errno.EIO
        n.cancel_scope.cancel()
    said = [r for r in caplog.records if getattr(r, "kvfs_event", None) == "error"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "Input/output error" in said[0].getMessage()


def test_a_device_back_under_the_running_store_is_used_again(
    tmp_path: Path, loop_disk: LoopDisk, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failing spell ends FAILING_SECONDS after the last error (0 here, not to wait a
    # minute): the disk mounted again under the running store serves its pages and takes
    # new ones, with no reopen.
    import kvfs._local

    cfg = two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        os.sync()
        loop_disk.shut_down()
        put_all(s, {f"b/p{i}": os.urandom(100_000) for i in range(4)})
        assert s.statistics().devices[1].failing
        loop_disk.comeback()
        assert {k: s.get(k) for k in pages} == pages
        monkeypatch.setattr(kvfs._local, "FAILING_SECONDS", 0.0)
        later = {f"c/p{i}": os.urandom(100_000) for i in range(4)}
        put_all(s, later)
        assert {s.stat(k).extents[0].device for k in later} == {0, 1}
        assert not s.statistics().devices[1].failing
        assert {k: s.get(k) for k in later} == later
        found = s.fsck()
        assert not any(found[k] for k in ("missing", "corrupt", "unreadable", "damaged_pages"))
