"""The four front doors of the object API (``Store``, ``SyncStore``, ``RemoteStore``,
``SyncRemoteStore``) offer the same methods with the same parameters, so code written
against one runs against another; the differences are the few listed here, on purpose."""

from __future__ import annotations

import inspect
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

DOORS: dict[str, type] = {
    "Store": kvfs.Store,
    "SyncStore": kvfs.SyncStore,
    "RemoteStore": kvfs.RemoteStore,
    "SyncRemoteStore": kvfs.SyncRemoteStore,
}
IN_PROCESS, CLIENTS = {"Store", "SyncStore"}, {"RemoteStore", "SyncRemoteStore"}
ASYNC, SYNC = {"Store", "RemoteStore"}, {"SyncStore", "SyncRemoteStore"}

#: The public names that only some doors have, on purpose (docs/api.md says so too). Any
#: other name one door has and another lacks fails the test: add it to every door, or
#: here with the reason.
ONLY_ON: dict[str, tuple[set[str], str]] = {
    "engine": (IN_PROCESS, "the synchronous core itself: a client has none in its process"),
    "config": (IN_PROCESS, "the StoreConfig opened; a client knows its socket (see identity)"),
    "aclose": (ASYNC, "closing, by trio's name, on the async doors"),
    "close": (SYNC, "closing, on the blocking doors"),
    "ping": (CLIENTS, "whether the daemon answers: in-process there is no daemon"),
    "identity": (CLIENTS, "which store the daemon serves (its lock file, data dirs, pid)"),
    "fsck_progress": ({"SyncRemoteStore"}, "fsck(progress=)'s older name, kept for callers"),
}

#: Methods whose parameters differ on purpose, by door.
OWN_PARAMETERS: dict[tuple[str, str], str] = {
    # the blocking client bounds its ping on a connection of its own; on trio a cancel
    # scope (trio.move_on_after) bounds any call
    ("ping", "SyncRemoteStore"): "timeout",
}
# Not differences of the surface, so not listed: the clients' begin_write raises
# NotImplementedError (a page is streamed into the daemon's store by put), and their
# get(into=buf) copies the answer into buf (host buffers only).


def public_names(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def parameters(cls: type, name: str) -> object:
    """What a caller writes: each parameter's name, kind and default (not its annotation:
    the clients annotate their results ``Any``), or "property"."""
    if isinstance(inspect.getattr_static(cls, name), property):
        return "property"
    sig = inspect.signature(getattr(cls, name))
    return [(p.name, p.kind.name, p.default) for p in list(sig.parameters.values())[1:]]


def test_every_front_door_has_the_same_methods_with_the_same_parameters() -> None:
    """A method added to one door and forgotten in another (read_page on the sync doors
    only), a keyword on one only (fsck's progress= on SyncRemoteStore, as fsck_progress),
    keywords hidden behind ``**kw`` (SyncStore.put and list, the sync put_many) or a
    blocking method on an async door fails here."""
    names = set().union(*(public_names(c) for c in DOORS.values()))
    wrong = []
    for name in sorted(names):
        have = {d for d, c in DOORS.items() if name in public_names(c)}
        expected = ONLY_ON.get(name, (set(DOORS), ""))[0]
        if have != expected:
            wrong.append(f"{name}: on {sorted(have)}, expected on {sorted(expected)}")
            continue
        seen = {
            d: parameters(DOORS[d], name) for d in sorted(have) if (name, d) not in OWN_PARAMETERS
        }
        if len({repr(p) for p in seen.values()}) > 1:
            wrong.append(f"{name}: " + "; ".join(f"{d}{p}" for d, p in seen.items()))
        for d in have:
            # Store's methods are coroutines, the blocking doors' plain calls. (RemoteStore's
            # shared with SyncRemoteStore return their awaitable _call: its own are checked.)
            fn = getattr(DOORS[d], name)
            own = d != "RemoteStore" or name in vars(kvfs.RemoteStore)
            if callable(fn) and own and inspect.iscoroutinefunction(fn) != (d in ASYNC):
                wrong.append(f"{d}.{name}: {'not ' * (d in ASYNC)}a coroutine function")
    assert not wrong, "\n".join(wrong)
    assert len(names) > 30  # (a listing that found nothing compares nothing)


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
