"""The daemon's control channel: a Unix socket speaking msgpack, and its clients.

Wire format: every message is a 4-byte big-endian length and a msgpack body. A request is
``[method, args, kwargs]``; the answer is ``[0, result]`` or ``[1, error_type, message]``.
One request at a time per connection; clients open several connections for concurrency.
A client of another protocol (curl on the socket) is answered and dropped at its first
bytes: they announce a frame of hundreds of MiB whose body is no request.
Records (:class:`PageInfo`, :class:`SessionInfo`, :class:`StoreStatistics`) travel as maps
tagged with their type and come back as the same frozen dataclasses. A page (a bin over
INLINE_BYTES near a message's top) is sent from its own buffer, not packed into a body
(:func:`body_pieces`), and the daemon receives it as a view into the frame it read
(:func:`decode`): one copy of it in the daemon; the bytes on the wire are msgpack's.

Permissions: the socket is made mode 0600 right after ``bind`` and every connection's peer
is checked with ``SO_PEERCRED``: only the daemon's own user (and root) is served, so the
instant between ``bind`` and ``chmod`` grants nothing. Clients check the daemon the same way
(:func:`check_daemon_peer`): one run by another user is refused, whoever put its socket there.

:func:`control_service` is a daemon service (``run_daemon(services=[...])``);
:class:`RemoteStore` has the interface of :class:`~kvfs.Store` over the socket, and
:class:`SyncRemoteStore` that of :class:`~kvfs.SyncStore` (the CLI's).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import functools
import logging
import math
import os
import resource
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import trio

from . import _errors
from ._budget import ByteBudget
from ._events import disk_error_due, files_error_due, log_event
from ._keys import PageKey, as_key
from ._local import disk_failed
from ._store import Store
from ._types import DeviceStatistics, Extent, PageInfo, SessionInfo, StoreStatistics

__all__ = [
    "METHODS",
    "DaemonUnavailable",
    "control_service",
    "decode",
    "encode",
    "log_event",
    "read_frame_sync",
    "recv_frame",
    "send_frame",
]

log = logging.getLogger("kvfs.control")

#: Store methods served over the channel (``begin_write`` is not: use ``put``).
METHODS = frozenset(
    {
        "put",
        "get",
        "read_range",
        "stat",
        "exists",
        "list",
        "sessions",
        "session_info",
        "set_session_attrs",
        "delete",
        "delete_session",
        "rename",
        "pin",
        "unpin",
        "pin_session",
        "unpin_session",
        "evict",
        "fsck",
        "statistics",
        "spill",
        "restore",
        "archived_sessions",
        "archive_hosts",
        "ping",
        "identity",
    }
)
MAX_FRAME = 1 << 31
_HDR = struct.Struct(">I")
_BIN32 = struct.Struct(">BI")  # msgpack's bin 32 header: 0xc6 and the length
_RECORDS: dict[str, type] = {
    c.__name__: c for c in (PageInfo, SessionInfo, StoreStatistics, DeviceStatistics, Extent)
}
_TUPLES = {"extents", "devices"}


class DaemonUnavailable(_errors.KvfsError, ConnectionError):  # type: ignore[misc]
    """No daemon answers on the control socket, or it went away during a call."""


class DaemonBusy(DaemonUnavailable):
    """A daemon listens on the control socket but accepted no connection in time (its
    backlog full): it is there, so its socket is no leftover."""


#: msgpack extension type of a record (PageInfo, Extent...): [name, fields]. Out of band:
#: a tag key inside ordinary maps made a user's attribute named "__t" decode as a record,
#: or fail the whole answer.
_RECORD_EXT = 1


#: How strings that are not UTF-8 cross the channel: as the bytes they stand for. A file
#: name is bytes (an orphan a data directory holds, which fsck names; os.fsdecode gives
#: such a string), and an answer holding one could not be packed: the connection failed
#: and the client was told the daemon had died. (Key names are UTF-8: both sides check.)
_NAMES = "surrogateescape"


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _RECORDS:
        d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        body = msgpack.packb(
            [type(obj).__name__, d], default=_default, use_bin_type=True, unicode_errors=_NAMES
        )
        return msgpack.ExtType(_RECORD_EXT, body)
    if isinstance(obj, PageKey):
        return obj.path
    if isinstance(obj, tuple):
        return list(obj)
    if type(obj).__module__ == "numpy" and getattr(obj, "shape", None) == ():
        # a numpy scalar (np.bool_, np.int64) as the Python value it is. Sent as its bytes
        # (it has a buffer), replace=np.False_ arrived as b"\x00", true: a page was replaced
        return obj.item()
    # (page data goes as a memoryview, which msgpack packs itself; any other buffer here
    # is an argument that would arrive as bytes, not as what it meant)
    raise TypeError(f"cannot send {type(obj).__name__} over the control channel")


def _ext(code: int, data: bytes) -> Any:
    if code != _RECORD_EXT:
        return msgpack.ExtType(code, data)
    name, d = msgpack.unpackb(
        data, ext_hook=_ext, raw=False, strict_map_key=False, unicode_errors=_NAMES
    )
    for k in _TUPLES & d.keys():
        d[k] = tuple(d[k])
    cls = _RECORDS[name]
    # A field this kvfs does not know (a newer daemon's: PageInfo gained pin_until) is
    # left out: the record still means what this side reads of it
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})


def packed(obj: Any) -> bytes:
    """A message's body. Raises FrameTooLarge past MAX_FRAME (the peer would drop the
    connection, and the caller was told the daemon died)."""
    try:
        body = msgpack.packb(obj, default=_default, use_bin_type=True, unicode_errors=_NAMES)
    except UnicodeEncodeError:
        raise  # (a lone surrogate no bytes stand for: it was told as a message "too large")
    except ValueError as e:  # msgpack: a bytes object over 4 GiB
        raise FrameTooLarge(f"a message too large for the control channel ({e})") from None
    if len(body) > MAX_FRAME:
        raise _too_large(len(body))
    return body


def _too_large(n: int) -> FrameTooLarge:
    return FrameTooLarge(
        f"a message of {n} bytes is over the control channel's {MAX_FRAME} "
        "(pages that large: through the mount, or the object API in the daemon's process)"
    )


def body_pieces(obj: Any) -> list[bytes | memoryview]:
    """A message's body as the pieces to send: together the bytes of :func:`packed`, but a
    buffer over INLINE_BYTES near the top (a put's data, a get's answer) is a piece of its
    own behind its bin header, not copied into one packed body (that copy held the page
    twice, in the daemon and in the client). Raises FrameTooLarge past MAX_FRAME."""
    if not _carries_page(obj):
        return [packed(obj)]
    pieces: list[bytes | memoryview] = []
    _pack_into(pieces, obj, 2)
    n = sum(len(p) for p in pieces)
    if n > MAX_FRAME:
        raise _too_large(n)
    return pieces


def _pack_into(pieces: list[bytes | memoryview], obj: Any, depth: int) -> None:
    """Append ``obj``'s msgpack to ``pieces``, descending ``depth`` levels of lists."""
    page = isinstance(obj, (bytes, bytearray, memoryview)) and len(obj) > INLINE_BYTES
    if page:
        view = memoryview(obj).cast("B")  # (flat: a put's data was made so, bytes are)
        if len(view) > MAX_FRAME:
            raise _too_large(len(view))
        small = _BIN32.pack(0xC6, len(view))
    elif depth and isinstance(obj, list):
        small = msgpack.Packer().pack_array_header(len(obj))
    else:
        small = packed(obj)
    if pieces and isinstance(pieces[-1], bytes):
        pieces[-1] += small
    else:
        pieces.append(small)
    if page:
        pieces.append(view)
    elif depth and isinstance(obj, list):
        for x in obj:
            _pack_into(pieces, x, depth - 1)


class FrameTooLarge(ValueError):
    """A request or an answer over the control channel's frame limit."""


def encode(obj: Any) -> bytes:
    """One framed message."""
    body = packed(obj)
    return _HDR.pack(len(body)) + body


class ForeignFrame(ValueError):
    """A frame that cannot be a request of this protocol: a client of another one (an HTTP
    request's ``GET `` read as a length of 1.2 GB). Its body cannot be skipped."""


class MalformedFrame(ValueError):
    """A whole frame whose body is no message of this protocol (the stream stays usable)."""


def decode(
    body: bytes | bytearray | memoryview, *, views: bool = False, request: bool = False
) -> Any:
    """A message from its body. With ``views``, a bin over INLINE_BYTES near the top (a
    put's data, a get's answer) comes as a memoryview into ``body``: msgpack copies every
    bin into a new bytes, and the receiver held the page twice. With ``request`` (the
    daemon's side), a body over INLINE_BYTES holds at most MAX_REQUEST_ITEMS msgpack items,
    and records stay msgpack ExtTypes (no request carries one). Raises MalformedFrame."""
    # A request is a few items and perhaps a page. Unpacked whatever it held, a frame of
    # empty arrays took 64 bytes of the daemon's memory for each byte of it (a 32 MiB one
    # 2 GiB, and minutes of walking it), and a record's own msgpack inside could hold as
    # many: any client could have the daemon killed for want of memory.
    ext = msgpack.ExtType if request else _ext
    try:
        if views and len(body) > INLINE_BYTES:
            spans = _page_spans(memoryview(body), MAX_REQUEST_ITEMS if request else None)
        else:
            spans = []
        if not spans:
            return msgpack.unpackb(
                body, ext_hook=ext, raw=False, strict_map_key=False, unicode_errors=_NAMES
            )
        return _unpack_around(memoryview(body), spans, ext)
    except Exception as e:  # noqa: BLE001 - msgpack's own errors, an unknown record...
        raise MalformedFrame(f"{type(e).__name__}: {e}") from None


#: msgpack's types of a fixed size by their first byte: the bytes after it (nil, booleans,
#: numbers, fixext)
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
#: the others (bin, ext, str, array, map 8/16/32): the width of their length, the bytes
#: between it and the payload (ext's type), the items per count (arrays 1, maps 2; 0: bytes)
_SIZED = {0xC4: (1, 0, 0), 0xC5: (2, 0, 0), 0xC6: (4, 0, 0), 0xC7: (1, 1, 0), 0xC8: (2, 1, 0)}
_SIZED |= {0xC9: (4, 1, 0), 0xD9: (1, 0, 0), 0xDA: (2, 0, 0), 0xDB: (4, 0, 0), 0xDC: (2, 0, 1)}
_SIZED |= {0xDD: (4, 0, 1), 0xDE: (2, 0, 2), 0xDF: (4, 0, 2)}


def _item(b: memoryview, at: int) -> tuple[int, int, int]:
    """The msgpack item at ``at``: (where its payload starts, its payload's bytes, its
    items). Raises IndexError or KeyError for a truncated or an unknown one."""
    t = b[at]
    if t < 0x80 or t >= 0xE0:  # fixint
        return at + 1, 0, 0
    if t < 0xA0:  # fixmap, fixarray
        return at + 1, 0, (t & 0x0F) * (2 if t < 0x90 else 1)
    if t < 0xC0:  # fixstr
        return at + 1, t & 0x1F, 0
    if t in _FIXED:
        return at + 1, _FIXED[t], 0
    width, gap, per = _SIZED[t]
    if at + 1 + width > len(b):
        raise IndexError("truncated")
    n = int.from_bytes(b[at + 1 : at + 1 + width], "big")
    return at + 1 + width + gap, 0 if per else n, n * per


def _spend(budget: list[int] | None, items: int) -> None:
    """Take ``items`` from ``budget`` (a one-item list); raises ValueError past it."""
    if budget is not None:
        budget[0] -= items
        if budget[0] < 0:
            raise ValueError(f"a request of more than {MAX_REQUEST_ITEMS} msgpack items")


def _end(b: memoryview, at: int, budget: list[int] | None = None) -> int:
    """Where the msgpack item at ``at`` ends; the items in it taken from ``budget``."""
    start, size, items = _item(b, at)
    _spend(budget, items)  # (before the walk: an array's count alone can be 4 billion)
    at = start + size
    for _ in range(items):
        at = _end(b, at, budget)
    if at > len(b):
        raise IndexError("truncated")
    return at


def _page_spans(
    b: memoryview, max_items: int | None = None
) -> list[tuple[tuple[int, ...], int, int, int]]:
    """Each bin over INLINE_BYTES in the top two levels of arrays: (its index path, where
    its header starts, where its bytes start and end). Nothing when ``b`` is no whole
    msgpack item (msgpack then says what is wrong). With ``max_items``, raises ValueError
    for a message of more items, or nested too deep to walk (which msgpack would unpack)."""
    spans: list[tuple[tuple[int, ...], int, int, int]] = []
    budget = None if max_items is None else [max_items]

    def walk(at: int, path: tuple[int, ...]) -> int:
        start, size, items = _item(b, at)
        if b[at] == 0xC6 and size > INLINE_BYTES and start + size <= len(b):
            spans.append((path, at, start, start + size))
            return start + size
        if len(path) < 2 and (0x90 <= b[at] <= 0x9F or b[at] in (0xDC, 0xDD)):
            _spend(budget, items)
            for i in range(items):
                start = walk(start, (*path, i))
            return start
        return _end(b, at, budget)

    try:
        walk(0, ())
    except (IndexError, KeyError):
        return []
    except RecursionError:
        if budget is not None:  # (the items past it were not counted)
            raise ValueError("a request nested too deep") from None
        return []
    return spans


def _unpack_around(
    b: memoryview,
    spans: list[tuple[tuple[int, ...], int, int, int]],
    ext: Callable[[int, bytes], Any] = _ext,
) -> Any:
    """The message in ``b`` with each span's bin a view into ``b``: the rest is unpacked
    (extension types by ``ext``) with a nil in each one's place (a copy of the small parts
    only), then the views put in."""
    parts: list[bytes | memoryview] = []
    at = 0
    for _path, head, _start, end in spans:
        parts += [b[at:head], b"\xc0"]
        at = end
    parts.append(b[at:])
    msg = msgpack.unpackb(
        b"".join(parts), ext_hook=ext, raw=False, strict_map_key=False, unicode_errors=_NAMES
    )
    for path, _head, start, end in spans:
        if not path:
            return b[start:end]
        within = msg
        for i in path[:-1]:
            within = within[i]
        within[path[-1]] = b[start:end]
    return msg


def _error_class(name: str) -> type[BaseException]:
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, _errors.KvfsError):
        return cls
    builtin = {
        "ValueError": ValueError,
        "FileNotFoundError": FileNotFoundError,
        "PermissionError": PermissionError,
        "TypeError": TypeError,
        "FileExistsError": FileExistsError,
        "OSError": OSError,
    }
    return builtin.get(name, _errors.KvfsError)


def error_reply(e: BaseException) -> list[Any]:
    """The answer to a call that failed with ``e``: ``[1, class name, message, errno]``
    (the errno of an OSError, e.g. a failing disk's EIO; None for others; a client older
    than it reads the first three)."""
    return [1, type(e).__name__, str(e), e.errno if isinstance(e, OSError) else None]


def raise_remote(name: str, message: str, err: int | None = None) -> None:
    """Raise the error the daemon reported, as the same class where kvfs knows it, with
    its errno (a disk's EIO came back as an OSError whose errno was None)."""
    exc = _error_class(name)(message)
    if err is not None and isinstance(exc, OSError) and not isinstance(exc, _errors.KvfsError):
        exc.errno = err
    raise exc


# -- server ------------------------------------------------------------------------------
def _peer_uid(sock: trio.socket.SocketType | socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


#: A peer that stops sending, or reading, in the middle of a message for this long is
#: dropped (between messages a connection may idle for ever: clients pool them).
STALL_SECONDS = 60.0
#: Bodies up to this size are unpacked on the trio loop; larger ones in a thread: a 512 MiB
#: page stalled the loop, and the mount's requests with it, for a second. A bin over this
#: size near a message's top is a page, sent and received without a copy of it.
INLINE_BYTES = 1 << 20
_ZEROS = memoryview(bytes(INLINE_BYTES))
#: The most msgpack items a request over INLINE_BYTES may hold (its page is one): as many
#: as a frame of INLINE_BYTES can, so a large frame costs the daemon no more to unpack.
MAX_REQUEST_ITEMS = INLINE_BYTES


def default_page_budget() -> int:
    """The bytes of pages the daemon holds for the control channel at once, over every
    connection: a put's page as it is received and stored, a get's as it is read and sent.
    A quarter of the host's memory, 1 GiB at least: a guard against running out of it, not a
    limit on throughput (clients getting 512 MiB pages at once, or stuck not reading them,
    each held one in the daemon, with no limit on their number)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 0
    return max(1 << 30, memory // 4)


class _Held:
    """The bytes one connection holds of the daemon's page budget: its request's page, then
    its answer's, given back once it is answered (and when the connection ends). Entered,
    it is the connection's, for :func:`recv_frame` and the get calls to take from."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.n = 0

    async def take(self, n: int) -> None:
        await self.budget.take(n)
        self.n += n

    def release(self) -> None:
        if self.n:
            self.budget.give(self.n)
            self.n = 0

    async def __aenter__(self) -> _Held:
        _HELD.set(self)  # (the connection's task's own context)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


#: the serving connection's share of the page budget (each connection is a task of its own)
_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("_HELD", default=None)


#: The first byte of every request's body: msgpack's array of three ([method, args, kwargs]).
_REQUEST_LEAD = 0x93


async def recv_frame(
    stream: trio.SocketStream, *, request: bool = False, views: bool = False
) -> Any:
    """One decoded message. Returns ``None`` at a clean EOF between messages; raises
    EOFError when the peer closes or stalls mid-message, FrameTooLarge for a header
    announcing more than MAX_FRAME (its body is not read), MalformedFrame for a whole frame
    that is no message (msgpack's nil included). With ``request`` (the daemon's side),
    ForeignFrame as soon as the body of a frame over INLINE_BYTES starts with anything but
    a request's first byte, and
    a put's data comes as a view into the frame's buffer (see :func:`decode`), as does a
    get's answer with ``views``."""
    hdr = await _recv_into(stream, bytearray(4), eof_ok=True)
    if hdr is None:
        return None
    (n,) = _HDR.unpack(hdr)
    if n > MAX_FRAME:
        raise FrameTooLarge(
            f"a control frame of {n} bytes is over the control channel's {MAX_FRAME}"
        )
    # Any text protocol's first 4 bytes read as a length of 512 MiB or more: its client
    # (curl on the socket) waited STALL_SECONDS for the rest of a body it never meant to
    # send. A frame that large is a put, whose body starts as every request's does; one
    # that does not is refused at its first byte. (Small ones are read whole and answered,
    # the stream still in step.)
    lead = _REQUEST_LEAD if request and n > INLINE_BYTES else None
    body = await _recv_body(stream, n, lead, _HELD.get() if lead is not None else None)
    if n > INLINE_BYTES:
        msg = await trio.to_thread.run_sync(
            functools.partial(decode, body, views=request or views, request=request)
        )
    else:
        msg = decode(body, request=request)
    if msg is None:
        # (msgpack's nil is no message either way, and returned it read as an EOF: the
        # daemon closed the connection without an answer, as if the client had left)
        raise MalformedFrame("a nil message")
    return msg


async def _recv_body(
    stream: trio.SocketStream, n: int, lead: int | None = None, held: _Held | None = None
) -> bytearray:
    """``n`` bytes, the buffer grown as they arrive: a header announcing 2 GiB and nothing
    after it held (and zero-filled, on the loop) 2 GiB until the peer left. Raises
    ForeignFrame when ``lead`` is given and the first byte is another. With ``held``, the
    ``n`` bytes are taken from the page budget once the first byte is checked, before the
    buffer grows past its first MiB (the client waits meanwhile, sending)."""
    buf, got = bytearray(min(n, INLINE_BYTES)), 0
    while got < n:
        if got == len(buf):
            # By INLINE_BYTES at a time (the bytearray's realloc grows it in place): doubled
            # from a new zero-filled bytes, each step held half the frame once more.
            buf += _ZEROS[: min(INLINE_BYTES, n - len(buf))]
        with memoryview(buf) as view, view[got:] as free:
            with trio.move_on_after(STALL_SECONDS) as waited:
                k = await stream.socket.recv_into(free)
        if waited.cancelled_caught:
            raise EOFError(f"the peer sent nothing for {STALL_SECONDS:g} s mid-message")
        if not k:
            raise EOFError("connection closed mid-message")
        if got == 0 and lead is not None and buf[0] != lead:
            raise ForeignFrame(
                f"a control frame of {n} bytes whose body starts with {bytes(buf[:8])!r} "
                "is no kvfs request (a client of another protocol?)"
            )
        if got == 0 and held is not None:
            # (after the check: curl on the socket, announcing a length of 1.2 GB, waited
            # for that much of the budget before it was refused)
            await held.take(n)
        got += k
    return buf


async def _recv_into(
    stream: trio.SocketStream, buf: bytearray, *, eof_ok: bool
) -> bytearray | None:
    """``buf`` filled from the stream (a frame's header); None at a clean EOF before its
    first byte with ``eof_ok``. Raises EOFError when the peer closes after that byte, or
    sends nothing more for STALL_SECONDS: a peer that sent part of a header and stopped
    was kept for ever (one between messages may idle: clients pool connections)."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        with trio.move_on_after(STALL_SECONDS if got else math.inf) as waited:
            k = await stream.socket.recv_into(view[got:])
        if waited.cancelled_caught:
            raise EOFError(f"the peer sent nothing for {STALL_SECONDS:g} s mid-message")
        if not k:
            if got == 0 and eof_ok:
                return None
            raise EOFError("connection closed mid-message")
        got += k
    return buf


async def send_frame(stream: trio.SocketStream, obj: Any) -> None:
    """Send one message (a page in it goes as it is, not copied into a packed body: see
    :func:`body_pieces`). An answer too large for a frame goes as the error saying so.
    Raises EOFError when the peer stops reading mid-message for STALL_SECONDS (an unread
    answer of a page held its bytes in the daemon for as long as the client lived)."""
    try:
        pieces = body_pieces(obj)
    except FrameTooLarge as e:
        if not (isinstance(obj, list) and obj and obj[0] == 0):
            raise
        pieces = [packed([1, "ValueError", str(e)])]
    n = sum(len(p) for p in pieces)
    if n < 1 << 16:
        await stream.send_all(b"".join([_HDR.pack(n), *pieces]))
        return
    await stream.send_all(_HDR.pack(n))
    for piece in pieces:
        with memoryview(piece) as view:
            for at in range(0, len(view), INLINE_BYTES):
                with trio.move_on_after(STALL_SECONDS) as waited:
                    await stream.send_all(view[at : at + INLINE_BYTES])
                if waited.cancelled_caught:
                    raise EOFError(f"the peer read nothing for {STALL_SECONDS:g} s mid-message")


def _carries_page(obj: Any) -> bool:
    """A message holding a large buffer (a put's data, a get's answer) near its top."""
    items = obj if isinstance(obj, list) else [obj]
    for x in items:
        for y in x if isinstance(x, list) else [x]:
            if isinstance(y, (bytes, bytearray, memoryview)) and len(y) > INLINE_BYTES:
                return True
    return False


async def _serve_one(store: Store, stream: trio.SocketStream, budget: ByteBudget) -> None:
    uid = _peer_uid(stream.socket)
    if uid not in (os.getuid(), 0):
        log.warning("control: refused a connection from uid %d", uid)
        log_event("error", level=logging.WARNING, what="control connection refused", uid=uid)
        await _answer_and_close(
            stream, [1, "PermissionError", f"uid {uid} may not use this kvfs daemon"]
        )
        return
    async with stream, _Held(budget) as held:
        while True:
            held.release()  # (what the last request held: it is answered)
            try:
                request = await recv_frame(stream, request=True)
            except MalformedFrame as e:  # a whole frame: the next one can still be read
                await send_frame(stream, [1, "ValueError", f"malformed control request: {e}"])
                continue
            except (FrameTooLarge, ForeignFrame) as e:
                # The peer's mistake (another protocol, a stray write): answered, and the
                # connection closed, since the body it announced cannot be skipped. (It was
                # dropped without a word, the client told the daemon had died, and the log
                # got a traceback.)
                log.warning("control: closed a connection: %s", e)
                held.release()  # (its close waits up to 5 s for the peer: not with budget)
                await _answer_and_close(stream, [1, "ValueError", str(e)])
                return
            if request is None:
                return
            await _answer(store, stream, request)
            # Let go of the request (a put's page) now: kept until the next request came,
            # an idle pooled connection held its last page in the daemon.
            del request


async def _answer(store: Store, stream: trio.SocketStream, request: Any) -> None:
    """Carry out one decoded request and send its answer."""
    if not (
        isinstance(request, list)
        and len(request) == 3
        and isinstance(request[0], str)
        and isinstance(request[1], list)
        and isinstance(request[2], dict)
        and all(isinstance(k, str) for k in request[2])
    ):
        # (it was unpacked as it came: the connection dropped with a traceback in the log,
        # and the client was told the daemon had died)
        why = "malformed control request: not [method, [args], {kwargs}]"
        await send_frame(stream, [1, "ValueError", why])
        return
    method, args, kwargs = request
    if method in _WITH_PROGRESS and kwargs.pop("progress", False):
        await _with_progress(store, stream, method, args, kwargs)
        return
    await send_frame(stream, await _dispatch(store, method, args, kwargs))


async def _answer_and_close(stream: trio.SocketStream, reply: list[Any]) -> None:
    """Send ``reply`` and close a connection that cannot go on."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(encode(reply))
        await stream.send_eof()
        # Read what the client sent until it closes: closing with unread data would
        # reset the connection and could discard the answer before the client reads it.
        with trio.move_on_after(5):
            while await stream.receive_some(65536):
                pass
    await stream.aclose()


async def _dispatch(
    store: Store, method: str, args: list[Any], kwargs: dict[str, Any]
) -> list[Any]:
    if method not in METHODS:
        return [1, "ValueError", f"unknown control method {method!r}"]
    t0 = time.perf_counter()
    try:
        if method == "ping":
            result: Any = True
        elif method == "identity":
            result = _identity(store)
        elif method == "get":
            result = await _read_page(store, *args, **kwargs)
        elif method == "read_range":
            await _hold_answer(store, args, kwargs)
            result = await store.read_range(*args, **kwargs)
        else:
            result = await getattr(store, method)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the client
        _log_failure(store, method, args, kwargs, e)
        return error_reply(e)
    _log_done(method, args, kwargs, result, t0)
    return [0, result]


async def _read_page(store: Store, path: str, *, room: int | None = None) -> Any:
    """A page for a get's answer. A large one is read into a buffer of its own and sent
    from it: ``store.get``'s bytes were a copy of its read buffer (and the packed answer,
    before, a third). With ``room`` (a client's buffer of that many bytes), a page that
    cannot fit is refused before it is read, so a page only the archive holds is not
    restored for nothing. Raises TypeError, ValueError for a ``room`` that is no count of
    bytes (a client's own: the object API never sends one)."""
    if room is not None and type(room) is not int:
        # (a str failed deep in the read: "'>' not supported between 'int' and 'str'")
        raise TypeError(f"a get's room is a number of bytes, not {room!r}")
    if room is not None and room < 0:
        raise ValueError(f"a get's room is a number of bytes >= 0, not {room}")
    held = _HELD.get()
    if held is None:
        got = await store._read_page(path, room)
    else:
        # A page over 1 MiB comes back as its size, unread: it takes from the budget, then
        # is read. (Taken before the read by a lookup of its own, on the loop, a small get
        # through the channel cost a tenth more; this way it costs nothing.)
        held.release()  # (the request's frame, decoded: see _hold_answer)
        got = await store._read_page(path, room, INLINE_BYTES)
        if isinstance(got, int):
            await held.take(got)
            got = await store._read_page(path, room)
    assert not isinstance(got, int)
    return bytes(got) if len(got) <= INLINE_BYTES else got


async def _hold_answer(store: Store, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Take a read_range's bytes from the connection's share of the budget before they are
    read (sized by the page's row, read on the loop as the mount's lookups are). A call
    that will fail on its own arguments, or a page not there, takes nothing."""
    held = _HELD.get()
    if held is None:
        return
    # The request is decoded: what its frame took goes back before the answer takes. (A get
    # whose frame was over 1 MiB waited, holding it, for room it kept from itself: for
    # ever, and the budget with it.)
    held.release()
    names = ("key", "offset", "size")  # (as read_range names them)
    a = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    off, size = a.get("offset"), a.get("size")
    if not (type(off) is int and type(size) is int and off >= 0 and size > INLINE_BYTES):
        return  # (a small range, or one the call refuses: no lookup for it)
    try:
        row = store.engine.index.page(as_key(a["key"]).path)
    except Exception:  # noqa: BLE001 - the call itself says what is wrong
        return
    n = 0 if row is None else max(0, min(size, row.size - off))
    if n > INLINE_BYTES:
        await held.take(n)


def _identity(store: Store) -> dict[str, Any]:
    """Which store this daemon serves (its lock file names it): a client given a socket
    (``--socket``, ``$KVFS_CONTROL_SOCKET``) and a data directory checks that they are
    the same store."""
    return {
        "lock": os.path.realpath(store.config.lock_path),
        "data_dirs": [os.path.realpath(d) for d in store.config.data_dirs],
        "pid": os.getpid(),
    }


def _log_failure(
    store: Store, method: str, args: list[Any], kwargs: dict[str, Any], e: Exception
) -> None:
    """The event line of a failed call. A caller's mistake (no such page, bad key, an
    argument of the wrong type or number, spill or restore where no archive tier is
    configured) or a full cache (the capacity) is a warning; a failing disk's error
    (IndexUnavailable, a data disk's I/O error) a warning, one line per
    DEVICE_ERROR_LOG_SECONDS with the count of those since (``more``), as the mount says
    it, and so is a daemon out of file descriptors (EMFILE, ENFILE); anything else an
    error."""
    # (every call fails so while the disk is down, or no descriptor is left: an engine's
    # hundreds of gets a second were as many ERROR lines)
    due = disk_error_due if disk_failed(e) else None
    if due is None and _errors.out_of_files(e):
        due = files_error_due
    if due is not None:
        more = due(store)
        if more is not None:
            log_event(
                "error",
                level=logging.WARNING,
                method=method,
                target=_target(args, kwargs),
                error=type(e).__name__,
                message=_short(str(e)),
                **({"more": more} if more else {}),
            )
        return
    # (TypeError: what a call's arguments get, from Python or the store's checks, as
    # ValueError their values: a client's mistake was an ERROR in the daemon's log)
    expected = isinstance(
        e, (FileNotFoundError, FileExistsError, ValueError, TypeError, _errors.CapacityExceeded)
    ) or (isinstance(e, _errors.ArchiveUnavailable) and not store.engine.config.archive_url)
    # A lookup that finds nothing is an answer, not a failure: `kvfs pin NAME` asks
    # whether NAME is a page before it asks for the session, every time, and an engine's
    # get of a page it has not stored is a cache miss (a soak's log held ~545 such
    # warnings a minute; the statistics count misses).
    lookup = method in _LOOKUPS and isinstance(e, FileNotFoundError)
    log_event(
        "error",
        level=logging.DEBUG if lookup else logging.WARNING if expected else logging.ERROR,
        method=method,
        target=_target(args, kwargs),
        error=type(e).__name__,
        message=_short(str(e)),
    )


#: the methods whose "not found" is an answer (logged at DEBUG only)
_LOOKUPS = frozenset({"stat", "session_info", "exists", "get", "read_range"})


def _log_done(method: str, args: list[Any], kwargs: dict[str, Any], result: Any, t0: float) -> None:
    """The event line a finished spill or restore leaves in the daemon's log (an evict's is
    the engine's own: every evict logs one, asked over the channel or not)."""
    if method in ("spill", "restore"):
        log_event(
            method, target=_target(args, kwargs), bytes=result, seconds=time.perf_counter() - t0
        )


def _target(args: list[Any], kwargs: dict[str, Any]) -> str:
    x = args[0] if args and args[0] is not None else kwargs.get("session") or kwargs.get("key")
    if x is None:
        return "-"
    if not isinstance(x, (str, int, float)):
        return f"<{type(x).__name__}>"  # (a client's odd argument: its repr can be any size)
    return _short(str(x))


#: the most characters of a client's argument or of an error message an event line holds
LOG_TEXT_MAX = 300


def _short(text: str) -> str:
    """``text`` cut to LOG_TEXT_MAX characters for the log: a request's key, and the
    message quoting it, went into the event line whole (a key of 1 GiB, a line of 1 GiB,
    per request)."""
    if len(text) <= LOG_TEXT_MAX:
        return text
    return f"{text[:LOG_TEXT_MAX]}... ({len(text)} characters)"


async def control_service(
    store: Store,
    path: str | os.PathLike[str] | None = None,
    *,
    page_budget: int | None = None,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``store`` on its control socket until cancelled; reports the socket's path.
    ``page_budget``: the bytes of pages held for its connections at once
    (:func:`default_page_budget`).

    The path is ``path``, else derived from the store's config (``extra['daemon']
    ['control_socket']`` or beside the lock file: :func:`kvfs._settings.control_socket_path`).
    A leftover socket nothing answers on is replaced. Anything else there is refused: a
    socket another daemon serves (one given the same ``--socket``, or the same
    ``KVFS_CONTROL_SOCKET``, took it over silently, and commands meant for this store went
    to the other) or a file that is no socket (it was deleted). The socket is removed at
    exit. Raises OSError (FileExistsError for those two).
    """
    from ._settings import config_socket_path

    sock_path = Path(path) if path else config_socket_path(store.config)
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    _claim(sock_path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(os.fspath(sock_path))
        os.chmod(sock_path, 0o600)
        bound = os.lstat(sock_path).st_ino
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    listener = trio.SocketListener(sock)
    budget = ByteBudget(default_page_budget() if page_budget is None else page_budget)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await _serve_one(store, stream, budget)
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError, ConnectionError):
            pass  # the client went away
        except Exception:  # noqa: BLE001 - one bad client must not stop the daemon
            log.exception("control: connection failed")

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_accept, store, listener, handler)
            log.info("control channel on %s", sock_path)
            task_status.started(sock_path)
            await trio.sleep_forever()
    finally:
        # Only its own: where the file was deleted and another daemon bound the path
        # since, removing it cut that daemon's clients off.
        try:
            if os.lstat(sock_path).st_ino == bound:
                sock_path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            # (a directory gone read-only: raised, it made a clean stop exit 1, a failure
            # to systemd; the next daemon replaces the leftover, which nothing answers on)
            log.warning("control: could not remove %s: %s", sock_path, e.strerror)


#: accept's errors for a daemon out of descriptors or memory: wait, and try again
_ACCEPT_LATER = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: how long accept waits after one of those (as trio.serve_listeners)
ACCEPT_RETRY_SECONDS = 0.1


async def _accept(
    store: Store,
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on ``listener``, each served by ``handler`` in a task, until
    cancelled. trio.serve_listeners' loop, but an accept that fails for want of descriptors
    (EMFILE, ENFILE) or memory is said as the mount says it, a WARNING per
    DEVICE_ERROR_LOG_SECONDS with a count of the rest: trio's logged an ERROR with a
    traceback every 0.1 s while a client waited. The client waits in the backlog, and is
    accepted once a descriptor is free (or gives up: DaemonUnavailable)."""
    async with listener, trio.open_nursery() as handlers:
        task_status.started()
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in _ACCEPT_LATER:
                    raise
                more = files_error_due(store)
                if more is not None:
                    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                    log.warning(
                        "control: cannot accept a connection: %s (the daemon's open files "
                        "limit is %s); it waits%s",
                        e.strerror,
                        "unlimited" if soft == resource.RLIM_INFINITY else soft,
                        f"; {more} more such errors since the last of these lines" if more else "",
                    )
                await trio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            handlers.start_soon(handler, stream)


# -- blocking client pieces (shared with kvfs._remote) ------------------------------------
def _claim(sock_path: Path) -> None:
    """Remove a stale socket at ``sock_path``; raise FileExistsError for anything else."""
    try:
        st = os.lstat(sock_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            f"control socket {sock_path}: a file that is no socket is there (not replaced)"
        )
    try:
        connect_sync(sock_path, timeout=5).close()
    except DaemonUnavailable as e:
        if not isinstance(e, DaemonBusy):  # (a busy daemon is there: refused below)
            sock_path.unlink(missing_ok=True)  # a daemon's leftover: nobody answers on it
            return
    raise FileExistsError(
        f"control socket {sock_path}: another kvfs daemon answers on it (give this one "
        "its own --socket)"
    )


def connect_sync(path: str | os.PathLike[str], timeout: float | None = None) -> socket.socket:
    """A connected socket to the daemon. Raises DaemonUnavailable when nothing listens."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(os.fspath(path))
            break
        except OSError as e:
            s.close()
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.ENOTDIR):
                raise DaemonUnavailable(f"no kvfs daemon answers on {path}") from e
            if e.errno != errno.EAGAIN and not isinstance(e, TimeoutError):
                raise
            # Its backlog is full (a Unix socket with a timeout says EAGAIN at once):
            # tried again until the timeout, then a daemon that is there but busy.
            if deadline is None or time.monotonic() >= deadline:
                raise DaemonBusy(f"the kvfs daemon on {path} accepts no connection") from e
            time.sleep(0.01)
    try:
        check_daemon_peer(s, path)
    except BaseException:
        s.close()
        raise
    return s


def check_daemon_peer(
    s: socket.socket | trio.socket.SocketType, path: str | os.PathLike[str]
) -> None:
    """Refuse a daemon run by another user (not root): whoever could put a socket at
    ``path`` would otherwise be sent this user's pages and commands. Root talks to any
    user's daemon. Raises PermissionError."""
    me = os.getuid()
    peer = _peer_uid(s)
    if me != 0 and peer not in (me, 0):
        raise PermissionError(
            errno.EACCES,
            f"the control socket {path} is served by uid {peer}, not by you (uid {me}) or "
            "root: not used",
        )


def read_frame_sync(s: socket.socket, *, views: bool = False) -> Any:
    """One decoded message; raises DaemonUnavailable on EOF (the daemon went away). With
    ``views``, a get's answer is a view into the frame's buffer (see :func:`decode`)."""
    hdr = _recv_sync(s, 4)
    (n,) = _HDR.unpack(hdr)
    return decode(_recv_sync(s, n), views=views)


def _recv_sync(s: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = s.recv_into(view[got:], n - got)
        except ConnectionResetError:
            k = 0
        if not k:
            raise DaemonUnavailable(
                "the kvfs daemon closed the connection mid-command "
                "(it stopped or was killed); the command's effect is unknown"
            )
        got += k
    return buf


#: long operations whose caller may ask for progress frames (their engine method takes a
#: ``progress(done, total)`` callback: contents checked, page bytes archived or restored)
_WITH_PROGRESS = ("fsck", "spill", "restore", "evict")


async def _with_progress(
    store: Store, stream: trio.SocketStream, method: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    """``method`` sending ``[2, done, total]`` frames (at most ten a second) before its
    answer."""
    latest: list[int] = [0, 0]
    done = trio.Event()

    def progress(done: int, total: int) -> None:
        latest[:] = [done, total]

    async def reporter() -> None:
        sent = None
        while not done.is_set():
            with trio.move_on_after(0.1):
                await done.wait()
            if latest != sent and latest[1]:
                sent = list(latest)
                try:
                    await send_frame(stream, [2, *sent])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the client went away (Ctrl-C): the work finishes all the same

    async with trio.open_nursery() as n:
        n.start_soon(reporter)
        try:
            # The store's method, as a call without progress gets: the engine's took its
            # own keywords too (evict's reason: any text a client sent became a reason in
            # the statistics and the metrics, one more counter for each)
            t0 = time.perf_counter()
            result = await getattr(store, method)(*args, progress=progress, **kwargs)
            _log_done(method, args, kwargs, result, t0)
            reply: list[Any] = [0, result]
        except Exception as e:  # noqa: BLE001 - the failure goes back to the client
            _log_failure(store, method, args, kwargs, e)
            reply = error_reply(e)
        finally:
            done.set()
    await send_frame(stream, reply)


def call_sync(
    s: socket.socket,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    on_error: Callable[[str, str, int | None], None] = raise_remote,
    on_progress: Callable[[int, int], None] | None = None,
    views: bool = False,
) -> Any:
    """Send one request and return its result (or raise the daemon's error). Progress
    frames (``[2, done, total]``) before the answer go to ``on_progress``. With ``views``,
    a page answered is a view into the frame's buffer (see :func:`decode`)."""
    pieces = body_pieces([method, list(args), kwargs])
    try:
        s.sendall(_HDR.pack(sum(len(p) for p in pieces)))
        for piece in pieces:
            s.sendall(piece)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise DaemonUnavailable(
            "the kvfs daemon closed the connection (it stopped or was killed)"
        ) from e
    reply = read_frame_sync(s, views=views)
    while reply[0] == 2:
        if on_progress is not None:
            on_progress(reply[1], reply[2])
        reply = read_frame_sync(s, views=views)
    if reply[0] == 0:
        return reply[1]
    # raises, unless the caller raises it later itself
    on_error(reply[1], reply[2], reply[3] if len(reply) > 3 else None)
    return None
