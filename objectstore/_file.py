"""``file://DIR``: an object store in a local (or shared network) directory.

Each object is a file at ``DIR/<key>``. A put writes a temporary file under
``DIR/.objectstore-tmp/``, fsyncs it, then publishes it with ``rename`` (replace) or
``link`` (conditional create: fails atomically if the key exists) and fsyncs the directory.
A crash leaves at most a temporary file, which the store never lists and removes at open.
As a key's components are directories here, a key and another beginning with it and a
``/`` (``a`` and ``a/b``), which S3 holds both, cannot both be stored: the second put
raises ValueError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import trio

from kvfs._errors import ArchiveAccessDenied, ArchiveUnavailable
from kvfs._local import fsync_dir

from ._abc import ObjectNotFound, ObjectStore, archive_threads, check_key
from ._retry import Backoff, retry

__all__ = ["FileStore"]

TMP = ".objectstore-tmp"
#: A temporary file older than this at an open is a crashed put's: removed. A younger one
#: may be another process's put in flight (an archive directory shared by several hosts).
TMP_STALE_SECONDS = 3600.0
#: tries at making a key's directory and linking into it while deletes remove it again
_MKDIR_TRIES = 8
T = TypeVar("T")
_TEMPORARY = {errno.EAGAIN, errno.EINTR, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY}


def _is_temporary(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in _TEMPORARY


class FileStore(ObjectStore):
    """Objects as files under one directory. Open with :meth:`open`."""

    def __init__(self, root: Path, *, backoff: Backoff | None = None, durable: bool = True) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.backoff = backoff or Backoff(deadline=10.0)
        self.durable = durable

    @classmethod
    async def open(
        cls, root: str | Path, *, create: bool = True, sweep: bool = True, **kw: object
    ) -> FileStore:
        """Open (creating with ``create``) the directory and, with ``sweep``, remove the
        temporary files of puts a crash cut short (not where the directory is read-only
        to this process: they stay, and it opens). Another process that writes to the same
        directory at that moment loses its in-flight put, so a process that opens a store
        its parent has opened (kvfs's upload workers) passes ``sweep=False``. Raises
        ArchiveUnavailable."""
        self = cls(Path(root), **kw)  # type: ignore[arg-type]

        def prepare() -> None:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            if not self.root.is_dir():
                raise FileNotFoundError(
                    errno.ENOENT, "archive directory does not exist", str(self.root)
                )
            # (its temporary directory is made by the first put: an open that is refused
            # later, a kvfs store finding this is not its archive, leaves nothing here)
            if sweep:
                try:
                    self._sweep(TMP_STALE_SECONDS)
                except OSError as e:
                    # A read-only archive (a share mounted so) opened unless a crash had
                    # left a temporary file there: its removal waits for a sweep by a host
                    # that may write; reads need none.
                    if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                        raise

        await self._call(prepare, "open")
        return self

    def _sweep(self, older_than: float) -> int:
        """Remove the temporary files of puts a crash interrupted, and not those of another
        host's put in flight (a file:// archive on a shared file system): theirs are
        younger. Ages are by the file system's clock (a file's mtime against a file made
        now), not this host's."""
        tmp = self.root / TMP
        if not tmp.is_dir():
            return 0
        probe = tmp / f"now-{uuid.uuid4().hex}"
        try:
            probe.touch()
            now = probe.lstat().st_mtime
        except OSError:
            now = time.time()  # (a read-only archive: nothing could be removed anyway)
        finally:
            probe.unlink(missing_ok=True)
        gone = 0
        for f in tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if f.lstat().st_mtime < now - older_than:
                    f.unlink()
                    gone += 1
        return gone

    async def abort_stale_uploads(self, older_than: float, prefix: str = "") -> int:
        return await self._call(lambda: self._sweep(older_than), "sweep temporary files")

    def _check_root(self) -> None:
        """Called on a miss: a missing object in a missing archive directory (unmounted,
        deleted) is the archive being unavailable, not the object being absent."""
        if not self.root.is_dir():
            raise ArchiveUnavailable(f"archive directory {self.root} does not exist (any more)")

    def _path(self, key: str, *, writing: bool = False) -> Path:
        check_key(key)
        if writing and any(len(os.fsencode(p)) > 255 for p in key.split("/")):
            raise ValueError(
                f"object key {key[:60]!r}... has a component over 255 bytes, longer than a "
                "file name in a file:// archive"
            )
        if key.split("/", 1)[0] == TMP:
            raise ValueError(f"object key {key!r} uses the reserved name {TMP!r}")
        return self.root / key

    async def _call(self, fn: Callable[[], T], what: str) -> T:
        async def attempt() -> T:
            return await trio.to_thread.run_sync(fn, limiter=archive_threads())

        try:
            return await retry(
                attempt,
                is_temporary=_is_temporary,
                backoff=self.backoff,
                what=f"{what} on {self.url}",
            )
        except (ObjectNotFound, ArchiveUnavailable, ValueError):
            raise
        except PermissionError as e:  # (EACCES, EPERM) the archive answered: no outage
            raise ArchiveAccessDenied(
                f"{what} on {self.url}: access denied ({e.strerror or e}): check the "
                f"permissions of {e.filename or self.root}"
            ) from e
        except OSError as e:
            raise ArchiveUnavailable(f"{what} on {self.url} failed: {e.strerror or e}") from e

    async def get(self, key: str, *, into: memoryview | bytearray | None = None) -> bytes | int:
        path = self._path(key)

        def read() -> bytes | int:
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed below
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                self._check_root()
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:  # too long to be a file: never stored
                    raise
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            with f:
                if into is None:
                    return f.read()
                size = os.fstat(f.fileno()).st_size
                dest = memoryview(into).cast("B")
                if len(dest) < size:
                    raise ValueError(
                        f"buffer of {len(dest)} bytes is smaller than object {key!r} ({size} bytes)"
                    )
                done = 0
                while done < size:
                    n = f.readinto(dest[done:size])
                    if not n:
                        break
                    done += n
                return done

        return await self._call(read, f"get {key}")

    async def put(
        self, key: str, data: bytes | memoryview, *, if_absent: bool = False, cold: bool = False
    ) -> bool:
        path = self._path(key, writing=True)

        def begins_others() -> ValueError:
            return ValueError(
                f"object key {key!r} and a key beginning with {key + '/'!r} (or one that "
                f"{key!r} begins) cannot both be stored in a file:// archive, where one of "
                "them is a directory"
            )

        def publish(tmp: Path) -> bool:
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    # (a directory there is no object: "already stored" lost the data)
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        raise begins_others() from None
                    return False
            else:
                try:
                    os.replace(tmp, path)
                except IsADirectoryError:
                    raise begins_others() from None
            return True

        def write() -> bool:
            tmp = self.root / TMP / uuid.uuid4().hex
            try:
                try:
                    f = open(tmp, "wb")  # noqa: SIM115 - closed below
                except FileNotFoundError:
                    self._check_root()
                    tmp.parent.mkdir(exist_ok=True)
                    f = open(tmp, "wb")  # noqa: SIM115
                with f:
                    f.write(data)
                    f.flush()
                    if self.durable:
                        os.fsync(f.fileno())
                # A concurrent delete removes the directories it leaves empty (``delete``):
                # the key's directory may vanish between making it and linking into it.
                for attempt in range(_MKDIR_TRIES):
                    try:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        stored = publish(tmp)
                        break
                    except NotADirectoryError:  # (an object's file above the key's directory)
                        raise begins_others() from None
                    except (FileNotFoundError, FileExistsError):
                        if path.parent.is_file():
                            raise begins_others() from None
                        if attempt == _MKDIR_TRIES - 1:
                            raise
                if self.durable:
                    fsync_dir(path.parent)
                return stored
            finally:
                tmp.unlink(missing_ok=True)

        return await self._call(write, f"put {key}")

    async def exists(self, key: str) -> bool:
        return await self.modified(key) is not None

    async def modified(self, key: str) -> float | None:
        path = self._path(key)

        def mtime() -> float | None:
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                self._check_root()
                return None
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:
                    raise
                return None
            return st.st_mtime if stat.S_ISREG(st.st_mode) else None

        return await self._call(mtime, f"stat {key}")

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def rm() -> None:
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                self._check_root()
                return
            except IsADirectoryError:  # (the start of other keys, ``d`` of ``d/x``: no object)
                return
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:
                    raise
                return
            # Drop directories the delete left empty (never the root).
            parent = path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

        await self._call(rm, f"delete {key}")

    async def list(self, prefix: str = "") -> AsyncIterator[str]:  # type: ignore[override]
        def failed(e: OSError) -> None:
            # A directory gone meanwhile (a delete removes those it empties), or a prefix
            # naming an object's file, held no key. Skipping any other error (EACCES, EIO),
            # as os.walk does by default, made the listing silently short: a collection
            # that read no manifests where some are.
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                raise e

        def walk() -> list[str]:
            # Only the directory the prefix names is walked (``gc/`` does not read ``blobs/``).
            base = prefix.rpartition("/")[0]
            self._check_root()
            if base:
                # No key starts with ``../`` or ``/``: walking there listed files outside
                # the archive; nor is a temporary file a key.
                try:
                    check_key(base)
                except ValueError:
                    return []
                if base.split("/", 1)[0] == TMP:
                    return []
            out = []
            top = os.path.join(self.root, base)
            for dirpath, dirnames, filenames in os.walk(top, onerror=failed):
                rel = os.path.relpath(dirpath, self.root)
                if rel == ".":
                    dirnames[:] = [d for d in dirnames if d != TMP]
                for name in filenames:
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        out.append(key.replace(os.sep, "/"))
            if not out:
                self._check_root()  # (gone while walked: not an empty archive)
            return sorted(out)

        for k in await self._call(walk, f"list {prefix or '(all)'}"):
            yield k
