"""The daemon's clients (RemoteStore, SyncRemoteStore) take the same arguments and raise the
same errors as the in-process store, and survive a daemon restart without failed calls."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

import kvfs
from kvfs._control import control_service
from kvfs._remote import RemoteStore, SyncRemoteStore

MakeConfig = Callable[..., kvfs.StoreConfig]


@asynccontextmanager
async def served(cfg: kvfs.StoreConfig, sock: Path) -> AsyncIterator[kvfs.Store]:
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        yield store
        n.cancel_scope.cancel()


async def test_many_calls_raise_the_store_error_as_it_is(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    sock = tmp_path / "c.sock"
    async with served(make_config(), sock):
        r = RemoteStore(sock)
        await r.put("a/1", b"one")
        with pytest.raises(kvfs.PageNotFound):  # was ExceptionGroup([PageNotFound])
            await r.get_many(["a/1", "a/missing"])
        with pytest.raises(kvfs.PageExists):
            await r.put_many([("a/2", b"two"), ("a/1", b"again")], concurrency=1)
        with pytest.raises(ValueError, match="one buffer per key"):  # was: ignored
            await r.get_many(["a/1"], into=[bytearray(3), bytearray(3)])
        with pytest.raises(ValueError, match="one buffer per key"):  # was: IndexError group
            await r.get_many(["a/1", "a/2"], into=[bytearray(3)])
        infos = await r.put_many([("a/3", b"3"), ("a/4", b"4")], pin=True, concurrency=0)
        assert [i.pinned for i in infos] == [True, True]
        await r.aclose()

        def sync_side() -> None:
            s = SyncRemoteStore(sock)
            try:
                # concurrency= went on to put(): TypeError
                s.put_many([("b/1", b"1"), ("b/2", b"2")], concurrency=2, attrs={"k": "v"})
                assert s.get_many(["b/1", "b/2"], concurrency=2) == [b"1", b"2"]
                with pytest.raises(ValueError, match="one buffer per key"):
                    s.get_many(["b/1", "b/2"], into=[bytearray(1)])
                with pytest.raises(kvfs.PageNotFound):
                    s.get_many(["b/1", "b/missing"])
            finally:
                s.close()

        await trio.to_thread.run_sync(sync_side)


async def test_a_buffer_too_small_is_refused_before_an_archive_only_page_is_restored(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A get through the daemon into a buffer too small for a page only the archive held
    restored the page (taking local room) and sent it, and only then did the client refuse
    the buffer: the daemon now hears the buffer's size with the request."""
    sock = tmp_path / "g.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/arch", extra={"archive": {"interval": 0}})
    key, data = "sessions/a/p/layer-000", os.urandom(100_000)
    async with served(cfg, sock) as store:
        await store.put(key, data)
        await store.spill("a")
        async with kvfs.open_remote_store(sock) as r:
            with pytest.raises(ValueError, match="buffer of 10 bytes is smaller than page"):
                await r.get(key, bytearray(10))
        s = SyncRemoteStore(sock)
        try:
            with pytest.raises(ValueError, match="smaller than page"):
                await trio.to_thread.run_sync(s.get, key, bytearray(len(data) - 1))
            assert (await store.stat(key)).tier == "archive"
            buf = bytearray(len(data) + 1)  # (a larger one is fine, as in-process)
            assert await trio.to_thread.run_sync(s.get, key, buf) == len(data)
            assert buf[: len(data)] == data
        finally:
            s.close()


async def test_async_client_reports_progress(make_config: MakeConfig, tmp_path: Path) -> None:
    """``progress=`` on RemoteStore.spill/restore/evict was a TypeError."""
    sock = tmp_path / "p.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/arch", extra={"archive": {"interval": 0}})
    async with served(cfg, sock) as store:
        for s in ("a", "b"):
            for i in range(3):
                await store.put(f"sessions/{s}/p/layer-{i:03d}", os.urandom(70_000 + i))
        total = sum(70_000 + i for i in range(3))
        seen: dict[str, list[tuple[int, int]]] = {"spill": [], "restore": [], "evict": []}
        async with kvfs.open_remote_store(sock) as r:
            await r.spill("a", progress=lambda d, t: seen["spill"].append((d, t)))
            assert await r.restore("a", progress=lambda d, t: seen["restore"].append((d, t)))
            await r.evict(session="b", progress=lambda d, t: seen["evict"].append((d, t)))
        assert {k: v[-1] for k, v in seen.items()} == dict.fromkeys(seen, (total, total))
        assert (await store.session_info("b")).local_bytes == 0


async def test_bad_arguments_get_the_in_process_errors(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    sock = tmp_path / "e.sock"
    strided = np.arange(64, dtype=np.uint8)[::2]
    async with served(make_config(), sock) as store:
        await store.put("a/1", b"x" * 64)
        async with kvfs.open_remote_store(sock) as r:
            for client in (store, r):
                with pytest.raises(ValueError, match="C-contiguous"):  # remote: TypeError
                    await client.put("a/2", strided)
                with pytest.raises(ValueError, match="C-contiguous"):
                    await client.get("a/1", into=np.zeros(256, np.uint8)[::2])
                with pytest.raises(kvfs.InvalidKey):  # remote: UnicodeEncodeError
                    await client.put("a/\ud800", b"x")
                with pytest.raises(kvfs.InvalidKey, match="UTF-8"):  # both: UnicodeEncodeError
                    await client.put("a/3", b"x", attrs={"k": "\ud800"})
                with pytest.raises(kvfs.InvalidKey, match="UTF-8"):
                    await client.set_session_attrs("a", {"\udfff": "v"})
                assert not await client.exists("a/3")
    with pytest.raises(kvfs.InvalidKey):  # in-process, PageKey("../x") named a page "../x"
        kvfs.PageKey("../x")
    with pytest.raises(kvfs.InvalidKey, match="sessions/<session>/<prefix>/<layer>"):
        kvfs.PageKey("sessions/x")


async def test_a_restarted_daemon_answers_the_first_call(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Pooled connections to a daemon that stopped made the next calls (one per connection)
    fail with DaemonUnavailable although a new daemon was answering."""
    sock = tmp_path / "r.sock"
    cfg = make_config()
    sync = SyncRemoteStore(sock)
    remote = RemoteStore(sock)
    async with served(cfg, sock) as store:
        await store.put("a/1", b"one")
        barrier = threading.Barrier(3)

        def call() -> None:
            barrier.wait()
            assert sync.get("a/1") == b"one"

        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(trio.to_thread.run_sync, call)
        assert await remote.get_many(["a/1"] * 3, concurrency=3) == [b"one"] * 3
        assert len(sync._idle) >= 2 and len(remote._idle) >= 2
    async with served(cfg, sock):  # the daemon again, on the same socket
        for _ in range(4):
            assert await trio.to_thread.run_sync(sync.get, "a/1") == b"one"
            assert await remote.get("a/1") == b"one"
    sync.close()
    await remote.aclose()


async def test_a_forked_child_does_not_share_the_pooled_connection(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """After a fork the pooled connection was the parent's and the child's at once: each
    got some of the other's answers (another key's bytes), or hung."""
    sock = tmp_path / "f.sock"
    a, b = b"A" * 100_000, b"B" * 100_000
    async with served(make_config(), sock):

        def sync_side() -> None:
            s = SyncRemoteStore(sock, timeout=30)
            s.put("f/p0", a)
            s.put("f/p1", b)  # one connection now waits in the pool
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child reads p1 while the parent reads p0
                try:
                    ok = all(s.get("f/p1") == b for _ in range(200))
                    os.write(w, b"1" if ok else b"0")
                finally:
                    os._exit(0)
            os.close(w)
            try:
                mine = [s.get("f/p0") == a for _ in range(200)]
            finally:
                os.waitpid(pid, 0)
                s.close()
            assert all(mine) and os.read(r, 1) == b"1"

        await trio.to_thread.run_sync(sync_side)
