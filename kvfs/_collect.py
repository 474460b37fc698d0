"""Deleting archive objects when several hosts share one bucket: collection intents.

An object may be deleted only while no manifest names it. A collecting host (A) learns that
by reading every manifest, and S3 has no transaction that spans that reading and the
deletes: host B can write a manifest naming the object right after A read the manifests,
check that the object exists, and drop its local copy, and then A deletes the object. So A
says what it is about to delete before it reads, and B looks before it drops:

A, collecting (``Collector.collect``):
  1. PUT ``gc/<id>`` naming every candidate (its intent);
  2. read every manifest; delete the candidates none names, stopping ``window / 2`` seconds
     after the PUT (the rest stay queued for a later pass);
  3. PUT ``gc/<id>.done``; both objects are deleted ``window`` seconds later by A's next
     passes (they linger so that B can see a collection that has already finished).

B, before dropping local copies of blobs that manifests it just wrote name
(``Collector.settle``):
  1. LIST ``gc/`` and read the intents it has not seen yet (they never change; a damaged
     one is taken to name every blob, one not fetched for an outage fails the drop);
  2. wait until every unfinished intent that names one of the blobs is done; one that is
     still unfinished ``window`` seconds after B first saw it belongs to a dead host (which
     stopped deleting ``window / 2`` after writing it): B removes it and goes on;
  3. check that the named blobs still exist, re-uploading any that is missing: those of
     intents, those this operation did not store itself, and all of them when the
     operation took more than ``window / 2``.

Why nothing is lost: a collection that deletes the object after B's check read the
manifests before B's manifest existed, so its intent was written before B's LIST and B
waited for it. One that deleted it before B's check is caught by the check (its intent is
still listed, done, when it finished less than ``window`` ago, that is, after this
operation began; older deletions happened before B stored or checked the object). Only
durations are measured, each on one host's own clock; no clocks are compared across hosts.

What a crash leaves: a host killed while collecting leaves an unfinished intent; the host
finishes it when it next collects, and other hosts wait for it at most ``window`` seconds
once, and only if it names a blob they are dropping.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING

import msgpack
import trio

from ._errors import ArchiveUnavailable
from ._events import log_event

if TYPE_CHECKING:
    from objectstore._abc import ObjectStore

__all__ = ["INTENTS", "Collector"]

log = logging.getLogger("kvfs.archive")

INTENTS = "gc/"
DONE = ".done"
#: how long a collection may spend storing its done marker once it has stopped (also when
#: cancelled); past that the intent is left unfinished, and finished later
FINISH_SECONDS = 15.0


class Collector:
    """One host's side of the protocol above, for the archive ``store``."""

    def __init__(
        self,
        store: ObjectStore,
        store_id: str,
        window: float,
        count: Callable[[str], None],
    ) -> None:
        self.store = store
        self.store_id = store_id
        self.window = window
        self.count = count
        #: intents read so far: key -> the blob hashes it names (an intent never changes)
        self._seen: dict[str, frozenset[bytes] | None] = {}
        #: unfinished intents of other hosts: key -> when this host first saw them
        self._first_seen: dict[str, float] = {}
        #: this host's intents: key -> time.time() when finished (None: under way)
        self._mine: dict[str, float | None] = {}

    # -- the collecting side ----------------------------------------------------------------
    async def announce(self, hashes: list[bytes]) -> str:
        """Write an intent naming ``hashes``; returns its key."""
        key = f"{INTENTS}{self.store_id}-{time.time_ns():x}-{os.urandom(4).hex()}"
        body = {"v": 1, "store_id": self.store_id, "written": time.time(), "hashes": hashes}
        self._mine[key] = None
        try:
            await self.store.put(key, msgpack.packb(body, use_bin_type=True))
        except BaseException:
            del self._mine[key]
            raise
        return key

    async def finish(self, key: str) -> None:
        await self.store.put(key + DONE, msgpack.packb({"written": time.time()}))
        self._mine[key] = time.time()

    async def collect(
        self,
        candidates: list[bytes],
        referenced: Callable[[], Awaitable[set[bytes] | None]],
        may_delete: Callable[[bytes], Awaitable[bool]],
        delete: Callable[[bytes], Awaitable[None]],
    ) -> list[bytes]:
        """Delete the objects of ``candidates`` that no manifest names (``referenced()``:
        every blob the manifests name, None when one is unreadable: nothing is deleted).
        Returns the candidates settled (deleted, named by a manifest, or refused by
        ``may_delete``: no longer to collect); the others stay queued."""
        key = await self.announce(candidates)
        t0 = time.monotonic()
        await self.tidy(await self.store.modified(key))
        try:
            named = await referenced()
            if named is None:
                return []
            settled: list[bytes] = []
            for h in candidates:
                if time.monotonic() - t0 > self.window / 2:
                    log.warning(
                        "archive collection stopped after %.0f s; %d objects stay queued",
                        time.monotonic() - t0,
                        len(candidates) - len(settled),
                    )
                    break
                if h not in named and await may_delete(h):
                    await delete(h)
                settled.append(h)
            return settled
        finally:
            # Unfinished until the done marker is stored: if that fails, the intent is a
            # leftover that this host finishes later (tidy, or a settle that meets it).
            del self._mine[key]
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + FINISH_SECONDS
                await self.finish(key)

    async def tidy(self, store_now: float | None = None) -> None:
        """Remove this host's intents finished more than ``window`` ago, and finish those
        left unfinished (by a crash of a previous run, or a failed finish): they can delete
        nothing any more, since only one process owns a store. ``store_now``: the archive's
        clock now (the modification time of an object just written), by which those a
        previous run finished are timed."""
        now = time.time()
        keys = set(await self.store.list_all(INTENTS))
        for k in sorted(keys):
            if not k[len(INTENTS) :].startswith(self.store_id + "-"):
                continue
            if k.endswith(DONE):
                if k[: -len(DONE)] not in keys:  # its intent was removed by another host
                    await self.store.delete(k)
            elif k + DONE not in keys:
                if self._mine.get(k, 0) is not None:  # not a pass of this process under way
                    await self.finish(k)
            elif k not in self._mine:
                # finished by a previous run: removed a window after it finished. (Taking
                # "now" as that time, a host used only by short commands never removed any:
                # no process lived a window past the one that met them.)
                self._mine[k] = await self._finished_at(k, now, store_now)
        for k, at in list(self._mine.items()):
            if at is not None and now - at > self.window:
                await self.store.delete(k)
                await self.store.delete(k + DONE)
                del self._mine[k]

    async def _finished_at(self, key: str, now: float, store_now: float | None) -> float:
        """When a previous run finished intent ``key``, on this process's clock (``now``
        is its time now): the age of its done marker by the archive's clock (its
        modification time against ``store_now``), so that no step of this host's clock
        between the runs can make it look older than it is (``now`` without
        ``store_now``, or when the marker is gone: kept a window more)."""
        done = await self.store.modified(key + DONE)
        if done is None or store_now is None:
            return now
        return now - max(0.0, store_now - done)

    # -- the dropping side ----------------------------------------------------------------
    async def settle(
        self, hashes: Collection[bytes], fresh: Collection[bytes], started: float
    ) -> list[bytes]:
        """Called after this host wrote manifests naming ``hashes`` and before it drops
        their local copies (``fresh``: stored by this operation, which began at
        ``time.monotonic()`` == ``started``). Waits for unfinished collections naming any
        of them; returns the blobs whose objects must be checked (and re-uploaded when
        missing) before the copies go. Raises ArchiveUnavailable (its LIST, or the read of
        an intent): then no copy may go."""
        want = frozenset(hashes)
        waited = False
        while True:
            keys = set(await self.store.list_all(INTENTS))
            naming: dict[str, frozenset[bytes]] = {}
            for k in sorted(keys):
                if k.endswith(DONE):
                    continue
                if k not in self._seen:
                    self._seen[k] = await self._read(k)
                named = self._seen[k]
                names = want if named is None else named & want
                if names:
                    naming[k] = names
            busy = [k for k in naming if k + DONE not in keys and not await self._over(k)]
            if not busy:
                break
            if not waited:
                waited = True
                self.count("collection_waits")
                log_event("collection-wait", intents=len(busy), key=busy[0])
            await trio.sleep(0.1)
        for k in [k for k in self._seen if k not in keys]:
            del self._seen[k]  # removed by its host: never listed again
            self._first_seen.pop(k, None)
        if time.monotonic() - started > self.window / 2:
            return sorted(want)
        check = want - frozenset(fresh)
        for names in naming.values():
            check |= names
        return sorted(check)

    async def _read(self, key: str) -> frozenset[bytes] | None:
        """The blobs an intent names (None: unreadable, so taken to name every blob).
        Raises ArchiveUnavailable: an intent not read is no damaged one (kept as naming
        every blob, it was waited for, and said to be unreadable, for as long as it was
        listed), and the settle, with nothing dropped, is tried again by its caller."""
        try:
            m = msgpack.unpackb(await self.store.get(key), raw=False)
            return frozenset(bytes(h) for h in m["hashes"])
        except FileNotFoundError:
            return frozenset()  # removed since the listing: it finished long ago
        except ArchiveUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any damage: waited for like any other
            log.warning("archive collection intent %s is unreadable (%s)", key, e)
            return None

    async def _over(self, key: str) -> bool:
        """Whether an unfinished intent can no longer delete anything: one a previous run
        of this host left (finished now), or another host's first seen ``window`` ago
        (that host stopped deleting by then; removed, so nobody waits for it again)."""
        if key in self._mine:
            return False  # this process's own pass: it finishes
        if key[len(INTENTS) :].startswith(self.store_id + "-"):
            await self.finish(key)
            return True
        first = self._first_seen.setdefault(key, time.monotonic())
        if time.monotonic() - first < self.window:
            return False
        log_event(
            "collection-dead",
            level=logging.WARNING,
            key=key,
            message=f"unfinished after {self.window:.0f} s: its host stopped deleting; removed",
        )
        self.count("collections_presumed_dead")
        await self.store.delete(key)
        await self.store.delete(key + DONE)
        return True
