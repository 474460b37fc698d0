"""Retention (``archive.retention``): a session untouched that long is deleted from every
tier, this host's and the archive's, by the background task. Pinned sessions, sessions
holding a pinned page, and sessions in use stay. File and S3 archives."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
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
            for sess in SESSIONS:  # pinned while set up, however long that takes here
                await s.pin_session(sess)
            start = time.monotonic()  # no session is touched last before this
            for n, ks in enumerate(keys.values()):
                for i, k in enumerate(ks):
                    await s.put(k, kv_page(10 * n + i))
            await s.pin(keys["pinned-page"][0])
            for sess in ("spilled", "pinned", "pinned-page"):
                await s.spill(sess)  # in the archive only: retention must reach it there
            spilled = {kvfs.checksum(kv_page(i)) for i in range(3)}
            for sess in ("spilled", "local", "busy", "pinned-page"):
                await s.unpin_session(sess)  # an unpin is a touch: retention counts from here
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
        looked = time.time()  # the pass's cutoff, taken before this put
        s.put(k, kv_page(1))
        eng = s.engine
        eng.flush_atimes()
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


async def _objects(s: kvfs.Store, prefix: str) -> list[str]:
    return await s.engine.policy.store.list_all(prefix)  # type: ignore[attr-defined, no-any-return]


async def _spilled_read_back_and_beaten(s: kvfs.Store, k: PageKey, page: bytes) -> None:
    """``page`` put as ``k``, spilled, read back (local again, and still archived), and the
    store's heartbeat written."""
    await s.put(k, page)
    await s.spill(k.session)
    assert await s.get(k) == page
    with trio.fail_after(30):
        while not await _objects(s, "hosts/"):
            await trio.sleep(0.05)


async def _retired_by_hand(s: kvfs.Store) -> None:
    """What a host retiring ``s`` does to it, in that order: its heartbeat goes, then its
    (unpinned) manifests."""
    store = s.engine.policy.store  # type: ignore[attr-defined]
    for key in await _objects(s, "hosts/") + await _objects(s, "manifests/"):
        await store.delete(key)


def _hashes(blob_keys: list[str]) -> set[bytes]:
    return {bytes.fromhex(k.rsplit("/", 1)[1]) for k in blob_keys}


def test_a_host_silent_for_good_is_retired_but_its_pins_stay(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B spills and goes away for good. Once B has been silent for twice its retention
    (plus two heartbeats), host A deletes B's manifests, except a pinned session's, and
    collects the objects only they named; content A's own manifest names stays."""
    shared = kv_page(50)
    # B's sessions are set up without a background task (so B expires nothing of its own
    # however long that takes here); then B runs once with retention 1.5 s and no spill
    # passes, long enough to write its heartbeat, and goes. A retires it 3.75 s later.
    b_setup = archived_cfg(make_config, archive_url, name="host-b")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=1.5)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    with kvfs.open_store_sync(b_setup) as b_sync:
        b_sync.pin_session("kept")
        for sess, page in (("gone", kv_page(51)), ("kept", kv_page(52)), ("both", shared)):
            b_sync.put(PageKey.semantic(sess, "p", 0), page)
            b_sync.spill(sess)
    only_b = {kvfs.checksum(kv_page(51)), kvfs.checksum(kv_page(52))}

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            assert [k for k in await _objects(a, "manifests/") if "gone" in k]  # B's, still
            # what a collection of B's killed before it finished, and one finished, leave
            gone = next(k for k in await _objects(a, "manifests/") if "gone" in k)
            b_id = gone.rpartition("@")[2]
            intent = msgpack.packb({"v": 1, "store_id": b_id, "hashes": []})  # names nothing
            for leftover in (f"gc/{b_id}-1-dead", f"gc/{b_id}-2-done", f"gc/{b_id}-2-done.done"):
                await a.engine.policy.store.put(leftover, intent)  # type: ignore[attr-defined]
            await a.pin_session("mine")  # A's own retention keeps it
            await a.put(PageKey.semantic("mine", "p", 0), shared)
            await a.spill("mine")
            with trio.fail_after(60):
                while (await a.statistics()).extra["archive"]["hosts_retired"] == 0:
                    await trio.sleep(0.1)
            left = await _objects(a, "manifests/")
            assert not [k for k in left if "gone" in k] and [k for k in left if "kept" in k]
            kept = kvfs.checksum(kv_page(52))  # the pinned session's page
            with trio.fail_after(60):  # collected: what only B's deleted manifests named
                while _hashes(await _objects(a, "blobs/")) & (only_b - {kept}):
                    await trio.sleep(0.1)
            blobs = _hashes(await _objects(a, "blobs/"))
            assert kvfs.checksum(shared) in blobs  # A's manifest names it
            assert blobs & only_b == {kept}
            # B's heartbeat goes although its pinned manifest stays: B, if only cut off,
            # must write its manifests again when back, not trust the ones deleted here
            assert f"hosts/{b_id}" not in await _objects(a, "hosts/")
            assert not [k for k in await _objects(a, "gc/") if b_id in k]  # B's intents went

    trio.run(main)


async def _retired_marker(a: kvfs.Store, host: str) -> dict[str, Any]:
    """``retired/<host>``, once A has written it."""
    store = a.engine.policy.store  # type: ignore[attr-defined]
    with trio.fail_after(60):
        while f"retired/{host}" not in await _objects(a, "retired/"):
            await trio.sleep(0.05)
    return msgpack.unpackb(await store.get(f"retired/{host}"), raw=False)  # type: ignore[no-any-return]


def test_a_retired_hosts_manifests_go_once_their_pins_end_and_their_objects_are_collected(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B goes for good with two sessions pinned for a while: the pin of ``early`` ends
    before A retires B, that of a page of ``late`` after. Retirement kept both manifests
    and never read them again: their sessions and objects stayed in the bucket for ever.
    Now ``early`` goes with the retirement, and ``late`` at a look of A's once its pin has
    ended; A collects their objects, and B's marker goes with the last of them."""
    # B's silence limit is 2 x 0.8 s + 2 x 0.2 s; late's pin (15 s) outlasts it by far,
    # also on a loaded machine (its retirement takes 3-4 s on an idle one), and then ends
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=0.8)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    early, late = PageKey.semantic("early", "p", 0), PageKey.semantic("late", "p", 0)
    only_b = {kvfs.checksum(kv_page(91)), kvfs.checksum(kv_page(92)), kvfs.checksum(kv_page(93))}

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:  # (no spill or retention pass of its own)
            b_id = b.engine.store_id  # type: ignore[attr-defined]
            await b.put(early, kv_page(91))
            await b.put(late, kv_page(92))
            await b.put(PageKey.semantic("late", "p", 1), kv_page(93))  # (not pinned)
            await b.pin_session("early", ttl=0.5)
            await b.pin(late, ttl=15)
            for sess in ("early", "late"):
                await b.spill(sess)
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            marker = await _retired_marker(a, b_id)
            (kept,) = [k for k in await _objects(a, "manifests/") if k.endswith("@" + b_id)]
            assert "late" in kept  # early's pin had ended: early went with the retirement
            part = kept[len("manifests/") :].rpartition("@")[0]
            assert marker["sessions"] == [part] and list(marker["ends"]) == [part]
            with trio.fail_after(60):  # late's pin ends, and a look of A's then deletes it
                while f"retired/{b_id}" in await _objects(a, "retired/"):
                    await trio.sleep(0.1)
            assert not [k for k in await _objects(a, "manifests/") if k.endswith("@" + b_id)]
            assert await a.archived_sessions() == []
            with trio.fail_after(60):  # collected: what only B's manifests named
                while _hashes(await _objects(a, "blobs/")) & only_b:
                    await trio.sleep(0.1)

    trio.run(main)


def test_a_retired_hosts_manifest_stays_while_a_pin_of_it_holds(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B goes for good with a session pinned for an hour, a page pinned for an hour
    (in a session whose other page is not pinned) and a session pinned for good. A retires
    B and looks at what stays again and again: all three stay whole, with their objects,
    and B's marker records when the two pins with an end end."""
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=0.8)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    keys = {s: PageKey.semantic(s, "p", 0) for s in ("hour", "page", "good")}
    loose = PageKey.semantic("page", "p", 1)
    pages = {k: kv_page(94 + i) for i, k in enumerate([*keys.values(), loose])}

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            b_id = b.engine.store_id  # type: ignore[attr-defined]
            for k, page in pages.items():
                await b.put(k, page)
            await b.pin_session("hour", ttl=3600)
            await b.pin(keys["page"], ttl=3600)
            await b.pin_session("good")
            ends = {
                "hour": (await b.session_info("hour")).pin_until,
                "page": (await b.stat(keys["page"])).pin_until,
            }
            for sess in keys:
                await b.spill(sess)
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            await _retired_marker(a, b_id)
            store = a.engine.policy.store  # type: ignore[attr-defined]
            with trio.fail_after(60):  # A looked at what stays twice more
                while msgpack.unpackb(await store.get(f"retired/{b_id}")).get("checks", 0) < 2:
                    await trio.sleep(0.1)
            marker = msgpack.unpackb(await store.get(f"retired/{b_id}"), raw=False)
            assert len(marker["sessions"]) == 3
            assert sorted(marker["ends"].values()) == sorted(ends.values())
            left = [k for k in await _objects(a, "manifests/") if k.endswith("@" + b_id)]
            assert len(left) == 3
            assert {s["session"] for s in await a.archived_sessions()} == set(keys)
            assert {kvfs.checksum(p) for p in pages.values()} <= _hashes(
                await _objects(a, "blobs/")
            )

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-v")) as v:
        for sess in keys:
            v.restore(sess)
        for k, page in pages.items():
            assert v.get(k) == page


def test_a_manifest_a_retired_host_writes_before_its_heartbeat_stays(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B, retired, comes back and writes a manifest of an unpinned session before its
    first heartbeat. A's later looks at what B left deleted it (no pin in force: taken for
    one whose pins had ended), where before pins had ends every manifest with pages
    stayed. Only those the retirement kept for their pins go when the pins end."""
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=0.8)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            b_id = b.engine.store_id  # type: ignore[attr-defined]
            store = b.engine.policy.store  # type: ignore[attr-defined]
            await b.put(PageKey.semantic("hour", "p", 0), kv_page(81))
            await b.pin_session("hour", ttl=3600)  # (B's marker stays for it)
            await b.put(PageKey.semantic("fresh", "p", 0), kv_page(82))
            for sess in ("hour", "fresh"):
                await b.spill(sess)
            (fresh,) = [k for k in await _objects(b, "manifests/") if "fresh" in k]
            written = await store.get(fresh)
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            await _retired_marker(a, b_id)
            assert fresh not in await _objects(a, "manifests/")  # retired with B
            archive = a.engine.policy.store  # type: ignore[attr-defined]
            await archive.put(fresh, written)  # B, back, writes it again before it beats
            with trio.fail_after(60):  # A looked at what B left twice more
                while msgpack.unpackb(await archive.get(f"retired/{b_id}")).get("checks", 0) < 2:
                    await trio.sleep(0.1)
            assert fresh in await _objects(a, "manifests/")

    trio.run(main)


def _x_w_and_a(
    make_config: Callable[..., kvfs.StoreConfig], archive_url: str
) -> tuple[kvfs.StoreConfig, ...]:
    """Configurations of host X (keeps its sessions), host W (a first run's, then one that
    beats and goes for good) and host A (retires a host silent for a second)."""
    return (
        archived_cfg(make_config, archive_url, name="host-x"),
        archived_cfg(make_config, archive_url, name="host-w"),
        archived_cfg(make_config, archive_url, name="host-w", interval=60, retention=1.5),
        archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1),
    )


def _w_goes_and_a_retires_it(
    w_cfg: kvfs.StoreConfig,
    a_cfg: kvfs.StoreConfig,
    then: Callable[[kvfs.Store], Awaitable[None]],
) -> None:
    """Run W until its heartbeat is in the archive, then A until it has retired W, and
    ``await then(a)`` in A."""

    async def main() -> None:
        async with kvfs.open_store(w_cfg) as w:  # W's heartbeat, then W goes for good
            with trio.fail_after(30):
                while not await _objects(w, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            with trio.fail_after(60):
                while (await a.statistics()).extra["archive"]["hosts_retired"] == 0:
                    await trio.sleep(0.1)
            await then(a)

    trio.run(main)


@pytest.mark.parametrize("layout", ["per-host", "single"])
def test_a_session_a_retired_host_deleted_stays_deleted(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    layout: str,
) -> None:
    """Host W took session u over from host X (restored it) and deleted it: W's manifest,
    without pages, supersedes X's. Retiring W deleted that manifest with the others, and X's
    came back: u listed again, and restored on any host. The same with X's manifest in the
    layout before per-host manifests (``manifests/<session>``, one per session): the
    retirement looked for what W's tombstone supersedes only under per-host keys."""
    from kvfs._manifest import legacy_manifest_key, manifest_key

    x_cfg, w_setup, w_cfg, a_cfg = _x_w_and_a(make_config, archive_url)
    with kvfs.open_store_sync(x_cfg) as x:
        x.put(PageKey.semantic("u", "p", 0), kv_page(70))
        x.spill("u")
        if layout == "single":
            policy = x.engine.policy  # type: ignore[attr-defined]
            store, new = policy.store, manifest_key("sessions/u", x.engine.store_id)
            policy.call(store.put, legacy_manifest_key("sessions/u"), policy.call(store.get, new))
            policy.call(store.delete, new)
    with kvfs.open_store_sync(w_setup) as w:
        w.restore("u")
        w.delete_session("u")
        assert w.archived_sessions() == []

    async def listed(a: kvfs.Store) -> None:
        assert await a.archived_sessions() == []

    _w_goes_and_a_retires_it(w_cfg, a_cfg, listed)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-v")) as v:
        assert v.archived_sessions() == []
        with pytest.raises(kvfs.SessionNotFound):
            v.restore("u")


def test_a_session_another_host_restored_and_let_expire_stays_listed(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host A spills session s and keeps it (no retention). Host B restores s (B's manifest
    now supersedes A's) and leaves it untouched: B's retention deletes it there. B kept its
    manifest as a tombstone that still superseded A's, so s vanished from every host's
    listing while A held it: a fresh host (or A rebuilt from the archive) could not restore
    it. B's retention speaks for B's copy only: s is listed from A's manifest again."""
    from kvfs._manifest import manifest_key

    k = PageKey.semantic("s", "p", 0)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        a.put(k, kv_page(75))
        a.spill("s")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=0.05, retention=1.5)

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            await b.restore("s")
            mine = manifest_key("sessions/s", b.engine.store_id)  # type: ignore[attr-defined]
            assert mine in await _objects(b, "manifests/")  # superseding A's
            with trio.fail_after(60):  # expired, and its manifest rewrite done
                while (st := (await b.statistics()).extra["archive"])[
                    "sessions_expired"
                ] == 0 or st["spill_queue"]:
                    await trio.sleep(0.1)
            assert await b.sessions() == []
            assert mine not in await _objects(b, "manifests/")
            assert [x["session"] for x in await b.archived_sessions()] == ["s"]

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("s")
        assert c.get(k) == kv_page(75)


def test_a_session_a_retired_host_had_restored_stays_listed(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host W restored session u from host X (W's manifest supersedes X's) and went away
    for good. Retiring W replaced W's manifest by a tombstone still superseding X's, and u
    vanished from every host's listing while X held it. A retirement does what W's own
    retention would have done: it deletes W's manifest, and u is listed from X's."""
    x_cfg, w_setup, w_cfg, a_cfg = _x_w_and_a(make_config, archive_url)
    k = PageKey.semantic("u", "p", 0)
    with kvfs.open_store_sync(x_cfg) as x:
        x.put(k, kv_page(71))
        x.spill("u")
    with kvfs.open_store_sync(w_setup) as w:
        w.restore("u")
        w_id = w.engine.store_id

    async def listed(a: kvfs.Store) -> None:
        assert not [m for m in await _objects(a, "manifests/") if m.endswith("@" + w_id)]
        assert [x["session"] for x in await a.archived_sessions()] == ["u"]

    _w_goes_and_a_retires_it(w_cfg, a_cfg, listed)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-v")) as v:
        v.restore("u")
        assert v.get(k) == kv_page(71)


def test_a_host_that_keeps_beating_is_never_retired(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B is alive, its spilled session in use; host A watches for more than B's
    silence limit and deletes none of B's manifests."""
    # B's limit is 2 x 3 s + 2 x 0.75 s: a heartbeat may take seconds on a loaded machine
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=0.05, retention=3)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    k = PageKey.semantic("live", "p", 0)

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b, kvfs.open_store(a_cfg) as a:
            await b.put(k, kv_page(60))
            await b.spill("live")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 8:  # past B's limit
                assert await b.get(k) == kv_page(60)  # B in use: its retention keeps it
                await trio.sleep(0.1)
            assert [m for m in await _objects(a, "manifests/") if "live" in m]
            assert (await a.statistics()).extra["archive"]["hosts_retired"] == 0

    trio.run(main)


def test_a_host_taken_for_gone_writes_its_manifests_again(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """What another host does to one it takes for gone (cut off from the archive for twice
    its retention) is delete its unpinned manifests and its heartbeat. The host, back,
    finds its heartbeat missing and writes its manifests again."""
    cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=2)
    k = PageKey.semantic("s", "p", 0)

    async def main() -> None:
        async with kvfs.open_store(cfg) as a:
            await _spilled_read_back_and_beaten(a, k, kv_page(70))
            await _retired_by_hand(a)
            with trio.fail_after(30):
                while not await _objects(a, "manifests/"):
                    assert await a.get(k) == kv_page(70)  # in use: its retention keeps it
                    await trio.sleep(0.05)
            assert await _objects(a, "hosts/")

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        assert "s" in {x["session"] for x in b.archived_sessions()}
        b.restore("s")
        assert b.get(k) == kv_page(70)


def test_kvfs_hosts_lists_who_shares_the_archive(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    run: Callable[..., tuple[int, str, str]],
) -> None:
    """Heartbeats and manifests name the hosts: a retention host (retired if silent), a
    keep-everything host (never), and a host that only a script ever used (no heartbeat)."""
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=60)
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=0.05)
    c_cfg = archived_cfg(make_config, archive_url, name="host-c")
    with kvfs.open_store_sync(c_cfg) as c:
        c.put(PageKey.semantic("c", "p", 0), kv_page(80))
        c.spill("c")
        c_id = c.engine.store_id

    async def main() -> list[dict[str, object]]:
        async with kvfs.open_store(a_cfg) as a, kvfs.open_store(b_cfg) as b:
            await a.put(PageKey.semantic("a", "p", 0), kv_page(81))
            await a.spill("a")
            with trio.fail_after(30):
                while len(await _objects(a, "hosts/")) < 2:
                    await trio.sleep(0.05)
            ids = a.engine.store_id, b.engine.store_id
            return [h for h in await a.archive_hosts() if h["store_id"] in ids]

    ha, hb = trio.run(main)
    if ha["this"] is False:
        ha, hb = hb, ha
    assert ha["this"] and ha["sessions"] == 1 and ha["retention_s"] == 60.0
    assert ha["heartbeat_s"] == 15.0
    assert ha["retire_at"] == ha["last_heartbeat"] + 2 * 60 + 2 * 15  # type: ignore[operator]
    assert not hb["this"] and hb["sessions"] == 0 and hb["retention_s"] == 0.0
    assert hb["retire_at"] is None
    assert ha["state"] == hb["state"] == "live"
    archive = ["--archive", archive_url]
    rc, out, _ = run("hosts", "--json", "--data", ",".join(map(str, a_cfg.data_dirs)), *archive)
    assert rc == 0
    rows = {h["store_id"]: h for h in json.loads(out)}
    assert rows[c_id]["sessions"] == 1 and rows[c_id]["last_heartbeat"] is None
    assert len(rows) == 3
    rc, out, _ = run("hosts", "--data", ",".join(map(str, a_cfg.data_dirs)), *archive)
    assert rc == 0 and "RETIRED" in out and "never" in out and "if silent" in out
    assert rows[c_id]["state"] == "no-heartbeat" and rows[c_id]["retention_s"] is None


def test_heartbeats_with_the_endpoint_down_are_retried_and_reads_go_on(
    make_config: Callable[..., kvfs.StoreConfig],
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
) -> None:
    """The archive unreachable: each failed heartbeat is counted as an archive error and
    tried again at the next one; the store serves its local pages meanwhile; once the
    endpoint answers, the heartbeat is written."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={proxy.endpoint}&deadline=1&connect_timeout=0.5"
    cfg = make_config(
        ndev=1, archive_url=url, extra={"archive": {"interval": 0.05, "retention": 2}}
    )
    k = PageKey.semantic("s", "p", 0)

    async def main() -> None:
        async with kvfs.open_store(cfg) as s:  # (opening checks the bucket: up then)
            await s.put(k, kv_page(95))
            with trio.fail_after(30):
                while not await _objects(s, "hosts/"):
                    await trio.sleep(0.05)
            store = s.engine.policy.store  # type: ignore[attr-defined]
            for key in await _objects(s, "hosts/"):
                await store.delete(key)  # so its coming back shows the retry worked
            proxy.down()
            with trio.fail_after(60):
                while (await s.statistics()).extra["archive"]["errors"] < 2:
                    assert await s.get(k) == kv_page(95)
                    await trio.sleep(0.1)
            proxy.up()
            with trio.fail_after(60):
                while not await _objects(s, "hosts/"):
                    await trio.sleep(0.1)

    trio.run(main)


def test_a_first_heartbeat_rewrites_nothing(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A store that spilled without a background task (a script) and then runs as a daemon
    writes its first heartbeat; that is no sign another host retired it, so none of its
    manifests is written again (only a heartbeat this store wrote before, gone, is)."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        s.put(PageKey.semantic("s", "p", 0), kv_page(97))
        s.spill("s")

    async def main() -> None:
        cfg = archived_cfg(make_config, archive_url, interval=0.05, retention=3600)
        async with kvfs.open_store(cfg) as s:
            with trio.fail_after(30):
                while not await _objects(s, "hosts/"):
                    await trio.sleep(0.05)
            await trio.sleep(0.3)  # a few spill passes
            st = (await s.statistics()).extra["archive"]
            assert st["spill_queue"] == 0 and st["manifests_written"] == 0

    trio.run(main)


def test_a_host_cut_off_and_retired_keeps_its_pages_when_back(
    make_config: Callable[..., kvfs.StoreConfig],
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
) -> None:
    """Host B, cut off from the archive, is retired by host A: A deletes the manifest of B's
    unpinned session s and collects its object, and keeps B's pinned session's manifest.
    B was only cut off and kept s in use; back, it must not trust what it wrote before:
    its next eviction of s writes s's manifest again (and re-uploads the page), so other
    hosts list s and no collection takes its object. (With its heartbeat kept beside the
    pinned manifest, B found it and went on as before: the eviction left s's only copy in
    an object no manifest named.)"""
    bucket = s3_server.new_bucket()
    b_url = f"s3://{bucket}?endpoint={proxy.endpoint}&deadline=1&connect_timeout=0.5"
    a_url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    b_cfg = make_config(
        ndev=1,
        name="host-b",
        archive_url=b_url,
        extra={"archive": {"interval": 60, "retention": 2}},
    )
    a_cfg = archived_cfg(make_config, a_url, name="host-a", interval=0.05, retention=1)
    ks, kp = PageKey.semantic("s", "p", 0), PageKey.semantic("pinned", "p", 0)

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            await b.pin_session("pinned")
            await b.put(kp, kv_page(97))
            await b.put(ks, kv_page(96))
            await b.spill("pinned")
            await b.spill("s")
            assert await b.get(ks) == kv_page(96)  # local again, and archived
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
            proxy.down()
            async with kvfs.open_store(a_cfg) as a:
                with trio.fail_after(60):
                    while (await a.statistics()).extra["archive"]["hosts_retired"] == 0:
                        assert await b.get(ks) == kv_page(96)  # in use on B meanwhile
                        await trio.sleep(0.1)
                gone = {kvfs.checksum(kv_page(96))}
                with trio.fail_after(60):  # A collected s's object
                    while _hashes(await _objects(a, "blobs/")) & gone:
                        assert await b.get(ks) == kv_page(96)
                        await trio.sleep(0.1)
                assert [k for k in await _objects(a, "manifests/") if "pinned" in k]
            proxy.up()
            with trio.fail_after(60):
                await b.evict(session="s")
            assert (await b.stat(ks)).tier == "archive"
            # named again in the archive: listed by other hosts, and never collected
            assert [k for k in await _objects(b, "manifests/") if k.startswith(S_MANIFEST)]
            assert await b.get(ks) == kv_page(96)

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, a_url, name="host-c")) as c:
        assert "s" in {x["session"] for x in c.archived_sessions()}
        c.restore("s")
        assert c.get(ks) == kv_page(96)


S_MANIFEST = "manifests/sessions%2Fs@"


def test_a_host_retired_just_after_it_beat_writes_its_manifests_before_a_drop(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Another host retires this one on the heartbeat before its last (the decision and the
    deletions race the beat): the heartbeat goes first, then the manifests. This host, not
    overdue, trusted its manifests until its next beat (an hour with a long retention): an
    eviction then dropped a page's last local copy, named by no manifest, for the other
    host's collection to delete. It now looks at its heartbeat before any drop."""
    cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=3600)
    k = PageKey.semantic("s", "p", 0)

    async def main() -> None:
        async with kvfs.open_store(cfg) as b:
            await _spilled_read_back_and_beaten(b, k, kv_page(71))
            await _retired_by_hand(b)
            await b.evict(session="s")
            assert (await b.stat(k)).tier == "archive"
            assert await _objects(b, "manifests/")  # written again before the drop
            assert await _objects(b, "hosts/")
            assert await b.get(k) == kv_page(71)

    trio.run(main)


def test_a_host_that_beats_while_judged_silent_is_left_alone(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host A read B's old heartbeat and judged B gone; B beat right then. A deleted B's
    manifests all the same (and B, its heartbeat just written, trusted them). A now deletes
    nothing unless the heartbeat is still the one it judged."""
    b_setup = archived_cfg(make_config, archive_url, name="host-b")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=1.5)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    with kvfs.open_store_sync(b_setup) as b_sync:
        b_sync.put(PageKey.semantic("s", "p", 0), kv_page(72))
        b_sync.spill("s")

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            b_id = b.engine.store_id
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
        async with kvfs.open_store(a_cfg) as a:
            hosts = a.engine.policy.spiller.hosts  # type: ignore[attr-defined]
            judged = hosts._heartbeat
            beat: list[float] = []

            async def and_then_b_beats(host: str) -> object:
                seen = await judged(host)
                if host == b_id and seen is not None and not beat:
                    retention, interval, at = seen
                    if await hosts.store.modified(hosts.key) - at > 2 * retention + 2 * interval:
                        body = await hosts.store.get(f"hosts/{b_id}")
                        await hosts.store.put(f"hosts/{b_id}", body)  # B is back
                        beat.append(trio.current_time())
                return seen

            hosts._heartbeat = and_then_b_beats
            with trio.fail_after(60):
                while not beat:
                    await trio.sleep(0.05)
            await trio.sleep(0.5)  # (several of A's passes)
            assert [k for k in await _objects(a, "manifests/") if b_id in k]
            assert f"hosts/{b_id}" in await _objects(a, "hosts/")
            assert (await a.statistics()).extra["archive"]["hosts_retired"] == 0

    trio.run(main)


def test_a_host_back_while_being_retired_keeps_the_manifest_it_wrote(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host A retires B; B comes back while A reads B's manifest (B beats and writes that
    manifest again, as a host finding its heartbeat gone does). A looked at B's heartbeat
    before the read, found it missing, and deleted the manifest B had just written and
    trusted: B's pages were named by no manifest, their objects queued for A's collection.
    A looks again once it has read a manifest, and leaves B alone."""
    b_setup = archived_cfg(make_config, archive_url, name="host-b")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=1.5)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    with kvfs.open_store_sync(b_setup) as b_sync:
        b_sync.put(PageKey.semantic("s", "p", 0), kv_page(73))
        b_sync.spill("s")

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            b_id = b.engine.store_id  # type: ignore[attr-defined]
            with trio.fail_after(30):
                while not await _objects(b, "hosts/"):
                    await trio.sleep(0.05)
            (b_manifest,) = [k for k in await _objects(b, "manifests/") if b_id in k]
        async with kvfs.open_store(a_cfg) as a:
            store = a.engine.policy.store  # type: ignore[attr-defined]
            real = store.get
            back: list[bytes] = []

            async def and_b_comes_back(key: str, *args: object, **kw: object) -> object:
                if key == b_manifest and not back:
                    # B, back (with a long retention now): it beats, then writes again
                    body = await real(key)
                    beat = {"v": 1, "retention": 3600.0, "interval": 900.0, "tombstones": []}
                    await store.put(f"hosts/{b_id}", msgpack.packb(beat))
                    await store.put(key, body)
                    back.append(body)
                return await real(key, *args, **kw)

            store.get = and_b_comes_back
            with trio.fail_after(60):
                while not back or f"hosts/{b_id}.retiring" in await _objects(a, "hosts/"):
                    await trio.sleep(0.05)
            assert b_manifest in await _objects(a, "manifests/")
            assert f"hosts/{b_id}" in await _objects(a, "hosts/")
            assert not await _objects(a, "retired/")
            assert (await a.statistics()).extra["archive"]["hosts_retired"] == 0

    trio.run(main)
