"""The write path of the engine: put, the commit that publishes a page, leaf hashing, and
:class:`PageWriter` (streaming writes for the mount).

Life of a put (what a crash at each step leaves behind):

1. the key and attributes are checked; nothing on disk yet;
2. room is reserved under the capacity cap, evicting by policy if needed (a page small
   enough, or one the cap has no room for now, is hashed first: a duplicate of data held
   shares it, reserving nothing, and goes to step 4);
3. the data goes to new files in the device directories (one vectored write per file from
   the calling thread, see ``BlobWriter.write_whole``), and its leaf hashes are computed
   on the hash pool meanwhile; the files are fsynced. A crash here leaves unreferenced files, swept at the
   next start (the index records whether the last shutdown was clean);
4. one SQLite transaction (WAL, synchronous=FULL) inserts the page row: this is the instant
   the page exists. If identical content was already held, the new files are deleted and
   the page shares the existing data (reference-counted).

Functions here take the :class:`~kvfs._engine.Engine` whose state they use; the engine's
public methods are the entry points.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ._aligned import aligned_buffer, as_bytes_view
from ._checksum import LEAF, leaf_hash, tree_hash
from ._errors import CapacityExceeded, IndexUnavailable, InvalidKey, PageExists, PageNotFound
from ._index import BlobRow, PageCommit, PageRow
from ._keys import PageKey
from ._local import BlobWriter, wait_all
from ._reads import page_info
from ._types import PageInfo

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = [
    "ATTR_GID",
    "ATTR_MODE",
    "ATTR_MTIME",
    "ATTR_UID",
    "ATTR_XATTR",
    "RESERVED_ATTRS",
    "RESERVE_WAIT_SECONDS",
    "XATTR_SIZE_MAX",
    "PageWriter",
    "check_attrs",
    "leaves_now",
    "put",
]

#: how long a write waits for room that writes in flight hold (kvfs/_engine.py, _reserve)
RESERVE_WAIT_SECONDS = 10.0
#: a streaming writer grows by this many zero bytes a write when truncated to a larger size
TRUNCATE_PIECE = 8 << 20
HASH_GROUP = 2 * LEAF  # bytes hashed per pool task when a streamed page is committed
#: Pages up to this size are hashed before they are written, so a duplicate costs no write;
#: larger ones are hashed while they are written (a duplicate's files are then removed).
DEDUP_FIRST_MAX = 256 * 1024


#: Page attributes the mount keeps POSIX metadata in (set by chmod/chown/utime on the mount).
ATTR_MODE, ATTR_UID, ATTR_GID, ATTR_MTIME = "fs.mode", "fs.uid", "fs.gid", "fs.mtime_ns"
#: their common prefix: neither listed nor settable as ``user.kvfs.attr.*`` on the mount
RESERVED_ATTRS = "fs."
#: ``user.kvfs.attr.<k>``: the page's attribute ``k`` (what ``put --attr`` and the object
#: API's ``attrs`` set) as an extended attribute on the mount
ATTR_XATTR = "user.kvfs.attr."
#: The largest extended attribute value Linux hands to a process (``XATTR_SIZE_MAX``).
XATTR_SIZE_MAX = 64 * 1024
#: Linux's limits on extended attributes (XATTR_NAME_MAX, XATTR_SIZE_MAX) bound an
#: attribute's name and value, so that the mount can show every one.
ATTR_NAME_MAX = 255 - len(ATTR_XATTR)


def check_attrs(attrs: dict[str, str] | None, *, page: bool = True) -> dict[str, str]:
    """A copy of ``attrs`` once every name and value is text; a page's (``page``) also
    text the mount can show as xattrs, and the mount's own (``fs.*``) only as it writes
    them: one that did not parse made the file, and every listing of its directory, fail
    with EIO. (A session's attributes show in its ``.kvfs.json``, of any size.)"""
    if attrs is None:
        return {}
    if not isinstance(attrs, dict):
        raise InvalidKey("attrs must be a dict of str to str")
    for k, v in attrs.items():
        if not isinstance(k, str):
            raise InvalidKey(f"attrs must map str to str; got the key {k!r} ({type(k).__name__})")
        if not isinstance(v, str):
            raise InvalidKey(f"attrs must map str to str; got {k!r}: {type(v).__name__}")
        try:
            name, value = k.encode("utf-8"), v.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(f"attrs: {k!r}: {v!r} is not valid UTF-8 text") from None
        if not page:
            continue
        if not 0 < len(name) <= ATTR_NAME_MAX or "\0" in k:
            raise InvalidKey(
                f"attrs: the name {k[:40]!r} must be 1 to {ATTR_NAME_MAX} bytes, without NUL"
            )
        if len(value) > XATTR_SIZE_MAX:
            raise InvalidKey(f"attrs: {k!r} is {len(value)} bytes; at most {XATTR_SIZE_MAX}")
        if k.startswith(RESERVED_ATTRS) and not _mount_attr_ok(k, v):
            raise InvalidKey(
                f"attrs: {k}={v!r}: names starting with {RESERVED_ATTRS!r} are the mount's "
                f"(an octal {ATTR_MODE}, a decimal {ATTR_UID}, {ATTR_GID} or {ATTR_MTIME})"
            )
    return dict(attrs)


def _mount_attr_ok(name: str, value: str) -> bool:
    try:
        n = int(value, 8 if name == ATTR_MODE else 10)
    except ValueError:
        return False
    if name == ATTR_MODE:
        return 0 <= n <= 0o7777
    if name in (ATTR_UID, ATTR_GID):
        return 0 <= n < 2**32
    return name == ATTR_MTIME


def start_device(eng: Engine, k: PageKey, size: int | None = None) -> int:
    """The first device of page ``k``'s data (``size`` None: not known yet), a failing
    device skipped (LocalTier.place)."""
    li = k.layer_index
    if li is not None:
        # Consecutive layers of one prefix land on consecutive devices.
        return eng.tier.place(
            (zlib.crc32(k.session_dir.encode() + b"/" + (k.prefix or "").encode()) + li)
            % eng.tier.n,
            size,
        )
    return eng.tier.next_start(size)


# -- leaf hashing -------------------------------------------------------------------------
def leaves_now(mv: memoryview) -> bytes:
    """The leaf digests of a buffer, hashed on this thread."""
    if len(mv) == 0:
        return leaf_hash(b"")
    return b"".join(leaf_hash(mv[i : i + LEAF]) for i in range(0, len(mv), LEAF))


def leaves_parallel(eng: Engine, mv: memoryview) -> bytes:
    """The leaf digests of a buffer, hashed on the engine's hash pool in groups of leaves."""
    if len(mv) <= HASH_GROUP:
        return leaves_now(mv)
    groups = [
        eng.hash_pool.submit(leaves_now, mv[o : o + HASH_GROUP])
        for o in range(0, len(mv), HASH_GROUP)
    ]
    return b"".join(f.result() for f in groups)


def _hash_beside_write(eng: Engine, mv: memoryview) -> builtins.list[Future[bytes]]:
    """Hash a page's leaves on the hash pool while this thread writes it: in as many
    contiguous spans as there are CPUs beside the writer's (at least one).

    One CPU is left to the write: its syscall, page pinning and completions slow down when
    every CPU hashes (measured on the 2-vCPU dev VM: a 16 MiB put's write took ~12% longer
    with two hashing threads than with one). A single thread hashes ~7 GB/s, so one span
    keeps up with a device; more CPUs hash striped pages over several devices in parallel.
    """
    leaves = -(-len(mv) // LEAF)
    spans = max(1, min(eng.hash_threads - 1, leaves))
    per = -(-leaves // spans) * LEAF
    return [eng.hash_pool.submit(leaves_now, mv[o : o + per]) for o in range(0, len(mv), per)]


def _hashed(eng: Engine, mv: memoryview) -> bytes:
    """The leaf digests of a put's data, hashed on the hash pool; the pool is done with
    the caller's buffer when this returns or raises (a Ctrl-C meanwhile included)."""
    hashing = _hash_beside_write(eng, mv)
    wait_all(hashing)
    return b"".join(f.result() for f in hashing)


# -- put ----------------------------------------------------------------------------------
class _BlobGone(Exception):
    """The data a dedup put meant to share was evicted before the commit."""


def _flag(name: str, value: object) -> bool:
    """A put's ``pin`` or ``replace``: True or False (numpy's bool too). Anything else is a
    TypeError: ``replace="no"`` is truthy, and replaced the page it was meant to keep."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ in ("bool", "bool_") and hasattr(value, "dtype"):  # numpy's
        return bool(value)
    raise TypeError(f"put's {name} is True or False, not {value!r}")


def put(
    eng: Engine,
    k: PageKey,
    data: object,
    *,
    attrs: dict[str, str] | None,
    pin: bool,
    replace: bool,
) -> PageInfo:
    """:meth:`Engine.put` once the store is known open and the key parsed."""
    pin, replace = _flag("pin", pin), _flag("replace", replace)
    a = check_attrs(attrs)
    mv = as_bytes_view(data)
    if not replace and eng.index.page(k.path) is not None:
        raise PageExists(f"page {k.path!r} exists; pages are write-once")
    size = len(mv)
    leaves: bytes | None = None
    need = eng.tier.disk_bytes(size)
    with eng._cap_lock:
        short = eng.used + eng.reserved + need > eng.capacity
    if size <= DEDUP_FIRST_MAX or short:
        # Small pages: hash first (it is cheap), so a duplicate costs no write at all. A
        # larger one too when there is no room for it now: a duplicate needs none, and
        # reserving it evicted the very page it duplicates (deleted, without an archive)
        # or, that page pinned, failed with CapacityExceeded.
        leaves = leaves_now(mv) if size <= DEDUP_FIRST_MAX else _hashed(eng, mv)
        shared = _share(eng, k, size, leaves, a, pin, replace)
        if shared is not None:
            return shared
    eng._reserve(need)
    start = start_device(eng, k, size)
    moved = False
    while True:
        w = eng.tier.writer(start, direct=True)
        try:
            # This thread writes (one vectored write per device file, see write_whole)
            # while the hash pool hashes the leaves: the write is the long pole, and
            # starting it here saves a hop to a pool. Small pages were hashed already.
            hashing = [] if leaves is not None else _hash_beside_write(eng, mv)
            try:
                w.write_whole(mv)
            finally:
                # Hashing reads the caller's buffer: it is over before put returns or
                # raises (a Ctrl-C meanwhile included).
                wait_all(hashing)
            done = [f.result() for f in hashing]
            if leaves is None:
                leaves = b"".join(done)
            extents, disk = w.finish(size)
            break
        except BaseException as e:
            w.abort()
            # A disk that failed under this write is failing now: the page goes to devices
            # that are not, where it can (once; a second failure is the caller's).
            again = eng.tier.place(start, size) if isinstance(e, OSError) else start
            if again != start and not moved:
                start, moved = again, True
                continue
            eng._unreserve(need)
            raise
    assert leaves is not None
    return commit(
        eng, k, tree_hash(size, leaves), size, leaves, w, need, a, pin, replace, extents, disk
    )


def _share(
    eng: Engine,
    k: PageKey,
    size: int,
    leaves: bytes,
    attrs: dict[str, str],
    pin: bool,
    replace: bool,
) -> PageInfo | None:
    """Publish page ``k`` on the local copy of identical data already held, writing
    nothing; None when there is no such copy (or it was evicted meanwhile)."""
    h = tree_hash(size, leaves)
    b = eng.index.blob(h)
    if b is None or not b.local or h in eng._damaged:
        return None
    try:
        return commit(eng, k, h, size, leaves, None, 0, attrs, pin, replace, None)
    except _BlobGone:
        return None  # evicted meanwhile: write the data after all


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT's KeyboardInterrupt until the block is over, then raise it. Only in the
    main thread (the one a signal handler runs in) and only where the handler is Python's
    default: a program's own handler, and trio's, are left to do what they do."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if got:
            raise KeyboardInterrupt


@_interrupts_held()
def commit(
    eng: Engine,
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
    """Publish a written (or shared) page in the index and settle the accounting.

    A Ctrl-C (KeyboardInterrupt) meanwhile is held until the page is published or not and
    its files and room settled, then raised: raised while the put waited for another
    thread's group commit, the files were removed, the room given back, and the commit
    that followed published the page all the same, naming files that were gone. So an
    interrupted put may have stored its page (``exists`` tells), as a remote one may."""
    sess_attrs = {"model": attrs["model"]} if "model" in attrs else {}
    now = time.time()
    # These files take the place of a local copy that failed its checksum: shared, a good
    # put would have been as unreadable as it.
    stale = eng._damaged.get(h) if w is not None else None
    try:
        used_new, freed, _old, replaced_copy = eng.index.commit_page(
            PageCommit(
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
                stale=stale,
                atime=eng.clock.stamp(k.session_dir, now),
            ),
            now=now,
        )
    except LookupError as e:
        if w is not None:
            w.abort()
        eng._unreserve(reserved)
        if not isinstance(e, KeyError):
            raise _BlobGone() from e
        raise PageExists(f"page {k.path!r} exists; pages are write-once") from None
    except BaseException as e:
        # A commit that the index's disk failed is rolled back, but the disk may have taken
        # the WAL's write before it failed the flush: then the page is there when the disk
        # comes back. Its files stay for that (the next open, never a clean one after such
        # a failure, sweeps them when the page is not there); any other failure, or one
        # before the commit, changed nothing in the index, and they go.
        if w is not None and not (isinstance(e, IndexUnavailable) and e.at_commit):
            w.abort()
        eng._unreserve(reserved)
        raise
    if w is not None and not used_new:
        # Identical data was already held: share it. The redundant files go before their
        # reservation is released, so bytes on disk never exceed the cap.
        w.abort()
    # A fresh blob's rows are known without reading them back (a put's last query saved).
    fresh = (
        BlobRow(h, size, leaves, 1, extents, disk, False, now, now)
        if used_new and extents is not None
        else None
    )
    with eng._cap_changed:
        eng.reserved -= reserved
        eng._cap_changed.notify_all()
        if fresh is not None:
            eng._account(fresh, +1)
    if replaced_copy is not None:
        eng.replaced_damaged(replaced_copy)
        fresh = None  # (the blob's row is not a fresh one's: read it back)
    with eng._cap_lock:
        eng._counters["puts"] += 1
        eng._counters["bytes_written"] += size
        if not used_new or w is None:
            eng._counters["dedup_puts"] += 1
    if freed is not None:
        eng._drop_files(freed)
    if _old is not None and _old.hash != h:
        eng.policy.pages_removed([_old])  # a replace: the archive's manifest is stale
    if fresh is None:
        try:
            return eng.stat(k)
        except PageNotFound:
            pass  # evicted at once by another thread's pressure: the put still succeeded
        fresh = BlobRow(h, size, leaves, 1, None, 0, False, now, now)
    page = PageRow(k.path, k.session_dir, h, size, now, now, pin, attrs)
    return page_info(eng, page, fresh)


# -- streaming writes ---------------------------------------------------------------------
class PageWriter:
    """Streams one page to the local tier; the page appears when :meth:`commit` returns.

    Writes may come in any order and size. Room is reserved as the page grows. Until commit,
    nothing is visible; :meth:`abort` (or a crash) leaves nothing behind.
    """

    def __init__(self, engine: Engine, key: PageKey) -> None:
        self.engine = engine
        self.key = key
        self._w = engine.tier.writer(start_device(engine, key), direct=False)
        self._reserved = 0
        self._size = 0
        self._lock = threading.Lock()
        #: writes past their reservation, writing their bytes outside the lock: commit and
        #: abort wait for them (an abort removed the files under such a write, which then
        #: made its file again, left on disk outside the cap with its descriptor open)
        self._writing = 0
        self._idle = threading.Condition(self._lock)
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

    @property
    def closed(self) -> bool:
        """Committed or aborted (or a commit under way)."""
        return self._done

    def write(self, offset: int, data: bytes | memoryview) -> int:
        with self.engine._using():
            return self._write(offset, data)

    def _write(self, offset: int, data: bytes | memoryview) -> int:
        if self._done:  # (first, before its arguments' errors; again under the lock, below)
            raise ValueError("writer is closed")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, not {offset!r}")
        # In bytes, whatever the buffer's item type: len() of a float32 array counts items.
        mv = as_bytes_view(data)
        end = offset + len(mv)
        with self._lock:
            if self._done:
                # (under the lock: a write that checked before it, and waited for it behind
                # another write waiting for room, went on after an abort, reserved room
                # nothing gave back and wrote files the abort had removed)
                raise ValueError("writer is closed")
            self._room_for(end)
            self._size = max(self._size, end)
            touched = range(offset // LEAF, -(-end // LEAF)) if end > offset else range(0)
            for i in touched:
                self._leaf_hashes.pop(i, None)
                self._busy[i] += 1
                self._gen[i] += 1
            gens = {i: self._gen[i] for i in touched}
            self._writing += 1
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
                self._writing -= 1
                if not self._writing:
                    self._idle.notify_all()
        return len(mv)

    def _room_for(self, end: int) -> None:
        """Reserve the room a page ``end`` bytes long takes on disk (caller holds _lock).
        Raises CapacityExceeded."""
        size = max(end, self._size)
        # (a size past the cap is refused before disk_bytes, which counts every stripe
        # unit: a write at offset 2**50 spent minutes there)
        whole = size if size > self.engine.capacity else self.engine.tier.disk_bytes(size)
        need = whole - self._reserved
        if whole > self.engine.capacity:  # (evicting for it would buy nothing)
            raise CapacityExceeded(
                f"a page of {whole} bytes{' on disk' if whole != size else ''} is larger "
                f"than the capacity cap of {self.engine.capacity} bytes"
            )
        if need > 0:
            # Reserve ahead in stripe units so small writes do not each pay the check;
            # the room ahead is a wish: without it, reserve just what this write needs.
            extra = min(
                self.engine.tier.unit,
                max(0, self.engine.capacity // 64),
                self.engine.capacity - whole,
            )
            # (one wait in all: the second try is for less, not for longer)
            deadline = time.monotonic() + RESERVE_WAIT_SECONDS
            try:
                self.engine._reserve(need + extra, own=self._reserved, deadline=deadline)
            except CapacityExceeded:
                if extra == 0:
                    raise
                extra = 0
                self.engine._reserve(need, own=self._reserved, deadline=deadline)
            self._reserved += need + extra

    def truncate(self, size: int) -> None:
        """Make the page being written ``size`` bytes long, as ``ftruncate`` does: growing
        adds zeros (room reserved as for a write: CapacityExceeded), shrinking drops the
        bytes past ``size`` from the data files, so a later write past the end leaves zeros
        between, not the dropped bytes. Not concurrently with a write (the mount waits for
        the writes queued before it). Raises ValueError for a negative size or a closed
        writer."""
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be a non-negative int, not {size!r}")
        with self.engine._using(), self._lock:
            if self._done:
                raise ValueError("writer is closed")
            if size < self._size:
                self._w.truncate(size)
                self._size = size
                for i in [i for i in self._leaf_hashes if (i + 1) * LEAF > size]:
                    del self._leaf_hashes[i]  # the leaf lost bytes, or lies past the end
                # Room held past what the smaller page needs goes back to other writers.
                keep = self.engine.tier.disk_bytes(size)
                if self._reserved > keep:
                    self.engine._unreserve(self._reserved - keep)
                    self._reserved = keep
                return
            if size > self._size:
                # The room first, for the whole size: `truncate -s 1P` allocated its zeros
                # before the cap was checked (MemoryError, not CapacityExceeded), and the
                # zeros go in pieces, each written with its room already held.
                self._room_for(size)
            start = self._size
        zeros = bytes(min(max(0, size - start), TRUNCATE_PIECE))
        for off in range(start, size, TRUNCATE_PIECE):
            self.write(off, memoryview(zeros)[: min(TRUNCATE_PIECE, size - off)])

    def read(self, offset: int, size: int) -> bytes:
        """Read back bytes written so far (an engine may re-read its own file before close)."""
        end = min(self._size, offset + size)
        out = bytearray()
        pos = offset
        while pos < end:
            dev, foff = self.engine.tier.locate(self._w.start, pos)
            take = min(end - pos, self.engine.tier.unit - pos % self.engine.tier.unit)
            chunk = b""  # a hole on a device no write reached yet: zeros, as past a file's end
            if self._w.has_file(dev):
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
        """Make the written bytes a page, those of the writes still writing theirs included
        (waited for). Raises PageExists (unless replace), CapacityExceeded, StoreClosed (the
        close discards what was written; abort() is then a no-op)."""
        with self.engine._using():
            return self._commit(attrs, replace, pin)

    def _close(self) -> bool:
        """Mark the writer closed (under the lock: a write waiting for it then sees so), once
        the writes still writing their bytes are done: their bytes are the commit's, their
        files the abort's. False if it was closed already."""
        with self._lock:
            if self._done:
                return False
            self._done = True
            self._idle.wait_for(lambda: not self._writing)
            return True

    def _commit(self, attrs: dict[str, str] | None, replace: bool, pin: bool) -> PageInfo:
        if not self._close():
            raise ValueError("writer is closed")
        eng = self.engine
        size = self._size
        try:
            extents, disk = self._w.finish(size)
            leaves = self._hash_files(extents, size)
        except BaseException:
            self._w.abort()
            eng._unreserve(self._reserved)
            raise
        return commit(
            eng,
            self.key,
            tree_hash(size, leaves),
            size,
            leaves,
            self._w,
            self._reserved,
            check_attrs(attrs),
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
            return leaves_parallel(self.engine, buf)
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
        """Discard what was written, once the writes still writing their bytes are done: their
        files go too, and their room. Idempotent; a no-op after commit."""
        if not self._close():  # (the store's close may abort it too)
            return
        self._w.abort()
        self.engine._unreserve(self._reserved)
