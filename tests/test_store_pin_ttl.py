"""Pins with a lifetime (``pin(key, ttl=...)``): kept from eviction until they end, then
released as an unpin releases them (before eviction looks, periodically, and at open); a
pin again replaces the lifetime, an unpin clears it, and it survives a restart."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import kvfs
import kvfs._store
from kvfs._control import control_service
from kvfs._fuse_ns import session_json
from kvfs._remote import open_remote_store

KiB = 1024
ROOT_INODE = 1  # (pyfuse3.ROOT_INODE)
MakeConfig = Callable[..., kvfs.StoreConfig]
Run = Callable[..., tuple[int, str, str]]
PAGE = 64 * KiB


class _Ctx:
    """A FUSE request's context, as the mount's loop passes it."""

    uid, gid, pid, umask = os.getuid(), os.getgid(), os.getpid(), 0o022


CTX = _Ctx()
ROOM = PAGE + 4 * KiB  # a page's bytes on disk, header and alignment included


def _ended(until: float | None) -> None:
    """Wait until the time ``until`` has passed (a pin of a fraction of a second)."""
    assert until is not None
    while time.time() <= until:
        time.sleep(min(0.05, max(0.001, until - time.time() + 0.001)))


def test_a_page_pinned_for_a_while_is_kept_until_its_pin_ends_then_evicted(
    make_config: MakeConfig,
) -> None:
    """A pin had no end: a page an agent pinned before it crashed held its room for good."""
    cfg = make_config(ndev=1, stripe_unit=PAGE, capacity=2 * ROOM)
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/p", os.urandom(PAGE))
        store.put("b/p", os.urandom(PAGE))
        store.pin("a/p", ttl=3600)
        store.pin("b/p", ttl=3600)
        with pytest.raises(kvfs.CapacityExceeded):
            store.put("c/p", os.urandom(PAGE))  # both pins hold: nothing may go
        assert store.exists("a/p") and store.exists("b/p")
        store.pin("b/p", ttl=0.5)  # (pinning again replaces the lifetime)
        _ended(store.stat("b/p").pin_until)
        store.put("c/p", os.urandom(PAGE))  # b's pin has ended: b makes the room
        assert not store.exists("b/p")
        assert store.exists("a/p") and store.stat("a/p").pinned
        assert store.statistics().evictions == {"capacity": 1}


def test_a_session_pinned_for_a_while_is_kept_from_an_evict_until_its_pin_ends(
    make_config: MakeConfig,
) -> None:
    with kvfs.open_store_sync(make_config()) as store:
        store.put(kvfs.PageKey.semantic("s", "p", 0), os.urandom(PAGE))
        store.pin_session("s", ttl=3600)
        assert store.session_info("s").pin_until is not None
        assert store.evict(session="s") == 0
        store.pin_session("s", ttl=0.5)
        _ended(store.session_info("s").pin_until)
        assert store.evict(session="s") > 0  # (no archive: the pages go, the session too)
        assert store.list(path_prefix="sessions/s/") == []


def test_a_pins_lifetime_survives_a_restart_and_one_that_ended_meanwhile_is_released_at_open(
    make_config: MakeConfig,
) -> None:
    cfg = make_config()
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/p", b"a")
        store.put("b/p", b"b")
        store.pin("a/p", ttl=3600)
        store.pin("b/p", ttl=0.5)
        until = store.stat("a/p").pin_until
        ended = store.stat("b/p").pin_until
    _ended(ended)
    with kvfs.open_store_sync(cfg) as store:
        a, b = store.stat("a/p"), store.stat("b/p")
        assert a.pinned and a.pin_until == until
        assert not b.pinned and b.pin_until is None


def test_a_pin_without_a_ttl_makes_a_pin_with_one_for_good_and_the_other_way_round(
    make_config: MakeConfig,
) -> None:
    with kvfs.open_store_sync(make_config()) as store:
        store.put("a/p", b"a")
        store.pin("a/p", ttl=0.5)
        ended = store.stat("a/p").pin_until
        store.pin("a/p")
        assert store.stat("a/p").pin_until is None
        _ended(ended)
        assert store.engine.release_expired_pins() == 0
        assert store.stat("a/p").pinned
        store.pin("a/p", ttl=0.5)  # a lifetime on a pin for good: it ends too
        _ended(store.stat("a/p").pin_until)
        assert store.engine.release_expired_pins() == 1
        assert not store.stat("a/p").pinned


def test_unpin_delete_and_replace_clear_a_pins_lifetime_and_rename_moves_it(
    make_config: MakeConfig,
) -> None:
    """The lifetime of a pin gone must not end a pin made later for good on that name."""
    with kvfs.open_store_sync(make_config()) as store:
        for k in ("a/p", "b/p", "c/p", "d/p"):
            store.put(k, k.encode())
            store.pin(k, ttl=0.5)
        ended = max(store.stat(k).pin_until or 0.0 for k in ("a/p", "b/p", "c/p", "d/p"))
        store.unpin("a/p")
        assert store.stat("a/p").pin_until is None
        store.pin("a/p")
        store.delete("b/p")
        store.put("b/p", b"b", pin=True)
        store.put("c/p", b"c2", pin=True, replace=True)
        store.rename("d/p", "e/p")
        assert store.stat("e/p").pinned and store.stat("e/p").pin_until is not None
        _ended(ended)
        assert store.engine.release_expired_pins() == 1  # e/p's, moved with it
        assert all(store.stat(k).pinned for k in ("a/p", "b/p", "c/p"))
        assert not store.stat("e/p").pinned


def test_a_pin_that_ends_is_an_unpin_in_the_archives_manifest_too(tmp_path: Path) -> None:
    """A pin's end goes the way of an unpin: the session's manifest, which another host's
    retirement of this one trusts, is rewritten unpinned."""
    import msgpack

    archive = tmp_path / "archive"
    cfg = kvfs.StoreConfig(
        data_dirs=(tmp_path / "d",),
        archive_url=f"file://{archive}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )

    def pinned() -> bool:
        (path,) = (archive / "manifests").glob("sessions%2Fa@*")
        return bool(msgpack.unpackb(path.read_bytes(), raw=False)["pinned"])

    with kvfs.open_store_sync(cfg) as st:
        st.put("sessions/a/p/layer-000", b"A" * 6000)
        st.spill("a")
        st.pin_session("a", ttl=0.5)
        pol = st.engine.policy
        pol.call(pol.spiller.flush_pending)  # (the daemon's next background pass)
        assert pinned()
        _ended(st.session_info("a").pin_until)
        assert st.engine.release_expired_pins() == 1
        pol.call(pol.spiller.flush_pending)
        assert not pinned()


def test_the_mounts_session_metadata_says_when_its_pin_ends(make_config: MakeConfig) -> None:
    with kvfs.open_store_sync(make_config()) as store:
        store.put(kvfs.PageKey.semantic("s", "p", 0), b"x")
        store.pin_session("s", ttl=600)
        doc = json.loads(session_json(store.engine, "sessions/s"))
        assert doc["pinned"] and doc["pin_until"] == store.session_info("s").pin_until
        store.pin_session("s")
        assert json.loads(session_json(store.engine, "sessions/s"))["pin_until"] is None


def test_a_pins_lifetime_must_be_a_number_of_seconds_over_zero(make_config: MakeConfig) -> None:
    with kvfs.open_store_sync(make_config()) as store:
        store.put("a/p", b"a")
        for bad in (0, -1, float("nan"), float("inf"), True, "30m"):
            with pytest.raises(ValueError):
                store.pin("a/p", ttl=bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                store.pin_session("a/", ttl=bad)  # type: ignore[arg-type]
        assert not store.stat("a/p").pinned
        with pytest.raises(ValueError):
            store.engine.pin("a/p", False, ttl=10)


async def test_a_running_store_releases_pins_that_ended(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing released a pin but an unpin: ``ls`` showed it pinned for ever."""
    monkeypatch.setattr(kvfs._store, "HOUSEKEEPING_SECONDS", 0.1)
    async with kvfs.open_store(make_config()) as store:
        await store.put("a/p", b"a")
        await store.pin_session("a/", ttl=0.3)
        with trio.fail_after(30):  # (a bound on the wait, not a timing asserted)
            while (await store.session_info("a/")).pinned:
                await trio.sleep(0.05)
        assert (await store.session_info("a/")).pin_until is None


async def test_a_pin_with_a_ttl_through_the_daemon(make_config: MakeConfig, tmp_path: Path) -> None:
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        async with open_remote_store(sock) as r:
            await r.put("sessions/s/p/layer-000", b"x")
            before = time.time()
            await r.pin("sessions/s/p/layer-000", ttl=1800)
            await r.pin_session("s", ttl=60)
            info = await r.stat("sessions/s/p/layer-000")
            assert info.pinned and info.pin_until is not None
            assert before + 1800 <= info.pin_until <= time.time() + 1800
            s = await r.session_info("s")
            assert s.pinned and s.pin_until is not None and s.pin_until <= time.time() + 60
            with pytest.raises(ValueError):
                await r.pin("sessions/s/p/layer-000", ttl=-5)
            await r.pin("sessions/s/p/layer-000")  # for good again
            assert (await r.stat("sessions/s/p/layer-000")).pin_until is None
        n.cancel_scope.cancel()


def test_cli_pin_for_a_duration_and_ls_shows_the_time_left(run: Run, tmp_path: Path) -> None:
    d = ("--data", str(tmp_path / "d"))
    (tmp_path / "f").write_bytes(b"z" * 100)
    assert run("put", "f", "sessions/a/p/layer-000", *d)[0] == 0
    assert run("put", "f", "sessions/b/p/layer-000", *d)[0] == 0
    before = time.time()
    rc, out, _ = run("pin", "--for", "30m", "a", "sessions/b/p/layer-000", *d)
    assert rc == 0
    assert out == "pinned session a (1 page) for 30m\npinned page sessions/b/p/layer-000 for 30m\n"
    (page,) = json.loads(run("ls", "sessions/b/p/layer-000", "--json", *d)[1])
    assert page["pinned"] and before + 1800 <= page["pin_until"] <= time.time() + 1800
    sessions = {s["session"]: s for s in json.loads(run("ls", "--json", *d)[1])}
    assert before + 1800 <= sessions["a"]["pin_until"] <= time.time() + 1800
    assert sessions["b"]["pin_until"] is None and not sessions["b"]["pinned"]
    rc, out, _ = run("ls", "sessions/b/p/layer-000", *d)
    assert rc == 0 and "  30m left  " in out.splitlines()[2]
    rc, out, _ = run("ls", *d)
    rows = {r.split()[0]: r for r in out.splitlines()[2:]}
    assert "  30m left  " in rows["a"] and "left" not in rows["b"]
    assert run("pin", "a", *d)[0] == 0  # for good again
    (s,) = [s for s in json.loads(run("ls", "--json", *d)[1]) if s["session"] == "a"]
    assert s["pinned"] and s["pin_until"] is None
    rc, out, _ = run("pin", "--for", "2h", "a", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["ttl"] == 7200


@pytest.mark.parametrize("bad", ["1x", "0", "-5m", "soon", ""])
def test_cli_pin_for_a_bad_duration_is_a_usage_error(run: Run, tmp_path: Path, bad: str) -> None:
    d = ("--data", str(tmp_path / "d"))
    (tmp_path / "f").write_bytes(b"z")
    assert run("put", "f", "sessions/a/p/layer-000", *d)[0] == 0
    with pytest.raises(SystemExit) as e:
        run("pin", "--for", bad, "a", *d)
    assert e.value.code == 2
    (s,) = json.loads(run("ls", "--json", *d)[1])
    assert not s["pinned"]


def _archived(tmp_path: Path, host: str) -> kvfs.StoreConfig:
    return kvfs.StoreConfig(
        data_dirs=(tmp_path / host,),
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )


def test_another_host_that_imports_a_session_keeps_its_pins_until_they_end(
    tmp_path: Path,
) -> None:
    """The manifest recorded a pin, not its end: a host that died before its pins ended
    left them for good to every host that imported its sessions (and to itself, rebuilt
    from the archive)."""
    import msgpack

    with kvfs.open_store_sync(_archived(tmp_path, "a")) as a:
        for s in ("long", "ended", "good"):
            a.put(f"sessions/{s}/p/layer-000", s.encode() * 100)
            a.put(f"sessions/{s}/p/layer-001", s.encode() * 200)
            a.spill(s)
        a.pin_session("long", ttl=3600)
        a.pin("sessions/long/p/layer-000", ttl=1800)
        a.pin_session("ended", ttl=0.5)
        a.pin("sessions/ended/p/layer-000", ttl=0.5)
        a.pin_session("good")
        a.pin("sessions/good/p/layer-000")
        pol = a.engine.policy
        pol.call(pol.spiller.flush_pending)  # (the daemon's next background pass)
        long_until = a.session_info("long").pin_until
        page_until = a.stat("sessions/long/p/layer-000").pin_until
        ended = a.session_info("ended").pin_until
        (path,) = (tmp_path / "archive" / "manifests").glob("sessions%2Flong@*")
        m = msgpack.unpackb(path.read_bytes(), raw=False)
        assert m["pin_until"] == long_until
        assert [p.get("pin_until") for p in m["pages"]] == [page_until, None]
    _ended(ended)  # (host a is gone before the release it would have made)
    with kvfs.open_store_sync(_archived(tmp_path, "b")) as b:
        for s in ("long", "ended", "good"):
            b.restore(s)
        long, page = b.session_info("long"), b.stat("sessions/long/p/layer-000")
        assert long.pinned and long.pin_until == long_until
        assert page.pinned and page.pin_until == page_until
        assert not b.stat("sessions/long/p/layer-001").pinned
        assert not b.session_info("ended").pinned
        assert not b.stat("sessions/ended/p/layer-000").pinned
        good = b.session_info("good")  # a pin without an end is still one for good
        assert good.pinned and good.pin_until is None
        page = b.stat("sessions/good/p/layer-000")
        assert page.pinned and page.pin_until is None
        assert b.engine.release_expired_pins() == 0


def test_renewing_a_pin_after_a_spill_rewrites_the_end_its_manifest_records(
    tmp_path: Path,
) -> None:
    """A renewal changed only this host's end: another host importing the session took
    the first end, and released a pin still renewed here."""
    import msgpack

    def manifest() -> dict:
        (path,) = (tmp_path / "archive" / "manifests").glob("sessions%2Fa@*")
        return msgpack.unpackb(path.read_bytes(), raw=False)  # type: ignore[no-any-return]

    with kvfs.open_store_sync(_archived(tmp_path, "a")) as a:
        a.put("sessions/a/p/layer-000", b"A" * 6000)
        a.spill("a")
        pol = a.engine.policy
        for ttl in (60, 600):
            a.pin("sessions/a/p/layer-000", ttl=ttl)
            a.pin_session("a", ttl=ttl)
            pol.call(pol.spiller.flush_pending)
            assert manifest()["pin_until"] == a.session_info("a").pin_until
            (p,) = manifest()["pages"]
            assert p["pin_until"] == a.stat("sessions/a/p/layer-000").pin_until
        a.pin("sessions/a/p/layer-000")  # for good now: the end goes
        pol.call(pol.spiller.flush_pending)
        (p,) = manifest()["pages"]
        assert p["pinned"] and "pin_until" not in p


@pytest.mark.parametrize("bad", ["soon", True, None, [1.0]])
def test_a_manifest_whose_pin_end_is_not_a_time_is_unreadable(bad: object) -> None:
    from kvfs._checksum import checksum, leaves_of
    from kvfs._manifest import pack_manifest, parse_manifest

    page = {"path": "sessions/a/p/layer-000", "size": 1, "leaves": leaves_of(b"x")}
    page |= {"hash": checksum(b"x"), "pinned": True}
    m = {"v": 1, "session": "sessions/a", "name": "a", "created": 1.0, "atime": 1.0}
    m |= {"pinned": True, "attrs": {}, "store_id": "x", "spilled_at": 1.0, "pages": [page]}
    assert parse_manifest(pack_manifest({**m, "pin_until": 5.0}))["pin_until"] == 5.0
    with pytest.raises(ValueError, match="pin_until"):
        parse_manifest(pack_manifest({**m, "pin_until": bad}))
    with pytest.raises(ValueError, match="pin_until"):
        parse_manifest(pack_manifest({**m, "pages": [{**page, "pin_until": bad}]}))


async def test_a_pin_that_ended_reads_as_none_before_it_is_released(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Until the next release pass (up to 5 s in a running store) a pin that had ended
    still read as pinned: stat and list said pinned, ls showed ``0s left``, the mount's
    user.kvfs.pinned said 1, and so did an archived session's listing."""
    from kvfs._fuse import KvfsOperations

    monkeypatch.setattr(kvfs._store, "HOUSEKEEPING_SECONDS", 3600.0)  # (no pass meanwhile)
    cfg = make_config(archive_url=f"file://{tmp_path / 'archive'}")
    async with kvfs.open_store(cfg) as store:
        ops = KvfsOperations(store)
        try:
            key = "sessions/s/p/layer-000"
            await store.put(key, b"x" * 100)
            await store.put("sessions/t/p/layer-000", b"y" * 100)
            await store.spill("s")
            await store.pin(key, ttl=0.5)
            await store.pin_session("s", ttl=0.5)
            await store.pin_session("t", ttl=3600)
            pol = store.engine.policy
            await trio.to_thread.run_sync(pol.call, pol.spiller.flush_pending)
            ino = (await ops.lookup(ROOT_INODE, b"sessions", CTX)).st_ino
            for name in (b"s", b"p", b"layer-000"):
                ino = (await ops.lookup(ino, name, CTX)).st_ino
            assert await ops.getxattr(ino, b"user.kvfs.pinned", CTX) == b"1"
            ends = [(await store.session_info("s")).pin_until, (await store.stat(key)).pin_until]
            await trio.to_thread.run_sync(_ended, max(ends))  # type: ignore[type-var]
            info = await store.stat(key)
            assert not info.pinned and info.pin_until is None
            (listed,) = await store.list(session="s")
            assert not listed.pinned and listed.pin_until is None
            s = await store.session_info("s")
            assert not s.pinned and s.pin_until is None
            assert {x.session: x.pinned for x in await store.sessions()} == {"s": False, "t": True}
            assert not json.loads(session_json(store.engine, "sessions/s"))["pinned"]
            assert await ops.getxattr(ino, b"user.kvfs.pinned", CTX) == b"0"
            (archived,) = await store.archived_sessions()
            assert not archived["pinned"] and archived["pin_until"] is None
            # (nothing released yet: the index still holds the pins that ended)
            assert store.engine.index.session("sessions/s").pinned  # type: ignore[union-attr]
        finally:
            await ops.aclose()


def test_the_end_of_a_pin_an_older_kvfs_removed_is_forgotten_at_open(
    make_config: MakeConfig,
) -> None:
    """A kvfs older than pin lifetimes renames, unpins and deletes without clearing their
    ends: after it ran (a downgrade, then an upgrade), a page put pinned for good on the
    path a page pinned for a while had left got that pin's end."""
    import sqlite3

    cfg = make_config()
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/p", b"a")
        store.put("b/p", b"b")
        store.pin("a/p", ttl=3600)
        store.pin("b/p", ttl=3600)
        store.pin_session("s", ttl=3600)
        index = store.engine.index.path
    # what the older kvfs did: rename a/p to z/p, unpin b/p, unpin session s (its SQL)
    db = sqlite3.connect(index)
    with db:
        db.execute("UPDATE pages SET path='z/p', session='z' WHERE path='a/p'")
        db.execute("INSERT INTO sessions VALUES ('z', 0, 0, 0, NULL)")
        db.execute("UPDATE pages SET pinned=0 WHERE path='b/p'")
        db.execute("UPDATE sessions SET pinned=0 WHERE dir='sessions/s'")
    db.close()
    with kvfs.open_store_sync(cfg) as store:
        store.put("a/p", b"a2", pin=True)
        info = store.stat("a/p")
        assert info.pinned and info.pin_until is None  # for good, as it was put
        rows = store.engine.index._q("SELECT target, kind FROM pin_expiry")
        assert rows == []


async def test_a_pins_lifetime_may_be_a_numpy_number_in_process_as_through_the_daemon(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """``pin(key, ttl=np.int64(60))`` (a lifetime computed with numpy) was refused in-process
    as "a pin's ttl is a number of seconds > 0, not np.int64(60)", and pinned through the
    daemon (its client sends a numpy scalar as the number it is)."""
    import numpy as np

    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("a/p", b"a")
        async with open_remote_store(sock) as r:
            for pin in (store.pin, r.pin):
                for ttl in (np.int64(60), np.float32(60)):
                    before = time.time()
                    await pin("a/p", ttl=ttl)  # type: ignore[arg-type]
                    until = (await store.stat("a/p")).pin_until
                    assert until is not None and before + 60 <= until <= time.time() + 60
                    await store.unpin("a/p")
            for pin_session in (store.pin_session, r.pin_session):
                await pin_session("a/", ttl=np.int64(60))  # type: ignore[arg-type]
                assert (await store.session_info("a/")).pin_until is not None
                await store.unpin_session("a/")
        n.cancel_scope.cancel()
