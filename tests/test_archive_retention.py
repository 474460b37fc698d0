"""Retention (``archive.retention``): a session untouched that long is deleted from every
tier, this host's and the archive's, by the background task. Pinned sessions, sessions
holding a pinned page, and sessions in use stay. File and S3 archives."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import trio

import kvfs
from kvfs import PageKey
from tests.test_archive import archive_url, archived_cfg, kv_page  # noqa: F401 - fixture

__all__ = ["archive_url"]


def test_untouched_sessions_go_from_every_tier_and_the_rest_stay(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    retention = 1.5
    cfg = archived_cfg(
        make_config, archive_url, name="host-a", interval=0.05, retention=f"{retention}s"
    )
    keys = {s: [PageKey.semantic(s, "p", i) for i in range(3)] for s in SESSIONS}

    async def main() -> None:
        async with kvfs.open_store(cfg) as s:
            policy = s.engine.policy  # type: ignore[attr-defined]
            await s.pin_session("pinned")
            start = time.monotonic()  # no session is touched last before this
            for n, ks in enumerate(keys.values()):
                for i, k in enumerate(ks):
                    await s.put(k, kv_page(10 * n + i))
            await s.pin(keys["pinned-page"][0])
            for sess in ("spilled", "pinned", "pinned-page"):
                await s.spill(sess)  # in the archive only: retention must reach it there
            spilled = {bytes.fromhex((await s.stat(k)).checksum) for k in keys["spilled"]}
            with trio.fail_after(60):
                while {"spilled", "local"} & {i.session for i in await s.sessions()}:
                    # "busy" is read all along: in use, it is never untouched that long
                    assert await s.get(keys["busy"][0]) == kv_page(30)
                    await trio.sleep(0.1)
            assert time.monotonic() - start >= retention * 0.9  # not before its time
            left = {i.session for i in await s.sessions()}
            assert left == {"busy", "pinned", "pinned-page"}
            for sess in left:
                for i, k in enumerate(keys[sess]):
                    assert await s.get(k) == kv_page(10 * SESSIONS.index(sess) + i)
            with pytest.raises(kvfs.PageNotFound):
                await s.get(keys["spilled"][0])
            with trio.fail_after(60):  # the background pass collects the objects no manifest names
                while spilled & {
                    bytes.fromhex(k.rsplit("/", 1)[1].split(".")[0])
                    for k in await policy.store.list_all("blobs/")
                }:
                    await trio.sleep(0.1)
            archived = {a["session"] for a in await s.archived_sessions()}
            assert "spilled" not in archived and "pinned" in archived
            st = (await s.statistics()).extra["archive"]
            assert st["sessions_expired"] == 2 and st["retention_s"] == retention

    trio.run(main)
    # Another host sharing the bucket does not find the expired session either.
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        found = {a["session"] for a in b.archived_sessions()}
        assert "spilled" not in found and {"pinned", "pinned-page"} <= found
        b.restore("pinned")
        assert b.get(keys["pinned"][1]) == kv_page(10 * SESSIONS.index("pinned") + 1)


SESSIONS = ["spilled", "local", "pinned", "busy", "pinned-page"]


def test_a_session_touched_after_the_pass_looked_is_kept(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """The check and the deletion are one index transaction: a session touched or pinned
    after the retention pass listed it is kept."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        k = PageKey.semantic("a", "p", 0)
        s.put(k, kv_page(1))
        eng = s.engine
        eng.flush_atimes()
        looked = time.time() - 0.001  # the pass's cutoff came before this put
        assert eng.expire_session("sessions/a", looked) is None
        s.pin(k)
        assert eng.expire_session("sessions/a", time.time() + 1) is None  # a pinned page
        s.unpin(k)
        s.pin_session("a")
        assert eng.expire_session("sessions/a", time.time() + 1) is None  # a pinned session
        s.unpin_session("a")
        assert eng.expire_session("sessions/a", time.time() + 1) == 1
        assert not s.exists(k) and s.sessions() == []
        assert eng.expire_session("sessions/a", time.time() + 1) is None  # gone already
