"""A Hypothesis state machine: two kvfs hosts sharing one archive, against a dict model.

Host A owns session ``a`` and host B session ``b``; both draw their pages from the same four
contents, so the archive holds one object for a content both hosts spilled (dedup across
hosts). Each host puts, replaces, deletes, spills, evicts, restores and restarts, in any
interleaving, and may lose its local disks (a host rebuilt from the archive alone). After
every step each host's own pages read back as the model says, archive-only pages included:
one host deleting or replacing its page never takes away an object the other host's pages
still need. A third, empty host that restores a session the owner has not changed since its
last spill sees exactly the owner's pages. At the end no object is orphaned and every
manifest names only objects that exist.

Then what ``kvfs hosts`` says of the hosts sharing an archive: a retired host as retired
(not as one that never beat), one back from retirement as live, and only sessions that hold
pages counted (not tombstones).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from _archive_dir import named, objects
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvfs
from kvfs import PageKey
from tests.test_archive import archive_url, archived_cfg, fill, kv_page  # noqa: F401 - fixture

HOSTS = ("A", "B")
SESSION = {"A": "a", "B": "b"}
CONTENTS = [bytes([i]) * (5000 + 3000 * i) for i in range(4)]
hosts = st.sampled_from(HOSTS)
layers = st.integers(0, 2)
contents = st.integers(0, 3)


class SharedArchive(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvfs-hosts-"))
        self.archive = self.root / "archive"
        self.cfg: dict[str, kvfs.StoreConfig] = {}
        self.store: dict[str, kvfs.SyncStore] = {}
        self.model: dict[str, dict[PageKey, bytes]] = {h: {} for h in HOSTS}
        #: per host: its session as of its last spill, or None once changed since
        self.spilled: dict[str, dict[PageKey, bytes] | None] = {h: None for h in HOSTS}
        self.lost = 0
        for h in HOSTS:
            self._open(h)

    def _config(self, name: str) -> kvfs.StoreConfig:
        return kvfs.StoreConfig(
            data_dirs=(self.root / name / "d0", self.root / name / "d1"),
            stripe_unit=8192,
            archive_url=f"file://{self.archive}",
            durable=False,
            extra={"archive": {"interval": 0, "upload_processes": 0}},
        )

    def _open(self, h: str) -> None:
        self.cfg[h] = self._config(f"{h}{self.lost}")
        self.store[h] = kvfs.SyncStore(kvfs.Engine(self.cfg[h]))

    def _key(self, h: str, layer: int) -> PageKey:
        return PageKey.semantic(SESSION[h], "p", layer)

    @rule(h=hosts, layer=layers, c=contents)
    def put(self, h: str, layer: int, c: int) -> None:
        k = self._key(h, layer)
        self.store[h].put(k, CONTENTS[c], replace=True)
        self.model[h][k] = CONTENTS[c]
        self.spilled[h] = None

    @rule(h=hosts, layer=layers)
    def delete(self, h: str, layer: int) -> None:
        k = self._key(h, layer)
        if k in self.model[h]:
            self.store[h].delete(k)
            del self.model[h][k]
            self.spilled[h] = None

    @rule(h=hosts)
    def spill(self, h: str) -> None:
        if self.model[h]:
            self.store[h].spill(SESSION[h])
            self.spilled[h] = dict(self.model[h])

    @rule(h=hosts)
    def evict(self, h: str) -> None:
        if self.model[h]:
            self.store[h].evict(session=SESSION[h])

    @rule(h=hosts)
    def restore(self, h: str) -> None:
        if self.model[h]:
            self.store[h].restore(SESSION[h])

    @rule(h=hosts)
    def restart(self, h: str) -> None:
        self.store[h].close()
        self.store[h] = kvfs.SyncStore(kvfs.Engine(self.cfg[h]))  # the same directories

    @rule(h=hosts)
    def lose_local_disks(self, h: str) -> None:
        """The host is rebuilt with empty disks: its session comes back from the archive,
        as it was at its last spill (or is gone, never spilled)."""
        self.store[h].close()
        self.lost += 1
        self._open(h)
        got = self.spilled[h]
        if got is None:
            # changed since its last spill (or never spilled): what comes back is not defined
            # by this model; start the session over
            with contextlib.suppress(kvfs.SessionNotFound):
                self.store[h].restore(SESSION[h])
            for info in self.store[h].list(path_prefix=f"sessions/{SESSION[h]}/"):
                self.store[h].delete(info.path)
            self.model[h] = {}
        else:
            self.store[h].restore(SESSION[h])
            self.model[h] = dict(got)

    @rule(h=hosts)
    def third_host_restores(self, h: str) -> None:
        """An empty host restores the session of ``h``, unchanged since its last spill."""
        got = self.spilled[h]
        if got is None:
            return
        self.lost += 1
        with kvfs.open_store_sync(self._config(f"C{self.lost}")) as c:
            c.restore(SESSION[h])
            listed = {i.path for i in c.list(path_prefix=f"sessions/{SESSION[h]}/")}
            assert listed == {k.path for k in got}
            for k, v in got.items():
                assert c.get(k) == v
            sid = c.engine.store_id
        # The third host is gone for good, and so is the manifest its restore wrote: kept, it
        # made that host a holder of the session, whose pages stay in the session's union
        # when the owner deletes them, and come back on the owner's next restore (as
        # docs/archive.md says; test_pages_a_host_imported_survive_the_owners_delete). This
        # model follows only A and B.
        for m in (self.archive / "manifests").rglob(f"*@{sid}"):
            m.unlink()

    @invariant()
    def pages_match_model(self) -> None:
        for h in HOSTS:
            listed = {i.path for i in self.store[h].list(path_prefix="sessions/")}
            assert listed == {k.path for k in self.model[h]}, h
            for k, v in self.model[h].items():
                assert self.store[h].get(k) == v, (h, k)

    def teardown(self) -> None:
        try:
            for s in self.store.values():
                s.close()  # writes queued manifests and deletes what nothing names
            stored, listed = objects(self.archive), named(self.archive)
            assert listed <= stored, f"manifests name missing objects: {listed - stored}"
            assert stored <= listed, f"orphan objects: {stored - listed}"
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


SharedArchive.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_two_hosts_share_an_archive = SharedArchive.TestCase


# -- kvfs hosts: what it says of each host --------------------------------------------------


async def _listed(s: kvfs.Store, prefix: str) -> list[str]:
    return await s.engine.policy.store.list_all(prefix)  # type: ignore[attr-defined, no-any-return]


async def _beaten(s: kvfs.Store) -> None:
    with trio.fail_after(30):
        while f"hosts/{s.engine.store_id}" not in await _listed(s, "hosts/"):  # type: ignore[attr-defined]
            await trio.sleep(0.05)


def _rows(out: str) -> tuple[list[str], list[str]]:
    """The table's lines, and its columns' names."""
    lines = out.rstrip("\n").split("\n")
    return lines, lines[0].split()


def _cells(lines: list[str], row: str) -> dict[str, str]:
    """One row of the table by its store id, cut at the header's column starts: the columns
    line up (every cell starts where its header does)."""
    header, rule = lines[0], lines[1]
    starts = [i for i in range(len(rule)) if rule[i] == "-" and (i == 0 or rule[i - 1] == " ")]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    (line,) = [ln for ln in lines[2:] if ln.startswith(row)]
    cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    for a in starts[1:]:
        assert line[a - 2 : a] == "  " or not line[a - 2 : a].strip(), (line, a)
    return dict(zip(names, cells, strict=True))


def test_kvfs_hosts_says_a_retired_host_was_retired_and_when(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    run: Callable[..., tuple[int, str, str]],
) -> None:
    """Host B (a pinned session, an unpinned one, and a tombstone: a session it took over
    from host X and deleted) goes away and host A retires it. B's pinned manifest and its
    tombstone stay, its heartbeat goes: ``kvfs hosts`` says B was retired, when and by whom,
    with the retention and last heartbeat it had, and counts one session (the tombstone
    holds no pages); X, which never beat, says no-heartbeat. Table and --json."""
    x_cfg = archived_cfg(make_config, archive_url, name="host-x")
    b_setup = archived_cfg(make_config, archive_url, name="host-b")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=1.5)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    with kvfs.open_store_sync(x_cfg) as x:
        x.put(PageKey.semantic("u", "p", 0), kv_page(70))
        x.spill("u")
        x_id = x.engine.store_id
    with kvfs.open_store_sync(b_setup) as b_sync:
        b_id = b_sync.engine.store_id
        b_sync.restore("u")
        b_sync.delete_session("u")  # B's manifest of u: a tombstone superseding X's
        b_sync.pin_session("kept")
        for sess, page in (("gone", kv_page(71)), ("kept", kv_page(72))):
            b_sync.put(PageKey.semantic(sess, "p", 0), page)
            b_sync.spill(sess)

    async def main() -> tuple[str, list[dict[str, object]]]:
        async with kvfs.open_store(b_cfg) as b:  # B's heartbeat, then B goes for good
            await _beaten(b)
            (me,) = [h for h in await b.archive_hosts() if h["this"]]
            assert me["state"] == "live" and me["sessions"] == 2  # gone, kept; not u
            assert me["retired_at"] is None and me["retire_at"] is not None
        async with kvfs.open_store(a_cfg) as a:
            with trio.fail_after(60):
                while (await a.statistics()).extra["archive"]["hosts_retired"] == 0:
                    await trio.sleep(0.1)
            assert f"retired/{b_id}" in await _listed(a, "retired/")
            left = [k for k in await _listed(a, "manifests/") if k.endswith("@" + b_id)]
            assert len(left) == 2  # kept (pinned), u (the tombstone)
            return a.engine.store_id, await a.archive_hosts()  # type: ignore[attr-defined]

    a_id, hosts = trio.run(main)
    rows = {h["store_id"]: h for h in hosts}
    b = rows[b_id]
    assert b["state"] == "retired" and b["sessions"] == 1 and b["retired_by"] == a_id
    assert b["retention_s"] == 1.5 and b["heartbeat_s"] == 0.375
    assert isinstance(b["last_heartbeat"], float) and isinstance(b["retired_at"], float)
    assert b["last_heartbeat"] + 2 * 1.5 + 2 * 0.375 < b["retired_at"] < time.time() + 5
    assert b["retire_at"] is None
    assert rows[x_id]["state"] == "no-heartbeat" and rows[x_id]["sessions"] == 1
    assert rows[x_id]["retention_s"] is None and rows[x_id]["retired_at"] is None
    assert rows[a_id]["state"] == "silent" or rows[a_id]["state"] == "live"
    flags = ["--data", ",".join(map(str, a_cfg.data_dirs)), "--archive", archive_url]
    rc, out, _ = run("hosts", "--json", *flags)
    assert rc == 0
    cli = {h["store_id"]: h for h in json.loads(out)}
    assert cli[b_id]["state"] == "retired" and cli[b_id]["retired_by"] == a_id
    assert cli[a_id]["this"] and cli[a_id]["sessions"] == 0
    rc, out, _ = run("hosts", *flags)
    assert rc == 0
    lines, names = _rows(out)
    assert names == ["STORE", "THIS", "STATE", "SESSIONS", "RETENTION", "HEARTBEAT", "RETIRED"]
    rb, rx = _cells(lines, b_id), _cells(lines, x_id)
    assert rb["STATE"] == "retired" and rb["SESSIONS"] == "1" and rb["RETENTION"] == "1.5s"
    assert rb["RETIRED"].endswith("ago") and rb["HEARTBEAT"].endswith("ago")
    assert rx == {
        "STORE": x_id,
        "THIS": "",
        "STATE": "no-heartbeat",
        "SESSIONS": "1",
        "RETENTION": "-",
        "HEARTBEAT": "-",
        "RETIRED": "never",
    }
    assert _cells(lines, a_id)["THIS"] == "yes"


def test_a_retired_host_that_comes_back_is_live_and_writes_again(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Host B is retired (its pinned session stays, and the marker saying it was retired).
    B starts again on the same disks: it finds its heartbeat gone, writes its manifests again,
    deletes the marker and beats; it spills a new session; every host lists B live, with
    its sessions, and B's pages restore elsewhere."""
    b_setup = archived_cfg(make_config, archive_url, name="host-b")
    b_cfg = archived_cfg(make_config, archive_url, name="host-b", interval=60, retention=1.5)
    b_back = archived_cfg(make_config, archive_url, name="host-b", interval=0.05, retention=3600)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    kept, new = PageKey.semantic("kept", "p", 0), PageKey.semantic("new", "p", 0)
    with kvfs.open_store_sync(b_setup) as b_sync:
        b_id = b_sync.engine.store_id
        b_sync.pin_session("kept")
        b_sync.put(kept, kv_page(73))
        b_sync.spill("kept")

    def state(hosts: list[dict[str, object]]) -> dict[str, object]:
        (row,) = [h for h in hosts if h["store_id"] == b_id]
        return row

    async def main() -> None:
        async with kvfs.open_store(b_cfg) as b:
            await _beaten(b)
        async with kvfs.open_store(a_cfg) as a:
            with trio.fail_after(60):
                while f"retired/{b_id}" not in await _listed(a, "retired/"):
                    await trio.sleep(0.1)
            row = state(await a.archive_hosts())
            assert row["state"] == "retired" and row["sessions"] == 1
            async with kvfs.open_store(b_back) as b:  # back
                await _beaten(b)
                # B deleted its marker before it beat; a look of A's at the marker that
                # began before can write it again just after, and the next pass (A's or
                # B's) deletes it, the heartbeat beside it (kvfs/_hosts.py)
                with trio.fail_after(30):
                    while f"retired/{b_id}" in await _listed(b, "retired/"):
                        await trio.sleep(0.05)
                await b.put(new, kv_page(75))
                await b.spill("new")
                row = state(await a.archive_hosts())
                assert row["state"] == "live" and row["retired_at"] is None
                assert row["retention_s"] == 3600.0 and row["retire_at"] is not None
                assert row["sessions"] == 2  # kept (written again), new
                assert await b.get(kept) == kv_page(73)
            await trio.sleep(0.5)  # A's passes: B beat within its limit, nothing retired
            assert state(await a.archive_hosts())["state"] == "live"

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        assert {"kept", "new"} <= {s["session"] for s in c.archived_sessions()}
        c.restore("new")
        assert c.get(new) == kv_page(75)


def test_kvfs_hosts_counts_only_sessions_holding_pages(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    run: Callable[..., tuple[int, str, str]],
) -> None:
    """Host W took sessions u and v over from host X and deleted u: W's manifest of u is a
    tombstone (no pages). W, live, lists it in its heartbeat, and every host counts W's one
    session holding pages, v; W's own count (no daemon: from its index) agrees."""
    x_cfg = archived_cfg(make_config, archive_url, name="host-x")
    w_cfg = archived_cfg(make_config, archive_url, name="host-w", interval=0.05, retention=3600)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05)
    with kvfs.open_store_sync(x_cfg) as x:
        for sess in ("u", "v"):
            x.put(PageKey.semantic(sess, "p", 0), kv_page(ord(sess)))
            x.spill(sess)
    with kvfs.open_store_sync(w_cfg) as w:
        w_id = w.engine.store_id
        for sess in ("u", "v"):
            w.restore(sess)
        w.delete_session("u")
        w.spill("v")

    async def main() -> dict[str, object]:
        async with kvfs.open_store(w_cfg) as w, kvfs.open_store(a_cfg) as a:
            await _beaten(w)
            assert len([k for k in await _listed(a, "manifests/") if k.endswith("@" + w_id)]) == 2
            (row,) = [h for h in await a.archive_hosts() if h["store_id"] == w_id]
            return row

    row = trio.run(main)
    assert row["state"] == "live" and row["sessions"] == 1 and not row["this"]
    rc, out, _ = run(
        "hosts", "--json", "--data", ",".join(map(str, w_cfg.data_dirs)), "--archive", archive_url
    )
    assert rc == 0
    (me,) = [h for h in json.loads(out) if h["this"]]
    assert me["store_id"] == w_id and me["sessions"] == 1


def test_a_heartbeat_names_a_bounded_number_of_tombstones_and_counts_the_rest(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host keeps every tombstone it made, and its heartbeat, written every interval,
    listed them all: it grew without bound. It names at most TOMBSTONE_BYTES of them
    (lowered here to fit one) and counts the rest, and the others still count only W's
    one session holding pages."""
    import kvfs._hosts

    monkeypatch.setattr(kvfs._hosts, "TOMBSTONE_BYTES", 20, raising=False)
    x_cfg = archived_cfg(make_config, archive_url, name="host-x")
    w_cfg = archived_cfg(make_config, archive_url, name="host-w", interval=0.05, retention=3600)
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05)
    with kvfs.open_store_sync(x_cfg) as x:
        for sess in ("t", "u", "v"):
            x.put(PageKey.semantic(sess, "p", 0), kv_page(ord(sess)))
            x.spill(sess)
    with kvfs.open_store_sync(w_cfg) as w:
        w_id = w.engine.store_id
        for sess in ("t", "u", "v"):
            w.restore(sess)
        w.delete_session("t")
        w.delete_session("u")
        w.spill("v")

    async def main() -> tuple[dict[str, Any], dict[str, object]]:
        async with kvfs.open_store(w_cfg) as w, kvfs.open_store(a_cfg) as a:
            await _beaten(w)
            archive = a.engine.policy.store  # type: ignore[attr-defined]
            beat = msgpack.unpackb(await archive.get(f"hosts/{w_id}"), raw=False)
            (row,) = [h for h in await a.archive_hosts() if h["store_id"] == w_id]
            return beat, row

    beat, row = trio.run(main)
    assert len(beat["tombstones"]) == 1 and beat["tombstone_count"] == 2
    assert row["state"] == "live" and row["sessions"] == 1


def test_a_heartbeat_outranks_a_retired_marker_and_a_retirement_under_way_shows(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A ``retired/`` marker left beside a heartbeat (the host came back while another was
    finishing its retirement) does not make it retired: the heartbeat outranks it. A host
    another one is retiring (``.retiring``, here empty, as kvfs before the markers wrote
    it) shows as retiring, what it had not known."""
    cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=3600)

    async def main() -> dict[str, dict[str, object]]:
        async with kvfs.open_store(cfg) as a:
            await _beaten(a)
            store = a.engine.policy.store  # type: ignore[attr-defined]
            me = a.engine.store_id  # type: ignore[attr-defined]
            await store.put(f"retired/{me}", msgpack.packb({"v": 1, "at": 1.0, "sessions": []}))
            await store.put("hosts/gone.retiring", b"")
            # Retired, its .retiring not yet deleted (the retiring host's next request):
            # listed as still retiring, which a test waiting for the marker then saw.
            await store.put("retired/done", msgpack.packb({"v": 1, "at": 1.0, "sessions": []}))
            await store.put("hosts/done.retiring", b"")
            return {h["store_id"]: h for h in await a.archive_hosts()}  # type: ignore[misc]

    rows = trio.run(main)
    (me,) = [h for h in rows.values() if h["this"]]
    assert me["state"] == "live" and me["retired_at"] is None and me["retention_s"] == 3600.0
    gone = rows["gone"]
    assert gone["state"] == "retiring" and gone["retention_s"] is None
    assert gone["retired_at"] is None and gone["sessions"] == 0
    assert rows["done"]["state"] == "retired" and rows["done"]["retired_at"] == 1.0


# -- what stays of a retired host: tidied once nothing needs it -------------------------------


def test_a_retired_hosts_tombstones_and_marker_go_once_they_supersede_nothing(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """Hosts B and C each took session u over from host X and deleted it: their manifests of
    u are tombstones superseding X's. C also holds a pinned session. Both go and host A
    retires them: the tombstones stay while X's manifest does (u stays deleted, however
    often A looks), and so do the markers. Once X deletes u, A deletes both tombstones
    (they hide nothing any more) and B's marker (nothing of B is left); C's pinned session
    and its marker stay. Before, every such host's marker and tombstones stayed for ever."""
    x_cfg = archived_cfg(make_config, archive_url, name="host-x")  # keeps its sessions
    a_cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)
    u = PageKey.semantic("u", "p", 0)
    with kvfs.open_store_sync(x_cfg) as x:
        x.put(u, kv_page(80))
        x.spill("u")
    ids = {}
    for name in ("host-b", "host-c"):  # both take u over while X's is its only version
        with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name=name)) as h:
            ids[name] = h.engine.store_id
            h.restore("u")
    for name in ("host-b", "host-c"):
        with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name=name)) as h:
            h.delete_session("u")  # its manifest of u: a tombstone superseding X's
            if name == "host-c":
                h.pin_session("kept")
                h.put(PageKey.semantic("kept", "p", 0), kv_page(81))
                h.spill("kept")
    b_id, c_id = ids["host-b"], ids["host-c"]

    async def marker(a: kvfs.Store, host: str) -> dict[str, Any]:
        raw = await a.engine.policy.store.get(f"retired/{host}")  # type: ignore[attr-defined]
        return msgpack.unpackb(raw, raw=False)  # type: ignore[no-any-return]

    async def left(a: kvfs.Store, host: str) -> list[str]:
        return sorted(k for k in await _listed(a, "manifests/") if k.endswith("@" + host))

    def x_deletes_u() -> None:
        with kvfs.open_store_sync(x_cfg) as x:
            x.delete_session("u")

    async def main() -> None:
        for name in ("host-b", "host-c"):  # a heartbeat each, then gone for good
            cfg = archived_cfg(make_config, archive_url, name=name, interval=60, retention=1.5)
            async with kvfs.open_store(cfg) as h:
                await _beaten(h)
        async with kvfs.open_store(a_cfg) as a:
            with trio.fail_after(60):
                while len(await _listed(a, "retired/")) < 2:
                    await trio.sleep(0.1)
            retired = {h: (await marker(a, h))["at"] for h in (b_id, c_id)}
            with trio.fail_after(60):  # A looked at both again, twice, X's u still there
                while min([(await marker(a, h)).get("checks", 0) for h in (b_id, c_id)]) < 2:
                    await trio.sleep(0.1)
            assert len(await left(a, b_id)) == 1 and len(await left(a, c_id)) == 2
            assert [s["session"] for s in await a.archived_sessions()] == ["kept"]
            await trio.to_thread.run_sync(x_deletes_u)  # nothing left to hide
            with trio.fail_after(60):
                while await left(a, b_id) or len(await left(a, c_id)) > 1:
                    await trio.sleep(0.1)
                while f"retired/{b_id}" in await _listed(a, "retired/"):
                    await trio.sleep(0.1)
            (kept,) = await left(a, c_id)
            assert "kept" in kept
            c = await marker(a, c_id)
            assert c["at"] == retired[c_id] and c["sessions"] == [
                kept[len("manifests/") :].rpartition("@")[0]
            ]
            rows = {h["store_id"]: h for h in await a.archive_hosts()}
            assert b_id not in rows
            assert rows[c_id]["state"] == "retired" and rows[c_id]["sessions"] == 1

    trio.run(main)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-v")) as v:
        assert [s["session"] for s in v.archived_sessions()] == ["kept"]
        with pytest.raises(kvfs.SessionNotFound):
            v.restore("u")


def test_a_retired_marker_left_beside_a_heartbeat_is_deleted(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A race can leave ``retired/<id>`` beside that host's heartbeat (the retiring host
    writes it just after the host, back, deleted it). The next pass that finds both
    deletes the marker: it no longer stayed until the host was retired again."""
    cfg = archived_cfg(make_config, archive_url, name="host-a", interval=0.05, retention=1)

    async def main() -> None:
        async with kvfs.open_store(cfg) as a:
            await _beaten(a)
            store = a.engine.policy.store  # type: ignore[attr-defined]
            me = a.engine.store_id  # type: ignore[attr-defined]
            await store.put(f"retired/{me}", msgpack.packb({"v": 1, "at": 1.0, "sessions": []}))
            with trio.fail_after(60):
                while f"retired/{me}" in await _listed(a, "retired/"):
                    await trio.sleep(0.1)
            assert f"hosts/{me}" in await _listed(a, "hosts/")

    trio.run(main)


# -- listing sessions other hosts hold -----------------------------------------------------


def test_a_long_named_session_with_an_unreadable_manifest_is_left_out_of_the_listing(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A session one of whose manifests cannot be read is not listed (its restore raises
    CorruptPage: that manifest may name pages the others lack), whatever its name's length.
    A long name's manifest key holds only part of it and a hash (session_key_part), and the
    session an unreadable manifest belonged to was taken from its key as if it were whole:
    it matched no session, and the session was listed from the other host's manifest."""
    from kvfs._manifest import manifest_key

    long = "agent-" + "é" * 120 + "-" + "x" * 8
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        fill(a, long, 1)
        a.spill(long)
        policy = a.engine.policy  # type: ignore[attr-defined]
        bad = manifest_key(f"sessions/{long}", a.engine.store_id)
        assert bad in policy.call(policy.store.list_all, "manifests/")  # (the key cut short)
        policy.call(policy.store.put, bad, b"\xc1 not msgpack")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        fill(b, long, 1, seed=2)
        b.spill(long)
        assert b.archived_sessions() == []
        with pytest.raises(kvfs.CorruptPage, match="unreadable"):
            b.restore(long)


def test_a_manifest_from_a_newer_kvfs_is_refused_saying_so(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A host sharing the bucket that runs a newer kvfs may write manifests of a later
    version: this kvfs cannot read them and refuses the session, saying that the manifest is
    newer and this kvfs must be upgraded (it said "not a version-1 kvfs manifest", as for
    any damage)."""
    from kvfs._manifest import manifest_key, pack_manifest

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        fill(a, "s", 1)
        a.spill("s")
        policy = a.engine.policy  # type: ignore[attr-defined]
        key = manifest_key("sessions/s", a.engine.store_id)
        m = msgpack.unpackb(policy.call(policy.store.get, key), raw=False)
        policy.call(policy.store.put, key, pack_manifest({**m, "v": 2}))
    b_cfg = archived_cfg(make_config, archive_url, name="host-b")
    with kvfs.open_store_sync(b_cfg) as b, pytest.raises(kvfs.CorruptPage, match="newer kvfs"):
        b.restore("s")


def test_a_warning_for_an_unreadable_manifest_says_why(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The listing leaves a session with an unreadable manifest out, and a collection
    deletes nothing while one cannot be read; each says so in a warning naming the key. The
    warning did not say why (parse_manifest's error was dropped): a digest that no longer
    matches, a newer kvfs and bytes that are not msgpack read alike."""
    from kvfs._manifest import manifest_key, pack_manifest

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        fill(a, "bad", 1)
        fill(a, "other", 2, seed=1)
        a.spill("bad")
        a.spill("other")
        policy = a.engine.policy  # type: ignore[attr-defined]
        key = manifest_key("sessions/bad", a.engine.store_id)
        m = msgpack.unpackb(policy.call(policy.store.get, key), raw=False)
        policy.call(policy.store.put, key, pack_manifest({**m, "v": 2}))
        with caplog.at_level("WARNING", logger="kvfs"):
            assert [x["session"] for x in a.archived_sessions()] == ["other"]
            listing = caplog.text
            caplog.clear()
            a.delete(PageKey.semantic("other", "p0", 0))  # its object: to collect
        assert "not listed" in listing and "written by a newer kvfs" in listing
        assert "nothing deleted this pass" in caplog.text
        assert "written by a newer kvfs" in caplog.text
