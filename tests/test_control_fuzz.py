"""Whatever bytes a client sends on the control socket, the daemon goes on: every whole
frame gets an answer (an error for what is no request) and the connection stays in step;
what cannot be read to its end is answered and closed, or closed; nothing outside the
public methods is reached, nothing is stored or deleted by a bad request, nothing is held
for a peer that stalls, and the log has no ERROR and no traceback for a client's mistake.

The daemon is the real control service over a real store, in this process (so its log
lines and its descriptors can be seen); the clients are raw Unix sockets."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfs
import kvfs._control as control
from kvfs._control import METHODS, control_service, encode, read_frame_sync
from kvfs._remote import open_remote_store_sync

MakeConfig = Callable[..., kvfs.StoreConfig]

BIG = 3 << 20  # a page sent as a page (over the control channel's INLINE_BYTES)
SEED = {
    "k/1": b"0123456789",
    "sessions/s/p/layer-000": b"abc" * 1000,
    "big/1": bytes(range(256)) * (BIG // 256),
}


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


async def _serving(
    make_config: MakeConfig,
    tmp_path: Path,
    side: Callable[[Path], Any],
    page_budget: int | None = None,
    **config: Any,
) -> Any:
    """``side(socket path)`` in a thread, against a daemon's control service over a store
    holding SEED; then the store is checked as fsck sees it."""
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config(**config)) as store, trio.open_nursery() as n:
        await n.start(functools.partial(control_service, store, sock, page_budget=page_budget))
        for key, data in SEED.items():
            await store.put(key, data)
        await store.set_session_attrs("s", {"model": "m"})
        result = await trio.to_thread.run_sync(side, sock)
        assert not any((await store.fsck()).values())
        n.cancel_scope.cancel()
    return result


def _exchange(s: socket.socket, data: bytes) -> Any:
    """Send ``data`` and read the answer (progress frames skipped); None when the daemon
    closed the connection without one."""
    s.sendall(data)
    try:
        reply = read_frame_sync(s)
        while reply[0] == 2:
            reply = read_frame_sync(s)
    except kvfs.DaemonUnavailable:
        return None
    return reply


def _connect(sock: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)  # (a guard: a daemon that never answers fails the test, not hangs it)
    for _ in range(3000):
        try:
            s.connect(os.fspath(sock))
            return s
        except BlockingIOError:  # the daemon's backlog is full: it accepts as it can
            time.sleep(0.01)
    s.close()
    raise AssertionError("the daemon accepted no connection")


def _state(sock: Path) -> tuple[Any, ...]:
    """What a bad request must not change: every page (its bytes by checksum, its pin, its
    attributes) and every session; and the daemon still stores, reads and deletes."""
    with open_remote_store_sync(sock, timeout=30) as r:
        probe = os.urandom(100)
        r.put("fuzz/probe", probe)
        assert r.get("fuzz/probe") == probe
        r.delete("fuzz/probe")
        pages = sorted((p.path, p.checksum, p.pinned, p.attrs) for p in r.list(path_prefix=""))
        sessions = sorted((s.session, s.pinned, s.attrs, s.pages) for s in r.sessions())
        return tuple(pages), tuple(sessions)


def _no_errors(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged at ERROR, and no traceback: a client's mistake is at most a warning."""
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], [r.getMessage() for r in bad]


# -- whole frames of every shape -------------------------------------------------------------
#: strings that are no key and no session (a request made of them can change nothing)
BAD_NAMES = ["", "..", "a/../b", "a/\x00b", "/abs", ".kvfs/x", "sessions/a/b", "x" * 5000]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.sampled_from(BAD_NAMES)
    | st.binary(max_size=16)
)
_junk = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4)
    ),
    max_leaves=12,
)
_KWARGS = ["room", "progress", "attrs", "pin", "replace", "ttl", "session", "prefix"]
_KWARGS += ["path_prefix", "repair", "archive", "reason", "verify_data", "into", "key"]
_PRIVATE = ["_call", "_read_page", "_run", "__class__", "__init__", "engine", "config"]
_PRIVATE += ["close", "aclose", "begin_write", "read_page", "put_many", "get_many", ""]
#: (every int msgpack can carry: past them the request could not be packed at all, which
#: failed the test in CI's examples, not the daemon)
_methods = st.sampled_from(sorted(METHODS) + _PRIVATE) | st.integers(-(2**63), 2**64 - 1) | _junk
_requests = st.builds(
    lambda m, a, k: _packed([m, a, k]),
    _methods,
    st.lists(_junk, max_size=4) | _junk,
    st.dictionaries(st.sampled_from(_KWARGS) | st.text(max_size=6), _junk, max_size=3) | _junk,
)
_bodies = (
    _requests
    | _junk.map(_packed)
    | st.binary(max_size=64)
    | st.tuples(_requests, st.integers(0, 200)).map(lambda t: t[0][: t[1]])  # cut short
    | st.tuples(_requests, st.binary(min_size=1, max_size=8)).map(lambda t: t[0] + t[1])
    | st.integers(1, 5000).map(lambda n: b"\x93\xa4ping\x91" + b"\x91" * n + b"\x90\x80")
)


async def test_whole_frames_of_any_shape_are_answered_and_change_nothing(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        conn = [_connect(sock)]

        @settings(
            max_examples=250,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(_bodies)
        def one(body: bytes) -> None:
            if conn[0].fileno() < 0:  # (closed after an example that failed)
                conn[0] = _connect(sock)
            s = conn[0]
            try:
                reply = _exchange(s, _frame(body))
            except BaseException:
                s.close()
                raise
            if reply is None:
                s.close()
            # a whole frame is answered, and the connection goes on in step
            assert isinstance(reply, list) and reply[0] in (0, 1), reply
            if reply[0] == 1:
                assert isinstance(reply[1], str) and isinstance(reply[2], str), reply
            assert _exchange(s, encode(["ping", [], {}])) == [0, True]
            assert _state(sock) == before

        try:
            one()
        finally:
            conn[0].close()

    await _serving(make_config, tmp_path, side)
    _no_errors(caplog)


async def test_private_and_unknown_names_reach_nothing(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the public methods are served. With progress asked, the four long calls ran the
    engine's methods, whose own keywords were reached: evict(reason=...) put any text a
    client sent among the statistics' (and the metrics') eviction reasons."""
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        with _connect(sock) as s:
            for name in [*_PRIVATE, "__getattribute__", "__dict__", "_engine", "PING"]:
                reply = _exchange(s, encode([name, [], {}]))
                assert reply[:2] == [1, "ValueError"] and "unknown control method" in reply[2]
            for method, args, kw in [
                ("evict", ["k/1"], {"reason": "injected"}),
                ("fsck", [], {"verify_data": False}),
                ("spill", ["s"], {"bogus": 1}),
            ]:
                reply = _exchange(s, encode([method, args, {**kw, "progress": True}]))
                assert reply[:2] == [1, "TypeError"], reply
                assert "unexpected keyword argument" in reply[2], reply
            for kw in ({"progress": True}, {"into": 5}):  # (progress where none is taken)
                assert _exchange(s, encode(["get", ["k/1"], kw]))[:2] == [1, "TypeError"]
                assert _exchange(s, encode(["put", ["k/2", b"x"], kw]))[:2] == [1, "TypeError"]
        assert _state(sock) == before
        with open_remote_store_sync(sock) as r:
            assert "injected" not in r.statistics().evictions

    await _serving(make_config, tmp_path, side)
    _no_errors(caplog)


async def test_a_callers_wrong_arguments_are_warnings_and_clear_errors(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Arguments of the wrong type or number (a call's TypeError) were logged at ERROR, a
    failure of the daemon, though they are the client's; a get's room of the wrong type
    failed with "'>' not supported between instances of 'int' and 'str'"."""
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        with _connect(sock) as s:
            for request in [
                ["get", [], {}],
                ["list", ["x"], {}],
                ["statistics", [1], {}],
                ["put", ["k/2", 5], {}],
                ["put", ["k/2", b"x"], {"pin": "yes"}],
                ["read_range", ["k/1", 0.5, 1], {}],
                ["fsck", [], {"progress": True, "bogus": 1}],
            ]:
                reply = _exchange(s, encode(request))
                assert reply[:2] == [1, "TypeError"], (request, reply)
            for room, error in [("x", "TypeError"), (True, "TypeError"), (-1, "ValueError")]:
                reply = _exchange(s, encode(["get", ["k/1"], {"room": room}]))
                assert reply[:2] == [1, error] and "room is a number of bytes" in reply[2]
            for room in (10, 2**64 - 1):
                assert _exchange(s, encode(["get", ["k/1"], {"room": room}])) == [0, SEED["k/1"]]
            for offset, size in [(-1, 5), (0, -5), (-(2**63), 1)]:
                reply = _exchange(s, encode(["read_range", ["k/1", offset, size], {}]))
                assert reply[:2] == [1, "ValueError"], reply
            reply = _exchange(s, encode(["read_range", ["k/1", 2, 2**64 - 1], {}]))
            assert reply == [0, SEED["k/1"][2:]]
            long = "x/" + "\x00" * (2 << 20)  # (quoted in InvalidKey's message)
            for request in [["stat", [long], {}], ["stat", [b"x" * 100_000], {}]]:
                assert _exchange(s, encode(request))[:2] == [1, "InvalidKey"]
            for key in BAD_NAMES:
                for method, args in [("put", [key, b"x"]), ("delete", [key]), ("get", [key])]:
                    reply = _exchange(s, encode([method, args, {}]))
                    assert reply[:2] == [1, "InvalidKey"], (method, key, reply)
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side)
    events = [r for r in caplog.records if r.name == "kvfs.events"]
    assert {r.levelname for r in events} <= {"DEBUG", "WARNING"}
    # a client's arguments and the messages quoting them are cut short in the log
    assert max(len(r.getMessage()) for r in events) < 1000
    _no_errors(caplog)


async def test_a_large_frame_of_many_items_is_refused_before_it_is_unpacked(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame over 1 MiB was unpacked whatever it held: one of empty arrays took 64 bytes
    of the daemon's memory per byte (a 32 MiB frame 2 GiB, and a minute of walking it), as
    did a record's msgpack inside a request; any client could have the daemon killed for
    want of memory. Measured with tracemalloc (the daemon is in this process)."""
    import tracemalloc

    n = 3 << 20  # items, in a frame of about 3 MiB
    lists = b"\x93\xa4ping\x91\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\x80"
    claim = b"\x93\xa4ping\x91\xdd\xff\xff\xff\xff" + b"\x00" * (2 << 20) + b"\x80"
    fields = {"device": 0, "path": "p", "offset": 0, "length": 1}
    record = _packed(["Extent", {**fields, "more": [[]] * n}])
    in_ext = _packed(["stat", [msgpack.ExtType(1, record)], {}])
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        tracemalloc.start()
        try:
            with _connect(sock) as s:
                for body in (lists, claim):
                    reply = _exchange(s, _frame(body))
                    assert reply[:2] == [1, "ValueError"], reply
                    assert "more than 1048576 msgpack items" in reply[2], reply
                reply = _exchange(s, _frame(in_ext))  # (no request carries a record)
                assert reply[:2] == [1, "InvalidKey"] and "ExtType" in reply[2], reply
                assert _exchange(s, encode(["ping", [], {}])) == [0, True]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # (the frames' buffers, a few MiB each; unpacked, the first was 200 MiB)
        assert peak < 48 << 20, peak >> 20
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side)
    _no_errors(caplog)


# -- frames that cannot be read whole, and clients that go away or stall ---------------------
async def test_frames_cut_short_or_announced_too_large_close_the_connection_only(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvfs")
    put = _packed(["put", ["new/1", os.urandom(BIG)], {}])

    def side(sock: Path) -> None:
        before = _state(sock)
        for data in [
            b"\x00",
            b"\x00\x00\x00",
            _frame(_packed(["ping", [], {}]))[:-1],
            _frame(put)[: 4 + (2 << 20)],  # a put cut off before its page arrived
        ]:
            with _connect(sock) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(10) == b""  # closed, no answer: the frame never ended
        for data in [
            struct.pack(">Q", 2**63),  # (a length of 2**63, as 8 bytes: its first 4 read)
            b"\xff" * 8,
            struct.pack(">I", control.MAX_FRAME + 1) + b"\x93",
            struct.pack(">I", 64 << 20) + b"GET / HTTP/1.1\r\n",  # no request's first byte
        ]:
            with _connect(sock) as s:
                reply = _exchange(s, data)
                assert reply[:2] == [1, "ValueError"], reply
                assert s.recv(10) == b""  # and closed: the body cannot be skipped
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side)
    _no_errors(caplog)


async def test_a_peer_stalled_mid_header_is_dropped(
    make_config: MakeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer silent for STALL_SECONDS in the middle of a message is dropped, but one that
    had sent part of a frame's 4-byte header was kept for ever (a descriptor and a task
    each). STALL_SECONDS is lowered here to 1 s; the recv's 30 s is a guard."""
    monkeypatch.setattr(control, "STALL_SECONDS", 1.0)

    def side(sock: Path) -> None:
        with _connect(sock) as idle, _connect(sock) as partial:
            partial.sendall(b"\x00\x00")
            assert partial.recv(10) == b""
            assert _exchange(idle, encode(["ping", [], {}])) == [0, True]  # (idle: kept)

    await _serving(make_config, tmp_path, side)


async def test_clients_gone_stuck_or_half_open_cost_the_daemon_nothing_after(
    make_config: MakeConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client gone mid-request or mid-answer (a large get), one that never reads its
    answer (dropped after STALL_SECONDS, lowered here to 1 s), and a hundred half-open
    connections at once: the daemon serves the others meanwhile, stores nothing, logs no
    error, and holds no descriptor for any of them once they are gone."""
    monkeypatch.setattr(control, "STALL_SECONDS", 1.0)
    caplog.set_level(logging.DEBUG, logger="kvfs")
    answer = len(encode([0, SEED["big/1"]]))

    def fds() -> int:
        # (sockets only: the store opens and closes files of its own meanwhile, a worker
        # thread's index connection say)
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return n

    def side(sock: Path) -> None:
        before = _state(sock)
        baseline = fds()
        with _connect(sock) as s:  # gone mid-request: its page half sent
            s.sendall(_frame(_packed(["put", ["new/1", os.urandom(BIG)], {}]))[: BIG // 2])
        with _connect(sock) as s:  # gone mid-answer
            s.sendall(encode(["get", ["big/1"], {}]))
            assert len(s.recv(100)) > 0

        def until_fds(n: int) -> None:
            # (the daemon opens its end of a connection as it accepts it, and closes it as
            # it lets go of the client: polled, no timing)
            for _ in range(600):
                if fds() <= n:
                    return
                time.sleep(0.05)
            raise AssertionError(f"{fds()} descriptors open, not {n}")

        until_fds(baseline)
        with _connect(sock) as stuck:  # never reads its answer: dropped, its page let go
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.sendall(encode(["get", ["big/1"], {}]))
            # Dropped: the daemon closes its end, which this end sees as a hang-up while
            # the answer's first part still waits unread in it (read, it is no stuck
            # client: the daemon sends the rest and keeps the connection for the next call)
            hup = select.poll()
            hup.register(stuck, select.POLLHUP)
            assert hup.poll(30_000), "the daemon kept a client that never reads"
            got = 0
            while chunk := stuck.recv(1 << 16):  # what the daemon sent before it gave up
                got += len(chunk)
            assert got < answer
            until_fds(baseline + 1)  # and let go of it: this end only
        half = [_connect(sock) for _ in range(100)]
        for i, h in enumerate(half):
            h.sendall(b"\x00" * (i % 4))  # nothing, or part of a header
        assert _state(sock) == before  # served all the while
        for h in half:
            h.close()
        until_fds(baseline)
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side)
    _no_errors(caplog)


async def test_the_pages_held_for_all_connections_at_once_are_bounded(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each client's large get was read into the daemon's memory as it came, and each put's
    page received whole, with no bound over the connections: N engine workers getting
    512 MiB pages at once, or N stuck not reading them, held N of them. The daemon now
    holds at most its page budget (here two pages): the third get and a put wait for room,
    small calls are served meanwhile, and every one completes once the first answers are
    read."""
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        clients = [_connect(sock) for _ in range(5)]
        for c in clients:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.sendall(encode(["get", ["big/1"], {}]))

        def answered() -> list[socket.socket]:
            ready = select.select(clients, [], [], 0)[0]
            return [c for c in clients if c in ready]

        for _ in range(600):  # (polled: the daemon reads the first two as it can)
            if len(answered()) >= 2:
                break
            time.sleep(0.05)
        put = _connect(sock)
        replies: dict[int, Any] = {}

        def read(i: int, c: socket.socket) -> None:
            replies[i] = read_frame_sync(c)

        putter = threading.Thread(
            target=lambda: (
                put.sendall(encode(["put", ["new/big", SEED["big/1"]], {}])),
                read(-1, put),
            )
        )
        putter.start()
        time.sleep(0.5)  # (room for what an unbounded daemon would do: it did it at once)
        assert len(answered()) == 2, "the daemon read more gets than its budget holds"
        with open_remote_store_sync(sock, timeout=30) as r:  # small calls are served
            assert r.get("k/1") == SEED["k/1"]
            assert not r.exists("new/big")  # the put waits too
        readers = [threading.Thread(target=read, args=(i, c)) for i, c in enumerate(clients)]
        for t in readers:
            t.start()
        for t in [*readers, putter]:
            t.join(60)
        assert all(replies[i] == [0, SEED["big/1"]] for i in range(5)), "a get went wrong"
        assert replies[-1][0] == 0, replies[-1]
        for c in [*clients, put]:
            c.close()
        with open_remote_store_sync(sock, timeout=30) as r:
            assert r.get("new/big") == SEED["big/1"]
            r.delete("new/big")
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side, page_budget=2 * BIG)
    _no_errors(caplog)


async def test_a_large_request_frame_never_keeps_the_page_budget_from_itself(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A get whose request frame was over 1 MiB (a large bin for its room) took the budget
    for the frame, then waited for room for its answer that it held itself: for ever, and
    every large call after it with it. And a client of another protocol (curl on the
    socket: its first bytes read as a 1.2 GB length) waited for that much of the budget
    before it was refused; with the budget held by stuck clients, for ever."""
    caplog.set_level(logging.DEBUG, logger="kvfs")

    def side(sock: Path) -> None:
        before = _state(sock)
        with _connect(sock) as s:
            reply = _exchange(s, encode(["get", ["big/1"], {"room": b"x" * (BIG + 1000)}]))
            assert reply[:2] == [1, "TypeError"], reply
            assert _exchange(s, encode(["get", ["big/1"], {}])) == [0, SEED["big/1"]]
        stuck = [_connect(sock) for _ in range(2)]  # the whole budget, held
        for c in stuck:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.sendall(encode(["get", ["big/1"], {}]))
        for _ in range(600):  # (polled: the daemon reads them as it can)
            if len(select.select(stuck, [], [], 0)[0]) == 2:
                break
            time.sleep(0.05)
        with _connect(sock) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = read_frame_sync(s)
            assert reply[:2] == [1, "ValueError"] and "no kvfs request" in reply[2], reply
        for c in stuck:
            c.close()
        assert _state(sock) == before

    await _serving(make_config, tmp_path, side, page_budget=2 * BIG)
    _no_errors(caplog)
