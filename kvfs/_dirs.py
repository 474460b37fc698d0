"""Explicit directories: the ones ``mkdir`` made on the mount (or that ``chmod`` gave a mode),
kept so an empty directory survives a remount. Directories that hold pages exist without a
row here (see :mod:`kvfs._fuse_ns`).

The engine owns the table, beside the index, so deleting a semantic session removes the
directories made in it whoever deletes it: the mount, ``kvfs rm`` through the daemon,
retention, or a store opened offline.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ._index import unavailable

__all__ = ["DIRS_FILE", "DirRow", "DirTable"]

#: the table's file, in the index's directory
DIRS_FILE = "kvfs-dirs.sqlite3"


@dataclass(frozen=True, slots=True)
class DirRow:
    path: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int


class DirTable:
    """Explicit directories (made by mkdir or chmod'ed): a small SQLite table beside the index,
    mirrored in memory. Thread-safe. A crash loses nothing committed; the table holds no data."""

    def __init__(self, path: Path) -> None:
        #: guards the in-memory rows, which the FUSE loop reads: never held across a commit
        self._lock = threading.Lock()
        #: serialises the commits (each an fsync), in threads
        self._write = threading.Lock()
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS dirs (path TEXT PRIMARY KEY, mode INTEGER,"
                " uid INTEGER, gid INTEGER, mtime_ns INTEGER)"
            )
            self._rows = {
                r[0]: DirRow(*r)
                for r in self._db.execute("SELECT path, mode, uid, gid, mtime_ns FROM dirs")
            }
        except BaseException:  # (a failed open leaves no connection behind; see Index)
            self._db.close()
            raise

    def get(self, path: str) -> DirRow | None:
        with self._lock:
            return self._rows.get(path)

    def has_under(self, path: str) -> bool:
        pre = path + "/"
        with self._lock:
            return any(p.startswith(pre) for p in self._rows)

    def children(self, path: str) -> list[str]:
        pre = path + "/" if path else ""
        with self._lock:
            return [
                p[len(pre) :]
                for p in self._rows
                if p != path and p.startswith(pre) and "/" not in p[len(pre) :]
            ]

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One commit, under the write lock; a disk that fails it raises IndexUnavailable
        (this table is beside the index, on its disk), with nothing changed."""
        with self._write:
            try:
                yield
            except sqlite3.DatabaseError as e:
                bad = unavailable(self.path, e)
                if bad is None:
                    raise
                raise bad from e

    def put(self, row: DirRow) -> None:
        with self._writing():
            self._db.execute(
                "INSERT OR REPLACE INTO dirs VALUES (?,?,?,?,?)",
                (row.path, row.mode, row.uid, row.gid, row.mtime_ns),
            )
            with self._lock:
                self._rows[row.path] = row

    def tree(self, path: str) -> list[str]:
        """``path`` (when it has a row) and every directory below it."""
        pre = path + "/"
        with self._lock:
            return [p for p in self._rows if p == path or p.startswith(pre)]

    def remove_many(self, paths: list[str]) -> None:
        """Remove the rows of ``paths``, in one commit."""
        if not paths:
            return
        with self._writing():
            self._db.execute("BEGIN")
            try:
                self._db.executemany("DELETE FROM dirs WHERE path=?", [(p,) for p in paths])
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # (a failed COMMIT may have rolled back)
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
            with self._lock:
                for p in paths:
                    self._rows.pop(p, None)

    def remove(self, path: str) -> None:
        with self._writing():
            self._db.execute("DELETE FROM dirs WHERE path=?", (path,))
            with self._lock:
                self._rows.pop(path, None)

    def close(self) -> None:
        """Close the table's connection; never raises for its disk (a failing one)."""
        with self._write, self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()
