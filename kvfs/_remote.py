"""Clients of the control channel with the object API's interface.

:class:`RemoteStore` mirrors :class:`~kvfs.Store` (async, trio) and :class:`SyncRemoteStore`
mirrors :class:`~kvfs.SyncStore`, so engine workers in other processes share one daemon's
store with the same calls. Each in-flight call holds its own connection (connections are
pooled), so concurrent calls run concurrently in the daemon.

Differences from the in-process store: ``begin_write`` is not offered (use ``put``);
``get(key, into=buf)`` copies the received bytes into ``buf`` (host buffers only). If the
daemon dies during a call the call raises :class:`DaemonUnavailable`, and whether the call
took effect is unknown (a ``put`` may be checked with ``exists``).
"""

from __future__ import annotations

import builtins
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import trio

from ._control import (
    DaemonUnavailable,
    call_sync,
    connect_sync,
    raise_remote,
    recv_frame,
    send_frame,
)
from ._keys import PageKey
from ._types import PageInfo

__all__ = ["RemoteStore", "SyncRemoteStore", "open_remote_store", "open_remote_store_sync"]

KeyLike = PageKey | str


def _k(key: KeyLike) -> str:
    return key.path if isinstance(key, PageKey) else key


def _copy_into(data: bytes, into: object) -> int:
    dest = memoryview(into).cast("B")  # type: ignore[arg-type]
    if len(dest) < len(data):
        raise ValueError(f"buffer of {len(dest)} bytes is too small for {len(data)}")
    dest[: len(data)] = data
    return len(data)


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
        return self._call("put", _k(key), data, attrs=attrs, pin=pin, replace=replace)

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
        return self._call("list", session=session, prefix=prefix, path_prefix=path_prefix)

    def sessions(self) -> Any:
        return self._call("sessions")

    def session_info(self, session: str) -> Any:
        return self._call("session_info", session)

    def set_session_attrs(self, session: str, attrs: dict[str, str]) -> Any:
        return self._call("set_session_attrs", session, attrs)

    def delete(self, key: KeyLike) -> Any:
        return self._call("delete", _k(key))

    def delete_session(self, session: str) -> Any:
        return self._call("delete_session", session)

    def rename(self, src: KeyLike, dst: KeyLike) -> Any:
        return self._call("rename", _k(src), _k(dst))

    def pin(self, key: KeyLike) -> Any:
        return self._call("pin", _k(key))

    def unpin(self, key: KeyLike) -> Any:
        return self._call("unpin", _k(key))

    def pin_session(self, session: str) -> Any:
        return self._call("pin_session", session)

    def unpin_session(self, session: str) -> Any:
        return self._call("unpin_session", session)

    def evict(self, key: KeyLike | None = None, *, session: str | None = None) -> Any:
        return self._call("evict", None if key is None else _k(key), session=session)

    def fsck(self, *, repair: bool = False) -> Any:
        return self._call("fsck", repair=repair)

    def statistics(self) -> Any:
        return self._call("statistics")

    def spill(self, session: str) -> Any:
        return self._call("spill", session)

    def restore(self, session: str) -> Any:
        return self._call("restore", session)

    def archived_sessions(self) -> Any:
        return self._call("archived_sessions")

    def archive_hosts(self) -> Any:
        return self._call("archive_hosts")

    def begin_write(self, key: KeyLike) -> Any:
        raise NotImplementedError("begin_write is not offered over the control channel; use put")


class SyncRemoteStore(_Api):
    """:class:`~kvfs.SyncStore`'s interface over the control socket (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        self.path = Path(path)
        self._timeout = timeout
        self._idle: builtins.list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _call(self, method: str, *args: Any, on_progress: Any = None, **kw: Any) -> Any:
        with self._lock:
            s = self._idle.pop() if self._idle else None
        if s is None:
            s = connect_sync(self.path, self._timeout)
        try:
            result = call_sync(s, method, args, kw, on_progress=on_progress)
        except BaseException:
            s.close()
            raise
        with self._lock:
            if self._closed:
                s.close()
            else:
                self._idle.append(s)
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
        if progress is None:
            return self._call("evict", k, session=session)
        return self._call("evict", k, session=session, progress=True, on_progress=progress)

    def _long(self, method: str, session: str, progress: Callable[[int, int], None] | None) -> Any:
        if progress is None:
            return self._call(method, session)
        return self._call(method, session, progress=True, on_progress=progress)

    def fsck_progress(
        self, *, repair: bool = False, progress: Callable[[int, int], None]
    ) -> dict[str, builtins.list[str]]:
        """fsck with ``progress(done, total)`` called as the daemon checks (a few times a
        second). Returns the findings, as ``fsck``."""
        result: dict[str, builtins.list[str]] = self._call(
            "fsck", repair=repair, progress=True, on_progress=progress
        )
        return result

    def ping(self) -> bool:
        """True when the daemon answers. Raises DaemonUnavailable."""
        return bool(self._call("ping"))

    def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        data: bytes = self._call("get", _k(key))
        return data if into is None else _copy_into(data, into)

    def put_many(
        self, items: Iterable[tuple[KeyLike, object]], **kw: Any
    ) -> builtins.list[PageInfo]:
        return [self.put(k, v, **kw) for k, v in items]

    def get_many(
        self, keys: Iterable[KeyLike], into: Iterable[object] | None = None, **_: Any
    ) -> builtins.list[bytes | int]:
        ks = builtins.list(keys)
        bufs = builtins.list(into) if into is not None else [None] * len(ks)
        return [self.get(k, b) for k, b in zip(ks, bufs, strict=True)]

    def close(self) -> None:
        """Close the pooled connections (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


class RemoteStore(_Api):
    """:class:`~kvfs.Store`'s interface over the control socket, on trio."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._idle: builtins.list[trio.SocketStream] = []
        self._closed = False

    async def _connect(self) -> trio.SocketStream:
        try:
            return await trio.open_unix_socket(os.fspath(self.path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise DaemonUnavailable(f"no kvfs daemon answers on {self.path}") from e

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        stream = self._idle.pop() if self._idle else await self._connect()
        try:
            try:
                await send_frame(stream, [method, builtins.list(args), kw])
                reply = await recv_frame(stream)
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
        raise_remote(reply[1], reply[2])

    async def ping(self) -> bool:
        return bool(await self._call("ping"))

    async def get(self, key: KeyLike, into: object | None = None) -> bytes | int:
        data: bytes = await self._call("get", _k(key))
        return data if into is None else _copy_into(data, into)

    async def put_many(
        self, items: Iterable[tuple[KeyLike, object]], *, concurrency: int = 4, **kw: Any
    ) -> builtins.list[PageInfo]:
        its = builtins.list(items)
        out: builtins.list[Any] = [None] * len(its)

        async def one(i: int) -> None:
            out[i] = await self.put(its[i][0], its[i][1], **kw)

        await _bounded(one, len(its), concurrency)
        return out

    async def get_many(
        self, keys: Iterable[KeyLike], into: Iterable[object] | None = None, *, concurrency: int = 4
    ) -> builtins.list[bytes | int]:
        ks = builtins.list(keys)
        bufs = builtins.list(into) if into is not None else [None] * len(ks)
        out: builtins.list[Any] = [None] * len(ks)

        async def one(i: int) -> None:
            out[i] = await self.get(ks[i], bufs[i])

        await _bounded(one, len(ks), concurrency)
        return out

    async def aclose(self) -> None:
        """Close the pooled connections (idempotent)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for s in idle:
            await s.aclose()


async def _bounded(fn: Any, n: int, concurrency: int) -> None:
    limit = trio.CapacityLimiter(max(1, concurrency))

    async def run(i: int) -> None:
        async with limit:
            await fn(i)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(run, i)


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
def open_remote_store_sync(path: str | os.PathLike[str]) -> Iterator[SyncRemoteStore]:
    """A :class:`SyncRemoteStore` on the daemon at ``path``, checked with a ping."""
    store = SyncRemoteStore(path)
    try:
        store.ping()
        yield store
    finally:
        store.close()
