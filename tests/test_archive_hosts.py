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
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from _archive_dir import named, objects
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvfs
from kvfs import PageKey

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
