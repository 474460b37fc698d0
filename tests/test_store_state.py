"""A Hypothesis state machine drives the store against a dict model.

Steps: put (with dedup-prone payloads, pin, replace), get, delete, pin/unpin a page,
pin/unpin a session, evict a page or a session, and restart (close + reopen). The cap is
small, so puts also evict by policy. Without an archive tier eviction deletes, so the model
lets an unpinned page vanish only in a put (the policy's eviction of data, every page that
shares it), never a pinned one; an explicit evict deletes exactly the unprotected pages
named.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvfs
from kvfs._checksum import checksum

KiB = 1024
SESSIONS = ["a", "b", "c"]
KEYS = [kvfs.PageKey.semantic(s, "p", layer) for s in SESSIONS for layer in range(3)] + [
    kvfs.PageKey.from_path("eng/x.bin"),
    kvfs.PageKey.from_path("eng/y.bin"),
]
PAYLOADS = [bytes([v]) * n for n in (0, 100, 4096, 16 * KiB + 1, 40_000) for v in (1, 2)]

keys = st.sampled_from(KEYS)
payloads = st.integers(0, len(PAYLOADS) - 1)  # an index: short reprs in failure reports
# "eng/" is the engine directory's session; a bare "eng" would mean it only while no
# semantic session sessions/eng exists (Engine.resolve_session, tested on its own)
sessions = st.sampled_from([*SESSIONS, "eng/"])


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvfs-state-"))
        self.cfg = kvfs.StoreConfig(
            data_dirs=(self.tmp / "d0", self.tmp / "d1"), stripe_unit=16 * KiB, capacity=100 * KiB
        )
        self.store = kvfs.SyncStore(kvfs.Engine(self.cfg))
        self.model: dict[str, bytes] = {}
        self.pinned: set[str] = set()
        self.pinned_sessions: set[str] = set()
        self.may_vanish = False

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _session_of(self, path: str) -> str:
        return kvfs.PageKey(path).session_dir

    def _protected(self, path: str) -> bool:
        return path in self.pinned or self._session_of(path) in self.pinned_sessions

    def _drop(self, path: str) -> None:
        self.model.pop(path, None)
        self.pinned.discard(path)

    @rule(key=keys, data=payloads, pin=st.booleans(), replace=st.booleans())
    def put(self, key: kvfs.PageKey, data: int, pin: bool, replace: bool) -> None:
        self.may_vanish = True
        data = PAYLOADS[data]
        if key.path in self.model and not replace:
            try:
                self.store.put(key, data, pin=pin)
            except kvfs.PageExists:
                return
            raise AssertionError("a second put of a key must raise PageExists")
        try:
            info = self.store.put(key, data, pin=pin, replace=replace)
        except kvfs.CapacityExceeded:
            # Only when what is left is protected; the old page (if any) is untouched.
            event("put: CapacityExceeded")
            return
        assert info.size == len(data) and info.pinned == pin
        self.model[key.path] = data
        (self.pinned.add if pin else self.pinned.discard)(key.path)

    @rule(key=keys)
    def get(self, key: kvfs.PageKey) -> None:
        if key.path in self.model:
            assert self.store.get(key) == self.model[key.path]
        else:
            try:
                self.store.get(key)
            except kvfs.PageNotFound:
                return
            raise AssertionError(f"{key} should not exist")

    @rule(key=keys)
    def delete(self, key: kvfs.PageKey) -> None:
        if key.path in self.model:
            self.store.delete(key)
            self._drop(key.path)
        else:
            try:
                self.store.delete(key)
            except kvfs.PageNotFound:
                return
            raise AssertionError(f"deleting missing {key} should raise")

    @rule(key=keys, on=st.booleans())
    def pin(self, key: kvfs.PageKey, on: bool) -> None:
        if key.path not in self.model:
            return
        (self.store.pin if on else self.store.unpin)(key)
        (self.pinned.add if on else self.pinned.discard)(key.path)

    @rule(session=sessions, on=st.booleans())
    def pin_session(self, session: str, on: bool) -> None:
        d = kvfs.session_dir(session)
        try:
            (self.store.pin_session if on else self.store.unpin_session)(session)
        except kvfs.SessionNotFound:
            # only an unpin, of a session that holds nothing and was never pinned
            held = any(kvfs.PageKey.from_path(p).session_dir == d for p in self.model)
            assert not on and not held and d not in self.pinned_sessions, d
            return
        (self.pinned_sessions.add if on else self.pinned_sessions.discard)(d)

    def _evict_expect(self, paths: set[str]) -> set[str]:
        """Pages an explicit evict of ``paths`` removes (no archive: it deletes): those of
        them that are not protected, and no other. A page of another session sharing their
        data keeps it, and a pin there does not keep these."""
        return {p for p in paths if not self._protected(p)}

    @rule(key=keys)
    def evict_page(self, key: kvfs.PageKey) -> None:
        if key.path not in self.model:
            return
        gone = self._evict_expect({key.path})
        self.store.evict(key)
        event(f"evict page: {'removed' if gone else 'protected'}")
        for p in gone:
            assert not self.store.exists(p), f"{p} should have been evicted"
            self._drop(p)
        for p in set(self.model) - gone:
            assert self.store.exists(p), f"{p} went with {key.path}'s eviction"

    @rule(session=sessions)
    def evict_session(self, session: str) -> None:
        d = kvfs.session_dir(session)
        paths = {p for p in self.model if self._session_of(p) == d}
        if not paths:
            return
        gone = self._evict_expect(paths)
        self.store.evict(session=session)
        for p in gone:
            assert not self.store.exists(p), f"{p} should have been evicted"
            self._drop(p)
        for p in set(self.model) - gone:  # nothing else: not what shared their data
            assert self.store.exists(p), f"{p} went with {session}'s eviction"

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = kvfs.SyncStore(kvfs.Engine(self.cfg))
        assert self.store.engine.recovered_orphans == []

    @invariant()
    def matches_model(self) -> None:
        st_ = self.store.statistics()
        assert st_.used_bytes <= st_.capacity_bytes
        # The accounting (carried across clean restarts) matches the blob rows.
        assert st_.used_bytes == self.store.engine.index.local_disk_bytes()
        present = {p.path: p for p in self.store.list(path_prefix="")}
        assert set(present) <= set(self.model), f"unexpected pages {set(present) - set(self.model)}"
        for path in list(self.model):
            if path not in present:
                assert self.may_vanish and not self._protected(path), f"{path} vanished"
                event("evicted to make room")
                self._drop(path)
                continue
            info = present[path]
            assert info.checksum == checksum(self.model[path]).hex()
            assert info.pinned == (path in self.pinned)
        self.may_vanish = False


StoreMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
