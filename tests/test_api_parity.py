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
