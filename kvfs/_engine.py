"""The synchronous, thread-safe core of a store: index + striped local tier + policy.

Everything here blocks (disk, hashing, SQLite) and is meant to be called from worker
threads; :mod:`kvfs._store` wraps it for trio and the sync facade calls it directly.

Life of a put (what a crash at each step leaves behind):

1. the key and attributes are checked; nothing on disk yet;
2. room is reserved under the capacity cap, evicting by policy if needed;
3. the data goes to new files in the device directories, and its leaf hashes are computed
   alongside; the files are fsynced. A crash here leaves unreferenced files, swept at the
   next start (the index records whether the last shutdown was clean);
4. one SQLite transaction (WAL, synchronous=FULL) inserts the page row: this is the instant
   the page exists. If identical content was already held, the new files are deleted and
   the page shares the existing data (reference-counted).
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from ._aligned import aligned_buffer
from ._checksum import DIGEST, LEAF, leaf_hash, leaf_hasher, tree_hash
from ._config import StoreConfig
from ._errors import (
    ArchiveUnavailable,
    CapacityExceeded,
    CorruptPage,
    InvalidKey,
    KvfsError,
    PageExists,
    PageNotFound,
    SessionNotFound,
    StoreClosed,
)
from ._index import BlobRow, Index, PageRow
from ._keys import PageKey, as_key, session_dir
from ._local import BlobWriter, CorruptedFile, LocalTier
from ._lock import DirLock
from ._policy import TieringPolicy
from ._types import (
    DeviceStatistics,
    Extent,
    PageInfo,
    SessionInfo,
    StoreStatistics,
)

__all__ = ["Engine"]

HASH_GROUP = 2 * LEAF  # leaves hashed per task when a put hashes beside its writes
#: Pages up to this size are hashed before they are written, so a duplicate costs no write;
#: larger ones are hashed while they are written (a duplicate's files are then removed).
DEDUP_FIRST_MAX = 256 * 1024
#: Reads go in pieces of this size, at most READ_WINDOW (or two per device) in flight; each
#: piece is hashed as it lands while the next ones are read, so only the last piece's hash
#: is left when the disk is done.
READ_PIECE = 512 * 1024
READ_WINDOW = 8
RESERVE_WAIT_SECONDS = 10.0
ATIME_FLUSH_SECONDS = 5.0


def _check_attrs(attrs: dict[str, str] | None) -> dict[str, str]:
    if attrs is None:
        return {}
    if not isinstance(attrs, dict):
        raise InvalidKey("attrs must be a dict of str to str")
    for k, v in attrs.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidKey(f"attrs must map str to str; got {k!r}: {type(v).__name__}")
    return dict(attrs)


def _as_bytes_view(data: object) -> memoryview:
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"page data must be a buffer (bytes, bytearray, numpy array...), "
            f"not {type(data).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError("page data must be a C-contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class Engine:
    """Owns one store directory set. Open with :meth:`open`; close with :meth:`close`."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._closed = True
        self._lock = DirLock(config.lock_path)
        self._lock.acquire()
        try:
            self._open()
        except BaseException:
            self._lock.release()
            raise

    def _open(self) -> None:
        cfg = self.config
        for d in cfg.data_dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.index = Index(cfg.index_path, durable=cfg.durable)
        store_id = self.index.get_meta("store_id")
        if store_id is None:
            store_id = uuid.uuid4().hex
            self.index.set_meta("store_id", store_id)
        self.store_id: str = str(store_id)
        self.io_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvfs-io")
        self.hash_pool = ThreadPoolExecutor(
            max(2, (os.cpu_count() or 2)), thread_name_prefix="kvfs-hash"
        )
        self.tier = LocalTier(
            cfg.data_dirs,
            cfg.stripe_unit,
            direct=cfg.direct_io,
            durable=cfg.durable,
            pool=self.io_pool,
            bounce_buffers=2 * cfg.io_threads,
        )
        self.tier.prepare(self.store_id)
        self.policy: TieringPolicy = TieringPolicy(self)
        self._cap_lock = threading.Lock()
        self._cap_changed = threading.Condition(self._cap_lock)
        self._evict_lock = threading.Lock()
        self._leases: Counter[bytes] = Counter()
        # Blobs dropped while leased, by hash; a list: the same content can be dropped,
        # put again (new files) and dropped again while one lease is still held.
        self._deferred: dict[bytes, list[BlobRow]] = {}
        self._atimes: tuple[dict[str, float], dict[bytes, float], dict[str, float]] = ({}, {}, {})
        self._atime_flushed = time.monotonic()
        self._counters: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self.recovered_orphans: builtins.list[str] = []
        clean = self.index.get_meta("clean", True) is not False
        if not clean:
            self.recovered_orphans = self.tier.sweep(self.index.all_extent_files())
        # The accounting saved by the last clean close; recomputed from every blob row after
        # a crash (or from an older store): a clean restart reads no per-page state at all.
        saved = self.index.get_meta("accounting") if clean else None
        self.index.set_meta("clean", False)
        if isinstance(saved, (list, tuple)) and len(saved) == 2 and len(saved[1]) == self.tier.n:
            self.used, self.dev_used = int(saved[0]), [int(x) for x in saved[1]]
        else:
            self.used = 0
            self.dev_used = [0] * self.tier.n
            for b in self.index.local_blobs():
                self._account(b, +1)
        self.reserved = 0
        self.capacity = cfg.capacity or (self.used + sum(self.tier.free_bytes()))
        self._closed = False
        if cfg.archive_url:
            from ._archive import ArchivingPolicy  # imports objectstore/boto3 only when used

            try:
                self.policy = ArchivingPolicy(self)
            except BaseException:
                self._closed = True
                self.io_pool.shutdown()
                self.hash_pool.shutdown()
                self.index.close()
                raise

    def _account(self, b: BlobRow, sign: int) -> None:
        """Track bytes on disk per device for a blob's local files (caller holds _cap_lock
        or is single-threaded)."""
        assert b.extents is not None
        self.used += sign * b.disk_bytes
        per: Counter[int] = Counter()
        for dev, _f, _o, length in b.extents:
            per[dev] += length
        share = b.disk_bytes / max(1, b.size)
        for dev, n in per.items():
            self.dev_used[dev] += sign * int(n * share if b.size else b.disk_bytes)

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush_atimes()
            self.policy.close()
            with self._cap_lock:
                deferred, self._deferred = self._deferred, {}
            for blobs in deferred.values():
                for b in blobs:
                    if b.extents:
                        self.tier.unlink(b.extents)
                        with self._cap_lock:
                            self._account(b, -1)
            self.io_pool.shutdown(wait=True)
            self.hash_pool.shutdown(wait=True)
            self.index.set_meta("accounting", [self.used, self.dev_used])
            self.index.set_meta("clean", True)
            self.index.close()
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    # -- capacity ---------------------------------------------------------------------
    def _reserve(self, n: int, own: int = 0) -> None:
        """Reserve ``n`` bytes under the cap, evicting by policy if needed.

        When nothing is evictable *now* but other writes are in flight, their reservations
        will soon either be released or become committed (evictable) pages: wait for that
        (up to RESERVE_WAIT_SECONDS) instead of failing a put another put's timing doomed.
        ``own`` is what the caller already holds (a growing streaming writer): it is not
        waited for.
        Raises CapacityExceeded when the page cannot fit even then.
        """
        deadline = time.monotonic() + RESERVE_WAIT_SECONDS
        while True:
            with self._cap_lock:
                if self.used + self.reserved + n <= self.capacity:
                    self.reserved += n
                    return
                if n > self.capacity:
                    raise CapacityExceeded(
                        f"a page of {n} bytes on disk is larger than the "
                        f"capacity cap of {self.capacity} bytes"
                    )
            with self._evict_lock:
                with self._cap_lock:
                    short = self.used + self.reserved + n - self.capacity
                if short <= 0 or self.policy.make_room(short, "capacity") > 0:
                    continue
            with self._cap_changed:
                if self.used + self.reserved + n <= self.capacity:
                    continue
                if self.reserved - own <= 0 or time.monotonic() > deadline:
                    raise CapacityExceeded(
                        f"no room for {n} bytes: {self.used} of {self.capacity} bytes used, "
                        f"{self.reserved} reserved by writes in flight, and nothing left "
                        "that may be evicted (pinned, leased or being written)"
                    )
                self._cap_changed.wait(0.05)

    def _unreserve(self, n: int) -> None:
        with self._cap_changed:
            self.reserved -= n
            self._cap_changed.notify_all()

    # -- leases -----------------------------------------------------------------------
    def is_leased(self, h: bytes) -> bool:
        with self._cap_lock:
            return self._leases[h] > 0

    @contextmanager
    def lease(self, key: PageKey | str) -> Iterator[tuple[PageRow, BlobRow]]:
        """Hold a page's data in place: it is not evicted, and its files are not removed
        (even by delete) until the lease ends. Raises PageNotFound."""
        self._check_open()
        k = as_key(key)
        with self._cap_lock:
            found = self.index.page_and_blob(k.path)
            if found is None:
                raise PageNotFound(f"no page {k.path!r}")
            self._leases[found[1].hash] += 1
        try:
            yield found
        finally:
            self._unlease(found[1].hash)

    def _unlease(self, h: bytes) -> None:
        with self._cap_lock:
            self._leases[h] -= 1
            if self._leases[h] > 0:
                return
            del self._leases[h]
            blobs = self._deferred.pop(h, [])
        for b in blobs:
            self._drop_files(b)

    def _drop_files(self, b: BlobRow) -> None:
        """Unlink a blob's local files now, or when its last lease ends."""
        if b.extents is None:
            return
        with self._cap_lock:
            if self._leases[b.hash] > 0:
                self._deferred.setdefault(b.hash, []).append(b)
                return
            self._leases.pop(b.hash, None)
        self.tier.unlink(b.extents)
        with self._cap_lock:
            self._account(b, -1)

    # -- put --------------------------------------------------------------------------
    def _start_device(self, k: PageKey) -> int:
        li = k.layer_index
        if li is not None:
            # Consecutive layers of one prefix land on consecutive devices.
            return (
                zlib.crc32(k.session_dir.encode() + b"/" + (k.prefix or "").encode()) + li
            ) % self.tier.n
        return self.tier.next_start()

    def put(
        self,
        key: PageKey | str,
        data: object,
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
    ) -> PageInfo:
        """Store a page. Write-once: raises PageExists unless ``replace``.

        Raises InvalidKey, PageExists, CapacityExceeded. On any error nothing is visible and
        nothing is left on disk.
        """
        self._check_open()
        k = as_key(key)
        a = _check_attrs(attrs)
        mv = _as_bytes_view(data)
        if not replace and self.index.page(k.path) is not None:
            raise PageExists(f"page {k.path!r} exists; pages are write-once")
        size = len(mv)
        leaves: bytes | None = None
        if size <= DEDUP_FIRST_MAX:
            # Small pages: hash first (it is cheap), so a duplicate costs no write at all.
            leaves = self._group_now(mv)
            h = tree_hash(size, leaves)
            b = self.index.blob(h)
            if b is not None and b.local:
                try:
                    return self._commit(k, h, size, leaves, None, 0, a, pin, replace, None)
                except _BlobGone:
                    pass  # evicted meanwhile: write the data after all
        need = self.tier.disk_bytes(size)
        self._reserve(need)
        w = self.tier.writer(self._start_device(k), direct=True)
        try:
            # The writes are submitted first, so their I/O is under way before hashing takes
            # the CPUs; then the leaves are hashed on the hash pool and in this thread. A
            # page hashed already (small) is written by this thread: no hop to a pool.
            piece = self.tier.piece
            writes = [
                self.io_pool.submit(w.write, o, mv[o : o + piece])
                for o in range(piece if leaves is not None else 0, size, piece)
            ]
            try:
                if leaves is not None:
                    if size:
                        w.write(0, mv[:piece])
                else:
                    groups = range(0, size, HASH_GROUP)
                    hashing = [
                        self.hash_pool.submit(self._group_now, mv[o : o + HASH_GROUP])
                        for o in groups[:-1]
                    ]
                    last = self._group_now(mv[groups[-1] :])
                    leaves = b"".join(f.result() for f in hashing) + last
            finally:
                # Every write must be over before abort() may close the files under it.
                _wait_all(writes)
            extents, disk = w.finish(size)
        except BaseException:
            w.abort()
            self._unreserve(need)
            raise
        assert leaves is not None
        return self._commit(
            k, tree_hash(size, leaves), size, leaves, w, need, a, pin, replace, extents, disk
        )

    def _commit(
        self,
        k: PageKey,
        h: bytes,
        size: int,
        leaves: bytes,
        w: BlobWriter | None,
        reserved: int,
        attrs: dict[str, str],
        pin: bool,
        replace: bool,
        extents: tuple | None,
        disk: int = 0,
    ) -> PageInfo:
        sess_attrs = {"model": attrs["model"]} if "model" in attrs else {}
        try:
            used_new, freed, _old = self.index.commit_page(
                path=k.path,
                session=k.session_dir,
                h=h,
                size=size,
                leaves=leaves,
                extents=extents,
                disk_bytes=disk,
                attrs=attrs,
                pinned=pin,
                replace=replace,
                session_attrs=sess_attrs,
            )
        except LookupError as e:
            if w is not None:
                w.abort()
            self._unreserve(reserved)
            if not isinstance(e, KeyError):
                raise _BlobGone() from e
            raise PageExists(f"page {k.path!r} exists; pages are write-once") from None
        except BaseException:
            if w is not None:
                w.abort()
            self._unreserve(reserved)
            raise
        if w is not None and not used_new:
            # Identical data was already held: share it. The redundant files go before their
            # reservation is released, so bytes on disk never exceed the cap.
            w.abort()
        with self._cap_changed:
            self.reserved -= reserved
            self._cap_changed.notify_all()
            if used_new and extents is not None:
                b = self.index.blob(h)
                assert b is not None
                self._account(b, +1)
        with self._cap_lock:
            self._counters["puts"] += 1
            self._counters["bytes_written"] += size
            if not used_new or w is None:
                self._counters["dedup_puts"] += 1
        if freed is not None:
            self._drop_files(freed)
            self.policy.forget_blob(freed)
        if _old is not None and _old.hash != h:
            self.policy.pages_removed([_old])  # a replace: the archive's manifest is stale
        try:
            return self.stat(k)
        except PageNotFound:
            # Under pressure another thread's eviction may already have taken the page it
            # just became: the put still succeeded. Report the page as it was committed.
            now = time.time()
            return PageInfo(
                path=k.path,
                session=k.session,
                size=size,
                checksum=h.hex(),
                created=now,
                atime=now,
                pinned=pin,
                tier="local",
                attrs=attrs,
            )

    def _submit_leaves(self, mv: memoryview) -> builtins.list[Future[bytes]]:
        def group(o: int) -> bytes:
            chunk = mv[o : o + HASH_GROUP]
            return b"".join(leaf_hash(chunk[i : i + LEAF]) for i in range(0, len(chunk), LEAF))

        if len(mv) == 0:
            return [self.hash_pool.submit(leaf_hash, b"")]
        return [self.hash_pool.submit(group, o) for o in range(0, len(mv), HASH_GROUP)]

    def _leaves_parallel(self, mv: memoryview) -> bytes:
        if len(mv) <= HASH_GROUP:
            return self._group_now(mv)
        return b"".join(f.result() for f in self._submit_leaves(mv))

    @staticmethod
    def _group_now(mv: memoryview) -> bytes:
        if len(mv) == 0:
            return leaf_hash(b"")
        return b"".join(leaf_hash(mv[i : i + LEAF]) for i in range(0, len(mv), LEAF))

    def begin_write(self, key: PageKey | str) -> PageWriter:
        """A streaming writer for a page whose size is not known up front (the FUSE mount)."""
        self._check_open()
        k = as_key(key)
        return PageWriter(self, k)

    # -- get --------------------------------------------------------------------------
    def get(self, key: PageKey | str, into: object | None = None) -> bytes | int:
        """Read a whole page. Returns bytes, or with ``into`` (a writable buffer at least the
        page's size) the number of bytes read into it. Raises PageNotFound, CorruptPage."""
        self._check_open()
        k = as_key(key)
        with self.lease(k) as (page, blob):
            if not blob.local:
                blob = self._restore(blob, page)
            if into is None:
                buf = aligned_buffer(blob.size)
                self._read_verified(page, blob, buf, 0, blob.size)
                return bytes(buf)
            dest = _as_bytes_view(into)
            if dest.readonly:
                raise TypeError("the buffer to read into is read-only")
            if len(dest) < blob.size:
                raise ValueError(
                    f"buffer of {len(dest)} bytes is smaller than page "
                    f"{k.path!r} ({blob.size} bytes)"
                )
            self._read_verified(page, blob, dest, 0, blob.size)
            return blob.size

    def read_range(self, key: PageKey | str, offset: int, size: int) -> bytes:
        """Read ``size`` bytes at ``offset`` (short at the end), verifying the leaves touched."""
        self._check_open()
        k = as_key(key)
        with self.lease(k) as (page, blob):
            if offset >= blob.size or size <= 0:
                return b""
            if not blob.local:
                blob = self._restore(blob, page)
            end = min(blob.size, offset + size)
            lo = offset - offset % LEAF
            hi = min(blob.size, -(-end // LEAF) * LEAF)
            buf = aligned_buffer(hi - lo)
            self._read_verified(page, blob, buf, lo, hi - lo)
            return bytes(buf[offset - lo : end - lo])

    def read_held(
        self, page: PageRow, blob: BlobRow, offset: int, size: int, *, buffered: bool = False
    ) -> memoryview:
        """:meth:`read_range` for data held by :meth:`lease`: reads exactly the leased page even
        if its key has since been replaced or deleted (an open file on the mount). Returns a
        view of a fresh buffer (no extra copy). ``buffered``: plain preads through the page
        cache on this thread (the mount: kernel read-ahead on the data files, no fresh
        mmap per request, no hop to the I/O pool). Raises CorruptPage, PageNotFound (data
        gone from every tier)."""
        self._check_open()
        if offset >= blob.size or size <= 0:
            return memoryview(b"")
        if not blob.local:
            blob = self._restore(blob, page)
        end = min(blob.size, offset + size)
        lo = offset - offset % LEAF
        hi = min(blob.size, -(-end // LEAF) * LEAF)
        if buffered:
            data = self._read_buffered(page, blob, lo, hi - lo)
            return memoryview(data)[offset - lo : end - lo]
        buf = aligned_buffer(hi - lo)
        self._read_verified(page, blob, buf, lo, hi - lo)
        return buf[offset - lo : end - lo]

    def set_page_attrs(self, key: PageKey | str, attrs: dict[str, str]) -> None:
        """Merge ``attrs`` into a page's attributes (the mount keeps file modes here).
        Raises PageNotFound, InvalidKey."""
        self._check_open()
        k = as_key(key)
        if not self.index.update_page_attrs(k.path, _check_attrs(attrs)):
            raise PageNotFound(f"no page {k.path!r}")

    def _restore(self, blob: BlobRow, page: PageRow) -> BlobRow:
        with self._cap_lock:
            self._counters["misses"] += 1
        b = self.policy.restore_blob(blob)
        if not b.local:
            raise PageNotFound(f"page {page.path!r} could not be restored")
        return b

    def _read_buffered(self, page: PageRow, blob: BlobRow, off: int, n: int) -> bytes:
        """Page bytes [off, off+n) (leaf-aligned start) read with plain preads on this thread,
        every leaf verified before anything is returned. Raises CorruptPage."""
        assert blob.extents is not None and off % LEAF == 0
        parts: builtins.list[bytes] = []
        try:
            for p in self.tier.pieces(blob.extents, off, n):
                path = self.tier.abspath(p.dev, p.file)
                fd = os.open(path, os.O_RDONLY)
                try:
                    got = os.pread(fd, p.n, p.file_off)
                    while len(got) < p.n:  # a short read: only at the end of the file
                        more = os.pread(fd, p.n - len(got), p.file_off + len(got))
                        if not more:
                            raise CorruptedFile(path, "data file is shorter than its extents")
                        got += more
                finally:
                    os.close(fd)
                parts.append(got)
        except OSError as e:
            if (corrupt := self._as_corrupt(page, e)) is None:
                raise
            raise corrupt from e
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        mv = memoryview(data)
        digests = (leaf_hash(mv[j * LEAF : (j + 1) * LEAF]) for j in range(-(-n // LEAF)))
        self._check_leaves(page, blob, off // LEAF, digests, n)
        return data

    def _read_verified(
        self, page: PageRow, blob: BlobRow, dest: memoryview, off: int, n: int
    ) -> None:
        """Read page bytes [off, off+n) (leaf-aligned start) into dest and verify each leaf.

        Reads run on the I/O pool; each group of leaves is hashed as soon as its bytes are in,
        so hashing overlaps the disk. A mismatch raises CorruptPage and the caller gets nothing.
        """
        assert blob.extents is not None and off % LEAF == 0
        pieces = list(self.tier.pieces(blob.extents, off, n, max_piece=READ_PIECE))
        # A bounded window of reads in flight: pieces then land one after another, and each
        # is hashed while the next ones are read, instead of all landing at the end together.
        window = max(READ_WINDOW, 2 * self.tier.n)
        futs: dict[int, Future[None]] = {}
        got: builtins.list[bytes] = []
        hasher = leaf_hasher()
        nxt = 0
        opened: dict[tuple[int, str], tuple[int, bool]] = {}
        try:
            try:
                opened = self.tier.open_files(pieces)
                for j, p in enumerate(pieces):
                    if len(pieces) == 1:  # one piece: read it here, no hop to the pool
                        self.tier.read_piece(p, dest, None, opened)
                        nxt = 1
                    while nxt < len(pieces) and nxt < j + window:
                        futs[nxt] = self.io_pool.submit(
                            self.tier.read_piece, pieces[nxt], dest, None, opened
                        )
                        nxt += 1
                    if j in futs:
                        futs.pop(j).result()
                    pos, end = p.dest_off, p.dest_off + p.n
                    while pos < end:  # feed the leaf hashes, cutting at leaf boundaries
                        cut = min(end, (pos // LEAF + 1) * LEAF)
                        hasher.update(dest[pos:cut])
                        pos = cut
                        if pos % LEAF == 0 or pos == n:
                            got.append(hasher.digest())
                            hasher = leaf_hasher()
            finally:
                # No read may still be landing in the caller's buffer once we return or raise.
                try:
                    _wait_all(list(futs.values()))
                finally:
                    self.tier.close_files(opened)
        except OSError as e:
            if (corrupt := self._as_corrupt(page, e)) is None:
                raise
            raise corrupt from e
        self._check_leaves(page, blob, off // LEAF, got, n)

    def _as_corrupt(self, page: PageRow, e: OSError) -> CorruptPage | None:
        """A failed data-file read: a missing or short data file is a CorruptPage (counted);
        None for any other OSError (EIO, EMFILE...), which the caller re-raises as it is."""
        if isinstance(e, FileNotFoundError):
            self._count("corrupt_reads")
            return CorruptPage(f"page {page.path!r}: a data file is missing ({e.filename})")
        if isinstance(e, KvfsError):
            self._count("corrupt_reads")
            return CorruptPage(f"page {page.path!r}: {e}")
        return None

    def _check_leaves(
        self, page: PageRow, blob: BlobRow, first: int, digests: Iterable[bytes], n: int
    ) -> None:
        """Compare leaf digests (from leaf ``first`` on) with the stored ones; on a match
        count the read as a hit and touch the page, else raise CorruptPage (counted)."""
        for j, digest in enumerate(digests):
            bad = first + j
            if digest != blob.leaves[bad * DIGEST : (bad + 1) * DIGEST]:
                self._count("corrupt_reads")
                raise CorruptPage(
                    f"page {page.path!r} is corrupt: bytes {bad * LEAF}-"
                    f"{min(blob.size, (bad + 1) * LEAF)} do not match the checksum"
                )
        with self._cap_lock:
            self._counters["gets"] += 1
            self._counters["hits"] += 1
            self._counters["bytes_read"] += n
        self.touch(page)

    def _count(self, name: str, n: int = 1) -> None:
        with self._cap_lock:
            self._counters[name] += n

    def touch(self, page: PageRow) -> None:
        now = time.time()
        pa, ba, sa = self._atimes
        with self._cap_lock:
            pa[page.path] = now
            ba[page.hash] = now
            sa[page.session] = now
            due = time.monotonic() - self._atime_flushed > ATIME_FLUSH_SECONDS
        if due:
            self.flush_atimes()

    def flush_atimes(self) -> None:
        with self._cap_lock:
            batch, self._atimes = self._atimes, ({}, {}, {})
            self._atime_flushed = time.monotonic()
        self.index.flush_atimes(*batch)

    # -- metadata ---------------------------------------------------------------------
    def _info(self, p: PageRow, b: BlobRow) -> PageInfo:
        tier = "+".join(t for t, on in (("local", b.local), ("archive", b.archived)) if on)
        ext = tuple(
            Extent(e[0], self.tier.abspath(e[0], e[1]), e[2], e[3]) for e in (b.extents or ())
        )
        return PageInfo(
            path=p.path,
            session=PageKey(p.path).session,
            size=p.size,
            checksum=b.hash.hex(),
            created=p.created,
            atime=p.atime,
            pinned=p.pinned,
            tier=tier or "none",
            attrs=p.attrs,
            extents=ext,
        )

    def stat(self, key: PageKey | str) -> PageInfo:
        self._check_open()
        k = as_key(key)
        found = self.index.page_and_blob(k.path)
        if found is None:
            raise PageNotFound(f"no page {k.path!r}")
        return self._info(*found)

    def exists(self, key: PageKey | str) -> bool:
        self._check_open()
        return self.index.page(as_key(key).path) is not None

    def list(
        self,
        *,
        session: str | None = None,
        prefix: str | None = None,
        path_prefix: str | None = None,
    ) -> builtins.list[PageInfo]:
        """Pages of a session (optionally of one prefix of it), or under a path prefix."""
        self._check_open()
        if prefix is not None and session is None:
            raise InvalidKey("prefix needs a session")
        sd = session_dir(session) if session is not None else None
        pp = path_prefix
        if prefix is not None:
            pp = f"{sd}/{prefix}/"
        rows = self.index.pages(session=sd, path_prefix=pp)
        out = []
        for p in rows:
            b = self.index.blob(p.hash)
            if b is not None:
                out.append(self._info(p, b))
        return out

    def sessions(self) -> builtins.list[SessionInfo]:
        self._check_open()
        return [self._session_info(s.dir) for s in self.index.sessions()]

    def session_info(self, session: str) -> SessionInfo:
        self._check_open()
        return self._session_info(session_dir(session))

    def _session_info(self, d: str) -> SessionInfo:
        s = self.index.session(d)
        if s is None:
            raise SessionNotFound(f"no session {d!r}")
        u = self.index.session_usage(d)
        name = d.split("/", 1)[1] if d.startswith("sessions/") else d
        return SessionInfo(
            session=name,
            dir=d,
            created=s.created,
            atime=s.atime,
            pinned=s.pinned,
            attrs=s.attrs,
            pages=u["pages"],
            bytes=u["bytes"],
            local_bytes=u["local_bytes"],
            archived_bytes=u["archived_bytes"],
        )

    def set_session_attrs(self, session: str, attrs: dict[str, str]) -> None:
        self._check_open()
        self.index.set_session_attrs(session_dir(session), _check_attrs(attrs))

    # -- delete -----------------------------------------------------------------------
    def delete(self, key: PageKey | str) -> None:
        """Remove a page. Its data goes with its last reference. Raises PageNotFound."""
        self._check_open()
        k = as_key(key)
        gone, freed = self.index.delete_pages([k.path])
        if not gone:
            raise PageNotFound(f"no page {k.path!r}")
        self._after_delete(gone, freed)

    def delete_session(self, session: str) -> int:
        """Remove every page of a session and the session itself; returns pages removed."""
        self._check_open()
        d = session_dir(session)
        if self.index.session(d) is None:
            raise SessionNotFound(f"no session {session!r}")
        gone, freed = self.index.delete_pages(p.path for p in self.index.pages(session=d))
        self._after_delete(gone, freed)
        with self.index.transaction() as db:
            db.execute("DELETE FROM sessions WHERE dir=?", (d,))
        return len(gone)

    def _after_delete(self, gone: builtins.list[PageRow], freed: builtins.list[BlobRow]) -> None:
        for b in freed:
            self._drop_files(b)
            self.policy.forget_blob(b)
        for d in {p.session for p in gone}:
            self.index.drop_session_if_empty(d)
        if gone:
            self.policy.pages_removed(gone)

    def delete_blob_pages(self, blob: BlobRow, reason: str) -> int:
        """Evict by deletion (no archive): every page sharing this data goes. Returns bytes freed."""
        pages = self.index.pages_of_blob(blob.hash)
        gone, freed = self.index.delete_pages(p.path for p in pages)
        self._after_delete(gone, freed)
        with self._cap_lock:
            self._evictions[reason] += 1
        n = sum(b.disk_bytes for b in freed if b.extents is not None)
        from ._events import log_event

        log_event(
            "evict",
            content=blob.hash.hex()[:16],
            reason=reason,
            pages=len(gone),
            bytes=n,
            archived=False,
        )
        return n

    def rename(self, src: PageKey | str, dst: PageKey | str) -> None:
        """Move a page to a new key, atomically replacing any page there."""
        self._check_open()
        s, d = as_key(src), as_key(dst)
        try:
            old, freed = self.index.rename_page(s.path, d.path, d.session_dir)
        except KeyError:
            raise PageNotFound(f"no page {s.path!r}") from None
        if freed is not None:
            self._drop_files(freed)
            self.policy.forget_blob(freed)
        self.index.drop_session_if_empty(old.session)
        # The archive's manifests of both sessions list the old name and the replaced data.
        self.policy.pages_removed(
            [old, dataclasses.replace(old, path=d.path, session=d.session_dir)]
        )

    # -- pin --------------------------------------------------------------------------
    def pin(self, key: PageKey | str, pinned: bool = True) -> None:
        self._check_open()
        k = as_key(key)
        if not self.index.set_page_pinned(k.path, pinned):
            raise PageNotFound(f"no page {k.path!r}")

    def pin_session(self, session: str, pinned: bool = True) -> None:
        """Pin a session (it may have no pages yet: pinning reserves its place)."""
        self._check_open()
        self.index.set_session_pinned(session_dir(session), pinned)

    # -- eviction ---------------------------------------------------------------------
    def evict(
        self,
        target: PageKey | str | None = None,
        *,
        session: str | None = None,
        reason: str = "manual",
    ) -> int:
        """Drop local copies of one page or a whole session by policy. Returns bytes freed.

        Pinned and leased data is skipped. Without an archive tier this deletes the pages.
        """
        self._check_open()
        if session is not None:
            d = session_dir(session)
            if self.index.session(d) is None:
                raise SessionNotFound(f"no session {session!r}")
            hashes = {p.hash for p in self.index.pages(session=d)}
        elif target is not None:
            p = self.index.page(as_key(target).path)
            if p is None:
                raise PageNotFound(f"no page {as_key(target).path!r}")
            hashes = {p.hash}
        else:
            raise ValueError("evict needs a page or a session")
        evictable = {b.hash for b in self.index.eviction_candidates(1 << 62)}
        freed = 0
        with self._evict_lock:
            for h in hashes:
                b = self.index.blob(h)
                if b is None or not b.local or h not in evictable or self.is_leased(h):
                    continue
                freed += self.policy.evict_blob(b, reason)
        return freed

    # -- archive tier (kvfs/_archive.py) ---------------------------------------------
    def _archive(self):  # type: ignore[no-untyped-def]  # -> ArchivingPolicy
        from ._archive import ArchivingPolicy

        self._check_open()
        if not isinstance(self.policy, ArchivingPolicy):
            raise ArchiveUnavailable("no archive tier is configured (set archive_url)")
        return self.policy

    def spill(self, session: str) -> int:
        """Upload the session's pages the archive lacks plus its manifest, then drop local
        copies (pinned sessions too: this is the explicit request). Returns bytes uploaded.
        Raises SessionNotFound, ArchiveUnavailable (then nothing local was dropped)."""
        return int(self._archive().spill(session_dir(session)))

    def restore(self, session: str) -> int:
        """Bring a session back: import its manifest's pages this store lacks (from any host
        sharing the archive) and prefetch every page. Returns bytes restored. Raises
        SessionNotFound, ArchiveUnavailable, CorruptPage."""
        return int(self._archive().restore_session(session_dir(session)))

    def archived_sessions(self) -> builtins.list[dict[str, object]]:
        """Sessions that have a manifest in the archive, from every host sharing it."""
        return list(self._archive().archived_sessions())

    # -- statistics -------------------------------------------------------------------
    def statistics(self) -> StoreStatistics:
        self._check_open()
        c = self.index.counts()
        free = self.tier.free_bytes()
        with self._cap_lock:
            k = dict(self._counters)
            return StoreStatistics(
                capacity_bytes=self.capacity,
                used_bytes=self.used,
                reserved_bytes=self.reserved,
                pages=c["pages"],
                sessions=c["sessions"],
                local_blobs=c["local_blobs"],
                local_bytes=c["local_bytes"],
                logical_bytes=c["logical_bytes"],
                puts=k.get("puts", 0),
                dedup_puts=k.get("dedup_puts", 0),
                gets=k.get("gets", 0),
                hits=k.get("hits", 0),
                misses=k.get("misses", 0),
                corrupt_reads=k.get("corrupt_reads", 0),
                bytes_written=k.get("bytes_written", 0),
                bytes_read=k.get("bytes_read", 0),
                evictions=dict(self._evictions),
                extra=self.policy.statistics(),
                devices=tuple(
                    DeviceStatistics(i, str(r), self.dev_used[i], free[i])
                    for i, r in enumerate(self.tier.roots)
                ),
            )

    # -- verification -----------------------------------------------------------------
    def fsck(
        self, *, repair: bool = False, verify_data: bool = True, progress: object = None
    ) -> dict[str, builtins.list[str]]:
        """Check the index against the files: missing files, wrong sizes, bad checksums,
        orphans. With ``repair``, orphans are removed and pages with missing or corrupt
        data are deleted (they cannot be served). Returns findings by kind."""
        self._check_open()
        out: dict[str, builtins.list[str]] = {
            "missing": [],
            "corrupt": [],
            "orphans": [],
            "repaired": [],
        }
        known = self.index.all_extent_files()
        for dev, rel in self.tier.all_files():
            if (dev, rel) not in known:
                out["orphans"].append(self.tier.abspath(dev, rel))
        blobs = self.index.local_blobs()
        bad: builtins.list[BlobRow] = []
        for i, b in enumerate(blobs):
            assert b.extents is not None
            if callable(progress):
                progress(i, len(blobs))
            missing = [
                self.tier.abspath(e[0], e[1])
                for e in b.extents
                if not os.path.exists(self.tier.abspath(e[0], e[1]))
            ]
            if missing:
                out["missing"] += missing
                bad.append(b)
                continue
            if verify_data:
                buf = aligned_buffer(b.size)
                try:
                    for p in self.tier.pieces(b.extents, 0, b.size):
                        self.tier.read_piece(p, buf)
                    ok = (
                        tree_hash(b.size, self._group_now(buf) if b.size else leaf_hash(b""))
                        == b.hash
                    )
                except OSError:
                    ok = False
                if not ok:
                    out["corrupt"].append(b.hash.hex())
                    bad.append(b)
        if repair:
            for path in out["orphans"]:
                try:
                    os.unlink(path)
                    out["repaired"].append(f"removed orphan {path}")
                except FileNotFoundError:
                    pass
            for b in bad:
                n = self.delete_blob_pages(b, "fsck")
                out["repaired"].append(f"deleted pages of {b.hash.hex()[:16]} ({n} bytes)")
        return out


def _wait_all(futs: builtins.list[Future[None]]) -> None:
    """Wait for every future; then raise the first error, if any."""
    first: BaseException | None = None
    for f in futs:
        try:
            f.result()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


class _BlobGone(Exception):
    """The data a dedup put meant to share was evicted before the commit."""


class PageWriter:
    """Streams one page to the local tier; the page appears when :meth:`commit` returns.

    Writes may come in any order and size. Room is reserved as the page grows. Until commit,
    nothing is visible; :meth:`abort` (or a crash) leaves nothing behind.
    """

    def __init__(self, engine: Engine, key: PageKey) -> None:
        self.engine = engine
        self.key = key
        self._w = engine.tier.writer(engine._start_device(key), direct=False)
        self._reserved = 0
        self._size = 0
        self._lock = threading.Lock()
        self._done = False
        # Leaves a single write covered whole are checksummed from the caller's buffer as they
        # are written, so commit need not read them back. A leaf's hash is kept only if no
        # other write touched that leaf while it was in flight (_busy, _gen).
        self._leaf_hashes: dict[int, bytes] = {}
        self._busy: Counter[int] = Counter()
        self._gen: Counter[int] = Counter()

    @property
    def size(self) -> int:
        return self._size

    def write(self, offset: int, data: bytes | memoryview) -> int:
        if self._done:
            raise ValueError("writer is closed")
        end = offset + len(data)
        with self._lock:
            need = self.engine.tier.disk_bytes(max(end, self._size)) - self._reserved
            if need > 0:
                # Reserve ahead in stripe units so small writes do not each pay the check.
                extra = min(self.engine.tier.unit, max(0, self.engine.capacity // 64))
                self.engine._reserve(need + extra, own=self._reserved)
                self._reserved += need + extra
            self._size = max(self._size, end)
            touched = range(offset // LEAF, -(-end // LEAF)) if end > offset else range(0)
            for i in touched:
                self._leaf_hashes.pop(i, None)
                self._busy[i] += 1
                self._gen[i] += 1
            gens = {i: self._gen[i] for i in touched}
        mv = memoryview(data)
        hashes: dict[int, bytes] = {}
        try:
            self._w.write(offset, mv)
            for i in touched:
                if i * LEAF >= offset and (i + 1) * LEAF <= end:
                    hashes[i] = leaf_hash(mv[i * LEAF - offset : (i + 1) * LEAF - offset])
        finally:
            with self._lock:
                for i in touched:
                    self._busy[i] -= 1
                    if i in hashes and self._busy[i] == 0 and self._gen[i] == gens[i]:
                        self._leaf_hashes[i] = hashes[i]
                    else:
                        self._leaf_hashes.pop(i, None)
                        self._gen[i] += 1
        return len(data)

    def truncate(self, size: int) -> None:
        with self._lock:
            if size < self._size:
                raise ValueError("a page being written cannot shrink")
        if size > self._size:
            self.write(self._size, bytes(size - self._size))

    def read(self, offset: int, size: int) -> bytes:
        """Read back bytes written so far (an engine may re-read its own file before close)."""
        end = min(self._size, offset + size)
        out = bytearray()
        pos = offset
        while pos < end:
            dev, foff = self.engine.tier.locate(self._w.start, pos)
            take = min(end - pos, self.engine.tier.unit - pos % self.engine.tier.unit)
            fd = os.open(self.engine.tier.abspath(dev, self._w.rel), os.O_RDONLY)
            try:
                chunk = os.pread(fd, take, foff)
            finally:
                os.close(fd)
            out += chunk.ljust(take, b"\0")
            pos += take
        return bytes(out)

    def commit(
        self, *, attrs: dict[str, str] | None = None, replace: bool = False, pin: bool = False
    ) -> PageInfo:
        """Make the written bytes a page. Raises PageExists (unless replace), CapacityExceeded."""
        if self._done:
            raise ValueError("writer is closed")
        self._done = True
        eng = self.engine
        size = self._size
        try:
            extents, disk = self._w.finish(size)
            leaves = self._hash_files(extents, size)
        except BaseException:
            self._w.abort()
            eng._unreserve(self._reserved)
            raise
        return eng._commit(
            self.key,
            tree_hash(size, leaves),
            size,
            leaves,
            self._w,
            self._reserved,
            _check_attrs(attrs),
            pin,
            replace,
            extents,
            disk,
        )

    def _hash_files(self, extents: tuple, size: int) -> bytes:
        # The bytes were just written through the page cache, so reading them back is a
        # memory copy, not disk I/O. Leaves already checksummed by write() are not read.
        t = self.engine.tier
        with self._lock:
            known = dict(self._leaf_hashes)
        n = -(-size // LEAF)
        if size == 0 or not known:
            buf = aligned_buffer(size)
            for p in t.pieces(extents, 0, size):
                t.read_piece(p, buf, direct=False)
            return self.engine._leaves_parallel(buf)
        out = []
        for i in range(n):
            h = known.get(i)
            if h is None:
                lo, ln = i * LEAF, min(LEAF, size - i * LEAF)
                buf = aligned_buffer(ln)
                for p in t.pieces(extents, lo, ln):
                    t.read_piece(p, buf, direct=False)
                h = leaf_hash(buf)
            out.append(h)
        return b"".join(out)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._w.abort()
        self.engine._unreserve(self._reserved)
