"""The object-store interface every archive backend implements.

Contract (documented once, here; ``tests/test_objectstore.py`` checks every implementation):

* Keys are ``/``-separated relative names (``blobs/ab12...``, ``manifests/x.msgpack``): no
  leading ``/``, no empty, ``.`` or ``..`` component. Values are whole objects of bytes.
* :meth:`put` is atomic: a reader sees the old object, the new one, or (for a new key)
  nothing; never a torn write. With ``if_absent=True`` it is a conditional create: it
  returns False, writing nothing, when the key already exists (two hosts racing to upload
  the same content both succeed; one object results).
* :meth:`get` raises :class:`ObjectNotFound` (a ``FileNotFoundError``) for a missing key.
  With ``into`` the bytes land in the caller's buffer and the count is returned.
* :meth:`delete` of a missing key is not an error (S3 semantics).
* :meth:`list` yields every key starting with ``prefix``, in lexicographic order.
* Temporary failures (connection refused, timeouts, 5xx, 408, throttling) are retried inside
  the store by the one helper in :mod:`objectstore._retry` until its deadline; what reaches
  the caller is :class:`~kvfs.ArchiveUnavailable` (cause in ``__cause__``) for a store that
  cannot be reached, does not exist or refuses access, and :class:`ObjectNotFound`.
* Every method is a trio coroutine; blocking work runs in worker threads.
"""

from __future__ import annotations

import abc
import builtins
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "ARCHIVE_THREADS",
    "ObjectNotFound",
    "ObjectStore",
    "archive_threads",
    "check_key",
    "one_error_nursery",
]

#: threads archive I/O may hold at once, per trio run (trio's own default limiter has 40)
ARCHIVE_THREADS = 40
_threads: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("objectstore_threads")


def archive_threads() -> trio.CapacityLimiter:
    """The limiter of every thread the stores run blocking I/O in, one per trio run, apart
    from trio's default one. A read given up by its caller (``abandon_on_cancel``) keeps
    its thread, and its token, until the endpoint answers or the read timeout passes: on
    the default limiter a burst of those against a hung endpoint left no thread for any
    other ``to_thread.run_sync`` of the process (control calls, index steps) for as long.
    Here they can only hold up other archive I/O, which waits on that endpoint anyway."""
    try:
        return _threads.get()
    except LookupError:
        limiter = trio.CapacityLimiter(ARCHIVE_THREADS)
        _threads.set(limiter)
        return limiter


def _first_leaf(eg: BaseExceptionGroup) -> BaseException:
    for e in eg.exceptions:
        leaf = _first_leaf(e) if isinstance(e, BaseExceptionGroup) else e
        if not isinstance(leaf, trio.Cancelled):
            return leaf
    return eg.exceptions[0]


@asynccontextmanager
async def one_error_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose failure is raised as the first underlying error, not a group: callers
    catch ArchiveUnavailable or ObjectNotFound as the contract documents."""
    try:
        async with trio.open_nursery() as n:
            yield n
    except BaseExceptionGroup as eg:
        raise _first_leaf(eg) from None


class ObjectNotFound(FileNotFoundError):
    """No object is stored under this key."""


#: the longest key (S3's limit; a ``file://`` archive also limits each component, a file
#: name, to 255 bytes)
KEY_MAX = 1024


def check_key(key: str) -> str:
    """Validate an object key; raises ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, not {key!r}")
    if key.startswith("/") or key.endswith("/"):
        raise ValueError(f"object key {key!r} may not start or end with '/'")
    for part in key.split("/"):
        if part in ("", ".", "..") or "\x00" in part:
            raise ValueError(f"object key {key!r} has an invalid component {part!r}")
    if len(key.encode("utf-8", "surrogateescape")) > KEY_MAX:
        raise ValueError(f"object key {key[:60]!r}... is over {KEY_MAX} bytes (S3's limit)")
    return key


class ObjectStore(abc.ABC):
    """Abstract async object store. See the module docstring for the contract."""

    #: Where the store points, for messages (never contains credentials).
    url: str = ""

    # -- the core every implementation provides ----------------------------------------
    @abc.abstractmethod
    async def get(self, key: str, *, into: memoryview | bytearray | None = None) -> bytes | int:
        """The object's bytes (or the count written into ``into``).

        Raises ObjectNotFound, ArchiveUnavailable, ValueError (``into`` too small)."""

    @abc.abstractmethod
    async def put(
        self, key: str, data: bytes | memoryview, *, if_absent: bool = False, cold: bool = False
    ) -> bool:
        """Store ``data`` under ``key`` atomically; True if written. With ``if_absent`` an
        existing object is left alone and False is returned. ``cold``: an object written
        once and seldom read (a page's), which the store may keep in a cheaper class (S3's
        ``storage_class`` option); small objects rewritten often (manifests, heartbeats)
        are not. Raises ArchiveUnavailable, and ValueError for a key the store cannot hold
        (an invalid one; in a ``file://`` store, one beside a key it begins or that begins it).
        A crash or cancellation leaves the old object or the new one, never a mix (a file
        store may leave a temporary file that the next put of the key does not see)."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether ``key`` holds an object. Raises ArchiveUnavailable."""

    @abc.abstractmethod
    async def modified(self, key: str) -> float | None:
        """When ``key`` was last written, in seconds since the epoch by the store's own
        clock (S3: the server's ``LastModified``, whole seconds), or None when absent.
        Hosts sharing a store compare these, never their own clocks. Raises
        ArchiveUnavailable."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is absent). Raises ArchiveUnavailable."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[str]:
        """Every key starting with ``prefix``, in order. Raises ArchiveUnavailable."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release connections. Idempotent."""

    async def abort_stale_uploads(self, older_than: float, prefix: str = "") -> int:
        """Remove what puts cut short left in the store (a process killed mid-put, an abort
        that could not reach the endpoint): S3's incomplete multipart uploads of keys
        starting with ``prefix``, which no listing shows and S3 bills until aborted; a
        ``file://`` store's temporary files (of any key: their names do not say which).
        Only those started more than ``older_than`` seconds ago, by the store's own clock:
        a younger one may be another host's put in flight. Returns how many went. Raises
        ArchiveUnavailable (ArchiveAccessDenied where the credentials may not list or abort
        them). A store that leaves nothing behind has nothing to do (this default)."""
        return 0

    # -- conveniences with default implementations --------------------------------------
    async def list_all(self, prefix: str = "") -> builtins.list[str]:
        """:meth:`list` collected into a list."""
        return [k async for k in self.list(prefix)]

    async def list_versions(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        """Every key starting with ``prefix``, in order, each with a tag that changes
        whenever its content does (S3: the ETag from the listing itself), or "" where the
        store has none (read the object to know). Raises ArchiveUnavailable."""
        return [(k, "") async for k in self.list(prefix)]

    async def get_many(self, keys: Iterable[str], *, concurrency: int = 8) -> dict[str, bytes]:
        """Fetch several objects concurrently; raises the first error (others are cancelled)."""
        keys = list(keys)
        out: dict[str, bytes] = {}
        limit = trio.CapacityLimiter(concurrency)

        async def one(k: str) -> None:
            async with limit:
                data = await self.get(k)
                assert isinstance(data, bytes)
                out[k] = data

        async with one_error_nursery() as n:
            for k in keys:
                n.start_soon(one, k)
        return out

    async def delete_many(self, keys: Iterable[str], *, concurrency: int = 8) -> None:
        """Delete several keys concurrently."""
        limit = trio.CapacityLimiter(concurrency)

        async def one(k: str) -> None:
            async with limit:
                await self.delete(k)

        async with one_error_nursery() as n:
            for k in keys:
                n.start_soon(one, k)

    async def __aenter__(self) -> ObjectStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
