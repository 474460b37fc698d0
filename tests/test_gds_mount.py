"""The by-path fast path on a real kvfs FUSE mount: extents from ``user.kvfs.extents``,
data straight from the backing files, the open mount file keeping them in place."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from _corrupt import flip_mounted_byte
from _gds import KiB, MiB, aligned, archive_only_with_no_room, key, rand
from _kvfs_mount import ServedMount

import gds
import kvfs
from gds._source import decode_extents


def write(path: Path, data: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.tobytes())


def test_read_by_path_on_a_mount(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=3, stripe_unit=64 * KiB), mp), gds.FastPath() as fp:
        pages = {
            mp / f"sessions/s/p/layer-{i:03d}": rand(MiB * i + 4096 * i + 3, seed=i)
            for i in range(1, 4)
        }
        for p, d in pages.items():
            write(p, d)
        dests = {p: aligned(d.nbytes) for p, d in pages.items()}
        futs = {p: fp.read_path(p, dests[p]) for p in pages}
        for p, d in pages.items():
            assert futs[p].result() == d.nbytes
            assert np.array_equal(dests[p], d)
        # A directory on the mount is no page.
        try:
            fp.read_path(mp / "sessions/s/p", aligned(4096))
        except (gds.NotAKvfsPage, IsADirectoryError):
            pass
        else:
            raise AssertionError("a directory was read as a page")


def test_many_chunk_page_by_path(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A page of thousands of stripe chunks (a 4 KiB unit): its extents attribute stays a
    few hundred bytes (the explicit list would be ~400 KiB, over Linux's 64 KiB limit), and
    the by-path fast path reads the page from it."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=3, stripe_unit=4 * KiB), mp), gds.FastPath() as fp:
        pages = {
            mp / "sessions/s/p/layer-000": rand(16 * MiB + 5, seed=1),  # 4,097 chunks
            mp / "sessions/s/p/layer-001": rand(2 * 4096 + 1, seed=2),  # 3 chunks, 3 devices
            mp / "sessions/s/p/layer-002": rand(100, seed=3),  # 1 chunk
        }
        for p, d in pages.items():
            write(p, d)
        raw = os.getxattr(mp / "sessions/s/p/layer-000", "user.kvfs.extents")
        assert len(raw) < 1024
        v = json.loads(raw)
        assert (v["v"], v["unit"], v["size"], len(v["files"])) == (2, 4096, 16 * MiB + 5, 3)
        files, runs = decode_extents(raw)
        assert len(runs) == 4097 and sum(n for _f, _o, n in runs) == 16 * MiB + 5
        for p, d in pages.items():
            dest = aligned(d.nbytes)
            assert fp.read_path(p, dest, backend="host").result() == d.nbytes
            assert np.array_equal(dest, d)


def test_decode_extents_rule() -> None:
    """The striping rule: chunk c is min(U, S - c*U) bytes at H + (c // n) * U of
    files[c % n]; runs of one file that touch merge; the explicit list is taken as it is."""
    v = {"v": 2, "files": ["/a", "/b", "/c"], "unit": 4096, "header": 4096, "size": 4 * 4096 + 10}
    assert decode_extents(json.dumps(v)) == (
        ("/a", "/b", "/c"),
        ((0, 4096, 4096), (1, 4096, 4096), (2, 4096, 4096), (0, 8192, 4096), (1, 8192, 10)),
    )
    one = {"v": 2, "files": ["/a"], "unit": 4096, "header": 4096, "size": 3 * 4096 + 1}
    assert decode_extents(json.dumps(one)) == (("/a",), ((0, 4096, 3 * 4096 + 1),))
    empty = {"v": 2, "files": ["/a"], "unit": 4096, "header": 4096, "size": 0}
    assert decode_extents(json.dumps(empty)) == (("/a",), ((0, 4096, 0),))
    explicit = [["/a", 4096, 10], ["/b", 8192, 5], ["/a", 12288, 1]]
    assert decode_extents(json.dumps(explicit)) == (
        ("/a", "/b"),
        ((0, 4096, 10), (1, 8192, 5), (0, 12288, 1)),
    )
    for bad in (
        b"not json",
        b"{}",
        json.dumps({**v, "v": 3}),
        json.dumps({**v, "unit": 0}),
        json.dumps({**v, "files": []}),
        json.dumps({**v, "size": "10"}),
        json.dumps([["/a", 4096]]),
        json.dumps([["a", 0, 4096]]),  # relative: opened from the reader's cwd
        json.dumps([[7, 0, 4096]]),
        json.dumps({**v, "files": ["data/f"]}),
        json.dumps({**v, "unit": 4097}),  # no stripe unit the daemon writes
    ):
        with pytest.raises(kvfs.CorruptPage):
            decode_extents(bad)


def test_a_size_attribute_that_is_not_the_files_size_is_refused(tmp_path: Path) -> None:
    """Attributes set by hand on a file on no mount, claiming a page longer than the file:
    refused before the extents are built (one per stripe unit of the size claimed, so a
    claim of 10**12 bytes exhausted memory), not taken as a page to read."""
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(8 * KiB))
    claimed = 64 * KiB
    rule = {"v": 2, "files": [str(plain)] * 2, "unit": 4096, "header": 0, "size": claimed}
    os.setxattr(plain, "user.kvfs.extents", json.dumps(rule).encode())
    os.setxattr(plain, "user.kvfs.size", str(claimed).encode())
    os.setxattr(plain, "user.kvfs.checksum", b"00" * 32)
    with pytest.raises(kvfs.CorruptPage, match="on no kvfs mount"):
        gds.source_from_mount(plain)


def test_unlink_on_the_mount_during_a_read(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    pool.submit(gate.wait)  # the read is queued with the mount file open
    with (
        ServedMount(make_config(ndev=2, stripe_unit=64 * KiB), mp),
        gds.FastPath(io_pool=pool) as fp,
    ):
        p = mp / "sessions/s/p/layer-000"
        data = rand(2 * MiB + 100)
        write(p, data)
        files = set(decode_extents(os.getxattr(p, "user.kvfs.extents"))[0])
        dest = aligned(data.nbytes)
        fut = fp.read_path(p, dest)
        os.unlink(p)
        assert not p.exists()
        assert all(os.path.exists(f) for f in files)  # the open handle holds the lease
        gate.set()
        assert fut.result() == data.nbytes
        assert np.array_equal(dest, data)
    pool.shutdown()


def test_archive_only_pages_by_path(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A page the mount holds only in the archive had extents covering 0 bytes, and the
    by-path read failed as corrupt. It is restored by a read through the mount first; where
    there is no room for that, read through the mount (the daemon's memory copy). An
    unaligned destination was refused only after that restore."""
    url = f"file://{tmp_path / 'archive'}"
    arch = {"archive": {"interval": 0}}
    roomy = make_config(ndev=2, name="roomy", archive_url=url, extra=arch)
    data = rand(2 * MiB + 9)
    with kvfs.open_store_sync(roomy) as s:
        s.put(key(0), data)
        s.spill("sess")
    tight = archive_only_with_no_room(make_config, f"{url}-tight", data, name="tight")
    for cfg, tier in ((roomy, "local+archive"), (tight, "archive")):
        mp = tmp_path / f"mnt-{cfg.data_dirs[0].parent.name}"
        mp.mkdir()
        with ServedMount(cfg, mp), gds.FastPath() as fp:
            page = mp / key(0).path
            assert os.getxattr(page, "user.kvfs.tier") == b"archive"
            with pytest.raises(gds.UnalignedDestination):
                fp.read_path(page, aligned(data.nbytes + 1)[1:])
            assert os.getxattr(page, "user.kvfs.tier") == b"archive"  # nothing restored
            dest = aligned(data.nbytes)
            assert fp.read_path(page, dest).result(timeout=60) == data.nbytes
            assert np.array_equal(dest, data)
            assert os.getxattr(page, "user.kvfs.tier").decode() == tier


def test_a_page_replaced_between_open_and_attributes_is_read_through_the_handle(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename onto the name after the fast path opened it made the attribute reads fail
    with ESTALE; the open handle still reads the page it opened."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=2, stripe_unit=64 * KiB), mp), gds.FastPath() as fp:
        p, tmp = mp / "sessions/s/p/layer-000", mp / "sessions/s/p/.tmp"
        old, new = rand(MiB + 3, seed=1), rand(MiB + 3, seed=2)
        write(p, old)
        write(tmp, new)
        real = os.getxattr

        def replaced_first(fd: int, name: str) -> bytes:
            if tmp.exists():
                os.rename(tmp, p)  # a publisher's rename lands right after our open
            return real(fd, name)

        monkeypatch.setattr(os, "getxattr", replaced_first)
        dest = aligned(old.nbytes)
        assert fp.read_path(p, dest).result(timeout=60) == old.nbytes
        assert np.array_equal(dest, old)
        monkeypatch.undo()
        assert fp.read_path(p, dest).result(timeout=60) == new.nbytes
        assert np.array_equal(dest, new)


def test_a_read_by_path_given_another_pages_attributes_reads_its_own_page(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attributes are the inode's, not the open file's: another process's open of a
    name replaced behind the kernel's back moves them to the new page, which nothing
    leases. A read that then found that page's files gone failed with CorruptPage though
    the page it opened was whole; three attributes read one by one could also be of two
    pages. Such a read is done through the mount instead; malformed attributes are
    CorruptPage (a ValueError escaped)."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=2, stripe_unit=64 * KiB), mp), gds.FastPath() as fp:
        p, q = mp / "sessions/s/p/layer-000", mp / "sessions/s/p/layer-001"
        mine, other = rand(MiB + 3, seed=1), rand(MiB + 3, seed=2)
        write(p, mine)
        write(q, other)
        names = ("user.kvfs.extents", "user.kvfs.size", "user.kvfs.checksum")
        theirs = {n: os.getxattr(q, n) for n in names}
        files = decode_extents(theirs["user.kvfs.extents"])[0]
        os.unlink(q)
        assert not any(os.path.exists(f) for f in files)
        real = os.getxattr

        def swapped(fd: int, name: str) -> bytes:
            return theirs.get(name) or real(fd, name)

        monkeypatch.setattr(os, "getxattr", swapped)
        dest = aligned(mine.nbytes)
        assert fp.read_path(p, dest).result(timeout=60) == mine.nbytes
        assert np.array_equal(dest, mine)
        # the checksum of the other page only: the read fails its checksum, then goes through
        theirs = {"user.kvfs.checksum": theirs["user.kvfs.checksum"]}
        dest = aligned(mine.nbytes)
        assert fp.read_path(p, dest).result(timeout=60) == mine.nbytes
        assert np.array_equal(dest, mine)
        for bad in ({"user.kvfs.size": b"ten"}, {"user.kvfs.checksum": b"zz"}):
            theirs = bad
            with pytest.raises(kvfs.CorruptPage, match="malformed kvfs attributes"):
                fp.read_path(p, aligned(mine.nbytes))


def test_a_damaged_local_copy_read_by_path_is_healed_through_the_mount(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A by-path read that fails its checksum was an error even where the archive holds
    the page; read again through the mount, the daemon replaces the copy from the archive
    (as a read by key does)."""
    url = f"file://{tmp_path / 'archive'}"
    cfg = make_config(ndev=1, archive_url=url, extra={"archive": {"interval": 0}})
    data = rand(2 * MiB + 9)
    with kvfs.open_store_sync(cfg) as s:
        s.put("sessions/s/p/layer-000", data)
        s.spill("s")
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(cfg, mp), gds.FastPath() as fp:
        p = mp / "sessions/s/p/layer-000"
        assert fp.read_path(p, aligned(data.nbytes)).result(timeout=60) == data.nbytes
        flip_mounted_byte(os.getxattr(p, "user.kvfs.extents"), 5, 1)
        dest = aligned(data.nbytes)
        assert fp.read_path(p, dest).result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)
        dest = aligned(data.nbytes)  # and the copy on disk is whole again
        assert fp.read_path(p, dest, backend="host").result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)


@pytest.mark.parametrize("then", ["unlinked", "replaced"])
def test_a_read_by_path_done_again_reads_the_page_it_opened(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, then: str
) -> None:
    """A by-path read that failed its checksum was done again by opening the name anew,
    not through the handle that holds the page: the name unlinked meanwhile, the read of a
    page the archive could heal failed as corrupt; replaced, it gave the new page."""
    from test_gds import HoldAfter

    url = f"file://{tmp_path / 'archive'}"
    cfg = make_config(ndev=1, archive_url=url, extra={"archive": {"interval": 0}})
    data, other = rand(2 * MiB + 9, seed=1), rand(2 * MiB + 9, seed=2)
    with kvfs.open_store_sync(cfg) as s:
        s.put("sessions/s/p/layer-000", data)
        s.spill("s")
    mp = tmp_path / "mnt"
    mp.mkdir()
    held = HoldAfter(0)  # the read's pieces wait, its handle open, until released
    with ServedMount(cfg, mp), gds.FastPath(io_pool=held) as fp:
        p, tmp = mp / "sessions/s/p/layer-000", mp / "sessions/s/p/.tmp"
        with open(p, "rb") as f:
            f.read(1)  # restored from the archive: a local copy to damage
        flip_mounted_byte(os.getxattr(p, "user.kvfs.extents"), 5, 1)
        write(tmp, other)
        dest = aligned(data.nbytes)
        try:
            fut = fp.read_path(p, dest)
            if then == "unlinked":
                os.unlink(p)
            else:
                os.rename(tmp, p)
        finally:
            held.release()
        assert fut.result(timeout=60) == data.nbytes
        assert np.array_equal(dest, data)
    held.shutdown()


def test_a_plain_file_opened_by_a_name_now_on_a_mount_is_never_read_through(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """Whether a failed read could be done again through its open file was decided by the
    name, looked up again after the read: a symlink that named a plain file (its attributes
    made up) when opened, and a page on a kvfs mount by the time the read failed its
    checksum, had the plain file's bytes read through, checked against nothing, and
    returned as the page. It is the open file's mount that counts."""
    from test_gds import HoldAfter

    mp = tmp_path / "mnt"
    mp.mkdir()
    held = HoldAfter(0)  # the read's pieces wait until the link is moved
    with ServedMount(make_config(ndev=1), mp), gds.FastPath(io_pool=held) as fp:
        page = mp / "sessions/s/p/layer-000"
        write(page, rand(8 * KiB))
        plain = tmp_path / "plain"
        plain.write_bytes(b"not the page: nothing checks these bytes".ljust(8 * KiB, b"."))
        os.setxattr(plain, "user.kvfs.extents", json.dumps([[str(plain), 0, 8 * KiB]]).encode())
        os.setxattr(plain, "user.kvfs.size", b"8192")
        os.setxattr(plain, "user.kvfs.checksum", os.getxattr(page, "user.kvfs.checksum"))
        link = tmp_path / "link"
        link.symlink_to(plain)
        dest = aligned(8 * KiB)
        try:
            fut = fp.read_path(link, dest)
            link.unlink()
            link.symlink_to(page)
        finally:
            held.release()
        with pytest.raises(kvfs.CorruptPage, match="do not match its checksum"):
            fut.result(timeout=60)
    held.shutdown()
