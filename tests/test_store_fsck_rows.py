"""fsck checks the index's rows against each other, not only against the files: a blob row
lost while pages still name its data (its files were then removed as orphans, and the
pages could never be read), a blob row whose size or digests are wrong, reference counts,
page sizes; and its repair never deletes a pinned page (it deleted damaged pinned pages
like any other)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _corrupt import flip_stored_byte

import kvfs
from kvfs._index import _pack
from kvfs._maint import FSCK_FINDINGS

KiB = 1024


@contextmanager
def index_of(cfg: kvfs.StoreConfig) -> Iterator[sqlite3.Connection]:
    """The closed store's index, to damage it as a bug or a lost write would have."""
    db = sqlite3.connect(str(cfg.index_path))
    try:
        with db:
            yield db
            # (the byte count saved at close counted what it held: counted again at open)
            db.execute("DELETE FROM meta WHERE k='accounting'")
    finally:
        db.close()


def files_of(info: kvfs.PageInfo) -> list[str]:
    return sorted({e.path for e in info.extents})


def problems(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The findings that are not the report of a repair."""
    return {k: v for k, v in found.items() if v and k not in ("repaired", "unrecoverable")}


def accounted(s: kvfs.SyncStore) -> None:
    """The accounting adds up: the devices' sum, and the files' sizes on disk."""
    st = s.statistics()
    assert st.used_bytes == sum(d.used_bytes for d in st.devices)
    on_disk = sum(
        f.stat().st_size
        for r in s.engine.tier.roots
        for f in (r / "blobs").rglob("*")
        if f.is_file()
    )
    assert st.used_bytes == on_disk


@pytest.mark.parametrize(
    ("size", "ndev", "reopen_unit"),
    [
        (300 * KiB + 5, 3, 64 * KiB),  # striped over every device
        (100 * KiB, 2, 64 * KiB),  # two chunks, one each
        (5000, 2, 64 * KiB),  # one chunk on one device
        (0, 2, 64 * KiB),  # a header alone
        (300 * KiB + 5, 3, 256 * KiB),  # reopened with another stripe unit: the header's counts
    ],
)
def test_a_lost_blob_row_is_made_again_from_its_files(
    make_config: Callable[..., kvfs.StoreConfig], size: int, ndev: int, reopen_unit: int
) -> None:
    """The files of data that pages name and no blob row holds were orphans to fsck, and
    --repair removed them: the pages were listed (by the mount) and never readable again."""
    data = os.urandom(size)
    cfg = make_config(ndev=ndev, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/a", data)
        s.put("t/b", data)  # shares it
        other = s.put("s/c", os.urandom(70 * KiB))
    with index_of(cfg) as db:
        db.execute("DELETE FROM blobs WHERE hash=?", (bytes.fromhex(info.checksum),))
    cfg = make_config(ndev=ndev, stripe_unit=reopen_unit)
    with kvfs.open_store_sync(cfg) as s:
        with pytest.raises(kvfs.CorruptPage, match="no blob row"):
            s.get("s/a")
        found = s.fsck()
        assert found["missing_blob_rows"] == [info.checksum]
        assert found["damaged_pages"] == ["s/a", "t/b"]
        assert found["orphans"] == []  # a page names their data: no orphans
        assert all(os.path.exists(f) for f in files_of(info))
        found = s.fsck(repair=True)
        assert found["repaired"] == [
            f"made the blob row of {info.checksum[:16]} again from its files (s/a, t/b)"
        ]
        assert found["unrecoverable"] == []
        assert s.get("s/a") == data and s.get("t/b") == data and s.stat("t/b").size == size
        assert s.get("s/c") == s.get("s/c") and s.stat("s/c").checksum == other.checksum
        assert not problems(s.fsck())
        accounted(s)
        s.delete("s/a")  # one reference per page: the data stays for the other
        assert s.get("t/b") == data
        s.delete("t/b")
        assert not any(os.path.exists(f) for f in files_of(info))
        assert not problems(s.fsck())
        accounted(s)


def test_an_open_after_a_crash_keeps_the_files_of_a_lost_blob_row(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """The sweep at an unclean open removed every file no blob row names: the data of a
    lost row too, before fsck could find it. It keeps that data, verified, and removes the
    rest as ever (keeping every leftover, each crash added files the capacity never
    counted, for as long as a pinned page held nowhere else was kept)."""
    data = os.urandom(200 * KiB)
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/a", data)
        leftover = s.engine.tier.roots[1] / "blobs" / "cd" / "a-crashed-writers"
    with index_of(cfg) as db:
        db.execute("DELETE FROM blobs")
        db.execute("UPDATE meta SET v=? WHERE k='clean'", (_pack(False),))
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"\0" * 8192)
    with kvfs.open_store_sync(cfg) as s:
        assert s.engine.recovered_orphans == [str(leftover)]
        assert all(os.path.exists(f) for f in files_of(info))
        assert s.fsck(repair=True)["missing_blob_rows"] == [info.checksum]
        assert s.get("s/a") == data
        accounted(s)


def test_pages_whose_data_and_row_are_gone_are_deleted_unless_pinned(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Pages naming data that neither a blob row nor a file holds were listed and never
    readable, and no fsck said so or removed them."""
    data = os.urandom(90 * KiB)
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/a", data)
        s.put("t/b", data, pin=True)
        s.put("u/c", data)
        s.pin_session("u")  # a pinned session pins its pages
    with index_of(cfg) as db:
        db.execute("DELETE FROM blobs")
    for f in files_of(info):
        os.unlink(f)
    with kvfs.open_store_sync(cfg) as s:
        found = s.fsck()
        assert found["missing_blob_rows"] == [info.checksum]
        assert found["damaged_pages"] == ["s/a", "t/b", "u/c"]
        found = s.fsck(repair=True)
        assert (
            "deleted s/a: no blob row held its data, and no copy of it was found"
            in (found["repaired"])
        )
        assert found["unrecoverable"] == ["t/b", "u/c"]
        assert sum(r.startswith("kept t/b, pinned: ") for r in found["repaired"]) == 1
        assert not s.exists("s/a") and s.exists("t/b") and s.exists("u/c")
        assert s.fsck(repair=True)["unrecoverable"] == ["t/b", "u/c"]  # said every time
        s.unpin("t/b")
        s.unpin_session("u")
        found = s.fsck(repair=True)
        assert found["unrecoverable"] == [] and not s.exists("t/b") and not s.exists("u/c")
        assert not problems(s.fsck())


def test_a_damaged_pinned_page_held_nowhere_else_is_kept_and_said(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """fsck --repair deleted damaged pinned pages like any other: a pin vanished, and the
    repair was reported as complete."""
    data = os.urandom(150 * KiB)
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/pinned", data, pin=True)
        s.put("s/other", data)  # the same data, unpinned
        flip_stored_byte(info, 1000)
        found = s.fsck(repair=True)
        assert found["corrupt"] == [info.checksum]
        assert "deleted s/other: its data was damaged and held nowhere else" in found["repaired"]
        assert found["unrecoverable"] == ["s/pinned"]
        (kept,) = [r for r in found["repaired"] if r.startswith("kept")]
        assert kept.startswith("kept s/pinned, pinned: its data was damaged") and "put" in kept
        assert s.stat("s/pinned").pinned and not s.exists("s/other")
        with pytest.raises(kvfs.CorruptPage):
            s.get("s/pinned")
        s.put("s/again", data)  # the same bytes replace the damaged copy
        assert s.get("s/pinned") == data
        assert not problems(s.fsck())
        accounted(s)


def test_wrong_reference_counts_are_found_and_set(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """One reference too few: deleting one page deleted the data of the other; too many:
    the data of deleted pages was kept, and counted, for ever. fsck said neither."""
    shared, alone = os.urandom(80 * KiB), os.urandom(60 * KiB)
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        a = s.put("s/a", shared)
        s.put("s/b", shared)
        c = s.put("s/c", alone)
    with index_of(cfg) as db:
        db.execute("UPDATE blobs SET refs=1 WHERE hash=?", (bytes.fromhex(a.checksum),))
        db.execute("UPDATE blobs SET refs=3 WHERE hash=?", (bytes.fromhex(c.checksum),))
    with kvfs.open_store_sync(cfg) as s:
        s.delete("s/c")  # its data stays: two references left
        assert all(os.path.exists(f) for f in files_of(c))
        found = s.fsck()
        assert found["wrong_refs"] == sorted([a.checksum, c.checksum])
        assert found["damaged_pages"] == []
        repaired = s.fsck(repair=True)["repaired"]
        assert f"set the reference count of {a.checksum[:16]} to 2 (it counted 1)" in repaired
        assert (
            f"deleted the blob row of {c.checksum[:16]} and its files: no page names it" in repaired
        )
        assert not any(os.path.exists(f) for f in files_of(c))
        s.delete("s/a")
        assert s.get("s/b") == shared
        assert not problems(s.fsck())
        accounted(s)


@pytest.mark.parametrize("damage", ["size", "leaves"])
def test_a_blob_row_whose_size_or_digests_are_wrong_is_mended_from_its_data(
    make_config: Callable[..., kvfs.StoreConfig], damage: str
) -> None:
    """A blob row whose size is not what its extents hold (or whose digests are wrong)
    fails every read of its pages; fsck without verification said nothing, and with it
    called good data corrupt, and --repair deleted the pages."""
    data = os.urandom(300 * KiB + 7)
    cfg = make_config(ndev=3)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/a", data)
    h = bytes.fromhex(info.checksum)
    with index_of(cfg) as db:
        if damage == "size":
            db.execute("UPDATE blobs SET size=size+5000 WHERE hash=?", (h,))
        else:
            (leaves,) = db.execute("SELECT leaves FROM blobs WHERE hash=?", (h,)).fetchone()
            db.execute("UPDATE blobs SET leaves=? WHERE hash=?", (bytes(32) + leaves[32:], h))
    with kvfs.open_store_sync(cfg) as s:
        with pytest.raises(kvfs.CorruptPage):
            s.get("s/a")
        for found in (s.fsck(), s.engine.fsck(verify_data=False)):
            assert problems(found) == {"bad_blob_rows": [info.checksum], "damaged_pages": ["s/a"]}
        found = s.fsck(repair=True)
        assert (
            len(found["repaired"]) == 1 and "from its verified local copy" in found["repaired"][0]
        )
        assert s.get("s/a") == data and s.stat("s/a").size == len(data)
        assert not problems(s.fsck())


def test_a_page_whose_size_is_not_its_datas_is_set(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """stat said one size and a read returned another; fsck said nothing."""
    data = os.urandom(50 * KiB)
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        s.put("s/a", data)
    with index_of(cfg) as db:
        db.execute("UPDATE pages SET size=size+7")
    with kvfs.open_store_sync(cfg) as s:
        assert s.stat("s/a").size == len(data) + 7
        assert problems(s.fsck()) == {"wrong_page_size": ["s/a"]}
        repaired = s.fsck(repair=True)["repaired"]
        assert repaired == [
            f"set the size of s/a to {len(data)} bytes, its data's (it said {len(data) + 7})"
        ]
        assert s.stat("s/a").size == len(data) == len(s.get("s/a"))
        assert not problems(s.fsck())


def test_fsck_returns_only_the_kinds_docs_cli_md_lists(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    cfg = make_config(
        ndev=2, archive_url=f"file://{tmp_path / 'arch'}", extra={"archive": {"interval": 0}}
    )
    with kvfs.open_store_sync(cfg) as s:
        flip_stored_byte(s.put("s/a", os.urandom(9000), pin=True), 10)
        found = s.fsck(repair=True, archive=True)
    assert set(found) <= set(FSCK_FINDINGS), set(found) - set(FSCK_FINDINGS)
    assert found["unrecoverable"] == ["s/a"]


def archived(make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path) -> kvfs.StoreConfig:
    url = f"file://{tmp_path / 'arch'}"
    return make_config(ndev=2, archive_url=url, extra={"archive": {"interval": 0}})


def test_a_lost_blob_row_of_archived_data_comes_back_from_the_archive(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A page whose data only the archive holds, its blob row lost: fsck --repair makes the
    row again from the archive's copy (restored on access); data held nowhere at all loses
    its pages. Opened without the archive, nothing is deleted: the archive may hold it."""
    data, gone = os.urandom(70 * KiB), os.urandom(30 * KiB)
    cfg = archived(make_config, tmp_path)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("sessions/a/p/l0", data, pin=True)
        lost = s.put("sessions/b/p/l0", gone)
        s.spill("a")
        s.spill("b")
        assert s.stat("sessions/a/p/l0").tier == "archive"
    (tmp_path / "arch" / "blobs" / lost.checksum).unlink()  # held nowhere now
    with index_of(cfg) as db:
        db.execute("DELETE FROM blobs")
    offline = make_config(ndev=2)  # the same store, without its archive
    with kvfs.open_store_sync(offline) as s:
        found = s.fsck(repair=True)
        assert found["missing_blob_rows"] == sorted([info.checksum, lost.checksum])
        assert found["unrecoverable"] == ["sessions/a/p/l0", "sessions/b/p/l0"]
        assert all("opened without the archive" in r for r in found["repaired"])
        assert s.exists("sessions/a/p/l0") and s.exists("sessions/b/p/l0")
    with kvfs.open_store_sync(cfg) as s:
        found = s.fsck(repair=True)
        assert found["unrecoverable"] == []
        assert (
            f"made the blob row of {info.checksum[:16]} again from the archive's copy "
            "(restored on access): sessions/a/p/l0" in found["repaired"]
        )
        assert (
            "deleted sessions/b/p/l0: no blob row held its data, and no copy of it was found"
            in found["repaired"]
        )
        assert s.get("sessions/a/p/l0") == data and s.stat("sessions/a/p/l0").pinned
        assert not s.exists("sessions/b/p/l0")
        assert not problems(s.fsck(archive=True))


def test_a_damaged_pinned_page_comes_back_from_the_archive(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    data = os.urandom(70 * KiB)
    cfg = archived(make_config, tmp_path)
    with kvfs.open_store_sync(cfg) as s:
        s.put("sessions/a/p/l0", data, pin=True)
        s.spill("a")
        s.restore("a")
        info = s.stat("sessions/a/p/l0")
        assert info.tier == "local+archive"
        flip_stored_byte(info, 100)
        found = s.fsck(repair=True)
        assert found["corrupt"] == [info.checksum] and found["unrecoverable"] == []
        assert found["repaired"] == [
            f"restored {info.checksum[:16]} from the archive (sessions/a/p/l0)"
        ]
        assert s.get("sessions/a/p/l0") == data and s.stat("sessions/a/p/l0").pinned
        assert not problems(s.fsck())


def test_a_damaged_row_of_archive_only_data_is_set_from_the_archive(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    data = os.urandom(70 * KiB)
    cfg = archived(make_config, tmp_path)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("sessions/a/p/l0", data)
        s.spill("a")
    with index_of(cfg) as db:
        db.execute("UPDATE blobs SET size=size-1")
    with kvfs.open_store_sync(cfg) as s:
        assert problems(s.fsck()) == {
            "bad_blob_rows": [info.checksum],
            "damaged_pages": ["sessions/a/p/l0"],
        }
        found = s.fsck(repair=True)
        assert found["repaired"] == [
            f"set the size and leaf digests of {info.checksum[:16]} from the archive's copy"
        ]
        assert s.get("sessions/a/p/l0") == data
        assert not problems(s.fsck())


def test_a_file_its_writer_removed_during_the_check_is_no_orphan(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put that finds its data already stored removes the files it wrote. fsck on a live
    store listed them, then read which files are being written after the writer had gone:
    they were reported as orphans (exit 5 on a healthy store; a review's concurrency run,
    once in 190 passes). Here the writer's exit is made to fall in that window."""
    cfg = make_config(ndev=2)
    with kvfs.open_store_sync(cfg) as s:
        s.put("sessions/a/p/layer-000", b"x" * 10_000)
        tier = s.engine.tier
        # what a writer has made so far: a data file, listed by the check
        left = tier.roots[0] / "blobs" / "ab" / "writer-gone-meanwhile"
        left.parent.mkdir(exist_ok=True)
        left.write_bytes(b"\0" * 4096)
        writing = tier.writing_files

        def writer_done_meanwhile() -> set[tuple[int, str]]:
            left.unlink()  # the duplicate's files, removed by their writer, now gone
            return writing()

        monkeypatch.setattr(tier, "writing_files", writer_done_meanwhile)
        found = s.fsck()
        assert problems(found) == {}, found


def test_a_put_of_the_data_of_a_lost_blob_row_counts_the_pages_it_mends(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A put of bytes whose blob row was lost made a row counting only its own page: the
    pages already naming those bytes read again, and deleting the new page freed the data
    under them (they named a row that was gone once more)."""
    data = os.urandom(100 * KiB)
    cfg = make_config(ndev=2, stripe_unit=64 * KiB)
    with kvfs.open_store_sync(cfg) as s:
        info = s.put("s/a", data)
        s.put("t/b", data)
    with index_of(cfg) as db:
        db.execute("DELETE FROM blobs")
    with kvfs.open_store_sync(cfg) as s:
        fresh = s.put("u/c", data)  # the same bytes: a row again, new files
        assert fresh.checksum == info.checksum
        assert s.get("s/a") == data and s.get("t/b") == data
        found = s.fsck()
        assert found["wrong_refs"] == [] and found["missing_blob_rows"] == []
        assert sorted(found["orphans"]) == files_of(info)  # the old copy, no row names it
        s.delete("u/c")
        assert s.get("s/a") == data and s.get("t/b") == data
        s.delete("s/a")
        assert s.get("t/b") == data
        found = s.fsck(repair=True)
        assert set(problems(found)) == {"orphans"}
        assert not problems(s.fsck())
        accounted(s)
        s.delete("t/b")
        assert not any(os.path.exists(f) for f in files_of(fresh))
        accounted(s)
