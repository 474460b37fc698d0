"""Session spill, manifests, multi-host import and the background spiller (trio tasks).

Everything here runs on a trio loop (the store's, or a private one for sync callers); index
and disk work goes to worker threads.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote

import trio

from objectstore._abc import one_error_nursery

from ._collect import Collector
from ._errors import ArchiveAccessDenied, ArchiveUnavailable, CorruptPage, SessionNotFound
from ._events import Throttle, disk_error_due, log_event
from ._hosts import Hosts
from ._keys import session_name
from ._local import disk_failed
from ._maint import after_delete
from ._manifest import (
    BLOBS,
    MANIFESTS,
    NAME_IN_KEY_MAX,
    blob_key,
    build_manifest,
    is_session_manifest,
    legacy_manifest_key,
    manifest_key,
    manifest_prefixes,
    merge_manifests,
    pack_manifest,
    parse_manifest,
    pinned_now,
    session_key_part,
    session_of_manifest_key,
)

if TYPE_CHECKING:
    from ._archive import ArchivingPolicy

__all__ = ["Spiller"]

log = logging.getLogger("kvfs.archive")

#: a session whose watermark spill failed (not for the archive: a damaged local page) is
#: not tried again for this long
SPILL_RETRY_SECONDS = 300.0
#: queued deletions of archive objects collected at a time, each chunk a collection of its
#: own (an intent naming them, then a read of every manifest): the queue may hold one for
#: every page deleted while gc_grace or an archive outage held it. Large, because each chunk
#: reads every manifest again (file://; on S3 the changed ones and a listing): ~100 bytes
#: an entry, so a chunk holds a few MB, and a queue needs many only at millions
COLLECT_ROWS = 50_000
#: an incomplete upload (S3 multipart, a file:// temporary file) older than this is a killed
#: put's, not one in flight on this host or another sharing the archive: aborted
UPLOAD_STALE_SECONDS = 24 * 3600.0
#: the background task looks for those this often (and once when it starts)
UPLOAD_SWEEP_SECONDS = 3600.0
#: a retention pass waits while this host's clock is ahead of the archive's by more than
#: this (or a tenth of the retention, if less): it would delete sessions early by as much
CLOCK_AHEAD_SECONDS = 300.0

#: a manifest deleted since it was listed (Spiller._get_manifest)
_GONE = object()
T = TypeVar("T")


async def _thread(fn, *args):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args))


class Spiller:
    """Spills sessions and keeps manifests and blob objects in step with the index."""

    def __init__(self, policy: ArchivingPolicy) -> None:
        self.policy = policy
        self.engine = policy.engine
        self.store = policy.store
        self.aindex = policy.aindex
        #: sessions being spilled, each with how many spills of it run (a background pass
        #: and `kvfs spill` at once: the first to end took it off while the other ran)
        self._active: collections.Counter[str] = collections.Counter()
        #: per session: the index's removal count its last manifest written here reflects
        self.written: dict[str, int] = {}
        #: per session: the pages (path, content) its manifest, as this host last wrote it,
        #: names. By page, not content: a page put since under another path, sharing content
        #: the manifest names for an older page, is not named by it (see name_in_manifests).
        #: While one is written, only what both it and the one before it name
        self.named: dict[str, set[tuple[str, bytes]]] = {}
        #: per session: held while its manifest is built and stored (write_manifest)
        self._manifest_locks: dict[str, threading.Lock] = {}
        #: manifest key -> (its version tag, the contents it names), for collections
        self._named_cache: dict[str, tuple[str, frozenset[bytes]]] = {}
        #: session -> time.monotonic() before which a watermark pass does not try it again
        self._spill_failed: dict[str, float] = {}
        #: the archive refused the sweep of incomplete uploads (said once; not tried again)
        self._sweep_denied = False
        #: a retention pass held back by this host's clock: one warning an hour
        self._clock_warning = Throttle(3600.0)
        #: seconds this host's clock was ahead of the archive's when the last retention
        #: pass waited for that (None: it did not)
        self.retention_paused: float | None = None
        #: local bytes a pressure spill left to each session (see relieve_pressure)
        self._no_gain: dict[str, int] = {}
        #: time.monotonic() before which the next retention pass does not run
        self._next_expiry = 0.0
        #: sessions whose manifest in the single-manifest layout was looked for
        self._legacy_checked: set[str] = set()
        #: ``.session``: the session a retention pass is deleting in this thread (expiring)
        self._expiring = threading.local()
        self.collector = Collector(
            self.store, self.engine.store_id, policy.cfg.gc_window, policy.count
        )
        self.hosts = Hosts(
            self.store,
            self.engine.store_id,
            policy.cfg.retention,
            policy.count,
            self.heartbeat_missing,
            self._forget_retired,
            self.tombstones,
        )

    def queue_length(self) -> int:
        return len(self._active) + self.aindex.pending_count("manifest")

    # -- spill ----------------------------------------------------------------------------
    async def spill_session(
        self,
        d: str,
        drop: bool = True,
        progress: Callable[[int, int], None] | None = None,
        keep_pinned: bool = False,
    ) -> int:
        """Upload the session's pages that the archive lacks, write its manifest, then (with
        ``drop``) drop the local copies of its content that no other session still needs
        here: content another session also holds stays local until that session's manifest
        names it too (it spilled as well), so a prefix many live sessions share is not taken
        from under them by one going cold; content a pinned page or another pinned session
        holds stays, and with ``keep_pinned`` (a background pass, not a request) so does
        what the session's own pinned pages hold.
        ``progress(page bytes archived, page bytes to archive)`` as uploads finish. Returns
        bytes uploaded.

        Raises SessionNotFound, ArchiveUnavailable (nothing local was dropped), CorruptPage
        (a local copy failed its checksum: that page is not archived, nothing dropped).
        """
        idx = self.engine.index
        if await _thread(idx.session, d) is None:
            raise SessionNotFound(f"no session {session_name(d)!r}")
        self._active[d] += 1
        started = time.monotonic()
        try:
            await self._check_named()
            pages = await trio.to_thread.run_sync(lambda: idx.pages(session=d))
            hashes = sorted({p.hash for p in pages})
            rows = await trio.to_thread.run_sync(lambda: [idx.blob(h) for h in hashes])
            todo = [b.hash for b in rows if b is not None and not b.archived]
            sizes = {b.hash: b.size for b in rows if b is not None}
            total = sum(sizes[h] for h in todo)
            archived = 0

            stored: list[bytes] = []

            def done(hs: list[bytes]) -> None:
                nonlocal archived
                stored.extend(hs)
                archived += sum(sizes[h] for h in hs)
                if progress is not None:
                    progress(archived, total)

            if progress is not None:
                progress(0, total)
            fresh: set[bytes] = set()
            try:
                uploaded = await self.policy.upload_many(todo, mark=False, fresh=fresh, done=done)
            except BaseException:
                # What was stored before the failure is recorded (or, deleted meanwhile,
                # queued to be forgotten): else no delete would ever remove those objects.
                with trio.CancelScope(shield=True):
                    await _thread(self.aindex.mark_archived, stored)
                raise
            # (a page deleted while it uploaded: its object is queued to be forgotten)
            await _thread(self.aindex.mark_archived, todo)
            await self.write_manifest(d)
            await self._verify_referenced(await self.collector.settle(hashes, fresh, started))
            if drop:
                await self._learn_named(hashes, d)
                await _thread(self._drop_all, hashes, None if keep_pinned else d)
            self.policy.count("sessions_spilled")
            return uploaded
        finally:
            self._active[d] -= 1
            if not self._active[d]:
                del self._active[d]

    async def name_in_manifests(
        self, hashes: list[bytes], fresh: set[bytes], started: float
    ) -> None:
        """Before the local copies of archived blobs go: write the manifest of every session
        holding one of ``hashes`` that its manifest (as this host last wrote it) does not
        name yet, then make sure the objects exist (:meth:`Collector.settle`), re-uploading
        any that another host collected meanwhile (``fresh``: stored by this operation,
        which began at ``time.monotonic()`` == ``started``).

        A page held only in the archive must be named by a manifest: other hosts sharing
        the bucket delete any object no manifest names, and a host rebuilt from the archive
        knows only what manifests list. Raises ArchiveUnavailable."""
        await self._check_named()
        holders: dict[str, set[tuple[str, bytes]]] = {}
        for h in hashes:
            for d, path in await _thread(self.aindex.pages_holding, h):
                holders.setdefault(d, set()).add((path, h))
        # By page: a manifest naming the content for one page does not name another page of
        # the session put since with the same bytes, which would be left in no manifest.
        stale = [d for d, ps in sorted(holders.items()) if not ps <= self.named.get(d, set())]
        for d in stale:
            await self.write_manifest(d)
        await self._verify_referenced(await self.collector.settle(hashes, fresh, started))

    async def _learn_named(self, hashes: list[bytes], d: str) -> None:
        """Learn what this host's manifests name of the other sessions sharing ``hashes``
        that spilled before this process knew them (``named`` lives in memory): without
        it, content shared with a session spilled by an earlier ``kvfs spill`` never left
        the local tier. One GET per such session, once per process."""

        def unknown() -> list[str]:
            others = {s for h in hashes for s in self.aindex.sessions_of_blob(h)}
            return self.aindex.all_archived(sorted(others - {d} - set(self.named)))

        sid = self.engine.store_id
        limit = trio.CapacityLimiter(self.policy.cfg.concurrency)

        async def learn(s: str) -> None:
            async with limit:
                try:
                    m = parse_manifest(await self.store.get(manifest_key(s, sid)))  # type: ignore[arg-type]
                except (FileNotFoundError, ValueError):
                    return  # unknown: what it shares stays local
            self.named.setdefault(s, {(p["path"], bytes(p["hash"])) for p in m["pages"]})

        async with one_error_nursery() as n:
            for s in await trio.to_thread.run_sync(unknown):
                n.start_soon(learn, s)

    async def _check_named(self) -> None:
        """Before ``named`` is trusted for a drop: when this host's heartbeat is overdue,
        another host may have taken it for gone and deleted its manifests; beat first (a
        missing heartbeat resets ``named`` and queues every manifest to be written again).
        Where hosts may be retired, the heartbeat is looked at before every drop even when
        not overdue: a retirement decided on the previous heartbeat can land just after
        this host beat (it deletes the heartbeat before any manifest, so a drop after
        this look finds the manifests still there)."""
        if self.hosts.overdue():
            await self.hosts.beat()
        elif self.hosts.retention > 0 and self.hosts.beaten_at is not None:
            await self.hosts.confirm()

    async def _verify_referenced(self, hashes: list[bytes]) -> None:
        """Every blob a fresh manifest names exists (another host may have collected one
        between our HEAD and our manifest): re-upload what is missing before dropping.
        Blobs this spill stored itself are not asked again. With upload workers the HEADs
        (and any re-upload) run there, out of the daemon's GIL."""
        if self.policy.uploads is not None and await self.policy.ensure_archived(hashes):
            return
        limit = trio.CapacityLimiter(self.policy.cfg.concurrency)

        async def one(h: bytes) -> None:
            async with limit:
                b = await _thread(self.engine.index.blob, h)
                if b is not None and b.local and not await self.store.exists(blob_key(h)):
                    obj = await trio.to_thread.run_sync(self._encode_local, h)
                    await self.store.put(blob_key(h), obj, if_absent=True, cold=True)

        async with one_error_nursery() as n:
            for h in hashes:
                n.start_soon(one, h)

    def _drop_all(self, hashes: list[bytes], d: str | None) -> None:
        """Drop the local copies the session no longer needs (pins of session ``d`` do not
        count: it was asked for): one index transaction for all of them (a commit per page
        cost 1-2 ms of fsync each), then the files, several at once."""
        idx, eng = self.engine.index, self.engine
        want = []
        for h in hashes:
            b = idx.blob(h)
            if (
                b is not None
                and b.local
                and b.archived
                and not eng.is_leased(h)
                and self.aindex.droppable(h, d)
            ):
                want.append(h)
        rows = self.aindex.drop_local_many(want, self.named, d)
        list(self.policy._io.map(lambda r: self.policy.forget_local(r, "spill"), rows))

    def _encode_local(self, h: bytes) -> bytes:
        from ._codec import encode

        data = self.policy.read_local(h)
        if data is None:
            raise ArchiveUnavailable(
                f"blob {h.hex()[:16]} vanished from the archive and is no longer local"
            )
        return encode(data, level=self.policy.cfg.zstd_level)[0]

    async def write_manifest(self, d: str) -> None:
        """Write this host's manifest of session ``d``: delete it when nothing of the session
        is archived here, unless it supersedes other hosts' (then it stays, without pages).

        One at a time per session (callers run on the daemon's loop and on callers' own
        loops): two writes whose index reads and PUTs interleaved could leave the older
        read in the archive, naming less than this host has already dropped locally."""
        lock = self._manifest_locks.setdefault(d, threading.Lock())
        if not lock.acquire(blocking=False):
            await trio.to_thread.run_sync(lock.acquire)  # not cancellable: never leaked
        try:
            with self.policy._lock:
                codecs = dict(self.policy.codecs)
            asked = time.time()  # removal requests older than this are reflected below
            seen = self.engine.index.removals[d]  # what this manifest reflects, at least
            sid = self.engine.store_id
            # From the index read below until the new manifest is stored, the archive may
            # hold either one: only what both name may be trusted by a drop. A page the new
            # one leaves out (deleted, renamed, replaced) and put again meanwhile was
            # dropped on the old one's word, then named by neither once the new one landed.
            old = self.named.get(d, set())
            trusted: set[tuple[str, bytes]] = set()
            self.named[d] = trusted
            supersedes = await _thread(self.aindex.imported, d)
            m = await trio.to_thread.run_sync(
                lambda: build_manifest(self.engine.index, d, sid, codecs, supersedes)
            )
            named = set() if m is None else {(p["path"], bytes(p["hash"])) for p in m["pages"]}
            # (a failed write leaves this: it holds either way. Only where ``trusted`` is
            # still there: a reset of ``named`` meanwhile, by rewrite_all_manifests, is not
            # undone. Replaced whole, never changed in place: a worker thread may be
            # iterating the set, see flush_pending)
            if self.named.get(d) is trusted:
                self.named[d] = old & named
            if m is None:
                await self.store.delete(manifest_key(d, sid))
            else:
                await self.store.put(manifest_key(d, sid), pack_manifest(m))
            if d not in self._legacy_checked:
                await self._drop_own_legacy(d)
            self.policy.count("manifests_written")
            self.written[d] = max(self.written.get(d, 0), seen)
            self.named[d] = named
        finally:
            lock.release()
        await _thread(self.aindex.done, "manifest", [d], asked)

    async def _drop_own_legacy(self, d: str) -> None:
        """A manifest this store wrote in an older layout (one per session, before the
        eighth session; a long name uncut, before the eleventh) is replaced by the one just
        written: delete it (another host's stays)."""
        try:
            m = parse_manifest(await self.store.get(legacy_manifest_key(d)))  # type: ignore[arg-type]
        except (FileNotFoundError, ValueError):
            m = None
        if m is not None and m.get("store_id") == self.engine.store_id:
            await self.store.delete(legacy_manifest_key(d))
        if len(manifest_prefixes(d)) > 1:
            # a long name: this host's manifest under the uncut name (before the eleventh
            # session) would be read beside the new one
            await self.store.delete(legacy_manifest_key(d) + "@" + self.engine.store_id)
        self._legacy_checked.add(d)

    async def session_manifests(self, d: str) -> list[dict[str, Any]]:
        """Every host's manifest of session ``d`` (one LIST, then the GETs). Raises
        CorruptPage naming an unreadable one."""
        keys = [
            k
            for prefix in manifest_prefixes(d)
            for k in await self.store.list_all(prefix)
            if is_session_manifest(k, d)
        ]
        keys = list(dict.fromkeys(keys))
        out = []
        for key in keys:
            try:
                raw = await self.store.get(key)
            except FileNotFoundError:
                continue  # deleted since the listing
            try:
                out.append(parse_manifest(raw))  # type: ignore[arg-type]
            except ValueError as e:
                raise CorruptPage(f"manifest {key} in {self.store.url} is unreadable: {e}") from e
        return out

    # -- keeping the archive in step with deletes --------------------------------------------
    async def flush_pending(self) -> None:
        """Rewrite queued manifests, then delete queued blob objects that no manifest in the
        archive references (manifests first: no manifest ever names a deleted object)."""
        pending = await _thread(self.aindex.pending, "manifest")
        if len(pending) > 1:
            # Manifests that will name content they do not name yet go first (a rename's
            # destination before its source): a failure between the two writes leaves a
            # page named twice for a while, never by no manifest at all.
            idx = self.engine.index

            def gains(d: str) -> bool:
                return not idx.archived_hashes(d) <= {h for _, h in self.named.get(d, ())}

            first = await trio.to_thread.run_sync(lambda: {d for d in pending if gains(d)})
            pending.sort(key=lambda d: d not in first)
        for d in pending:
            await self.write_manifest(d)
            log_event("spill", target=d, reason="pending-manifest")
        # The queue may hold an entry for every page deleted while gc_grace or an archive
        # outage held it: collected COLLECT_ROWS at a time, each chunk a collection of its
        # own (its intent written before it reads the manifests: kvfs/_collect.py).
        cutoff = time.time() - self.policy.cfg.gc_grace
        began = time.monotonic()
        after = ""
        while True:
            keys = await _thread(self.aindex.pending_chunk, "forget", cutoff, after, COLLECT_ROWS)
            if not keys:
                return
            if time.monotonic() - began > self.collector.window / 2:
                # One pass deletes for as long as one collection may, as when the whole
                # queue was one: the other background steps wait for it.
                log.warning(
                    "archive collection stopped after %.0f s; %d objects stay queued",
                    time.monotonic() - began,
                    await _thread(self.aindex.pending_count, "forget"),
                )
                return
            after = keys[-1]
            # (leased: a reader holds it, an open file: stays queued for a later pass)
            cands = [h for h in map(bytes.fromhex, keys) if not self.engine.is_leased(h)]
            if not cands:
                continue
            gone = await self._collect(cands)
            if len(gone) < len(cands):
                return  # stopped (its window, an unreadable manifest): the rest stays queued

    async def _collect(self, cands: list[bytes]) -> list[bytes]:
        """One collection of ``cands`` (queued to be forgotten, not leased): deletes the
        objects no manifest names and settles them in the queue. Returns those settled."""

        async def referenced() -> set[bytes] | None:
            return await self._named(frozenset(cands))

        async def unheld(h: bytes) -> bool:
            # Held again here meanwhile, as data the archive holds: its object stays, and
            # that row's last reference queues it again. A put of the same bytes makes a
            # row the archive does not hold (its spill uploads it again): that row never
            # queues the object, so it goes now, or it stayed in the bucket for good.
            if self.engine.is_leased(h):
                return False
            b = await _thread(self.engine.index.blob, h)
            return b is None or not b.archived

        async def delete(h: bytes) -> None:
            await self.store.delete(blob_key(h))
            log_event(
                "archive-delete", level=logging.DEBUG, content=h.hex()[:16], reason="last-reference"
            )

        gone = await self.collector.collect(cands, referenced, unheld, delete)
        await _thread(self.aindex.done, "forget", [h.hex() for h in gone])
        return gone

    async def _named(self, want: frozenset[bytes]) -> set[bytes] | None:
        """Which of ``want`` any manifest in the archive names; None when one is unreadable
        (its pages are unknown, so nothing is known to be unreferenced: the caller deletes
        nothing and its queue stays for a later pass).

        A manifest whose version tag (S3: the ETag its listing returns) is the one this host
        read before is not read again: a collection costs a LIST per 1,000 manifests plus
        a GET per manifest changed since the last one, not a GET per manifest. Stores
        without tags (``file://``, a local directory) are read whole every time. Each
        manifest read is folded into the answer as it arrives, ``concurrency`` at a time:
        beyond the tags' cache, memory is that of the manifests being read, not of all."""
        listing = await self.store.list_versions(MANIFESTS)
        cache = self._named_cache
        named: set[bytes] = set()
        kept: dict[str, tuple[str, frozenset[bytes]]] = {}
        unreadable = False

        async def fold(key: str, version: str) -> None:
            nonlocal unreadable
            if version and key in cache and cache[key][0] == version:
                hashes = cache[key][1]
            else:
                m = await self._get_manifest(key)
                if m is _GONE:
                    return  # deleted since the listing
                if isinstance(m, ValueError):
                    if not unreadable:
                        unreadable = True
                        _unreadable(key, m, "archive object deletion", "nothing deleted this pass")
                        reading.cancel()  # (the answer is None: the others need not be read)
                    return
                assert isinstance(m, dict)
                hashes = frozenset(bytes(p["hash"]) for p in m["pages"])
            if version:
                kept[key] = (version, hashes)
            named.update(want & hashes)

        with trio.CancelScope() as reading:
            await self._each(listing, lambda kv: fold(*kv))
        if unreadable:
            return None
        self._named_cache = kept
        return named

    async def _get_manifest(self, key: str) -> dict[str, Any] | ValueError | object:
        """The manifest under ``key``, parsed; the ValueError that says why when it is
        unreadable, :data:`_GONE` when it was deleted since it was listed. Raises
        ArchiveUnavailable."""
        try:
            raw = await self.store.get(key)
        except FileNotFoundError:
            return _GONE
        try:
            return parse_manifest(raw)  # type: ignore[arg-type]
        except ValueError as e:
            return e

    async def _each(self, items: Iterable[T], fn: Callable[[T], Awaitable[None]]) -> None:
        """``await fn(item)`` for each of ``items``, ``concurrency`` at a time: that many
        tasks take the items in turn, so the items not begun hold no task (a task waiting
        for each, as before, was in proportion to the archive). Raises the first error."""

        async def worker() -> None:
            for item in it:  # (shared: next() does not checkpoint, so no item is taken twice)
                await fn(item)

        it = iter(items)
        async with one_error_nursery() as n:
            for _ in range(max(1, self.policy.cfg.concurrency)):
                n.start_soon(worker)

    # -- other hosts' sessions ------------------------------------------------------------
    async def archived_sessions(self) -> list[dict[str, object]]:
        """Every session with a manifest in the archive (from any host sharing it); a session
        several hosts hold is listed once, with the union of their pages.

        Read ``concurrency`` sessions at a time, each session's manifests (found together
        by their keys) merged into its entry before the next session's are read: memory is
        an entry and a key per session, not every page of the archive."""
        keys = await self.store.list_all(MANIFESTS)
        groups: dict[str, list[int]] = {}  # a session's part of its keys -> their places
        for i, key in enumerate(keys):
            groups.setdefault(_key_group(key), []).append(i)
        # session -> (the place of its first manifest read, its entry; None: no pages)
        entries: dict[str, tuple[int, dict[str, object] | None]] = {}
        # a session one of whose manifests cannot be read is left out, not listed from the
        # others: its restore raises CorruptPage "unreadable" (it may name pages they lack).
        # By its key's group: a long name's key holds only part of the name (and a hash)
        unreadable: set[str] = set()
        # manifests naming a session other than their keys' (none kvfs writes): merged
        # with that session's at the end
        strays: list[tuple[int, str, dict[str, Any]]] = []

        async def read(places: list[int]) -> list[tuple[int, str, dict[str, Any]]]:
            """The group's manifests that read, each with its place and its session."""
            out = []
            for i in places:
                m = await self._get_manifest(keys[i])
                if m is _GONE:
                    continue  # deleted since the listing
                if isinstance(m, ValueError):  # not listed; said, so a lost session is no mystery
                    _unreadable(keys[i], m, "archived session manifest", "not listed")
                    unreadable.add(_key_group(keys[i]))
                    continue
                assert isinstance(m, dict)
                # The manifest names its session; a long name's key holds only part of it.
                d = m.get("session") if isinstance(m.get("session"), str) else None
                out.append((i, d or session_of_manifest_key(keys[i]), m))
            return out

        def enter(d: str, ms: list[tuple[int, str, dict[str, Any]]]) -> None:
            ms.sort(key=lambda x: x[0])  # (in the listing's order, as merge_manifests had them)
            entries[d] = (ms[0][0], _session_entry([m for _, _, m in ms]))

        async def one(group: str) -> None:
            by_session: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
            for i, d, m in await read(groups[group]):
                if session_key_part(d) == group:
                    by_session.setdefault(d, []).append((i, d, m))
                else:
                    strays.append((i, d, m))
            for d, ms in by_session.items():
                enter(d, ms)

        await self._each(list(groups), one)
        for d in sorted({d for _, d, _ in strays}):
            # its own group was read without these: again, with them
            group = session_key_part(d)
            ms = [x for x in await read(groups.get(group, [])) if x[1] == d]
            enter(d, ms + [x for x in strays if x[1] == d])
        return [
            e
            for d, (_, e) in sorted(entries.items(), key=lambda x: x[1][0])
            if e is not None and session_key_part(d) not in unreadable
        ]

    async def import_session(self, d: str) -> int:
        """Add the pages of the session's manifest this index lacks (archive-only: they list
        and restore on access). Returns pages added. Raises SessionNotFound when neither the
        index nor the archive knows the session."""
        if d in await _thread(self.aindex.pending, "manifest"):
            # This host changed the session (a delete, a rename) since its manifest was
            # written: importing the stale one would bring deleted pages back. Write it now.
            await self.write_manifest(d)
        # Nor may a delete that lands while the manifest is fetched, or one this host made
        # and has not written yet (its rewrite not even queued): the import adds nothing
        # unless every removal from the session is in a manifest written before the fetch.
        removals = self.engine.index.removals
        at_fetch = removals[d]
        written = self.written.get(d, 0) >= at_fetch
        started = time.monotonic()
        ms = await self.session_manifests(d)
        merged = merge_manifests(ms) if ms else None
        if merged is None or not merged["pages"]:
            if await _thread(self.engine.index.session, d) is None:
                raise SessionNotFound(f"no session {session_name(d)!r} here or in {self.store.url}")
            return 0
        added, replaced, freed = await _thread(
            self.aindex.import_manifest,
            merged,
            lambda: written and removals[d] == at_fetch,
            self.engine.store_id,
        )
        if replaced:  # older pages of this host's, replaced by newer ones of another's
            await _thread(after_delete, self.engine, replaced, freed)
        if added:  # (its manifest is queued: an archive down now gets it written later)
            try:
                await self.write_manifest(d)
                added -= await self._drop_collected_imports(d, merged, started)
            except ArchiveUnavailable as e:
                self._failed(f"the manifest of {d} after its import", e, "next pass")
        return added

    async def _drop_collected_imports(self, d: str, merged: dict, started: float) -> int:
        """After the manifest naming what an import added is written: the pages whose
        objects a collection deleted meanwhile go again. Their owner deleted them after this
        host read its manifest, and its collection read the manifests before this host's
        existed; kept, they listed here and in this host's manifest, and no read of them
        could ever succeed. :meth:`Collector.settle` says which objects a collection may
        have taken (those its intents name: a HEAD each, only while one ran); the others
        are named by a manifest the collection read. Returns the pages dropped."""
        hashes = sorted({bytes(p["hash"]) for p in merged["pages"]})
        check = await self.collector.settle(hashes, hashes, started)
        await self._verify_referenced(check)  # (content held here too goes up again)

        def archive_only(h: bytes) -> bool:
            b = self.engine.index.blob(h)
            return b is not None and not b.local and b.archived

        gone_objects = [
            h
            for h in check
            if await _thread(archive_only, h) and not await self.store.exists(blob_key(h))
        ]
        if not gone_objects:
            return 0
        pages = [
            (path, h)
            for h in gone_objects
            for s, path in await _thread(self.aindex.pages_holding, h)
            if s == d
        ]

        def delete_unless_put_again() -> tuple[list[Any], list[Any]]:
            # (in one transaction with the check: a put of the path meanwhile, or of these
            # bytes, which made them local again, keeps its page)
            idx = self.engine.index
            with idx.transaction() as db:
                still = [
                    path
                    for path, h in pages
                    if db.execute(
                        "SELECT 1 FROM pages p JOIN blobs b ON b.hash=p.hash"
                        " WHERE p.path=? AND p.hash=? AND b.extents IS NULL",
                        (path, h),
                    ).fetchone()
                ]
                return idx._delete_pages(db, still)

        gone, freed = await trio.to_thread.run_sync(delete_unless_put_again)
        await _thread(after_delete, self.engine, gone, freed)
        for p in gone:
            log.info(
                "%s: deleted by its owner while this host imported it (its archive object "
                "is gone); it is not listed here",
                p.path,
            )
        await self.write_manifest(d)
        return len(gone)

    # -- background -------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: keep the archive in step, and when local use passes the high watermark,
        spill the coldest unpinned cold sessions until it is under the low watermark."""
        cfg = self.policy.cfg
        if cfg.interval <= 0:
            await trio.sleep_forever()
        steps = (
            ("archive manifests and deletes", self.flush_pending),
            ("watermark spill pass", self.relieve_pressure),
            ("retention pass", self.expire_sessions),
        )
        while True:
            await trio.sleep(cfg.interval)
            # Each step on its own: manifests queued while the endpoint is down must not
            # stop retention here, nor one session that cannot spill stop the others.
            for what, step in steps:
                try:
                    await step()
                except Exception as e:  # noqa: BLE001 - one pass lost, never the daemon
                    self._failed(what, e, "next pass")

    def _failed(self, what: str, e: Exception, retry: str) -> None:
        """A background task's failure: counted, logged as a warning (with the traceback
        when it is not one of the archive's expected failures), retried later. A failing
        disk's error (IndexUnavailable, a data disk's I/O error), which every pass meets
        while it lasts, is one warning per DEVICE_ERROR_LOG_SECONDS with the count of those
        since (``more``), and no traceback."""
        self.policy.count("errors")
        disk = disk_failed(e)
        # (each pass, every spill_interval, was an ERROR with a traceback while it failed)
        more = disk_error_due(self) if disk else 0
        if more is None:
            return
        log_event(
            "error",
            level=logging.WARNING,
            what=what,
            error=type(e).__name__,
            message=str(e),
            retry=retry,
            **({"more": more} if more else {}),
        )
        if not (disk or isinstance(e, (ArchiveUnavailable, CorruptPage))):
            log.error("unexpected error in the %s", what, exc_info=e)

    async def _forget_retired(self, hashes: list[bytes]) -> None:
        """Queue what a retired host's manifest named for collection, before that manifest
        is deleted (collected once no manifest names it; queued first, nothing is missed)."""
        if hashes:
            await _thread(self.aindex.enqueue, "forget", sorted({h.hex() for h in hashes}))

    async def tombstones(self) -> list[str]:
        """This host's manifests that hold no pages (it took the session over from other
        hosts and deleted it: build_manifest), by session key part: its heartbeat lists
        them, so that kvfs hosts counts only sessions holding pages without reading them."""
        return [session_key_part(d) for d in await _thread(self.aindex.tombstones)]

    async def heartbeat_missing(self) -> None:
        """This host's heartbeat is not in the archive. The first time (a new store, or one
        that never ran a background task) nothing follows; when this store wrote one
        before, another host took it for gone and may have deleted its manifests: every
        one is written again (:meth:`rewrite_all_manifests`)."""
        idx = self.engine.index
        if await _thread(idx.get_meta, "heartbeat_written") is None:
            await _thread(idx.set_meta, "heartbeat_written", 1)
            return
        await self.rewrite_all_manifests()

    async def rewrite_all_manifests(self) -> None:
        """Queue a manifest rewrite for every session holding archived pages. The rewrites,
        and the existence checks before any local copy is dropped, follow as usual."""
        self.named, self.written = {}, {}  # (new dicts: other tasks may be reading these)
        sessions = await _thread(self.engine.index.sessions_with_archived_pages)
        if sessions:
            await _thread(self.aindex.enqueue, "manifest", sessions)

    async def heartbeats(self) -> None:
        """Forever, beside :meth:`run` (a long spill pass must not silence this host): this
        host's heartbeat, and the retirement of hosts silent for good (kvfs/_hosts.py)."""
        next_sweep = 0.0
        while True:
            try:
                await self.hosts.tick()
            except Exception as e:  # noqa: BLE001 - one heartbeat lost, never the daemon
                self._failed("archive heartbeat", e, "next heartbeat")
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + UPLOAD_SWEEP_SECONDS
                await self.sweep_uploads()
            await trio.sleep(self.hosts.interval)

    async def sweep_uploads(self) -> int:
        """Abort what puts cut short left in the archive more than UPLOAD_STALE_SECONDS ago
        (kvfs/objectstore: a killed upload worker's incomplete multipart uploads, billed by
        S3 and listed nowhere else). Returns how many went; never raises. Credentials that
        may not do it get one warning, and the bucket's lifecycle rule is then the way (as
        for a server that cannot: the store says so once, and finds nothing after)."""
        if self._sweep_denied:
            return 0
        try:
            # (only kvfs's own objects large enough to be sent in parts: a store at a
            # bucket's root must not abort other programs' uploads)
            gone = 0
            for prefix in (BLOBS, MANIFESTS):
                gone += await self.store.abort_stale_uploads(UPLOAD_STALE_SECONDS, prefix)
        except ArchiveAccessDenied as e:
            self._sweep_denied = True
            log.warning(
                "%s; incomplete uploads of killed puts are left to the bucket's lifecycle "
                "rule (AbortIncompleteMultipartUpload: docs/archive.md)",
                e,
            )
            return 0
        except Exception as e:  # noqa: BLE001 - one sweep lost, never the daemon
            self._failed("sweep of incomplete uploads", e, "next sweep")
            return 0
        if gone:
            self.policy.count("uploads_aborted", gone)
            log_event("uploads-aborted", count=gone, older_than_s=UPLOAD_STALE_SECONDS)
        return gone

    async def relieve_pressure(self) -> int:
        """One watermark pass. Returns the number of sessions spilled."""
        eng, cfg = self.engine, self.policy.cfg
        if eng.used <= cfg.high_watermark * eng.capacity:
            return 0
        await _thread(eng.flush_atimes)
        now = time.time()
        cands = sorted(
            (
                s
                for s in await _thread(eng.index.sessions)
                if not s.pinned and now - s.atime >= cfg.idle_seconds
            ),
            key=lambda s: s.atime,
        )
        n = 0
        for s in cands:
            if eng.used <= cfg.low_watermark * eng.capacity:
                break
            if self._spill_failed.get(s.dir, 0.0) > time.monotonic():
                continue  # failed a little while ago: the others first
            local = (await _thread(eng.index.session_usage, s.dir))["local_bytes"]
            if local == 0 or self._no_gain.get(s.dir) == local:
                continue  # (what it holds here stays: pinned, or shared with a live session)
            t0 = time.monotonic()
            try:
                sent = await self.spill_session(s.dir, True, keep_pinned=True)
            except SessionNotFound:
                continue  # deleted since the listing
            except ArchiveUnavailable:
                raise  # the next session would fail the same way
            except Exception as e:  # noqa: BLE001 - one session (a damaged page) only
                self._spill_failed[s.dir] = time.monotonic() + SPILL_RETRY_SECONDS
                self._failed(f"watermark spill of {s.dir}", e, f"in {SPILL_RETRY_SECONDS:g} s")
                continue
            self._spill_failed.pop(s.dir, None)
            # What a spill leaves local stays (pinned pages, content live sessions share):
            # the session is not spilled again for it, a manifest written each pass, until
            # it changes
            after = (await _thread(eng.index.session_usage, s.dir))["local_bytes"]
            self._no_gain[s.dir] = after
            log_event(
                "spill", target=s.dir, reason="pressure", bytes=sent, seconds=time.monotonic() - t0
            )
            n += 1
        return n

    async def expire_sessions(self) -> int:
        """One retention pass (``retention`` > 0): delete from every tier each unpinned
        session, holding no pinned page, untouched for ``retention`` seconds. Runs at most
        every tenth of the retention (a minute at most), since it lists every session.
        Returns the number of sessions deleted."""
        eng, retention = self.engine, self.policy.cfg.retention
        if retention <= 0 or time.monotonic() < self._next_expiry:
            return 0
        self._next_expiry = time.monotonic() + min(60.0, retention / 10)
        # Ages are by this host's clock (its sessions' last accesses are): one that jumped
        # ahead (a wrong clock at boot, a VM restored, NTP stepping) made every session look
        # old, and this pass deleted them from every tier. So it runs only while this clock
        # agrees with the archive's, by a heartbeat from the last two intervals (written
        # now if none is: ArchiveUnavailable skips the pass, as an outage does).
        if self.hosts.clock_ahead is None or self.hosts.beaten_at is None or self.hosts.overdue():
            await self.hosts.beat()
        ahead, allowed = self.hosts.clock_ahead, min(CLOCK_AHEAD_SECONDS, retention / 10)
        if ahead is None:  # (the heartbeat it just wrote is not there: the next pass)
            return 0
        self.retention_paused = ahead if ahead > allowed else None
        if ahead > allowed:
            if self._clock_warning.due() is not None:
                log_event(
                    "retention-paused",
                    level=logging.WARNING,
                    why="this host's clock is ahead of the archive's",
                    ahead_s=round(ahead),
                    allowed_s=round(allowed, 1),
                )
            return 0
        await _thread(eng.flush_atimes)
        now = time.time()
        cutoff = now - retention
        n = 0
        for s in await _thread(eng.index.sessions):
            if s.pinned or s.atime >= cutoff or s.dir in self._active:
                continue
            pages = await _thread(self._expire, s.dir, cutoff)
            if pages is None:
                continue  # touched or pinned since the listing
            n += 1
            self.policy.count("sessions_expired")
            log_event("expire", target=s.dir, pages=pages, idle_seconds=round(now - s.atime))
        return n

    def _expire(self, d: str, cutoff: float) -> int | None:
        """Engine.expire_session, in a worker thread that :meth:`expiring` names ``d`` in
        meanwhile (the index's transaction runs in it, and so does queue_changes)."""
        self._expiring.session = d
        try:
            return self.engine.expire_session(d, cutoff)
        finally:
            self._expiring.session = None

    def expiring(self) -> str | None:
        """The session a retention pass is deleting in this thread, if any.

        Its deletion must not speak for the other hosts that hold the session: this host's
        retention says only that this host has not touched it, and another host may be
        using it now. So the transaction that deletes it also forgets the other hosts'
        manifest versions it imported (ArchivingPolicy.queue_changes): this host's manifest
        of it is then deleted, not kept as a tombstone superseding theirs, which hid the
        session from every host while its other host still held it. An explicit delete
        (``kvfs rm``) keeps the tombstone: it is the user's, for every host."""
        return getattr(self._expiring, "session", None)


def _key_group(key: str) -> str:
    """The part of a manifest's key that all manifests of its session share: the session's
    :func:`session_key_part` (that of the whole name, for a long one's key from before names
    were cut)."""
    part = key[len(MANIFESTS) :].split("@", 1)[0]
    if "+" in part or len(part) <= NAME_IN_KEY_MAX:  # (a cut name's part holds its "+")
        return part
    return session_key_part(unquote(part))


def _session_entry(ms: list[dict[str, Any]]) -> dict[str, object] | None:
    """A session's entry in :meth:`Spiller.archived_sessions` from its manifests; None when
    their union holds no pages (deleted on the hosts whose manifests count: tombstones)."""
    m = merge_manifests(ms)
    if not m["pages"]:
        return None
    # (a pin whose end has passed is none: its host may have died before it could write
    # the manifest unpinned)
    pinned = pinned_now(m, time.time())
    return {
        "session": m["name"],
        "dir": m["session"],
        "pages": len(m["pages"]),
        "bytes": sum(p["size"] for p in m["pages"]),
        "attrs": m["attrs"],
        "pinned": pinned,
        "pin_until": m.get("pin_until") if pinned else None,
        "created": m["created"],
        "atime": m["atime"],
        "spilled_at": m["spilled_at"],
        "store_id": m["store_id"],
        "hosts": len(ms),
    }


def _unreadable(key: str, why: ValueError, what: str, outcome: str) -> None:
    """A warning event for a manifest that cannot be parsed (``why``: parse_manifest's
    error, saying what is wrong with it), and what was done about it."""
    log_event(
        "error",
        level=logging.WARNING,
        what=what,
        key=key,
        error="CorruptPage",
        message=f"the manifest is unreadable; {outcome}",
        reason=str(why),
    )
