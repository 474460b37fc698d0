"""Corruption is detected and never returned; deduplicated data lives exactly as long as its
last reference."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _corrupt import flip_stored_byte

import kvfs
from kvfs._checksum import LEAF

KiB, MiB = 1024, 1 << 20


def flip(info: kvfs.PageInfo, page_off: int) -> None:
    """Flip one bit of the stored byte at ``page_off`` of the page, in its data file."""
    flip_stored_byte(info, page_off, mask=0x10)


SIZE = 2 * LEAF + 100 * KiB + 123  # three leaves, the last one partial


@pytest.mark.parametrize(
    "where", [0, 4095, 4096, LEAF - 1, LEAF, LEAF + 777 * KiB, 2 * LEAF, SIZE - 1]
)
@pytest.mark.parametrize("ndev", [1, 3])
def test_flipped_byte_is_corrupt_page(
    make_config: Callable[..., kvfs.StoreConfig], where: int, ndev: int
) -> None:
    data = os.urandom(SIZE)
    with kvfs.open_store_sync(make_config(ndev=ndev, stripe_unit=256 * KiB)) as store:
        info = store.put("s/page", data)
        flip(info, where)
        with pytest.raises(kvfs.CorruptPage) as ei:
            store.get("s/page")
        assert isinstance(ei.value, OSError) and "corrupt" in str(ei.value)
        for buf in (bytearray(SIZE), kvfs.aligned_buffer(SIZE)):
            with pytest.raises(kvfs.CorruptPage):
                store.get("s/page", into=buf)
        bad_leaf = where // LEAF
        with pytest.raises(kvfs.CorruptPage):
            store.read_range("s/page", where, 1)
        with pytest.raises(kvfs.CorruptPage):
            store.read_range("s/page", max(0, where - 10), 20)
        for leaf in range(3):  # ranged reads verify only the leaves they touch
            if leaf != bad_leaf:
                lo = leaf * LEAF
                assert store.read_range("s/page", lo + 5, 100) == data[lo + 5 : lo + 105]
        assert store.statistics().corrupt_reads >= 5
        assert store.fsck()["corrupt"] == [info.checksum]
        flip(info, where)  # flipped back: good again, nothing cached the failure
        assert store.get("s/page") == data
        flip(info, where)
        report = store.fsck(repair=True)
        assert report["corrupt"] and report["repaired"]
        assert not store.exists("s/page")


@pytest.mark.parametrize("size", [100 * KiB, SIZE])  # hashed first and shared, or written
@pytest.mark.parametrize("found_by", ["get", "fsck"])
@pytest.mark.parametrize("restart", [False, True])
def test_a_put_of_the_bytes_of_a_damaged_copy_replaces_it(
    make_config: Callable[..., kvfs.StoreConfig], size: int, found_by: str, restart: bool
) -> None:
    """A put whose bytes matched a local copy known to be damaged shared it: the put
    succeeded, its own good bytes were dropped, and its page was as unreadable as the first
    (fsck --repair then deleted it). A system prompt's page rotting made every session
    that saved it later unreadable. What was found damaged is remembered across a restart."""
    data = os.urandom(size)
    cfg = make_config(ndev=2, stripe_unit=256 * KiB)
    with kvfs.open_store_sync(cfg) as store:
        flip(store.put("s/page", data), size // 2)
        if found_by == "get":
            with pytest.raises(kvfs.CorruptPage):
                store.get("s/page")
        else:
            assert store.fsck()["corrupt"]
        if not restart:
            _put_replaces_the_damaged_copy(store, data)
    if restart:
        with kvfs.open_store_sync(cfg) as store:
            _put_replaces_the_damaged_copy(store, data)
    with kvfs.open_store_sync(cfg) as store:
        assert store.get("s/page") == data and store.fsck()["orphans"] == []


def _put_replaces_the_damaged_copy(store: kvfs.SyncStore, data: bytes) -> None:
    store.put("t/page", data)
    assert store.get("t/page") == data
    assert store.get("s/page") == data  # the same content: good again
    report = store.fsck()
    assert "damaged_pages" in report and not any(report.values()), report
    st = store.statistics()
    assert st.used_bytes == sum(d.used_bytes for d in st.devices)


def test_a_good_copy_put_after_a_damaged_one_went_is_not_taken_for_it_after_a_restart(
    make_config: Callable[..., kvfs.StoreConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """The index kept which contents were found damaged, not which copy: the damaged copy
    deleted and the bytes put again, the next open took that good copy for the damaged one,
    and the next put of the bytes replaced it (its files written again, a heal logged)."""
    data = os.urandom(100 * KiB)
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as store:
        flipped = store.put("s/page", data)
        flip(flipped, 5)
        with pytest.raises(kvfs.CorruptPage):
            store.get("s/page")
        store.delete("s/page")
        good = store.put("t/page", data).extents
        # (what a kvfs from before reads stays as it was: contents alone, which it took
        # to be hex strings and failed to open the index on anything else)
        assert list(store.engine.index.get_meta("damaged")) == [flipped.checksum]
    with kvfs.open_store_sync(cfg) as store, caplog.at_level("INFO", logger="kvfs"):
        store.put("u/page", data)
        assert store.stat("t/page").extents == store.stat("u/page").extents == good
        assert store.get("t/page") == data
    assert not [r for r in caplog.records if "heal" in r.getMessage()]


def test_a_content_a_kvfs_from_before_found_damaged_stays_damaged(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A kvfs from before saves the damaged contents alone, under 'damaged', and leaves
    'damaged_copies' as this one wrote it: a content it found damaged was forgotten at this
    kvfs's next open, which read the copies only, and a put of those bytes shared the
    damaged copy (the page it put could not be read)."""
    a, b = os.urandom(100 * KiB), os.urandom(100 * KiB)
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as store:
        first = store.put("s/a", a)
        flip(first, 5)
        with pytest.raises(kvfs.CorruptPage):
            store.get("s/a")  # (noted by this kvfs: its copy and its content)
        second = store.put("s/b", b)
        flip(second, 5)
        # what a kvfs from before saves when it finds b damaged: the contents alone
        store.engine.index.set_meta("damaged", [first.checksum, second.checksum])
    with kvfs.open_store_sync(cfg) as store:
        store.put("t/b", b)
        assert store.get("t/b") == b
        store.put("t/a", a)
        assert store.get("t/a") == a


CRASH_IN_REPLACE = r"""
import os, signal, sys
import kvfs
from kvfs import _engine

data = bytes(range(256)) * 400
cfg = kvfs.StoreConfig(data_dirs=(sys.argv[1],))
_engine.Engine.replaced_damaged = lambda self, row: os.kill(os.getpid(), signal.SIGKILL)
with kvfs.open_store_sync(cfg) as st:
    try:
        st.get("s/a")
    except kvfs.CorruptPage:
        st.put("s/b", data)  # replaces the damaged copy; killed right after its commit
"""


def test_a_crash_in_a_put_replacing_a_damaged_copy_leaves_its_pages_readable(
    tmp_path: Path,
) -> None:
    """The damaged copy was dropped in a transaction of its own before the put's commit: a
    crash between them left the pages of that content with data held nowhere, and fsck
    reported nothing. Now the put's commit replaces it."""
    data = bytes(range(256)) * 400
    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "d",))
    with kvfs.open_store_sync(cfg) as store:
        flip(store.put("s/a", data), 5000)
    r = subprocess.run(
        [sys.executable, "-c", CRASH_IN_REPLACE, str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert r.returncode == -9, r.stderr
    with kvfs.open_store_sync(cfg) as store:
        assert store.get("s/a") == data and store.get("s/b") == data
        assert [p.tier for p in store.list(path_prefix="s/")] == ["local", "local"]
        assert not any(v for k, v in store.fsck().items() if k != "orphans")


def test_missing_and_truncated_files(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=64 * KiB)) as store:
        a = store.put("s/a", os.urandom(300 * KiB))
        b = store.put("s/b", os.urandom(300 * KiB))
        os.truncate(a.extents[-1].path, a.extents[-1].offset + 10)
        with pytest.raises(kvfs.CorruptPage, match="shorter than its extents") as e:
            store.get("s/a")
        assert a.extents[-1].path in str(e.value)  # the file, not "fd 14"
        os.unlink(b.extents[0].path)
        with pytest.raises(kvfs.CorruptPage, match="missing"):
            store.get("s/b")
        report = store.fsck()
        assert report["missing"] and report["corrupt"] == [a.checksum]
        # the check without reading the data sees a short file too (it took one for whole)
        quick = store.engine.fsck(verify_data=False)
        assert quick["corrupt"] == [a.checksum] and quick["damaged_pages"] == ["s/a", "s/b"]


def test_dedup_survives_all_deletes_but_the_last(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    cfg = make_config(ndev=3, stripe_unit=64 * KiB)
    shared = os.urandom(5 * 64 * KiB + 999)  # striped over all three devices
    with kvfs.open_store_sync(cfg) as store:
        store.put("other/x", os.urandom(1000))
        base = store.statistics()
        keys = [kvfs.PageKey.semantic(f"agent-{i}", "system-prompt", 0) for i in range(6)]
        infos = [store.put(k, shared) for k in keys]
        files = {e.path for e in infos[0].extents}
        assert all({e.path for e in i.extents} == files for i in infos)  # one copy
        one = store.statistics()
        assert one.local_blobs == base.local_blobs + 1
        assert one.dedup_puts == base.dedup_puts + 5
        assert one.logical_bytes - base.logical_bytes == 6 * len(shared)
        stored = one.used_bytes - base.used_bytes
        assert 0 < stored < 2 * len(shared)
        # Delete every key but the last, in several ways: page, session, replace.
        store.delete(keys[0])
        store.delete_session("agent-1")
        store.put(keys[2], b"something else", replace=True)
        store.delete(keys[3])
        store.delete(keys[4])
        assert all(os.path.exists(f) for f in files)
        assert store.get(keys[5]) == shared
        small = store.engine.tier.disk_bytes(len(b"something else"))
        assert store.statistics().used_bytes - base.used_bytes == stored + small
        store.delete(keys[5])  # the last reference: the data goes
        assert not any(os.path.exists(f) for f in files)
        store.delete(keys[2])
        end = store.statistics()
        assert (end.used_bytes, end.local_blobs, end.local_bytes) == (
            base.used_bytes,
            base.local_blobs,
            base.local_bytes,
        )
        assert store.fsck()["orphans"] == []


def test_dedup_of_a_large_page_leaves_no_second_copy(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Large pages are written before their hash is known; the redundant copy is removed."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    data = os.urandom(3 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/1", data)
        used = store.statistics().used_bytes
        store.put("b/1", data)
        assert store.statistics().used_bytes == used
        assert store.fsck()["orphans"] == []
        assert store.get("b/1") == data


def test_a_corrupt_read_is_logged_with_its_cause(
    make_config: Callable[..., kvfs.StoreConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """The mount can only answer EIO: the log says which page and which bytes failed."""
    with kvfs.open_store_sync(make_config(ndev=1)) as s:
        s.put("a/p", os.urandom(3 * LEAF))
        flip_stored_byte(s.stat("a/p"), LEAF + 9)
        with caplog.at_level("WARNING", logger="kvfs"), pytest.raises(kvfs.CorruptPage):
            s.get("a/p")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'a/p' is corrupt: bytes 1048576-2097152" in m for m in warned), warned


def test_fsck_repair_on_a_live_store_touches_only_what_is_damaged(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """`kvfs fsck --repair` runs beside the daemon's clients. It once removed, as orphans,
    the files of a page still being written and of a deleted page a reader still held, and
    deleted a healthy page whose bytes were deleted and put again while it checked them."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as store:
        eng = store.engine
        data = os.urandom(1 * MiB)
        w = store.begin_write("engine/being-written.bin")  # a file open on the mount
        w.write(0, data)
        store.put("x/held", data[: 300 * KiB])
        with eng.lease("x/held") as (page, blob):  # a reader of a file deleted meanwhile
            store.delete("x/held")
            found = store.fsck(repair=True)
            assert found["orphans"] == [] and found["repaired"] == []
            assert bytes(eng.read_held(page, blob, 0, 4096)) == data[:4096]
        w.commit()
        assert store.get("engine/being-written.bin") == data

        store.put("x/a", data)
        local_blobs = eng.index.local_blobs

        def delete_and_put_again() -> list[object]:  # another client, while fsck checks
            rows = local_blobs()
            store.delete("x/a")
            store.put("y/b", data)
            return rows

        eng.index.local_blobs = delete_and_put_again  # type: ignore[method-assign]
        found = store.fsck(repair=True)
        eng.index.local_blobs = local_blobs  # type: ignore[method-assign]
        assert found["missing"] == [] and found["damaged_pages"] == [], found
        assert found["repaired"] == []
        assert store.get("y/b") == data
        assert not any(store.fsck().values())  # nothing missing, corrupt or orphaned


def test_fsck_repair_between_a_deletes_commit_and_its_unlink_spares_a_readers_files(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A delete commits, then drops the files (deferred while a reader holds them). A repair
    that ran between the two found the files named by no row and not yet deferred, and
    removed them as orphans from under the reader (found by a stress run)."""
    with kvfs.open_store_sync(make_config(ndev=2, stripe_unit=64 * KiB)) as store:
        eng = store.engine
        data = os.urandom(300 * KiB)
        store.put("x/held", data)
        drop = eng._drop_files
        found: dict[str, list[str]] = {}

        def repair_first(blob: object) -> None:  # fsck of another client, at that instant
            found.update(store.fsck(repair=True))
            drop(blob)  # type: ignore[arg-type]

        with eng.lease("x/held") as (page, blob):
            eng._drop_files = repair_first  # type: ignore[method-assign]
            try:
                store.delete("x/held")
            finally:
                eng._drop_files = drop  # type: ignore[method-assign]
            assert found["orphans"] == [], found
            assert bytes(eng.read_held(page, blob, 0, len(data))) == data
        assert not any(store.fsck().values())


def test_a_directory_among_the_data_files_stops_neither_an_open_nor_a_repair(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A directory someone made under blobs/<xx>/ was taken for a data file: unlinking it
    failed every open after a crash (IsADirectoryError, the daemon could not start) and
    every fsck --repair, before anything was repaired. A file lost from a striped page was
    also listed once per extent."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/page", os.urandom(300 * KiB))
    stray = cfg.data_dirs[0] / "blobs" / "ab" / "dir"
    stray.mkdir(parents=True)
    crashed = (
        "import kvfs, os, sys\n"
        "cfg = kvfs.StoreConfig(data_dirs=sys.argv[1:], stripe_unit=65536)\n"
        "opened = kvfs.open_store_sync(cfg)\n"
        "s = opened.__enter__()\n"
        "s.put('s/other', b'o' * 5000)\n"
        "os._exit(0)  # killed: not closed cleanly\n"
    )
    subprocess.run([sys.executable, "-c", crashed, *map(str, cfg.data_dirs)], check=True)
    with kvfs.open_store_sync(cfg) as s:  # recovery at open: it skips what is no file
        assert stray.is_dir()
        orphan = cfg.data_dirs[1] / "blobs" / "cd" / "leftover"
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"x")
        lost = info.extents[0].path
        assert sum(e.path == lost for e in info.extents) > 1  # one file, several extents
        os.unlink(lost)
        found = s.fsck()
        assert found["missing"] == [lost] and found["orphans"] == [str(orphan)]
        repaired = s.fsck(repair=True)["repaired"]
        assert f"removed orphan {orphan}" in repaired and not s.exists("s/page")
        assert not any(s.fsck()[k] for k in ("missing", "corrupt", "orphans"))


def test_a_data_file_whose_read_fails_is_listed_as_unreadable(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A read that fails once the file is open (a bad sector: preadv's EIO names no file)
    was listed under ``unreadable`` by its error's text, which the check then dropped as no
    file of the blob: fsck found no problem (exit 0) while it listed the page as damaged, and
    its repair kept the page "see unreadable", with nothing there. A directory where the
    data file was opens and fails its read (EISDIR) the same way."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/page", os.urandom(100 * KiB))
        other = os.urandom(100 * KiB)
        s.put("s/other", other)
        cut = info.extents[0].path
        os.unlink(cut)
        os.mkdir(cut)
        found = s.fsck()
        assert found["unreadable"] == [cut]
        assert found["damaged_pages"] == ["s/page"]
        assert not any(found[k] for k in ("missing", "corrupt", "orphans"))
        repaired = s.fsck(repair=True)
        assert repaired["unreadable"] == [cut] and repaired["unrecoverable"] == ["s/page"]
        assert s.exists("s/page") and s.get("s/other") == other
