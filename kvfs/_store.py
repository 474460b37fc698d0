"""The object API: :class:`Store` (async, trio) and :class:`SyncStore` (a thin facade).

Both call the same thread-safe :class:`~kvfs._engine.Engine`; the async store runs each call
in a worker thread under a :class:`trio.CapacityLimiter`, so the trio loop never blocks on
disk, hashing or SQLite.

Cancellation: a call already running in its worker thread is finished before the
cancellation is delivered (trio waits for the thread), so a cancelled ``put`` may still
have stored the page; ``exists`` tells.
"""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import trio

from ._config import StoreConfig
from ._engine import Engine, PageWriter
from ._gather import BatchCalls, calls_at_once, one_buffer_per_key, pairs
from ._keys import PageKey
from ._types import PageInfo, SessionInfo, StoreStatistics

__all__ = ["Store", "SyncStore", "open_store", "open_store_sync"]

log = logging.getLogger("kvfs.store")

T = TypeVar("T")
KeyLike = PageKey | str


class Store(BatchCalls):
    """Async page store. Get one with ``async with kvfs.open_store(config) as store``."""

    def __init__(self, engine: Engine, limiter: trio.CapacityLimiter) -> None:
        self._engine = engine
        self._limiter = limiter

    @property
    def engine(self) -> Engine:
        """The synchronous core (for the FUSE layer and fast paths that manage threads)."""
        return self._engine

    @property
    def config(self) -> StoreConfig:
        return self._engine.config

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kw), limiter=self._limiter
        )

    async def put(
        self,
        key: KeyLike,
        data: object,
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
    ) -> PageInfo:
        """Store a write-once page from any C-contiguous buffer (bytes, bytearray, a numpy
        array; a torch CPU tensor as ``t.view(torch.uint8).numpy()``). Returns its info.

        Raises TypeError (no buffer), ValueError (a strided one), InvalidKey (a bad key, or ``attrs`` the mount could not show as xattrs: see
        docs/mount.md), PageExists (unless ``replace``), CapacityExceeded. Atomic: after an
        error or a crash the page is either wholly there or not at all.
        """
        return await self._run(self._engine.put, key, data, attrs=attrs, pin=pin, replace=replace)

    async def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        """Read a page: bytes, or the count read into ``into`` (a writable C-contiguous
        buffer at least the page's size, as :meth:`put` takes; aligned buffers use O_DIRECT).

        Raises PageNotFound, CorruptPage (never returns data that fails its checksum);
        TypeError or ValueError for an ``into`` that cannot take the page.
        """
        return await self._run(self._engine.get, key, into)

    async def read_page(self, key: KeyLike) -> bytes | memoryview:
        """A whole page in a buffer of its own, not a copy of it (see
        :meth:`Engine.read_page`): a large page is held once, where ``get`` returns a
        ``bytes`` copied from its read buffer. The result is a ``bytes`` or a
        ``memoryview`` (which one depends on where the page was read from: use it as a
        buffer, not as ``bytes``). Raises as :meth:`get` does."""
        got = await self._read_page(key)
        assert not isinstance(got, int)  # (a size only with ``most``)
        return got

    async def _read_page(
        self, key: KeyLike, room: int | None = None, most: int | None = None
    ) -> bytes | memoryview | int:
        """:meth:`read_page`, refusing a page larger than ``room`` bytes before it is read
        or restored (the daemon's answer to a remote get into a buffer of that size); with
        ``most``, returning the size of a page larger than that instead of reading it."""
        return await self._run(self._engine.read_page, key, room=room, most=most)

    async def read_range(self, key: KeyLike, offset: int, size: int) -> bytes:
        return await self._run(self._engine.read_range, key, offset, size)

    async def stat(self, key: KeyLike) -> PageInfo:
        return await self._run(self._engine.stat, key)

    async def exists(self, key: KeyLike) -> bool:
        return await self._run(self._engine.exists, key)

    async def list(
        self,
        *,
        session: str | None = None,
        prefix: str | None = None,
        path_prefix: str | None = None,
    ) -> builtins.list[PageInfo]:
        return await self._run(
            self._engine.list, session=session, prefix=prefix, path_prefix=path_prefix
        )

    async def sessions(self) -> builtins.list[SessionInfo]:
        return await self._run(self._engine.sessions)

    async def session_info(self, session: str) -> SessionInfo:
        return await self._run(self._engine.session_info, session)

    async def set_session_attrs(self, session: str, attrs: dict[str, str]) -> None:
        await self._run(self._engine.set_session_attrs, session, attrs)

    async def delete(self, key: KeyLike) -> None:
        await self._run(self._engine.delete, key)

    async def delete_session(self, session: str) -> int:
        return await self._run(self._engine.delete_session, session)

    async def rename(self, src: KeyLike, dst: KeyLike) -> None:
        await self._run(self._engine.rename, src, dst)

    async def pin(self, key: KeyLike, *, ttl: float | None = None) -> None:
        """Keep a page from eviction until it is unpinned, or for ``ttl`` seconds. Pinning
        again replaces the lifetime (without ``ttl``: for good). Raises PageNotFound,
        ValueError (a ``ttl`` not > 0)."""
        await self._run(self._engine.pin, key, True, ttl=ttl)

    async def unpin(self, key: KeyLike) -> None:
        await self._run(self._engine.pin, key, False)

    async def pin_session(self, session: str, *, ttl: float | None = None) -> None:
        """Keep a session's pages from eviction, as :meth:`pin` a page."""
        await self._run(self._engine.pin_session, session, True, ttl=ttl)

    async def unpin_session(self, session: str) -> None:
        await self._run(self._engine.pin_session, session, False)

    async def evict(
        self,
        key: KeyLike | None = None,
        *,
        session: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Drop local copies (see Engine.evict); ``progress`` is called from a thread."""
        return await self._run(
            functools.partial(self._engine.evict, key, session=session, progress=progress)
        )

    async def fsck(
        self,
        *,
        repair: bool = False,
        archive: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, builtins.list[str]]:
        """Check (with ``repair``: mend) the store; findings by kind (see Engine.fsck).
        ``progress(contents checked, contents to check)`` is called from a thread."""
        return await self._run(self._engine.fsck, repair=repair, archive=archive, progress=progress)

    async def begin_write(self, key: KeyLike) -> PageWriter:
        return await self._run(self._engine.begin_write, key)

    async def statistics(self) -> StoreStatistics:
        return await self._run(self._engine.statistics)

    async def spill(
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Spill a session to the archive now; bytes uploaded (see Engine.spill).
        ``progress(page bytes archived, page bytes to archive)`` is called from a thread."""
        return await self._run(functools.partial(self._engine.spill, session, progress=progress))

    async def restore(
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Import and prefetch a session from the archive; bytes restored (Engine.restore).
        ``progress(bytes done, bytes to restore)`` is called from a worker thread."""
        return await self._run(functools.partial(self._engine.restore, session, progress=progress))

    async def archived_sessions(self) -> builtins.list[dict[str, object]]:
        return await self._run(self._engine.archived_sessions)

    async def archive_hosts(self) -> builtins.list[dict[str, object]]:
        return await self._run(self._engine.archive_hosts)

    async def aclose(self) -> None:
        """Close the store (idempotent). Waits for calls in flight."""
        await trio.to_thread.run_sync(self._engine.close)


@asynccontextmanager
async def open_store(config: StoreConfig | None = None, **overrides: Any) -> AsyncIterator[Store]:
    """Open (creating if needed) the store described by ``config``; close it on exit.

    Raises StoreLocked when another process owns the data directories.
    """
    cfg = (config or StoreConfig()).replace(**overrides) if overrides else (config or StoreConfig())
    engine = await trio.to_thread.run_sync(Engine, cfg)
    store = Store(engine, trio.CapacityLimiter(max(4, cfg.io_threads * 2)))
    # The body runs inside the nursery of the store's background tasks; an error it raises
    # leaves the block as it is (PageNotFound, not an ExceptionGroup holding it).
    raised: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_housekeeping_forever, engine)
            background = getattr(engine.policy, "background", None)
            if background is not None:  # the archive tier's spiller
                nursery.start_soon(background)
            try:
                yield store
            except BaseException as e:
                raised = e
            finally:
                nursery.cancel_scope.cancel()
        if raised is not None:
            raise raised
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


#: how often a running store does its housekeeping: writes the access times reads noted,
#: and releases the pins whose lifetime ended (eviction releases those first whatever this
#: is: the capacity they held is never what fails a put)
HOUSEKEEPING_SECONDS = 5.0


async def _housekeeping_forever(engine: Engine) -> None:
    """Every HOUSEKEEPING_SECONDS, each step in turn. A step that fails (a full disk: SQLite
    cannot write) is logged and the next pass tries again (meanwhile an eviction releases
    ended pins, and access times not written only order eviction less well): an atime
    flush that raised ended the store's nursery, and with it every call of the daemon."""
    steps: tuple[tuple[Callable[[], object], str], ...] = (
        (engine.flush_atimes, "access times not written this time"),
        (engine.release_expired_pins, "pins whose lifetime ended are not released yet"),
    )
    while True:
        await trio.sleep(HOUSEKEEPING_SECONDS)
        for step, undone in steps:
            try:
                await trio.to_thread.run_sync(step)
            except Exception as e:
                log.warning("%s: %s", undone, e)


class SyncStore:
    """Blocking facade over the same core, for scripts: same methods, no ``await``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def config(self) -> StoreConfig:
        return self._engine.config

    def put(
        self,
        key: KeyLike,
        data: object,
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
    ) -> PageInfo:
        return self._engine.put(key, data, attrs=attrs, pin=pin, replace=replace)

    def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        return self._engine.get(key, into)

    def read_page(self, key: KeyLike) -> bytes | memoryview:
        """As :meth:`Store.read_page`: a whole page in a buffer of its own, not a copy (see
        :meth:`Engine.read_page`); raises as :meth:`get` does."""
        got = self._engine.read_page(key)
        assert not isinstance(got, int)  # (a size only with ``most``)
        return got

    def read_range(self, key: KeyLike, offset: int, size: int) -> bytes:
        return self._engine.read_range(key, offset, size)

    def stat(self, key: KeyLike) -> PageInfo:
        return self._engine.stat(key)

    def exists(self, key: KeyLike) -> bool:
        return self._engine.exists(key)

    def list(
        self,
        *,
        session: str | None = None,
        prefix: str | None = None,
        path_prefix: str | None = None,
    ) -> builtins.list[PageInfo]:
        return self._engine.list(session=session, prefix=prefix, path_prefix=path_prefix)

    def sessions(self) -> builtins.list[SessionInfo]:
        return self._engine.sessions()

    def session_info(self, session: str) -> SessionInfo:
        return self._engine.session_info(session)

    def set_session_attrs(self, session: str, attrs: dict[str, str]) -> None:
        self._engine.set_session_attrs(session, attrs)

    def delete(self, key: KeyLike) -> None:
        self._engine.delete(key)

    def delete_session(self, session: str) -> int:
        return self._engine.delete_session(session)

    def rename(self, src: KeyLike, dst: KeyLike) -> None:
        self._engine.rename(src, dst)

    def pin(self, key: KeyLike, *, ttl: float | None = None) -> None:
        self._engine.pin(key, True, ttl=ttl)

    def unpin(self, key: KeyLike) -> None:
        self._engine.pin(key, False)

    def pin_session(self, session: str, *, ttl: float | None = None) -> None:
        self._engine.pin_session(session, True, ttl=ttl)

    def unpin_session(self, session: str) -> None:
        self._engine.pin_session(session, False)

    def evict(
        self,
        key: KeyLike | None = None,
        *,
        session: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        return self._engine.evict(key, session=session, progress=progress)

    def fsck(
        self,
        *,
        repair: bool = False,
        archive: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, builtins.list[str]]:
        return self._engine.fsck(repair=repair, archive=archive, progress=progress)

    def begin_write(self, key: KeyLike) -> PageWriter:
        return self._engine.begin_write(key)

    def put_many(
        self,
        items: Iterable[tuple[KeyLike, object]],
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
        concurrency: int = 4,
    ) -> builtins.list[PageInfo]:
        """Put several pages from ``concurrency`` threads; results in input order. Every
        item is checked first (a bad key or buffer, or a key twice, stores nothing, and the
        error names the item). The first error of a put is raised after the calls in
        flight finish: the pages stored stay stored, and which were depends on timing
        (``exists`` says)."""
        # Not the engine's I/O pool: each put waits on that pool, so running puts on it
        # deadlocks once every pool thread is a put waiting for its own writes.
        items = pairs(items)
        with ThreadPoolExecutor(
            calls_at_once(concurrency, len(items)), thread_name_prefix="kvfs-put-many"
        ) as ex:
            put = functools.partial(self._engine.put, attrs=attrs, pin=pin, replace=replace)
            return list(ex.map(lambda kd: put(*kd), items))

    def get_many(
        self, keys: Iterable[KeyLike], into: Iterable[object] | None = None, *, concurrency: int = 4
    ) -> builtins.list[bytes | int]:
        """Get several pages (optionally each into its own buffer); results in input order."""
        keys = list(keys)
        bufs = one_buffer_per_key(keys, into)
        with ThreadPoolExecutor(
            calls_at_once(concurrency, len(keys)), thread_name_prefix="kvfs-get-many"
        ) as ex:
            return list(
                ex.map(lambda kb: self._engine.get(kb[0], kb[1]), zip(keys, bufs, strict=True))
            )

    def statistics(self) -> StoreStatistics:
        return self._engine.statistics()

    def spill(self, session: str, *, progress: Callable[[int, int], None] | None = None) -> int:
        return self._engine.spill(session, progress=progress)

    def restore(self, session: str, *, progress: Callable[[int, int], None] | None = None) -> int:
        return self._engine.restore(session, progress=progress)

    def archived_sessions(self) -> builtins.list[dict[str, object]]:
        return self._engine.archived_sessions()

    def archive_hosts(self) -> builtins.list[dict[str, object]]:
        return self._engine.archive_hosts()

    def close(self) -> None:
        self._engine.close()


@contextmanager
def open_store_sync(
    config: StoreConfig | None = None,
    *,
    archive_required: bool = True,
    archive_down: str | None = None,
    **overrides: Any,
) -> Iterator[SyncStore]:
    """Blocking counterpart of :func:`open_store`. ``archive_required=False``: for an
    inspection of the local tier, an archive that cannot be opened leaves the store open
    without it (``store.engine.archive_error`` says why), and ``archive_down`` opens so
    without trying it (an earlier open found it down; see :class:`Engine`)."""
    cfg = (config or StoreConfig()).replace(**overrides) if overrides else (config or StoreConfig())
    s = SyncStore(Engine(cfg, archive_required=archive_required, archive_down=archive_down))
    try:
        yield s
    finally:
        s.close()
