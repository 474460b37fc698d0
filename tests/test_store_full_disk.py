"""A disk that fills up under the store, or under its file:// archive: a real 16 MiB tmpfs,
mounted for each test (root, as CI runs). Every failure is a clear CapacityExceeded (or
ArchiveUnavailable for the archive), nothing is left behind, pages already acknowledged
stay intact, and the store goes on once space is freed."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvfs

Run = Callable[..., tuple[int, str, str]]

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def filled(disk: Path, leave: int = 0) -> Iterator[None]:
    """Fill ``disk`` until ``leave`` bytes are free (or nothing is), then free it again."""
    filler = disk / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        f.write(bytes(max(0, free(disk) - leave)))
    try:
        yield
    finally:
        filler.unlink()


def clean(s: kvfs.SyncStore) -> None:
    report = s.fsck()
    assert report["orphans"] == [] and report["missing"] == [] and report["corrupt"] == []
    assert s.statistics().reserved_bytes == 0


def test_a_put_that_does_not_fit_on_the_disk_is_capacity_exceeded(small_disk: Path) -> None:
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)  # over the disk
    with kvfs.open_store_sync(cfg) as s:
        stored = {}
        with pytest.raises(kvfs.CapacityExceeded, match="is full"):
            for i in range(32):
                data = os.urandom(MiB)
                s.put(f"a/p{i}", data)
                stored[f"a/p{i}"] = data
        assert 8 <= len(stored) < 16
        assert all(s.get(k) == v for k, v in stored.items())
        clean(s)
        s.delete("a/p0")
        s.delete("a/p1")
        s.put("a/again", os.urandom(MiB))  # the same store goes on
        clean(s)


def test_the_index_that_cannot_grow_changes_nothing(small_disk: Path) -> None:
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p", os.urandom(MiB))
        s.set_session_attrs("a", {"model": "m"})
        big = {"model": "m", "notes": "x" * (2 * MiB)}  # more WAL than the disk has left
        with filled(small_disk):
            with pytest.raises(kvfs.CapacityExceeded, match="index .* cannot grow"):
                s.set_session_attrs("a", big)
            with pytest.raises(kvfs.CapacityExceeded):
                s.put("a/q", os.urandom(64 * 1024))
        assert s.session_info("a").attrs == {"model": "m"}
        assert not s.exists("a/q")
        clean(s)
        s.set_session_attrs("a", big)  # room again: the same store takes it
        assert s.session_info("a").attrs == big
    with kvfs.open_store_sync(cfg) as s:
        assert s.session_info("a").attrs == big and len(s.list()) == 1


def test_every_failure_near_a_full_disk_is_clean(small_disk: Path) -> None:
    """Puts at every amount of free space from 0 to ~400 KiB (4 KiB steps): each one either
    succeeds or raises CapacityExceeded; afterwards every acknowledged page reads back, fsck
    finds nothing wrong, and the store reopens with all of them."""
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    stored: dict[str, bytes] = {}
    errors: dict[str, int] = {}
    with kvfs.open_store_sync(cfg) as s:
        for i in range(6):
            stored[f"a/p{i}"] = os.urandom(MiB)
            s.put(f"a/p{i}", stored[f"a/p{i}"])
        for slack in range(0, 400 * 1024, 4096):
            with filled(small_disk, leave=slack):
                for j in range(2):
                    key, data = f"b/s{slack}-{j}", os.urandom(48 * 1024 + j)
                    try:
                        s.put(key, data)
                        stored[key] = data
                    except kvfs.CapacityExceeded as e:
                        kind = "index" if "index" in str(e) else "device"
                        errors[kind] = errors.get(kind, 0) + 1
        assert errors.get("device", 0) > 0 and len(stored) > 6, errors
        assert all(s.get(k) == v for k, v in stored.items())
        clean(s)
    with kvfs.open_store_sync(cfg) as s:
        assert {p.path for p in s.list(path_prefix="a/")} | {
            p.path for p in s.list(path_prefix="b/")
        } == set(stored)
        clean(s)


def test_the_default_capacity_leaves_room_for_the_index(small_disk: Path) -> None:
    """capacity 0 (the devices' free space) keeps a reserve: the pages hit the cap, not the
    disk, and the index still grows to delete them."""
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",))
    with kvfs.open_store_sync(cfg) as s:
        with pytest.raises(kvfs.CapacityExceeded, match="no room"):
            for i in range(32):  # pinned: never evicted
                s.put(kvfs.PageKey.semantic("a", "p", i), os.urandom(MiB), pin=True)
        assert free(small_disk) >= 2 * MiB
        s.set_session_attrs("a", {"notes": "y" * (512 * 1024)})
        assert s.delete_session("a") >= 8
        assert s.list() == []
        clean(s)


def test_a_store_on_a_disk_that_filled_up_opens_and_deletes(small_disk: Path) -> None:
    """Another writer fills the disk while the store is closed: the open uses the index's
    reserve (kvfs-index.reserve), and deleting pages frees the disk again."""
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    with kvfs.open_store_sync(cfg) as s:
        for i in range(4):
            s.put(kvfs.PageKey.semantic("a", "p", i), os.urandom(MiB))
    assert (small_disk / "store" / "kvfs-index.reserve").exists()
    with filled(small_disk):
        assert free(small_disk) < 64 * 1024
        with kvfs.open_store_sync(cfg) as s:
            assert s.delete_session("a") == 4
            assert s.list() == []
            clean(s)
        assert free(small_disk) >= 4 * MiB


def test_a_store_closed_on_a_full_disk_recounts_at_the_next_open_and_loses_nothing(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The close cannot mark the index clean (its WAL cannot grow): it says so and
    completes; the next open, with the disk still full (the index's reserve), recounts as
    after a crash, and every page is there with nothing left over."""
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    data = {f"a/p{i}": os.urandom(MiB) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s:
        for k, v in data.items():
            s.put(k, v)
        used = s.statistics().used_bytes
        with filled(small_disk):
            with pytest.raises(kvfs.CapacityExceeded):
                s.put("a/more", os.urandom(64 * 1024))
            caplog.clear()
            s.close()
            assert "closed without marking the index clean" in caplog.text
            with kvfs.open_store_sync(cfg) as s:
                assert "not closed cleanly" in caplog.text
                assert s.engine.recovered_orphans == []
                assert all(s.get(k) == v for k, v in data.items())
                assert s.statistics().used_bytes == used
                clean(s)
    with kvfs.open_store_sync(cfg) as s:
        assert sorted(p.path for p in s.list()) == sorted(data)


def failed_creates(disk: Path, store: Path) -> Iterator[tuple[int, kvfs.CapacityExceeded]]:
    """Create a store at ``store`` with each amount of free space from 0 to ~256 KiB left
    on ``disk`` (the index, its WAL and shared memory, the directories table, the device
    marker each run out in turn): ``(bytes left, error)`` of each create that failed,
    looked at while the disk is still that full; one that opened is removed."""
    for leave in range(0, 256 * 1024, 8192):
        with filled(disk, leave=leave):
            try:
                with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(store,))):
                    pass
            except kvfs.CapacityExceeded as e:
                yield leave, e
            else:
                shutil.rmtree(store)


def test_a_store_created_on_a_full_disk_is_made_whole_or_not_at_all(
    small_disk: Path, run: Run
) -> None:
    """A new store's open at every amount of free space from 0 to ~256 KiB (the index, its
    WAL and shared memory, the directories table, the device marker each run out in turn)
    either opens or raises DiskFull saying so, leaving nothing: an empty index left behind
    was taken for a store by the next command (`kvfs ls` made one instead of answering "no
    kvfs store")."""
    store = small_disk / "store"
    failed = 0
    for leave, e in failed_creates(small_disk, store):
        assert "disk is full" in str(e) and "nothing was left behind" in str(e)
        assert not store.exists(), (leave, sorted(os.listdir(store)))
        failed += 1
    assert failed > 8
    (small_disk / "kept").mkdir()  # a directory that was there stays, and empty
    with filled(small_disk), pytest.raises(kvfs.CapacityExceeded, match="disk is full"):
        kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(small_disk / "kept",))).__enter__()
    assert list((small_disk / "kept").iterdir()) == []
    rc, _, err = run("ls", "--data", str(store))
    assert rc == 3 and "no kvfs store" in err and not store.exists()
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(store,))) as s:
        s.put("a/p", b"x" * 100)
        assert s.get("a/p") == b"x" * 100


def test_a_failed_create_lets_its_lock_go_only_with_its_directories_gone(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-up removed the lock file, let the lock go, then removed the directories it
    had made: an open in that window made a new lock file, held it, and had its blobs/
    removed from under it. When the lock goes now, only the lock file's directory is left."""
    from kvfs._lock import DirLock

    store = small_disk / "store"
    at_release: list[list[str]] = []
    release = DirLock.release

    def noting(self: DirLock) -> None:
        if self.path.parent == store:
            at_release.append(sorted(os.listdir(store)) if store.exists() else [])
        release(self)

    monkeypatch.setattr(DirLock, "release", noting)
    made_blobs = 0
    for _, _ in failed_creates(small_disk, store):  # (the last release: the failed open's)
        made_blobs += any("blobs" in seen for seen in at_release[-1:])
        assert not store.exists()
    assert made_blobs == 0


def test_an_empty_index_left_by_a_failed_create_is_no_store(small_disk: Path, run: Run) -> None:
    """What an older kvfs left after a create failed on a full disk (an empty index and lock
    file) is no store: commands say so, and a create that fails again removes it."""
    store = small_disk / "store"
    store.mkdir()
    (store / "kvfs-index.sqlite3").touch()
    (store / "kvfs.lock").touch()
    rc, _, err = run("ls", "--data", str(store))
    assert rc == 3 and "no kvfs store" in err
    with filled(small_disk), pytest.raises(kvfs.CapacityExceeded, match="disk is full"):
        kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(store,))).__enter__()
    assert sorted(os.listdir(store)) == ["kvfs.lock"]  # (the lock was there before)
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(store,))) as s:
        s.put("a/p", b"y")
    rc, out, _ = run("ls", "--data", str(store))
    assert rc == 0 and "a" in out.split()


# -- the archive tier (file:// archive; the same error paths serve S3) ---------------------
def spilled_cfg(data: Path, archive: Path) -> kvfs.StoreConfig:
    return kvfs.StoreConfig(
        data_dirs=(data,),
        capacity=1 << 30,
        archive_url=f"file://{archive}",
        extra={"archive": {"interval": 0}},
    )


def put_session(s: kvfs.SyncStore, n: int) -> dict[kvfs.PageKey, bytes]:
    data = {kvfs.PageKey.semantic("big", "p", i): os.urandom(MiB) for i in range(n)}
    for k, v in data.items():
        s.put(k, v)
    return data


def test_a_spill_to_a_full_archive_keeps_every_local_copy(small_disk: Path, tmp_path: Path) -> None:
    with kvfs.open_store_sync(spilled_cfg(tmp_path / "store", small_disk / "archive")) as s:
        data = put_session(s, 20)  # 20 MiB of incompressible pages: more than the 16 MiB
        with pytest.raises(kvfs.ArchiveUnavailable, match="No space left"):
            s.spill("big")
        # No manifest was written: nothing dropped (the objects stored before the disk
        # filled are recorded: local+archive, and not uploaded again)
        assert {s.stat(k).tier for k in data} <= {"local", "local+archive"}
        assert all(s.get(k) == v for k, v in data.items())
        clean(s)
        assert list((small_disk / "archive" / ".objectstore-tmp").iterdir()) == []


def test_a_restore_onto_a_full_disk_brings_back_what_fits(small_disk: Path, tmp_path: Path) -> None:
    with kvfs.open_store_sync(spilled_cfg(small_disk / "store", tmp_path / "archive")) as s:
        data = put_session(s, 8)
        s.spill("big")
        with filled(small_disk, leave=3 * MiB):
            with pytest.raises(kvfs.CapacityExceeded, match="is full"):
                s.restore("big")
            tiers = [s.stat(k).tier for k in data]
            assert 0 < tiers.count("local+archive") < 8 and "archive" in tiers
            clean(s)
        assert s.restore("big") == (8 - tiers.count("local+archive")) * MiB
        assert all(s.get(k) == v for k, v in data.items())
        clean(s)


def test_df_on_the_mount_shows_no_more_room_than_the_disk_has(
    small_disk: Path, tmp_path: Path
) -> None:
    """statfs said the cap less what is used, whatever the disk held: with 1 GiB given on a
    16 MiB disk, df showed 1 GiB available and a 40 MiB write then failed with ENOSPC."""
    from _kvfs_mount import ServedMount

    cfg = kvfs.StoreConfig(data_dirs=[small_disk / "d"], capacity=1 << 30)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(cfg, mp):
        st = os.statvfs(mp)
        assert st.f_blocks * st.f_frsize == 1 << 30  # the cap given, as given
        shown = st.f_bavail * st.f_frsize
        assert 0 < shown <= free(small_disk), (shown, free(small_disk))
        assert st.f_bfree == st.f_bavail


async def test_an_access_time_flush_on_a_full_disk_does_not_end_the_store(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The running store's atime flush was not guarded: SQLite that could not grow the
    index on a full disk raised out of it, and ended the store's nursery (every call of
    the daemon failed from then on)."""
    import trio

    import kvfs._engine
    import kvfs._store

    monkeypatch.setattr(kvfs._store, "HOUSEKEEPING_SECONDS", 0.05)
    # (the reads' own flush logs the same words: only the housekeeping loop's may end the
    # wait below, or the test could pass without that loop's flush ever failing)
    monkeypatch.setattr(kvfs._engine, "ATIME_FLUSH_SECONDS", 1e9)
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    keys = [f"s/p{i:04d}" for i in range(400)]
    with kvfs.open_store_sync(cfg) as s:
        for k in keys:
            s.put(k, k.encode())
        s.put("t/p", b"t")
    # (closed: the index's WAL is checkpointed and truncated; the flush must grow it)
    async with kvfs.open_store(cfg) as store:
        with filled(small_disk):
            for k in keys:  # access times for every page: more than the WAL holds
                assert await store.get(k) == k.encode()
            with trio.fail_after(60):  # (a bound on the wait, not a timing asserted)
                while "access times not written" not in caplog.text:
                    await trio.sleep(0.05)
        # the same store goes on, housekeeping included: a pin that ends is released
        await store.pin("t/p", ttl=0.2)
        with trio.fail_after(60):
            while store.engine.index.page("t/p").pinned:  # type: ignore[union-attr]
                await trio.sleep(0.05)
        await store.put("t/q", b"q")
        assert await store.get("t/q") == b"q"


def test_access_times_a_failed_flush_could_not_write_are_written_by_the_next(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush took the batch of access times noted by reads before writing it: when the
    write failed (a full disk), they were gone, and eviction ordered those pages by the
    times of their puts, as if never read since."""
    import kvfs._engine

    monkeypatch.setattr(kvfs._engine, "ATIME_FLUSH_SECONDS", 1e9)  # flushed here, not by reads
    cfg = kvfs.StoreConfig(data_dirs=(small_disk / "store",), capacity=1 << 30)
    keys = [f"s/p{i:04d}" for i in range(400)]
    with kvfs.open_store_sync(cfg) as s:
        for k in keys:
            s.put(k, k.encode())
    # (closed: the index's WAL is checkpointed and truncated; the flush must grow it)
    with kvfs.open_store_sync(cfg) as s:
        index = s.engine.index
        put_at = {k: index.page(k).atime for k in keys}  # type: ignore[union-attr]
        session_put_at = index.session("s").atime  # type: ignore[union-attr]
        with filled(small_disk):
            for k in keys:  # access times for every page: more than the WAL holds
                assert s.get(k) == k.encode()
            with pytest.raises(kvfs.CapacityExceeded):
                s.engine.flush_atimes()
        s.engine.flush_atimes()  # room again
        unread = [k for k in keys if index.page(k).atime <= put_at[k]]  # type: ignore[union-attr]
        assert unread == []
        assert index.session("s").atime > session_put_at  # type: ignore[union-attr]
