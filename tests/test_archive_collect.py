"""Deleting archive objects while other hosts share the bucket (kvfs/_collect.py).

Host A deletes its last reference to some content and collects the object once no manifest
names it; host B, at the same moment, evicts its own copy of that content. These tests hold
A's object deletions at a gate (the real store underneath), so the interleaving that lost
B's page before the collection intents existed happens every time. File and S3 archives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import kvfs
from kvfs import PageKey
from tests.test_archive import archive_url, archived_cfg, kv_page  # noqa: F401 - fixture

__all__ = ["archive_url"]


def gate_blob_deletes(s: kvfs.SyncStore) -> tuple[threading.Event, threading.Event]:
    """Make ``s``'s deletions of blob objects wait for the returned ``gate``; ``reached`` is
    set when the first one is about to go (A has read the manifests and found none naming
    it)."""
    import trio

    gate, reached = threading.Event(), threading.Event()
    store = s.engine.policy.store  # type: ignore[attr-defined]
    real = store.delete

    async def gated(key: str) -> None:
        if key.startswith("blobs/"):
            reached.set()
            await trio.to_thread.run_sync(gate.wait)
        await real(key)

    store.delete = gated
    return gate, reached


def gate_manifest_puts(s: kvfs.SyncStore) -> tuple[threading.Event, threading.Event]:
    """Make ``s``'s first manifest write wait for the returned ``gate``; ``reached`` is set
    when it is about to go (the manifest is built from the index, not stored yet)."""
    import trio

    gate, reached = threading.Event(), threading.Event()
    store = s.engine.policy.store  # type: ignore[attr-defined]
    real = store.put

    async def gated(key: str, *args: object, **kw: object) -> object:
        if key.startswith("manifests/") and not reached.is_set():
            reached.set()
            await trio.to_thread.run_sync(gate.wait)
        return await real(key, *args, **kw)

    store.put = gated
    return gate, reached


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def test_an_eviction_racing_another_hosts_collection_keeps_the_page(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A reads every manifest (none names the content) and is about to delete its object
    when B writes a manifest naming it and drops its local copy. Before the intents, B's
    check that the object exists came before A's delete and B's page was lost."""
    same = kv_page(7)
    ka, kb = PageKey.semantic("a", "p", 0), PageKey.semantic("b", "p", 0)
    with (
        kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a,
        kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b,
    ):
        a.put(ka, same)
        a.spill("a")  # the object exists, and only A's manifest names it
        b.put(kb, same)
        gate, reached = gate_blob_deletes(a)
        collecting, a_errors = in_thread(lambda: a.delete(ka))  # A's last reference
        assert reached.wait(30), "A never got to deleting the object"
        evicting, b_errors = in_thread(lambda: b.evict(session="b"))
        # B must come to wait for A's collection, however long B takes to get there (a
        # fixed sleep here failed once on a loaded machine: B reached its check after it).
        deadline = time.monotonic() + 30
        while evicting.is_alive() and time.monotonic() < deadline:
            if b.statistics().extra["archive"]["collection_waits"]:
                break
            time.sleep(0.02)
        b_waited = evicting.is_alive()
        gate.set()
        collecting.join(30)
        evicting.join(30)
        assert not a_errors and not b_errors, (a_errors, b_errors)
        assert b_waited, "B dropped its copy while A's collection of the content was under way"
        assert b.stat(kb).tier == "archive"  # the local copy is gone ...
        assert b.get(kb) == same  # ... and the archive still has the page
        assert b.statistics().extra["archive"]["collection_waits"] >= 1


def test_an_unfinished_collection_of_a_dead_host_delays_others_once(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A host killed mid-collection leaves its intent behind, unfinished. Another host
    waits for it at most ``gc_window`` seconds from first seeing it (by then the dead host
    would have stopped deleting), removes it, and keeps the page. The dead host, restarted,
    finishes its own leftovers."""
    same = kv_page(8)
    ka, kb = PageKey.semantic("a", "p", 0), PageKey.semantic("b", "p", 0)
    window = 1.5
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", gc_window=window)
    with kvfs.open_store_sync(a_cfg) as a:
        a.put(ka, same)
        a.spill("a")
        policy = a.engine.policy  # type: ignore[attr-defined]
        # What a SIGKILL between announcing and finishing leaves: the intent alone.
        policy.call(policy.spiller.collector.announce, [bytes.fromhex(a.stat(ka).checksum)])
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", gc_window=window)
    with kvfs.open_store_sync(b_cfg) as b:
        b.put(kb, same)
        t0 = time.monotonic()
        b.evict(session="b")
        took = time.monotonic() - t0
        assert took >= window, f"B did not wait for the unfinished collection ({took:.2f} s)"
        assert b.get(kb) == same
        st = b.statistics().extra["archive"]
        assert st["collection_waits"] == 1 and st["collections_presumed_dead"] == 1
        b.put(PageKey.semantic("b", "p", 1), same)
        b.evict(session="b")
        st = b.statistics().extra["archive"]
        assert st["collection_waits"] == 1, "the dead collection was waited for twice"
        intents = b.engine.policy.call(b.engine.policy.store.list_all, "gc/")  # type: ignore[attr-defined]
        assert intents == []


def test_an_intent_not_read_for_an_outage_is_read_again_not_taken_for_damage(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
    caplog,  # noqa: ANN001
) -> None:
    """Host A's collection is under way, naming content B does not hold. B's read of A's
    intent fails for the endpoint (ArchiveUnavailable once the store's deadline has
    passed): it was taken for a damaged intent, logged as "unreadable" and kept for as long
    as it was listed as naming every blob, so B waited for it, and every eviction after
    did too until it was gone. Now B's eviction fails as for any outage, nothing dropped,
    and the next one reads the intent and goes on without waiting."""
    import pytest
    import trio

    window = 3.0
    kb = PageKey.semantic("b", "p", 0)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", gc_window=window)
    with kvfs.open_store_sync(a_cfg) as a:
        policy = a.engine.policy  # type: ignore[attr-defined]
        # A's collection, under way: its intent, not finished yet
        policy.call(policy.spiller.collector.announce, [kvfs.checksum(kv_page(70))])
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", gc_window=window)
    with kvfs.open_store_sync(b_cfg) as b:
        b.put(kb, kv_page(71))
        store = b.engine.policy.store  # type: ignore[attr-defined]
        real, failed = store.get, []

        async def once_down(key: str, **kw: object) -> object:
            if key.startswith("gc/") and not failed:
                failed.append(key)
                await trio.sleep(0)
                raise kvfs.ArchiveUnavailable(f"cannot reach the archive for {key}")
            return await real(key, **kw)

        store.get = once_down
        with caplog.at_level("WARNING", logger="kvfs"), pytest.raises(kvfs.ArchiveUnavailable):
            b.evict(session="b")
        assert failed and b.stat(kb).tier == "local+archive"  # nothing dropped
        b.evict(session="b")
        assert b.stat(kb).tier == "archive"
        assert b.statistics().extra["archive"]["collection_waits"] == 0
        assert "unreadable" not in caplog.text
        assert b.get(kb) == kv_page(71)


def test_a_restarted_host_finishes_the_collection_its_crash_left(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """Only one process owns a store, so its own unfinished intent from before a restart can
    delete nothing any more: finished at once, never waited for."""
    same = kv_page(9)
    k = PageKey.semantic("a", "p", 0)
    cfg = archived_cfg(make_config, archive_url, name="host-a", gc_window=60)
    with kvfs.open_store_sync(cfg) as a:
        a.put(k, same)
        a.spill("a")
        policy = a.engine.policy  # type: ignore[attr-defined]
        left = policy.call(policy.spiller.collector.announce, [bytes.fromhex(a.stat(k).checksum)])
    with kvfs.open_store_sync(cfg) as a:
        a.restore("a")
        t0 = time.monotonic()
        a.evict(session="a")
        assert time.monotonic() - t0 < 30, "waited for its own dead collection"
        policy = a.engine.policy  # type: ignore[attr-defined]
        assert policy.call(policy.store.exists, left + ".done")
        assert a.statistics().extra["archive"]["collection_waits"] == 0
        assert a.get(k) == same


def test_finished_intents_linger_for_the_window_then_go(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A finished intent stays listed for ``gc_window`` (a host whose operation began before
    the collection finished still sees it), then the next collection removes it."""
    window = 0.5
    with kvfs.open_store_sync(
        archived_cfg(make_config, archive_url, name="host-a", gc_window=window)
    ) as a:
        policy = a.engine.policy  # type: ignore[attr-defined]
        for i in range(3):
            a.put(PageKey.semantic("a", "p", i), kv_page(20 + i))
        a.spill("a")
        a.delete(PageKey.semantic("a", "p", 0))  # collects its object
        first = policy.call(policy.store.list_all, "gc/")
        assert len(first) == 2 and first[1] == first[0] + ".done"
        time.sleep(window * 1.5)
        a.delete(PageKey.semantic("a", "p", 1))
        second = policy.call(policy.store.list_all, "gc/")
        assert len(second) == 2 and not set(first) & set(second)


def test_finished_intents_of_short_lived_processes_go_too(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A host used only by short commands (``kvfs rm``, a script with ``SyncStore``): each
    run's collection left its intent, and the next run counted the window from its own
    start, so no run ever removed one. Every other host's settle lists them all."""
    window = 0.5
    cfg = archived_cfg(make_config, archive_url, name="host-a", gc_window=window)
    with kvfs.open_store_sync(cfg) as a:
        for i in range(3):
            a.put(PageKey.semantic("a", "p", i), kv_page(30 + i))
        a.spill("a")
    runs = []
    for i in range(2):
        with kvfs.open_store_sync(cfg) as a:
            a.delete(PageKey.semantic("a", "p", i))  # collects its object
            policy = a.engine.policy  # type: ignore[attr-defined]
            runs.append(set(policy.call(policy.store.list_all, "gc/")))
        time.sleep(window * 1.5)
    assert len(runs[0]) == 2
    assert len(runs[1]) == 2 and not runs[0] & runs[1]  # the first run's went


def test_a_clock_stepped_between_runs_does_not_age_finished_intents(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
    monkeypatch,  # noqa: ANN001
) -> None:
    """A run's finished intent must stay listed for the window (another host's settle may
    need to see it). Timed by this host's clock, a clock stepped forward between two runs
    (NTP after a resume) made the next run take it for an hour old and remove it at once;
    it is timed by the archive's clock now."""
    import types

    import kvfs._collect as collect

    cfg = archived_cfg(make_config, archive_url, name="host-a", gc_window=60)
    with kvfs.open_store_sync(cfg) as a:
        for i in range(3):
            a.put(PageKey.semantic("a", "p", i), kv_page(40 + i))
        a.spill("a")
    behind = types.SimpleNamespace(
        time=lambda: time.time() - 3600, monotonic=time.monotonic, time_ns=time.time_ns
    )
    monkeypatch.setattr(collect, "time", behind)  # the first run's clock: an hour behind
    with kvfs.open_store_sync(cfg) as a:
        a.delete(PageKey.semantic("a", "p", 0))  # collects its object
        policy = a.engine.policy  # type: ignore[attr-defined]
        first = set(policy.call(policy.store.list_all, "gc/"))
    monkeypatch.undo()
    with kvfs.open_store_sync(cfg) as a:
        a.delete(PageKey.semantic("a", "p", 1))
        policy = a.engine.policy  # type: ignore[attr-defined]
        after = set(policy.call(policy.store.list_all, "gc/"))
    assert len(first) == 2 and first <= after  # the first run's: still there


def test_hosts_writing_the_same_directory_keep_each_others_pages(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """LMCache, vLLM and llm-d on every host write into the same directory of their mount,
    so every host holds a session of the same name. Each writes its own manifest of it:
    before, the last host to write replaced the others' pages in the one manifest, and a
    page evicted on the first host was named nowhere (its object collectable, invisible to
    a host restoring the directory). A third host restores the union."""
    mine = {h: PageKey.from_path(f"lmcache/model@1@{h}@hash.data") for h in ("a", "b")}
    data = {h: kv_page(30 + i) for i, h in enumerate(mine)}
    for h in mine:
        with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name=f"host-{h}")) as s:
            s.put(mine[h], data[h])
            s.evict(session="lmcache/")  # archive-only here: only the manifest names it
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        [listed] = c.archived_sessions()
        assert listed["dir"] == "lmcache" and listed["pages"] == 2 and listed["hosts"] == 2
        c.restore("lmcache/")
        assert {i.path: c.get(PageKey.from_path(i.path)) for i in c.list(session="lmcache/")} == {
            mine[h].path: data[h] for h in mine
        }


def test_a_host_that_took_a_session_over_decides_what_it_holds(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """An agent moves from host A to host B: B restores A's session, deletes one page and
    adds another. B's manifest supersedes the version of A's it imported, so a third host
    restores B's view, without the deleted page; until A writes its manifest again."""
    keys = [PageKey.semantic("agent", "p", i) for i in range(3)]
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        for i, k in enumerate(keys[:2]):
            a.put(k, kv_page(40 + i))
        a.spill("agent")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.restore("agent")
        b.delete(keys[0])
        b.put(keys[2], kv_page(42))
        b.spill("agent")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("agent")
        assert sorted(i.path for i in c.list(session="agent")) == [k.path for k in keys[1:]]
        assert c.get(keys[1]) == kv_page(41) and c.get(keys[2]) == kv_page(42)


def test_a_restore_by_a_host_holding_an_older_page_takes_the_newer_one(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """Hosts A and B put the same path (B later) and spill it. A's restore kept its own
    older page, and A's manifest, superseding B's, then made every other host restore the
    older page too: the page created last must win everywhere, on A as well."""
    k = PageKey.semantic("s3", "p", 0)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a")
    with kvfs.open_store_sync(a_cfg) as a:
        a.put(k, kv_page(60))
        a.spill("s3")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.put(k, kv_page(61))
        b.spill("s3")
    with kvfs.open_store_sync(a_cfg) as a:
        a.restore("s3")
        assert a.get(k) == kv_page(61)
        found = a.fsck()
        assert not (found["missing"] or found["corrupt"] or found["orphans"]), found
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-e")) as e:
        e.restore("s3")
        assert e.get(k) == kv_page(61)


def test_a_manifest_in_the_single_manifest_layout_is_read_and_replaced(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A bucket written before per-host manifests holds ``manifests/<session>``: it is still
    listed and restored, and its own host replaces it with its per-host manifest."""
    from kvfs._manifest import legacy_manifest_key, manifest_key

    k = PageKey.semantic("old", "p", 0)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a")
    with kvfs.open_store_sync(a_cfg) as a:
        a.put(k, kv_page(50))
        a.spill("old")
        policy = a.engine.policy  # type: ignore[attr-defined]
        store, new = policy.store, manifest_key("sessions/old", a.engine.store_id)  # type: ignore[attr-defined]
        policy.call(store.put, legacy_manifest_key("sessions/old"), policy.call(store.get, new))
        policy.call(store.delete, new)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        assert [x["dir"] for x in c.archived_sessions()] == ["sessions/old"]
        c.restore("old")
        assert c.get(k) == kv_page(50)
        c_manifest = manifest_key("sessions/old", c.engine.store_id)  # type: ignore[attr-defined]
    with kvfs.open_store_sync(a_cfg) as a:
        a.put(PageKey.semantic("old", "p", 1), kv_page(51))
        a.spill("old")
        policy = a.engine.policy  # type: ignore[attr-defined]
        # (C's own manifest, written when it imported the session, stays: it holds it too)
        assert policy.call(policy.store.list_all, "manifests/") == sorted([new, c_manifest])


def test_a_session_deleted_by_the_host_that_took_it_over_stays_deleted(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A host rebuilt after losing its disks (a new store id) restores its session from the
    manifest of its former self and deletes the pages. Its manifest, now without pages,
    still supersedes the old one (a tombstone): deleting it would let the old manifest bring
    the pages back. Found by the two-host state machine run longer than CI runs it."""
    from pytest import raises

    k0, k1 = PageKey.semantic("a", "p", 0), PageKey.semantic("a", "p", 1)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="old")) as old:
        old.put(k1, kv_page(60))
        old.evict(session="a")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="new")) as new:
        new.restore("a")
        new.delete(k1)
        new.put(k0, kv_page(60))
        new.restore("a")
        assert [i.path for i in new.list(session="a")] == [k0.path]
        assert new.archived_sessions() == []
    third = archived_cfg(make_config, archive_url, name="third")
    with kvfs.open_store_sync(third) as c, raises(kvfs.SessionNotFound):
        c.restore("a")


def test_a_collection_reads_only_the_manifests_changed_since_the_last(
    make_config,  # noqa: ANN001
    s3_server,  # noqa: ANN001
) -> None:
    """A collection must know every manifest's pages. On S3 the listing gives each
    manifest's ETag, so a manifest unchanged since this host's last collection is not read
    again: one GET for the one manifest a delete rewrote, not one per session."""
    url = f"s3://{s3_server.new_bucket()}/kv?endpoint={s3_server.endpoint}&addressing=path"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        for n in range(6):
            for i in range(2):
                s.put(PageKey.semantic(f"s{n}", "p", i), kv_page(100 * n + i))
            s.spill(f"s{n}")
        store = s.engine.policy.store  # type: ignore[attr-defined]
        real, read = store.get, []

        async def counting(key: str, **kw: object) -> object:
            if key.startswith("manifests/"):
                read.append(key)
            return await real(key, **kw)

        store.get = counting
        s.delete(PageKey.semantic("s0", "p", 0))  # the first collection reads them all
        assert len(read) == 6
        read.clear()
        s.delete(PageKey.semantic("s1", "p", 0))
        assert len(read) == 1 and "s1" in read[0]
        gone = "blobs/" + kvfs.checksum(kv_page(100)).hex()  # s1's deleted page: collected
        assert not s.engine.policy.call(store.exists, gone)  # type: ignore[attr-defined]
        assert s.get(PageKey.semantic("s2", "p", 1)) == kv_page(201)


def test_a_page_its_owner_deletes_while_another_host_imports_it_goes_there_too(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A restores B's session: it reads B's manifest and imports the page, and before A's
    own manifest names it, B deletes the page and collects its object (no manifest named
    it when B read them). A listed the page, and named it in its manifest, for good: every
    read of it failed, on A and on any host restoring the session from A's manifest."""

    k = PageKey.semantic("s", "p", 0)
    with (
        kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a,
        kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b,
    ):
        b.put(k, kv_page(9))
        b.put(PageKey.semantic("s", "p", 1), kv_page(10))  # stays: the session lives on
        b.spill("s")
        gate, reached = gate_manifest_puts(a)
        store = a.engine.policy.store  # type: ignore[attr-defined]
        restoring, errors = in_thread(lambda: a.restore("s"))
        assert reached.wait(30), "A never got to writing its manifest"
        b.delete(k)  # B's last reference: B rewrites its manifest and collects the object
        gone = "blobs/" + kvfs.checksum(kv_page(9)).hex()
        assert not b.engine.policy.call(store.exists, gone)  # type: ignore[attr-defined]
        gate.set()
        restoring.join(30)
        assert not errors, errors
        assert [i.path for i in a.list(session="s")] == ["sessions/s/p/layer-001"]
        assert a.get(PageKey.semantic("s", "p", 1)) == kv_page(10)
    # A host restoring the session from the archive now finds only the page that exists.
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("s")
        assert [i.path for i in c.list(session="s")] == ["sessions/s/p/layer-001"]


class _WatchedLock:
    """A session's manifest lock that says (``contended``) when a caller has to wait for it."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self.contended = contended

    def acquire(self, blocking: bool = True) -> bool:
        got = self._lock.acquire(blocking)
        if not got:
            self.contended.set()
        return got

    def release(self) -> None:
        self._lock.release()


def test_an_eviction_while_a_manifest_is_written_keeps_what_the_new_one_does_not_name(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """A delete rewrites the session's manifest (it no longer names page p); while that
    write is under way, p is put again with the same bytes and evicted. The eviction
    trusted what the previous manifest named (p) until the new one was stored, so it
    dropped p's local copy, and the new manifest, written without p, left it archive-only
    and named by no manifest: a host restoring the session from the archive never saw it
    (and once no other page shared its content, another host's collection deleted it)."""

    same = kv_page(11)
    kp, kq = PageKey.semantic("s", "p", 0), PageKey.semantic("s", "q", 0)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        a.put(kp, same)
        a.put(kq, same)  # the content outlives p's delete
        a.put(PageKey.semantic("s", "r", 0), kv_page(12))
        a.spill("s")
        assert a.get(kq) == same  # local again, and still archived
        policy = a.engine.policy  # type: ignore[attr-defined]
        settled = threading.Event()
        policy.spiller._manifest_locks[a.engine.resolve_session("s")] = _WatchedLock(settled)
        gate, reached = gate_manifest_puts(a)
        deleting, d_errors = in_thread(lambda: a.delete(kp))  # rewrites the manifest
        assert reached.wait(30), "the delete never got to writing the manifest"
        a.put(kp, same)  # shares the local, archived copy again

        def evict() -> None:
            try:
                a.evict(kp)
            finally:
                settled.set()

        # The eviction either finishes, or waits for the manifest being written: either
        # way the write may go on now.
        evicting, e_errors = in_thread(evict)
        assert settled.wait(30), "the eviction neither finished nor waited"
        gate.set()
        deleting.join(30)
        evicting.join(30)
        assert not d_errors and not e_errors, (d_errors, e_errors)
        assert a.stat(kp).tier == "archive"  # the eviction did drop the copy
        assert a.get(kp) == same
    # A host restoring the session from the archive sees every page the host holds.
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("s")
        assert len(c.list(session="s")) == 3
        assert c.get(kp) == same


def gate_intent_listings(s: kvfs.SyncStore) -> tuple[threading.Event, threading.Event]:
    """Make ``s``'s first listing of collection intents (the look an eviction takes once
    its manifests are written, before it drops anything) wait for the returned ``gate``;
    ``reached`` is set when it is about to go."""
    import trio

    gate, reached = threading.Event(), threading.Event()
    store = s.engine.policy.store  # type: ignore[attr-defined]
    real = store.list_all

    async def gated(prefix: str, *args: object, **kw: object) -> object:
        if prefix.startswith("gc/") and not reached.is_set():
            reached.set()
            await trio.to_thread.run_sync(gate.wait)
        return await real(prefix, *args, **kw)

    store.list_all = gated
    return gate, reached


def test_a_page_deleted_and_put_again_while_it_is_evicted_keeps_its_copy(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """An eviction chose an archived page; before it dropped the copy the page was deleted
    and put again with the same bytes: a new blob row, not archived, under a path the
    session's manifest (not rewritten yet: gc_grace holds the delete's follow-up) still
    names. The drop trusted the manifest alone and took the only copy of the new row; the
    manifest rewritten later left the page out, and the collection of the deleted page's
    object took the data: the page read as missing from the archive."""
    same = kv_page(21)
    kp, kq = PageKey.semantic("s", "p", 0), PageKey.semantic("s", "q", 0)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, gc_grace=3600)) as a:
        a.put(kp, same)
        a.put(kq, kv_page(22))
        a.spill("s")
        assert a.get(kp) == same  # local again, and archived
        gate, reached = gate_intent_listings(a)
        evicting, errors = in_thread(lambda: a.evict(kp))
        assert reached.wait(30), "the eviction never got to its check before the drop"
        a.delete(kp)
        a.put(kp, same)  # a new row: the archive does not hold it as far as it knows
        gate.set()
        evicting.join(30)
        assert not errors, errors
        assert a.stat(kp).tier == "local"
    # The delete's follow-up now: the manifest rewritten, the old object collected.
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, gc_grace=0)) as a:
        a.delete(kq)  # (a delete without a background task does the queued work)
        assert a.get(kp) == same
        a.spill("s")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("s")
        assert c.get(kp) == same


def test_a_session_spilled_twice_at_once_is_in_progress_until_both_end(
    make_config,  # noqa: ANN001
    archive_url: str,  # noqa: F811
) -> None:
    """Two spills of one session at once (a background pass and `kvfs spill`): the first to
    end took the session off the spills in progress while the other still ran, so the
    queue length said none and a retention pass could delete it under that spill."""
    import itertools

    import trio

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        s.put(PageKey.semantic("s", "p", 0), kv_page(31))
        spiller = s.engine.policy.spiller  # type: ignore[attr-defined]
        store = s.engine.policy.store  # type: ignore[attr-defined]
        real, manifests = store.put, itertools.count()
        gate, held = threading.Event(), threading.Event()

        async def second_manifest_waits(key: str, *args: object, **kw: object) -> object:
            if key.startswith("manifests/") and next(manifests) == 1:
                held.set()
                await trio.to_thread.run_sync(gate.wait)
            return await real(key, *args, **kw)

        store.put = second_manifest_waits
        spills = [in_thread(lambda: s.spill("s")) for _ in range(2)]
        try:
            assert held.wait(30), "no second manifest was written"
            deadline = time.monotonic() + 30
            while all(t.is_alive() for t, _ in spills):
                assert time.monotonic() < deadline, "the first spill never ended"
                time.sleep(0.01)
            assert "sessions/s" in spiller._active and spiller.queue_length() >= 1
        finally:
            gate.set()
            for t, errors in spills:
                t.join(30)
                assert not errors, errors
        assert not spiller._active
