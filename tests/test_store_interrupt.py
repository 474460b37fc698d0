"""Ctrl-C (KeyboardInterrupt) in the middle of a call of the sync facade: the call's worker
threads are over before it raises, nothing it wrote is left, and the store goes on."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvfs
from kvfs import PageKey
from kvfs._aligned import aligned_buffer

KiB = 1024
MiB = 1024 * 1024


def _ctrl_c_once_waiting(main: int, caller: str, then: threading.Event) -> None:
    """Send SIGINT to the thread ``main`` once it waits on a condition inside a function
    named ``caller`` (a put waiting for the write of its file on another device), as a
    terminal's Ctrl-C reaches a script; then hold this thread until ``then`` (or a second:
    a call that waits for what was queued behind this one is waiting for it)."""
    while True:
        frame = sys._current_frames().get(main)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names[:1] == ["wait"] and caller in names:
            break
        threading.Event().wait(0.005)
    signal.pthread_kill(main, signal.SIGINT)
    then.wait(1.0)


def test_ctrl_c_in_a_put_leaves_no_file_written_after_it(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    # One I/O thread, held by a call queued before the put: the put writes its first
    # device's file itself, and waits on that thread for the other's when Ctrl-C comes.
    cfg = make_config(ndev=2, stripe_unit=4 * MiB, io_threads=1)
    data = aligned_buffer(16 * MiB)
    data[:] = bytes(range(256)) * (16 * MiB // 256)
    key = "sessions/s/p/layer-000"
    with kvfs.open_store_sync(cfg) as s:
        raised = threading.Event()
        main = threading.main_thread().ident
        s.engine.io_pool.submit(_ctrl_c_once_waiting, main, "wait_all", raised)
        with pytest.raises(KeyboardInterrupt):
            s.put(key, data)
        raised.set()
        s.engine.io_pool.submit(lambda: None).result()  # what was queued has run
        # The other device's write ran after the put had removed its files, and made its
        # file again: 8 MiB on disk that no page, reservation or writer accounted for.
        assert [p for d in cfg.data_dirs for p in Path(d).glob("blobs/*/*")] == []
        assert not s.exists(key)
        assert s.engine.reserved == 0
        s.put(key, data)
        assert s.get(key) == bytes(data)
        assert not any(v for v in s.fsck().values())


def test_ctrl_c_while_another_thread_commits_the_put_leaves_a_readable_page(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A put waiting for the group commit another thread leads was interrupted there: it
    removed its files and gave back its room, and the leader then published the page
    anyway, naming files that were gone (a get found it corrupt). Now the interrupt waits
    for the commit: the put raises KeyboardInterrupt, and its page, published, reads."""
    cfg = make_config(ndev=1)
    ours, theirs = b"a" * (256 * 1024), b"b" * (256 * 1024)
    with kvfs.open_store_sync(cfg) as s:
        index = s.engine.index
        holding, release = threading.Event(), threading.Event()

        def hold_the_index() -> None:  # the leader's transaction waits behind this one
            with index.transaction():
                holding.set()
                release.wait(30)

        holder = threading.Thread(target=hold_the_index)
        holder.start()
        assert holding.wait(30)
        leader = threading.Thread(target=lambda: s.put("t/leader", theirs))
        leader.start()
        while not index._gc_leading:  # (the other thread leads the next commit)
            threading.Event().wait(0.005)
        main = threading.main_thread().ident
        assert main is not None

        def ctrl_c_then_release() -> None:
            _ctrl_c_once_waiting(main, "commit_page", threading.Event())  # (a second after)
            release.set()

        waiter = threading.Thread(target=ctrl_c_then_release)
        waiter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                s.put("t/ours", ours)
        finally:
            release.set()
            for t in (waiter, holder, leader):
                t.join(30)
        assert s.get("t/leader") == theirs
        assert s.get("t/ours") == ours  # (queued before the Ctrl-C: the leader published it)
        assert s.engine.reserved == 0
        assert not any(v for v in s.fsck().values())


def _in_a_thread(name: str) -> bool:
    """Whether some thread is in a function called ``name``."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == name:
                return True
            frame = frame.f_back
    return False


def test_ctrl_c_while_a_restore_commits_leaves_no_room_reserved_nor_file(
    make_config: Callable[..., kvfs.StoreConfig],
    tmp_path: Path,
) -> None:
    """The restore commits its staged copies in batches, each taken off the list of copies
    to commit before the thread that commits it starts: a cancellation (Ctrl-C) there lost
    the batch, its files on disk with no row and its room reserved until the store closed."""
    n = 6
    cfg = make_config(
        ndev=2,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        rng = np.random.default_rng(0)
        data = {
            PageKey.semantic("agent", "p0", i): rng.integers(0, 255, 40 * KiB, np.uint8).tobytes()
            for i in range(n)
        }
        for k, v in data.items():
            s.put(k, v)
        assert s.spill("agent") > 0
        index = s.engine.index
        main = threading.main_thread().ident
        assert main is not None
        holding, release = threading.Event(), threading.Event()

        def hold_the_index() -> None:  # the restore's first commit waits behind this
            with index.transaction():
                holding.set()
                release.wait(30)

        def ctrl_c_once_all_staged() -> None:
            need = s.engine.tier.disk_bytes(40 * KiB)
            # Every page has its room (each is being written, or is written, and goes on the
            # list of copies to commit), and the first commit waits for the index.
            while not (s.engine.reserved == n * need and _in_a_thread("adopt_local_many")):
                threading.Event().wait(0.005)
            signal.pthread_kill(main, signal.SIGINT)
            threading.Event().wait(0.3)  # (the restore is cancelled: then its commit runs)
            release.set()

        holder = threading.Thread(target=hold_the_index)
        holder.start()
        assert holding.wait(30)
        waiter = threading.Thread(target=ctrl_c_once_all_staged)
        waiter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                s.restore("agent")
        finally:
            release.set()
            for t in (waiter, holder):
                t.join(30)
        assert s.engine.reserved == 0
        local = [i.extents for i in s.list(session="agent") if i.tier != "archive"]
        files = [p for d in cfg.data_dirs for p in Path(d).glob("blobs/*/*")]
        assert len(files) == sum(len(e) for e in local)
        for k, v in data.items():
            assert s.get(k) == v
        assert not any(v for v in s.fsck().values())


def _stack_of(t: int) -> list[str]:
    frame = sys._current_frames().get(t)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def test_ctrl_c_in_a_read_restoring_a_page_tells_the_readers_waiting_for_it(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """Readers of a page only the archive holds share one download. A Ctrl-C in the read
    that made it raised KeyboardInterrupt in the other readers' threads too (the shared
    result was the interrupt); they get ArchiveUnavailable now, and a later read restores
    the page. The object is a FIFO, so the download waits until the test writes it."""
    archive = tmp_path / "archive"
    cfg = make_config(
        ndev=1,
        archive_url=f"file://{archive}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )
    k, v = PageKey.semantic("agent", "p0", 0), bytes(range(256)) * 256
    with kvfs.open_store_sync(cfg) as s:
        s.put(k, v)
        assert s.spill("agent") > 0
        obj = archive / "blobs" / s.stat(k).checksum
        body = obj.read_bytes()
        obj.unlink()
        os.mkfifo(obj)
        main = threading.main_thread().ident
        assert main is not None
        other: list[BaseException | bytes] = []

        def read() -> None:
            try:
                other.append(s.get(k))
            except BaseException as e:  # (what a thread of the caller's would see)
                other.append(e)

        reader = threading.Thread(target=read)

        def ctrl_c_then_feed() -> None:
            while "_restore_one" not in _stack_of(main):  # its download waits for the FIFO
                threading.Event().wait(0.005)
            reader.start()
            while not {"restore_blob", "result"} <= set(_stack_of(reader.ident or 0)):
                threading.Event().wait(0.005)
            signal.pthread_kill(main, signal.SIGINT)
            threading.Event().wait(0.3)
            with open(obj, "wb") as w:
                obj.unlink()
                w.write(body)

        helper = threading.Thread(target=ctrl_c_then_feed)
        helper.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                s.get(k)
        finally:
            helper.join(30)
            reader.join(30)
        assert len(other) == 1 and isinstance(other[0], kvfs.ArchiveUnavailable), other
        assert s.stat(k).tier == "archive" and s.engine.reserved == 0
        obj.write_bytes(body)
        assert s.get(k) == v
