"""The synchronous, thread-safe core of a store: index + striped local tier + policy.

Everything here blocks (disk, hashing, SQLite) and is meant to be called from worker
threads; :mod:`kvfs._store` wraps it for trio and the sync facade calls it directly.

:class:`Engine` owns the state: open and crash recovery, close, capacity reservation,
leases, counters and access times, page and session metadata. Its public methods are the
entry points; the work behind them lives beside it, one job a module:

* :mod:`kvfs._writes`: put, the commit that publishes a page, leaf hashing, ``PageWriter``;
* :mod:`kvfs._reads`: get, read_range, read_held, each leaf verified as it lands;
* :mod:`kvfs._maint`: delete, rename, evict, statistics, fsck.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import math
import numbers
import os
import sqlite3
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from . import _maint, _reads, _writes
from ._budget import waiting
from ._config import DISK_CAPACITY, StoreConfig
from ._dirs import DIRS_FILE, DirTable
from ._errors import (
    ArchiveUnavailable,
    CapacityExceeded,
    CorruptPage,
    DiskFull,
    IndexUnavailable,
    KvfsError,
    PageNotFound,
    SessionNotFound,
    StoreClosed,
    StoreLocked,
)
from ._events import log_event
from ._index import BlobRow, Index, PageRow, disk_failure, meta_value
from ._keys import PageKey, as_key, session_dir, session_name
from ._local import (
    DEVICE_MARKER,
    LocalTier,
    device_store,
    fsync_dir,
    is_disk_error,
    unnamed_files,
)
from ._lock import DirLock
from ._policy import AccessClock, TieringPolicy
from ._types import PageInfo, SessionInfo, StoreStatistics
from ._writes import RESERVE_WAIT_SECONDS, PageWriter, check_attrs

__all__ = ["Engine", "PageWriter"]

#: how long close() waits for calls in flight before it closes under them (then the index
#: is not marked clean, and the next open recounts as after a crash)
CLOSE_WAIT_SECONDS = 120.0
#: how long close() then waits for an upload job still reading deleted content's files
LEASE_WAIT_SECONDS = 30.0
ATIME_FLUSH_SECONDS = 5.0

log = logging.getLogger("kvfs.engine")
K = TypeVar("K")


#: A file beside the index that holds room for it. It is removed before the index opens, so
#: a store whose disk filled up (other writers, or a capacity set above the disk) still opens
#: and can delete pages; it is made again at the end of an open that has room to spare.
RESERVE = "kvfs-index.reserve"


def release_reserve(index_dir: Path) -> bool:
    """Remove the index's reserve file; True if there was one."""
    try:
        os.unlink(index_dir / RESERVE)
        return True
    except FileNotFoundError:
        return False


def keep_reserve(index_dir: Path) -> None:
    """Make the reserve (min(4 MiB, 1/16 of the free space), real blocks) when the disk has
    four times that free; otherwise leave it for a later open. Never raises."""
    path = index_dir / RESERVE
    try:
        st = os.statvfs(index_dir)
        free = st.f_bavail * st.f_frsize
        size = min(4 << 20, free // 16)
        if path.exists() or size < (64 << 10) or free < 4 * size:
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as e:
        log.debug("no index reserve in %s: %s", index_dir, e)
        with contextlib.suppress(OSError):
            path.unlink()


def is_new_store(cfg: StoreConfig) -> bool:
    """No store at ``cfg`` yet: no index, or an empty one (SQLite writes its header with the
    first commit, so an empty file is only ever what a failed create left). Raises
    IndexUnavailable when the index's disk answers an I/O error (see :func:`_open_error`)."""
    try:
        if cfg.index_path.stat().st_size > 0:
            return False
        return os.stat(f"{cfg.index_path}-wal").st_size == 0
    except FileNotFoundError:
        return True
    except OSError as e:  # (the CLI asks before it opens: a bare EIO was all it printed)
        bad = _index_disk_failed(e, cfg)
        if bad is None:
            raise
        raise bad from e


def _abs(p: Path) -> Path:
    return Path(os.path.abspath(p))  # (normalised, as Path.absolute() is not: a/../b)


def _created_paths(cfg: StoreConfig) -> builtins.list[Path]:
    """Every path the open of a new store may create, parents before children: the
    directories (and their missing parents), the index and its neighbours, each device's
    marker and fan-out directories. The lock file comes last: it is removed last."""
    out: builtins.list[Path] = []
    for d in dict.fromkeys([cfg.index_path.parent, *cfg.data_dirs]):
        out += [p for p in reversed(_abs(d).parents) if p not in out]
        out.append(_abs(d))
    index_dir = _abs(cfg.index_path.parent)
    for name in (cfg.index_path.name, DIRS_FILE):
        out += [index_dir / name, index_dir / f"{name}-wal", index_dir / f"{name}-shm"]
    out.append(index_dir / RESERVE)
    for d in cfg.data_dirs:
        root = _abs(d)
        out += [root / DEVICE_MARKER, root / (DEVICE_MARKER + ".tmp"), root / "blobs"]
        out += [root / "blobs" / f"{x:02x}" for x in range(256)]
    out.append(_abs(cfg.lock_path))
    return out


def _undo_create(made: builtins.list[Path], lock: DirLock) -> None:
    """Remove what a failed open of a new store made (``made``: the paths of
    :func:`_created_paths` that were not there before it), holding the lock until only the
    lock file's directory and its parents are left: an opener meanwhile gets StoreLocked,
    not a store half removed, and one after finds nothing of it to lose from under it.
    Files are unlinked; directories removed only when empty (never anything someone else
    put there). Never raises."""
    lock_file = _abs(lock.path)
    for p in made:
        if p != lock_file and not p.is_dir():
            with contextlib.suppress(OSError):
                p.unlink()
    # The directories too, all but the lock file's own and its parents, before the lock
    # file goes: an open that makes a new lock file once it is gone holds that lock at
    # once, and the directories it then makes (blobs/, its fan-out) were removed from
    # under it (FileNotFoundError, or its empty fan-out gone after its marker was written).
    holding = {lock_file.parent, *lock_file.parent.parents}
    _remove_dirs([d for d in made if d not in holding])
    if lock_file in made:
        with contextlib.suppress(OSError):
            lock_file.unlink()
    lock.release()
    _remove_dirs([d for d in made if d in holding])


def _remove_dirs(made: builtins.list[Path]) -> None:
    """rmdir the directories of ``made`` that are empty, children first. Never raises."""
    for d in reversed(made):
        if d.is_dir() and not d.is_symlink():
            with contextlib.suppress(OSError):
                d.rmdir()


# SQLite's result codes, which the sqlite3 module (its constants and the exceptions'
# sqlite_errorcode) names only from Python 3.11; on 3.10 the message is all there is.
_SQLITE_IOERR = 10
_SQLITE_FULL = 13


def _index_disk_failed(
    e: BaseException, cfg: StoreConfig, *, file: Path | None = None
) -> IndexUnavailable | None:
    """IndexUnavailable for an open that failed with ``e`` because the disk of the index's
    directory answered an I/O error: a disk's OSError (DISK_ERRORS) on the directory or a
    file in it (the lock file, the index, the reserve; ``file``: the one meant when the
    error names none), or SQLite's error on the index that :func:`disk_failure` finds the
    disk's. None for any other error."""
    index_dir = _abs(cfg.index_path.parent)
    if isinstance(e, sqlite3.DatabaseError):
        said, where = disk_failure(cfg.index_path, e), _abs(cfg.index_path)
    elif is_disk_error(e):
        named = getattr(e, "filename", None) or file
        if named is None:
            return None
        said, where = getattr(e, "strerror", None) or str(e), _abs(Path(named))
        if index_dir not in (where, where.parent):
            return None  # (a data directory's: the tier says which and what it means)
    else:
        return None
    if said is None:
        return None
    on = "itself" if where == index_dir else where.name
    return IndexUnavailable(
        f"cannot open the store in {cfg.data_dirs[0]}: the index's directory {index_dir} "
        f"answered an I/O error ({said}, on {on}; is its disk failing?). Nothing was created "
        "or changed; once the disk is back, the store opens as it was"
    )


def _open_error(
    e: Exception, cfg: StoreConfig, *, new: bool, file: Path | None = None
) -> Exception:
    """The error an open that failed with ``e`` raises: IndexUnavailable, saying so, when
    ``e`` is the index directory's disk failing (:func:`_index_disk_failed`; ``file``: the
    file ``e`` is about when it names none), where a bare EIO from the lock file was all a
    caller saw; DiskFull, saying so, when ``e`` is a disk too full for it (ENOSPC/EDQUOT,
    SQLite's SQLITE_FULL, or an I/O error of SQLite's where the index's disk has next to
    nothing free: growing its shared-memory file fails so, and SQLite keeps the errno to
    itself); ``e`` itself otherwise. Look before what the open made is removed (that frees
    the space)."""
    failing = _index_disk_failed(e, cfg, file=file)
    if failing is not None:
        return failing
    full = isinstance(e, CapacityExceeded) or (
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    )
    if isinstance(e, sqlite3.OperationalError):
        code = getattr(e, "sqlite_errorcode", None)
        full = code == _SQLITE_FULL or "disk is full" in str(e)
        ioerr = code & 0xFF == _SQLITE_IOERR if code is not None else "disk I/O error" in str(e)
        if ioerr:
            with contextlib.suppress(OSError):
                st = os.statvfs(cfg.index_path.parent)
                full = st.f_bavail * st.f_frsize < (1 << 20)
    if not full:
        return e
    what, left = ("create", "nothing was left behind") if new else ("open", "no page changed")
    return DiskFull(
        f"cannot {what} the store in {cfg.data_dirs[0]} (index in {cfg.index_path.parent}): "
        f"its disk is full ({e}); {left}. Free space there and try again"
    )


def _keep_newer(into: dict[K, float], times: dict[K, float]) -> None:
    """Merge access times ``times`` into ``into``, the later time of a key winning."""
    for k, t in times.items():
        into[k] = max(t, into.get(k, t))


def _pin_until(pinned: bool, ttl: float | None) -> float | None:
    """When a pin of ``ttl`` seconds made now ends (None: never)."""
    if ttl is None:
        return None
    if not pinned:
        raise ValueError("an unpin takes no ttl")
    # numbers.Real, not (int, float): numpy's np.int64(3) (a duration computed with numpy)
    # was refused as "not > 0" in-process, and pinned through the daemon
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real) or not 0 < ttl < math.inf:
        raise ValueError(f"a pin's ttl is a number of seconds > 0, not {ttl!r}")
    return time.time() + float(ttl)


def _open_index(cfg: StoreConfig) -> Index:
    try:
        return Index(cfg.index_path, durable=cfg.durable)
    except sqlite3.DatabaseError as e:
        if isinstance(e, sqlite3.OperationalError):  # locked, full...: not the file's fault
            raise
        if disk_failure(cfg.index_path, e) is not None:
            raise  # (SQLite's "malformed" for a read its disk failed: _open_error says so)
        raise KvfsError(
            f"the index {cfg.index_path} is unreadable ({e}); the store does not open on an "
            "index it cannot trust. Keep the file for inspection; to start over, move it (with "
            "its -wal and -shm files) and the data directories aside: sessions in the archive "
            "come back with `kvfs restore` (`kvfs ls --archived` lists them)"
        ) from e


def _refuse_foreign_data(cfg: StoreConfig) -> None:
    """No index yet, but a data directory already holds a store's data: the index was lost
    or moved, or the directories are out of order. Raises KvfsError, having created
    nothing."""
    for d in cfg.data_dirs:
        other = device_store(d)
        if other is not None:
            raise KvfsError(
                f"{d} holds data of store {other}, but there is no index at "
                f"{cfg.index_path}: was the index lost or moved, or are the data directories "
                "out of their original order? Point index_dir at the index, or move the data "
                "directories aside to start an empty store (sessions in the archive come back "
                "with `kvfs restore`)"
            )


def _devices_known(index: Index) -> int:
    """How many data directories this store has had (0 for a new index)."""
    return _device_count(index.get_meta)


def _device_count(meta: Callable[[str], object]) -> int:
    """The ``devices`` meta value; older stores that did not record it: the device count of
    their saved accounting."""
    n = meta("devices")
    if isinstance(n, int):
        return n
    saved = meta("accounting")
    if isinstance(saved, (list, tuple)) and len(saved) == 2:
        return len(saved[1])
    return 0


def devices_known(cfg: StoreConfig) -> int:
    """How many data directories the store at ``cfg`` has had, read without opening it (0
    when its index is missing or unreadable: opening it then says why)."""
    try:
        db = sqlite3.connect(f"file:{cfg.index_path}?mode=ro", uri=True)
    except sqlite3.Error:
        return 0
    try:
        rows = dict(db.execute("SELECT k, v FROM meta WHERE k IN ('devices', 'accounting')"))
    except sqlite3.Error:
        return 0
    finally:
        db.close()
    return _device_count(lambda k: meta_value(rows.get(k)))


def too_few_devices(cfg: StoreConfig, known: int | None = None) -> str | None:
    """What is wrong with ``cfg`` if it names fewer data directories than the store has
    (``known``; None: read from its index, :func:`devices_known`), else None."""
    known = devices_known(cfg) if known is None else known
    if len(cfg.data_dirs) >= known:
        return None
    return (
        f"the store in {cfg.data_dirs[0]} has {known} data directories, but only "
        f"{len(cfg.data_dirs)} configured: the pages striped over the others would be "
        "missing; configure all of them, in their original order"
    )


def headroom(free: int) -> int:
    """What the default capacity (0: the devices' free space at open) leaves free on a device
    for the index and its WAL (which must grow even to delete pages) and for other writers:
    1% of the free space, at least 64 MiB, at most a quarter of it."""
    return min(max(64 << 20, free // 100), free // 4)


class Engine:
    """Owns one store directory set. Open with :meth:`open`; close with :meth:`close`."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        archive_required: bool = True,
        archive_down: str | None = None,
    ) -> None:
        """Open the store at ``config`` (see :meth:`_open` for what an open recovers).

        ``archive_required=False`` is for inspecting the local tier while the archive is
        down (``kvfs fsck``, ``stats`` and ``ls`` offline): an archive that cannot be opened
        (ArchiveUnavailable) leaves the store open as one configured without an archive,
        and ``archive_error`` says why. Its archive-only pages read as missing, and a repair,
        spill or restore raises ArchiveUnavailable with that reason. Otherwise the open
        raises ArchiveUnavailable, and StoreLocked, KvfsError, DiskFull as always.

        ``archive_down`` (with ``archive_required=False`` only, else ValueError): why the
        archive could not be opened a moment ago (an earlier open's ``archive_error``). It
        is not tried again, so the open does not wait out the endpoint's ``open_deadline``
        once more (``kvfs stats --watch`` opens the store for each refresh); the store opens
        as if the archive had failed so, and ``archive_error`` is that reason.
        """
        if archive_down is not None and archive_required:
            raise ValueError("archive_down is for an open with archive_required=False")
        self.config = config
        self._closed = True
        self._archive_required = archive_required
        self._archive_down = archive_down
        #: why the archive configured could not be opened (``archive_required=False``)
        self.archive_error: str | None = None
        #: the process that opened the store: a forked child inherits this object, but not
        #: its threads, and must not share its SQLite connections, lock or files
        self._pid = os.getpid()
        for d in (*config.data_dirs, config.index_path.parent):
            if d.exists() and not d.is_dir():
                raise KvfsError(f"{d} is not a directory; data and index directories must be")
        # A store opened for the first time is made by this open, or not at all: a failed
        # create (a full disk) left an empty index that the next open took for a store.
        # What is there is looked at before the lock file is made; whether the store is new,
        # once the lock is held (a store another process made meanwhile is not new).
        made = [p for p in _created_paths(config) if not os.path.lexists(p)]
        self._lock = DirLock(config.lock_path)
        try:
            self._lock.acquire()
        except StoreLocked:
            raise
        except OSError as e:  # (no lock file: its directories, if it made them, go)
            _remove_dirs(made)
            raise _open_error(e, config, new=True, file=config.lock_path) from e
        new = False
        try:
            new = is_new_store(config)
            self._open()
        except BaseException as e:
            self._close_failed_open()
            err = _open_error(e, config, new=new) if isinstance(e, Exception) else None
            if new:  # (an empty index there before, left by an older kvfs, goes too)
                index = [Path(f"{_abs(config.index_path)}{x}") for x in ("", "-wal", "-shm")]
                _undo_create([*index, *(p for p in made if p not in index)], self._lock)
            else:
                # An existing store refused (another store's directory, one missing) is left
                # as it was: the index's reserve, removed for the open, is made again, and
                # the directory table (a store made before it existed) goes
                keep_reserve(config.index_path.parent)
                for p in made:
                    if p.name.startswith(DIRS_FILE):
                        with contextlib.suppress(OSError):
                            p.unlink()
                self._lock.release()
            if err is not None and err is not e:
                raise err from e
            raise

    def _close_failed_open(self) -> None:
        for db in (getattr(self, "index", None), getattr(self, "dirs", None)):
            if db is not None:
                with contextlib.suppress(Exception):  # closed already by some failure paths
                    db.close()
        for name in ("io_pool", "hash_pool", "_atime_pool"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=False)

    def _open(self) -> None:
        cfg = self.config
        if is_new_store(cfg):
            _refuse_foreign_data(cfg)  # before an index file is created beside them
        if release_reserve(cfg.index_path.parent):
            log.debug("index reserve released for the open")
        self.index = _open_index(cfg)
        #: the directories mkdir made on the mount (kept here: a session's delete removes them)
        self.dirs = DirTable(cfg.index_path.parent / DIRS_FILE)
        store_id = self.index.get_meta("store_id")
        known = 0 if store_id is None else _devices_known(self.index)
        if (why := too_few_devices(cfg, known)) is not None:
            raise KvfsError(why)
        for i, d in enumerate(cfg.data_dirs):
            if i < known and not (d / DEVICE_MARKER).exists():
                raise KvfsError(
                    f"{d} is device {i} of this store but holds no {DEVICE_MARKER}: is its "
                    "disk mounted? The store does not open without it (the pages striped "
                    "there would be missing); mount it, or keep the directories in their "
                    "original order"
                )
        if store_id is None:
            store_id = uuid.uuid4().hex
            # A store's identity, which the device markers name (always durable): lost at a
            # power cut while they stayed (durable=False), the next open made another, and
            # every open after refused the directories as another store's. So it is on disk,
            # the index file's name too, before prepare writes the markers.
            self.index.set_meta("store_id", store_id, durable=True)
            fsync_dir(cfg.index_path.parent)
        self.store_id: str = str(store_id)
        self.io_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvfs-io")
        self.hash_threads = max(2, os.cpu_count() or 2)
        self.hash_pool = ThreadPoolExecutor(self.hash_threads, thread_name_prefix="kvfs-hash")
        self._atime_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfs-atime")
        self.tier = LocalTier(
            cfg.data_dirs,
            cfg.stripe_unit,
            direct=cfg.direct_io,
            durable=cfg.durable,
            pool=self.io_pool,
            bounce_buffers=2 * cfg.io_threads,
        )
        self.tier.prepare(self.store_id)
        if len(cfg.data_dirs) > _devices_known(self.index):
            self.index.set_meta("devices", len(cfg.data_dirs))
        self.policy: TieringPolicy = TieringPolicy(self)
        self.index.on_changed = lambda db, sessions, freed: self.policy.queue_changes(
            db, sessions, freed
        )
        self._cap_lock = threading.Lock()
        self._cap_changed = threading.Condition(self._cap_lock)
        self._evict_lock = threading.Lock()
        self._leases: Counter[bytes] = Counter()
        # Blobs dropped while leased, by hash; a list: the same content can be dropped,
        # put again (new files) and dropped again while one lease is still held.
        self._deferred: dict[bytes, list[BlobRow]] = {}
        #: blobs whose local copy failed its checksum and stayed (see note_damaged)
        self._damaged: dict[bytes, tuple] = self._damaged_at_open()
        self._damaged_lock = threading.Lock()  # (their list in the index, kept in order)
        self._atimes: tuple[dict[str, float], dict[bytes, float], dict[str, float]] = ({}, {}, {})
        self._atime_flushed = time.monotonic()
        #: blob access times by burst, for eviction's order (a prefix goes tail first)
        self.clock = AccessClock()
        self._counters: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self.recovered_orphans: builtins.list[str] = []
        #: the mount serving this store, with its options (kvfs._mount.serve_mount)
        self.mounted: dict[str, object] | None = None
        clean = self.index.get_meta("clean", True) is not False
        if not clean:
            # (the accounting is recounted as the rows are read for the sweep: once)
            orphans: Iterable[tuple[int, str]] = unnamed_files(
                self.tier.all_files, self._recount_files
            )
            lost: set[tuple[int, str]] = set()
            if lost_pages := self.index.pages_without_blob():  # (a damaged index only)
                orphans = builtins.list(orphans)
                lost = _maint.lost_data_files(self.tier, lost_pages, orphans)
            self.recovered_orphans = self.tier.sweep(f for f in orphans if f not in lost)
            log.warning(
                "the store was not closed cleanly (a crash, a kill, a close under calls "
                "still running, or a disk that failed under the index): its accounting is "
                "recounted, and %d leftover data file(s) of writes never committed were "
                "removed",
                len(self.recovered_orphans),
            )
            if lost:
                # A damaged index: pages name data that no blob row holds, and these files
                # are that data (verified): kept for fsck --repair, which makes its rows.
                log.warning(
                    "the index is damaged: some pages name data no blob row holds; %d data "
                    "file(s) holding it were kept, not counted in the capacity until "
                    "kvfs fsck --repair makes their rows again",
                    len(lost),
                )
        # The accounting saved by the last clean close; recomputed from every blob row after
        # a crash (above) or from an older store: a clean restart reads no per-page state.
        saved = self.index.get_meta("accounting") if clean else None
        self.index.set_meta("clean", False)
        if isinstance(saved, (list, tuple)) and len(saved) == 2 and len(saved[1]) == self.tier.n:
            self.used, self.dev_used = int(saved[0]), [int(x) for x in saved[1]]
        elif clean:
            for _ in self._recount_files():  # (the count only: there is no sweep)
                pass
        self.reserved = 0
        #: callers of _reserve waiting for room: id -> (since, bytes they already hold)
        self._reserve_waiters: dict[int, tuple[float, int]] = {}
        self._waiter_ids = iter(range(1 << 62))
        #: streaming writers not yet committed or aborted (aborted at close)
        self._page_writers: weakref.WeakSet[PageWriter] = weakref.WeakSet()
        # A capacity given is the store's: kept, so that an open without one (an offline
        # `kvfs put` beside a daemon mounted with --capacity) keeps to it too. Without
        # either: the disks' free space (each file system counted once) less headroom.
        # DISK_CAPACITY asks for the disks' and forgets the one kept (0 is kept).
        saved = self.index.get_meta("capacity")
        free = self.tier.free_bytes_per_filesystem()
        if cfg.capacity > 0:
            if saved != cfg.capacity:
                self.index.set_meta("capacity", cfg.capacity)
            self.capacity = cfg.capacity
        elif cfg.capacity == 0 and isinstance(saved, int) and saved > 0:
            self.capacity = saved
        else:
            if saved and cfg.capacity == DISK_CAPACITY:
                self.index.set_meta("capacity", 0)
            self.capacity = self.used + sum(f - headroom(f) for f in free)
        room = self.used + sum(free)
        if self.capacity > room:  # (the disk then fills first: see "A full disk")
            log.warning(
                "the capacity (%d bytes) is more than the data directories can hold (%d "
                "bytes used and free): writes will find the disk full before the cap",
                self.capacity,
                room,
            )
        self._closed = False
        self._calls = 0  # API calls in flight (see _using): close() waits for them
        self._calls_done = threading.Condition()
        if cfg.archive_url and self._archive_down is not None:
            # (as below, when the open fails: nothing of the archive's is read or written)
            self.archive_error = self._archive_down
            log.info("opened without its archive, not tried again: %s", self._archive_down)
        elif cfg.archive_url:
            from ._archive import ArchivingPolicy  # imports objectstore/boto3 only when used

            try:
                self.policy = ArchivingPolicy(self)  # a failure: __init__ closes what is open
            except BaseException as e:
                if self._archive_required or not isinstance(e, ArchiveUnavailable):
                    if clean:
                        # Nothing was written yet: the index is left clean, as it was found
                        # (an archive unreachable at open made every later open recount the
                        # data, sweep for orphans, and warn of a crash that never happened).
                        with contextlib.suppress(Exception):
                            self.index.set_meta("accounting", [self.used, self.dev_used])
                            self.index.set_meta("clean", True)
                    raise
                # Open for inspection, as without an archive: the recovery above touched
                # local files only, and nothing of the archive's (its recorded identity, the
                # queue of its changes in the index) was read or written.
                self.archive_error = str(e)
                log.info("opened without its archive, which cannot be used: %s", e)
        elif self.index.has_archive_only():
            # (their reads fail as missing: say why once, where an operator looks)
            log.warning(
                "opened without an archive, but some pages are held only by the archive "
                "this store spilled to (%s): they read as missing until it is configured",
                self.index.get_meta("archive") or "unknown",
            )
        try:  # (pins that ended while the store was closed: their room is free again)
            if n := self.index.drop_stale_pin_ends():
                log.info("forgot the ends of %d pins no longer there (an older kvfs ran)", n)
            self._release_expired_pins()
        except Exception as e:  # a full disk: eviction and the periodic pass try again
            log.warning("pins whose lifetime ended are not released yet: %s", e)
        keep_reserve(cfg.index_path.parent)

    def _recount_files(self) -> Iterator[tuple[int, str]]:
        """Count the bytes on disk again from every local blob row (single-threaded: at
        open), yielding the (device, file)s those rows name on the way."""
        self.used, self.dev_used = 0, [0] * self.tier.n
        for b in self.index.local_blobs():
            self._account(b, +1)
            assert b.extents is not None
            yield from dict.fromkeys((e[0], e[1]) for e in b.extents)

    def _account(self, b: BlobRow, sign: int) -> None:
        """Track bytes on disk per device for a blob's local files (caller holds _cap_lock
        or is single-threaded)."""
        assert b.extents is not None
        self.used += sign * b.disk_bytes
        per: Counter[int] = Counter()
        for dev, _f, _o, length in b.extents:
            per[dev] += length
        # disk_bytes (header and alignment included) split by each device's share of the
        # data, the rounding left to the last: the devices' sum is exactly ``used``
        devs, total, left = sorted(per), sum(per.values()), b.disk_bytes
        for i, dev in enumerate(devs):
            n = left if i == len(devs) - 1 else b.disk_bytes * per[dev] // max(1, total)
            left -= n
            self.dev_used[dev] += sign * n

    # -- lifecycle --------------------------------------------------------------------
    @contextmanager
    def _using(self) -> Iterator[None]:
        """One API call: refused (StoreClosed) once close() began; close() waits for it."""
        with self._calls_done:
            self._check_open()
            self._calls += 1
        try:
            yield
        finally:
            with self._calls_done:
                self._calls -= 1
                if self._calls == 0:
                    self._calls_done.notify_all()

    def close(self) -> None:
        """Close the store (idempotent): wait for calls in flight, save the accounting,
        mark the index clean, close the index and release the lock. The connections, the
        files, the thread pools and the lock are let go whatever fails on the way; a disk
        that fails under the index (IndexUnavailable) is not raised, but logged with what
        could not be done (the next open recounts and sweeps, as after a crash)."""
        with self._calls_done:
            if self._closed:
                return
            self._closed = True
            if os.getpid() != self._pid:
                # A forked child unwinding its copy (a ``with`` block, an exit handler): the
                # index, the files, the lock and the worker threads are the parent's.
                return
            # Calls already running finish first: a put committing after the accounting
            # was saved would leave the next open a byte count too low, and the cap broken.
            settled = self._calls_done.wait_for(lambda: self._calls == 0, CLOSE_WAIT_SECONDS)
            if not settled:
                log.warning(
                    "closing with %d calls still running after %.0f s; the next open "
                    "recounts the data, as after a crash",
                    self._calls,
                    CLOSE_WAIT_SECONDS,
                )
        try:
            if settled:
                self._abort_writers()
            self._atime_pool.shutdown(wait=True)
            try:
                self.flush_atimes()
            except CapacityExceeded as e:
                # access times are hints: a full disk must not stop a close
                log.warning("access times not saved at close: %s", e)
            except IndexUnavailable as e:
                log.error("access times not saved at close: %s", e)
            try:
                self.policy.close()
            except IndexUnavailable as e:  # (the archive's queue is in the index)
                log.error("the archive's queued work not done at close: %s", e)
            self._wait_deferred(LEASE_WAIT_SECONDS if settled else 0.0)
            with self._cap_lock:
                deferred, self._deferred = self._deferred, {}
            kept = 0
            for blobs in deferred.values():
                for b in blobs:
                    # (a lease still held past the wait: its reader may still read the
                    # files, so they stay, swept as orphans by the next open, unclean)
                    if b.extents and not self._leases[b.hash]:
                        self.tier.unlink(b.extents)
                        with self._cap_lock:
                            self._account(b, -1)
                    elif b.extents:
                        kept += 1
            if kept:
                log.warning(
                    "closing: the files of %d deleted or evicted content(s) are still read; "
                    "the next open removes them (it recounts, as after a crash)",
                    kept,
                )
            self.io_pool.shutdown(wait=True)
            self.hash_pool.shutdown(wait=True)
            try:
                if settled and not kept and self.index.failed is None:
                    self.index.set_meta("accounting", [self.used, self.dev_used])
                    self.index.set_meta("clean", True)
            except CapacityExceeded as e:
                log.warning(
                    "closed without marking the index clean (the next open recounts, as "
                    "after a crash): %s",
                    e,
                )
            except IndexUnavailable:
                pass  # (index.failed says it, below)
            if self.index.failed is not None:
                # (a put whose commit the disk failed left its files for that open to sweep)
                log.error(
                    "closed without saving the accounting or marking the index clean (the "
                    "next open recounts and sweeps, as after a crash): the index %s failed "
                    "under the store, %s",
                    self.index.path,
                    self.index.failed,
                )
        finally:
            # Whatever failed above: the connections, the files and the lock are let go (an
            # index disk that failed was kept busy, and could not be unmounted)
            for pool in (self._atime_pool, self.io_pool, self.hash_pool):
                pool.shutdown(wait=False)
            self.index.close()
            self.dirs.close()
            self._lock.release()

    def _wait_deferred(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the leases on deleted or evicted content whose files
        wait for them (:meth:`_drop_files`) to end. Calls in flight are over by now; such a
        lease is an upload worker's job still reading the files, abandoned when another
        batch of its spill or eviction failed, and it ends with the job. Before, the close
        left those files behind and marked the index clean: orphans no open swept."""
        deadline = time.monotonic() + seconds
        while True:
            with self._cap_lock:
                held = any(self._leases[h] for h in self._deferred)
            if not held or time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _abort_writers(self) -> None:
        """Discard the streaming writes never committed or aborted (no call of theirs runs
        now): their files would outlive the close, outside the cap, and the next open,
        finding the index clean, would not look for them."""
        with self._cap_lock:
            left = [w for w in list(self._page_writers) if not w.closed]
        for w in left:
            w.abort()
        if left:
            log.warning("closing: %d page write(s) never committed were discarded", len(left))

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise StoreClosed(
                f"this store was opened by process {self._pid}; process {os.getpid()} is a "
                "fork of it and cannot use it (its threads did not survive the fork, and "
                "one process owns a data directory): open the store after forking, in the "
                "one process that uses it, and reach it from others through its mount"
            )
        if self._closed:
            raise StoreClosed("the store is closed")

    # -- capacity ---------------------------------------------------------------------
    def _reserve(self, n: int, own: int = 0, deadline: float | None = None) -> None:
        """Reserve ``n`` bytes under the cap, evicting by policy if needed.

        When nothing is evictable *now* but other writes are in flight, their reservations
        will soon either be released or become committed (evictable) pages: wait for that
        (until ``deadline``, a time.monotonic(); default RESERVE_WAIT_SECONDS from now)
        instead of failing a put another put's timing doomed. ``own`` is what the caller
        already holds (a growing streaming writer): it is not waited for, and nor is what
        callers that began waiting earlier hold: they may be waiting for this caller's room
        (two streaming writers each holding half the cap waited for each other until the
        deadline). The later one fails at once; the earlier gets the room once its writer
        gives up. Raises CapacityExceeded when the page cannot fit even then.
        """
        if deadline is None:
            deadline = time.monotonic() + RESERVE_WAIT_SECONDS
        me = next(self._waiter_ids)
        with contextlib.ExitStack() as stack:
            try:
                self._reserve_waiting(n, own, deadline, me, stack)
            finally:
                with self._cap_lock:
                    self._reserve_waiters.pop(me, None)

    def _reserve_waiting(
        self, n: int, own: int, deadline: float, me: int, stack: contextlib.ExitStack
    ) -> None:
        """:meth:`_reserve`'s loop; its first wait enters ``waiting()`` on ``stack`` (the
        mount's writer threads do not count a thread that waits for room others give)."""
        announced = False
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
                blocked = self.policy.room_blocked()
            if blocked is not None:  # (waiting would only try it again, as long)
                raise CapacityExceeded(
                    f"no room for {n} bytes: {self.used} of {self.capacity} bytes used, and "
                    f"nothing could be evicted to make it: {blocked}"
                )
            with self._cap_changed:
                if self.used + self.reserved + n <= self.capacity:
                    continue
                since = self._reserve_waiters.setdefault(me, (time.monotonic(), own))[0]
                older = sum(
                    held for w, (at, held) in self._reserve_waiters.items() if (at, w) < (since, me)
                )
                if self.reserved - own - older <= 0 or time.monotonic() > deadline:
                    # (others': this write's own room, counted in reserved, held nothing up)
                    mine = f" (and {own} by this write so far)" if own else ""
                    raise CapacityExceeded(
                        f"no room for {n} bytes: {self.used} of {self.capacity} bytes used, "
                        f"{self.reserved - own} reserved by other writes in flight{mine}, "
                        "and not enough left "
                        "that may be evicted to make it (the rest is pinned, leased or being "
                        "written; without an archive nothing is deleted for room that cannot "
                        "be made)"
                    )
                if not announced:
                    stack.enter_context(waiting())
                    announced = True
                self._cap_changed.wait(0.05)

    def _unreserve(self, n: int) -> None:
        with self._cap_changed:
            self.reserved -= n
            self._cap_changed.notify_all()

    # -- leases -----------------------------------------------------------------------
    def unlisted_copy(self, h: bytes) -> BlobRow | None:
        """A local copy of leased data that no index row names any more (deleted while a
        reader held it), waiting for its last lease to end; None if there is none."""
        with self._cap_lock:
            return next((b for b in self._deferred.get(h, ()) if b.local), None)

    def is_leased(self, h: bytes) -> bool:
        with self._cap_lock:
            return self._leases[h] > 0

    @contextmanager
    def lease(self, key: PageKey | str) -> Iterator[tuple[PageRow, BlobRow]]:
        """Hold a page's data in place: it is not evicted, and its files are not removed
        (even by delete) until the lease ends. A lease counts as a call in flight, so
        :meth:`close` waits for it: the fast path reads the files behind the store's back
        while it holds one (closed first, the store unlinked a deleted page's files under
        the read, and released its lock with the read still going). Raises PageNotFound,
        StoreClosed."""
        k = as_key(key)
        with self._using():
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
            for b in blobs:  # (out of _deferred, not yet unlinked: fsck must know)
                self.index.dropping(b)
        for b in blobs:
            self._drop_files(b)

    def _drop_files(self, b: BlobRow) -> None:
        """Unlink a blob's local files now, or when its last lease ends."""
        if b.extents is None:
            return
        with self._cap_lock:
            if self._leases[b.hash] > 0:
                self._deferred.setdefault(b.hash, []).append(b)
                self.index.dropped(b)
                return
            self._leases.pop(b.hash, None)
        self.tier.unlink(b.extents)
        self.index.dropped(b)
        with self._cap_lock:
            self._account(b, -1)

    # -- writes (kvfs/_writes.py) -----------------------------------------------------
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
        with self._using():
            return _writes.put(self, as_key(key), data, attrs=attrs, pin=pin, replace=replace)

    def begin_write(self, key: PageKey | str) -> PageWriter:
        """A streaming writer for a page whose size is not known up front (the FUSE mount)."""
        with self._using():
            k = as_key(key)
            w = PageWriter(self, k)
            with self._cap_lock:
                self._page_writers.add(w)
            return w

    # -- reads (kvfs/_reads.py) -------------------------------------------------------
    def get(self, key: PageKey | str, into: object | None = None) -> bytes | int:
        """Read a whole page. Returns bytes, or with ``into`` (a writable buffer at least the
        page's size) the number of bytes read into it. Raises PageNotFound, CorruptPage;
        TypeError or ValueError for an ``into`` that cannot take the page, before a page
        only the archive holds is restored."""
        with self._using():
            got = _reads.get(self, as_key(key), into)
            assert not isinstance(got, memoryview)  # (only with own=True)
            return got

    def read_page(
        self, key: PageKey | str, *, room: int | None = None, most: int | None = None
    ) -> bytes | memoryview | int:
        """Read a whole page into a page-aligned buffer of its own and return that, not a
        copy of it (a page larger than the few KiB ``get`` copies is held once: the
        daemon's answer to a remote get is sent from it). With ``room`` (the bytes a
        caller's buffer holds), a larger page raises ValueError before it is read, or
        restored from the archive. With ``most``, a page larger than that is not read: its
        size is returned (the daemon takes room for it, then reads). Raises PageNotFound,
        CorruptPage as ``get`` does."""
        with self._using():
            return _reads.get(self, as_key(key), None, room=room, own=True, most=most)

    def read_range(self, key: PageKey | str, offset: int, size: int) -> bytes:
        """Read ``size`` bytes at ``offset`` (short at the end), verifying the leaves touched."""
        with self._using():
            return _reads.read_range(self, as_key(key), offset, size)

    def read_held(
        self, page: PageRow, blob: BlobRow, offset: int, size: int, *, buffered: bool = False
    ) -> memoryview:
        """:meth:`read_range` for data held by :meth:`lease`: reads exactly the leased page even
        if its key has since been replaced or deleted (an open file on the mount). Returns a
        view of a fresh buffer (no extra copy), read on this thread: with O_DIRECT into heap
        memory (the mount's cached files: the kernel keeps the bytes in the mount's page
        cache, so a second copy in the data files' cache would be waste), or with
        ``buffered`` through the data files' page cache (a reader with no cache of its own:
        a ``direct_io`` file on the mount). Raises CorruptPage, PageNotFound (data gone from
        every tier)."""
        with self._using():
            return _reads.read_held(self, page, blob, offset, size, buffered=buffered)

    def set_page_attrs(self, key: PageKey | str, attrs: dict[str, str]) -> None:
        """Merge ``attrs`` into a page's attributes (the mount keeps file modes here).
        Raises PageNotFound, InvalidKey."""
        with self._using():
            k = as_key(key)
            if not self.index.update_page_attrs(k.path, check_attrs(attrs)):
                raise PageNotFound(f"no page {k.path!r}")

    # -- counters and access times ----------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._cap_lock:
            self._counters[name] += n

    def heal(self, blob: BlobRow, err: CorruptPage) -> BlobRow:
        """After ``err`` (``blob``'s local copy failed its checksum, or lost a file): the row
        to read again, its copy replaced from the archive. Raises ``err`` when there is no
        other copy, CorruptPage when the archive's cannot be brought back."""
        try:
            healed = self.policy.heal(blob, "corrupt")
        except KvfsError as e:
            self.note_damaged(blob)
            raise CorruptPage(f"{err}; its archived copy could not be brought back: {e}") from e
        if healed is None:
            self.note_damaged(blob)
            raise err
        return healed

    def note_damaged(self, blob: BlobRow) -> None:
        """``blob``'s local copy failed its checksum and stays: the next put of the same
        bytes replaces it with its own files instead of sharing it (a good put made
        unreadable, and deleted by fsck --repair). Kept in the index: a restart forgot it,
        and the next put of those bytes shared the damaged copy again."""
        if blob.extents is not None:
            with self._damaged_lock:
                with self._cap_lock:
                    if self._damaged.get(blob.hash) == blob.extents:
                        return
                    self._damaged[blob.hash] = blob.extents
                self._save_damaged()

    def replaced_damaged(self, row: BlobRow) -> None:
        """A put's files took the place of ``row``, the damaged copy :meth:`note_damaged`
        noted (in the put's commit): remove its files."""
        with self._damaged_lock:
            with self._cap_lock:
                if self._damaged.get(row.hash) == row.extents:
                    del self._damaged[row.hash]
            self._save_damaged()
        self._drop_files(row)
        log_event("heal", content=row.hash.hex()[:16], source="put", bytes=row.size)

    def _save_damaged(self) -> None:
        # each with its copy's files: the content alone marked any later copy of it damaged
        # at the next open (one put again after the damaged one was deleted, or restored
        # from the archive), and a put of those bytes then replaced that good copy
        # (under a key of its own: "damaged" keeps the contents alone, as a kvfs from
        # before reads them, which failed to open the index holding this list there)
        # ("damaged" first: an open reads each copy's files for the contents it names, and a
        # crash between the two left it naming a content alone, or not one it had dropped)
        with self._cap_lock:
            saved = sorted([h.hex(), [list(e) for e in ext]] for h, ext in self._damaged.items())
        self.index.set_meta("damaged", [hx for hx, _ in saved])
        self.index.set_meta("damaged_copies", saved)

    def _damaged_at_open(self) -> dict[bytes, tuple]:
        """The damaged copies noted before this open that the index still holds (the same
        files: a copy made since is another). A content saved alone (a kvfs before the
        files were saved) stands for its copy now.

        'damaged' says which contents: a kvfs from before keeps that list alone, and notes
        and drops contents in it, leaving 'damaged_copies' as it was (read alone, a content
        it had found damaged was forgotten, and a put of its bytes shared the damaged copy);
        'damaged_copies' says the files of each, where this kvfs noted them."""
        out: dict[bytes, tuple] = {}
        saved = self.index.get_meta("damaged")
        copies = self.index.get_meta("damaged_copies")
        files = {c[0]: c[1] for c in copies} if isinstance(copies, (list, tuple)) else {}
        for item in saved if isinstance(saved, (list, tuple)) else ():
            hx, ext = (item, files.get(item)) if isinstance(item, str) else (item[0], item[1])
            b = self.index.blob(bytes.fromhex(hx))
            if b is None or b.extents is None:
                continue
            if ext is None or b.extents == tuple(tuple(e) for e in ext):
                out[b.hash] = b.extents
        return out

    def note_read(self, page: PageRow, nbytes: int, *, restored: bool = False) -> None:
        """Count a verified read of ``page`` and note its access time. A read that had to
        restore its data first (``restored``) was counted as a miss already
        (:meth:`_restore`); the others are the hits. Hits are counted here, not taken as
        gets less misses: a read whose restore failed is a miss and no get, and took a hit
        away (a counter that went down)."""
        with self._cap_lock:
            self._counters["gets"] += 1
            self._counters["bytes_read"] += nbytes
            if not restored:
                self._counters["hits"] += 1
        self.touch(page)

    def corrupt_read(self, message: str) -> CorruptPage:
        """A read found corrupt or missing data: count it, log it (the mount answers only
        EIO, so the log is where an operator learns why), and return the error to raise."""
        self._count("corrupt_reads")
        log_event("error", level=logging.WARNING, what="read", error="CorruptPage", message=message)
        return CorruptPage(message)

    def touch(self, page: PageRow) -> None:
        """Note a read's access time; they reach the index in batches, written by a
        background thread so that no read waits for that commit and its fsync."""
        now = time.time()
        at = self.clock.stamp(page.session, now)
        with self._cap_lock:
            pa, ba, sa = self._atimes
            pa[page.path] = now
            ba[page.hash] = max(at, ba.get(page.hash, at))
            sa[page.session] = now
            due = time.monotonic() - self._atime_flushed > ATIME_FLUSH_SECONDS
            if due:
                self._atime_flushed = time.monotonic()  # one flush submitted, not one a read
        if due:
            with contextlib.suppress(RuntimeError):  # closing: close() flushes the rest
                self._atime_pool.submit(self._flush_atimes_logged)

    def _flush_atimes_logged(self) -> None:
        try:
            self.flush_atimes()
        except Exception as e:  # access times only order eviction: never fail a read for them
            log.warning("access times not written this time: %s", e)

    def flush_atimes(self) -> None:
        """Write the access times reads noted since the last flush. When the write fails (a
        full disk), the batch is noted again for the next flush, beside those noted
        meanwhile (the later time of a key wins, as in the index): else eviction ordered
        those pages by older times, as if never read since. Raises what the index raised."""
        with self._cap_lock:
            batch, self._atimes = self._atimes, ({}, {}, {})
            self._atime_flushed = time.monotonic()
        try:
            self.index.flush_atimes(*batch)
        except BaseException:
            with self._cap_lock:
                pa, ba, sa = self._atimes
                _keep_newer(pa, batch[0])
                _keep_newer(ba, batch[1])
                _keep_newer(sa, batch[2])
            raise

    # -- metadata (views built in kvfs/_reads.py) -------------------------------------
    def stat(self, key: PageKey | str) -> PageInfo:
        with self._using():
            return _reads.stat(self, as_key(key))

    def exists(self, key: PageKey | str) -> bool:
        with self._using():
            return self.index.page(as_key(key).path) is not None

    def list(
        self,
        *,
        session: str | None = None,
        prefix: str | None = None,
        path_prefix: str | None = None,
    ) -> builtins.list[PageInfo]:
        """Pages of a session (optionally of one prefix of it), or under a path prefix."""
        with self._using():
            return _reads.list_pages(self, session, prefix, path_prefix)

    def sample_pages(self, session_dir: str, n: int) -> builtins.list[PageRow]:
        """The first ``n`` pages of a session directory, in path order, without listing
        it all (what an integration reads to tell which model a session belongs to)."""
        with self._using():
            return self.index.pages(session=session_dir, limit=n)

    def sessions(self) -> builtins.list[SessionInfo]:
        """Every session held. One deleted while the list is made is left out (its row
        went between the listing and the reading of its figures)."""
        with self._using():
            out = []
            for s in self.index.sessions():
                try:
                    out.append(_reads.session_info(self, s.dir))
                except SessionNotFound:
                    continue
            return out

    def session_info(self, session: str) -> SessionInfo:
        with self._using():
            return _reads.session_info(self, self.resolve_session(session))

    def resolve_session(self, session: str) -> str:
        """The directory a session name means. ``agent-42`` is the semantic session
        ``sessions/agent-42``; when no such session exists here but a top-level engine
        directory ``agent-42`` does (what ``ls`` shows for it), the name means that
        directory. ``agent-42/`` (or any name with a '/') is always the directory."""
        d = session_dir(session)
        if (
            d != session
            and "/" not in session
            and self.index.session(d) is None
            and self.index.session(session) is not None
        ):
            return session
        return d

    def set_session_attrs(self, session: str, attrs: dict[str, str]) -> None:
        """Merge attributes into an existing session's. Raises SessionNotFound (a typo
        made an empty session that then listed)."""
        with self._using():
            d = self._existing_session(session)
            self.index.set_session_attrs(d, check_attrs(attrs, page=False))

    def _existing_session(self, session: str) -> str:
        d = self.resolve_session(session)
        if self.index.session(d) is None:
            raise SessionNotFound(f"no session {session_name(d)!r}")
        return d

    # -- delete, evict (kvfs/_maint.py) -----------------------------------------------
    def delete(self, key: PageKey | str) -> None:
        """Remove a page. Its data goes with its last reference. Raises PageNotFound."""
        with self._using():
            _maint.delete(self, as_key(key))

    def delete_session(self, session: str) -> int:
        """Remove every page of a session and the session itself; returns pages removed."""
        with self._using():
            return _maint.delete_session(self, session)

    def expire_session(self, d: str, untouched_since: float) -> int | None:
        """Retention: remove an unpinned session (directory ``d``) last touched before
        ``untouched_since`` from every tier; None when it was touched or pinned meanwhile."""
        with self._using():
            return _maint.expire_session(self, d, untouched_since)

    def delete_blob_pages(self, blob: BlobRow, reason: str) -> int:
        """Evict by deletion (no archive): every page sharing this data goes, unless one of
        them is pinned by now. Returns bytes freed."""
        return _maint.delete_blob_pages(self, blob, reason)

    def delete_evicted_pages(self, pages: builtins.list[PageRow], reason: str) -> int:
        """Evict by deletion (no archive), by name: these pages go, data another page
        shares stays. Returns bytes freed."""
        return _maint.delete_evicted_pages(self, pages, reason)

    def rename(self, src: PageKey | str, dst: PageKey | str) -> None:
        """Move a page to a new key, atomically replacing any page there."""
        with self._using():
            _maint.rename(self, as_key(src), as_key(dst))

    # -- pin --------------------------------------------------------------------------
    def pin(self, key: PageKey | str, pinned: bool = True, *, ttl: float | None = None) -> None:
        """Pin a page (for ``ttl`` seconds, else until it is unpinned), or unpin it. Pinning
        again replaces the pin's lifetime: without ``ttl`` the pin is for good, with one it
        ends then, whatever it was. Raises PageNotFound, ValueError (a ``ttl`` not > 0)."""
        with self._using():
            k = as_key(key)
            if not self.index.set_page_pinned(k.path, pinned, _pin_until(pinned, ttl)):
                raise PageNotFound(f"no page {k.path!r}")

    def pin_session(self, session: str, pinned: bool = True, *, ttl: float | None = None) -> None:
        """Pin a session (it may have no pages yet: pinning reserves its place), for ``ttl``
        seconds as :meth:`pin` a page, or unpin one (SessionNotFound when there is none: a
        typo made an empty session)."""
        with self._using():
            until = _pin_until(pinned, ttl)
            d = self.resolve_session(session) if pinned else self._existing_session(session)
            self.index.set_session_pinned(d, pinned, until)

    def release_expired_pins(self, now: float | None = None) -> int:
        """Unpin the pages and sessions whose pin's lifetime has ended by ``now`` (default:
        the time now), as an unpin would. Returns how many were released. Done before
        eviction looks for candidates, periodically in a running store, and at open."""
        with self._using():
            return self._release_expired_pins(now)

    def _release_expired_pins(self, now: float | None = None) -> int:
        """:meth:`release_expired_pins` inside a call already counted (a put making room)."""
        released = self.index.release_expired_pins(time.time() if now is None else now)
        for target, kind in released:
            log_event("unpin", kind=kind, target=target, reason="expired")
        return len(released)

    # -- eviction ---------------------------------------------------------------------
    def evict(
        self,
        target: PageKey | str | None = None,
        *,
        session: str | None = None,
        reason: str = "manual",
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Drop local copies of one page or a whole session by policy. Returns bytes freed.

        Pinned and leased data is skipped. Without an archive tier this deletes the pages
        (theirs only: data that a page of another session shares stays, and is not freed).
        With one, what it lacks is uploaded first: ``progress(page bytes archived, page bytes
        to archive)`` as uploads finish (not called when nothing needs uploading); raises
        ArchiveUnavailable when the archive cannot take it (then nothing was dropped).
        """
        with self._using():
            return _maint.evict(self, target, session, reason, progress)

    # -- archive tier (kvfs/_archive.py) ---------------------------------------------
    def _archive(self):  # type: ignore[no-untyped-def]  # -> ArchivingPolicy
        from ._archive import ArchivingPolicy

        self._check_open()
        if self.archive_error is not None:  # (configured, and could not be opened)
            raise ArchiveUnavailable(self.archive_error)
        if not isinstance(self.policy, ArchivingPolicy):
            raise ArchiveUnavailable("no archive tier is configured (set archive_url)")
        return self.policy

    def spill(self, session: str, *, progress: Callable[[int, int], None] | None = None) -> int:
        """Upload the session's pages the archive lacks plus its manifest, then drop local
        copies (pinned sessions too: this is the explicit request); ``progress(page bytes
        archived, page bytes to archive)`` as uploads finish. Returns bytes uploaded.
        Raises SessionNotFound, ArchiveUnavailable (then nothing local was dropped)."""
        with self._using():
            d = self.resolve_session(session)  # (a bad name is InvalidKey, archive or not)
            return int(self._archive().spill(d, progress))

    def restore(self, session: str, *, progress: Callable[[int, int], None] | None = None) -> int:
        """Bring a session back: import its manifest's pages this store lacks (from any host
        sharing the archive) and prefetch every page (those already known start while the
        manifest is fetched); ``progress(bytes done, bytes to restore)`` as they come.
        Returns bytes restored. Raises SessionNotFound, ArchiveUnavailable, CorruptPage
        (after every page was tried)."""
        with self._using():
            d = self.resolve_session(session)
            archive = self._archive()
            try:
                return int(archive.restore_session(d, progress))
            except SessionNotFound:
                if d == session or "/" in session:
                    raise
            # Neither here nor in the archive as a semantic session: a top-level engine
            # directory of that name, archived by this host or another one sharing the bucket.
            return int(archive.restore_session(session, progress))

    def archived_sessions(self) -> builtins.list[dict[str, object]]:
        """Sessions that have a manifest in the archive, from every host sharing it."""
        with self._using():
            return list(self._archive().archived_sessions())

    def archive_hosts(self) -> builtins.list[dict[str, object]]:
        """The hosts sharing the archive (heartbeats and manifests): see kvfs/_hosts.py."""
        with self._using():
            return list(self._archive().archive_hosts())

    def _restore(self, blob: BlobRow, page: PageRow) -> BlobRow | bytes:
        """Bring one page's data back from the archive for a read (counted as a miss): its
        local copy's row, or, when the local tier has no room for it, its verified bytes
        held in memory (the archive's ``memory_copies``)."""
        with self._cap_lock:
            self._counters["misses"] += 1
        held = self.policy.memory_copy(blob.hash)
        if held is not None:
            return held
        t0 = time.monotonic()
        try:
            b = self.policy.restore_blob(blob)
            # a read that waited for the archive: a line each (a session's restore is one
            # line for all its pages; the per-content lines are DEBUG)
            log_event(
                "restore",
                target=page.path,
                reason="read",
                bytes=blob.size,
                seconds=time.monotonic() - t0,
            )
        except CapacityExceeded as e:
            return self.policy.copy_in_memory(blob, e)
        except OSError as e:  # (a disk's error writing the copy: served from memory)
            return self.read_around(blob, page, e)
        if not b.local:
            raise PageNotFound(f"page {page.path!r} could not be restored")
        return b

    def read_around(self, blob: BlobRow, page: PageRow, err: OSError) -> bytes:
        """``blob``'s data when its local copy cannot be read (or written) for a disk's
        error ``err`` (EIO...): the archive's copy, verified and held in memory as for want
        of room (the archive's ``memory_copies``). Raises ``err`` for any other error, and
        when the archive holds no copy or cannot give it (why is logged)."""
        if not is_disk_error(err) or not blob.archived:
            raise err
        try:
            return self.policy.copy_in_memory(blob, err, reason="disk error")
        except KvfsError as e:
            log.warning("page %r: its archived copy could not be read either: %s", page.path, e)
            raise err from e

    # -- statistics, verification (kvfs/_maint.py) -----------------------------------
    def statistics(self) -> StoreStatistics:
        with self._using():
            return _maint.statistics(self)

    def fsck(
        self,
        *,
        repair: bool = False,
        verify_data: bool = True,
        progress: object = None,
        archive: bool = False,
    ) -> dict[str, builtins.list[str]]:
        """Check the index against the files and its rows against each other: missing
        files, bad checksums, orphans, pages whose blob row is gone, blob rows whose size
        or digests are wrong, reference counts, page sizes. With ``repair``, orphans are
        removed, rows are mended (a lost blob row made again from its files or the
        archive's copy), damaged local copies of archived data are restored from the
        archive, and pages whose data is held nowhere else are deleted (they cannot be
        served), except pinned ones: kept, and listed as ``unrecoverable``. With
        ``archive``, also download and verify the archive object of everything archived
        (see ArchivingPolicy.check_archive). ``verify_data=False`` reads no data: a file
        missing, or shorter than its extents, is still found, a changed byte is not.
        Returns findings by kind
        (:data:`kvfs._maint.FSCK_FINDINGS`). Opened without the archive it could not open
        (``archive_error``), the check is local and says so in ``archive_error``, and a
        repair raises ArchiveUnavailable, changing nothing: it could delete the pages of
        damaged local copies that the archive holds good copies of."""
        if repair and self.archive_error is not None:
            raise ArchiveUnavailable(
                f"{self.archive_error} (fsck --repair needs the archive: nothing was changed)"
            )
        with self._using():
            return _maint.fsck(
                self, repair=repair, verify_data=verify_data, progress=progress, archive=archive
            )
