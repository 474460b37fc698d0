"""The four front doors of the object API (``Store``, ``SyncStore``, ``RemoteStore``,
``SyncRemoteStore``) offer the same methods with the same parameters, so code written
against one runs against another; the differences are the few listed here, on purpose."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import kvfs
from kvfs._control import control_service

MakeConfig = Callable[..., kvfs.StoreConfig]
MiB = 1 << 20


@asynccontextmanager
async def served(cfg: kvfs.StoreConfig, sock: Path) -> AsyncIterator[kvfs.Store]:
    """An open store, and a daemon's control channel serving it on ``sock``."""
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        yield store
        n.cancel_scope.cancel()


async def test_read_page_on_every_front_door(make_config: MakeConfig, tmp_path: Path) -> None:
    """``read_page`` was public on SyncStore and SyncRemoteStore only (Store had a private
    ``_read_page``, RemoteStore nothing): code using it could not move to the async doors."""
    sock = tmp_path / "c.sock"
    cfg = make_config()
    small, large = os.urandom(1000), os.urandom(3 * MiB + 5)
    async with served(cfg, sock) as store:
        await store.put("a/small", small)
        await store.put("a/large", large)
        remote = kvfs.SyncRemoteStore(sock)
        try:
            async with kvfs.open_remote_store(sock) as r:
                for read_page in (store.read_page, r.read_page):
                    assert await read_page("a/small") == small
                    got = await read_page("a/large")
                    assert isinstance(got, memoryview) and got == large  # (no bytes copy)
                    with pytest.raises(kvfs.PageNotFound):
                        await read_page("a/missing")
            got = await trio.to_thread.run_sync(remote.read_page, "a/large")
            assert isinstance(got, memoryview) and got == large
            with pytest.raises(kvfs.PageNotFound):
                await trio.to_thread.run_sync(remote.read_page, "a/missing")
        finally:
            remote.close()
    with kvfs.open_store_sync(cfg) as sync:
        assert sync.read_page("a/small") == small
        got = sync.read_page("a/large")
        assert isinstance(got, memoryview) and got == large
        with pytest.raises(kvfs.PageNotFound):
            sync.read_page("a/missing")


async def test_fsck_reports_progress_on_every_front_door(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """``fsck(progress=)`` was a TypeError on every door: only SyncRemoteStore reported an
    fsck's progress, under another name (``fsck_progress``), and the CLI called the engine
    itself to draw the in-process bar."""
    sock = tmp_path / "c.sock"
    cfg = make_config()
    seen: dict[str, list[tuple[int, int]]] = {d: [] for d in ("Store", "Remote", "SyncRemote")}

    def to(door: str) -> Callable[[int, int], None]:
        return lambda done, total: seen[door].append((done, total))

    async with served(cfg, sock) as store:
        for i in range(5):
            await store.put(f"sessions/a/p/layer-{i:03d}", os.urandom(3000 + i))
        assert not any((await store.fsck(progress=to("Store"))).values())
        async with kvfs.open_remote_store(sock) as r:
            assert not any((await r.fsck(progress=to("Remote"))).values())

        def sync_remote() -> None:  # (in a thread: the daemon answers on this trio loop)
            with kvfs.open_remote_store_sync(sock) as s:
                found = s.fsck(progress=to("SyncRemote"))
                assert not any(found.values())
                # the older name still works
                assert s.fsck_progress(progress=lambda d, t: None) == found

        await trio.to_thread.run_sync(sync_remote)
    with kvfs.open_store_sync(cfg) as sync:
        seen["SyncStore"] = []
        assert not any(sync.fsck(progress=to("SyncStore")).values())
    assert {door: calls[-1] for door, calls in seen.items()} == dict.fromkeys(seen, (5, 5))
