"""The disk holding the index fails while the store runs: the index (``index_dir``) on a
real ext4 file system on a loop device (tests/_loop_disk.py), shut down under the running
store, the data directory on a plain one. What each call gets, what is left behind and how
the store comes back are in docs/architecture.md, "The index's disk fails"."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio
from _loop_disk import LoopDisk

import kvfs
from kvfs._control import control_service
from kvfs._fuse import KvfsOperations
from kvfs._remote import open_remote_store


def index_on(tmp_path: Path, disk: LoopDisk) -> kvfs.StoreConfig:
    """A store whose data is on a plain directory and whose index is on ``disk``."""
    return kvfs.StoreConfig(data_dirs=(tmp_path / "d0",), index_dir=disk.path / "index")


def said_index_fails(e: BaseException, cfg: kvfs.StoreConfig) -> None:
    """``e`` is the clear error: IndexUnavailable, EIO, naming the index, not "malformed"."""
    assert isinstance(e, kvfs.IndexUnavailable) and isinstance(e, OSError), repr(e)
    assert e.errno == errno.EIO
    text = str(e)
    assert str(cfg.index_path) in text and "I/O error" in text, text
    assert "Nothing was changed" in text or "nothing was changed" in text, text
    assert "malformed" not in text and "corrupt" not in text, text


def data_files(cfg: kvfs.StoreConfig) -> set[Path]:
    return {p for p in (cfg.data_dirs[0] / "blobs").rglob("*") if p.is_file()}


def test_every_call_says_the_index_disk_fails(tmp_path: Path, loop_disk: LoopDisk) -> None:
    # A get, stat, list or put raised sqlite3's "database disk image is malformed" (as if
    # the index were corrupt), a delete sqlite3's "disk I/O error"
    cfg = index_on(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p0", b"x" * 100_000)
        os.sync()
        loop_disk.shut_down()
        calls = {
            "put": lambda: s.put("a/p1", b"y" * 100_000),
            "get": lambda: s.get("a/p0"),
            "stat": lambda: s.stat("a/p0"),
            "exists": lambda: s.exists("a/p0"),
            "list": lambda: s.list(session="a"),
            "delete": lambda: s.delete("a/p0"),
            "statistics": s.statistics,
        }
        for name, call in calls.items():
            with pytest.raises(kvfs.IndexUnavailable) as e:
                call()
            said_index_fails(e.value, cfg)
            assert e.value.__cause__ is not None, name  # (SQLite's own words)


def test_a_put_the_index_disk_fails_leaves_nothing(tmp_path: Path, loop_disk: LoopDisk) -> None:
    # The put (a page written to the data disk, then its commit failed) raised sqlite3's
    # error; now a clear one, no page after the comeback, and no data file left over
    cfg = index_on(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p0", b"x" * 100_000)
        before = data_files(cfg)
        os.sync()
        loop_disk.shut_down()
        # (replace: no existence check first, and over 256 KiB: no lookup of its content
        # before the write; the index is first touched by the commit)
        with pytest.raises(kvfs.IndexUnavailable) as e:
            s.put("a/big", os.urandom(1 << 20), replace=True)
        said_index_fails(e.value, cfg)
        assert s.engine.reserved == 0  # its room given back
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        assert [p.path for p in s.list()] == ["a/p0"] and not s.exists("a/big")
        found = s.fsck()
        assert not any(found[k] for k in ("orphans", "missing", "corrupt", "unreadable"))
        assert data_files(cfg) == before


def test_close_completes_and_every_acknowledged_page_comes_back(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # The close raised EIO half-way, leaving the index's connections and files open: the
    # disk could not be unmounted ("target is busy"), nor the store opened again.
    cfg = index_on(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000 + i) for i in range(5)}
    cm = kvfs.open_store_sync(cfg)
    s = cm.__enter__()
    for k, v in pages.items():
        s.put(k, v)
    assert s.get("a/p0") == pages["a/p0"]  # (an access time to save at close)
    os.sync()
    loop_disk.shut_down()
    with pytest.raises(kvfs.IndexUnavailable):
        s.put("a/late", b"z" * 100_000)
    with caplog.at_level(logging.ERROR, logger="kvfs"):
        cm.__exit__(None, None, None)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("marking the index clean" in m and str(cfg.index_path) in m for m in said), said
    with pytest.raises(kvfs.StoreClosed):
        s.get("a/p0")
    loop_disk.comeback()  # (an umount that finds the disk busy fails here)
    with kvfs.open_store_sync(cfg) as s:
        assert {k: s.get(k) for k in pages} == pages
        assert sorted(p.path for p in s.list()) == sorted(pages)
        found = s.fsck()
        assert not any(v for k, v in found.items() if k != "repaired"), found


async def test_the_mount_answers_eio_and_says_so_once(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # Each request was logged at ERROR with a traceback (sqlite3's "malformed")
    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
    cfg = index_on(tmp_path, loop_disk)
    async with kvfs.open_store(cfg) as store:
        for i in range(3):
            await store.put(f"a/p{i}", os.urandom(100_000))
        ops = KvfsOperations(store)
        try:
            a = (await ops.lookup(pyfuse3.ROOT_INODE, b"a", ctx)).st_ino
            os.sync()
            loop_disk.shut_down()
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="kvfs.fuse"):
                for i in range(3):
                    with pytest.raises(pyfuse3.FUSEError) as e:
                        await ops.lookup(a, f"p{i}".encode(), ctx)
                    assert e.value.errno == errno.EIO
                with pytest.raises(pyfuse3.FUSEError) as e:
                    await ops.mkdir(a, b"sub", 0o755, ctx)  # (the table of directories)
                assert e.value.errno == errno.EIO
        finally:
            await ops.aclose()
    said = [r for r in caplog.records if r.name == "kvfs.fuse" and r.levelno >= logging.INFO]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert str(cfg.index_path) in said[0].getMessage() and not said[0].exc_info


async def test_the_archive_worker_says_the_index_disk_fails_once_a_while(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # The archive's background pass (manifests and deletes, every spill_interval) logged
    # each failure the disk caused as an "unexpected error" at ERROR with a traceback, and
    # an ERROR event line: a mount's log took two tracebacks a second while the disk failed
    import dataclasses

    cfg = dataclasses.replace(
        index_on(tmp_path, loop_disk),
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0.05}},
    )
    async with kvfs.open_store(cfg) as store:
        for i in range(3):
            await store.put(f"a/p{i}", os.urandom(100_000))
        await store.spill("a")
        counters = store.engine.policy.counters  # type: ignore[attr-defined]
        os.sync()
        with caplog.at_level(logging.INFO):
            caplog.clear()
            loop_disk.shut_down()
            failed = counters["errors"]
            with trio.fail_after(60):
                while counters["errors"] < failed + 5:  # five passes failed
                    await trio.sleep(0.05)
            said = [r for r in caplog.records if r.name in ("kvfs.archive", "kvfs.events")]
    assert [r.getMessage() for r in said if r.levelno >= logging.ERROR] == []
    lines = [r.getMessage() for r in said if "archive manifests and deletes" in r.getMessage()]
    assert len(lines) == 1 and "IndexUnavailable" in lines[0], lines


async def test_the_control_channel_answers_each_call_with_the_error(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # (what `kvfs stats` and an engine's client get from the daemon while the index fails:
    # the error, call after call, and the daemon still there to answer). Each call was an
    # ERROR event line in the daemon's log: an engine's hundreds of gets a second flooded it
    cfg = index_on(tmp_path, loop_disk)
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        async with open_remote_store(sock) as r:
            await r.put("a/p0", b"x" * 100_000)
            os.sync()
            loop_disk.shut_down()
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="kvfs.events"):
                for call in (r.statistics, lambda: r.get("a/p0"), r.statistics, r.list):
                    with pytest.raises(kvfs.IndexUnavailable) as e:
                        await call()
                    said_index_fails(e.value, cfg)
        n.cancel_scope.cancel()
    said = [r for r in caplog.records if getattr(r, "kvfs_event", None) == "error"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "error=IndexUnavailable" in said[0].getMessage()
    assert str(cfg.index_path) in said[0].getMessage()


def tree(*dirs: Path) -> dict[Path, tuple[int, int]]:
    """Every path under ``dirs`` with its size and mtime: what an open changed."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for d in dirs for p in d.rglob("*")}


def test_an_open_while_the_index_disk_fails_says_so(tmp_path: Path, loop_disk: LoopDisk) -> None:
    # The open (and `kvfs ls`) stopped at the lock file with a bare "[Errno 5] Input/output
    # error: '.../kvfs.lock'", as if kvfs had a bug
    cfg = index_on(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p0", b"x" * 100_000)
    os.sync()
    before = tree(cfg.index_path.parent, cfg.data_dirs[0])
    loop_disk.shut_down()
    opening = kvfs.open_store_sync(cfg)
    with pytest.raises(kvfs.IndexUnavailable) as e:
        opening.__enter__()
    assert e.value.errno == errno.EIO
    text = str(e.value)
    assert str(cfg.index_path.parent) in text and "is its disk failing?" in text, text
    assert "Nothing was created or changed" in text, text
    loop_disk.comeback()
    assert tree(cfg.index_path.parent, cfg.data_dirs[0]) == before
    with kvfs.open_store_sync(cfg) as s:
        assert s.get("a/p0") == b"x" * 100_000


def test_kvfs_ls_while_the_index_disk_fails_says_so_in_one_line(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # `kvfs ls` printed "kvfs ls: [Errno 5] Input/output error: '.../kvfs.lock'", and
    # exited 1, as for any error: a failing disk has its own code (docs/cli.md)
    cfg = index_on(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p0", b"x" * 100_000)
    os.sync()
    loop_disk.shut_down()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    env["KVFS_INDEX_DIR"] = str(cfg.index_path.parent)
    r = subprocess.run(
        [sys.executable, "-m", "cli", "ls", "--offline", "--data", str(cfg.data_dirs[0])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 10 and r.stdout == "", (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("kvfs ls: cannot open the store"), r.stderr
    assert str(cfg.index_path.parent) in r.stderr and "is its disk failing?" in r.stderr
