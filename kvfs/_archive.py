"""The archive tier: :class:`ArchivingPolicy` spills before it evicts and restores on access.

Installed by the engine when ``StoreConfig.archive_url`` is set. Settings come from
``StoreConfig.extra["archive"]`` (see :class:`ArchiveConfig` and docs/archive.md).

The engine is synchronous and calls this policy from worker threads; the object stores are
trio coroutines. :meth:`ArchivingPolicy.call` bridges the two: onto the store's trio loop
when the background task runs there (``open_store``), else a short private ``trio.run``
in the calling thread (``SyncStore``, scripts).

Ordering that makes a crash harmless (what each step leaves behind):

1. blob objects are uploaded (conditional put: identical content from any session or host
   is stored once) and confirmed; a crash here leaves objects nothing references yet, and
   the next spill finds them (HEAD) and does not upload them again;
2. the blobs are marked ``archived`` in the index;
3. the session's manifest is written (one PUT: the previous or the new one is visible);
4. only then are local copies dropped (index first, then the files; files a crash leaves
   are swept at the next start). Without step 3 confirmed nothing local is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from objectstore._abc import one_error_nursery

from ._checksum import leaves_of, tree_hash
from ._codec import CodecChoice, elem_size, encode
from ._config import parse_duration, parse_size
from ._errors import (
    ArchiveAccessDenied,
    ArchiveUnavailable,
    CapacityExceeded,
    CorruptPage,
    DiskFull,
    KvfsError,
    PageNotFound,
)
from ._events import log_event
from ._index import SCAN_ROWS, BlobRow, PageRow
from ._local import fsync_dir, is_disk_error
from ._manifest import MANIFESTS, ArchiveIndex, blob_key, forget_imports_in
from ._policy import TieringPolicy
from ._spill import Spiller
from ._uploader import (
    BlobJob,
    ByteLimiter,
    MissingObject,
    Restored,
    RestoreJob,
    TierSpec,
    Uploaded,
    UploadPool,
    WorkerUnavailable,
    _unavailable,
    decode_verified,
    scratch_buffer,
    write_restored,
)

if TYPE_CHECKING:
    from ._engine import Engine
    from ._local import BlobWriter

__all__ = ["ArchiveConfig", "ArchivingPolicy"]

T = TypeVar("T")

#: archived blobs looked for in an archive configured in place of the recorded one
IDENTITY_SAMPLE = 8
#: ``progress(done, total)`` for a long operation, in bytes
Progress = Callable[[int, int], None]
log = logging.getLogger("kvfs.archive")


@dataclass(frozen=True)
class ArchiveConfig:
    """Archive settings (``StoreConfig.extra["archive"]``, a dict of these names)."""

    #: zstd level for spilled pages (1-19). 1: on byte-shuffled KV it compresses as well as 3
    #: (bf16/fp32 slightly better) at up to 2x the speed (docs/benchmarks.md, Archive tier)
    zstd_level: int = 1
    #: auto (try byte-shuffle and plain zstd on a sample, keep the smaller), zstd, zstd+shuffle, raw
    codec: str = "auto"
    #: seconds untouched after which a session is cold and may be spilled by the background task
    idle_seconds: float = 300.0
    #: fraction of capacity above which cold sessions spill, and the level they spill down to
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    #: seconds between background passes (0 disables the background spiller)
    interval: float = 1.0
    #: objects uploaded/downloaded at once
    concurrency: int = 8
    #: pages compressed at once (0: half the CPUs), leaving CPU to foreground reads; used
    #: when ``upload_processes`` is 0
    cpu_slots: int = 0
    #: worker processes that read, compress and upload spilled pages (0: threads of this
    #: process); out of the daemon's process, boto3 does not hold the GIL foreground reads need
    upload_processes: int = 2
    #: seconds a deleted blob waits before its archive object is removed (other hosts' spills
    #: that are just adding a reference finish first)
    gc_grace: float = 0.0
    #: seconds that bound one collection of unreferenced objects: a collection stops
    #: deleting half this after announcing itself, and another host waits at most this for
    #: one left unfinished (kvfs/_collect.py)
    gc_window: float = 300.0
    #: bytes a put that must make room frees beyond its own need (at most an eighth of the
    #: capacity): the puts after it find room, and a session's manifest is rewritten once
    #: per batch of evictions instead of once per evicted page
    evict_ahead: int = 64 << 20
    #: seconds a session may stay untouched before the background task deletes it from every
    #: tier (this host's and the archive's); pinned sessions and sessions holding a pinned
    #: page are kept. 0: sessions are kept until deleted
    retention: float = 0.0
    #: bytes of archive-only pages kept in memory to serve reads when the local tier has no
    #: room for them (its capacity held by pinned pages, open files or writes in flight)
    memory_copies: int = 256 << 20
    #: without a background task, seconds a delete may spend updating the archive (the rest
    #: stays queued in the index and is done by the next spill, close or background pass)
    sync_cleanup_seconds: float = 5.0
    #: options for open_objectstore (endpoint, region, addressing, deadline, ...)
    store_options: dict | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, object]) -> ArchiveConfig:
        """The settings in ``extra["archive"]``, sizes and durations as numbers or as the
        configuration file writes them ("256MiB", "7d"). Raises ValueError naming a setting
        that is unknown (with the name meant, where a close one or its configuration file
        name is given) or of the wrong kind."""
        from ._settings import ARCHIVE_FIELDS, OPTIONS, closest

        raw = dict(extra.get("archive") or {})  # type: ignore[call-overload]
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            hints = []
            for u in unknown:
                meant = ARCHIVE_FIELDS.get(u) or closest(u, names)
                hints.append(f"{u} ({meant}?)" if meant in names else u)
            raise ValueError(f"unknown archive setting(s): {', '.join(hints)}")
        # The sizes and durations take the strings the configuration file takes ("256MiB",
        # "7d"), as StoreConfig's sizes do: given in extra, "256MiB" was "no int".
        for opt in OPTIONS:
            name = ARCHIVE_FIELDS.get(opt.name)
            if name not in raw or not isinstance(raw[name], str):
                continue
            try:
                if opt.kind == "duration":
                    raw[name] = parse_duration(raw[name])
                elif opt.kind == "size":
                    raw[name] = parse_size(raw[name])
            except ValueError as e:
                raise ValueError(f"archive setting {name}: {e}") from None
        for f in fields(cls):
            if f.name in raw and not _of_kind(raw[f.name], f.default):
                kind = "dict" if f.default is None else type(f.default).__name__
                raise ValueError(f"archive setting {f.name}: {raw[f.name]!r} is no {kind}")
        cfg = cls(**raw)
        # (NaN passes no comparison: each bound is written so that it fails it)
        for name in ("idle_seconds", "interval", "gc_grace", "sync_cleanup_seconds"):
            if not getattr(cfg, name) >= 0:  # (nan: the spiller's sleep raised at its first pass)
                raise ValueError(f"archive {name} must be >= 0 seconds")
        if cfg.concurrency < 1:  # (0 failed the open with "max_workers must be greater than 0")
            raise ValueError("archive concurrency must be >= 1")
        if cfg.cpu_slots < 0:
            raise ValueError("archive cpu_slots must be >= 0 (0: half the CPUs)")
        if cfg.upload_processes < 0:
            raise ValueError("archive upload_processes must be >= 0")
        if cfg.memory_copies < 0:
            raise ValueError("archive memory_copies must be >= 0 bytes")
        if cfg.evict_ahead < 0:
            raise ValueError("archive evict_ahead must be >= 0 bytes")
        if not cfg.retention >= 0:
            raise ValueError("archive retention must be >= 0 seconds (0: keep sessions)")
        if not cfg.gc_window > 0:
            raise ValueError("archive gc_window must be > 0 seconds")
        if not 0 < cfg.low_watermark <= cfg.high_watermark <= 1:
            raise ValueError("archive watermarks need 0 < low_watermark <= high_watermark <= 1")
        return cfg


def _of_kind(value: object, default: object) -> bool:
    """Whether ``value`` may stand where ``default`` does (an int for a float; no bool for
    a number; a dict or None for None)."""
    if default is None:
        return value is None or isinstance(value, dict)
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def archive_identity(url: str | None) -> str:
    """Where an archive's objects are, without the options that only say how to reach them
    (endpoint, region, deadlines): ``s3://bucket/prefix`` or ``file:///real/path``."""
    from objectstore import parse_url

    scheme, where, q = parse_url(str(url))
    if scheme == "file":
        return f"file://{os.path.realpath(where)}"
    return f"s3://{where}/{q.get('prefix', '')}"


def worth_probing(refs: int) -> bool:
    """Whether a spill should HEAD a blob's object before uploading it.

    Every upload is a conditional create, so an object that exists is never written twice
    either way; the HEAD only saves sending its bytes. That pays for content likely to be
    there already: data several local pages share (a common system prompt, which other
    hosts hold too). A blob only one page references is almost always new, and the HEAD
    would be a request for nothing (docs/benchmarks.md: spill throughput +18% without them).
    """
    return refs > 1


def _low_priority() -> None:
    """Lowest CPU priority (nice 19) for the calling thread; Linux sets it per thread."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class _Staged:
    """A restored blob's durable local files, not yet named by the index."""

    h: bytes
    size: int
    writer: BlobWriter  # its abort() removes the files, whoever wrote them
    extents: tuple
    disk: int
    need: int
    dirs: tuple[str, ...]  # to fsync before the index commit


class ArchivingPolicy(TieringPolicy):
    """LRU eviction that uploads before dropping, restores on access, and spills sessions."""

    lossy_eviction = False  # what goes is in the archive

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        from objectstore import open_objectstore  # here: objectstore imports kvfs._errors

        self.cfg = ArchiveConfig.from_extra(engine.config.extra)
        self.url = engine.config.archive_url
        self.aindex = ArchiveIndex(engine.index)
        #: why the current room-making pass stopped: the archive could not be reached
        self._unreachable: str | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        options = dict(self.cfg.store_options or {})
        idx = engine.index
        recorded, ident = idx.get_meta("archive"), archive_identity(self.url)
        moved = recorded not in (None, ident) and idx.has_archived()
        if self.url.startswith("file:") and (moved or recorded == ident and idx.has_archive_only()):
            # It holds pages this store has nowhere else: a missing directory is a share not
            # mounted now, not a new archive to create (in the empty mount point). Another
            # archive than the one recorded is refused unless it holds this store's objects
            # (_check_identity): a missing one cannot, and is not made only to be refused.
            options.setdefault("create", False)
        try:
            self.store = trio.run(lambda: open_objectstore(self.url, **options))
        except ArchiveUnavailable as e:
            if moved:
                raise ArchiveUnavailable(
                    f"this store's archived pages are in {recorded}, but the archive "
                    f"configured is {self.url}: {e} (configure {recorded} again, or copy its "
                    "objects to the new location first)"
                ) from e
            raise
        try:
            self._check_identity()
        except BaseException:
            trio.run(self.store.aclose)
            raise
        self._lock = threading.Lock()
        self._inflight: dict[bytes, Future[BlobRow]] = {}
        #: archive-only pages served from memory for want of local room (copy_in_memory)
        self._memory: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._memory_bytes = 0
        #: downloads into memory in flight, shared by the readers of the same data
        self._memory_inflight: dict[bytes, Future[bytes]] = {}
        # File removals after a spill (an unlink costs ~2.5 ms here; several at once ~half)
        self._io = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="kvfs-archive-io")
        self.restore_latencies: collections.deque[float] = collections.deque(maxlen=1024)
        #: every restore's seconds since the store opened (blobs_restored counts them)
        self.restore_seconds = 0.0
        self.counters: collections.Counter[str] = collections.Counter()
        self.codecs: dict[bytes, str] = {}
        # Compression runs in its own few threads at the lowest CPU priority: a spill takes
        # the CPU that foreground reads leave, and at most ``cpu_slots`` pages at once.
        self._cpu = ThreadPoolExecutor(
            self.cfg.cpu_slots or max(1, (os.cpu_count() or 2) // 2),
            thread_name_prefix="kvfs-compress",
            initializer=_low_priority,
        )
        self._choice = CodecChoice()
        self.uploads: UploadPool | None = None
        if self.cfg.upload_processes > 0:
            self.uploads = UploadPool(
                self.url,
                dict(self.cfg.store_options or {}),
                processes=self.cfg.upload_processes,
                concurrency=self.cfg.concurrency,
                level=self.cfg.zstd_level,
                codec=self.cfg.codec,
            )
        self.spiller = Spiller(self)

    def _check_identity(self) -> None:
        """The index's archived flags are only true of the archive they were set against: an
        archive-only page would be unreadable in another one, and an eviction would drop the
        last local copy of a page it only believes archived. So a store whose index has
        archived anything opens only with the archive it recorded, or with one that holds
        its objects (a copy, moved there): a few of them are looked for. (Holding sessions
        of the same names says nothing: engines name their directories alike on every
        host.) Raises ArchiveUnavailable."""
        idx = self.engine.index
        ident = archive_identity(self.url)
        recorded = idx.get_meta("archive")
        if recorded is not None and idx.has_archived():
            sample = idx.archived_sample(IDENTITY_SAMPLE)

            async def holds_one() -> bool:
                for h in sample:
                    if await self.store.exists(blob_key(h)):
                        return True
                return False

            async def any_manifest() -> bool:
                keys = self.store.list(MANIFESTS)
                try:
                    async for _ in keys:
                        return True
                    return False
                finally:
                    close = getattr(keys, "aclose", None)
                    if close is not None:
                        await close()

            held = trio.run(holds_one)
            if not held and recorded != ident:
                raise ArchiveUnavailable(
                    f"this store's archived pages are in {recorded}, but the archive configured "
                    f"is {self.url}, which holds none of the {len(sample)} of its objects "
                    f"looked for: configure {recorded} again, or copy its objects to the new "
                    "location first (kvfs then accepts it)"
                )
            # The same URL can name another place than before: a file:// archive on a share
            # not mounted now (an empty directory, or one made again), an emptied bucket.
            # Spills there would drop local copies that a remount then hides. Only a store
            # with pages held by the archive alone knows that something must be there: what
            # it also holds locally may have been collected (no manifest named it), and a
            # spill checks and uploads that again.
            if not held and idx.has_archive_only() and not trio.run(any_manifest):
                raise ArchiveUnavailable(
                    f"the archive {self.url} holds none of the {len(sample)} of this store's "
                    "objects looked for, and no manifest at all: is its file system mounted, "
                    "is it the right bucket? (nothing was changed)"
                )
            if recorded != ident:
                log.warning(
                    "archive moved: %s -> %s (it holds this store's objects)", recorded, ident
                )
        if recorded != ident:
            idx.set_meta("archive", ident)

    # -- bridging sync callers to the async object store ----------------------------------
    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``afn(*args)`` to completion from a thread that is not the trio loop."""
        tok = self._token
        if tok is not None:
            try:
                return trio.from_thread.run(afn, *args, trio_token=tok)
            except trio.RunFinishedError:
                pass
        return trio.run(afn, *args)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # -- upload ---------------------------------------------------------------------------
    def read_local(self, h: bytes) -> memoryview | None:
        """The verified bytes of a local blob (None if it is no longer local), in the calling
        thread's scratch buffer: valid until that thread's next read_local or restore. Holds
        a lease so a concurrent eviction cannot remove the files mid-read. Raises CorruptPage."""
        eng = self.engine
        with eng._cap_lock:
            eng._leases[h] += 1
        try:
            b = eng.index.blob(h)
            if b is None or b.extents is None:
                return None
            buf = scratch_buffer(b.size)
            try:
                for p in eng.tier.pieces(b.extents, 0, b.size):
                    eng.tier.read_piece(p, buf)
            except FileNotFoundError as e:  # (ENOENT made a write needing room fail so)
                raise CorruptPage(
                    f"a data file of {h.hex()[:16]} is missing ({e.filename}); not uploaded"
                ) from e
            if tree_hash(b.size, leaves_of(buf)) != h:
                raise CorruptPage(
                    f"local copy of {h.hex()[:16]} does not match its checksum; not uploaded"
                )
            return buf
        finally:
            eng._unlease(h)

    def _dtype_of(self, h: bytes) -> str | None:
        pages = self.engine.index.pages_of_blob(h)
        return pages[0].attrs.get("dtype") if pages else None

    def _encode(self, h: bytes) -> tuple[bytes, str] | None:
        """Read, verify and compress a local blob (None if it is no longer local). Runs in
        the low-priority ``kvfs-compress`` threads (``cpu_slots`` of them), so a spill leaves
        CPU to foreground reads."""
        data = self.read_local(h)
        if data is None:
            return None
        elem = elem_size(self._dtype_of(h)) or 2
        codec = self._choice.pick(self.cfg.codec, elem)
        obj, used = encode(data, level=self.cfg.zstd_level, codec=codec, elem=elem)
        self._choice.learn(codec, elem, used)
        return obj, used

    async def upload_many(
        self,
        hashes: list[bytes],
        *,
        mark: bool = True,
        fresh: set[bytes] | None = None,
        done: Callable[[list[bytes]], None] | None = None,
    ) -> int:
        """:meth:`upload_blob` for several blobs, ``concurrency`` at once: in the upload
        worker processes when there are any (kvfs/_uploader.py), else in this process;
        ``done(hashes)`` as blobs are archived (a worker's batch at a time). Returns bytes
        uploaded. Raises ArchiveUnavailable, CorruptPage (the first error)."""
        if self.uploads is None:
            total = 0
            limit = trio.CapacityLimiter(self.cfg.concurrency)
            # (not a nursery that cancels the others at the first error: an upload whose put
            # had landed was cancelled before it marked its blob archived, and its object
            # was never deleted with its session. As upload_batch does: the uploads not
            # begun are not tried, those under way finish; an unreachable archive cancels
            # them, as each would wait out its deadline.)
            failed: list[Exception] = []
            scope = trio.CancelScope()

            async def one(h: bytes) -> None:
                nonlocal total
                async with limit:
                    if failed:
                        return
                    try:
                        # (not ``total += await ...``: that reads total before the await,
                        # and the tasks finishing meanwhile were lost from the count)
                        n = await self.upload_blob(h, mark=mark, fresh=fresh)
                    except Exception as e:
                        failed.append(e)
                        if _unavailable([e]) is not None:
                            scope.cancel()
                        return
                    total += n
                if done is not None:
                    done([h])

            with scope:
                async with trio.open_nursery() as n:
                    for h in hashes:
                        n.start_soon(one, h)
            if failed:
                raise failed[0]
            return total
        uploads = self.uploads
        jobs = await trio.to_thread.run_sync(self._jobs, hashes)
        stored: list[bytes] = []

        def batch_done(us: list[Uploaded]) -> None:
            stored.extend(u.h for u in us)
            if done is not None:
                done([u.h for u in us])

        try:
            answers = await uploads.upload(jobs, self._release, batch_done)
        except WorkerUnavailable as e:
            self._without_workers(e)
            return await self.upload_many(hashes, mark=mark, fresh=fresh, done=done)
        except BaseException:
            if mark:  # what was stored before the failure is known (see mark_archived)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.aindex.mark_archived, stored)
            raise
        if mark:
            await trio.to_thread.run_sync(self.aindex.mark_archived, [u.h for u in answers])
        return self._account_uploads(answers, fresh)

    async def ensure_archived(self, hashes: list[bytes]) -> bool:
        """Upload workers only: make sure the objects of the still-local blobs among
        ``hashes`` exist, storing what is missing. False when no worker could be started
        (the store uploads from its own process from now on: do it here)."""
        uploads = self.uploads
        assert uploads is not None
        # objects expected there: a HEAD each, the body sent only for one found missing
        # (a restored page evicted again re-sent every byte, and failed on an archive that
        # can be read but not written)
        jobs = await trio.to_thread.run_sync(self._jobs, hashes, True)
        try:
            done = await uploads.upload(jobs, self._release)
        except WorkerUnavailable as e:
            self._without_workers(e)
            return False
        self._account_uploads([u for u in done if u.stored], None)
        return True

    def _without_workers(self, e: WorkerUnavailable) -> None:
        log.warning("%s; this store uploads from its own process from now on", e)
        self.uploads = None

    def _jobs(self, hashes: list[bytes], expected: bool = False) -> list[BlobJob]:
        """Worker jobs for the blobs still local, each holding a lease (released by
        :meth:`_release` when its worker is done): the files stay in place meanwhile.
        Each HEADs its object first when ``expected`` (and reads its data only if it is
        missing), else beside the read when it is likely there already
        (:func:`worth_probing`)."""
        eng = self.engine
        jobs: list[BlobJob] = []
        try:
            for h in hashes:
                with eng._cap_lock:
                    eng._leases[h] += 1
                b = eng.index.blob(h)
                if b is None or b.extents is None:  # deleted, or dropped: archived already
                    eng._unlease(h)
                    continue
                reads = tuple(
                    (eng.tier.abspath(p.dev, p.file), p.file_off, p.dest_off, p.n)
                    for p in eng.tier.pieces(b.extents, 0, b.size)
                )
                jobs.append(
                    BlobJob(
                        h,
                        b.size,
                        elem_size(self._dtype_of(h)) or 2,
                        reads,
                        expected or worth_probing(b.refs),
                        expected,
                    )
                )
        except BaseException:
            self._release(jobs)
            raise
        return jobs

    def _release(self, jobs: list[BlobJob]) -> None:
        for j in jobs:
            self.engine._unlease(j.h)

    def _account_uploads(self, done: list[Uploaded], fresh: set[bytes] | None) -> int:
        total = 0
        for u in done:
            if u.codec is not None:
                with self._lock:
                    self.codecs[u.h] = u.codec
            if not u.stored:
                self.count("dedup_skipped")
                continue
            if fresh is not None:
                fresh.add(u.h)
            self.count("bytes_spilled", u.nbytes)
            total += u.nbytes
        return total

    async def upload_blob(
        self, h: bytes, *, mark: bool = True, fresh: set[bytes] | None = None
    ) -> int:
        """Make sure ``blobs/<h>`` exists; with ``mark``, mark the blob archived in the index.
        Returns bytes uploaded (0 when some session or host had already stored it); adds ``h``
        to ``fresh`` when this call stored it. Raises ArchiveUnavailable, CorruptPage."""
        if self.uploads is not None:
            return await self.upload_many([h], mark=mark, fresh=fresh)
        key = blob_key(h)
        # Read + compress while the HEAD is in flight (their latencies overlap); when the
        # object exists the result is discarded: nothing is uploaded twice, only CPU is spent.
        job = self._cpu.submit(self._encode, h)
        row = self.engine.index.blob(h)
        try:
            exists = await self.store.exists(key) if row and worth_probing(row.refs) else False
        except BaseException:
            job.cancel()
            raise
        if exists:
            job.cancel()
            if mark:
                await trio.to_thread.run_sync(self.aindex.mark_archived, [h])
            self.count("dedup_skipped")
            return 0
        got = await trio.to_thread.run_sync(job.result)
        if got is None:  # dropped meanwhile, so it was archived by someone else
            b = self.engine.index.blob(h)
            return (
                0 if b is None or b.archived else await self.upload_blob(h, mark=mark, fresh=fresh)
            )
        obj, codec = got
        wrote = await self.store.put(key, obj, if_absent=True, cold=True)
        if mark:
            await trio.to_thread.run_sync(self.aindex.mark_archived, [h])
        with self._lock:
            self.codecs[h] = codec
        if not wrote:
            self.count("dedup_skipped")
            return 0
        if fresh is not None:
            fresh.add(h)
        self.count("bytes_spilled", len(obj))
        return len(obj)

    def heal(self, blob: BlobRow, reason: str) -> BlobRow | None:
        """A local copy that failed its checksum, of a blob the archive also holds: drop that
        copy (its files go once no reader holds them) and restore the blob from the archive,
        verified there. Another reader may have healed it first: then its copy is used.
        None when the archive has no copy. Raises what a restore raises."""
        if not blob.archived:
            return None
        if self.drop_local(blob.hash, reason, blob.extents):
            self.count("blobs_healed")
            log_event("heal", content=blob.hash.hex()[:16], reason=reason, bytes=blob.size)
        cur = self.engine.index.blob(blob.hash)
        if cur is None:
            return None
        return cur if cur.local else self.restore_blob(cur)

    # -- TieringPolicy overrides ------------------------------------------------------------
    def make_room(self, need: int, reason: str = "capacity") -> int:
        """Evicting to the archive loses nothing, and each eviction pass uploads and names
        its blobs in their sessions' manifests (a rewrite of the whole manifest): free
        ``evict_ahead`` more than asked, so that under steady pressure those costs are paid
        per batch, not per put."""
        ahead = max(0, min(self.cfg.evict_ahead, self.engine.capacity // 8))
        self._unreachable = None
        return super().make_room(need + ahead, reason)

    def room_blocked(self) -> str | None:
        """The archive was unreachable in this room-making pass: every batch would wait
        out the deadline again (a put waited batches x deadline: hours on a large store)."""
        return self._unreachable

    def evict_pages(
        self,
        pages: list[PageRow],
        blobs: list[BlobRow],
        reason: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Evicting to the archive drops the local copy of shared data for every page
        sharing it: they all stay readable from the archive. Raises ArchiveUnavailable
        (nothing was dropped): the caller asked for this eviction and must hear why it did
        not happen."""
        if not blobs:
            return 0
        return sum(self.evict_blobs(blobs, reason, progress, raise_unavailable=True))

    def evict_blob(self, blob: BlobRow, reason: str) -> int:
        return self.evict_blobs([blob], reason)[0]

    def evict_blobs(
        self,
        blobs: list[BlobRow],
        reason: str,
        progress: Callable[[int, int], None] | None = None,
        *,
        raise_unavailable: bool = False,
    ) -> list[int]:
        """Upload what is not archived yet, write the manifests that do not name these
        contents yet (see :meth:`Spiller.name_in_manifests`), then drop the local copies.
        Bytes freed per blob: 0 where the archive cannot take it (its data stays local,
        nothing is lost). When a local copy is bad (CorruptPage), each blob is tried alone:
        that one keeps only itself. When the archive is unavailable, no blob is (each would
        wait out the deadline again): all stay, or with ``raise_unavailable`` the error is
        raised."""
        hashes = [b.hash for b in blobs]
        started = time.monotonic()

        todo = {b.hash: b.size for b in blobs if not b.archived}
        total, archived = sum(todo.values()), 0

        def done(hs: list[bytes]) -> None:
            nonlocal archived
            archived += sum(todo[h] for h in hs)
            if progress is not None:
                progress(archived, total)

        async def archive() -> None:
            fresh: set[bytes] = set()
            if todo:
                if progress is not None:
                    progress(0, total)
                await self.upload_many(list(todo), fresh=fresh, done=done)
            await self.spiller.name_in_manifests(hashes, fresh, started)

        try:
            self.call(archive)
        except ArchiveUnavailable as e:
            if isinstance(e, ArchiveAccessDenied):
                self._unreachable = f"the archive refused access ({e})"
            else:
                self._unreachable = f"the archive is unreachable ({e})"
            if raise_unavailable:
                raise
            log.warning("cannot evict %d blob(s) to the archive: %s", len(blobs), e)
            return [0] * len(blobs)
        except OSError as e:
            # A bad local copy, or one on a failing disk (read in an upload worker: the
            # device is learnt from the file named), keeps only itself local.
            if not (isinstance(e, CorruptPage) or is_disk_error(e)):
                raise
            self.engine.tier.note_error_of(e)
            if len(blobs) > 1:
                return [self.evict_blob(b, reason) for b in blobs]
            log.warning("cannot evict %s: %s", blobs[0].hash.hex()[:16], e)
            return [0]
        # One transaction for the batch; a blob that a put shared into another session since
        # the manifests were written, or that was pinned meanwhile, stays local (drop_local_many).
        rows = {r.hash: r for r in self.aindex.drop_local_many(hashes, self.spiller.named)}
        return [self.forget_local(rows[h], reason) if h in rows else 0 for h in hashes]

    def queue_changes(
        self, db: sqlite3.Connection, sessions: set[str], freed: list[BlobRow]
    ) -> None:
        super().queue_changes(db, sessions, freed)
        # A session a retention pass deletes: this host's copy goes, not the other hosts'
        # (Spiller.expiring). In the deletion's transaction: a crash after it must not
        # leave the imports, whose tombstone would hide the session from every host.
        d = self.spiller.expiring()
        if d is not None and d in sessions:
            forget_imports_in(db, d)

    def pages_removed(self, pages: list[PageRow]) -> None:
        if self._token is None and self.cfg.gc_grace <= 0:
            self._flush_now()

    def _flush_now(self) -> None:
        """No background task to keep the archive in step: try now, for a bounded time (a
        delete must not wait out an outage); what is left stays queued in the index."""

        async def bounded() -> None:
            with trio.move_on_after(self.cfg.sync_cleanup_seconds):
                await self.spiller.flush_pending()

        try:
            self.call(bounded)
        except (ArchiveUnavailable, CorruptPage) as e:
            log.warning("archive cleanup postponed: %s", e)

    def restore_blob(self, blob: BlobRow) -> BlobRow:
        """Download, verify and re-create the local copy of ``blob``; concurrent callers for
        the same blob share one download (interrupted, it fails for the others with
        ArchiveUnavailable; a later call tries again). A caller that leases the data (every
        reader) gets a copy no index row names when its pages are deleted meanwhile (see
        :meth:`_restore_unlisted`). Raises CorruptPage (the object is missing or does not
        match its checksum: nothing is served), ArchiveUnavailable, CapacityExceeded,
        PageNotFound (deleted, and not leased)."""
        h = blob.hash
        try:
            return self._once(self._inflight, h, lambda: self._restore_one(blob), "restore")[0]
        except PageNotFound:
            # Deleted during the download (a session's restore brings back what the session
            # still holds): a caller that leases the data (a file open on the mount) reads
            # it from a copy of its own, which _restore_one makes (unlisted); any other
            # has nothing to download again for
            if not self.engine.is_leased(h):
                raise
            return self.restore_blob(blob)

    def _once(
        self, inflight: dict[bytes, Future[T]], h: bytes, fn: Callable[[], T], what: str
    ) -> tuple[T, bool]:
        """``fn()`` once at a time for ``h``: the first caller runs it, those that come
        meanwhile wait for its result or its error (``restore_coalesced``). Returns the
        result and whether this caller ran it. Interrupted (Ctrl-C, a cancellation), it
        fails for the others with ArchiveUnavailable: raised in their threads too, it was
        a KeyboardInterrupt where no Ctrl-C came; a later call tries again."""
        with self._lock:
            fut = inflight.get(h)
            owner = fut is None
            if fut is None:
                fut = inflight[h] = Future()
        if not owner:
            self.count("restore_coalesced")
            return fut.result(), False
        try:
            got = fn()
            fut.set_result(got)
            return got, True
        except Exception as e:
            fut.set_exception(e)
            raise
        except BaseException:
            fut.set_exception(ArchiveUnavailable(f"the {what} it waited for was interrupted"))
            raise
        finally:
            with self._lock:
                del inflight[h]

    def _restore_one(self, blob: BlobRow) -> BlobRow:
        cur = self.engine.index.blob(blob.hash)
        if cur is None and self.engine.is_leased(blob.hash):
            return self._restore_unlisted(blob)
        if cur is None:
            raise PageNotFound(f"page data {blob.hash.hex()[:16]} was deleted")
        if cur.local:
            return cur
        # Room first (evicting if need be): a restore that cannot fit downloads nothing.
        need = self.engine.tier.disk_bytes(blob.size)
        self.engine._reserve(need)
        self.engine._unreserve(need)
        t0 = time.monotonic()
        obj = self.call(self._get_object, blob)
        got = self._adopt([self._stage(blob, obj)], t0)[0]
        if isinstance(got, PageNotFound) and self.engine.is_leased(blob.hash):
            # Deleted during the download while a reader holds the data (a file open on the
            # mount, then unlinked): it stays readable, from a copy no row names. (It failed
            # with "deleted during its restore", where an unlink before the read did not.)
            return self._restore_unlisted(blob, obj)
        if isinstance(got, BaseException):
            raise got
        return got

    def memory_copy(self, h: bytes) -> bytes | None:
        with self._lock:
            data = self._memory.get(h)
            if data is not None:
                self._memory.move_to_end(h)
                self.counters["memory_reads"] += 1
            return data

    def copy_in_memory(
        self, blob: BlobRow, no_room: Exception, reason: str = "no local room"
    ) -> bytes:
        """Archive-only data that has no local room (the capacity is held by pinned pages,
        open files or writes in flight), or whose local copy's disk fails (``reason``),
        downloaded, verified and kept in memory, least recently used first out, up to
        ``memory_copies`` bytes in all, so reads are served without a local copy. Raises
        CapacityExceeded from ``no_room`` for a page larger than that."""
        if blob.size > self.cfg.memory_copies:
            raise CapacityExceeded(
                f"{no_room} (and the page, {blob.size} bytes, is larger than the "
                f"{self.cfg.memory_copies} bytes archive.memory_copies may hold in memory)"
            ) from no_room
        held = self.memory_copy(blob.hash)
        if held is not None:
            return held
        # One download for the readers that find no room at once, as restore_blob shares
        # one: each downloaded the page for itself (eight readers, eight GETs)
        data, ran = self._once(
            self._memory_inflight,
            blob.hash,
            lambda: self._download_to_memory(blob, reason),
            "download",
        )
        if not ran:  # (served from the memory copy the one that ran made)
            with self._lock:
                self.counters["memory_reads"] += 1
        return data

    def _download_to_memory(self, blob: BlobRow, reason: str) -> bytes:
        """The page downloaded, verified and kept in memory (see :meth:`copy_in_memory`)."""
        obj = self.call(self._get_object, blob)
        key = f"archive object {blob_key(blob.hash)}"
        try:
            data = bytes(decode_verified(obj, blob.hash, blob.size, key))
        except CorruptPage as e:
            self._count_corrupt(str(e))
            raise
        with self._lock:
            if blob.hash not in self._memory:  # (another reader may have put it there)
                self._memory[blob.hash] = data
                self._memory_bytes += len(data)
            while self._memory_bytes > self.cfg.memory_copies:
                _, old = self._memory.popitem(last=False)
                self._memory_bytes -= len(old)
            self.counters["memory_reads"] += 1
        log_event(
            "restore-in-memory",
            content=blob.hash.hex()[:16],
            bytes=blob.size,
            reason=reason,
        )
        return data

    def _restore_unlisted(self, blob: BlobRow, obj: bytes | None = None) -> BlobRow:
        """A local copy of archive-only data whose pages were deleted while a reader holds
        it (a file open on the mount, then unlinked or replaced: POSIX keeps it readable).
        The copy is written like any restore but named by no index row; it counts against
        the capacity and its files go when the last lease ends. The archive object outlives
        the deletion while the data is leased (:meth:`Spiller.flush_pending`). ``obj``: the
        object, when it was downloaded already."""
        eng = self.engine
        held = eng.unlisted_copy(blob.hash)
        if held is not None:
            return held
        if obj is None:
            obj = self.call(self._get_object, blob)
        x = self._stage(blob, obj)
        row = replace(blob, extents=x.extents, disk_bytes=x.disk, refs=0)
        with eng._cap_lock:
            eng.reserved -= x.need
            eng._account(row, +1)
        eng._drop_files(row)  # deferred until the last lease ends (now, if it just did)
        return row

    def check_archive(
        self, *, repair: bool, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, list[str]]:
        """Read back and verify the archive object of every blob this store has marked
        archived (``kvfs fsck --check-archive``: a download of each). Returns the objects missing and
        corrupt, the pages they hold, and, with ``repair``, what was re-uploaded: an object
        whose content this store still holds in a verified local copy is written again.
        The others are reported, not deleted: another host may hold the data still.

        The blob rows are read as :meth:`Index._scan_blobs` reads them, a chunk at a time
        (in a worker thread), and a check starts only when one of the ``concurrency``
        running has ended: the pass holds a chunk of rows and those downloads (at most
        ``TRANSFER_BYTES`` of pages, kvfs/_uploader.py) at once, not a row and a task for
        every archived blob of the store. A blob archived during the pass is checked if
        its checksum is beyond the rows read so far; one deleted before its row is read is
        not. ``progress(done, total)``: ``total`` is the count of archived blobs when the
        pass began (or ``done``, once more were checked). Raises ArchiveUnavailable."""
        from objectstore import ObjectNotFound

        index = self.engine.index
        total = index.archived_blob_count()
        out: dict[str, list[str]] = {
            "archive_missing": [],
            "archive_corrupt": [],
            "archive_damaged_pages": [],
            "archive_repaired": [],
        }
        bad: list[BlobRow] = []
        done = 0

        async def check(b: BlobRow, slots: trio.Semaphore, budget: ByteLimiter) -> None:
            nonlocal done
            key = blob_key(b.hash)
            try:
                async with budget.hold(b.size):
                    try:
                        obj = await self.store.get(key)
                    except ObjectNotFound:
                        out["archive_missing"].append(key)
                        bad.append(b)
                    else:
                        assert isinstance(obj, bytes)
                        try:
                            await trio.to_thread.run_sync(
                                decode_verified, obj, b.hash, b.size, f"archive object {key}"
                            )
                        except CorruptPage:
                            out["archive_corrupt"].append(key)
                            bad.append(b)
            finally:
                slots.release()
            done += 1
            if progress is not None:
                progress(done, max(done, total))

        async def check_all() -> None:
            rows = index.archived_blobs()
            slots, budget = trio.Semaphore(self.cfg.concurrency), ByteLimiter()
            async with one_error_nursery() as n:  # (ArchiveUnavailable, not a group)
                while chunk := await trio.to_thread.run_sync(
                    lambda: list(itertools.islice(rows, SCAN_ROWS))
                ):
                    for b in chunk:
                        await slots.acquire()
                        n.start_soon(check, b, slots, budget)

        if progress is not None:
            progress(0, total)
        self.call(check_all)
        for b in bad:
            key = blob_key(b.hash)
            try:
                got = self._encode(b.hash) if repair else None
            except CorruptPage:
                got = None  # the local copy is damaged too: fsck's local check reports it
            if got is not None:
                self.call(self.store.put, key, got[0])
                out["archive_repaired"].append(f"re-uploaded {key} from the local copy")
                continue
            paths = [p.path for p in self.engine.index.pages_of_blob(b.hash)]
            out["archive_damaged_pages"] += paths
        for k in out:
            out[k].sort()
        return out

    def find_archived(self, h: bytes) -> tuple[int, bytes] | None:
        """The size and leaf digests of content ``h`` when the archive holds a copy of it
        that verifies against ``h``; None when it holds none, or a damaged one. Raises
        ArchiveUnavailable."""
        from objectstore import ObjectNotFound

        from ._codec import decode

        key = blob_key(h)
        try:
            obj = self.call(self.store.get, key)
        except ObjectNotFound:
            return None
        assert isinstance(obj, bytes)
        try:
            data = decode(obj, f"archive object {key}", into=scratch_buffer)
        except CorruptPage:
            return None
        leaves = leaves_of(data)
        if tree_hash(len(data), leaves) != h:
            return None
        return len(data), leaves

    async def _get_object(self, blob: BlobRow) -> bytes:
        from objectstore import ObjectNotFound

        try:
            obj = await self.store.get(blob_key(blob.hash))
        except ObjectNotFound:
            raise self._missing(
                blob.hash, f"archive object {blob_key(blob.hash)} is missing from {self.store.url}"
            ) from None
        except CorruptPage as e:  # (the server's own checksum never matched: counted so)
            self._count_corrupt(str(e))
            raise
        assert isinstance(obj, bytes)
        return obj

    def _missing(self, h: bytes, message: str) -> KvfsError:
        """The error for an archive object found missing: PageNotFound when its data was
        deleted meanwhile (no page names it, no reader holds it: the object went with it),
        else a corrupt read (counted and logged)."""
        if self.engine.index.blob(h) is None and not self.engine.is_leased(h):
            return PageNotFound(f"page data {h.hex()[:16]} was deleted during its restore")
        return self.engine.corrupt_read(message)

    def _stage(self, blob: BlobRow, obj: bytes) -> _Staged:
        """Decode and verify an object, then write it as durable local files that no index
        row names yet (:meth:`_adopt` commits them). Raises CorruptPage (nothing written),
        CapacityExceeded."""
        eng = self.engine
        try:
            data = decode_verified(
                obj, blob.hash, blob.size, f"archive object {blob_key(blob.hash)}"
            )
        except CorruptPage as e:
            self._count_corrupt(str(e))
            raise
        need = eng.tier.disk_bytes(len(data))
        eng._reserve(need)
        w = eng.tier.writer(eng.tier.next_start(len(data)), direct=True)
        try:
            extents, disk = write_restored(w, data)  # directories: synced in _adopt
        except BaseException:
            eng._unreserve(need)
            raise
        return _Staged(blob.hash, len(data), w, extents, disk, need, tuple(w.new_dirs))

    def _count_corrupt(self, message: str) -> None:
        self.engine.corrupt_read(message)
        self.count("corrupt_objects")

    def _adopt(self, staged: list[_Staged], t0: float) -> list[BlobRow | BaseException]:
        """Commit staged local copies in one index transaction (one fsync for all) and
        account them. Per blob: its row, or PageNotFound when it was deleted meanwhile."""
        eng = self.engine
        try:
            if eng.tier.durable:
                for d in sorted({d for x in staged for d in x.dirs}):
                    fsync_dir(d)
            rows = self.aindex.adopt_local_many([(x.h, x.extents, x.disk) for x in staged])
        except BaseException:
            for x in staged:
                x.writer.abort()
                eng._unreserve(x.need)
            raise
        out: list[BlobRow | BaseException] = []
        for x, row in zip(staged, rows, strict=True):
            if row is None:  # deleted, or made local by a put, meanwhile
                # (its files go before their room is given back: else another write took
                # that room while they were still on disk, past the cap)
                x.writer.abort()
            with eng._cap_changed:
                eng.reserved -= x.need
                if row is not None:
                    eng._account(row, +1)
                eng._cap_changed.notify_all()
            if row is None:
                cur = eng.index.blob(x.h)
                out.append(
                    cur
                    if cur is not None
                    else PageNotFound(f"page data {x.h.hex()[:16]} was deleted during its restore")
                )
                continue
            out.append(row)
            self.restore_latencies.append(time.monotonic() - t0)
            with self._lock:
                self.restore_seconds += self.restore_latencies[-1]
            self.count("bytes_restored", x.size)
            self.count("blobs_restored")
            log_event(
                "restore",
                level=logging.DEBUG,  # (per content; a request's line says the session's)
                content=x.h.hex()[:16],
                bytes=x.size,
                seconds=self.restore_latencies[-1],
            )
        return out

    async def _restore_many(
        self,
        blobs: list[BlobRow],
        progress: Progress | None = None,
        missing_ok: bool = False,
        *,
        one_by_one_when_full: bool = True,
    ) -> int:
        """Restore blobs: in the upload worker processes when there are any (each worker
        downloads, decodes, verifies and writes its batch's files; see
        :meth:`_restore_in_workers`), else in this process (:meth:`_restore_here`). The
        local copies are committed in batches, so a session costs a few index fsyncs, not
        one per page. Concurrent readers of these blobs wait for them (one download).
        Returns bytes restored; raises the first error after every blob has been tried.
        With ``missing_ok`` a blob deleted meanwhile (PageNotFound) is no error: a session's
        restore brings back what the session still holds."""
        from ._uploader import _wait

        owned: dict[bytes, Future[BlobRow]] = {}
        others: list[Future[BlobRow]] = []
        with self._lock:
            for b in blobs:
                fut = self._inflight.get(b.hash)
                if fut is None:
                    owned[b.hash] = self._inflight[b.hash] = Future()
                else:
                    others.append(fut)
        t0 = time.monotonic()

        total = sum(b.size for b in blobs if b.hash in owned)  # others: another restore's
        done = 0
        if progress is not None:
            progress(0, total)

        def settle(h: bytes, result: BlobRow | BaseException) -> None:
            nonlocal done
            with self._lock:
                fut = self._inflight.pop(h)
            if isinstance(result, BaseException):
                fut.set_exception(result)
                return
            fut.set_result(result)
            if progress is not None:
                done += result.size
                progress(done, total)

        todo = [b for b in blobs if b.hash in owned]
        try:
            if self.uploads is not None:
                todo = await self._restore_in_workers(todo, settle, t0)
            if todo:
                await self._restore_here(todo, settle, t0)
        finally:
            for h in list(owned):  # cancelled: whoever waits on them is told
                with self._lock:
                    fut = self._inflight.get(h)
                    if fut is owned[h]:
                        del self._inflight[h]
                    else:
                        continue
                if not fut.done():
                    fut.set_exception(ArchiveUnavailable("restore was cancelled"))
        total = 0
        failed: dict[bytes | None, BaseException] = {}  # by hash (None: another restore's)
        for key, fut in [*owned.items(), *((None, f) for f in others)]:
            try:
                total += (await _wait(fut)).size
            except PageNotFound as e:
                if not missing_ok:
                    failed.setdefault(key, e)
            except Exception as e:
                failed.setdefault(key, e)
        # Restored side by side, copies a full disk had room for a few of may all have
        # failed halfway (each held part of the room): those come back one at a time now,
        # until one does not fit
        retry = [b for b in blobs if isinstance(failed.get(b.hash), DiskFull)]
        for b in retry if one_by_one_when_full and len(blobs) > 1 else []:
            try:
                total += await self._restore_many(
                    [b], missing_ok=missing_ok, one_by_one_when_full=False
                )
            except DiskFull:
                break
            del failed[b.hash]
        # Copies written to a disk that failed under them: once more, now that placement
        # knows to avoid it (a blob striped over every device fails again)
        sick = [b for b in blobs if is_disk_error(failed.get(b.hash))]
        if sick and one_by_one_when_full:
            try:
                total += await self._restore_many(
                    sick, missing_ok=missing_ok, one_by_one_when_full=False
                )
                back = sick
            except Exception:  # (the first failure below is the one raised)
                rows = await trio.to_thread.run_sync(
                    lambda: [self.engine.index.blob(b.hash) for b in sick]
                )
                back = [b for b, cur in zip(sick, rows, strict=True) if cur and cur.local]
                total += sum(b.size for b in back)
            for b in back:
                del failed[b.hash]
        if failed:
            raise next(iter(failed.values()))
        return total

    async def _still_archived(
        self, blobs: list[BlobRow], settle: Callable[[bytes, BlobRow | BaseException], None]
    ) -> list[BlobRow]:
        """The blobs still to restore; the others (deleted, or local again) are settled."""
        rows = await trio.to_thread.run_sync(
            lambda: [self.engine.index.blob(b.hash) for b in blobs]
        )
        out = []
        for b, cur in zip(blobs, rows, strict=True):
            if cur is None or cur.local:
                settle(b.hash, cur or PageNotFound(f"page data {b.hash.hex()[:16]} was deleted"))
            else:
                out.append(b)
        return out

    async def _restore_in_workers(
        self,
        blobs: list[BlobRow],
        settle_future: Callable[[bytes, BlobRow | BaseException], None],
        t0: float,
    ) -> list[BlobRow]:
        """Restore in the upload worker processes: this process only reserves room, names
        the files, and commits what the workers wrote (the store's CPU and GIL stay with
        foreground work, as for spills). Files of a failed, abandoned or retried job are
        removed by name (the nonce chosen here). Returns the blobs left for this process
        when no worker can be started."""
        eng = self.engine
        uploads = self.uploads
        assert uploads is not None
        done: set[bytes] = set()  # settled here (the same hash may be restored again later)

        def settle(h: bytes, result: BlobRow | BaseException) -> None:
            done.add(h)
            settle_future(h, result)

        blobs = await self._still_archived(blobs, settle)
        spec = TierSpec(
            tuple(str(r) for r in eng.tier.roots), eng.tier.unit, eng.tier.direct, eng.tier.durable
        )
        # h -> (blob, the writer that names its files, bytes reserved); an entry leaves once
        # _adopt has committed (or removed) its copy, or when release() cleans it up
        pending: dict[bytes, tuple[BlobRow, BlobWriter, int]] = {}
        jobs: list[RestoreJob] = []

        def reserve_all() -> None:
            held = 0  # reserved here: no write of it starts before this loop ends, so a
            # reservation must not wait for it (it waited out RESERVE_WAIT_SECONDS for itself)
            for b in blobs:
                need = eng.tier.disk_bytes(b.size)
                try:
                    eng._reserve(need, own=held)
                except Exception as e:  # no room for this one: the others still come back
                    settle(b.hash, e)
                    continue
                held += need
                w = eng.tier.writer(eng.tier.next_start(b.size), direct=True)
                pending[b.hash] = (b, w, need)
                jobs.append(RestoreJob(b.hash, b.size, blob_key(b.hash), w.start, w.nonce))

        def release(batch: list[RestoreJob]) -> None:
            for j in batch:
                x = pending.pop(j.h, None)
                if x is not None:
                    x[1].abort()
                    eng._unreserve(x[2])

        def before_retry(batch: list[RestoreJob]) -> None:
            for j in batch:
                x = pending.get(j.h)
                if x is not None:
                    x[1].abort()

        async def answered(batch: list[RestoreJob], results: list[Restored]) -> None:
            staged: list[_Staged] = []
            for r in results:
                if r.error is not None:
                    err = r.error
                    if isinstance(err, MissingObject):
                        err = self._missing(r.h, str(err))
                    elif isinstance(err, CorruptPage):
                        self._count_corrupt(str(err))
                    else:  # a failing disk: placement learns to avoid it
                        eng.tier.note_error_of(err)
                    settle(r.h, err)  # the worker left no files; release() frees the room
                    continue
                blob, w, need = pending[r.h]
                assert r.extents is not None
                staged.append(_Staged(r.h, blob.size, w, r.extents, r.disk, need, r.dirs))
            if not staged:
                return
            # Out of ``pending`` only once the commit has run: cancelled on the way into its
            # thread, release() still removes the files and frees the room
            try:
                got = await trio.to_thread.run_sync(self._adopt, staged, t0)
            except Exception as e:  # _adopt removed the files and freed the room
                got = [e] * len(staged)
            for x in staged:
                del pending[x.h]
            for x, g in zip(staged, got, strict=True):
                settle(x.h, g)

        try:
            await trio.to_thread.run_sync(reserve_all)
            await uploads.restore(jobs, spec, answered, release, before_retry)
        # Each batch's files and room are released by the pool once no worker writes them
        # (even for a batch still running when another failed): nothing to release here.
        except WorkerUnavailable as e:
            self._without_workers(e)
            return [b for b in blobs if b.hash not in done]  # this process restores them
        except Exception as e:
            for j in jobs:
                if j.h not in done:
                    settle(j.h, e)
        return []

    async def _restore_here(
        self,
        blobs: list[BlobRow],
        settle: Callable[[bytes, BlobRow | BaseException], None],
        t0: float,
    ) -> None:
        """Restore in this process, ``concurrency`` downloads at once: each object is then
        decoded, verified and written in a thread, and one task commits what is written in
        batches (what is written while a commit runs goes into the next).

        Each blob is leased while the restore runs: room made for a later one must not be
        made by evicting one this restore just brought back (it reported success with part
        of the session evicted again). The worker path reserves everything first instead."""
        eng = self.engine
        with eng._cap_lock:
            for b in blobs:
                eng._leases[b.hash] += 1
        try:
            await self._restore_here_leased(blobs, settle, t0)
        finally:
            for b in blobs:
                eng._unlease(b.hash)

    async def _restore_here_leased(
        self,
        blobs: list[BlobRow],
        settle: Callable[[bytes, BlobRow | BaseException], None],
        t0: float,
    ) -> None:
        ready: list[_Staged] = []
        downloads = trio.CapacityLimiter(self.cfg.concurrency)
        staging = trio.CapacityLimiter(max(2, os.cpu_count() or 1))
        # downloaded objects wait in memory for a staging slot: at most this many at once
        held = trio.CapacityLimiter(downloads.total_tokens + staging.total_tokens)
        budget = ByteLimiter()  # (and at most this many of their page bytes)
        wake = trio.Event()
        producing = len(blobs)
        down: list[ArchiveUnavailable] = []  # once one download says so, the rest do not try

        async def one(b: BlobRow) -> None:
            nonlocal producing
            try:
                async with held, budget.hold(b.size):
                    async with downloads:
                        if down:
                            raise ArchiveUnavailable(str(down[0]))
                        if not await self._still_archived([b], settle):
                            return
                        try:
                            obj = await self._get_object(b)
                        except ArchiveAccessDenied:
                            raise  # this object refused: the others may well be allowed
                        except ArchiveUnavailable as e:
                            down.append(e)
                            raise
                    # The download slot is free again while this object is decoded, verified
                    # and written: downloads stay `concurrency` deep, as boto3 alone would.
                    async with staging:
                        # no checkpoint between the thread's return and the append: a staged
                        # copy is always either committed or aborted below
                        ready.append(await trio.to_thread.run_sync(self._stage, b, obj))
            except Exception as e:
                settle(b.hash, e)
            finally:
                producing -= 1
                wake.set()

        async def commit() -> None:
            nonlocal wake
            while producing or ready:
                if not ready:
                    await wake.wait()
                    wake = trio.Event()
                    continue
                # The batch stays in ``ready`` until its commit has run: cancelled on the way
                # into the thread (to_thread checks first), it is aborted below. (Taken off
                # before, a Ctrl-C there left its files and its room reserved for good.)
                batch = ready[:]
                try:
                    got = await trio.to_thread.run_sync(self._adopt, batch, t0)
                except Exception as e:  # (_adopt removed the files and gave back the room)
                    got = [e] * len(batch)
                del ready[: len(batch)]  # (what was appended meanwhile stays)
                for x, r in zip(batch, got, strict=True):
                    settle(x.h, r)

        try:
            async with one_error_nursery() as n:
                n.start_soon(commit)
                for b in blobs:
                    n.start_soon(one, b)
        finally:
            for x in ready:  # written but cancelled before its commit
                x.writer.abort()
                self.engine._unreserve(x.need)

    # -- sessions ---------------------------------------------------------------------------
    def spill(self, d: str, progress: Progress | None = None) -> int:
        return self.call(self.spiller.spill_session, d, True, progress)

    def restore_session(self, d: str, progress: Progress | None = None) -> int:
        """Import the session's manifest (pages this host lacks) and prefetch every page;
        the pages this index already knows start while the manifest is fetched.
        ``progress(bytes done, bytes to restore)`` is called as pages come back (from any
        thread; the total grows when the manifest adds pages). Every page is tried, then
        the first error is raised (the manifest's first): the known pages may be local
        again even when the manifest could not be read. Returns bytes restored. Raises
        SessionNotFound, ArchiveUnavailable, CorruptPage, CapacityExceeded (saying how much
        of the session is local: what fits stays)."""
        try:
            return self.call(self._restore_session, d, progress)
        except CapacityExceeded as e:
            u = self.engine.index.session_usage(d)
            if u["local_bytes"] >= u["bytes"]:
                # What found no room came back meanwhile all the same (another session's
                # restore of the same content, after the last look): the session is what
                # was asked. It failed with "45056 of its 45056 bytes are local; the rest
                # does not fit".
                return int(getattr(e, "restored", 0))
            why = str(e)
            cap = self.engine.capacity
            if u["bytes"] > cap:  # its own restored pages are what fills the cap
                why = f"the session is larger than the whole capacity ({cap} bytes): raise it"
            elif why.startswith("no room for"):  # (it counts this restore's own downloads as
                # "writes in flight": say what the user can do instead)
                why = (
                    f"the capacity ({self.engine.capacity} bytes) is held by what is pinned, "
                    "open or being written: raise it, or evict or unpin something first"
                )
            raise CapacityExceeded(
                f"{d}: {u['local_bytes']} of its {u['bytes']} bytes are local; the rest does "
                f"not fit: {why} (its archive-only pages still read one by one)"
            ) from e

    def _archived_blobs(self, d: str, skip: Collection[bytes] = ()) -> list[BlobRow]:
        idx = self.engine.index
        hashes = {p.hash for p in idx.pages(session=d)} - set(skip)
        return [b for h in hashes if (b := idx.blob(h)) is not None and not b.local]

    async def _restore_session(self, d: str, progress: Progress | None) -> int:
        try:
            return await self._restore_session_pages(d, progress)
        finally:
            # A restore is an access (an engine's hint that the agent resumes): the session's
            # last access is now, not the one its manifest recorded, or retention here would
            # delete it, from every host's view, at its next pass; and so is its pages' (or
            # an eviction would take them first, least recently used).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.engine.index.touch_session, d)

    async def _restore_session_pages(self, d: str, progress: Progress | None) -> int:
        known = await trio.to_thread.run_sync(self._archived_blobs, d)
        if not known:  # nothing to start on before the manifest says what the session holds
            await self.spiller.import_session(d)
            later = await trio.to_thread.run_sync(self._archived_blobs, d)
            return await self._restore_many(later, progress, missing_ok=True)
        # The pages this index already knows come back while the manifest is fetched (a
        # round trip to the archive, ~6 ms of a 100 ms restore on loopback); pages only the
        # manifest names (another host added them) follow. As before, every page is tried
        # and the first error (an unreadable manifest, an unreachable archive, a corrupt
        # object) is raised at the end.
        errors: list[Exception] = []
        first_total = [0]

        def first(i: int, t: int) -> None:
            first_total[0] = t
            if progress is not None:
                progress(i, t)

        async def fetch_manifest() -> None:
            try:
                await self.spiller.import_session(d)
            except Exception as e:
                errors.insert(0, e)

        done = 0
        async with one_error_nursery() as n:
            n.start_soon(fetch_manifest)
            try:
                done = await self._restore_many(known, first, missing_ok=True)
            except Exception as e:
                errors.append(e)
        later = await trio.to_thread.run_sync(self._archived_blobs, d, {b.hash for b in known})
        if later:
            base = first_total[0]
            more = None if progress is None else (lambda i, t: progress(base + i, base + t))
            try:
                done += await self._restore_many(later, more, missing_ok=True)
            except Exception as e:
                errors.append(e)
        # A page that found no room may have come back meanwhile all the same (another
        # session holding the same content restored it): the session is what was asked.
        if (
            errors
            and all(isinstance(e, CapacityExceeded) for e in errors)
            and not await trio.to_thread.run_sync(self._archived_blobs, d)
        ):
            return done
        if errors:
            errors[0].restored = done  # type: ignore[attr-defined]  # (see restore_session)
            raise errors[0]
        return done

    def archived_sessions(self) -> list[dict[str, object]]:
        return self.call(self.spiller.archived_sessions)

    def archive_hosts(self) -> list[dict[str, object]]:
        return self.call(self.spiller.hosts.survey)

    async def background(self) -> None:
        """The background spiller; run it in the nursery of ``open_store``."""
        self._token = trio.lowlevel.current_trio_token()
        if self.uploads is not None:
            self.uploads.warm()  # a daemon will spill: start the workers before it must
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.spiller.heartbeats)
                await self.spiller.run()
        finally:
            self._token = None

    def statistics(self) -> dict[str, object]:
        lat = sorted(self.restore_latencies)

        def pct(q: float) -> float | None:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

        with self._lock:
            c = dict(self.counters)
            restore_seconds = self.restore_seconds
        return {
            "archive": {
                "url": self.store.url,
                "spill_queue": self.spiller.queue_length(),
                # objects queued to be deleted from the archive (after deletes, replaced
                # pages; done by the background pass once gc_grace has passed)
                "pending_deletes": self.aindex.pending_count("forget"),
                "bytes_spilled": c.get("bytes_spilled", 0),
                "bytes_restored": c.get("bytes_restored", 0),
                "sessions_spilled": c.get("sessions_spilled", 0),
                "sessions_expired": c.get("sessions_expired", 0),
                "hosts_retired": c.get("hosts_retired", 0),
                # incomplete uploads of killed puts aborted (Spiller.sweep_uploads)
                "uploads_aborted": c.get("uploads_aborted", 0),
                "memory_reads": c.get("memory_reads", 0),
                "memory_copies_bytes": self._memory_bytes,
                "retention_s": self.cfg.retention,
                # the last retention pass waited: this host's clock was this many seconds
                # ahead of the archive's (None: it did not)
                "retention_paused_ahead_s": self.spiller.retention_paused,
                "blobs_restored": c.get("blobs_restored", 0),
                "dedup_skipped": c.get("dedup_skipped", 0),
                "restore_coalesced": c.get("restore_coalesced", 0),
                "corrupt_objects": c.get("corrupt_objects", 0),
                "blobs_healed": c.get("blobs_healed", 0),
                "errors": c.get("errors", 0),
                "manifests_written": c.get("manifests_written", 0),
                "collection_waits": c.get("collection_waits", 0),
                "collections_presumed_dead": c.get("collections_presumed_dead", 0),
                "restore_p50_s": pct(0.5),
                "restore_p99_s": pct(0.99),
                # every restore's seconds since the store opened (with blobs_restored, the
                # count: a mean over any window, which the recent quantiles cannot give)
                "restore_seconds": restore_seconds,
            }
        }

    def close(self) -> None:
        """Finish queued archive cleanup (bounded), stop the prefetch pool, close the store."""
        if self.aindex.has_pending("manifest") or self.aindex.has_pending(
            "forget", self.cfg.gc_grace
        ):
            self._flush_now()
        self._io.shutdown(wait=True)
        self._cpu.shutdown(wait=True)
        trio.run(self.store.aclose)
