"""Every FUSE handler's failure becomes an errno, in this one place.

pyfuse3 ends the whole mount when a handler raises anything but ``FUSEError``, so each
handler is wrapped: a :class:`~kvfs.KvfsError` becomes its ``errno``, an :class:`OSError`
keeps its own, anything else is logged at ERROR and answered with EIO. A disk's I/O error
(a data device's, or IndexUnavailable: the index's) is a WARNING, one line per
DEVICE_ERROR_LOG_SECONDS (:mod:`kvfs._events`, as the control channel's) with a count of
the rest. When the store's own directories are gone (removed under the running daemon)
nearly every request fails so: that is said once, in one line naming them, not in a
traceback per request. A daemon out of file descriptors (EMFILE, ENFILE) answers that errno,
and says so as a disk's error is said: a WARNING per DEVICE_ERROR_LOG_SECONDS.
"""

from __future__ import annotations

import errno
import functools
import logging
import resource
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from ._errors import IndexUnavailable, KvfsError, out_of_files
from ._events import disk_error_due, files_error_due, threads_error_due
from ._fuse_nodes import Node
from ._fuse_ns import child_path
from ._keys import MAX_NAME_BYTES, MAX_PATH_BYTES
from ._local import DISK_ERRORS

__all__ = ["child_of", "decode_name", "files_error", "fuse_error", "guard"]

log = logging.getLogger("kvfs.fuse")
T = TypeVar("T")
P = ParamSpec("P")


def fuse_error(n: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(n)


def guard(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Answer every failure with an errno; never let pyfuse3 see anything but FUSEError."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except KvfsError as e:
            if isinstance(e, IndexUnavailable):  # (as a data disk's, below: said, not each)
                _device_error(args[0], fn.__name__, e)
            else:
                log.debug("%s%r: %s", fn.__name__, args[1:3], e)
            raise fuse_error(e.errno or errno.EIO) from None
        except OSError as e:
            if e.errno is None:
                log.error("%s%r failed", fn.__name__, args[1:3], exc_info=True)
            elif e.errno in DISK_ERRORS:  # (a disk's: kvfs's own errors were caught above)
                _device_error(args[0], fn.__name__, e)
            elif out_of_files(e):
                files_error(args[0], fn.__name__, e)
            raise fuse_error(e.errno or errno.EIO) from None
        except Exception as e:
            if no_thread(e):
                _threads_error(args[0], fn.__name__)
            elif not _store_gone(args[0]):
                log.error("unexpected error in %s%r", fn.__name__, args[1:3], exc_info=True)
            raise fuse_error(errno.EIO) from None

    return wrapper


def _device_error(ops: object, handler: str, e: OSError) -> None:
    """Log a disk's I/O error that a request was answered with: the caller sees only EIO,
    and a failing device said nothing in the daemon's log (docs/architecture.md, "A
    device that fails"). One line per DEVICE_ERROR_LOG_SECONDS per mount."""
    more = disk_error_due(ops)
    if more is None:
        return
    log.warning(
        "%s: %s%s%s",
        handler,
        e,
        # (the index's error names its file and asks; a data file's is only the errno's)
        ""
        if isinstance(e, IndexUnavailable)
        else " (a disk failing? kvfs fsck lists what cannot be read)",
        f"; {more} more such errors since the last of these lines" if more else "",
    )


def files_error(ops: object, handler: str, e: OSError) -> None:
    """Log a request answered EMFILE or ENFILE: the daemon (or the system) has no file
    descriptor left, and the caller sees the errno of a file it did not open itself. One
    line per DEVICE_ERROR_LOG_SECONDS per mount, as a disk's error."""
    more = files_error_due(ops)
    if more is None:
        return
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.warning(
        "%s: %s (the daemon's open files limit is %s; each file open for writing holds a "
        "descriptor per data directory until it is closed)%s",
        handler,
        e,
        "unlimited" if soft == resource.RLIM_INFINITY else soft,
        f"; {more} more such errors since the last of these lines" if more else "",
    )


def no_thread(e: BaseException) -> bool:
    """Whether ``e`` is Python's failure to start a thread (the process at its cgroup's
    pids.max, or at RLIMIT_NPROC)."""
    return isinstance(e, RuntimeError) and "can't start new thread" in str(e)


def _threads_error(ops: object, handler: str) -> None:
    """Log a request answered EIO because no thread could be started for it: until then a
    traceback per request (every write of every file meets it while it lasts). One line
    per DEVICE_ERROR_LOG_SECONDS per mount, as a disk's error."""
    more = threads_error_due(ops)
    if more is not None:
        log.warning(
            "%s: no thread could be started (the daemon is at its cgroup's pids.max or its "
            "RLIMIT_NPROC): answered EIO%s",
            handler,
            f"; {more} more such errors since the last of these lines" if more else "",
        )


def _store_gone(ops: object) -> bool:
    """The Operations object's store lost a directory (``store_gone``, which logs it)."""
    check = getattr(ops, "store_gone", None)
    return bool(check is not None and check())


def decode_name(name: bytes) -> str:
    """A name from the kernel as text. Raises FUSEError ENAMETOOLONG, EINVAL (not UTF-8)."""
    if len(name) > MAX_NAME_BYTES:
        raise fuse_error(errno.ENAMETOOLONG)
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise fuse_error(errno.EINVAL) from None


def child_of(parent: Node, name: bytes) -> str:
    """The path of ``name`` in directory ``parent``. Raises FUSEError as decode_name, and
    ENAMETOOLONG for a path over the store's limit."""
    path = child_path(parent.path, decode_name(name))
    if len(path.encode()) > MAX_PATH_BYTES:
        raise fuse_error(errno.ENAMETOOLONG)
    return path
