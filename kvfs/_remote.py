"""Clients of the control channel with the object API's interface.

:class:`RemoteStore` mirrors :class:`~kvfs.Store` (async, trio) and :class:`SyncRemoteStore`
mirrors :class:`~kvfs.SyncStore`, so engine workers in other processes share one daemon's
store with the same calls. Each in-flight call holds its own connection (connections are
pooled), so concurrent calls run concurrently in the daemon.

Differences from the in-process store: ``begin_write`` is not offered (use ``put``);
``get(key, into=buf)`` copies the received bytes into ``buf`` (host buffers only). If the
daemon dies during a call the call raises :class:`DaemonUnavailable`, and whether the call
took effect is unknown (a ``put`` may be checked with ``exists``). A pooled connection
whose daemon went away meanwhile (stopped, restarted) is dropped before it is used, so the
first call after a restart reaches the new daemon. Arguments are checked as in-process
(InvalidKey, TypeError, ValueError) before anything is sent.
"""

from __future__ import annotations

import builtins
import functools
import os
import select
import socket
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import trio

from ._aligned import as_bytes_view
from ._control import (
    DaemonUnavailable,
    call_sync,
    check_daemon_peer,
    connect_sync,
    raise_remote,
    recv_frame,
    send_frame,
)
from ._errors import StoreClosed
from ._gather import BatchCalls, one_buffer_per_key, pairs
from ._keys import PageKey, as_key, check_list_filter, session_dir
from ._reads import too_small
from ._types import PageInfo
from ._writes import check_attrs

__all__ = ["RemoteStore", "SyncRemoteStore", "open_remote_store", "open_remote_store_sync"]

KeyLike = PageKey | str


def _k(key: KeyLike) -> str:
    # Checked here, as in-process: a bad key gets InvalidKey, not an error from packing it.
    return as_key(key).path


def _s(session: str) -> str:
    # As _k: a name that is no session (not UTF-8 above all, which msgpack cannot send) gets
    # InvalidKey here, as in-process; the daemon resolves the name itself.
    session_dir(session)
    return session


def _dest(into: object | None) -> memoryview | None:
    """The buffer a get reads into, checked before the page is sent."""
    return None if into is None else as_bytes_view(into, "the buffer to read into", writable=True)


def _get_args(path: str, dest: memoryview | None) -> tuple[tuple[str], dict[str, int]]:
    """A get's arguments on the wire: with a buffer, its size (``room``), so the daemon
    refuses a page that cannot fit before it restores one the archive holds (it restored
    and sent the page, and then the client refused it)."""
    return (path,), ({} if dest is None else {"room": len(dest)})


def _copy_into(data: bytes | memoryview, dest: memoryview, path: str) -> int:
    if len(dest) < len(data):  # (a page replaced by a larger one since the daemon looked)
        raise too_small(len(dest), path, len(data))
    dest[: len(data)] = data
    return len(data)


#: Idle connections a SyncRemoteStore keeps (one per thread calling at once, up to this);
#: more are closed when their call ends (100 threads left 100 open for good).
MAX_IDLE = 16

_sync_clients: weakref.WeakSet[SyncRemoteStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A fork while another thread held a client's lock left the child's copy held for
    # ever: its first call deadlocked.
    for client in list(_sync_clients):
        client._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _dropped(fd: int) -> bool:
    """Whether an idle pooled connection is unusable: an idle connection has nothing to
    read, so one that is readable has been closed by its daemon (stopped or restarted)."""
    poller = select.poll()  # (not select(): no limit on the descriptor's number)
    poller.register(fd, select.POLLIN | select.POLLPRI)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


class _Api:
    """The object API's methods, each one control-channel call (``_call`` supplies it)."""

    def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        """Send one request and return its result; each client class below supplies it
        (blocking for SyncRemoteStore, awaited for RemoteStore)."""
        raise NotImplementedError

    def put(
        self,
        key: KeyLike,
        data: object,
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
    ) -> Any:
        # As in-process: data must be a flat buffer (TypeError, ValueError when strided) and
        # attrs str to str (InvalidKey), checked before anything is sent.
        return self._call(
            "put", _k(key), as_bytes_view(data), attrs=check_attrs(attrs), pin=pin, replace=replace
        )

    def read_range(self, key: KeyLike, offset: int, size: int) -> Any:
        return self._call("read_range", _k(key), offset, size)

    def stat(self, key: KeyLike) -> Any:
        return self._call("stat", _k(key))

    def exists(self, key: KeyLike) -> Any:
        return self._call("exists", _k(key))

    def list(
        self,
        *,
        session: str | None = None,
        prefix: str | None = None,
        path_prefix: str | None = None,
    ) -> Any:
        check_list_filter(session, prefix, path_prefix)
        return self._call("list", session=session, prefix=prefix, path_prefix=path_prefix)

    def sessions(self) -> Any:
        return self._call("sessions")

    def session_info(self, session: str) -> Any:
        return self._call("session_info", _s(session))

    def set_session_attrs(self, session: str, attrs: dict[str, str]) -> Any:
        return self._call("set_session_attrs", _s(session), check_attrs(attrs, page=False))

    def delete(self, key: KeyLike) -> Any:
        return self._call("delete", _k(key))

    def delete_session(self, session: str) -> Any:
        return self._call("delete_session", _s(session))

    def rename(self, src: KeyLike, dst: KeyLike) -> Any:
        return self._call("rename", _k(src), _k(dst))

    def pin(self, key: KeyLike, *, ttl: float | None = None) -> Any:
        # (ttl only when given: a pin for good is the call an older daemon knows)
        return self._call("pin", _k(key), **({} if ttl is None else {"ttl": ttl}))

    def unpin(self, key: KeyLike) -> Any:
        return self._call("unpin", _k(key))

    def pin_session(self, session: str, *, ttl: float | None = None) -> Any:
        return self._call("pin_session", _s(session), **({} if ttl is None else {"ttl": ttl}))

    def unpin_session(self, session: str) -> Any:
        return self._call("unpin_session", _s(session))

    def evict(self, key: KeyLike | None = None, *, session: str | None = None) -> Any:
        return self._call(
            "evict",
            None if key is None else _k(key),
            session=None if session is None else _s(session),
        )

    def fsck(
        self,
        *,
        repair: bool = False,
        archive: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """As the in-process ``fsck``; ``progress`` gets (contents checked, contents to
        check) as the daemon reports them (a few times a second)."""
        if progress is None:  # (progress=True only when asked: an older daemon's call)
            return self._call("fsck", repair=repair, archive=archive)
        return self._call(
            "fsck", repair=repair, archive=archive, progress=True, on_progress=progress
        )

    def statistics(self) -> Any:
        return self._call("statistics")

    def spill(self, session: str) -> Any:
        return self._call("spill", _s(session))

    def restore(self, session: str) -> Any:
        return self._call("restore", _s(session))

    def archived_sessions(self) -> Any:
        return self._call("archived_sessions")

    def archive_hosts(self) -> Any:
        return self._call("archive_hosts")

    def begin_write(self, key: KeyLike) -> Any:
        raise NotImplementedError("begin_write is not offered over the control channel; use put")

    def identity(self) -> Any:
        """Which store the daemon serves: ``{"lock": its lock file, "data_dirs": [resolved
        paths], "pid": N}``."""
        return self._call("identity")


class SyncRemoteStore(_Api):
    """:class:`~kvfs.SyncStore`'s interface over the control socket (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        self.path = Path(path)
        self._timeout = timeout
        self._idle: builtins.list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        _sync_clients.add(self)

    def _call(
        self, method: str, *args: Any, on_progress: Any = None, views: bool = False, **kw: Any
    ) -> Any:
        s = None
        if self._closed:
            raise StoreClosed(f"this client of {self.path} was closed")
        while s is None:
            with self._lock:
                if self._pid != os.getpid():
                    # A fork: the pooled connections are the parent's too. Shared, each
                    # side got some of the other's answers (another key's bytes). The
                    # child's copies are closed (the parent's stay open) and it connects anew.
                    for old in self._idle:
                        old.close()
                    self._idle, self._pid = [], os.getpid()
                s = self._idle.pop() if self._idle else None
            if s is None:
                s = connect_sync(self.path, self._timeout)
            elif _dropped(s.fileno()):  # its daemon went away while it sat in the pool
                s.close()
                s = None
        answer: builtins.list[
            tuple[str, str, int | None]
        ] = []  # the daemon's error, if it answered one
        try:
            result = call_sync(
                s,
                method,
                args,
                kw,
                on_progress=on_progress,
                on_error=lambda name, message, err: answer.append((name, message, err)),
                views=views,
            )
        except BaseException:
            s.close()
            raise
        self._keep(s)  # (sound after an error answered too)
        if answer:
            raise_remote(*answer[0])
        return result

    def spill(  # type: ignore[override]
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """As ``SyncStore.spill``; with ``progress``, it is called with (page bytes archived,
        page bytes to archive) as the daemon reports them (a few times a second)."""
        return self._long("spill", session, progress)

    def restore(  # type: ignore[override]
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """As ``SyncStore.restore``; with ``progress``, it is called with (bytes restored,
        bytes to restore) as the daemon reports them (a few times a second)."""
        return self._long("restore", session, progress)

    def evict(  # type: ignore[override]
        self,
        key: KeyLike | None = None,
        *,
        session: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """As ``SyncStore.evict``; with ``progress``, it is called with (page bytes archived,
        page bytes to archive) as the daemon reports them."""
        k = None if key is None else _k(key)
        session = None if session is None else _s(session)
        if progress is None:
            return self._call("evict", k, session=session)
        return self._call("evict", k, session=session, progress=True, on_progress=progress)

    def _long(self, method: str, session: str, progress: Callable[[int, int], None] | None) -> Any:
        session = _s(session)
        if progress is None:
            return self._call(method, session)
        return self._call(method, session, progress=True, on_progress=progress)

    def fsck_progress(
        self,
        *,
        repair: bool = False,
        archive: bool = False,
        progress: Callable[[int, int], None],
    ) -> dict[str, builtins.list[str]]:
        """``fsck(repair=..., archive=..., progress=...)``, by its older name (kept for
        callers of it)."""
        result: dict[str, builtins.list[str]] = self.fsck(
            repair=repair, archive=archive, progress=progress
        )
        return result

    def ping(self, timeout: float | None = None) -> bool:
        """True when the daemon answers (within ``timeout`` seconds, on a connection of
        its own: a stopped or hung daemon made every command wait for ever). Raises
        DaemonUnavailable."""
        if timeout is None or self._closed:
            return bool(self._call("ping"))  # (StoreClosed once closed)
        s = connect_sync(self.path, timeout)
        try:
            ok = bool(call_sync(s, "ping", (), {}))
        except TimeoutError as e:
            s.close()
            raise DaemonUnavailable(
                f"the kvfs daemon on {self.path} did not answer within {timeout:g} s "
                "(stopped, or stuck)"
            ) from e
        except BaseException:
            s.close()
            raise
        s.settimeout(self._timeout)
        self._keep(s)
        return ok

    def _keep(self, s: socket.socket) -> None:
        """Pool a connection whose call is over, unless closed or the pool is full."""
        with self._lock:
            if self._closed or len(self._idle) >= MAX_IDLE:
                s.close()
            else:
                self._idle.append(s)

    def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        path, dest = _k(key), _dest(into)
        args, kw = _get_args(path, dest)
        # (into a buffer: the page is copied there from the frame, not from a bytes of it)
        data: bytes = self._call("get", *args, views=dest is not None, **kw)
        return data if dest is None else _copy_into(data, dest, path)

    def read_page(self, key: KeyLike) -> bytes | memoryview:
        """As ``SyncStore.read_page``: a large page is a view into the daemon's answer, not
        a copy of it; raises as :meth:`get` does."""
        return self._call("get", _k(key), views=True)  # type: ignore[no-any-return]

    def put_many(
        self,
        items: Iterable[tuple[KeyLike, object]],
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
        concurrency: int = 4,
    ) -> builtins.list[PageInfo]:
        """As ``SyncStore.put_many``: ``concurrency`` calls at a time, each on its own
        connection; the first error is raised after the calls in flight finish."""
        its = pairs(items)
        with ThreadPoolExecutor(
            max(1, min(concurrency, len(its) or 1)), thread_name_prefix="kvfs-put-many"
        ) as ex:
            put = functools.partial(self.put, attrs=attrs, pin=pin, replace=replace)
            return builtins.list(ex.map(lambda kd: put(*kd), its))

    def get_many(
        self, keys: Iterable[KeyLike], into: Iterable[object] | None = None, *, concurrency: int = 4
    ) -> builtins.list[bytes | int]:
        ks = builtins.list(keys)
        bufs = one_buffer_per_key(ks, into)
        with ThreadPoolExecutor(
            max(1, min(concurrency, len(ks) or 1)), thread_name_prefix="kvfs-get-many"
        ) as ex:
            return builtins.list(
                ex.map(lambda kb: self.get(kb[0], kb[1]), zip(ks, bufs, strict=True))
            )

    def close(self) -> None:
        """Close the pooled connections (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


class RemoteStore(_Api, BatchCalls):
    """:class:`~kvfs.Store`'s interface over the control socket, on trio.

    A call cancelled here returns at once (its connection is closed), but the daemon
    finishes what it received: a cancelled ``put`` whose page had arrived may be stored
    only after the call returned (``exists`` says False, then True), and a ``spill`` or
    ``restore`` runs to its end."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._idle: builtins.list[trio.SocketStream] = []
        self._fresh: set[trio.SocketStream] = set()  # just connected: not yet checked
        self._closed = False

    async def _connect(self) -> trio.SocketStream:
        try:
            stream = await trio.open_unix_socket(os.fspath(self.path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise DaemonUnavailable(f"no kvfs daemon answers on {self.path}") from e
        try:
            check_daemon_peer(stream.socket, self.path)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        self._fresh.add(stream)
        return stream

    async def _call(  # type: ignore[override]
        self, method: str, *args: Any, on_progress: Any = None, views: bool = False, **kw: Any
    ) -> Any:
        stream = None
        if self._closed:
            raise StoreClosed(f"this client of {self.path} was closed")
        while stream is None:
            stream = self._idle.pop() if self._idle else await self._connect()
            if stream in self._fresh:
                self._fresh.discard(stream)
            elif _dropped(stream.socket.fileno()):  # its daemon went away meanwhile
                await trio.aclose_forcefully(stream)
                stream = None
        try:
            try:
                await send_frame(stream, [method, builtins.list(args), kw])
                reply = await recv_frame(stream, views=views)
                while reply is not None and reply[0] == 2:  # progress, then the answer
                    if on_progress is not None:
                        on_progress(reply[1], reply[2])
                    reply = await recv_frame(stream, views=views)
                if reply is None:
                    raise EOFError
            except (
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                EOFError,
                ConnectionResetError,
            ) as e:
                raise DaemonUnavailable(
                    "the kvfs daemon closed the connection mid-command (it stopped or was killed)"
                ) from e
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if self._closed:
            await stream.aclose()
        else:
            self._idle.append(stream)
        if reply[0] == 0:
            return reply[1]
        raise_remote(reply[1], reply[2], reply[3] if len(reply) > 3 else None)

    async def ping(self) -> bool:
        return bool(await self._call("ping"))

    async def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        path, dest = _k(key), _dest(into)
        args, kw = _get_args(path, dest)
        data: bytes = await self._call("get", *args, views=dest is not None, **kw)
        return data if dest is None else _copy_into(data, dest, path)

    async def read_page(self, key: KeyLike) -> bytes | memoryview:
        """As ``Store.read_page``: a large page is a view into the daemon's answer, not a
        copy of it; raises as :meth:`get` does."""
        return await self._call("get", _k(key), views=True)  # type: ignore[no-any-return]

    async def spill(  # type: ignore[override]
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """As ``Store.spill``; ``progress`` gets (page bytes archived, page bytes to archive)
        as the daemon reports them (a few times a second)."""
        return await self._long("spill", session, progress)

    async def restore(  # type: ignore[override]
        self, session: str, *, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """As ``Store.restore``; ``progress`` gets (bytes restored, bytes to restore)."""
        return await self._long("restore", session, progress)

    async def evict(  # type: ignore[override]
        self,
        key: KeyLike | None = None,
        *,
        session: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """As ``Store.evict``; ``progress`` gets (page bytes archived, page bytes to archive)."""
        k = None if key is None else _k(key)
        session = None if session is None else _s(session)
        if progress is None:
            return await self._call("evict", k, session=session)
        return await self._call("evict", k, session=session, progress=True, on_progress=progress)

    async def _long(
        self, method: str, session: str, progress: Callable[[int, int], None] | None
    ) -> Any:
        session = _s(session)
        if progress is None:
            return await self._call(method, session)
        return await self._call(method, session, progress=True, on_progress=progress)

    async def aclose(self) -> None:
        """Close the pooled connections (idempotent)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for s in idle:
            await s.aclose()


@asynccontextmanager
async def open_remote_store(path: str | os.PathLike[str]) -> AsyncIterator[RemoteStore]:
    """A :class:`RemoteStore` on the daemon at ``path``, checked with a ping. Raises
    DaemonUnavailable."""
    store = RemoteStore(path)
    try:
        await store.ping()
        yield store
    finally:
        await store.aclose()


@contextmanager
def open_remote_store_sync(
    path: str | os.PathLike[str], *, timeout: float | None = None
) -> Iterator[SyncRemoteStore]:
    """A :class:`SyncRemoteStore` on the daemon at ``path``, checked with a ping that
    waits at most ``timeout`` seconds (also each call's socket timeout; None: no limit)."""
    store = SyncRemoteStore(path, timeout=timeout)
    try:
        store.ping(timeout)
        yield store
    finally:
        store.close()
