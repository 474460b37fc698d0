"""The page index: SQLite in WAL mode, the single source of truth for what exists.

A page is visible exactly when its row is committed here. Data files are written and made
durable first; the commit that inserts the page row is the one atomic step that publishes
it. Everything on disk that no committed row points at is an orphan and is swept at the next
start after an unclean shutdown.

Tables:
  blobs     one row per distinct content (checksum): size, leaf hashes, reference count,
            local extents (NULL when the data is not held locally), archive state.
  pages     one row per key: path, session directory, blob checksum, times, pinned, attrs.
  sessions  one row per session directory: times, pinned, attrs (model id...).
  pin_expiry  when a pin with a lifetime ends, per pinned page or session (a pin without
            one has no row); the pin is then released as an unpin releases it.
  meta      store identity and layout.

Writes go through one connection under one lock (transactions, group commit). Reads outside
a transaction use a read-only connection per thread, so a lookup never waits for a commit's
fsync (WAL readers see the last committed state while a writer commits): a foreground read
during a spill or a put's existence check beside another client's commit costs a lookup,
not a flush. A thread inside a transaction reads through the write connection and sees its
own changes. Writes are made from worker threads, never a trio loop; the mount's loop makes
single indexed reads itself (a lookup costs less than the hop to a thread, docs/mount.md).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ._aligned import aligned_buffer, open_direct
from ._errors import (
    CapacityExceeded,
    CorruptPage,
    IndexUnavailable,
    KvfsError,
    PageExists,
    out_of_files,
)

log = logging.getLogger("kvfs.index")

__all__ = ["BlobRow", "Index", "PageCommit", "PageRow", "SessionRow", "disk_failure", "unavailable"]

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BLOB);
CREATE TABLE IF NOT EXISTS blobs (
    hash BLOB PRIMARY KEY,
    size INTEGER NOT NULL,
    leaves BLOB NOT NULL,
    refs INTEGER NOT NULL,
    extents BLOB,
    disk_bytes INTEGER NOT NULL DEFAULT 0,
    archived INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    atime REAL NOT NULL
);
DROP INDEX IF EXISTS blobs_lru;
CREATE INDEX IF NOT EXISTS blobs_evict ON blobs(atime, created DESC) WHERE extents IS NOT NULL;
CREATE TABLE IF NOT EXISTS pages (
    path TEXT PRIMARY KEY,
    session TEXT NOT NULL,
    hash BLOB NOT NULL,
    size INTEGER NOT NULL,
    created REAL NOT NULL,
    atime REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    attrs BLOB
);
CREATE INDEX IF NOT EXISTS pages_session ON pages(session, path);
CREATE INDEX IF NOT EXISTS pages_hash ON pages(hash);
CREATE TABLE IF NOT EXISTS sessions (
    dir TEXT PRIMARY KEY,
    created REAL NOT NULL,
    atime REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    attrs BLOB
);
CREATE TABLE IF NOT EXISTS pin_expiry (
    target TEXT NOT NULL,
    kind TEXT NOT NULL,
    until REAL NOT NULL,
    PRIMARY KEY (target, kind)
);
CREATE INDEX IF NOT EXISTS pin_expiry_until ON pin_expiry(until);
"""

Extent = tuple[int, str, int, int]  # (device index, file relative to device root, offset, length)

#: blob rows a pass over all of them reads at once (see Index._scan_blobs)
SCAN_ROWS = 512


def _disk_full(e: BaseException) -> bool:
    """SQLITE_FULL: the database or its WAL could not grow."""
    return isinstance(e, sqlite3.OperationalError) and (
        getattr(e, "sqlite_errorcode", None) == getattr(sqlite3, "SQLITE_FULL", 13)
        or "disk is full" in str(e)
    )


# SQLite's primary result codes (the low byte of an error's ``sqlite_errorcode``, which the
# sqlite3 module gives from Python 3.11; on 3.10 the message is all there is)
_IOERR, _CORRUPT, _CANTOPEN, _NOTADB = 10, 11, 14, 26
_CODE_WORDS = (
    ("disk I/O error", _IOERR),
    ("malformed", _CORRUPT),
    ("unable to open", _CANTOPEN),
    ("not a database", _NOTADB),
)
#: what a disk that fails answers (kvfs._local.DISK_ERRORS, less EROFS: the probe reads)
_DISK_ERRORS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV})


def _sqlite_code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF
    return next((c for words, c in _CODE_WORDS if words in str(e)), None)


def _probe(path: Path) -> OSError | None:
    """The error the disk gives for the first block of the database ``path`` and of its
    WAL, read past the page cache (O_DIRECT where the filesystem has it: a cached block
    reads fine from a disk that no longer answers); None when both read."""
    for p in (path, Path(f"{path}-wal")):
        try:
            fd, _direct = open_direct(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        except OSError as e:
            return e
        try:
            os.preadv(fd, [aligned_buffer(4096)], 0)
        except OSError as e:
            return e
        finally:
            os.close(fd)
    return None


def disk_failure(path: Path, e: BaseException) -> str | None:
    """What the disk said (its error's text), when ``e``, an error of SQLite's on the
    database file ``path``, is its disk's; None for any other. SQLite says "disk I/O error"
    for a write the disk failed, but "database disk image is malformed" (as for a corrupt
    file) for a read it failed, and "unable to open" for a file it could not open: those
    are told apart from a damaged file by reading the file's first block from the disk."""
    if not isinstance(e, sqlite3.DatabaseError) or isinstance(
        e, (sqlite3.ProgrammingError, sqlite3.IntegrityError)
    ):
        return None
    code = _sqlite_code(e)
    if code not in (_IOERR, _CORRUPT, _CANTOPEN, _NOTADB):
        return None
    probed = _probe(path)
    if probed is not None and probed.errno in _DISK_ERRORS:
        return str(probed.strerror)
    if code != _IOERR:
        return None  # the file reads: SQLite's word for it stands
    # SQLite's I/O error growing its shared memory on a disk with next to nothing free is
    # a full disk, not a failing one (it keeps the errno to itself: see the engine's
    # _open_error, which tells a full disk so at open)
    with contextlib.suppress(OSError):
        st = os.statvfs(path.parent)
        if st.f_bavail * st.f_frsize < (1 << 20):
            return None
    return str(e)


def unavailable(
    path: Path, e: BaseException, *, at_commit: bool = False
) -> IndexUnavailable | None:
    """IndexUnavailable for ``e`` when :func:`disk_failure` finds it is the disk's; None
    for any other error (``e`` is then raised as it is). ``at_commit``: ``e`` was raised
    by the COMMIT itself."""
    said = disk_failure(path, e)
    return None if said is None else _unavailable(path, said, at_commit)


def _out_of_files(path: Path, e: BaseException) -> OSError | None:
    """OSError EMFILE (or ENFILE) for SQLite's "unable to open" (or I/O error) when the
    process has no file descriptor left to open the database ``path`` with; None for any
    other error. SQLite keeps the errno to itself: a thread's first read opens a connection
    of its own (three files), and at the limit its bare sqlite3.OperationalError escaped
    the store's calls and ended as an unexpected error, a traceback per request, on the
    mount. The index is not failing: nothing is marked, and the same call works once
    files close."""
    if not isinstance(e, sqlite3.OperationalError) or _sqlite_code(e) not in (_CANTOPEN, _IOERR):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as probe:
        if not out_of_files(probe):
            return None
        return OSError(
            probe.errno,
            f"the index {path} cannot be read: {probe.strerror} (too many files open in "
            "the process, its RLIMIT_NOFILE, or in the system); nothing was changed",
        )
    os.close(fd)
    return None


def _unavailable(path: Path, said: str, at_commit: bool) -> IndexUnavailable:
    err = IndexUnavailable(
        f"the index {path} cannot be used: its disk answered an I/O error ({said}; is it "
        f"failing?). {'Its commit was rolled back: n' if at_commit else 'N'}othing was "
        "changed by this call; the pages stored before are kept, and are served again once "
        "the disk is back and the store reopened"
    )
    err.at_commit = at_commit
    return err


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(b: bytes | None, default: Any = None) -> Any:
    return default if b is None else msgpack.unpackb(b, raw=False, use_list=False)


def _page_above(
    db: sqlite3.Connection, path: str, *, itself: bool = False, moving: str = ""
) -> str | None:
    """The page that is a directory above ``path`` (or ``path`` itself, with ``itself``),
    ``moving`` (a page being renamed) aside; None when there is none."""
    parts = path.split("/")
    for i in range(1, len(parts) + int(itself)):
        above = "/".join(parts[:i])
        if above != moving and db.execute("SELECT 1 FROM pages WHERE path=?", (above,)).fetchone():
            return above
    return None


def _check_no_clash(db: sqlite3.Connection, path: str, moving: str = "") -> None:
    """A page's path is a file on the mount: no page may be named like a directory above it,
    or have pages below it (the mount showed one and hid the other: ``kvfs put f dir`` made
    dir/page unreachable, a page under a page was invisible). Raises PageExists."""
    above = _page_above(db, path, moving=moving)
    if above is not None:
        raise PageExists(f"{path!r}: {above!r} is a page, so it cannot be a directory too")
    below = db.execute(
        "SELECT path FROM pages WHERE path > ? AND path < ? AND path != ? LIMIT 1",
        (path + "/", path + "0", moving),  # ("0" sorts right after "/")
    ).fetchone()
    if below is not None:
        raise PageExists(
            f"{path!r} is a directory of pages ({below[0]!r}...), so it cannot be a page too"
        )


def meta_value(b: bytes | None) -> Any:
    """A ``meta`` row's value as :meth:`Index.get_meta` returns it (for a read-only look)."""
    return _unpack(b)


@dataclass(frozen=True, slots=True)
class BlobRow:
    hash: bytes
    size: int
    leaves: bytes
    refs: int
    extents: tuple[Extent, ...] | None
    disk_bytes: int
    archived: bool
    created: float
    atime: float

    @property
    def local(self) -> bool:
        return self.extents is not None


@dataclass(frozen=True, slots=True)
class PageRow:
    path: str
    session: str
    hash: bytes
    size: int
    created: float
    atime: float
    pinned: bool
    attrs: dict[str, str]


@dataclass(frozen=True, slots=True)
class SessionRow:
    dir: str
    created: float
    atime: float
    pinned: bool
    attrs: dict[str, str]


_BLOB_COLS = "hash, size, leaves, refs, extents, disk_bytes, archived, created, atime"
_PAGE_COLS = "path, session, hash, size, created, atime, pinned, attrs"


#: the columns qualified, for statements over ``pages p`` and ``blobs b``
_P_COLS = ", ".join(f"p.{c.strip()}" for c in _PAGE_COLS.split(","))
_B_COLS = ", ".join(f"b.{c.strip()}" for c in _BLOB_COLS.split(","))
_PAGE_AND_BLOB = f"SELECT {_P_COLS}, {_B_COLS} FROM pages p LEFT JOIN blobs b ON b.hash = p.hash"
#: a page ``p`` that is pinned, or whose session is, and that matches ``{}``
_PINNED_PAGE = (
    "SELECT 1 FROM pages p LEFT JOIN sessions s ON s.dir=p.session"
    " WHERE {} AND (p.pinned=1 OR s.pinned=1)"
)
#: blob ``b`` is held by no pinned page and no page of a pinned session
_UNPINNED_B = f"NOT EXISTS ({_PINNED_PAGE.format('p.hash=b.hash')})"


def _pinned(db: sqlite3.Connection, column: str, value: object) -> bool:
    """Whether a page whose ``column`` (path, hash) is ``value`` is pinned by now, or its
    session is (read in the transaction that acts on it: a pin that landed after the page
    was chosen keeps it)."""
    sql = _PINNED_PAGE.format(f"p.{column}=?") + " LIMIT 1"
    return db.execute(sql, (value,)).fetchone() is not None


def _after_prefix(prefix: str) -> str | None:
    """The least string after every string that starts with ``prefix`` in the index's
    order (BINARY: UTF-8's bytes, which sort as the code points do); None when none is."""
    s = prefix.rstrip("\U0010ffff")
    if not s:
        return None
    nxt = ord(s[-1]) + 1
    return s[:-1] + chr(0xE000 if nxt == 0xD800 else nxt)  # (surrogates are no text)


def _where_pages(
    select: str, session: str | None, path_prefix: str | None, limit: int | None
) -> tuple[str, list[object]]:
    """``select`` (over ``pages p``) narrowed to a session and/or a path prefix, by path."""
    sql, where = select, []
    args: list[object] = []
    if session is not None:
        where.append("p.session=?")
        args.append(session)
    if path_prefix:
        # Range scan on the primary key: everything that starts with path_prefix. (Its end
        # was path_prefix + U+10FFFF, before which "d/\U0010ffffx" does not sort: a page
        # named so was left out of its directory's listing on the mount and in the API.)
        end = _after_prefix(path_prefix)
        where.append("p.path >= ?" if end is None else "p.path >= ? AND p.path < ?")
        args += [path_prefix] if end is None else [path_prefix, end]
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY p.path"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return sql, args


def _blob(r: tuple) -> BlobRow:
    ext = _unpack(r[4])
    return BlobRow(
        r[0],
        r[1],
        r[2],
        r[3],
        tuple(tuple(e) for e in ext) if ext is not None else None,  # type: ignore[union-attr]
        r[5],
        bool(r[6]),
        r[7],
        r[8],
    )


def _page(r: tuple) -> PageRow:
    return PageRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), dict(_unpack(r[7], {})))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PageCommit:
    """One page for :meth:`Index.commit_page` to publish: its row, and its blob's when the
    content is new. ``extents`` None: share the blob of checksum ``h`` already held locally."""

    path: str
    session: str
    h: bytes
    size: int
    leaves: bytes
    extents: Iterable[Extent] | None
    disk_bytes: int
    attrs: dict[str, str]
    pinned: bool
    replace: bool
    session_attrs: dict[str, str]
    #: the extents of a damaged local copy of ``h`` that these files replace (in the same
    #: transaction: a crash between a drop and the commit left the page's data nowhere)
    stale: tuple | None = None
    #: the access time the blob gets (``Engine.clock``'s, for eviction's order); None: the
    #: commit's time
    atime: float | None = None


class _Pending:
    """One queued :meth:`Index.commit_page` call."""

    __slots__ = ("commit", "done", "error", "now", "result")

    def __init__(self, commit: PageCommit, now: float) -> None:
        self.commit = commit
        self.now = now
        self.done = threading.Event()
        self.result: tuple[bool, BlobRow | None, PageRow | None, BlobRow | None] | None = None
        self.error: Exception | None = None


class _Reader:
    """A thread's read connection; closed when the thread ends (its thread-local goes)."""

    __slots__ = ("__weakref__", "db")

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __del__(self) -> None:
        self.db.close()


class Index:
    """Thread-safe wrapper around one SQLite connection. See the module docstring."""

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._gc_lock = threading.Lock()  # the group-commit queue (see commit_page)
        self._gc_queue: list[_Pending] = []
        self._gc_leading = False
        #: per session: how many times pages left it (delete, rename away or over), bumped
        #: inside the transaction that does it (the archive's import compares it)
        self.removals: collections.Counter[str] = collections.Counter()
        #: called inside every transaction that changes what a session's archive manifest
        #: says (pages removed by a delete, replace, rename or import; pins; session
        #: attributes) with those sessions and the blobs whose last reference went: the
        #: archive's follow-up work is queued in that transaction, so a crash right after
        #: it cannot forget it (a restore then brought deleted pages back)
        self.on_changed: Callable[[sqlite3.Connection, set[str], list[BlobRow]], None] | None
        self.on_changed = None
        #: (device, file) of local copies a transaction took out of the index whose files
        #: the engine has not yet removed, nor deferred for a lease (Engine._drop_files):
        #: fsck must not take them for orphans meanwhile (a repair removed them from under
        #: a reader). Added inside the transaction, so never absent from both.
        self._dropping: set[tuple[int, str]] = set()
        self._dropping_lock = threading.Lock()
        #: what the disk said when an IndexUnavailable was last raised: it failed under this store,
        #: whose close then leaves the index unclean (the next open recounts and sweeps)
        self.failed: str | None = None
        self._db = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=30
        )
        try:
            self._set_up(path, durable)
        except BaseException:
            # (a failed open, a full disk say, leaves no connection for the GC to find:
            # Python 3.13 warns of one, and the suite makes warnings errors)
            self._db.close()
            raise

    def _set_up(self, path: Path, durable: bool) -> None:
        self._check_schema(path)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk when put() returns. NORMAL keeps consistency, not the
        # last commits, across power loss; only for page-cache benchmarks.
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._durable = durable
        self._db.execute("PRAGMA foreign_keys=OFF")
        self._local = threading.local()  # this thread's read connection
        self._readers: weakref.WeakSet[_Reader] = weakref.WeakSet()
        self._readers_lock = threading.Lock()
        self._closed = False
        with self.transaction() as db:
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if db.execute("SELECT 1 FROM meta WHERE k='schema'").fetchone() is None:
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (_pack(SCHEMA_VERSION),))

    def _check_schema(self, path: Path) -> None:
        """Raise KvfsError for an index of another schema version (a newer kvfs made it),
        before anything is done to it: the statements that make this version's tables and
        indexes ran first, and failed on a newer one's tables as SQLite's bare "no such
        column" (or changed them), and the error was a RuntimeError, no KvfsError."""
        has_meta = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
        ).fetchone()
        v = has_meta and self._db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        if not v:
            return  # a new index (or one this version makes its schema in)
        try:
            found = _unpack(v[0])
        except (ValueError, msgpack.UnpackException):
            found = repr(v[0])
        if found == SCHEMA_VERSION:
            return
        newer = isinstance(found, int) and found > SCHEMA_VERSION
        raise KvfsError(
            f"the index {path} has schema version {found}, and this kvfs reads version "
            f"{SCHEMA_VERSION} only"
            + (": a newer kvfs made it; open it with that one" if newer else "")
            + ". Nothing was changed in it"
        )

    def close(self) -> None:
        """Checkpoint the WAL into the database and close every connection. Never raises
        for the disk (full, failing): the connections are closed all the same, and what
        was not done is logged (the WAL stays beside the database, and the next open
        checkpoints it)."""
        with self._lock, self._readers_lock:
            self._closed = True
            for r in list(self._readers):  # a reader's snapshot would stop the checkpoint
                with contextlib.suppress(sqlite3.Error):
                    r.db.close()
            self._readers.clear()
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as e:
                if _disk_full(e):
                    log.warning("index %s: no checkpoint at close, its disk is full", self.path)
                else:
                    said = disk_failure(self.path, e)
                    log.error(
                        "index %s: no checkpoint at close (%s); the next open checkpoints it",
                        self.path,
                        e if said is None else f"its disk answered an I/O error: {said}",
                    )
            finally:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()

    def _unavailable(self, e: BaseException, *, at_commit: bool = False) -> BaseException:
        """What to raise for ``e``: :func:`unavailable`'s IndexUnavailable (noted in
        ``failed``), or ``e`` itself."""
        said = disk_failure(self.path, e)
        if said is None:
            return _out_of_files(self.path, e) or e
        self.failed = f"its disk answered an I/O error ({said})"
        bad = _unavailable(self.path, said, at_commit)
        bad.__cause__ = e
        return bad

    @contextmanager
    def _disk(self) -> Iterator[None]:
        """SQLite's errors that the index's disk caused raised as IndexUnavailable."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            raise self._unavailable(e) from e

    def _reader(self) -> sqlite3.Connection:
        r: _Reader | None = getattr(self._local, "reader", None)
        if r is None:
            with self._readers_lock:  # not self._lock: a transaction may hold that
                if self._closed:
                    raise sqlite3.ProgrammingError("the index is closed")
                db = sqlite3.connect(
                    f"file:{self.path}?mode=ro",
                    uri=True,
                    check_same_thread=False,
                    isolation_level=None,
                    timeout=30,
                )
                try:
                    db.execute("PRAGMA query_only=1")
                except BaseException:
                    db.close()
                    raise
                r = _Reader(db)
                self._readers.add(r)
            self._local.reader = r
        return r.db

    @contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A connection whose reads all see one committed state (or, inside a transaction
        of this thread, that transaction's state)."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            yield self._db
            return
        with self._disk():
            r = self._reader()
            r.execute("BEGIN")
            try:
                yield r
            except BaseException:
                # (the body's error is the one to raise: an end that fails too, on a disk
                # that failed the body, would hide it)
                with contextlib.suppress(sqlite3.Error):
                    r.execute("COMMIT")
                raise
            r.execute("COMMIT")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT under the lock; ROLLBACK on any exception (a failed
        COMMIT included). A disk too full for the WAL to grow raises CapacityExceeded, with
        nothing changed; a disk that answers an I/O error, IndexUnavailable (see
        :func:`unavailable`)."""
        with self._lock:
            committing = False
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.DatabaseError as e:
                raise self._unavailable(e) from e
            try:
                yield self._db
                committing = True
                self._db.execute("COMMIT")
            except BaseException as e:
                if self._db.in_transaction:  # SQLite may have rolled back already
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                if _disk_full(e):
                    raise CapacityExceeded(
                        f"the index {self.path} cannot grow: its disk is full; nothing was "
                        "changed (free space on that disk, or lower the capacity)"
                    ) from e
                bad = self._unavailable(e, at_commit=committing)
                if bad is not e:
                    raise bad from e
                raise

    def _q(self, sql: str, args: Iterable[object] = ()) -> list[tuple]:
        with self._disk():
            if self._lock._is_owned():  # type: ignore[attr-defined]
                return self._db.execute(sql, tuple(args)).fetchall()
            return self._reader().execute(sql, tuple(args)).fetchall()

    # -- meta ---------------------------------------------------------------------------
    def get_meta(self, k: str, default: object = None) -> object:
        r = self._q("SELECT v FROM meta WHERE k=?", (k,))
        return _unpack(r[0][0]) if r else default

    def set_meta(self, k: str, v: object, *, durable: bool = False) -> None:
        """Set ``k``. ``durable``: committed to disk when this returns even in an index
        whose commits are not (``durable=False``); a new index file's name needs its
        directory synced too (the caller's: kvfs._local.fsync_dir)."""
        with self._lock:
            if durable and not self._durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                with self.transaction() as db:
                    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, _pack(v)))
            finally:
                if durable and not self._durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    # -- reads --------------------------------------------------------------------------
    def page(self, path: str) -> PageRow | None:
        r = self._q(f"SELECT {_PAGE_COLS} FROM pages WHERE path=?", (path,))
        return _page(r[0]) if r else None

    def blob(self, h: bytes) -> BlobRow | None:
        r = self._q(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,))
        return _blob(r[0]) if r else None

    def page_and_blob(self, path: str) -> tuple[PageRow, BlobRow] | None:
        # One statement reads one committed state: no read transaction needed around it.
        r = self._q(f"{_PAGE_AND_BLOB} WHERE p.path=?", (path,))
        if not r:
            return None
        n = len(_PAGE_COLS.split(","))
        if r[0][n] is None:  # same snapshot: a page row has its blob row, unless damaged
            raise CorruptPage(
                f"index inconsistent: page {path} names data {bytes(r[0][2]).hex()[:16]} that "
                "no blob row holds (kvfs fsck --repair mends it)"
            )
        return _page(r[0][:n]), _blob(r[0][n:])

    def pages(
        self,
        *,
        session: str | None = None,
        path_prefix: str | None = None,
        limit: int | None = None,
    ) -> list[PageRow]:
        sql, args = _where_pages(f"SELECT {_P_COLS} FROM pages p", session, path_prefix, limit)
        return [_page(r) for r in self._q(sql, args)]

    def pages_and_blobs(
        self, *, session: str | None = None, path_prefix: str | None = None
    ) -> list[tuple[PageRow, BlobRow]]:
        """The pages :meth:`pages` lists, each with its blob row, in one statement (one
        committed state, no query per page); a page whose blob row is missing (a damaged
        index: fsck's ``missing_blob_rows``) is left out."""
        sql, args = _where_pages(
            f"SELECT {_P_COLS}, {_B_COLS} FROM pages p JOIN blobs b ON b.hash = p.hash",
            session,
            path_prefix,
            None,
        )
        n = len(_PAGE_COLS.split(","))
        return [(_page(r[:n]), _blob(r[n:])) for r in self._q(sql, args)]

    def sessions_with_archived_pages(self) -> list[str]:
        return [
            r[0]
            for r in self._q(
                "SELECT DISTINCT p.session FROM pages p JOIN blobs b ON b.hash=p.hash"
                " WHERE b.archived ORDER BY p.session"
            )
        ]

    def archived_pages(self, session: str) -> list[tuple[PageRow, bytes, float | None]]:
        """The session's pages whose content is archived, each with its blob's leaf hashes
        and when its pin ends (None: pinned for good, or not pinned), by path: one
        statement (one consistent state; no query per page)."""
        rows = self._q(
            f"SELECT {_P_COLS}, b.leaves, e.until FROM pages p JOIN blobs b ON b.hash = p.hash"
            " LEFT JOIN pin_expiry e ON e.target = p.path AND e.kind = 'page'"
            " WHERE p.session=? AND b.archived ORDER BY p.path",
            (session,),
        )
        return [(_page(r[:-2]), r[-2], r[-1] if r[6] else None) for r in rows]

    def archived_hashes(self, session: str) -> set[bytes]:
        """The contents of the session's archived pages (no leaf hashes: a set test)."""
        return {
            bytes(r[0])
            for r in self._q(
                "SELECT DISTINCT p.hash FROM pages p JOIN blobs b ON b.hash = p.hash"
                " WHERE p.session=? AND b.archived",
                (session,),
            )
        }

    def pages_of_blob(self, h: bytes) -> list[PageRow]:
        return [_page(r) for r in self._q(f"SELECT {_PAGE_COLS} FROM pages WHERE hash=?", (h,))]

    def session(self, d: str) -> SessionRow | None:
        r = self._q("SELECT dir, created, atime, pinned, attrs FROM sessions WHERE dir=?", (d,))
        if not r:
            return None
        x = r[0]
        return SessionRow(x[0], x[1], x[2], bool(x[3]), dict(_unpack(x[4], {})))  # type: ignore[arg-type]

    def sessions(self) -> list[SessionRow]:
        rows = self._q("SELECT dir, created, atime, pinned, attrs FROM sessions ORDER BY dir")
        return [
            SessionRow(x[0], x[1], x[2], bool(x[3]), dict(_unpack(x[4], {})))  # type: ignore[arg-type]
            for x in rows
        ]

    def session_usage(self, d: str) -> dict[str, int]:
        """Pages and logical bytes of a session, split by where the data is."""
        r = self._q(
            "SELECT COUNT(*), COALESCE(SUM(p.size),0),"
            " COALESCE(SUM(CASE WHEN b.extents IS NOT NULL THEN p.size END),0),"
            " COALESCE(SUM(CASE WHEN b.archived THEN p.size END),0)"
            " FROM pages p JOIN blobs b ON b.hash=p.hash WHERE p.session=?",
            (d,),
        )[0]
        return {"pages": r[0], "bytes": r[1], "local_bytes": r[2], "archived_bytes": r[3]}

    def local_disk_bytes(self) -> int:
        return self._q("SELECT COALESCE(SUM(disk_bytes),0) FROM blobs WHERE extents IS NOT NULL")[
            0
        ][0]

    def has_archived(self) -> bool:
        """Whether any blob is marked as held by the archive."""
        return bool(self._q("SELECT 1 FROM blobs WHERE archived=1 LIMIT 1"))

    def has_archive_only(self) -> bool:
        """Whether any blob is held by the archive alone (no local copy)."""
        return bool(self._q("SELECT 1 FROM blobs WHERE archived=1 AND extents IS NULL LIMIT 1"))

    def archived_blobs(self) -> Iterator[BlobRow]:
        """Every blob marked as held by the archive, by checksum, read as
        :meth:`_scan_blobs` reads."""
        return map(_blob, self._scan_blobs(_BLOB_COLS, "archived=1"))

    def archived_blob_count(self) -> int:
        """How many blobs are marked as held by the archive."""
        return int(self._q("SELECT COUNT(*) FROM blobs WHERE archived=1")[0][0])

    def archived_sample(self, n: int) -> list[bytes]:
        """Up to ``n`` blobs marked as held by the archive, the most recently created first."""
        return [
            r[0]
            for r in self._q(
                "SELECT hash FROM blobs WHERE archived=1 ORDER BY created DESC LIMIT ?", (n,)
            )
        ]

    def counts(self) -> dict[str, int]:
        with self.snapshot() as db:
            pages, logical = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size),0) FROM pages"
            ).fetchone()
            blobs, stored = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size),0) FROM blobs WHERE extents IS NOT NULL"
            ).fetchone()
            sessions = db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        return {
            "pages": pages,
            "logical_bytes": logical,
            "local_blobs": blobs,
            "local_bytes": stored,
            "sessions": sessions,
        }

    def dropping(self, b: BlobRow | None) -> None:
        """``b``'s local files are leaving the index: see ``_dropping``."""
        if b is not None and b.extents is not None:
            with self._dropping_lock:
                self._dropping.update((e[0], e[1]) for e in b.extents)

    def dropped(self, b: BlobRow) -> None:
        """``b``'s files are removed, or deferred until its last lease ends."""
        if b.extents is not None:
            with self._dropping_lock:
                self._dropping.difference_update((e[0], e[1]) for e in b.extents)

    def dropping_files(self) -> set[tuple[int, str]]:
        with self._dropping_lock:
            return set(self._dropping)

    def _scan_blobs(self, cols: str, where: str) -> Iterator[tuple]:
        """``SELECT cols FROM blobs WHERE where``, by checksum, :data:`SCAN_ROWS` rows a
        read: what a pass over every blob row of the store (recovery, fsck) holds at once
        is one chunk, not every row (a store of millions of pages has millions of rows).
        Each chunk is a read of its own, so a caller that works between them (fsck reads
        every page) keeps no read transaction open meanwhile, which would keep the WAL
        from being checkpointed. Each row is read at most once; one committed during the
        pass is read if its checksum is beyond the chunks read so far."""
        after: object = -(1 << 63)  # (SQLite orders every number before any text or blob)
        while True:
            rows = self._q(
                f"SELECT {cols} FROM blobs WHERE hash > ? AND ({where})"
                f" ORDER BY hash LIMIT {SCAN_ROWS}",
                (after,),
            )
            yield from rows
            if len(rows) < SCAN_ROWS:
                return
            after = rows[-1][0]

    def local_extent_files(self) -> Iterator[tuple[int, str]]:
        """The (device, file) of each extent of every local blob (a file once per blob),
        read as :meth:`_scan_blobs` reads."""
        for _, ext in self._scan_blobs("hash, extents", "extents IS NOT NULL"):
            yield from dict.fromkeys((e[0], e[1]) for e in _unpack(ext))

    def local_blobs(self) -> Iterator[BlobRow]:
        """Every blob held locally, by checksum, read as :meth:`_scan_blobs` reads."""
        return map(_blob, self._scan_blobs(_BLOB_COLS, "extents IS NOT NULL"))

    def local_blob_count(self) -> int:
        """How many blobs are held locally."""
        return int(self._q("SELECT COUNT(*) FROM blobs WHERE extents IS NOT NULL")[0][0])

    def eviction_candidates(self, limit: int) -> list[BlobRow]:
        """Local blobs, least recently used first, that no pinned page or session holds;
        of those used at the same time (one burst, see ``AccessClock``) the newest first."""
        rows = self._q(
            f"SELECT {_BLOB_COLS} FROM blobs b WHERE b.extents IS NOT NULL AND {_UNPINNED_B}"
            " ORDER BY b.atime, b.created DESC LIMIT ?",
            (limit,),
        )
        return [_blob(r) for r in rows]

    def evictable(self, hashes: Iterable[bytes]) -> set[bytes]:
        """Of ``hashes``, the local blobs that no pinned page or session holds (what
        :meth:`eviction_candidates` would list of them): read by key, so an evict of one
        session reads its own blobs, not every local blob of the store."""
        hs = list(hashes)
        out: set[bytes] = set()
        for i in range(0, len(hs), 500):  # (SQLite's limit on bound parameters)
            chunk = hs[i : i + 500]
            out.update(
                bytes(r[0])
                for r in self._q(
                    f"SELECT b.hash FROM blobs b WHERE b.hash IN ({','.join('?' * len(chunk))})"
                    f" AND b.extents IS NOT NULL AND {_UNPINNED_B}",
                    chunk,
                )
            )
        return out

    # -- cross-checks (fsck) -------------------------------------------------------------
    def pages_without_blob(self) -> dict[bytes, list[PageRow]]:
        """The pages naming data that no blob row holds (a damaged index), by content."""
        out: dict[bytes, list[PageRow]] = {}
        rows = self._q(
            f"SELECT {_P_COLS} FROM pages p"
            " WHERE NOT EXISTS (SELECT 1 FROM blobs b WHERE b.hash = p.hash)"
        )
        for p in sorted(map(_page, rows), key=lambda p: p.path):
            out.setdefault(bytes(p.hash), []).append(p)
        return out

    def wrong_refs(self) -> list[tuple[bytes, int, int]]:
        """(content, references its row counts, pages naming it) for every blob row whose
        count is not the pages' (one statement: one committed state)."""
        return [
            (bytes(r[0]), r[1], r[2])
            for r in self._q(
                "SELECT hash, refs, n FROM (SELECT b.hash, b.refs,"
                " (SELECT COUNT(*) FROM pages p WHERE p.hash = b.hash) AS n FROM blobs b)"
                " WHERE refs != n ORDER BY hash"
            )
        ]

    def wrong_page_sizes(self) -> list[tuple[PageRow, int]]:
        """Every page whose size is not its data's, with its data's size."""
        rows = self._q(
            f"SELECT {_P_COLS}, b.size FROM pages p JOIN blobs b ON b.hash = p.hash"
            " WHERE p.size != b.size"
        )
        return sorted(((_page(r[:-1]), r[-1]) for r in rows), key=lambda x: x[0].path)

    def blobs_not_local(self) -> Iterator[BlobRow]:
        """Every blob held by the archive alone, read as :meth:`_scan_blobs` reads."""
        return map(_blob, self._scan_blobs(_BLOB_COLS, "extents IS NULL"))

    # -- repairs (fsck --repair) -----------------------------------------------------------
    def add_lost_blob(
        self,
        h: bytes,
        size: int,
        leaves: bytes,
        extents: tuple[Extent, ...] | None,
        disk_bytes: int,
        *,
        archived: bool,
    ) -> BlobRow | None:
        """A blob row again for data that pages name and no row holds (found in files no
        row names, or in the archive), with one reference per such page. None when a row
        holds it by now, or no page names it any more."""
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM blobs WHERE hash=?", (h,)).fetchone():
                return None
            n = db.execute("SELECT COUNT(*) FROM pages WHERE hash=?", (h,)).fetchone()[0]
            if not n:
                return None
            now = time.time()
            ext = _pack([list(e) for e in extents]) if extents is not None else None
            db.execute(
                f"INSERT INTO blobs ({_BLOB_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                (h, size, leaves, n, ext, disk_bytes if extents else 0, int(archived), now, now),
            )
            if archived:  # its pages' manifests name it again
                sessions = db.execute("SELECT DISTINCT session FROM pages WHERE hash=?", (h,))
                self._changed(db, {r[0] for r in sessions}, [])
            r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
            return _blob(r)

    def fix_refs(self, h: bytes) -> tuple[int, int, BlobRow | None] | None:
        """Set a blob row's reference count to the pages naming it: (was, now, the row
        deleted when no page names it: the caller drops its files), None when there is no
        such row any more."""
        with self.transaction() as db:
            r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
            if r is None:
                return None
            b = _blob(r)
            n = db.execute("SELECT COUNT(*) FROM pages WHERE hash=?", (h,)).fetchone()[0]
            if n:
                db.execute("UPDATE blobs SET refs=? WHERE hash=?", (n, h))
                return b.refs, n, None
            self.dropping(b)
            db.execute("DELETE FROM blobs WHERE hash=?", (h,))
            self._changed(db, set(), [b])  # (its archive object is collected)
            return b.refs, 0, b

    def fix_blob_row(self, h: bytes, copy: object, size: int, leaves: bytes) -> bool:
        """Set the size and leaf digests of a blob row whose local copy, still ``copy``
        (its extents), was verified with them. False when that copy is no longer its."""
        with self.transaction() as db:
            r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
            if r is None or _blob(r).extents != copy:
                return False
            db.execute("UPDATE blobs SET size=?, leaves=? WHERE hash=?", (size, leaves, h))
            return True

    def fix_page_size(self, path: str, h: bytes) -> int | None:
        """Set a page's size to its data's (which that data was verified with); None when
        the page holds other data by now, or is gone."""
        with self.transaction() as db:
            r = db.execute(
                "SELECT p.session, b.size FROM pages p JOIN blobs b ON b.hash = p.hash"
                " WHERE p.path=? AND p.hash=?",
                (path, h),
            ).fetchone()
            if r is None:
                return None
            db.execute("UPDATE pages SET size=? WHERE path=?", (r[1], path))
            self._changed(db, {r[0]}, [])  # the archive's manifest names its size
            return int(r[1])

    def delete_unpinned_pages(
        self, h: bytes, copy: object
    ) -> tuple[list[PageRow], list[BlobRow], list[PageRow]] | None:
        """fsck --repair of data held nowhere: delete every page naming content ``h``
        except the pinned ones (a page pinned, or in a pinned session), which are kept and
        returned third. Only while the blob's local copy is still ``copy`` (its extents);
        ``copy`` None: only while no blob row holds ``h``. None otherwise."""
        with self.transaction() as db:
            r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
            if (r is None) != (copy is None) or (r is not None and _blob(r).extents != copy):
                return None
            rows = [
                (_page(x[:-1]), bool(x[-1]))
                for x in db.execute(
                    f"SELECT {_P_COLS},"
                    " COALESCE(s.pinned, 0) FROM pages p LEFT JOIN sessions s"
                    " ON s.dir = p.session WHERE p.hash=? ORDER BY p.path",
                    (h,),
                )
            ]
            kept = [p for p, session_pinned in rows if p.pinned or session_pinned]
            gone, freed = self._delete_pages(
                db, [p.path for p, session_pinned in rows if not (p.pinned or session_pinned)]
            )
            return gone, freed, kept

    # -- writes -------------------------------------------------------------------------
    def commit_page(
        self, c: PageCommit, *, now: float | None = None
    ) -> tuple[bool, BlobRow | None, PageRow | None, BlobRow | None]:
        """Publish a page in one transaction.

        Returns ``(used_new_data, freed_blob, replaced_page, stale_copy)``: ``used_new_data``
        is False when a blob with this checksum is already local (the caller's files are
        redundant and must be removed); ``freed_blob`` is the blob whose last reference a
        replace dropped; ``stale_copy`` the row of the damaged copy ``c.stale`` that the new
        files replaced (the caller removes its files).
        Raises ``FileExistsError`` (unwrapped sqlite) semantics via the return of the caller:
        here, a :class:`KeyError` when the path exists and ``replace`` is False.

        Group commit: calls that arrive while another thread's commit is running are queued
        and published together in the next transaction (one WAL fsync for all of them), each
        in its own savepoint, so one call's error leaves the others' pages intact. A caller
        returns only after the transaction holding its page is committed.
        """
        req = _Pending(c, time.time() if now is None else now)
        with self._gc_lock:
            self._gc_queue.append(req)
            lead = not self._gc_leading
            self._gc_leading = True
        if lead:
            self._lead_group_commits()
        req.done.wait()
        if req.error is not None:
            # (an error of its own statements, in its savepoint, is SQLite's as it came)
            bad = self._unavailable(req.error)
            if bad is not req.error:
                raise bad from req.error
            raise req.error
        assert req.result is not None
        return req.result

    def _lead_group_commits(self) -> None:
        while True:
            with self._gc_lock:
                batch, self._gc_queue = self._gc_queue, []
                if not batch:
                    self._gc_leading = False
                    return
            try:
                with self.transaction() as db:
                    for r in batch:
                        db.execute("SAVEPOINT page")
                        try:
                            r.result = self._commit_page(db, r.commit, r.now)
                        except Exception as e:
                            db.execute("ROLLBACK TO page")
                            r.error = e
                        db.execute("RELEASE page")
            except BaseException as e:  # the transaction failed: none of the batch is committed
                err = e if isinstance(e, Exception) else RuntimeError(f"commit interrupted: {e!r}")
                for r in batch:
                    r.result, r.error = None, err
                if not isinstance(e, Exception):  # interrupted: fail the queue too, then stop
                    with self._gc_lock:
                        rest, self._gc_queue = self._gc_queue, []
                        self._gc_leading = False
                    for r in batch + rest:
                        r.error = err
                        r.done.set()
                    raise
            for r in batch:
                r.done.set()

    def _commit_page(
        self, db: sqlite3.Connection, c: PageCommit, now: float
    ) -> tuple[bool, BlobRow | None, PageRow | None, BlobRow | None]:
        """One page's changes, inside the caller's transaction and savepoint."""
        path, h, extents, disk_bytes = c.path, c.h, c.extents, c.disk_bytes
        old = db.execute(f"SELECT {_PAGE_COLS} FROM pages WHERE path=?", (path,)).fetchone()
        old_page = _page(old) if old else None
        if old_page is not None and not c.replace:
            raise KeyError(path)
        if old_page is None:
            _check_no_clash(db, path)
        existing = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
        used_new = True
        at = now if c.atime is None else c.atime
        replaced_copy: BlobRow | None = None
        if extents is None and (existing is None or _blob(existing).extents is None):
            raise LookupError("the data to share is no longer held locally")
        if existing is None:
            # One reference for this page, and one for each page already naming the data
            # (none, unless a damaged index lost its row: this put mends those pages)
            named = db.execute("SELECT COUNT(*) FROM pages WHERE hash=?", (h,)).fetchone()[0]
            db.execute(
                f"INSERT INTO blobs ({_BLOB_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    h,
                    c.size,
                    c.leaves,
                    1 + named,
                    _pack(list(extents)) if extents is not None else None,
                    disk_bytes if extents is not None else 0,
                    0,
                    now,
                    at,
                ),
            )
        else:
            eb = _blob(existing)
            stale = c.stale is not None and eb.extents == c.stale
            if (eb.local and not stale) or extents is None:
                used_new = False
                db.execute(
                    "UPDATE blobs SET refs=refs+1, atime=MAX(atime, ?) WHERE hash=?", (at, h)
                )
            else:  # known only in the archive, or damaged: our files become its local copy
                db.execute(
                    "UPDATE blobs SET refs=refs+1, atime=MAX(atime, ?), extents=?, disk_bytes=?"
                    " WHERE hash=?",
                    (at, _pack(list(extents)), disk_bytes, h),
                )
                replaced_copy = eb if stale else None
                self.dropping(replaced_copy)
        freed = None
        if old_page is not None:
            db.execute("DELETE FROM pages WHERE path=?", (path,))
            # the page put is pinned as it says: for good, or not at all
            self._set_pin_until(db, path, "page", None)
            freed = self._unref(db, old_page.hash) if old_page.hash != h else None
            if old_page.hash == h:
                db.execute("UPDATE blobs SET refs=refs-1 WHERE hash=?", (h,))
            else:  # the archive's manifest names the old data
                self._changed(db, {old_page.session}, [freed] if freed else [])
        db.execute(
            f"INSERT INTO pages ({_PAGE_COLS}) VALUES (?,?,?,?,?,?,?,?)",
            (path, c.session, h, c.size, now, now, int(c.pinned), _pack(c.attrs)),
        )
        self._touch_session(db, c.session, now, c.session_attrs)
        return used_new, freed, old_page, replaced_copy

    @staticmethod
    def _touch_session(
        db: sqlite3.Connection, d: str, now: float, attrs: dict[str, str] | None = None
    ) -> None:
        row = db.execute("SELECT attrs FROM sessions WHERE dir=?", (d,)).fetchone()
        if row is None:
            db.execute("INSERT INTO sessions VALUES (?,?,?,0,?)", (d, now, now, _pack(attrs or {})))
        else:
            merged = dict(_unpack(row[0], {}))  # type: ignore[arg-type]
            if attrs:
                for k, v in attrs.items():
                    merged.setdefault(k, v)
            db.execute(
                "UPDATE sessions SET atime=MAX(atime, ?), attrs=? WHERE dir=?",
                (now, _pack(merged), d),
            )

    def _unref(self, db: sqlite3.Connection, h: bytes) -> BlobRow | None:
        """Drop one reference; delete and return the blob row when it was the last."""
        db.execute("UPDATE blobs SET refs=refs-1 WHERE hash=?", (h,))
        r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
        if r is not None and r[3] <= 0:
            self.dropping(_blob(r))
            db.execute("DELETE FROM blobs WHERE hash=?", (h,))
            return _blob(r)
        return None

    def delete_pages(
        self, paths: Iterable[str], *, keep_pinned: bool = False
    ) -> tuple[list[PageRow], list[BlobRow]]:
        """Delete pages; return the rows deleted and the blobs whose last reference went.
        With ``keep_pinned`` (an eviction), a page pinned by now, or whose session is, is
        kept: a pin that lands after the pages were chosen keeps its page."""
        with self.transaction() as db:
            if keep_pinned:
                paths = [path for path in paths if not _pinned(db, "path", path)]
            return self._delete_pages(db, paths)

    def delete_blob_pages(
        self, h: bytes, *, keep_pinned: bool, copy: object = None
    ) -> tuple[list[PageRow], list[BlobRow]] | None:
        """Delete every page that shares blob ``h``, in one transaction. With
        ``keep_pinned`` (eviction), None instead when one of them, or its session, is
        pinned by now: a pin that lands after the victim was chosen keeps the data. With
        ``copy`` (extents), None unless the blob's local copy is still that one."""
        with self.transaction() as db:
            if copy is not None:
                r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
                if r is None or _blob(r).extents != copy:
                    return None
            if keep_pinned and _pinned(db, "hash", h):
                return None
            paths = [r[0] for r in db.execute("SELECT path FROM pages WHERE hash=?", (h,))]
            return self._delete_pages(db, paths)

    def _delete_pages(
        self, db: sqlite3.Connection, paths: Iterable[str]
    ) -> tuple[list[PageRow], list[BlobRow]]:
        gone: list[PageRow] = []
        freed: list[BlobRow] = []
        for path in paths:
            r = db.execute(f"SELECT {_PAGE_COLS} FROM pages WHERE path=?", (path,)).fetchone()
            if r is None:
                continue
            p = _page(r)
            self.removals[p.session] += 1
            db.execute("DELETE FROM pages WHERE path=?", (path,))
            # (its pin's lifetime goes with it: not onto a page put there later)
            self._set_pin_until(db, path, "page", None)
            gone.append(p)
            b = self._unref(db, p.hash)
            if b is not None:
                freed.append(b)
        if gone:
            self._changed(db, {p.session for p in gone}, freed)
        return gone, freed

    def _changed(self, db: sqlite3.Connection, sessions: set[str], freed: list[BlobRow]) -> None:
        if self.on_changed is not None:
            self.on_changed(db, sessions, freed)

    def delete_session(
        self, d: str, *, untouched_since: float | None = None
    ) -> tuple[list[PageRow], list[BlobRow]] | None:
        """Delete a session's pages and its own row in one transaction (a put committed
        after it starts the session afresh). None when there is no such session.

        With ``untouched_since`` (a retention pass), also None unless the session is
        unpinned, holds no pinned page, and was last touched before that time: a session
        touched or pinned since the caller looked is kept."""
        with self.transaction() as db:
            row = db.execute("SELECT atime, pinned FROM sessions WHERE dir=?", (d,)).fetchone()
            if row is None:
                return None
            if untouched_since is not None:
                pinned_page = db.execute(
                    "SELECT 1 FROM pages WHERE session=? AND pinned=1 LIMIT 1", (d,)
                ).fetchone()
                if row[1] or pinned_page is not None or row[0] >= untouched_since:
                    return None
            paths = [r[0] for r in db.execute("SELECT path FROM pages WHERE session=?", (d,))]
            deleted = self._delete_pages(db, paths)
            db.execute("DELETE FROM sessions WHERE dir=?", (d,))
            self._set_pin_until(db, d, "session", None)
            return deleted

    def rename_page(self, src: str, dst: str, dst_session: str) -> tuple[PageRow, BlobRow | None]:
        """Move a page to a new path atomically, replacing what was there (returns its freed blob)."""
        with self.transaction() as db:
            r = db.execute(f"SELECT {_PAGE_COLS} FROM pages WHERE path=?", (src,)).fetchone()
            if r is None:
                raise KeyError(src)
            p = _page(r)
            if src == dst:  # POSIX: renaming a file onto itself does nothing
                return p, None
            self.removals[p.session] += 1
            self.removals[dst_session] += 1
            freed = None
            old = db.execute("SELECT hash FROM pages WHERE path=?", (dst,)).fetchone()
            if old is None:
                _check_no_clash(db, dst, moving=src)
            if old is not None:
                db.execute("DELETE FROM pages WHERE path=?", (dst,))
                freed = self._unref(db, old[0])
            db.execute("UPDATE pages SET path=?, session=? WHERE path=?", (dst, dst_session, src))
            # the page's pin moves with it, and its lifetime too; the replaced page's goes
            self._set_pin_until(db, dst, "page", None)
            db.execute("UPDATE pin_expiry SET target=? WHERE target=? AND kind='page'", (dst, src))
            self._touch_session(db, dst_session, time.time())
            # both sessions' manifests name the old path, or the replaced data
            self._changed(db, {p.session, dst_session}, [freed] if freed else [])
        return p, freed

    def drop_local(
        self, h: bytes, extents: object = None, *, keep_pinned: bool = False
    ) -> BlobRow | None:
        """Forget a blob's local copy (the archive holds it); only if it is still the copy in
        ``extents``, when given (a copy restored since is kept). With ``keep_pinned`` (an
        eviction), None instead when a page holding it, or its session, is pinned by now.
        Returns the row as it was."""
        with self.transaction() as db:
            r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
            if r is None or r[4] is None:
                return None
            if extents is not None and _blob(r).extents != extents:
                return None
            if keep_pinned and _pinned(db, "hash", h):
                return None
            self.dropping(_blob(r))
            db.execute("UPDATE blobs SET extents=NULL, disk_bytes=0 WHERE hash=?", (h,))
            return _blob(r)

    def update_page_attrs(self, path: str, attrs: dict[str, str]) -> bool:
        """Merge attrs into a page's attrs; False when there is no such page."""
        with self.transaction() as db:
            row = db.execute("SELECT attrs FROM pages WHERE path=?", (path,)).fetchone()
            if row is None:
                return False
            merged = dict(_unpack(row[0], {}))  # type: ignore[arg-type]
            merged.update(attrs)
            db.execute("UPDATE pages SET attrs=? WHERE path=?", (_pack(merged), path))
            return True

    def set_page_pinned(self, path: str, pinned: bool, until: float | None = None) -> bool:
        """Pin or unpin a page; False when there is no such page. A pin ends at ``until``
        (a time.time()) when given, else never; either replaces the lifetime a pin had, and
        an unpin removes it."""
        with self.transaction() as db:
            row = db.execute("SELECT session, pinned FROM pages WHERE path=?", (path,)).fetchone()
            if row is None:
                return False
            r = db.execute("SELECT until FROM pin_expiry WHERE target=? AND kind='page'", (path,))
            ended_at = r.fetchone()
            until = until if pinned else None
            db.execute("UPDATE pages SET pinned=? WHERE path=?", (int(pinned), path))
            self._set_pin_until(db, path, "page", until)
            # The archive's manifest carries pins and when they end (a pin renewed with the
            # same end changes nothing there)
            if bool(row[1]) != pinned or (ended_at[0] if ended_at else None) != until:
                self._changed(db, {row[0]}, [])
            return True

    @staticmethod
    def _set_pin_until(db: sqlite3.Connection, target: str, kind: str, until: float | None) -> None:
        if until is None:
            db.execute("DELETE FROM pin_expiry WHERE target=? AND kind=?", (target, kind))
        else:
            db.execute(
                "INSERT OR REPLACE INTO pin_expiry (target, kind, until) VALUES (?,?,?)",
                (target, kind, until),
            )

    def pin_until(self, target: str, kind: str) -> float | None:
        """When the pin of page (``kind`` "page") or session directory ("session")
        ``target`` ends; None when it has no lifetime (or there is no pin)."""
        r = self._q("SELECT until FROM pin_expiry WHERE target=? AND kind=?", (target, kind))
        return float(r[0][0]) if r else None

    def drop_stale_pin_ends(self) -> int:
        """Forget the ends of pins that are no longer there: rows of ``pin_expiry`` whose
        page or session is not pinned (or gone). A kvfs older than pin lifetimes unpins,
        deletes and renames without clearing them (a store downgraded, then upgraded), and
        such a row ended the pin of a page put pinned on that path later. Returns how many
        went; a read only when there are none."""
        stale = (
            "(kind='page' AND NOT EXISTS (SELECT 1 FROM pages WHERE path=target AND pinned))"
            " OR (kind='session'"
            " AND NOT EXISTS (SELECT 1 FROM sessions WHERE dir=target AND pinned))"
        )
        if not self._q(f"SELECT 1 FROM pin_expiry WHERE {stale} LIMIT 1"):
            return 0
        with self.transaction() as db:
            return int(db.execute(f"DELETE FROM pin_expiry WHERE {stale}").rowcount)

    def release_expired_pins(self, now: float) -> list[tuple[str, str]]:
        """Unpin every page and session whose pin's lifetime ended by ``now``, as an unpin
        does (the archive's manifest follow-up included), in one transaction: a pin renewed
        meanwhile is not released. Returns the (target, kind) released."""
        if not self._q("SELECT 1 FROM pin_expiry WHERE until <= ? LIMIT 1", (now,)):
            return []  # (a read, no write transaction: make_room asks at every pass)
        released: list[tuple[str, str]] = []
        with self.transaction() as db:
            rows = db.execute(
                "SELECT target, kind FROM pin_expiry WHERE until <= ? ORDER BY until", (now,)
            ).fetchall()
            for target, kind in rows:
                if kind == "page":
                    p = db.execute(
                        "SELECT session, pinned FROM pages WHERE path=?", (target,)
                    ).fetchone()
                    if p is not None and p[1]:
                        db.execute("UPDATE pages SET pinned=0 WHERE path=?", (target,))
                        self._changed(db, {p[0]}, [])
                        released.append((target, kind))
                else:
                    s = db.execute("SELECT pinned FROM sessions WHERE dir=?", (target,)).fetchone()
                    if s is not None and s[0]:
                        self._set_session_pinned(db, target, False)
                        released.append((target, kind))
                db.execute("DELETE FROM pin_expiry WHERE target=? AND kind=?", (target, kind))
        return released

    def touch_session(self, d: str) -> None:
        """The session, and every page of it and their data, was used now (a restore: the
        pages just brought back must not be the first an eviction takes, as their atimes
        from the manifest made them)."""
        now = time.time()
        with self.transaction() as db:
            db.execute("UPDATE sessions SET atime=MAX(atime, ?) WHERE dir=?", (now, d))
            db.execute("UPDATE pages SET atime=MAX(atime, ?) WHERE session=?", (now, d))
            db.execute(
                "UPDATE blobs SET atime=MAX(atime, ?)"
                " WHERE hash IN (SELECT hash FROM pages WHERE session=?)",
                (now, d),
            )

    def set_session_pinned(self, d: str, pinned: bool, until: float | None = None) -> None:
        """Pin or unpin a session, as :meth:`set_page_pinned` a page. Raises PageExists for
        a directory at or below a page: no session can be there."""
        with self.transaction() as db:
            above = _page_above(db, d, itself=True)
            if above is not None:
                raise PageExists(f"{d!r}: {above!r} is a page, so no session can be there")
            self._set_session_pinned(db, d, pinned)
            self._set_pin_until(db, d, "session", until if pinned else None)

    def _set_session_pinned(self, db: sqlite3.Connection, d: str, pinned: bool) -> None:
        # (a touch: retention counts from an unpin, or from a pin's end)
        self._touch_session(db, d, time.time())
        db.execute("UPDATE sessions SET pinned=? WHERE dir=?", (int(pinned), d))
        self._changed(db, {d}, [])

    def set_session_attrs(self, d: str, attrs: dict[str, str]) -> None:
        with self.transaction() as db:
            self._touch_session(db, d, time.time())
            row = db.execute("SELECT attrs FROM sessions WHERE dir=?", (d,)).fetchone()
            merged = dict(_unpack(row[0], {}))  # type: ignore[arg-type]
            merged.update(attrs)
            db.execute("UPDATE sessions SET attrs=? WHERE dir=?", (_pack(merged), d))
            self._changed(db, {d}, [])

    def drop_session_if_empty(self, d: str) -> None:
        with self.transaction() as db:
            n = db.execute("SELECT COUNT(*) FROM pages WHERE session=?", (d,)).fetchone()[0]
            pinned = db.execute("SELECT pinned FROM sessions WHERE dir=?", (d,)).fetchone()
            if n == 0 and pinned is not None and not pinned[0]:
                db.execute("DELETE FROM sessions WHERE dir=?", (d,))

    def flush_atimes(
        self, pages: dict[str, float], blobs: dict[bytes, float], sessions: dict[str, float]
    ) -> None:
        """Write batched access times (reads do not each pay a transaction)."""
        if not (pages or blobs or sessions):
            return
        with self.transaction() as db:
            db.executemany(
                "UPDATE pages SET atime=MAX(atime, ?) WHERE path=?",
                [(t, p) for p, t in pages.items()],
            )
            db.executemany(
                "UPDATE blobs SET atime=MAX(atime, ?) WHERE hash=?",
                [(t, h) for h, t in blobs.items()],
            )
            db.executemany(
                "UPDATE sessions SET atime=MAX(atime, ?) WHERE dir=?",
                [(t, d) for d, t in sessions.items()],
            )
