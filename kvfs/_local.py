"""The striped local tier: N device directories, 4 KiB-aligned data files.

Layout of one device root::

    <root>/.kvfs-device           which store and which device index this directory is
    <root>/blobs/<xx>/<nonce>     one data file per (blob, device) holding that blob's chunks

A blob (the stored bytes of one or more identical pages) is cut into stripe units. Chunk
``c`` lives on device ``(start + c) % N`` at file offset ``HEADER + (c // N) * stripe_unit``:
a small blob is one chunk on one device, a large one is spread round-robin, and any page
offset maps to a place without knowing the final size (the FUSE writer needs that). Every
chunk starts 4 KiB aligned, so O_DIRECT and GPUDirect Storage can read extents as they are.
The first 4 KiB of every file is a header (magic + msgpack) that fsck can read.

This module only moves bytes; what exists is decided by the index (see ``_index``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import os
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import msgpack

from ._aligned import (
    ALIGN,
    BouncePool,
    address_of,
    aligned_buffer,
    is_aligned,
    open_direct,
    round_up,
)
from ._errors import DiskFull, IndexUnavailable, KvfsError
from ._index import Extent

log = logging.getLogger("kvfs.local")

__all__ = [
    "DEVICE_MARKER",
    "HEADER",
    "BlobWriter",
    "LocalTier",
    "Piece",
    "device_store",
    "placement",
    "run_beside",
    "unnamed_files",
    "wait_all",
]

HEADER = 4096
MAGIC = b"KVFSBLB1"
#: In every device root: which store and which device index the directory is.
DEVICE_MARKER = ".kvfs-device"
#: errnos a device's file system answers when its disk fails (dropped off the bus, shut
#: down after an error), as opposed to a full disk or a missing file
DISK_ERRORS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.EROFS})
#: A device that answered one of DISK_ERRORS is left out of new placements for this long
#: after its last one, then tried again: a disk that came back is used again, one still
#: failing fails one more write and is left out again.
FAILING_SECONDS = 60.0


def is_disk_error(e: BaseException | None) -> bool:
    """Whether ``e`` is a disk's own error (DISK_ERRORS), not kvfs's (a CorruptPage is EIO
    too), nor a full disk."""
    return isinstance(e, OSError) and not isinstance(e, KvfsError) and e.errno in DISK_ERRORS


def disk_failed(e: BaseException | None) -> bool:
    """Whether ``e`` says a disk fails: a data disk's own error (:func:`is_disk_error`) or
    the index's (IndexUnavailable). What the logs throttle and the CLI's exit code 10 mean."""
    return isinstance(e, IndexUnavailable) or is_disk_error(e)


@dataclass(frozen=True, slots=True)
class DeviceTrouble:
    """The disk errors one device answered since the store opened."""

    errors: int
    #: time.time() of the last one, and what it said
    last: float
    error: str


def read_marker(root: Path, hint: str = "") -> dict[str, Any] | None:
    """A device directory's marker, or None when it has none. Raises KvfsError when it
    cannot be read (``hint``: what it should hold, added to the message)."""
    marker = root / DEVICE_MARKER
    try:
        raw = marker.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # (a bare "[Errno 5] Input/output error" was all a CLI user saw)
        failing = "; is its disk failing?" if e.errno == errno.EIO else ""
        raise KvfsError(
            f"{marker} cannot be read ({e.strerror}{failing}). It says which store and device "
            f"{root} is: the store does not open without it{hint}"
        ) from e
    try:
        info = msgpack.unpackb(raw)
        if not isinstance(info, dict):
            raise ValueError(f"a {type(info).__name__}, not a map")
    except (ValueError, msgpack.UnpackException) as e:
        raise KvfsError(
            f"{marker} is unreadable ({e}): it says which store and device {root} is, and "
            f"kvfs will not guess{hint}"
        ) from e
    return info


def device_store(root: Path) -> str | None:
    """The store id a device directory's marker names, or None when it has none. Raises
    KvfsError when the marker cannot be read."""
    info = read_marker(root)
    return None if info is None else str(info.get("store"))


MAX_PIECE = 8 << 20
_IOV_MAX = 1024  # buffers per pwritev (Linux's IOV_MAX)
#: A buffered writer starts writeback (sync_file_range, asynchronous) every this many bytes
#: written to a file, so the fdatasync at the end waits for the tail only, not the whole file.
KICK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Piece:
    """One contiguous read: ``n`` bytes of a device file into ``dest[dest_off:dest_off+n]``."""

    dev: int
    file: str
    file_off: int
    dest_off: int
    n: int


def placement(
    rel: str, start: int, size: int, unit: int, ndev: int
) -> tuple[tuple[Extent, ...], dict[int, int]]:
    """Where a blob of ``size`` bytes written as ``rel`` from device ``start`` lies, with
    ``ndev`` devices and stripe unit ``unit``: its extents, and the size of each of its
    files (its header, and every chunk padded to 4 KiB)."""
    extents: list[Extent] = []
    sizes: dict[int, int] = {}
    for c in range(max(1, -(-size // unit))):
        dev, foff = (start + c) % ndev, HEADER + (c // ndev) * unit
        n = min(unit, size - c * unit)
        extents.append((dev, rel, foff, n))
        sizes[dev] = max(sizes.get(dev, HEADER), foff + round_up(n))
    return tuple(merge_extents(extents)), sizes


def merge_extents(extents: list[Extent]) -> list[Extent]:
    out: list[Extent] = []
    for e in extents:
        if out and out[-1][0] == e[0] and out[-1][1] == e[1] and out[-1][2] + out[-1][3] == e[2]:
            last = out[-1]
            out[-1] = (last[0], last[1], last[2], last[3] + e[3])
        else:
            out.append(e)
    return out


class LocalTier:
    """Byte movement for the striped local tier. Thread-safe; no knowledge of keys."""

    def __init__(
        self,
        roots: tuple[Path, ...],
        stripe_unit: int,
        *,
        direct: bool,
        durable: bool,
        pool: ThreadPoolExecutor,
        bounce_buffers: int,
    ) -> None:
        # absolute: extents name files for other processes (the fast path, the mount's
        # user.kvfs.extents), whose working directory is not this one's
        self.roots = tuple(Path(os.path.abspath(r)) for r in roots)
        self.n = len(self.roots)
        # Writers whose files the index may not name yet: a writer lives until its files
        # are committed or removed (see writing_files).
        self._writers: weakref.WeakSet[BlobWriter] = weakref.WeakSet()
        self._writers_lock = threading.Lock()
        self.unit = stripe_unit
        self.piece = min(stripe_unit, MAX_PIECE)
        self.direct = direct
        self.durable = durable
        self.pool = pool
        self.bounce = BouncePool(self.piece, bounce_buffers)
        self._rr = 0
        self._rr_lock = threading.Lock()
        self._trouble: dict[int, DeviceTrouble] = {}
        self._trouble_lock = threading.Lock()

    # -- set-up -----------------------------------------------------------------------
    def prepare(self, store_id: str) -> None:
        """Create the device layout, or check that existing directories belong to this
        store. Raises KvfsError for a directory that is another store's, or this store's
        device of another number (out of order, or named twice), having made nothing: every
        marker is read before any directory is made (a new device listed before the one
        refused was made, with its marker, by an open that failed)."""
        seen: dict[str, int] = {}
        for i, root in enumerate(self.roots):
            j = seen.setdefault(os.path.realpath(root), i)
            if j != i:
                raise KvfsError(
                    f"{root} is named twice among the data directories (as device {j} and "
                    f"{i}): each device is one directory"
                )
        new: list[tuple[int, Path]] = []
        for i, root in enumerate(self.roots):
            hint = f" (this store's device {i} would hold {{'store': {store_id!r}, 'index': {i}}})"
            info = read_marker(root, hint)
            if info is None:
                new.append((i, root))
            elif info.get("store") != store_id:
                raise KvfsError(
                    f"{root} is device {info.get('index')} of another store, "
                    f"{info.get('store')}, not of this one ({store_id}): is it the right "
                    "directory, in its original place among the data directories?"
                )
            elif info.get("index") != i:
                raise KvfsError(
                    f"{root} is device {info.get('index')} of store {store_id}, but is "
                    f"configured as device {i}: keep the data directories in their original "
                    "order"
                )
        for root in self.roots:
            (root / "blobs").mkdir(parents=True, exist_ok=True)
        for i, root in new:
            marker = root / DEVICE_MARKER
            if marker.exists():  # (named twice through paths realpath cannot tell: a bind mount)
                raise KvfsError(
                    f"{root} is named twice among the data directories (as device {i}, and "
                    "before): each device is one directory"
                )
            # The 256 fan-out directories up front: a put then only creates its file, and
            # the directories' own entries are durable before any page depends on them.
            for x in range(256):
                (root / "blobs" / f"{x:02x}").mkdir(exist_ok=True)
            tmp = marker.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, msgpack.packb({"store": store_id, "index": i}))
                # Its bytes before its name: the directory's fsync below makes the
                # rename durable, not the file's contents (ext4 writes a new file's
                # data later), and a crash would leave an empty marker that every
                # later open refuses (it will not guess what the directory is). Durable
                # whatever ``durable`` says: a marker lost loses every page, not the
                # last few, and it is written once.
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, marker)
            fsync_dir(str(root / "blobs"))
            fsync_dir(str(root))

    def free_bytes(self) -> list[int]:
        """Free bytes of each device's file system; 0 for one whose disk fails (counted
        against it): statistics and statfs go on for the others."""
        out = []
        for dev, r in enumerate(self.roots):
            try:
                st = os.statvfs(r)
            except OSError as e:
                if not is_disk_error(e):
                    raise
                self.note_error(dev, e)
                out.append(0)
                continue
            out.append(st.f_bavail * st.f_frsize)
        return out

    def free_bytes_per_filesystem(self) -> list[int]:
        """Free space of each distinct file system the roots are on: two data directories
        on one disk share its free space, which must not count twice."""
        seen: dict[int, int] = {}
        for r, free in zip(self.roots, self.free_bytes(), strict=True):
            seen.setdefault(os.stat(r).st_dev, free)
        return list(seen.values())

    def abspath(self, dev: int, rel: str) -> str:
        return os.path.join(self.roots[dev], rel)

    # -- health -----------------------------------------------------------------------
    def note_error(self, dev: int, e: BaseException) -> None:
        """Count ``e`` against device ``dev`` when it is a disk's error (DISK_ERRORS, not a
        kvfs error nor a full disk): the device is then :meth:`failing`. The first error
        after a healthy spell is a WARNING in the log."""
        if not is_disk_error(e):
            return
        now = time.time()
        with self._trouble_lock:
            old = self._trouble.get(dev)
            self._trouble[dev] = DeviceTrouble((old.errors if old else 0) + 1, now, str(e))
        if old is None or now - old.last >= FAILING_SECONDS:
            log.warning(
                "device %d (%s) answered a disk error (%s): new pages go to the other "
                "devices for %.0f s after its last one; its pages fail to read unless the "
                "archive holds them",
                dev,
                self.roots[dev],
                e,
                FAILING_SECONDS,
            )

    def note_error_of(self, e: BaseException) -> None:
        """:meth:`note_error` for an error met by another process (a restore worker), its
        device found by the data file it names."""
        name = getattr(e, "filename", None)
        for dev, root in enumerate(self.roots):
            if isinstance(name, str) and name.startswith(os.path.join(root, "")):
                self.note_error(dev, e)
                return

    def trouble(self, dev: int) -> DeviceTrouble | None:
        """Device ``dev``'s disk errors since the store opened; None if it had none."""
        with self._trouble_lock:
            return self._trouble.get(dev)

    def failing(self) -> frozenset[int]:
        """The devices whose last disk error is less than FAILING_SECONDS old."""
        now = time.time()
        with self._trouble_lock:
            return frozenset(d for d, t in self._trouble.items() if now - t.last < FAILING_SECONDS)

    # -- placement --------------------------------------------------------------------
    def next_start(self, size: int | None = None) -> int:
        """The first device of a new blob of ``size`` bytes (None: not known yet), in
        turn, skipping failing devices (see :meth:`place`)."""
        with self._rr_lock:
            self._rr = (self._rr + 1) % self.n
            start = self._rr
        return self.place(start, size)

    def place(self, start: int, size: int | None = None) -> int:
        """``start``, or where it is a failing device's (or the blob's chunks would reach
        one), the next device from which they reach none. A blob striped over every
        device cannot avoid one: ``start`` then. ``size`` None: one chunk, as far as is
        known (the mount's writer learns its size as it goes)."""
        bad = self.failing()
        if not bad:
            return start
        chunks = 1 if size is None else max(1, -(-size // self.unit))
        if chunks >= self.n:
            return start
        for j in range(self.n):
            s = (start + j) % self.n
            if not any((s + c) % self.n in bad for c in range(chunks)):
                return s
        return start

    def locate(self, start: int, page_off: int) -> tuple[int, int]:
        """(device, file offset) of a page offset for a blob placed at device ``start``."""
        c, within = divmod(page_off, self.unit)
        return (start + c) % self.n, HEADER + (c // self.n) * self.unit + within

    def read_header(self, dev: int, rel: str) -> dict[str, Any] | None:
        """The header of data file ``rel`` on device ``dev`` (what its writer recorded:
        nonce, dev, start, ndev, unit), or None when it is no kvfs data file or cannot be
        read."""
        try:
            with open(self.abspath(dev, rel), "rb") as f:
                raw = f.read(HEADER)
        except OSError:
            return None
        if len(raw) < len(MAGIC) + 2 or raw[: len(MAGIC)] != MAGIC:
            return None
        n = int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 2], "little")
        try:
            meta = msgpack.unpackb(raw[len(MAGIC) + 2 : len(MAGIC) + 2 + n])
        except (ValueError, msgpack.UnpackException):
            return None
        return meta if isinstance(meta, dict) else None

    def disk_bytes(self, size: int) -> int:
        """Bytes on disk (headers and padding included) a blob of ``size`` occupies."""
        chunks = max(1, -(-size // self.unit))
        per_dev = [0] * min(self.n, chunks)
        for c in range(chunks):
            per_dev[c % len(per_dev)] += round_up(min(self.unit, size - c * self.unit))
        return sum(HEADER + b for b in per_dev)

    # -- writing ----------------------------------------------------------------------
    def writer(self, start: int, *, direct: bool, nonce: str | None = None) -> BlobWriter:
        w = BlobWriter(self, start, direct=direct and self.direct, nonce=nonce)
        with self._writers_lock:
            self._writers.add(w)
        return w

    def writing_files(self) -> set[tuple[int, str]]:
        """Every (device, file) a writer of this process may have created that the index
        may not name yet: a put or a file on the mount being written, a restore (also one
        a worker process writes). Files a writer committed can be among them."""
        with self._writers_lock:
            rels = {w.rel for w in list(self._writers)}
        return {(dev, rel) for rel in rels for dev in range(self.n)}

    # -- reading ----------------------------------------------------------------------
    def pieces(
        self, extents: tuple[Extent, ...], off: int, n: int, max_piece: int | None = None
    ) -> Iterator[Piece]:
        """Split page bytes ``[off, off+n)`` into per-file reads of at most ``max_piece``
        (default: the stripe unit, at most MAX_PIECE)."""
        step = min(self.piece, max_piece) if max_piece else self.piece
        pos = 0
        end = off + n
        for dev, file, foff, length in extents:
            lo, hi = max(off, pos), min(end, pos + length)
            while lo < hi:
                take = min(hi - lo, step)
                yield Piece(dev, file, foff + (lo - pos), lo - off, take)
                lo += take
            pos += length
            if pos >= end:
                break

    def open_files(self, pieces: list[Piece]) -> dict[tuple[int, str], tuple[int, bool]]:
        """Open each file the pieces read, once (O_DIRECT where possible), for
        :meth:`read_piece`'s ``opened``; close them with :meth:`close_files`. Raises
        FileNotFoundError for a missing file (nothing is left open then)."""
        out: dict[tuple[int, str], tuple[int, bool]] = {}
        p = None
        try:
            for p in pieces:
                if (p.dev, p.file) not in out:
                    out[(p.dev, p.file)] = open_direct(
                        self.abspath(p.dev, p.file), os.O_RDONLY, direct=self.direct
                    )
        except BaseException as e:
            self.close_files(out)
            if p is not None:
                self.note_error(p.dev, e)
            raise
        return out

    @staticmethod
    def close_files(opened: dict[tuple[int, str], tuple[int, bool]]) -> None:
        for fd, _direct in opened.values():
            os.close(fd)

    def read_piece(
        self,
        p: Piece,
        dest: memoryview,
        direct: bool | None = None,
        opened: dict[tuple[int, str], tuple[int, bool]] | None = None,
    ) -> None:
        """Read one piece into ``dest[p.dest_off:...]``, O_DIRECT where the buffer allows;
        through a file of ``opened`` (see :meth:`open_files`) or one opened for the call.
        A disk's error counts against the device (:meth:`note_error`)."""
        try:
            self._read_piece(p, dest, direct, opened)
        except OSError as e:
            self.note_error(p.dev, e)
            raise

    def _read_piece(
        self,
        p: Piece,
        dest: memoryview,
        direct: bool | None,
        opened: dict[tuple[int, str], tuple[int, bool]] | None,
    ) -> None:
        path = self.abspath(p.dev, p.file)
        target = dest[p.dest_off : p.dest_off + p.n]
        if opened is not None:
            fd, direct = opened[(p.dev, p.file)]
            own = False
        else:
            fd, direct = open_direct(
                path, os.O_RDONLY, direct=self.direct if direct is None else direct
            )
            own = True
        try:
            if not direct:
                if _pread_full(fd, target, p.file_off) < p.n:
                    raise CorruptedFile(path, "data file is shorter than its extents")
                return
            head = p.n - p.n % ALIGN if p.file_off % ALIGN == 0 else 0
            if head and is_aligned(target[:head]):
                if _pread_full(fd, target[:head], p.file_off) < head:
                    raise CorruptedFile(path, "data file is shorter than its extents")
                done = head
            else:
                done = 0
            if done < p.n:  # unaligned buffer or tail: through a bounce buffer
                b = self.bounce.take()
                try:
                    while done < p.n:
                        fo = p.file_off + done
                        base = fo - fo % ALIGN
                        want = min(p.n - done, len(b) - (fo - base))
                        span = round_up(fo - base + want)
                        got = _pread_full(fd, b[:span], base)
                        if got < fo - base + want:
                            raise CorruptedFile(path, "data file is shorter than its extents")
                        target[done : done + want] = b[fo - base : fo - base + want]
                        done += want
                finally:
                    self.bounce.give(b)
        finally:
            if own:
                os.close(fd)

    def unlink(self, extents: tuple[Extent, ...]) -> None:
        """Remove a blob's files. One that a failing disk cannot remove is counted against
        its device and left: an orphan, which fsck lists and ``--repair`` (or the open
        after a crash) removes once the disk is back. (A delete whose index commit was done
        failed with the disk's EIO, and a retry found no page.)"""
        for dev, file in {(e[0], e[1]) for e in extents}:
            try:
                os.unlink(self.abspath(dev, file))
            except FileNotFoundError:
                pass
            except OSError as e:
                if not is_disk_error(e):
                    raise
                self.note_error(dev, e)
                log.info("data file left on a failing disk, an orphan: %s", e)

    # -- recovery ---------------------------------------------------------------------
    def all_files(self, skip: set[int] | frozenset[int] = frozenset()) -> Iterator[tuple[int, str]]:
        """Every regular file under ``blobs/<xx>/`` of every device but those in ``skip``:
        what data files may be. Anything else there (a directory someone made) is none of
        kvfs's: listed, an unlink of it failed every open after a crash, and every fsck
        --repair."""
        for dev, root in enumerate(self.roots):
            blobs = root / "blobs"
            if dev in skip or not blobs.is_dir():
                continue
            for sub in os.scandir(blobs):
                if sub.is_dir(follow_symlinks=False):
                    for f in os.scandir(sub.path):
                        if f.is_file(follow_symlinks=False):
                            yield dev, f"blobs/{sub.name}/{f.name}"

    def sweep(self, orphans: Iterable[tuple[int, str]]) -> list[str]:
        """Remove ``orphans``, data files the index does not name (see :func:`unnamed_files`).
        Returns what was removed; one that cannot be removed is logged and left (the open
        goes on)."""
        removed = []
        for dev, rel in orphans:
            path = self.abspath(dev, rel)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("could not remove the orphaned data file %s: %s", path, e)
                continue
            removed.append(path)
        return removed


#: (device, file) names sent to the scratch database of unnamed_files at once
_NAMES_AT_ONCE = 1024


class _NoRoom(Exception):
    """The scratch database of :func:`unnamed_files` could not be written."""


def unnamed_files(
    listed: Callable[[], Iterable[tuple[int, str]]],
    named: Callable[[], Iterable[tuple[int, str]]],
) -> Iterator[tuple[int, str]]:
    """The (device, file)s of ``listed()`` that ``named()`` does not name, in the order
    listed. ``listed()`` is read to its end before ``named()`` is called, and both before
    this returns (fsck relies on that order: a file written meanwhile is either not listed
    or named by then; the recovery at open recounts its accounting in ``named()``).

    Neither is held in Python objects: a store of millions of pages has millions of files,
    and sets of their names took hundreds of bytes a page. They go to a private temporary
    SQLite database (in SQLite's temporary directory, which holds about 150 bytes a file;
    unlinked as soon as it is made, so nothing is left behind by a crash), whose page
    cache bounds the memory it takes. Should it not be written there (no room), both are
    read again into a database in memory, which takes those 150 bytes a file."""
    try:
        db = _names_db("", listed, named)
    except _NoRoom as e:
        log.warning(
            "the names of the data files could not be written to SQLite's temporary "
            "directory (%s): they are held in memory instead",
            e.__cause__,
        )
        db = _names_db(":memory:", listed, named)
    return _unnamed_rows(db)


def _names_db(
    where: str,
    listed: Callable[[], Iterable[tuple[int, str]]],
    named: Callable[[], Iterable[tuple[int, str]]],
) -> sqlite3.Connection:
    """A scratch database at ``where`` with tables ``listed`` and ``named`` filled (see
    :func:`unnamed_files`). Raises _NoRoom when it cannot be written; what the callables
    raise is theirs."""
    # (any thread: the iterator of unnamed_files closes it, in whichever thread drops it)
    db = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
    try:
        try:
            db.execute("CREATE TABLE listed (dev INTEGER, rel BLOB)")
            db.execute("CREATE TABLE named (dev INTEGER, rel BLOB)")
            db.execute("BEGIN")
        except sqlite3.OperationalError as e:
            raise _NoRoom() from e
        for table, rows in (("listed", listed), ("named", named)):
            it = iter(rows())
            # (the chunk is read before SQLite is called: an error of the index that
            # ``named`` reads is not taken for one of this database's)
            while chunk := list(itertools.islice(it, _NAMES_AT_ONCE)):
                # (as bytes: a file name that is not UTF-8, none of kvfs's but possible in
                # a data directory, cannot be SQLite text, and failed every fsck and every
                # open after a crash with UnicodeEncodeError)
                encoded = [(d, r.encode("utf-8", "surrogateescape")) for d, r in chunk]
                try:
                    db.executemany(f"INSERT INTO {table} VALUES (?, ?)", encoded)
                except sqlite3.OperationalError as e:
                    raise _NoRoom() from e
        try:
            # indexed once filled: a sort of the names, twice as fast as a B-tree kept
            # in order while they arrive in random order (they are random hex)
            db.execute("CREATE INDEX named_files ON named (dev, rel)")
            db.execute("COMMIT")
        except sqlite3.OperationalError as e:
            raise _NoRoom() from e
    except BaseException:
        db.close()
        raise
    return db


def _unnamed_rows(db: sqlite3.Connection) -> Iterator[tuple[int, str]]:
    with contextlib.closing(db):
        for dev, rel in db.execute(
            "SELECT dev, rel FROM listed l WHERE NOT EXISTS"
            " (SELECT 1 FROM named n WHERE n.dev = l.dev AND n.rel = l.rel) ORDER BY l.rowid"
        ):
            yield dev, bytes(rel).decode("utf-8", "surrogateescape")


def run_beside(pool: ThreadPoolExecutor, calls: list[Callable[[], object]]) -> None:
    """Run the first call in this thread and the others on ``pool``; return once every one
    is over (so a caller may then close or remove what they use), raising the first error."""
    futs = [pool.submit(c) for c in calls[1:]]
    try:
        if calls:
            calls[0]()
    finally:
        wait_all(futs)


def wait_all(futs: list[Future[Any]]) -> None:
    """Wait for every future, through a KeyboardInterrupt that arrives meanwhile; then raise
    the interrupt, else the first error, if any.

    The callers close or remove what the futures use once this returns (a writer's files, a
    read's descriptors and buffer): a Ctrl-C that ended the wait for one future left it
    writing, and a put's file on another device was then made again after the put had
    removed its files, and left there."""
    first: BaseException | None = None
    interrupt: BaseException | None = None
    for f in futs:
        while True:
            try:
                f.result()
            except BaseException as e:
                if not f.done():  # the wait was interrupted, not the call: wait again
                    interrupt = interrupt or e
                    continue
                first = first or e
            break
    if interrupt is not None:
        raise interrupt
    if first is not None:
        raise first


class CorruptedFile(KvfsError, OSError):
    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def _pread_full(fd: int, buf: memoryview, off: int) -> int:
    """Read ``buf`` from ``off``; the bytes read, fewer only at the end of the file."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], off + done)
        if n == 0:
            return done
        done += n
    return done


def _pwritev_full(fd: int, bufs: list[memoryview], off: int) -> None:
    n = os.pwritev(fd, bufs, off)
    for b in bufs:  # a short write (rare): finish buffer by buffer
        if n < len(b):
            _pwrite_full(fd, b[n:], off + n)
        off += len(b)
        n = max(0, n - len(b))


def _pwrite_full(fd: int, buf: memoryview, off: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], off + done)


class BlobWriter:
    """Writes one blob's data files. Not visible to anyone until the index commits it.

    ``direct`` writers take whole aligned pieces (a put of a buffer); the others take writes
    of any size at any offset (the FUSE writer) through the page cache and fsync at the end.
    On any failure call :meth:`abort`, which removes every file this writer created.
    """

    def __init__(
        self, tier: LocalTier, start: int, *, direct: bool, nonce: str | None = None
    ) -> None:
        self.tier = tier
        self.start = start
        self.direct = direct
        # ``nonce`` names the files: another process may write them (a restore worker)
        # while this writer only knows their names, to remove them (abort)
        self.nonce = nonce or uuid.uuid4().hex
        self.rel = f"blobs/{self.nonce[:2]}/{self.nonce}"
        self._fds: dict[int, tuple[int, bool]] = {}
        # Headers not yet written, by device: a direct writer sends a file's header with the
        # data that follows it in one pwritev (one device write instead of two).
        self._headers: dict[int, memoryview] = {}
        self._lock = threading.Lock()
        self.size = 0
        self.new_dirs: list[str] = []  # set by finish()
        self._unkicked: dict[int, int] = {}

    def _fd(self, dev: int) -> tuple[int, bool]:
        with self._lock:
            if dev in self._fds:
                return self._fds[dev]
            path = self.tier.abspath(dev, self.rel)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            try:
                fd, direct = open_direct(path, flags, 0o640, direct=self.direct)
            except FileNotFoundError:  # the first file in this fan-out directory
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd, direct = open_direct(path, flags, 0o640, direct=self.direct)
            self._fds[dev] = (fd, direct)
            hdr = aligned_buffer(HEADER)
            meta = msgpack.packb(
                {
                    "v": 1,
                    "nonce": self.nonce,
                    "dev": dev,
                    "start": self.start,
                    "ndev": self.tier.n,
                    "unit": self.tier.unit,
                }
            )
            hdr[: len(MAGIC)] = MAGIC
            hdr[len(MAGIC) : len(MAGIC) + 2] = len(meta).to_bytes(2, "little")
            hdr[len(MAGIC) + 2 : len(MAGIC) + 2 + len(meta)] = meta
            if direct:
                self._headers[dev] = hdr
            else:
                _pwrite_full(fd, hdr, 0)
            return fd, direct

    def write(self, page_off: int, data: memoryview) -> None:
        """Write ``data`` at ``page_off``, split at stripe boundaries. Thread-safe per range."""
        unit = self.tier.unit
        pos = 0
        while pos < len(data):
            o = page_off + pos
            take = min(len(data) - pos, unit - o % unit)
            dev, foff = self.tier.locate(self.start, o)
            self._write_at(dev, foff, data[pos : pos + take])
            pos += take
        with self._lock:
            self.size = max(self.size, page_off + len(data))

    def _write_at(self, dev: int, foff: int, data: memoryview) -> None:
        try:
            fd, direct = self._fd(dev)
            if not direct:
                _pwrite_full(fd, data, foff)
                if self.tier.durable:
                    self._kick(dev, fd, len(data))
                return
            # Direct writers are given whole pieces starting at stripe-aligned offsets; the
            # last piece of a blob is padded with zeros to 4 KiB.
            head = len(data) - len(data) % ALIGN
            if head and is_aligned(data[:head]):
                hdr = self._take_header(dev) if foff == HEADER else None
                if hdr is not None:
                    _pwritev_full(fd, [hdr, data[:head]], 0)
                else:
                    _pwrite_full(fd, data[:head], foff)
                done = head
            else:
                done = 0
            b = self.tier.bounce.take() if done < len(data) else None
            try:
                while done < len(data):
                    assert b is not None
                    take = min(len(data) - done, len(b))
                    span = round_up(take)
                    b[:take] = data[done : done + take]
                    if span > take:
                        b[take:span] = bytes(span - take)
                    _pwrite_full(fd, b[:span], foff + done)
                    done += take
            finally:
                if b is not None:
                    self.tier.bounce.give(b)
        except OSError as e:
            self._raise_full(dev, e)

    def write_whole(self, data: memoryview) -> None:
        """Write a whole blob held in one buffer: one vectored write per device file (its
        header and every chunk it holds, in file order), the other devices' files on the
        tier's pool, this device's in the calling thread.

        One large write per file is what the raw baseline does; cutting the blob into
        stripe-unit writes on a pool instead costs a thread hop per piece and, on ext4,
        serialised extending O_DIRECT writes to the same inode (measured: 16 MiB in four
        parallel 4 MiB writes ~1.5x the time of one). Buffers that O_DIRECT cannot take
        (unaligned address, buffered writer) go piece by piece through :meth:`write`.
        """
        size = len(data)
        if not (self.direct and size and address_of(data) % ALIGN == 0):
            self._write_pieces(data)
            return
        unit, n = self.tier.unit, self.tier.n
        tail = size % ALIGN  # the last chunk's unaligned end goes through a bounce buffer
        body = size - tail
        spans: dict[int, list[memoryview]] = {}
        for c in range(-(-body // unit)):
            dev = (self.start + c) % n
            spans.setdefault(dev, []).append(data[c * unit : min(body, (c + 1) * unit)])
        run_beside(
            self.tier.pool, [functools.partial(self._write_spans, d, s) for d, s in spans.items()]
        )
        if tail:
            self.write(body, data[body:])
        with self._lock:
            self.size = max(self.size, size)

    def _write_spans(self, dev: int, spans: list[memoryview]) -> None:
        """One device file's header and chunks (aligned, contiguous in the file)."""
        try:
            fd, _direct = self._fd(dev)  # buffered where the filesystem refuses O_DIRECT
            hdr = self._take_header(dev)
            bufs = ([hdr] if hdr is not None else []) + spans
            off = 0 if hdr is not None else HEADER
            for i in range(0, len(bufs), _IOV_MAX):
                batch = bufs[i : i + _IOV_MAX]
                _pwritev_full(fd, batch, off)
                off += sum(len(b) for b in batch)
        except OSError as e:
            self._raise_full(dev, e)

    def _write_pieces(self, data: memoryview) -> None:
        piece = self.tier.piece
        run_beside(
            self.tier.pool,
            [
                functools.partial(self.write, o, data[o : o + piece])
                for o in range(0, max(1, len(data)), piece)
            ],
        )

    def truncate(self, size: int) -> None:
        """Cut each data file after the last byte it holds of page offsets below ``size``
        (a buffered writer's: the mount's file being written shrinks). Files read past
        their end as zeros, so bytes written past ``size`` later follow zeros, not what was
        cut. The files keep their headers."""
        assert not self.direct, "a direct writer takes whole blobs, never a truncate"
        unit, n = self.tier.unit, self.tier.n
        last = (size - 1) // unit  # the chunk holding the last byte kept (-1: none)
        first = self.tier.locate(self.start, 0)[0]  # (a zero-length blob's one file)
        with self._lock:
            fds = dict(self._fds)
        for dev, (fd, _direct) in fds.items():
            end = HEADER
            c = last - (last - (dev - self.start)) % n  # this file's last chunk up to it
            if c >= 0:
                end = self.tier.locate(self.start, c * unit)[1] + min(unit, size - c * unit)
            elif dev != first:
                # A file holding no chunk any more goes: the blob's extents would not name
                # it, so its header was counted nowhere (over the cap) and outlived the
                # page's delete. A later write past it makes it again.
                with self._lock:
                    del self._fds[dev]
                    self._headers.pop(dev, None)
                    self._unkicked.pop(dev, None)
                os.close(fd)
                try:
                    os.unlink(self.tier.abspath(dev, self.rel))
                except OSError as e:
                    if e.errno != errno.ENOENT:  # (gone already: what this wanted)
                        self._raise_full(dev, e)
                continue
            self._mapped(dev, os.ftruncate, fd, end)
        with self._lock:
            self.size = min(self.size, size)

    def _mapped(self, dev: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with a full device reported as CapacityExceeded."""
        try:
            return fn(*args)
        except OSError as e:
            self._raise_full(dev, e)

    def _raise_full(self, dev: int, e: OSError) -> NoReturn:
        """Raise ``e`` again, or DiskFull from it where it says the device is full: the
        one place every write path of this writer decides which of the two a caller gets
        (and where a disk's error counts against the device)."""
        self.tier.note_error(dev, e)
        if e.errno in (28, 122):  # ENOSPC, EDQUOT
            raise DiskFull(f"device {self.tier.roots[dev]} is full: {e.strerror}") from e
        raise e

    def _kick(self, dev: int, fd: int, n: int) -> None:
        """Start writing back a buffered file's dirty pages once KICK_BYTES accumulated."""
        with self._lock:
            due = self._unkicked.get(dev, 0) + n
            self._unkicked[dev] = 0 if due >= KICK_BYTES else due
        if due >= KICK_BYTES:
            _start_writeback(fd)

    def _take_header(self, dev: int) -> memoryview | None:
        with self._lock:
            return self._headers.pop(dev, None)

    def finish(self, size: int, *, sync_dirs: bool = True) -> tuple[tuple[Extent, ...], int]:
        """Make the files durable; return the blob's extents and its bytes on disk.

        ``sync_dirs=False`` leaves the fsync of the directories holding the new files to
        the caller (they are in ``self.new_dirs`` afterwards), which can then sync a
        directory once for many blobs before their index commit."""
        unit = self.tier.unit
        want: dict[int, int] = {}
        for c in range(-(-size // unit)):
            dev, foff = self.tier.locate(self.start, c * unit)
            want[dev] = max(want.get(dev, 0), foff + round_up(min(unit, size - c * unit)))
        # Every device holding a chunk gets its file, and a zero-length blob its first
        # device's header file, so the index has an extent: a buffered writer's writes may
        # have skipped a device (a file written past a hole: a pwrite past its end), whose
        # chunks are then zeros. (Without its file the commit failed, ENOENT.)
        for dev in want or [self.tier.locate(self.start, 0)[0]]:
            if dev not in self._fds:
                self._mapped(dev, self._fd, dev)
        for dev in list(self._fds):
            hdr = self._take_header(dev)  # no aligned write started at the data: alone
            if hdr is not None:
                self._mapped(dev, _pwrite_full, self._fds[dev][0], hdr, 0)
        # Buffered writers (the mount, filesystems without O_DIRECT) leave the last chunk
        # unpadded: pad it, so every file is exactly what disk_bytes() accounts for.
        for dev, (fd, _direct) in self._fds.items():
            if os.fstat(fd).st_size < want.get(dev, HEADER):
                self._mapped(dev, os.ftruncate, fd, want.get(dev, HEADER))
        if self.tier.durable:
            # fdatasync: the data, the block allocation and the size; not timestamps. (A
            # buffered file's delayed allocation can still fail here with ENOSPC.)
            run_beside(
                self.tier.pool,
                [
                    functools.partial(self._mapped, dev, os.fdatasync, fd)
                    for dev, (fd, _direct) in self._fds.items()
                ],
            )
        self.new_dirs = [os.path.dirname(self.tier.abspath(dev, self.rel)) for dev in self._fds]
        if self.tier.durable and sync_dirs:
            for d in self.new_dirs:
                fsync_dir(d)
        unit = self.tier.unit
        extents: list[Extent] = []
        for c in range(max(1, -(-size // unit))):
            dev, foff = self.tier.locate(self.start, c * unit)
            extents.append((dev, self.rel, foff, min(unit, size - c * unit)))
        self._close()
        return tuple(merge_extents(extents)), self.tier.disk_bytes(size)

    def _close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            os.close(fd)

    def has_file(self, dev: int) -> bool:
        """Whether this writer made its file on device ``dev`` yet (a write reached it)."""
        with self._lock:
            return dev in self._fds

    def files(self) -> list[str]:
        return [self.tier.abspath(dev, self.rel) for dev in self._fds]

    def abort(self) -> None:
        """Close and remove whatever this writer created. Never raises."""
        devs = list(self._fds)
        with contextlib.suppress(OSError):
            self._close()
        for dev in devs or range(self.tier.n):
            with contextlib.suppress(OSError):
                os.unlink(self.tier.abspath(dev, self.rel))


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages (does not wait for them; a hint
    only: durability still comes from the fdatasync in finish, which reports any error)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries durable: a file created, linked or renamed in it is
    still there after a crash once this returns (the file's own fsync does not cover its
    name). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
