"""Unit tests of the FUSE operations object, driven directly (no kernel): the error paths.

Each call is what the kernel would send; each answer must be an errno, never an exception
that would end the mount.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import pytest

import kvfs
from gds._source import decode_extents
from kvfs._fuse import XATTRS, KvfsOperations
from kvfs._fuse_ahead import AheadBudget
from kvfs._fuse_xattr import extents_xattr

KiB = 1024
MiB = 1024 * KiB
ROOT = pyfuse3.ROOT_INODE


@dataclass
class Ctx:
    uid: int = os.getuid()
    gid: int = os.getgid()
    pid: int = os.getpid()
    umask: int = 0o022


CTX = Ctx()


class Fields:
    def __init__(self, **on: bool) -> None:
        for f in (
            "update_atime",
            "update_mtime",
            "update_ctime",
            "update_mode",
            "update_uid",
            "update_gid",
            "update_size",
        ):
            setattr(self, f, on.get(f, False))


@pytest.fixture
async def ops(make_config: Callable[..., kvfs.StoreConfig]) -> AsyncIterator[KvfsOperations]:
    async with kvfs.open_store(make_config(capacity=64 * MiB)) as store:
        o = KvfsOperations(store)
        try:
            yield o
        finally:
            await o.aclose()


async def fuse_errno(call: object) -> int:
    with pytest.raises(pyfuse3.FUSEError) as ei:
        await call  # type: ignore[misc]
    return ei.value.errno


async def mkdirs(ops: KvfsOperations, path: str) -> int:
    ino = ROOT
    for part in path.split("/"):
        try:
            ino = (await ops.lookup(ino, part.encode(), CTX)).st_ino
        except pyfuse3.FUSEError:
            ino = (await ops.mkdir(ino, part.encode(), 0o755, CTX)).st_ino
    return ino


async def write_file(ops: KvfsOperations, parent: int, name: str, data: bytes) -> int:
    fi, attr = await ops.create(parent, name.encode(), 0o644, os.O_WRONLY, CTX)
    assert await ops.write(fi.fh, 0, data) == len(data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def test_lookup_missing_and_bad_names(ops: KvfsOperations) -> None:
    assert await fuse_errno(ops.lookup(ROOT, b"nope", CTX)) == errno.ENOENT
    assert await fuse_errno(ops.lookup(ROOT, b"\xff\xfe", CTX)) == errno.ENOENT
    sess = await mkdirs(ops, "sessions/s1")
    # A file directly in a session directory is not a sessions/<s>/<prefix>/<layer> key.
    assert await fuse_errno(ops.create(sess, b"layer-000", 0o644, os.O_WRONLY, CTX)) == errno.EINVAL
    assert (
        await fuse_errno(ops.create(ROOT, b".kvfs-mine", 0o644, os.O_WRONLY, CTX)) == errno.EINVAL
    )
    assert await fuse_errno(ops.create(ROOT, b"\xff", 0o644, os.O_WRONLY, CTX)) == errno.EINVAL
    prefix = await mkdirs(ops, "sessions/s1/p1")
    assert await fuse_errno(ops.mkdir(prefix, b"deeper", 0o755, CTX)) == errno.EINVAL
    assert await fuse_errno(ops.mkdir(ROOT, b"sessions", 0o755, CTX)) == errno.EEXIST


async def test_write_commit_and_immutability(ops: KvfsOperations) -> None:
    d = await mkdirs(ops, "lmcache")
    ino = await write_file(ops, d, "model@1@0@abc@bf16.data", b"x" * 5000)
    assert (await ops.getattr(ino, CTX)).st_size == 5000
    assert await fuse_errno(ops.open(ino, os.O_WRONLY, CTX)) == errno.EPERM
    assert await fuse_errno(ops.open(ino, os.O_RDWR, CTX)) == errno.EPERM
    assert await fuse_errno(ops.open(ino, os.O_RDONLY | os.O_TRUNC, CTX)) == errno.EPERM
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    assert (
        await fuse_errno(ops.setattr(ino, attr, Fields(update_size=True), None, CTX)) == errno.EPERM
    )
    # chmod is kept (rsync -a sets modes after close) but the page stays immutable.
    attr.st_mode = 0o640
    assert (
        await ops.setattr(ino, attr, Fields(update_mode=True), None, CTX)
    ).st_mode & 0o777 == 0o640
    assert await fuse_errno(ops.open(ino, os.O_WRONLY, CTX)) == errno.EPERM
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert fi.keep_cache and not fi.direct_io
    assert bytes(await ops.read(fi.fh, 4000, 4096)) == b"x" * 1000
    assert await fuse_errno(ops.write(fi.fh, 0, b"y")) == errno.EPERM
    await ops.release(fi.fh)


async def test_flush_before_write_does_not_commit(ops: KvfsOperations) -> None:
    # `echo x > f`: the shell dup2s the new fd and closes the original (a flush) first.
    fi, attr = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
    await ops.flush(fi.fh)
    assert await ops.write(fi.fh, 0, b"hello") == 5
    assert not ops.engine.exists("f")
    # The file in the making cannot be opened by anyone else.
    assert await fuse_errno(ops.open(attr.st_ino, os.O_RDONLY, CTX)) == errno.ENOENT
    assert await fuse_errno(ops.open(attr.st_ino, os.O_WRONLY, CTX)) == errno.EBUSY
    await ops.flush(fi.fh)
    assert ops.engine.get("f") == b"hello"
    await ops.release(fi.fh)


async def test_a_sparse_file_whose_writes_skip_a_device_is_published(
    ops: KvfsOperations,
) -> None:
    """A file written only past its first stripe units (a pwrite past the end, a hole
    before it) had no data file on the devices of the chunks it skipped: its writer read
    the hole back as ENOENT, and its close failed with ENOENT (the commit hashed a file
    that did not exist), so the page was never published."""
    unit = ops.engine.tier.unit  # three devices: chunk 2 alone skips two of them
    fi, attr = await ops.create(ROOT, b"sparse", 0o644, os.O_RDWR, CTX)
    assert await ops.write(fi.fh, 2 * unit + 5, b"x") == 1
    want = bytes(2 * unit + 5) + b"x"
    assert bytes(await ops.read(fi.fh, 0, len(want))) == want  # the writer reads the hole
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    assert ops.engine.get("sparse") == want


async def test_rename_of_open_file_commits_under_new_name(ops: KvfsOperations) -> None:
    await write_file(ops, ROOT, "final", b"old")
    fi, _ = await ops.create(ROOT, b"final.tmp", 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, b"new contents")
    await ops.rename(ROOT, b"final.tmp", ROOT, b"final", 0, CTX)
    assert ops.engine.get("final") == b"new contents"
    assert not ops.engine.exists("final.tmp")
    # Committed now; the open handle may still write (POSIX: the fd follows the file): its
    # writes make the next version, published whole at its release.
    assert await ops.write(fi.fh, 12, b"more") == 4
    assert ops.engine.get("final") == b"new contents"
    await ops.release(fi.fh)
    assert ops.engine.get("final") == b"new contentsmore"
    assert (
        await fuse_errno(ops.rename(ROOT, b"final", ROOT, b"x", pyfuse3.RENAME_EXCHANGE, CTX))
        == errno.EINVAL
    )
    await write_file(ops, ROOT, "other", b"o")
    assert (
        await fuse_errno(ops.rename(ROOT, b"final", ROOT, b"other", pyfuse3.RENAME_NOREPLACE, CTX))
        == errno.EEXIST
    )


async def test_unlinked_while_writing_is_discarded(ops: KvfsOperations) -> None:
    fi, _ = await ops.create(ROOT, b"gone", 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, b"abc")
    await ops.unlink(ROOT, b"gone", CTX)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    assert not ops.engine.exists("gone")
    assert (await ops.statfs(CTX)).f_bfree * 4096 == ops.engine.capacity - ops.engine.used


async def test_open_page_survives_unlink(ops: KvfsOperations) -> None:
    data = os.urandom(3 * MiB)
    ino = await write_file(ops, ROOT, "p", data)
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    await ops.unlink(ROOT, b"p", CTX)
    assert not ops.engine.exists("p")
    assert bytes(await ops.read(fi.fh, 0, len(data))) == data  # the lease kept the data
    await ops.release(fi.fh)
    assert await fuse_errno(ops.lookup(ROOT, b"p", CTX)) == errno.ENOENT


async def test_an_open_is_an_access(ops: KvfsOperations) -> None:
    """Reads the kernel's page cache answers never reach the daemon; opens do, and count as
    the page's and its session's access (eviction order and retention go by it)."""
    import time

    ino = await write_file(ops, ROOT, "p", b"x" * 100)
    eng = ops.engine
    eng.flush_atimes()
    before = eng.index.page("p").atime  # type: ignore[union-attr]
    session = eng.index.page("p").session  # type: ignore[union-attr]
    time.sleep(0.01)
    fi = await ops.open(ino, os.O_RDONLY, CTX)  # no read
    await ops.release(fi.fh)
    eng.flush_atimes()
    assert eng.index.page("p").atime > before  # type: ignore[union-attr]
    assert eng.index.session(session).atime > before  # type: ignore[union-attr]


async def test_replaced_behind_the_mount(ops: KvfsOperations) -> None:
    ino = await write_file(ops, ROOT, "q", b"one")
    await ops.store.put("q", b"two!", replace=True)
    # An open through the old inode, which may have the old bytes cached, is ESTALE: the
    # kernel then looks the name up again (a fresh inode) and retries the open once.
    assert await fuse_errno(ops.open(ino, os.O_RDONLY, CTX)) == errno.ESTALE
    # Should that retry race again (the same name within a second), it gets the new bytes
    # past the page cache rather than a second ESTALE, which would reach the caller.
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert fi.direct_io and not fi.keep_cache
    assert bytes(await ops.read(fi.fh, 0, 10)) == b"two!"
    assert (await ops.getattr(ino, CTX)).st_size == 4
    await ops.release(fi.fh)
    new = await ops.lookup(ROOT, b"q", CTX)
    assert new.st_ino != ino
    fi = await ops.open(new.st_ino, os.O_RDONLY, CTX)
    assert fi.keep_cache and bytes(await ops.read(fi.fh, 0, 10)) == b"two!"
    await ops.release(fi.fh)
    await ops.store.delete("q")
    assert await fuse_errno(ops.open(new.st_ino, os.O_RDONLY, CTX)) == errno.ENOENT


async def test_enospc_when_nothing_can_be_evicted(ops: KvfsOperations) -> None:
    fi, _ = await ops.create(ROOT, b"huge", 0o644, os.O_WRONLY, CTX)
    chunk = b"\0" * MiB
    with pytest.raises(pyfuse3.FUSEError) as ei:
        for i in range(80):
            await ops.write(fi.fh, i * MiB, chunk)
    assert ei.value.errno == errno.ENOSPC
    assert await fuse_errno(ops.flush(fi.fh)) == errno.ENOSPC  # close() fails too
    await ops.release(fi.fh)
    assert not ops.engine.exists("huge")
    assert ops.engine.reserved == 0


async def test_xattrs(ops: KvfsOperations) -> None:
    d = await mkdirs(ops, "sessions/s/p")
    data = os.urandom(200 * KiB)
    ino = await write_file(ops, d, "layer-003", data)
    assert [x.decode() for x in await ops.listxattr(ino, CTX)] == list(XATTRS)
    got = {x: (await ops.getxattr(ino, x.encode(), CTX)).decode() for x in XATTRS}
    assert got["user.kvfs.checksum"] == kvfs.checksum(data).hex()
    assert got["user.kvfs.size"] == str(len(data))
    assert got["user.kvfs.tier"] == "local"
    assert got["user.kvfs.pinned"] == "0"
    assert got["user.kvfs.session"] == "s"
    assert json.loads(got["user.kvfs.extents"])["v"] == 2  # the striping rule, not a list
    files, runs = decode_extents(got["user.kvfs.extents"])
    back = b""
    for fi, off, length in runs:
        with open(files[fi], "rb") as f:
            f.seek(off)
            back += f.read(length)
    assert back == data
    ops.engine.pin_session("s")  # its session pinned keeps it too (it said 0)
    assert await ops.getxattr(ino, b"user.kvfs.pinned", CTX) == b"1"
    ops.engine.pin_session("s", False)
    assert await ops.getxattr(ino, b"user.kvfs.pinned", CTX) == b"0"
    ops.engine.pin("sessions/s/p/layer-003")
    assert await ops.getxattr(ino, b"user.kvfs.pinned", CTX) == b"1"
    assert await fuse_errno(ops.getxattr(ino, b"user.other", CTX)) == pyfuse3.ENOATTR
    assert await fuse_errno(ops.getxattr(d, b"user.kvfs.size", CTX)) == pyfuse3.ENOATTR
    assert await fuse_errno(ops.setxattr(ino, b"user.kvfs.pinned", b"0", CTX)) == errno.ENOTSUP
    assert await fuse_errno(ops.setxattr(ino, b"user.x", b"0", CTX)) == errno.ENOTSUP


def _runs(info: kvfs.PageInfo) -> list[tuple[str, int, int]]:
    return [(e.path, e.offset, e.length) for e in info.extents]


def _decoded(raw: bytes) -> list[tuple[str, int, int]]:
    files, runs = decode_extents(raw)
    return [(files[f], off, n) for f, off, n in runs]


@pytest.mark.parametrize(("ndev", "unit"), [(1, 4 * KiB), (2, 4 * KiB), (3, 64 * KiB)])
def test_extents_xattr_round_trip(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, ndev: int, unit: int
) -> None:
    """Every way a blob comes to be (put, the mount's streaming writer, a restore from the
    archive) is laid out by the striping rule: its xattr is the rule's few parameters, and
    decoding it gives back exactly the extents the index holds."""
    cfg = make_config(ndev=ndev, stripe_unit=unit, archive_url=f"file://{tmp_path / 'arch'}")
    sizes = [0, 3, unit - 1, unit, unit + 1, ndev * unit, ndev * unit + 5, 1000 * unit + 7]
    with kvfs.open_store_sync(cfg) as store:
        for i, n in enumerate(sizes):
            store.put(f"sessions/put/p/layer-{i:03d}", os.urandom(n))
            w = store.begin_write(f"stream/p{i}")
            data = os.urandom(n)
            for off in range(0, n, 3 * unit + 1000):  # writes across stripe boundaries
                w.write(off, data[off : off + 3 * unit + 1000])
            w.commit()
        store.spill("put")
        store.evict(session="put")
        for i in range(len(sizes)):
            store.get(
                f"sessions/put/p/layer-{i:03d}"
            )  # restored from the archive into new local files
        keys = [f"sessions/put/p/layer-{i:03d}" for i in range(len(sizes))]
        for key in keys + [f"stream/p{i}" for i in range(len(sizes))]:
            info = store.stat(key)
            assert info.tier.startswith("local")
            raw = extents_xattr(info.extents, info.size, unit)
            assert json.loads(raw)["v"] == 2, key
            assert len(raw) < 200 + ndev * len(info.extents[0].path), key  # not per chunk
            assert _decoded(raw) == _runs(info), key


def test_extents_xattr_outside_the_rule() -> None:
    """Extents laid out some other way are given as the explicit list while it fits; past
    64 KiB the attribute is E2BIG (what Linux says for a value too large to return)."""
    odd = [kvfs.Extent(0, "/d0/a", 4096, 8192), kvfs.Extent(1, "/d1/a", 12288, 100)]
    raw = extents_xattr(odd, 8292, 4096)  # the second file's chunk is not after its header
    assert json.loads(raw) == [["/d0/a", 4096, 8192], ["/d1/a", 12288, 100]]
    assert _decoded(raw) == [(e.path, e.offset, e.length) for e in odd]
    many = [kvfs.Extent(0, f"/d0/{'x' * 100}{i}", 4096, 4096) for i in range(1000)]
    many[-1] = kvfs.Extent(0, many[-1].path, 8192, 4096)  # one chunk out of place
    with pytest.raises(pyfuse3.FUSEError) as ei:
        extents_xattr(many, 4096 * 1000, 4096)
    assert ei.value.errno == errno.E2BIG
    assert extents_xattr([], 10, 4096) == b"[]"  # not held locally


async def test_session_metadata_file(ops: KvfsOperations) -> None:
    d = await mkdirs(ops, "sessions/agent-1/p")
    await write_file(ops, d, "layer-000", b"k" * 100)
    sess = (await ops.lookup(ROOT, b"sessions", CTX)).st_ino
    s = (await ops.lookup(sess, b"agent-1", CTX)).st_ino
    meta = await ops.lookup(s, b".kvfs.json", CTX)
    assert meta.st_mode & 0o777 == 0o444
    assert await fuse_errno(ops.open(meta.st_ino, os.O_WRONLY, CTX)) == errno.EACCES
    fi = await ops.open(meta.st_ino, os.O_RDONLY, CTX)
    doc = json.loads(bytes(await ops.read(fi.fh, 0, 1 << 20)))
    await ops.release(fi.fh)
    assert doc["session"] == "agent-1" and doc["pages"] == 1 and doc["bytes"] == 100
    # stat and read agree, and mtime moves only when the content does (tar, rsync)
    a1, a2 = await ops.getattr(meta.st_ino, CTX), await ops.getattr(meta.st_ino, CTX)
    assert a1.st_size == a2.st_size and a1.st_mtime_ns == a2.st_mtime_ns
    fi = await ops.open(meta.st_ino, os.O_RDONLY, CTX)
    assert len(await ops.read(fi.fh, 0, 1 << 20)) == a1.st_size
    await ops.release(fi.fh)
    await write_file(ops, d, "layer-001", b"k" * 200)
    a3 = await ops.getattr(meta.st_ino, CTX)
    assert a3.st_mtime_ns > a1.st_mtime_ns
    fi = await ops.open(meta.st_ino, os.O_RDONLY, CTX)
    doc = json.loads(bytes(got := await ops.read(fi.fh, 0, 1 << 20)))
    await ops.release(fi.fh)
    assert doc["pages"] == 2 and len(got) == a3.st_size
    assert await fuse_errno(ops.unlink(s, b".kvfs.json", CTX)) == errno.EPERM
    assert await fuse_errno(ops.rmdir(s, b"p", CTX)) == errno.ENOTEMPTY


async def test_unexpected_error_is_eio_and_logged(
    ops: KvfsOperations, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(path: str) -> None:
        raise RuntimeError("index on fire")

    monkeypatch.setattr(ops.engine.index, "page", boom)
    with caplog.at_level(logging.ERROR, logger="kvfs.fuse"):
        assert await fuse_errno(ops.lookup(ROOT, b"x", CTX)) == errno.EIO
    assert any("index on fire" in (r.exc_text or "") for r in caplog.records)
    monkeypatch.undo()
    assert await fuse_errno(ops.lookup(ROOT, b"x", CTX)) == errno.ENOENT  # still serving


async def test_oserror_keeps_its_errno(
    ops: KvfsOperations, monkeypatch: pytest.MonkeyPatch
) -> None:
    fi, _ = await ops.create(ROOT, b"w", 0o644, os.O_WRONLY, CTX)
    writer = ops.handles[fi.fh].node.pending.writer  # type: ignore[union-attr]

    def full(off: int, data: bytes) -> int:
        raise OSError(errno.EDQUOT, "quota")

    monkeypatch.setattr(writer, "write", full)
    assert await fuse_errno(ops.write(fi.fh, 0, b"a")) == errno.EDQUOT
    assert await fuse_errno(ops.read(12345, 0, 1)) == errno.EBADF
    await ops.release(fi.fh)


async def test_statfs_reports_capacity(ops: KvfsOperations) -> None:
    await write_file(ops, ROOT, "a", b"a" * MiB)
    st = await ops.statfs(CTX)
    assert st.f_bsize == 4096 and st.f_frsize == 4096
    assert st.f_blocks * 4096 == 64 * MiB
    assert st.f_bavail == st.f_bfree < st.f_blocks


async def test_directories(ops: KvfsOperations) -> None:
    d = await mkdirs(ops, "vllm/ab")
    await write_file(ops, d, "cd", b"1")
    top = (await ops.lookup(ROOT, b"vllm", CTX)).st_ino
    assert await fuse_errno(ops.rmdir(top, b"ab", CTX)) == errno.ENOTEMPTY
    assert await fuse_errno(ops.rename(ROOT, b"vllm", ROOT, b"v2", 0, CTX)) == errno.EXDEV
    assert await fuse_errno(ops.unlink(top, b"ab", CTX)) == errno.EISDIR
    assert await fuse_errno(ops.open(top, os.O_RDONLY, CTX)) == errno.EISDIR
    await ops.unlink(d, b"cd", CTX)
    await ops.rmdir(top, b"ab", CTX)
    await ops.rmdir(ROOT, b"vllm", CTX)
    assert await fuse_errno(ops.lookup(ROOT, b"vllm", CTX)) == errno.ENOENT
    assert await fuse_errno(ops.rmdir(ROOT, b"sessions", CTX)) == errno.EBUSY
    e = await ops.mkdir(ROOT, b"empty", 0o777, CTX)
    assert e.st_mode & 0o777 == 0o755  # umask applied
    await ops.rename(ROOT, b"empty", ROOT, b"moved", 0, CTX)
    assert (await ops.lookup(ROOT, b"moved", CTX)).st_ino == e.st_ino


async def test_read_ahead_serves_sequential_and_random_reads(ops: KvfsOperations) -> None:
    import trio

    data = os.urandom(10 * MiB + 17)
    ino = await write_file(ops, ROOT, "ra", data)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        h = ops.handles[fi.fh]
        assert h.ahead is not None
        got = b"".join([bytes(await ops.read(fi.fh, off, MiB)) for off in range(0, len(data), MiB)])
        assert got == data
        assert bytes(await ops.read(fi.fh, 3 * MiB + 5, 100)) == data[3 * MiB + 5 : 3 * MiB + 105]
        assert bytes(await ops.read(fi.fh, 0, MiB)) == data[:MiB]  # a new sequential run
        await ops.release(fi.fh)  # waits for prefetches in flight, then ends the lease
        assert not ops.engine.is_leased(h.node.page.hash)  # type: ignore[union-attr]
        ops.nursery = None


def _resident(path: str) -> int:
    """How many pages of ``path`` are in the page cache (mincore)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            addr = ctypes.c_void_p(ctypes.addressof(anchor))
            if libc.mincore(addr, ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec)
        finally:
            del anchor


@pytest.mark.parametrize("direct", [False, True])
async def test_data_files_are_read_past_their_page_cache_for_cached_files(
    ops: KvfsOperations, direct: bool
) -> None:
    """A file the kernel caches (the default) has its bytes in the mount's page cache: the
    daemon reads the data files with O_DIRECT, so they are not cached twice. A direct_io
    file has no cache but the data files': those reads go through it."""
    import trio

    from kvfs._aligned import open_direct

    ops.direct_io = direct
    data = os.urandom(6 * MiB + 17)
    ino = await write_file(ops, ROOT, "twice", data)
    files, _ = decode_extents((await ops.getxattr(ino, b"user.kvfs.extents", CTX)).decode())
    fd, odirect = open_direct(files[0], os.O_RDONLY)
    os.close(fd)
    if not odirect:
        pytest.skip(f"{files[0]} is on a file system without O_DIRECT (tmpfs?); CI's /tmp has it")
    for path in files:  # written through the page cache: empty it (the files are synced)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert _resident(path) == 0
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery  # read-ahead on, as in the mount
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        assert fi.direct_io == direct
        got = b"".join([bytes(await ops.read(fi.fh, off, MiB)) for off in range(0, len(data), MiB)])
        await ops.release(fi.fh)
        ops.nursery = None
    assert got == data
    cached = sum(_resident(p) for p in files)
    assert (cached > 0) if direct else (cached == 0), cached


async def test_read_ahead_is_bounded_over_all_open_files(ops: KvfsOperations) -> None:
    """An engine that holds many pages open and reads only the start of each must not make
    the daemon hold a read-ahead window for every one: the mount's budget bounds the bytes
    prefetched and not yet read, over all files; a sequential reader still reads right."""
    import trio

    ops.read_ahead_budget = AheadBudget(6 * MiB)
    pages = {f"p{i}": os.urandom(4 * MiB) for i in range(6)}
    inos = {name: await write_file(ops, ROOT, name, data) for name, data in pages.items()}
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fhs = {}
        for name, ino in inos.items():  # open all, read the first MiB of each
            fhs[name] = (await ops.open(ino, os.O_RDONLY, CTX)).fh
            assert bytes(await ops.read(fhs[name], 0, MiB)) == pages[name][:MiB]
            await trio.testing.wait_all_tasks_blocked()
            assert ops.read_ahead_budget.held <= 6 * MiB
        assert ops.read_ahead_budget.held > 0  # the first files did get their windows
        for name, fh in fhs.items():  # and every file still reads back whole
            got = b"".join([bytes(await ops.read(fh, off, MiB)) for off in range(0, 4 * MiB, MiB)])
            assert got == pages[name]
        for fh in fhs.values():
            await ops.release(fh)
        assert ops.read_ahead_budget.held == 0  # closed files give their room back
        ops.nursery = None


async def test_read_ahead_refills_as_fetches_complete() -> None:
    """The window moves on when a fetch completes, not only when a request arrives (the
    reader may be waiting on the kernel), with at most MAX_FETCHES fetches in flight."""
    import trio

    from kvfs._fuse_ahead import MAX_FETCHES, ReadAhead

    started: list[int] = []
    release = trio.Event()
    running = 0
    most = 0

    async def fetch(off: int, n: int) -> bytes:
        nonlocal running, most
        started.append(off)
        running += 1
        most = max(most, running)
        if off:  # prefetches wait; the requests themselves are answered at once
            await release.wait()
        running -= 1
        return bytes(n)

    async with trio.open_nursery() as nursery:
        ra = ReadAhead(fetch, 64 * MiB, 16, nursery)
        await ra.read(0, MiB)  # one request, then the reader sends nothing more
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(started) == [0, MiB, 5 * MiB][: 1 + MAX_FETCHES]  # groups of 4 requests
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        # the completions refilled the window up to 16 requests past the reader: 17 MiB
        assert sorted(started)[-1] == 13 * MiB and len(started) == 5, started
        assert most == MAX_FETCHES
        await ra.aclose()


async def test_write_behind_keeps_order_and_reports_failures(ops: KvfsOperations) -> None:
    import trio

    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fi, _ = await ops.create(ROOT, b"wb", 0o644, os.O_WRONLY, CTX)
        for i in range(6):
            await ops.write(fi.fh, i * MiB, bytes([i]) * MiB)
        await ops.write(fi.fh, MiB, b"\xff" * 10)  # overlaps a queued write: lands after it
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        want = bytearray(b"".join(bytes([i]) * MiB for i in range(6)))
        want[MiB : MiB + 10] = b"\xff" * 10
        assert ops.engine.get("wb") == want
        # ENOSPC from a queued write comes back from a later write or from close
        fi, _ = await ops.create(ROOT, b"full", 0o644, os.O_WRONLY, CTX)
        with pytest.raises(pyfuse3.FUSEError) as ei:
            for i in range(80):
                await ops.write(fi.fh, i * MiB, b"\0" * MiB)
            await ops.flush(fi.fh)
        assert ei.value.errno == errno.ENOSPC
        await ops.release(fi.fh)
        assert not ops.engine.exists("full") and ops.engine.reserved == 0
        ops.nursery = None


async def test_write_behind_budget_bounds_writes_spread_over_files() -> None:
    """A writer that spreads its writes over many files (a layer per file) is held to the
    mount's write-behind budget, as one that fills a single file's queue is to its depth."""
    import threading

    import trio

    from kvfs._budget import ByteBudget
    from kvfs._fuse_behind import WriteBehind

    gate = threading.Event()
    written: list[int] = []

    def write(off: int, buf: bytes) -> None:
        assert gate.wait(10)
        written.append(len(buf))

    budget = ByteBudget(3 * MiB)
    files = [WriteBehind(write, 8, budget) for _ in range(5)]
    submitted = 0

    async def spread() -> None:
        nonlocal submitted
        for wb in files:
            await wb.submit(0, bytes(MiB))
            submitted += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spread)
        await trio.testing.wait_all_tasks_blocked()
        assert submitted == 3 and budget.held == 3 * MiB  # the fourth waits for room
        gate.set()
    for wb in files:
        await wb.drain()
    assert submitted == 5 and written == [MiB] * 5 and budget.held == 0


async def test_write_behind_runs_at_most_its_threads_over_all_files() -> None:
    """Write-behind started a thread for every file being written (hundreds of files at
    once, hundreds of threads; where a cgroup caps a container's processes, the writes
    that found none failed). Now at most the mount's thread count write at once, every
    file's writes still land in order, a busy file gives way to those waiting, and the
    threads exit once the queues are empty."""
    import threading
    import time

    import trio

    from kvfs._fuse_behind import WriteBehind, WriterThreads

    lock = threading.Lock()
    busy, most = 0, 0
    files: list[bytearray] = [bytearray(20) for _ in range(12)]

    def writer(i: int) -> Callable[[int, bytes], None]:
        def write(off: int, buf: bytes) -> None:
            nonlocal busy, most
            with lock:
                busy += 1
                most = max(most, busy)
            time.sleep(0.001)  # (a write takes a while: others queue meanwhile)
            files[i][off : off + len(buf)] = buf
            with lock:
                busy -= 1

        return write

    threads = WriterThreads(3)
    behind = [WriteBehind(writer(i), 4, None, threads) for i in range(12)]

    async def one(i: int) -> None:
        for n in range(40):  # each write overwrites the last: the file ends as the last
            await behind[i].submit(n % 4, bytes([n]) * 16)
        await behind[i].drain()

    async with trio.open_nursery() as nursery:
        for i in range(12):
            nursery.start_soon(one, i)
    assert most <= 3 and threads.running <= 3
    for f in files:
        assert f == bytes([36, 37, 38]) + bytes([39]) * 16 + bytes(1)
    for _ in range(200):  # (polled: each thread lingers a moment for more writes)
        if threads.running == 0:
            break
        await trio.sleep(0.01)
    assert threads.running == 0


async def test_a_writer_thread_waiting_for_room_does_not_hold_up_the_file_that_gives_it(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Near the cap, a write waits (up to 10 s) for the room other files' writes hold to be
    committed or given back. With the writer threads bounded, every thread could be so
    waiting while the file whose commit would give the room waited in line for a thread:
    nothing moved until the wait timed out, and the waiting write failed (ENOSPC). A
    thread waiting for room no longer counts against the bound, so that file gets one."""
    import trio

    from kvfs._fuse_behind import WriteBehind, WriterThreads

    unit = 64 * KiB
    cfg = make_config(ndev=1, stripe_unit=unit, capacity=6 * unit)
    async with kvfs.open_store(cfg) as store:
        eng = store.engine
        threads = WriterThreads(1)  # (one: as every one of the mount's 16 waiting)
        wa, wb = eng.begin_write("s/a"), eng.begin_write("s/b")
        a = WriteBehind(wa.write, 8, None, threads)
        b = WriteBehind(wb.write, 8, None, threads)
        await b.submit(0, b"b" * (2 * unit))
        await b.drain()
        while threads.running:  # (polled: b's thread lingers a moment for more writes)
            await trio.sleep(0.01)
        await a.submit(0, b"a" * (4 * unit))  # more than is left: waits for b's room
        await b.submit(2 * unit, b"b" * 10)  # b's last write, in line behind a's thread
        await b.drain()  # (before, only once a's wait had failed)
        await trio.to_thread.run_sync(wb.commit)
        await a.drain()  # (before: CapacityExceeded, the wait timed out)
        await trio.to_thread.run_sync(wa.commit)
        assert eng.get("s/a") == b"a" * (4 * unit)


async def test_flushes_at_once_commit_a_file_once_and_writes_go_on(ops: KvfsOperations) -> None:
    """A process that starts another while it writes a file: the child's close of the
    descriptor it inherited flushes beside the writer's own, and the writer goes on writing
    meanwhile. Both flushes committed the one writer (the second failed, "writer is
    closed", with a traceback in the log; before that it was never answered), and a write
    that came while the commit ran was refused with EBADF."""
    import trio

    first, second = os.urandom(MiB), os.urandom(MiB)
    answered: list[str] = []

    async def call(what: str, step: Awaitable[object]) -> None:
        await step
        answered.append(what)

    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fi, _ = await ops.create(ROOT, b"forked", 0o644, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, first)  # queued behind
        with trio.move_on_after(20):  # (a guard: a flush was never answered)
            async with trio.open_nursery() as closes:
                closes.start_soon(call, "child's flush", ops.flush(fi.fh))
                closes.start_soon(call, "flush", ops.flush(fi.fh))
                await trio.testing.wait_all_tasks_blocked()
                closes.start_soon(call, "write", ops.write(fi.fh, MiB, second))
        assert sorted(answered) == ["child's flush", "flush", "write"]
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        assert ops.engine.get("forked") == first + second
        # the writes queued already: the write comes while the child's flush commits
        fi, _ = await ops.create(ROOT, b"forked-2", 0o644, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, first)
        await ops.fsync(fi.fh, False)
        async with trio.open_nursery() as closes:
            closes.start_soon(call, "child's flush", ops.flush(fi.fh))
            await trio.testing.wait_all_tasks_blocked()
            await ops.write(fi.fh, MiB, second)
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        assert ops.engine.get("forked-2") == first + second
        ops.nursery = None


async def test_a_write_waiting_for_room_is_in_the_page_a_child_close_commits(
    ops: KvfsOperations,
) -> None:
    """A write that waited for room in its file's queue while a child's close of the
    descriptor it inherited drained that queue and committed the file went on into the
    committed writer: lost, with the writer's own close answered 0 (the page ended short,
    or with zeros where that write was, once later writes made the next version). Seen
    under a real mount with an engine's thread forking beside its writer, about one 1 MiB
    file in thirty."""
    import threading

    import trio

    from kvfs._fuse_behind import WriteBehind

    first, second = os.urandom(MiB), os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        for i in range(20):  # (trio picks which of the two wakes first: so, twenty rounds)
            fi, _ = await ops.create(ROOT, f"f{i}".encode(), 0o644, os.O_WRONLY, CTX)
            h = ops.handles[fi.fh]
            assert h.node.pending is not None
            gate, write = threading.Event(), h.node.pending.writer.write

            def held(off: int, buf: bytes, gate: threading.Event = gate, write=write) -> None:
                assert gate.wait(10)
                write(off, buf)

            # one write at a time in its queue, the first held in the data file's write
            h.behind = WriteBehind(held, 1, ops.write_behind_budget)
            await ops.write(fi.fh, 0, first)
            with trio.fail_after(20):  # (a guard: a waiter never woken)
                async with trio.open_nursery() as both:
                    both.start_soon(ops.write, fi.fh, MiB, second)  # waits for room
                    await trio.testing.wait_all_tasks_blocked()
                    both.start_soon(ops.flush, fi.fh)  # the child's close
                    await trio.testing.wait_all_tasks_blocked()
                    gate.set()
            await ops.flush(fi.fh)  # the writer's close
            await ops.release(fi.fh)
            assert ops.engine.get(f"f{i}") == first + second
        ops.nursery = None


async def test_write_behind_wakes_every_task_waiting_on_one_file() -> None:
    """Two closes of one file being written (the writer's, and a child's close of the
    descriptor it inherited: subprocess's fork closes them all) drain its queue at once,
    beside a write waiting for room. Each waiter took the one wake-up slot from the one
    before: only the last was woken, and the others' FLUSH was never answered (a child of
    an engine hung in close_range for good, its parent in vfork with it)."""
    import threading

    import trio

    from kvfs._fuse_behind import WriteBehind

    gate = threading.Event()

    def write(off: int, buf: bytes) -> None:
        assert gate.wait(10)

    wb = WriteBehind(write, 2)
    await wb.submit(0, b"a")
    await wb.submit(1, b"b")  # the queue is full
    finished: list[str] = []

    async def wait(what: str, step: Callable[[], Awaitable[None]]) -> None:
        await step()
        finished.append(what)

    with trio.move_on_after(10):  # (a guard: the waiters left behind waited for ever)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, "flush", wb.drain)
            nursery.start_soon(wait, "write", lambda: wb.submit(2, b"c"))
            nursery.start_soon(wait, "child's flush", wb.drain)
            await trio.testing.wait_all_tasks_blocked()
            assert finished == []
            gate.set()
    assert sorted(finished) == ["child's flush", "flush", "write"]
    await wb.drain()


def test_page_writer_checksums_whole_leaves_as_written(sync_store: kvfs.SyncStore) -> None:
    """The FUSE writer's page checksum: leaves hashed during write() must equal the bytes."""
    e = sync_store.engine
    data = bytearray(os.urandom(3 * MiB + 5))
    w = e.begin_write("a")
    for off in (2 * MiB, 0, MiB, 3 * MiB):  # whole leaves, out of order
        w.write(off, bytes(data[off : off + MiB]))
    w.write(MiB + 100, b"z" * 50)  # a later partial write into a hashed leaf
    data[MiB + 100 : MiB + 150] = b"z" * 50
    info = w.commit()
    assert info.checksum == kvfs.checksum(bytes(data)).hex()
    assert e.get("a") == data
    w = e.begin_write("b")
    for off in range(0, len(data), 700 * KiB):  # no write covers a leaf: all read back
        w.write(off, bytes(data[off : off + 700 * KiB]))
    assert w.commit().checksum == info.checksum


def test_page_writer_racing_writes_to_one_leaf(sync_store: kvfs.SyncStore) -> None:
    """A whole-leaf write whose leaf another write changes while it is in flight must not
    leave its checksum behind (the interleaving is forced)."""
    import threading

    e = sync_store.engine
    w = e.begin_write("race")
    real = w._w.write
    landed, other_done = threading.Event(), threading.Event()

    def slow_write(page_off: int, data: memoryview) -> None:
        real(page_off, data)
        if len(data) == MiB:  # the whole-leaf write: let the partial one land after it
            landed.set()
            assert other_done.wait(30)

    w._w.write = slow_write  # type: ignore[method-assign]
    whole = threading.Thread(target=w.write, args=(0, b"\x01" * MiB))
    whole.start()
    assert landed.wait(30)
    w.write(100, b"\xee" * 50)
    other_done.set()
    whole.join()
    info = w.commit()
    want = bytearray(b"\x01" * MiB)
    want[100:150] = b"\xee" * 50
    assert e.get("race") == want  # every leaf verified: a stale leaf hash raises CorruptPage
    assert info.checksum == kvfs.checksum(bytes(want)).hex()


async def test_a_page_with_a_bad_mount_attribute_still_stats(ops: KvfsOperations) -> None:
    """A store written by an earlier kvfs may hold an ``fs.uid`` that is no number (the
    object API took any): its file stats with the mount's defaults, and its directory lists,
    instead of EIO for both (a listing stats every entry)."""
    ops.engine.put("d/page", b"abc")
    ops.engine.put("d/other", b"def")
    ops.engine.index.update_page_attrs(
        "d/page", {"fs.uid": "abc", "fs.gid": "", "fs.mtime_ns": "x", "fs.mode": "z"}
    )
    d = (await ops.lookup(ROOT, b"d", CTX)).st_ino
    a = await ops.lookup(d, b"page", CTX)
    assert (a.st_uid, a.st_size, a.st_mode & 0o7777) == (os.getuid(), 3, 0o444)
    assert (await ops.getattr(a.st_ino, CTX)).st_gid == os.getgid()


async def _gated(ops: KvfsOperations, name: bytes) -> tuple[int, object]:
    """A file being written whose one queued write is held in its data file until the
    returned gate is set: a flush of it waits in its drain meanwhile."""
    import threading

    from kvfs._fuse_behind import WriteBehind

    fi, _ = await ops.create(ROOT, name, 0o644, os.O_WRONLY, CTX)
    h = ops.handles[fi.fh]
    assert h.node.pending is not None
    gate, write = threading.Event(), h.node.pending.writer.write

    def held(off: int, buf: bytes) -> None:
        assert gate.wait(10)
        write(off, buf)

    h.behind = WriteBehind(held, 1, ops.write_behind_budget)
    return fi.fh, gate


async def _answers(
    steps: dict[str, Awaitable[object]], gate: object, reached: Any = None
) -> dict[str, int]:
    """Run ``steps`` at once, in order, each started once the ones before are blocked (the
    second, with ``reached``, once the first is held: see :func:`_held`), then open
    ``gate``: what each answered (0, or its errno)."""
    import trio

    answered: dict[str, int] = {}

    async def call(what: str, step: Awaitable[object]) -> None:
        try:
            await step
            answered[what] = 0
        except pyfuse3.FUSEError as e:
            answered[what] = e.errno

    with trio.fail_after(20):  # (a guard: a step never answered)
        async with trio.open_nursery() as nursery:
            for i, (what, step) in enumerate(steps.items()):
                nursery.start_soon(call, what, step)
                if i == 0 and reached is not None:
                    assert await trio.to_thread.run_sync(reached.wait, 10)
                else:
                    await trio.testing.wait_all_tasks_blocked()
            gate.set()  # type: ignore[attr-defined]
    return answered


def _held(obj: object, method: str, *, after: bool = False) -> tuple[Any, Any]:
    """Replace ``obj.method`` by one that, once called, waits for the returned ``gate``;
    ``reached`` is set as it starts waiting (with ``after``, once the real call returned,
    whose result it then returns)."""
    import threading

    reached, gate, real = threading.Event(), threading.Event(), getattr(obj, method)

    def held(*args: object, **kw: object) -> object:
        got = real(*args, **kw) if after else None
        reached.set()
        assert gate.wait(10)
        return got if after else real(*args, **kw)

    setattr(obj, method, held)
    return reached, gate


async def test_a_rename_beside_its_writers_close_commits_the_file_once(
    ops: KvfsOperations,
) -> None:
    """A writer's thread renames the file (tmp + rename) while another thread closes it:
    both committed the one writer, one under each name. The rename answered 0 with the
    page left under the old name (the close EIO), or EIO with the page under the new name.
    Now the rename waits for the close and renames the page that close committed, as after
    a close that came first (it answered EBUSY); one that comes first commits it and the
    close answers 0."""
    import trio

    data = os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        # the close first, held in its drain, then the rename
        fh, gate = await _gated(ops, b"tmp")
        await ops.write(fh, 0, data)
        rename = ops.rename(ROOT, b"tmp", ROOT, b"final", 0, CTX)
        got = await _answers({"flush": ops.flush(fh), "rename": rename}, gate)
        await ops.release(fh)
        assert got == {"flush": 0, "rename": 0}
        assert ops.engine.get("final") == data and not ops.engine.exists("tmp")
        await ops.unlink(ROOT, b"final", CTX)
        # the rename first, held in its drain, then the close
        fh, gate = await _gated(ops, b"tmp")
        await ops.write(fh, 0, data)
        rename = ops.rename(ROOT, b"tmp", ROOT, b"final", 0, CTX)
        got = await _answers({"rename": rename, "flush": ops.flush(fh)}, gate)
        await ops.release(fh)
        assert got == {"flush": 0, "rename": 0}
        assert ops.engine.get("final") == data and not ops.engine.exists("tmp")
        ops.nursery = None


async def test_an_unlink_while_the_close_commits_removes_the_page(ops: KvfsOperations) -> None:
    """`rm f` while f's writer closes it, the commit under way: the unlink answered ENOENT
    (the file was pending no more, and not yet a page), and the page appeared after it.
    Now it waits for the commit and removes the page."""
    import trio

    data = os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fi, _ = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
        h = ops.handles[fi.fh]
        assert h.node.pending is not None
        begun, gate = _held(h.node.pending.writer, "commit")
        await ops.write(fi.fh, 0, data)
        # The unlink once the commit has begun: not while the close drains its queued
        # write (then the unlink came first, and the close committed nothing, either way)
        answered = await _answers(
            {"flush": ops.flush(fi.fh), "unlink": ops.unlink(ROOT, b"f", CTX)}, gate, begun
        )
        await ops.release(fi.fh)
        assert answered == {"flush": 0, "unlink": 0}
        assert not ops.engine.exists("f")
        ops.nursery = None


async def test_a_file_being_written_replaced_by_a_rename_is_closed_after_it(
    ops: KvfsOperations,
) -> None:
    """`mv page final` while another writer closes the file it was writing as final: the
    close committed its file over the page the rename had just put there (its commit ran
    while the rename's did), both answered 0, and final held the file the rename had
    replaced. The close waits for the rename now and commits nothing (its file was
    unlinked by it)."""
    import threading

    import trio

    data, other = os.urandom(MiB), os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        await write_file(ops, ROOT, "page", data)
        fi, _ = await ops.create(ROOT, b"final", 0o644, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, other)
        await ops.fsync(fi.fh, False)
        gate, rename = threading.Event(), ops.engine.rename

        def held_rename(src: str, dst: str) -> kvfs.PageInfo:
            assert gate.wait(10)
            return rename(src, dst)

        ops.engine.rename = held_rename  # type: ignore[method-assign]
        mv = ops.rename(ROOT, b"page", ROOT, b"final", 0, CTX)
        got = await _answers({"rename": mv, "flush": ops.flush(fi.fh)}, gate)
        await ops.release(fi.fh)
        assert got == {"rename": 0, "flush": 0}
        assert ops.engine.get("final") == data and not ops.engine.exists("page")
        assert ops.engine.reserved == 0  # (the file closed after the rename gave its room back)
        ops.nursery = None


async def test_a_file_released_beside_a_rename_onto_it_is_not_committed_over_it(
    ops: KvfsOperations,
) -> None:
    """The same for a file closed before any write, which its release commits (`touch`),
    and a rename onto it that comes as the release begins: the release no longer listed
    the file's handle, and the rename did not wait for it."""
    import threading

    import trio

    data = os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        for i in range(20):  # (trio picks which of the two runs first: so, twenty rounds)
            await write_file(ops, ROOT, "page", data)
            fi, _ = await ops.create(ROOT, b"final", 0o644, os.O_WRONLY, CTX)
            await ops.flush(fi.fh)  # (before any write: the release commits it)
            writer = ops.handles[fi.fh].node.pending.writer  # type: ignore[union-attr]
            gate, commit = threading.Event(), writer.commit

            def held(gate: threading.Event = gate, commit=commit, **kw: object) -> object:
                assert gate.wait(10)
                return commit(**kw)

            writer.commit = held  # type: ignore[method-assign]
            with trio.fail_after(20):
                async with trio.open_nursery() as both:
                    both.start_soon(ops.release, fi.fh)
                    both.start_soon(ops.rename, ROOT, b"page", ROOT, b"final", 0, CTX)
                    await trio.testing.wait_all_tasks_blocked()
                    gate.set()  # (the release's commit, if it is under way, after the rename)
            assert ops.engine.get("final") == data, i
            await ops.unlink(ROOT, b"final", CTX)
        ops.nursery = None


async def test_an_ftruncate_beside_its_writers_close_truncates_the_page(
    ops: KvfsOperations, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer's ftruncate while its close (another thread's, or a child's exit that
    closed the descriptor it inherited) commits the file: the truncate found the writer
    closed, answered EIO and logged an unexpected error. It waits for the close now, and
    then truncates the page's next version, which the writer's last close commits."""
    import trio

    data = os.urandom(MiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        for i in range(10):  # (which of the two threads gets on first is the OS's pick)
            fh, gate = await _gated(ops, f"f{i}".encode())
            await ops.write(fh, 0, data)
            got = await _truncate_beside_close(ops, fh, gate)
            await ops.release(fh)
            assert got == {"flush": 0, "truncate": 0}, i
            assert ops.engine.get(f"f{i}") == data[:100], i
        ops.nursery = None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _truncate_beside_close(ops: KvfsOperations, fh: int, gate: object) -> dict[str, int]:
    """An ftruncate to 100 bytes through ``fh`` beside its close (held in its drain until
    ``gate``): what each answered."""
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 100
    truncate = ops.setattr(ops.handles[fh].node.ino, attr, Fields(update_size=True), fh, CTX)
    return await _answers({"flush": ops.flush(fh), "truncate": truncate}, gate)


async def test_an_ftruncate_beside_a_close_that_discards_the_file_says_why(
    ops: KvfsOperations, caplog: pytest.LogCaptureFixture
) -> None:
    """The same ftruncate, beside a close whose commit fails (a queued write found no room,
    64 MiB of capacity): that close discards the file, and the truncate, once it had waited
    for it, found its writer closed and answered EIO with an unexpected error logged. It
    answers the file's failure now, as a write through the descriptor does."""
    import trio

    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        for i in range(10):  # (which of the two threads gets on first is the OS's pick)
            fh, gate = await _gated(ops, f"f{i}".encode())
            await ops.write(fh, 65 * MiB, b"x")  # (past the capacity: ENOSPC, queued)
            got = await _truncate_beside_close(ops, fh, gate)
            await ops.release(fh)
            assert got == {"flush": errno.ENOSPC, "truncate": errno.ENOSPC}, i
            assert not ops.engine.exists(f"f{i}") and ops.engine.reserved == 0, i
        ops.nursery = None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _beside_commit(ops: KvfsOperations, name: bytes, step: Callable[[int], Any]) -> int:
    """Write file ``name``, close it, and run ``step(inode)`` while that close commits it,
    once the commit has read the file's mode, owner and page attributes: its answer (0, or
    its errno). The close must answer 0."""
    fi, _ = await ops.create(ROOT, name, 0o644, os.O_WRONLY, CTX)
    h = ops.handles[fi.fh]
    assert h.node.pending is not None
    read, gate = _held(h.node.pending, "commit_attrs", after=True)
    await ops.write(fi.fh, 0, b"data")
    answers = await _answers({"close": ops.flush(fi.fh), "step": step(h.node.ino)}, gate, read)
    await ops.release(fi.fh)
    assert answers["close"] == 0
    return answers["step"]


async def test_a_chmod_beside_its_writers_close_is_kept(ops: KvfsOperations) -> None:
    """A writer's fchmod (or futimens, fchown) while its close (another thread) commits the
    file: set on the file being written once its commit had read the mode, it answered 0
    and the page kept the mode it was created with. It waits for the close now, as a
    truncate does, and sets the page's mode."""
    import trio

    attr = pyfuse3.EntryAttributes()
    attr.st_mode = 0o100600
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fields = Fields(update_mode=True)
        chmod = lambda ino: ops.setattr(ino, attr, fields, None, CTX)  # noqa: E731
        assert await _beside_commit(ops, b"f", chmod) == 0
        assert (await ops.lookup(ROOT, b"f", CTX)).st_mode & 0o7777 == 0o600
        ops.nursery = None


async def test_a_page_attribute_set_beside_its_writers_close_is_not_lost_silently(
    ops: KvfsOperations,
) -> None:
    """The same for a ``user.kvfs.attr.*`` the writer sets: it answered 0 and the page was
    committed without it. It waits for the close, and finds a committed page: EPERM, as
    any set on a page gets."""
    import trio

    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        setx = lambda ino: ops.setxattr(ino, b"user.kvfs.attr.dtype", b"fp16", CTX)  # noqa: E731
        assert await _beside_commit(ops, b"f", setx) == errno.EPERM
        assert "dtype" not in ops.engine.stat("f").attrs
        ops.nursery = None


async def test_a_rename_while_the_next_version_commits_moves_that_version(
    ops: KvfsOperations,
) -> None:
    """A writer's page committed (its flush), then written again (the page's next version)
    and closed, that version's commit under way as `mv f g` runs: the commit went to the
    name it had begun under, so f came back holding the new bytes and g kept the old ones.
    The rename waits for that commit and moves what it committed."""
    import trio

    first, second = os.urandom(64 * KiB), os.urandom(64 * KiB)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        fi, _ = await ops.create(ROOT, b"f", 0o644, os.O_WRONLY, CTX)
        await ops.write(fi.fh, 0, first)
        await ops.flush(fi.fh)  # the page, while the writer goes on
        await ops.write(fi.fh, 0, second)  # its next version
        again = ops.handles[fi.fh].again
        assert again is not None
        begun, gate = _held(again.writer, "commit")
        rename = ops.rename(ROOT, b"f", ROOT, b"g", 0, CTX)
        answered = await _answers({"release": ops.release(fi.fh), "rename": rename}, gate, begun)
        assert answered == {"release": 0, "rename": 0}
        assert not ops.engine.exists("f") and ops.engine.get("g") == second
        ops.nursery = None
