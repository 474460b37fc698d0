"""The kvfs error hierarchy.

Every error about the store, its pages, sessions, capacity and archive is a
:class:`KvfsError`; a call given the wrong kind of argument (not a buffer, a buffer too
small, a negative offset) gets the builtin TypeError or ValueError. Each leaf also inherits the
builtin exception a Python programmer would expect, so ``except FileNotFoundError`` keeps
working for code that knows nothing about kvfs. Errors are mapped to errno in exactly one
place (the FUSE layer) and to exit codes in exactly one place (the CLI).
"""

from __future__ import annotations

import errno

__all__ = [
    "ArchiveAccessDenied",
    "ArchiveUnavailable",
    "CapacityExceeded",
    "DiskFull",
    "CorruptPage",
    "IndexUnavailable",
    "InvalidKey",
    "KvfsError",
    "PageExists",
    "PageNotFound",
    "SessionNotFound",
    "StoreClosed",
    "StoreLocked",
    "leaf_errors",
    "out_of_files",
]

#: the process (EMFILE: its RLIMIT_NOFILE) or the system (ENFILE) has no file descriptor left
OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE})


def out_of_files(e: BaseException | None) -> bool:
    """Whether ``e`` says no file could be opened for want of descriptors (OUT_OF_FILES):
    a passing state, gone once files close, that every request meets while it lasts."""
    return isinstance(e, OSError) and e.errno in OUT_OF_FILES


class KvfsError(Exception):
    """Root of every error kvfs raises deliberately."""

    #: errno the FUSE layer answers with; EIO for anything not more specific.
    errno: int | None = errno.EIO


class InvalidKey(KvfsError, ValueError):
    """A page key or path is malformed: empty part, ``..``, NUL, too long, reserved name."""

    errno = errno.EINVAL


class PageNotFound(KvfsError, FileNotFoundError):
    """No page is stored under this key (in any tier)."""

    errno = errno.ENOENT


class SessionNotFound(KvfsError, FileNotFoundError):
    """No session of this name holds any page."""

    errno = errno.ENOENT


class PageExists(KvfsError, FileExistsError):
    """A page is already stored under this key and pages are write-once."""

    errno = errno.EEXIST


class CorruptPage(KvfsError, OSError):
    """Stored bytes do not match the page's checksum. The data is never returned."""

    errno = errno.EIO


class CapacityExceeded(KvfsError, OSError):
    """The page does not fit under the capacity cap even after evicting what may be evicted."""

    errno = errno.ENOSPC


class DiskFull(CapacityExceeded):
    """The disk under a data directory is full (ENOSPC, EDQUOT), whatever the cap allows."""


class IndexUnavailable(KvfsError, OSError):
    """The disk holding the index (``StoreConfig.index_dir``) answered an I/O error: the
    call needed the index and could not read or write it. Nothing was changed by the call
    (its transaction rolled back; a put's new data files removed, or, when the disk failed
    the commit itself, left for the next open to sweep). The message names the index file;
    the cause is in ``__cause__``. Not a corrupt index: that one does not open at all.
    An open raises it, naming the index's directory, when that disk fails it (creating and
    changing nothing)."""

    errno = errno.EIO
    #: raised by the commit itself: SQLite rolled it back, but a disk that took the WAL's
    #: write and then failed its flush may have kept it (docs/architecture.md)
    at_commit: bool = False


class StoreLocked(KvfsError, BlockingIOError):
    """Another process owns this data directory (the message names it)."""

    errno = errno.EBUSY


class StoreClosed(KvfsError, RuntimeError):
    """The store was closed; no further calls are accepted."""


class ArchiveUnavailable(KvfsError, ConnectionError):
    """The archive tier cannot be reached or refused access; the cause is in ``__cause__``."""

    errno = errno.EIO


class ArchiveAccessDenied(ArchiveUnavailable, PermissionError):
    """The archive answered and refused the request (S3 403: wrong or expired credentials,
    a bucket or IAM policy; a ``file://`` archive's EACCES). Not an outage: it is raised at
    once, never retried, and one object refused does not stop the others being tried. The
    message names the operation, the key and the permission it needs. An
    ArchiveUnavailable, so that every "nothing was dropped" path treats it as one; errno
    stays EIO on the mount (the reader of the file is not the one refused)."""


def leaf_errors(e: BaseException) -> list[BaseException]:
    """The errors an exception group (trio's nurseries raise them) is made of, nested
    groups flattened; ``[e]`` for any other exception."""
    subs = getattr(e, "exceptions", None)
    return [x for sub in subs for x in leaf_errors(sub)] if subs else [e]
