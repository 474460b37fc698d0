"""Ctrl-C (KeyboardInterrupt) in the middle of a call of the sync facade: the call's worker
threads are over before it raises, nothing it wrote is left, and the store goes on."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import kvfs
from kvfs._aligned import aligned_buffer

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
