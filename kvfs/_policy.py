"""Tiering policy: what leaves the local tier when room is needed, and how.

This is the one place that decides eviction. The base policy evicts least-recently-used
blobs that no pinned page or pinned session holds and that no reader has leased; with no
archive tier, evicting a blob deletes the pages that share it. Access times come from
:class:`AccessClock`, which makes that order keep a prefix's head longest. The archive tier subclasses
:class:`TieringPolicy` and overrides :meth:`evict_blob` to spill before dropping the local copy.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._errors import ArchiveUnavailable, KvfsError
from ._events import log_event
from ._index import BlobRow, PageRow
from ._manifest import enqueue_in

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = ["AccessClock", "TieringPolicy"]

#: a session directory's accesses less than this apart are one burst (a prefix read or
#: written in order, chunk after chunk; a prefill computes between its saves)
BURST_GAP = 2.0
#: and a burst is at most this long: within it, a page used last is not counted as used
#: after one used first, so this is how coarse LRU may get (one busy directory that many
#: requests share, LMCache's or vLLM's, has a new burst at least this often)
BURST_SPAN = 30.0


class AccessClock:
    """The access time each put and read records, for eviction's order.

    A prefix is useful from its head only: an engine that finds chunk 0 of a context
    missing recomputes all of it, whatever later chunks are kept. Plain LRU evicts a prefix
    read or written in order head first (chunk 0 has the oldest time), so the first pages
    to go left the rest unusable. Here the pages of one session directory touched in one
    burst (accesses less than ``gap`` apart, for at most ``span``) all get the burst's
    start as their time, and eviction breaks ties by creation, newest first: a prefix goes
    tail first, and what stays is still a usable prefix. Between bursts and between
    directories the order is LRU; within a burst it is by creation, whatever order the
    pages were read in (readers run in parallel, and the mount reads a file in many
    requests)."""

    def __init__(self, gap: float = BURST_GAP, span: float = BURST_SPAN) -> None:
        self.gap = gap
        self.span = span
        self._bursts: dict[str, tuple[float, float]] = {}  # session: (start, last access)
        self._pruned = 0.0  # when the bursts that ended were last forgotten
        self._lock = threading.Lock()

    def stamp(self, session: str, now: float | None = None) -> float:
        """The access time to record for a page of session directory ``session``."""
        now = time.time() if now is None else now
        with self._lock:
            if (
                session not in self._bursts
                and len(self._bursts) >= 4096
                and not 0 <= now - self._pruned <= self.gap
            ):
                # forget the bursts that ended (once a gap at most: with thousands of
                # sessions busy at once, each new one would scan them all)
                self._pruned = now
                self._bursts = {d: sl for d, sl in self._bursts.items() if now - sl[1] <= self.gap}
            start, last = self._bursts.get(session, (now, now))
            if now - last > self.gap or now - start > self.span or start - now > self.gap:
                start = last = now  # a new burst (``start - now``: the clock was set back)
            # A time a little before the burst's start is a caller that read the clock, then
            # waited for this lock behind the burst's first access (parallel readers of one
            # prefix): it is of the burst. As a new burst of its own it gave the first page
            # read a later time than the rest, and eviction kept it longer than all of them,
            # the head included.
            self._bursts[session] = (start, max(last, now))
            return start


class TieringPolicy:
    """LRU eviction of unpinned, unleased blobs. Subclass to change what evicting means."""

    batch = 64
    #: evicting deletes (no archive holds a copy): never for room that cannot be made
    lossy_eviction = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def make_room(self, need: int, reason: str = "capacity") -> int:
        """Evict until ``need`` bytes are freed or nothing evictable is left. Returns bytes freed.

        Called with the engine's eviction lock held, so victims are never chosen twice.
        """
        self.engine.flush_atimes()
        self.engine._release_expired_pins()  # (their data may go now: a put must not fail)
        first: list[BlobRow] | None = None  # the candidates the check read: the first pass's
        if self.lossy_eviction:
            first = self._enough_candidates(need)
            if first is None:
                # All that may go would not make the room: deleting it would lose those
                # pages and the write would fail anyway (it did: one cp too large deleted
                # every unpinned page, then got ENOSPC)
                return 0
        freed = 0
        evicted = 0
        t0 = time.monotonic()
        skipped: set[bytes] = set()
        while freed < need:
            if first is None:
                first = self.engine.index.eviction_candidates(self.batch + len(skipped))
            cands, first = [b for b in first if b.hash not in skipped], None
            batch: list[BlobRow] = []
            want = need - freed
            for blob in cands:  # least recently used first, as many as the room needs
                if self.engine.is_leased(blob.hash):
                    skipped.add(blob.hash)
                    continue
                batch.append(blob)
                want -= blob.disk_bytes
                if want <= 0:
                    break
            if not batch:
                break
            got = self.evict_blobs(batch, reason)
            # each pass frees something or skips a blob from then on: the loop ends
            skipped.update(b.hash for b, n in zip(batch, got, strict=True) if n == 0)
            freed += sum(got)
            evicted += sum(1 for n in got if n)
            if self.room_blocked() is not None:
                break  # the next batches would fail the same way, each waiting as long
        if evicted:
            # One line for the pass: under steady pressure every put evicts, and a line per
            # content was a line per page written (per content: DEBUG)
            log_event(
                "evict",
                reason=reason,
                contents=evicted,
                bytes=freed,
                archived=not self.lossy_eviction,
                seconds=time.monotonic() - t0,
            )
        return freed

    def room_blocked(self) -> str | None:
        """Why no eviction can make room now, whatever else is tried (None: keep trying)."""
        return None

    def evict_blobs(
        self,
        blobs: list[BlobRow],
        reason: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[int]:
        """Evict several blobs at once; the bytes each freed (0: that one was not evicted).
        ``progress(bytes archived, bytes to archive)`` where copies are archived first."""
        return [self.evict_blob(b, reason) for b in blobs]

    def _enough_candidates(self, need: int) -> list[BlobRow] | None:
        """The eviction candidates, least recently used first, as far as they free ``need``
        bytes; None when all that may be evicted now would not. Read in growing batches:
        under steady pressure the first holds enough."""
        limit = self.batch
        while True:
            cands = self.engine.index.eviction_candidates(limit)
            free = sum(b.disk_bytes for b in cands if not self.engine.is_leased(b.hash))
            if free >= need:
                return cands
            if len(cands) < limit:
                return None
            limit *= 4

    def evict_pages(
        self,
        pages: list[PageRow],
        blobs: list[BlobRow],
        reason: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """A targeted evict (``Store.evict`` of a page or a session): ``pages`` are the
        target's local pages that are not pinned (nor in a pinned session), ``blobs`` their
        data that no pin holds and no reader leases. Drop what this policy drops; return the
        bytes freed.

        Without an archive tier that deletes ``pages``, and only them: a page of another
        session sharing their data keeps it (then its bytes are not freed). Data the archive
        holds (a store opened without the archive it has) only loses its local copy."""
        held = {h for h in {p.hash for p in pages} if self._archived(h)}
        freed = sum(
            self.drop_local(b.hash, reason, b.extents, keep_pinned=True)
            for b in blobs
            if b.hash in held
        )
        rest = [p for p in pages if p.hash not in held]
        return freed + (self.engine.delete_evicted_pages(rest, reason) if rest else 0)

    def evict_blob(self, blob: BlobRow, reason: str) -> int:
        """Remove a blob's local copy; return the bytes freed (0 if it could not be evicted).

        Without an archive tier the local copy is the only copy: its pages are deleted;
        unless the archive holds it (a store opened without the archive it has: ``kvfs put
        --offline`` with no archive URL), when only the local copy goes.
        """
        if blob.archived:
            return self.drop_local(blob.hash, reason, blob.extents, keep_pinned=True)
        return self.engine.delete_blob_pages(blob, reason)

    def _archived(self, h: bytes) -> bool:
        b = self.engine.index.blob(h)
        return b is not None and b.archived

    def drop_local(
        self, h: bytes, reason: str, extents: object = None, *, keep_pinned: bool = False
    ) -> int:
        """Drop the local copy of an archived blob (only the copy in ``extents``, when
        given; with ``keep_pinned``, an eviction's, not once a pin holds it: a pin that
        landed after it was chosen keeps it). Returns bytes freed."""
        row = self.engine.index.drop_local(h, extents, keep_pinned=keep_pinned)
        if row is None:
            return 0
        return self.forget_local(row, reason)

    def forget_local(self, row: BlobRow, reason: str) -> int:
        """After the index dropped ``row``'s local copy: remove its files, count and log."""
        eng = self.engine
        eng._drop_files(row)
        with eng._cap_lock:
            eng._evictions[reason] += 1
        log_event(
            "evict",
            level=logging.DEBUG,  # (a pass's summary is the INFO line: make_room)
            content=row.hash.hex()[:16],
            reason=reason,
            bytes=row.disk_bytes,
            archived=True,
        )
        return row.disk_bytes

    def queue_changes(
        self, db: sqlite3.Connection, sessions: set[str], freed: list[BlobRow]
    ) -> None:
        """Inside the index transaction that removed pages from ``sessions``, or changed
        their pins or attributes (the index's ``on_changed``): queue the archive's
        follow-up work, in that transaction, so that no crash can lose it. Their manifests
        are rewritten (else a restore brought deleted pages back, and a pin made after a
        spill never reached the manifest that another host's retirement of this one
        trusts), and the objects of ``freed`` blobs (whose last reference went) are deleted
        once no manifest names them.

        Queued whenever this store has had an archive: opened without it (``kvfs rm --data
        DIR`` offline with no archive URL), the next open with it does the work."""
        if self.engine.index.get_meta("archive") is not None:
            enqueue_in(db, "manifest", sorted(sessions))
            enqueue_in(db, "forget", [b.hash.hex() for b in freed if b.archived])

    def pages_removed(self, pages: list[PageRow]) -> None:
        """Pages were removed, and their archive work queued (see :meth:`queue_changes`):
        the archive tier may do it now."""

    def statistics(self) -> dict[str, object]:
        """Policy figures merged into ``StoreStatistics.extra``."""
        return {}

    def close(self) -> None:
        """Release what the policy holds (called by ``Engine.close``)."""

    def heal(self, blob: BlobRow, reason: str) -> BlobRow | None:
        """``blob``'s local copy failed its checksum: replace it from another copy and return
        the row to read instead, or None when there is no other copy (without an archive
        there is none; the read then fails with CorruptPage). Opened without the archive
        that holds it: the damaged copy is dropped, and KvfsError says so (fsck --repair
        would otherwise delete pages the archive still holds)."""
        if not blob.archived:
            return None
        self.drop_local(blob.hash, reason, blob.extents)
        raise KvfsError(
            "this store was opened without its archive, which holds the data: it comes back "
            "when the store is opened with it"
        )

    def find_archived(self, h: bytes) -> tuple[int, bytes] | None:
        """The size and leaf digests of content ``h`` when the archive holds a verified
        copy of it (fsck --repair of pages whose blob row was lost), None when it holds
        none. Without an archive there is none; opened without the archive this store
        spilled to, KvfsError: it may hold the data, and cannot be asked."""
        if self.engine.index.get_meta("archive") is None:
            return None
        raise KvfsError(
            "this store was opened without the archive it spilled to, which may hold the "
            "data: run fsck --repair with it"
        )

    def check_archive(
        self, *, repair: bool, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, list[str]]:
        """fsck of the archive's copies (``kvfs fsck --check-archive``): without an archive there is
        none to check. ArchiveUnavailable, as every archive call without one raises: fsck
        then keeps what the local check found and repaired, and kvfs exits 8."""
        raise ArchiveUnavailable("no archive tier is configured: there is no archive to check")

    def memory_copy(self, h: bytes) -> bytes | None:
        """A verified copy of archive-only data held in memory (see the archive tier's
        ``copy_in_memory``); without an archive there is none."""
        return None

    def copy_in_memory(
        self, blob: BlobRow, no_room: Exception, reason: str = "no local room"
    ) -> bytes:
        """Archive-only data, verified, held in memory because no local room was left (or
        the local copy's disk fails: ``reason``); without an archive, ``no_room`` is
        raised."""
        raise no_room

    def restore_blob(self, blob: BlobRow) -> BlobRow:
        """Bring a blob that is not held locally back; without an archive there is nowhere to
        bring it from."""
        from ._errors import PageNotFound

        raise PageNotFound(
            f"page data {blob.hash.hex()[:16]} is not held locally and no archive "
            "tier is configured"
        )
