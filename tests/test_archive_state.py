"""A Hypothesis state machine: the tiered store (local + file:// archive) against a dict model,
with random puts (shared contents: dedup), deletes, renames, spills, evictions, restores and
restarts. After every step every page reads back as the model says; at the end the archive
holds no object nothing references and every manifest names only objects that exist."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from _archive_dir import named, objects
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvfs
from kvfs import PageKey

SESSIONS = ["a", "b"]
CONTENTS = [bytes([i]) * (5000 + 3000 * i) for i in range(4)]
keys = st.builds(PageKey.semantic, st.sampled_from(SESSIONS), st.just("p"), st.integers(0, 3))


class TieredStore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvfs-state-"))
        self.cfg = kvfs.StoreConfig(
            data_dirs=(self.root / "d0", self.root / "d1"),
            stripe_unit=8192,
            archive_url=f"file://{self.root / 'archive'}",
            durable=False,
            extra={"archive": {"interval": 0}},
        )
        self.store = kvfs.SyncStore(kvfs.Engine(self.cfg))
        self.model: dict[PageKey, bytes] = {}

    @rule(k=keys, c=st.integers(0, 3))
    def put(self, k: PageKey, c: int) -> None:
        self.store.put(k, CONTENTS[c], replace=True)
        self.model[k] = CONTENTS[c]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        self.store.delete(k)
        del self.model[k]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), dst=keys)
    def rename(self, data: st.DataObject, dst: PageKey) -> None:
        k = data.draw(st.sampled_from(sorted(self.model)))
        if k == dst:
            return
        self.store.rename(k, dst)
        self.model[dst] = self.model.pop(k)

    @rule(s=st.sampled_from(SESSIONS))
    def spill(self, s: str) -> None:
        if any(k.session == s for k in self.model):
            self.store.spill(s)

    @rule(s=st.sampled_from(SESSIONS))
    def evict(self, s: str) -> None:
        if any(k.session == s for k in self.model):
            self.store.evict(session=s)

    @rule(s=st.sampled_from(SESSIONS))
    def restore(self, s: str) -> None:
        if any(k.session == s for k in self.model):
            self.store.restore(s)

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = kvfs.SyncStore(kvfs.Engine(self.cfg))

    @invariant()
    def pages_match_model(self) -> None:
        listed = {i.path for i in self.store.list(path_prefix="sessions/")}
        assert listed == {k.path for k in self.model}
        for k, v in self.model.items():
            assert self.store.get(k) == v

    def teardown(self) -> None:
        try:
            stored = objects(self.root / "archive")
            held = {
                i.checksum for i in self.store.list(path_prefix="sessions/") if "archive" in i.tier
            }
            assert stored <= held, f"orphan objects: {stored - held}"
            listed = named(self.root / "archive")
            assert listed <= stored, f"manifests name missing objects: {listed - stored}"
        finally:
            self.store.close()
            shutil.rmtree(self.root, ignore_errors=True)


TieredStore.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_store = TieredStore.TestCase
