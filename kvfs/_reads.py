"""The read path of the engine: whole-page and ranged reads, every leaf verified, and the
metadata views (:class:`~kvfs._types.PageInfo`, :class:`~kvfs._types.SessionInfo`, listing).

Every read verifies the leaves it touches against the stored digests; a mismatch, or a
missing or short data file, raises :class:`~kvfs._errors.CorruptPage` (counted in
``statistics().corrupt_reads``). Functions here take the :class:`~kvfs._engine.Engine` whose
state they use; the engine's public methods are the entry points and hold the lease.
"""

from __future__ import annotations

import builtins
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from ._aligned import aligned_buffer, as_bytes_view, heap_view
from ._checksum import DIGEST, LEAF, leaf_hash, leaf_hasher
from ._errors import CorruptPage, InvalidKey, KvfsError, PageNotFound, SessionNotFound
from ._index import BlobRow, PageRow
from ._keys import PageKey, check_list_filter, session_name
from ._local import wait_all
from ._types import Extent, PageInfo, SessionInfo

if TYPE_CHECKING:
    from ._engine import Engine

T = TypeVar("T")

__all__ = ["get", "list_pages", "page_info", "read_held", "read_range", "session_info", "stat"]

#: Reads go in pieces of this size, at most READ_WINDOW (or two per device) in flight; each
#: piece is hashed as it lands while the next ones are read, so only the last piece's hash
#: is left when the disk is done.
READ_PIECE = 512 * 1024
READ_WINDOW = 8


class _Concurrent:
    """How many verified reads are running in this process (thread-safe counter)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.n = 0

    def __enter__(self) -> int:
        with self._lock:
            self.n += 1
            return self.n

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.n -= 1

    def reset(self) -> None:
        """In a forked child: the parent's reads are not its own, nor perhaps its lock."""
        self._lock = threading.Lock()
        self.n = 0


_reading = _Concurrent()
os.register_at_fork(after_in_child=_reading.reset)


def read_piece_size(concurrent: int) -> int:
    """Piece size for one verified read while ``concurrent`` reads run (itself included).

    Alone, a page is read in READ_PIECE pieces, several in flight, each hashed as it lands,
    so hashing hides behind the disk. When other reads run too, they keep the disk busy
    and small pieces only add thread hops: pieces grow with the number of readers, up to
    the stripe unit (8 concurrent readers of 2 MiB pages: 0.35 -> 0.30 s for 512 MiB,
    docs/benchmarks.md, TTFT section).
    """
    return READ_PIECE * max(1, min(concurrent, 16))


def get(
    eng: Engine,
    k: PageKey,
    into: object | None,
    *,
    room: int | None = None,
    own: bool = False,
    most: int | None = None,
) -> bytes | int | memoryview:
    """:meth:`Engine.get` once the store is known open and the key parsed; with ``own``,
    :meth:`Engine.read_page`. With ``most``, a page larger than that is neither read nor
    restored: its size is returned."""
    with eng.lease(k) as (page, blob):
        # The destination is checked before anything is restored: a page only the archive
        # held was downloaded (and took local room) for a buffer then refused.
        dest = None if into is None else _destination(into, blob.size, k)
        if room is not None and blob.size > room:
            raise too_small(room, k.path, blob.size)
        if most is not None and blob.size > most:
            return blob.size
        restored = not blob.local
        if restored:
            got = eng._restore(blob, page)
            if isinstance(got, bytes):  # no local room: served from memory
                eng.note_read(page, len(got), restored=True)
                return _from_memory(got, dest)
            blob = got
        if dest is None:
            buf = aligned_buffer(blob.size)
            served: memoryview | None = _or_healed(
                eng,
                page,
                blob,
                lambda b: _read_verified(eng, page, b, buf, 0, b.size),
                lambda data: data,
            )
            eng.note_read(page, blob.size, restored=restored)
            if served is not None:  # from the archive's copy: the disk failed
                return served if own else served.tobytes()
            return buf if own else bytes(buf)
        into_dest = dest  # (narrowed for the lambdas)
        _or_healed(
            eng,
            page,
            blob,
            lambda b: _read_verified(eng, page, b, into_dest, 0, b.size),
            lambda data: _fill(into_dest, data),
        )
        eng.note_read(page, blob.size, restored=restored)
        return blob.size


def _fill(dest: memoryview, data: memoryview) -> None:
    dest[: len(data)] = data


def _destination(into: object, size: int, k: PageKey) -> memoryview:
    """A writable flat view of ``into``, refused (TypeError, ValueError) unless it holds
    ``size`` bytes."""
    dest = as_bytes_view(into, "the buffer to read into", writable=True)
    if len(dest) < size:
        raise too_small(len(dest), k.path, size)
    return dest


def too_small(room: int, path: str, size: int) -> ValueError:
    """The error of a get into a buffer of ``room`` bytes, short of the page's ``size``."""
    return ValueError(f"buffer of {room} bytes is smaller than page {path!r} ({size} bytes)")


def _check_range(offset: int, size: int) -> tuple[int, int]:
    """``offset`` and ``size`` as Python ints (numpy's too: an int64 offset and a uint64
    size added up to a float, which no slice takes, and uint64s wrapped around in the
    leaf arithmetic). Raises TypeError (not an int), ValueError (negative)."""
    for what, n in (("offset", offset), ("size", size)):
        # (a "0" or a None got as far as a comparison: '<' not supported between ...)
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"a range's {what} is an int, not {n!r}")
    offset, size = operator.index(offset), operator.index(size)
    if offset < 0 or size < 0:
        raise ValueError(
            f"a range needs offset >= 0 and size >= 0, not offset={offset}, size={size}"
        )
    return offset, size


def read_range(eng: Engine, k: PageKey, offset: int, size: int) -> bytes:
    """:meth:`Engine.read_range` once the store is known open and the key parsed."""
    offset, size = _check_range(offset, size)
    with eng.lease(k) as (page, blob):
        if offset >= blob.size or size <= 0:
            return b""
        restored = not blob.local
        if restored:
            got = eng._restore(blob, page)
            if isinstance(got, bytes):  # no local room: served from memory
                eng.note_read(page, max(0, min(size, len(got) - offset)), restored=True)
                return got[offset : offset + size]
            blob = got
        end = min(blob.size, offset + size)
        lo = offset - offset % LEAF
        hi = min(blob.size, -(-end // LEAF) * LEAF)
        buf = aligned_buffer(hi - lo)
        _or_healed(
            eng,
            page,
            blob,
            lambda b: _read_verified(eng, page, b, buf, lo, hi - lo),
            lambda data: _fill(buf, data[lo:hi]),
        )
        eng.note_read(page, hi - lo, restored=restored)
        return bytes(buf[offset - lo : end - lo])


def read_held(
    eng: Engine, page: PageRow, blob: BlobRow, offset: int, size: int, *, buffered: bool
) -> memoryview:
    """:meth:`Engine.read_held` once the store is known open."""
    offset, size = _check_range(offset, size)
    if offset >= blob.size or size <= 0:
        return memoryview(b"")
    restored = not blob.local
    if restored:
        got = eng._restore(blob, page)
        if isinstance(got, bytes):  # no local room: served from memory
            eng.note_read(page, max(0, min(size, len(got) - offset)), restored=True)
            return memoryview(got)[offset : offset + size]
        blob = got
    end = min(blob.size, offset + size)
    lo = offset - offset % LEAF
    hi = min(blob.size, -(-end // LEAF) * LEAF)
    data = _or_healed(
        eng,
        page,
        blob,
        lambda b: _read_here(eng, page, b, lo, hi - lo, buffered),
        lambda whole: whole[lo:hi],
    )
    eng.note_read(page, hi - lo, restored=restored)
    return data[offset - lo : end - lo]


def _from_memory(data: bytes, dest: memoryview | None) -> bytes | int:
    """:func:`get`'s answer from a verified copy held in memory (``dest``: checked already)."""
    if dest is None:
        return data
    dest[: len(data)] = data
    return len(data)


def _or_healed(
    eng: Engine,
    page: PageRow,
    blob: BlobRow,
    read: Callable[[BlobRow], T],
    served: Callable[[memoryview], T],
) -> T:
    """``read(blob)``; when the local copy fails its checksum (or a file is missing) and the
    archive holds the blob, the copy is replaced from the archive and read again (counted in
    ``corrupt_reads`` all the same). When its disk fails (EIO...), ``served(the page's
    bytes)`` from the archive's copy, held in memory (the local copy stays: the disk may
    come back). Raises CorruptPage when there is no good copy, the disk's OSError when
    there is no other."""
    try:
        try:
            return read(blob)
        except CorruptPage as e:
            return read(eng.heal(blob, e))
    except OSError as e:
        return served(memoryview(eng.read_around(blob, page, e)))


def _read_here(
    eng: Engine, page: PageRow, blob: BlobRow, off: int, n: int, buffered: bool
) -> memoryview:
    """Page bytes [off, off+n) (leaf-aligned start) read on this thread into one buffer,
    every leaf verified before anything is returned: with O_DIRECT into :func:`heap_view`
    memory, or with plain preads through the data files' page cache when ``buffered``.
    Raises CorruptPage."""
    assert blob.extents is not None and off % LEAF == 0
    mv = memoryview(bytearray(n)) if buffered else heap_view(n)
    try:
        for p in eng.tier.pieces(blob.extents, off, n):
            eng.tier.read_piece(p, mv, direct=not buffered)
    except OSError as e:
        if (corrupt := _as_corrupt(eng, page, e)) is None:
            raise
        raise corrupt from e
    digests = (leaf_hash(mv[j * LEAF : (j + 1) * LEAF]) for j in range(-(-n // LEAF)))
    _check_leaves(eng, page, blob, off // LEAF, digests)
    return mv


def _read_verified(
    eng: Engine, page: PageRow, blob: BlobRow, dest: memoryview, off: int, n: int
) -> None:
    """Read page bytes [off, off+n) (leaf-aligned start) into dest and verify each leaf.

    Reads run on the I/O pool; each group of leaves is hashed as soon as its bytes are in,
    so hashing overlaps the disk. A mismatch raises CorruptPage and the caller gets nothing.
    """
    assert blob.extents is not None and off % LEAF == 0
    with _reading as concurrent:
        _read_pieces(eng, page, blob, dest, off, n, read_piece_size(concurrent))


def _read_pieces(
    eng: Engine, page: PageRow, blob: BlobRow, dest: memoryview, off: int, n: int, piece: int
) -> None:
    assert blob.extents is not None
    tier = eng.tier
    pieces = list(tier.pieces(blob.extents, off, n, max_piece=piece))
    held = sum(p.n for p in pieces)
    if held < n:  # (a damaged blob row: its tail was served as zeros, its leaf unchecked)
        raise eng.corrupt_read(
            f"page {page.path!r} is corrupt: its extents hold {held} of its bytes "
            f"{off}-{off + n} (kvfs fsck --repair mends the row)"
        )
    # A bounded window of reads in flight: pieces then land one after another, and each
    # is hashed while the next ones are read, instead of all landing at the end together.
    window = max(READ_WINDOW, 2 * tier.n)
    futs: dict[int, Future[None]] = {}
    got: builtins.list[bytes] = []
    hasher = leaf_hasher()
    nxt = 0
    opened: dict[tuple[int, str], tuple[int, bool]] = {}
    try:
        try:
            opened = tier.open_files(pieces)
            for j, p in enumerate(pieces):
                if len(pieces) == 1:  # one piece: read it here, no hop to the pool
                    tier.read_piece(p, dest, None, opened)
                    nxt = 1
                while nxt < len(pieces) and nxt < j + window:
                    futs[nxt] = eng.io_pool.submit(tier.read_piece, pieces[nxt], dest, None, opened)
                    nxt += 1
                if j in futs:
                    # (left in futs until it is over: an interrupt of this wait leaves
                    # it to the wait below)
                    futs[j].result()
                    del futs[j]
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
                wait_all(list(futs.values()))
            finally:
                tier.close_files(opened)
    except OSError as e:
        if (corrupt := _as_corrupt(eng, page, e)) is None:
            raise
        raise corrupt from e
    _check_leaves(eng, page, blob, off // LEAF, got)


def _as_corrupt(eng: Engine, page: PageRow, e: OSError) -> CorruptPage | None:
    """A failed data-file read: a missing or short data file is a CorruptPage (counted);
    None for any other OSError (EIO, EMFILE...), which the caller re-raises as it is."""
    if isinstance(e, FileNotFoundError):
        return eng.corrupt_read(f"page {page.path!r}: a data file is missing ({e.filename})")
    if isinstance(e, KvfsError):
        return eng.corrupt_read(f"page {page.path!r}: {e}")
    return None


def _check_leaves(
    eng: Engine, page: PageRow, blob: BlobRow, first: int, digests: Iterable[bytes]
) -> None:
    """Compare leaf digests (from leaf ``first`` on) with the stored ones; on a mismatch
    raise CorruptPage (counted). The caller counts the verified read (it knows whether the
    read restored its data first: a miss, not a hit)."""
    for j, digest in enumerate(digests):
        bad = first + j
        if digest != blob.leaves[bad * DIGEST : (bad + 1) * DIGEST]:
            raise eng.corrupt_read(
                f"page {page.path!r} is corrupt: bytes {bad * LEAF}-"
                f"{min(blob.size, (bad + 1) * LEAF)} do not match the checksum"
            )


# -- metadata -----------------------------------------------------------------------------
def pin_now(eng: Engine, target: str, kind: str, pinned: bool) -> tuple[bool, float | None]:
    """Whether page (``kind`` "page") or session directory ("session") ``target``, whose
    row says ``pinned``, is pinned now, and when that pin ends (None: for good). A pin
    whose end has passed reads as none before the release pass has run: ``ls`` showed it
    pinned, with ``0s left``, until then."""
    if not pinned:
        return False, None
    until = eng.index.pin_until(target, kind)
    if until is not None and until <= time.time():
        return False, None
    return True, until


def session_pinned(eng: Engine, d: str) -> bool:
    """Whether session directory ``d`` is pinned now (see :func:`pin_now`)."""
    s = eng.index.session(d)
    return s is not None and pin_now(eng, d, "session", s.pinned)[0]


def page_info(eng: Engine, p: PageRow, b: BlobRow) -> PageInfo:
    tier = "+".join(t for t, on in (("local", b.local), ("archive", b.archived)) if on)
    ext = tuple(Extent(e[0], eng.tier.abspath(e[0], e[1]), e[2], e[3]) for e in (b.extents or ()))
    pinned, until = pin_now(eng, p.path, "page", p.pinned)
    return PageInfo(
        path=p.path,
        session=PageKey(p.path).session,
        size=p.size,
        checksum=b.hash.hex(),
        created=p.created,
        atime=p.atime,
        pinned=pinned,
        tier=tier or "none",
        attrs=p.attrs,
        extents=ext,
        pin_until=until,
    )


def stat(eng: Engine, k: PageKey) -> PageInfo:
    found = eng.index.page_and_blob(k.path)
    if found is None:
        raise PageNotFound(f"no page {k.path!r}")
    return page_info(eng, *found)


def list_pages(
    eng: Engine, session: str | None, prefix: str | None, path_prefix: str | None
) -> builtins.list[PageInfo]:
    if prefix is not None and session is None:
        raise InvalidKey("prefix needs a session")
    # (a prefix that is no name listed nothing, and a path prefix that is not UTF-8 raised
    # SQLite's UnicodeEncodeError)
    check_list_filter(session, prefix, path_prefix)
    sd = eng.resolve_session(session) if session is not None else None
    pp = path_prefix
    if prefix is not None:
        pp = f"{sd}/{prefix}/"
    return [page_info(eng, p, b) for p, b in eng.index.pages_and_blobs(session=sd, path_prefix=pp)]


def session_info(eng: Engine, d: str) -> SessionInfo:
    s = eng.index.session(d)
    if s is None:
        raise SessionNotFound(f"no session {session_name(d)!r}")
    u = eng.index.session_usage(d)
    name = session_name(d)
    pinned, until = pin_now(eng, d, "session", s.pinned)
    return SessionInfo(
        session=name,
        dir=d,
        created=s.created,
        atime=s.atime,
        pinned=pinned,
        attrs=s.attrs,
        pages=u["pages"],
        bytes=u["bytes"],
        local_bytes=u["local_bytes"],
        archived_bytes=u["archived_bytes"],
        pin_until=until,
    )
