"""The control channel as a standalone service over a real store: RemoteStore has Store's
interface, errors keep their class, permissions, a daemon gone mid-call, metrics."""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from _corrupt import CLEAN_FSCK

import kvfs
from kvfs import DaemonUnavailable  # public: engines catch it
from kvfs._control import control_service, encode, read_frame_sync
from kvfs._metrics import metrics_service, render_metrics
from kvfs._remote import RemoteStore, SyncRemoteStore, open_remote_store, open_remote_store_sync

MakeConfig = Callable[..., kvfs.StoreConfig]


async def test_remote_store_mirrors_store(make_config: MakeConfig, tmp_path: Path) -> None:
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        assert await n.start(control_service, store, sock) == sock
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        async with open_remote_store(sock) as r:
            payload = os.urandom(200_000)
            info = await r.put(kvfs.PageKey.semantic("s1", "p", 0), payload, attrs={"a": "b"})
            assert isinstance(info, kvfs.PageInfo) and info.size == len(payload)
            assert info.extents and isinstance(info.extents[0], kvfs.Extent)
            assert await r.get("sessions/s1/p/layer-000") == payload
            buf = bytearray(len(payload))
            assert await r.get("sessions/s1/p/layer-000", into=buf) == len(payload)
            assert bytes(buf) == payload
            assert await r.read_range("sessions/s1/p/layer-000", 10, 5) == payload[10:15]
            assert await r.exists("sessions/s1/p/layer-000")
            assert (await r.stat("sessions/s1/p/layer-000")).attrs == {"a": "b"}
            keys = [f"sessions/s2/p/layer-{i:03d}" for i in range(6)]
            await r.put_many([(k, k.encode() * 100) for k in keys], concurrency=3)
            assert await r.get_many(keys, concurrency=3) == [k.encode() * 100 for k in keys]
            assert [p.path for p in await r.list(session="s2")] == keys
            ss = await r.sessions()
            assert {s.session for s in ss} == {"s1", "s2"} and isinstance(ss[0], kvfs.SessionInfo)
            assert (await r.session_info("s2")).pages == 6
            await r.pin("sessions/s1/p/layer-000")
            assert (await store.stat("sessions/s1/p/layer-000")).pinned
            await r.unpin("sessions/s1/p/layer-000")
            await r.pin_session("s2")
            await r.unpin_session("s2")
            await r.rename(keys[0], "sessions/s2/p/layer-100")
            await r.delete(keys[1])
            st = await r.statistics()
            assert isinstance(st, kvfs.StoreStatistics) and st.pages == 6
            assert isinstance(st.devices[0], kvfs.DeviceStatistics)
            assert await r.fsck() == CLEAN_FSCK
            assert await r.evict(session="s2") > 0  # no archive: the local copies go
            assert await r.delete_session("s1") == 1
            with pytest.raises(NotImplementedError):
                r.begin_write("x")
        n.cancel_scope.cancel()
    assert not sock.exists()


async def test_maps_that_look_like_records_pass_unchanged(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Records were tagged by a "__t" key inside ordinary maps: a page or session attribute
    named "__t" made the daemon's answer fail (the client was told the daemon died) or
    decode as a record, and broke `kvfs ls` for every session."""
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        async with open_remote_store(sock) as r:
            odd = {"__t": "Extent", "device": "0", "path": "p", "offset": "0", "length": "1"}
            for i, attrs in enumerate(({"__t": "hello"}, odd)):
                info = await r.put(f"x/p{i}", b"abc", attrs=attrs)
                assert info.attrs == attrs and isinstance(info.extents[0], kvfs.Extent)
                assert (await r.stat(f"x/p{i}")).attrs == attrs
            await r.put("sessions/s/p/layer-000", b"s")
            await r.set_session_attrs("s", {"__t": "SessionInfo"})
            assert {x.session: x.attrs for x in await r.sessions()}["s"] == {"__t": "SessionInfo"}
        n.cancel_scope.cancel()


async def test_the_socket_path_is_claimed_only_when_nothing_answers_there(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Whatever was at the socket path was unlinked: a second daemon given the same
    --socket took it over silently (commands meant for the first store went to the second),
    and --socket notes.txt deleted notes.txt."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        with pytest.raises(FileExistsError, match="no socket"):
            await n.start(control_service, store, notes)
        assert notes.read_text() == "mine"
        await n.start(control_service, store, sock)
        other = kvfs.StoreConfig(data_dirs=(tmp_path / "other",))
        async with kvfs.open_store(other) as second:
            with pytest.raises(FileExistsError, match="another kvfs daemon answers"):
                await n.start(control_service, second, sock)
        n.cancel_scope.cancel()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))  # a killed daemon's leftover: nothing listens
    stale.close()
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        assert await n.start(control_service, store, sock) == sock
        n.cancel_scope.cancel()


async def test_a_message_over_the_frame_limit_is_a_clear_error(
    make_config: MakeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put over the frame limit (2 GiB), or the answer to a get of a page over it, closed
    the connection: the client was told the daemon had stopped or been killed (exit 7),
    while it kept serving. The limit is lowered here to 1 MiB."""
    import kvfs._control as control

    monkeypatch.setattr(control, "MAX_FRAME", 1 << 20)
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("x/big", os.urandom(2 << 20))
        async with open_remote_store(sock) as r:
            with pytest.raises(ValueError, match="over the control channel's 1048576"):
                await r.put("x/new", os.urandom(2 << 20))
            with pytest.raises(ValueError, match="over the control channel's 1048576"):
                await r.get("x/big")
            assert await r.ping() and not await r.exists("x/new")

        def sync_side() -> None:
            with open_remote_store_sync(sock) as s:
                with pytest.raises(ValueError, match="over the control channel"):
                    s.get("x/big")
                assert s.read_range("x/big", 0, 10) == s.read_range("x/big", 0, 10)

        await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()


async def test_errors_keep_their_class(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvfs.events")
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        async with open_remote_store(sock) as r:
            with pytest.raises(kvfs.PageNotFound, match="no page"):
                await r.get("sessions/x/p/layer-000")
            with pytest.raises(kvfs.SessionNotFound):
                await r.session_info("nope")
            with pytest.raises(kvfs.PageNotFound):
                await r.stat("sessions/x/p/layer-000")
            with pytest.raises(kvfs.InvalidKey):
                await r.put("/abs", b"x")
            await r.put("a/b", b"1")
            with pytest.raises(kvfs.PageExists):
                await r.put("a/b", b"2")
            with pytest.raises(kvfs.ArchiveUnavailable):
                await r.spill("a")
            with pytest.raises(ValueError, match="unknown control method"):
                await r._call("engine")
        n.cancel_scope.cancel()
    events = [rec.getMessage() for rec in caplog.records if rec.name == "kvfs.events"]
    assert any(e.startswith("event=error method=get") and "PageNotFound" in e for e in events)
    # the caller's mistakes, spill without an archive tier included, are warnings: a
    # daemon's log at ERROR is for what went wrong in the daemon
    levels = {
        r.getMessage().split()[1]: r.levelname for r in caplog.records if r.name == "kvfs.events"
    }
    assert levels["method=spill"] == levels["method=put"] == "WARNING", levels
    # a lookup that finds nothing is an answer (`kvfs pin NAME` stats NAME first), and a
    # get that finds nothing is a cache miss: no alarm
    assert levels["method=stat"] == levels["method=session_info"] == "DEBUG", levels
    assert levels["method=get"] == "DEBUG", levels


async def test_spill_restore_evict_are_logged(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvfs.events")
    sock = tmp_path / "c.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/arch")
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        async with open_remote_store(sock) as r:
            await r.put("sessions/a/p/layer-000", os.urandom(9000))
            assert await r.spill("a") > 0
            assert await r.restore("a") > 0
            assert await r.evict("sessions/a/p/layer-000") > 0
            assert [s["session"] for s in await r.archived_sessions()] == [
                "a"
            ] or await r.archived_sessions()
        n.cancel_scope.cancel()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvfs.events"]
    for ev in ("spill", "restore", "evict"):
        assert any(
            x.startswith(f"event={ev} target=") and " bytes=" in x and " seconds=" in x
            for x in lines
        ), (ev, lines)


async def test_missing_daemon_and_a_daemon_gone_mid_call(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    with pytest.raises(DaemonUnavailable, match="no kvfs daemon"):
        async with open_remote_store(tmp_path / "absent.sock"):
            pass
    # a stale socket file (its daemon was SIGKILLed) is refused, not hung on
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    with pytest.raises(DaemonUnavailable):
        await SyncRemoteStore_ping(tmp_path / "stale.sock")
    # a server that reads the request and closes without answering
    sock = tmp_path / "half.sock"
    lsock = trio.socket.socket(socket.AF_UNIX)
    await lsock.bind(str(sock))
    lsock.listen(1)

    async def half_server() -> None:
        conn, _ = await lsock.accept()
        with conn:
            await conn.recv(100)

    async with trio.open_nursery() as n:
        n.start_soon(half_server)
        r = RemoteStore(sock)
        with pytest.raises(DaemonUnavailable, match="mid-command"):
            await r.statistics()
        await r.aclose()
    lsock.close()


async def SyncRemoteStore_ping(path: Path) -> None:  # noqa: N802 - a helper for one test
    r = SyncRemoteStore(path)
    try:
        await trio.to_thread.run_sync(r.ping)
    finally:
        r.close()


_CHILD = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect", e.errno); sys.exit(0)
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
except OSError:
    pass  # the daemon may refuse and close before the request is read
data = b""
while chunk := s.recv(65536):
    data += chunk
print("reply", data.hex())
"""


def _as_other_user(sock: Path, frame: bytes) -> list[str]:
    import subprocess

    r = subprocess.run(
        ["/usr/bin/python3", "-c", _CHILD, str(sock), frame.hex()],
        user=65534,
        group=65534,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


async def test_peer_of_another_uid_is_refused(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode 0600 keeps other users out; with the mode opened up, SO_PEERCRED still does.
    As root the other user is real (uid 65534 in a child); as an ordinary user the daemon's
    own uid is made to differ (the peer's credentials are still read from the kernel)."""
    import tempfile

    import kvfs._control as control

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        sock = Path(d) / "c.sock"
        async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
            await n.start(control_service, store, sock)
            frame = encode(["ping", [], {}])
            if os.getuid() == 0:
                out = await trio.to_thread.run_sync(_as_other_user, sock, frame)
                assert out == ["connect", "13"]  # EACCES: the socket is 0600
                os.chmod(sock, 0o666)
                out = await trio.to_thread.run_sync(_as_other_user, sock, frame)
                assert out[0] == "reply"
                from kvfs._control import decode

                reply = decode(bytes.fromhex(out[1])[4:])
            else:
                monkeypatch.setattr(control.os, "getuid", lambda: os.geteuid() + 12345)

                def attempt() -> object:
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(str(sock))
                    with s:
                        s.sendall(frame)
                        return read_frame_sync(s)

                reply = await trio.to_thread.run_sync(attempt)
            assert reply[0] == 1 and reply[1] == "PermissionError"
            assert "may not use this kvfs daemon" in reply[2]
            n.cancel_scope.cancel()


async def test_metrics_endpoint_bounded_sessions(make_config: MakeConfig) -> None:
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        for i in range(8):
            await store.put(f"sessions/s{i}/p/layer-000", b"k" * (1000 * (i + 1)))
        await store.get("sessions/s0/p/layer-000")
        port = await n.start(
            lambda task_status: metrics_service(
                store, port=0, max_sessions=3, task_status=task_status
            )
        )
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.0 200") and b"version=0.0.4" in head
        text = body.decode()
        assert 'kvfs_hits_total{tier="local"} 1' in text
        assert "kvfs_pages 8" in text and "# TYPE kvfs_puts_total counter" in text
        sess = [x for x in text.splitlines() if x.startswith("kvfs_session_bytes{")]
        assert len(sess) == 4 and 'session="_other"' in sess[-1]
        assert 'kvfs_session_bytes{session="s7",dir="sessions/s7"} 8000' in text
        assert sess[-1].endswith(" " + str(sum(1000 * (i + 1) for i in range(5))))
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET /other HTTP/1.0\r\n\r\n")
            assert (await stream.receive_some(100)).startswith(b"HTTP/1.0 404")
        n.cancel_scope.cancel()


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_exposition(
    text: str,
) -> tuple[dict[tuple[str, frozenset[tuple[str, str]]], float], dict[str, str]]:
    """The samples of Prometheus text exposition 0.0.4 ({(name, labels): value}) and each
    family's type, checked against the format's rules: every family has one HELP and one
    TYPE line before its samples, its samples are together, counters are named *_total,
    label values are escaped, values are numbers and no series appears twice."""
    assert text.endswith("\n")
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    helps: set[str] = set()
    types: dict[str, str] = {}
    done: set[str] = set()  # families whose samples ended
    current = None
    for line in text.splitlines():
        if line.startswith("# "):
            word, name, rest = (line[2:].split(" ", 2) + [""])[:3]
            assert _NAME.fullmatch(name), line
            if word == "HELP":
                assert name not in helps and re.fullmatch(r"(?:[^\\]|\\[\\n])*", rest), line
                helps.add(name)
            elif word == "TYPE":
                assert name not in types and rest in {"counter", "gauge", "summary", "untyped"}
                assert rest != "counter" or name.endswith("_total"), line
                types[name] = rest
            continue
        m = _NAME.match(line)
        assert m, line
        name, pos, labels = m.group(), m.end(), []
        if line[pos] == "{":
            pos += 1
            while line[pos] != "}":
                lm = _LABEL.match(line, pos)
                assert lm, line
                unescaped = re.sub(r"\\(.)", lambda e: {"n": "\n"}.get(e[1], e[1]), lm[2])
                labels.append((lm[1], unescaped))
                pos = lm.end() + (line[lm.end()] == ",")
            pos += 1
        assert line[pos] == " ", line
        value = float(line[pos + 1 :])
        family = re.sub(r"_(sum|count)$", "", name) if name not in types else name
        assert family in types and family in helps, f"{line}: no TYPE or HELP before it"
        assert len({k for k, _ in labels}) == len(labels), line
        if family != current:
            assert family not in done, f"{family}: its samples are not together"
            if current is not None:
                done.add(current)
            current = family
        key = (name, frozenset(labels))
        assert key not in samples, f"{line}: a second sample of one series"
        samples[key] = value
    return samples, types


def test_the_metrics_are_valid_exposition_and_their_counters_never_go_down(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A semantic session and an engine's directory of one name (sessions/lmcache and
    lmcache/) gave two series with one label set, and Prometheus drops such a scrape
    whole; the archive's misses that `kvfs stats` shows (corrupt objects) had no series;
    and the local hits, taken as gets less misses, went down at a read whose restore
    failed."""
    from _corrupt import flip_byte

    archive = tmp_path / "ar"
    cfg = make_config(archive_url=f"file://{archive}", extra={"archive": {"interval": 0}})
    with kvfs.open_store_sync(cfg) as s:

        def scrape() -> tuple[dict[tuple[str, frozenset[tuple[str, str]]], float], dict[str, str]]:
            return parse_exposition(render_metrics(s.statistics(), s.sessions()))

        s.put("sessions/lmcache/p/layer-000", b"a" * 100)
        s.put("lmcache/chunk", b"a" * 100)  # (the same content: a dedup put)
        s.put('sessions/we"ird\\/p/layer-000', b"w" * 10)
        s.put("sessions/b/p/layer-000", os.urandom(5000))
        assert s.get("lmcache/chunk") == b"a" * 100
        before, _ = scrape()
        assert s.spill("b") > 0
        (obj,) = (archive / "blobs").iterdir()
        flip_byte(obj, 100)
        with pytest.raises(kvfs.CorruptPage):
            s.get("sessions/b/p/layer-000")
        after, types = scrape()
    for (name, labels), v in before.items():
        if types.get(name) == "counter":
            assert after[(name, labels)] >= v, (name, sorted(labels))

    def value(name: str, **labels: str) -> float:
        return after[(name, frozenset(labels.items()))]

    assert value("kvfs_session_bytes", session="lmcache", dir="lmcache") == 100
    assert value("kvfs_session_bytes", session="lmcache", dir="sessions/lmcache") == 100
    assert value("kvfs_session_pages", session='we"ird\\', dir='sessions/we"ird\\') == 1
    assert value("kvfs_hits_total", tier="local") == 1
    assert value("kvfs_misses_total", tier="local") == 1
    assert value("kvfs_misses_total", tier="archive") == 1
    assert value("kvfs_dedup_puts_total") == 1
    assert value("kvfs_evictions_total", reason="spill") == 1


def test_the_restore_latency_summary_has_its_sum_and_count(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """The summary had its two quantiles (of the last 1024 restores) and no _sum or
    _count, so no mean latency over a window could be had from it."""
    cfg = make_config(archive_url=f"file://{tmp_path / 'ar'}", extra={"archive": {"interval": 0}})
    with kvfs.open_store_sync(cfg) as s:
        s.put("sessions/b/p/layer-000", os.urandom(5000))
        s.put("sessions/b/p/layer-001", os.urandom(5000))
        assert s.spill("b") > 0
        s.restore("b")
        samples, types = parse_exposition(render_metrics(s.statistics(), s.sessions()))
    assert types["kvfs_restore_latency_seconds"] == "summary"
    assert samples[("kvfs_restore_latency_seconds_count", frozenset())] == 2
    total = samples[("kvfs_restore_latency_seconds_sum", frozenset())]
    p99 = samples[("kvfs_restore_latency_seconds", frozenset({("quantile", "0.99")}))]
    assert 0 < p99 <= total


def test_a_float_sample_keeps_every_digit() -> None:
    """Float samples were written with ``:g`` (six digits): the restore latency's ``_sum``
    of 123456.7 s showed 123457 both before and after a restore of 0.2 s, so a ``rate()``
    over it read no restore time at all, and then a whole second at once."""
    st = kvfs.StoreStatistics(0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def scrape(total: float, count: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        archive = {"blobs_restored": count, "restore_seconds": total, "restore_p50_s": 0.2}
        st.extra["archive"] = archive
        return parse_exposition(render_metrics(st, []))[0]

    before = scrape(123456.7, 1000)
    after = scrape(123456.7 + 0.2, 1001)
    total = ("kvfs_restore_latency_seconds_sum", frozenset())
    assert (before[total], after[total]) == (123456.7, 123456.7 + 0.2)
    p50 = ("kvfs_restore_latency_seconds", frozenset({("quantile", "0.5")}))
    assert after[p50] == 0.2


def test_render_escapes_labels() -> None:
    st = kvfs.StoreStatistics(0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    s = kvfs.SessionInfo('we"ird\\', "sessions/x", 0, 0, False, {}, 1, 10, 10, 0)
    assert 'kvfs_session_bytes{session="we\\"ird\\\\",dir="sessions/x"} 10' in render_metrics(
        st, [s]
    )


def test_a_session_named_other_is_summed_not_shown_twice() -> None:
    """A session named "_other" among the largest gave two series with one label set (an
    invalid scrape): it is summed with the rest."""
    st = kvfs.StoreStatistics(0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def info(name: str, size: int) -> kvfs.SessionInfo:
        return kvfs.SessionInfo(name, name, 0, 0, False, {}, 1, size, size, 0)

    sessions = [info("_other", 50_000), info("a", 100), info("b", 10), info("c", 1)]
    lines = [
        x
        for x in render_metrics(st, sessions, max_sessions=2).splitlines()
        if x.startswith("kvfs_session_bytes{")
    ]
    assert lines == [
        'kvfs_session_bytes{session="a",dir="a"} 100',
        'kvfs_session_bytes{session="b",dir="b"} 10',
        'kvfs_session_bytes{session="_other"} 50001',
    ]


def test_engine_evictions_and_restores_are_logged(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Evictions and restores the engine does on its own (not asked over the channel) are
    structured lines too."""
    caplog.set_level(logging.INFO, logger="kvfs.events")
    with kvfs.open_store_sync(make_config(name="plain")) as s:
        s.put("sessions/a/p/layer-000", os.urandom(5000))
        s.evict(session="a")
    with kvfs.open_store_sync(make_config(name="arch", archive_url=f"file://{tmp_path}/ar")) as s:
        s.put("sessions/b/p/layer-000", payload := os.urandom(5000))
        s.evict("sessions/b/p/layer-000")
        assert s.get("sessions/b/p/layer-000") == payload  # restored on read
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfs.events"]
    # (one line per call or pass; one per content would be one per page: those are DEBUG)
    assert any(
        x.startswith("event=evict target=sessions/a reason=manual ")
        and "archived=False" in x
        and " bytes=" in x
        for x in lines
    ), lines
    assert any(
        x.startswith("event=evict target=sessions/b/p/layer-000 reason=manual ")
        and "archived=True" in x
        for x in lines
    ), lines
    assert any(
        x.startswith("event=restore target=sessions/b/p/layer-000 reason=read bytes=5000 ")
        for x in lines
    ), lines
    assert not [x for x in lines if "content=" in x], lines


async def test_fsck_progress_over_the_channel(make_config: MakeConfig, tmp_path: Path) -> None:
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        for i in range(12):
            await store.put(f"sessions/a/p/layer-{i:03d}", os.urandom(3000))
        seen: list[tuple[int, int]] = []

        def check() -> dict[str, list[str]]:
            r = SyncRemoteStore(sock)
            try:
                return r.fsck_progress(progress=lambda d, t: seen.append((d, t)))
            finally:
                r.close()

        found = await trio.to_thread.run_sync(check)
        assert found["corrupt"] == [] and found["missing"] == []
        assert seen and seen[-1] == (12, 12)
        n.cancel_scope.cancel()


async def test_a_name_that_is_not_utf8_crosses_the_channel(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """fsck through a daemon of a store whose data directory holds a file named in bytes
    that are not UTF-8 (an orphan): its answer could not be packed, and the client was told
    the daemon had died. Names cross the channel as the file system gives them."""
    sock = tmp_path / "c.sock"
    cfg = make_config()
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("sessions/a/p/layer-000", os.urandom(3000))
        stray = cfg.data_dirs[0] / "blobs" / "ab" / os.fsdecode(b"\xff-stray")
        stray.write_bytes(b"x")

        def check() -> dict[str, list[str]]:
            r = SyncRemoteStore(sock)
            try:
                return r.fsck()
            finally:
                r.close()

        found = await trio.to_thread.run_sync(check)
        assert found["orphans"] == [str(stray)] and found["corrupt"] == []
        n.cancel_scope.cancel()


async def test_spill_and_restore_progress_over_the_channel(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """``kvfs spill`` and ``kvfs restore`` through a daemon report page bytes as they are
    archived and come back."""
    sock = tmp_path / "r.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/arch", extra={"archive": {"interval": 0}})
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        for i in range(5):
            await store.put(f"sessions/a/p/layer-{i:03d}", os.urandom(100_000 + i))
        spilled: list[tuple[int, int]] = []
        seen: list[tuple[int, int]] = []

        def spill_then_restore() -> int:
            r = SyncRemoteStore(sock)
            try:
                r.spill("a", progress=lambda d, t: spilled.append((d, t)))
                return int(r.restore("a", progress=lambda d, t: seen.append((d, t))))
            finally:
                r.close()

        total = sum(100_000 + i for i in range(5))
        assert await trio.to_thread.run_sync(spill_then_restore) == total
        assert spilled and spilled[-1] == (total, total)
        assert seen and seen[-1] == (total, total)
        assert (await store.session_info("a")).local_bytes == total
        n.cancel_scope.cancel()


async def test_evict_progress_over_the_channel_and_in_process(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """``kvfs evict`` uploads what the archive lacks before dropping the local copies: it
    reports those bytes as they go, through a daemon and in-process; content already
    archived is dropped with no upload and no progress."""
    sock = tmp_path / "e.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/arch", extra={"archive": {"interval": 0}})
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        for s in ("a", "b"):
            for i in range(4):
                await store.put(f"sessions/{s}/p/layer-{i:03d}", os.urandom(50_000 + i))
        total = sum(50_000 + i for i in range(4))
        remote: list[tuple[int, int]] = []
        again: list[tuple[int, int]] = []

        def evict_remotely() -> tuple[int, int]:
            r = SyncRemoteStore(sock)
            try:
                freed = int(r.evict(session="a", progress=lambda d, t: remote.append((d, t))))
                return freed, int(r.evict(session="a", progress=lambda d, t: again.append((d, t))))
            finally:
                r.close()

        freed, freed_again = await trio.to_thread.run_sync(evict_remotely)
        assert freed >= total and freed_again == 0  # (disk bytes: 4 KiB blocks)
        assert remote and remote[-1] == (total, total)  # (the latest, ten times a second)
        assert again == []  # nothing left to upload (or to drop)
        local: list[tuple[int, int]] = []
        key = "sessions/b/p/layer-002"
        assert await store.evict(key, progress=lambda d, t: local.append((d, t))) >= 50_002
        assert local == [(0, 50_002), (50_002, 50_002)]
        assert await store.get(key) and (await store.session_info("a")).local_bytes == 0
        n.cancel_scope.cancel()


def test_journald_lines_carry_the_event_fields(tmp_path: Path) -> None:
    """The journald handler speaks the native protocol (checked on a socket of our own)."""
    from kvfs._events import log_event
    from kvfs._metrics import JournaldHandler

    path = tmp_path / "journal.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journal:
        journal.bind(str(path))
        handler = JournaldHandler(str(path))
        events = logging.getLogger("kvfs.events")
        events.addHandler(handler)
        old = events.level
        events.setLevel(logging.INFO)
        try:
            log_event("spill", target="sessions/a", bytes=10)
        finally:
            events.removeHandler(handler)
            events.setLevel(old)
            handler.close()
        fields = dict(line.split("=", 1) for line in journal.recv(65536).decode().splitlines())
    assert fields["MESSAGE"] == "event=spill target=sessions/a bytes=10"
    assert fields["PRIORITY"] == "6" and fields["KVFS_EVENT"] == "spill"
    with pytest.raises(ValueError, match="journald"):
        JournaldHandler(str(tmp_path / "absent"))


async def test_control_bench_runs_and_checks_bytes(tmp_path: Path) -> None:
    """The benchmark's machinery (tiny sizes; its figures are not asserted)."""
    from kvfs.bench.control import run_control_bench

    rows = await run_control_bench(
        tmp_path,
        small=4096,
        small_pages=5,
        large=1 << 20,
        large_pages=2,
        clients=2,
        repeat=1,
        durable=False,
    )
    assert [(r["pages"], r["op"]) for r in rows] == [
        ("small", "put"),
        ("small", "get"),
        ("large", "put"),
        ("large", "get"),
    ]
    assert all(r["remote_pages_s"] > 0 and r["worker_pages_s"] > 0 for r in rows)


_IMPOSTOR = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
s.listen(8)
print("ready", flush=True)
held = []
while True:
    held.append(s.accept()[0])
"""


@pytest.mark.skipif(
    os.getuid() != 0,
    reason="needs root to act as three users (CI and the device machine run as root)",
)
def test_a_daemon_run_by_another_user_is_refused(tmp_path: Path) -> None:
    """Whoever can put a socket where a client looks (a fallback runtime directory, a
    shared data directory) would be sent its pages and commands: the sync and the async
    client both refuse a daemon another user runs. Root may use any user's daemon."""
    import subprocess
    import tempfile

    from kvfs._control import connect_sync

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o777)
        sock = Path(d) / "kvfs.sock"
        with subprocess.Popen(
            ["/usr/bin/python3", "-c", _IMPOSTOR, str(sock)],
            user=65534,
            group=65534,
            stdout=subprocess.PIPE,
        ) as impostor:
            try:
                assert impostor.stdout is not None and impostor.stdout.readline() == b"ready\n"

                def as_victim() -> int:
                    refused = 0
                    try:
                        connect_sync(sock, 5).close()
                    except PermissionError as e:
                        refused += "served by uid 65534" in str(e)
                    try:
                        trio.run(RemoteStore(sock)._connect)
                    except PermissionError as e:
                        refused += "served by uid 65534" in str(e)
                    return refused

                pid = os.fork()
                if pid == 0:
                    code = 99
                    try:
                        os.setgid(54321)
                        os.setuid(54321)
                        code = as_victim()
                    finally:
                        os._exit(code)
                assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 2
                connect_sync(sock, 5).close()  # root: any user's daemon
            finally:
                impostor.kill()


async def test_a_client_gone_mid_progress_and_a_callers_mistake_are_no_errors(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kvfs fsck` interrupted with Ctrl-C closes its connection while progress frames are
    still being sent: the daemon finishes the check and logs no error (it logged "connection
    failed" with a traceback). A spill of a session that does not exist is the caller's
    mistake: a warning, as the same call without progress is, not an error."""
    sock = tmp_path / "c.sock"
    cfg = make_config(archive_url=f"file://{tmp_path}/archive")
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        for i in range(96):
            await store.put(f"sessions/a/p/layer-{i:03d}", os.urandom(1 << 20))

        def interrupted() -> None:
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            s.sendall(encode(["fsck", [], {"progress": True}]))
            assert read_frame_sync(s)[0] == 2  # a progress frame: the check runs
            s.close()

        def mistake() -> None:
            r = SyncRemoteStore(sock)
            try:
                with pytest.raises(kvfs.SessionNotFound):
                    r.spill("nobody", progress=lambda d, t: None)
            finally:
                r.close()

        with caplog.at_level(logging.DEBUG, logger="kvfs"):
            await trio.to_thread.run_sync(interrupted)
            await trio.to_thread.run_sync(mistake)
            await store.fsck()  # (the interrupted one runs beside it, and ends about as soon)
            await trio.sleep(1)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
        assert [r for r in caplog.records if "nobody" in r.getMessage()]  # (a warning)
        n.cancel_scope.cancel()


async def test_a_metrics_port_in_use_is_named(make_config: MakeConfig) -> None:
    """`kvfs mount: [Errno 98] Address already in use` did not say which address."""
    import socket as sk

    with sk.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
            with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{port}: "):
                await n.start(
                    lambda task_status: metrics_service(store, port=port, task_status=task_status)
                )


async def test_numpy_scalars_are_their_values_over_the_channel(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Any object with a buffer went as its bytes: replace=np.False_ arrived as b"\\x00",
    which is true, and replaced a write-once page; pin=np.True_ and an np.int64 offset
    failed inside the daemon."""
    import numpy as np

    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> None:
            with open_remote_store_sync(sock) as r:
                r.put("nb/1", b"0123456789")
                with pytest.raises(kvfs.PageExists):
                    r.put("nb/1", b"new", replace=np.False_)
                assert r.get("nb/1") == b"0123456789"
                assert r.put("nb/2", b"x", pin=np.True_).pinned
                assert r.read_range("nb/1", np.int64(2), np.int64(3)) == b"234"
                with pytest.raises(TypeError, match="cannot send ndarray"):
                    r.put("nb/3", b"x", attrs=None, pin=np.zeros(2))  # type: ignore[arg-type]

        await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()


async def test_a_header_alone_costs_no_memory_and_a_stalled_peer_is_dropped(
    make_config: MakeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame's buffer was allocated (and zero-filled, on the loop) as soon as its header
    announced the length: 4 bytes from any stray client held 1 GiB until it left, with no
    time limit. Now it grows as the bytes arrive, and a peer silent mid-message is dropped."""
    import struct
    import tracemalloc

    import kvfs._control as control

    monkeypatch.setattr(control, "STALL_SECONDS", 1.0, raising=False)
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> None:
            tracemalloc.start()
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(os.fspath(sock))
                    s.sendall(struct.pack(">I", (1 << 30) - 1) + b"\x93")
                    with open_remote_store_sync(sock) as r:
                        assert r.ping()  # the daemon goes on serving
                    assert tracemalloc.get_traced_memory()[1] < 64 << 20
                    s.settimeout(30)
                    assert s.recv(10) == b""  # dropped after STALL_SECONDS of silence
            finally:
                tracemalloc.stop()

        await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()


async def test_a_malformed_request_is_answered_and_the_connection_goes_on(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Requests that were no [method, [args], {kwargs}] dropped the connection with a
    traceback in the log: the client was told the daemon had died."""
    import msgpack

    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> None:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(os.fspath(sock))
                bodies = [
                    msgpack.packb(5),
                    msgpack.packb(["ping", []]),
                    msgpack.packb([["x"], [], {}]),
                    msgpack.packb(["stat", {"a": 1}, {}]),
                    msgpack.packb(["stat", [], {1: 2}]),
                    b"\xc1",  # never used in msgpack
                    msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Nope", {}]))),
                    msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Extent", {"x": 1}]))),
                ]
                for body in bodies:
                    s.sendall(len(body).to_bytes(4, "big") + body)
                    reply = read_frame_sync(s)
                    assert reply[:2] == [1, "ValueError"] and "malformed" in reply[2], reply
                s.sendall(encode(["ping", [], {}]))
                assert read_frame_sync(s) == [0, True]

        await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()


async def test_an_error_answer_keeps_the_connection_and_a_stuck_daemon_times_out(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """SyncRemoteStore closed a sound connection at every error answer (kvfs pin NAME
    connected anew each time); a daemon that accepts and never answers made ping, and so
    every CLI command, wait for ever."""
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> None:
            r = SyncRemoteStore(sock)
            try:
                assert r.ping()
                with pytest.raises(kvfs.PageNotFound):
                    r.stat("q/none")
                assert len(r._idle) == 1
                assert r.ping(timeout=5)
            finally:
                r.close()

        await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()
    mute = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(os.fspath(mute))
        listener.listen(1)
        with pytest.raises(DaemonUnavailable, match="did not answer within 0.5 s"):
            open_remote_store_sync(mute, timeout=0.5).__enter__()


async def test_remote_clients_behave_as_the_store_does_at_the_edges(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Calls after close went on working (the store raises StoreClosed); a read-only buffer
    was refused only after the whole page had been sent, and a small one with another
    message than in-process; 100 threads left 100 idle connections open for good; the
    daemon's socket file was removed at exit even when another daemon's had replaced it."""
    import threading

    import kvfs._remote as remote

    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("e/1", b"0123456789")

        def sync_side() -> None:
            r = SyncRemoteStore(sock)
            with pytest.raises(ValueError, match=r"smaller than page 'e/1' \(10 bytes\)"):
                r.get("e/1", into=bytearray(4))
            with pytest.raises(TypeError, match="read-only"):
                r.get("e/1", into=b"x" * 20)
            barrier = threading.Barrier(40)
            real_call = remote.call_sync

            def all_at_once(*a: object, **kw: object) -> object:  # 40 connections in use
                barrier.wait()
                return real_call(*a, **kw)  # type: ignore[arg-type]

            remote.call_sync = all_at_once  # type: ignore[assignment]

            def call() -> None:
                r.exists("e/1")

            threads = [threading.Thread(target=call) for _ in range(40)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            remote.call_sync = real_call
            assert len(r._idle) == remote.MAX_IDLE
            r.close()
            with pytest.raises(kvfs.StoreClosed):
                r.exists("e/1")

        await trio.to_thread.run_sync(sync_side)
        async with open_remote_store(sock) as ar:
            with pytest.raises(ValueError, match=r"smaller than page 'e/1'"):
                await ar.get("e/1", into=bytearray(4))
        with pytest.raises(kvfs.StoreClosed):
            await ar.exists("e/1")
        n.cancel_scope.cancel()

    async def serve_until(
        store: kvfs.Store, stop: trio.Event, *, task_status: trio.TaskStatus[None]
    ) -> None:
        async with trio.open_nursery() as inner:
            await inner.start(control_service, store, sock)
            task_status.started()
            await stop.wait()
            inner.cancel_scope.cancel()

    async with (
        kvfs.open_store(make_config(name="one")) as one,
        kvfs.open_store(make_config(name="two")) as two,
        trio.open_nursery() as outer,
    ):
        stop_one, stop_two = trio.Event(), trio.Event()
        await outer.start(serve_until, one, stop_one)
        os.unlink(sock)  # deleted by hand, and another daemon given the same path
        await outer.start(serve_until, two, stop_two)
        stop_one.set()
        await trio.sleep(0.3)  # the first one's service has ended

        def whose() -> object:
            with open_remote_store_sync(sock, timeout=10) as r2:
                return r2.identity()["data_dirs"]

        theirs = await trio.to_thread.run_sync(whose)
        assert theirs == [os.path.realpath(d) for d in two.config.data_dirs]
        stop_two.set()
    assert not sock.exists()  # the second daemon's own removal, at its exit


async def test_a_fork_while_a_client_is_locked_leaves_the_child_a_working_client(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A fork while another thread held a SyncRemoteStore's lock copied it held: the
    child's first call waited for ever."""
    import time

    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("f/1", b"x")

        def sync_side() -> int:
            r = SyncRemoteStore(sock)
            try:
                with r._lock:  # another thread in the middle of a call, as fork sees it
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child
                        code = 1
                        try:
                            code = 0 if r.exists("f/1") else 1
                        finally:
                            os._exit(code)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        return os.waitstatus_to_exitcode(status)
                    time.sleep(0.05)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return -1
            finally:
                r.close()

        assert await trio.to_thread.run_sync(sync_side) == 0
        n.cancel_scope.cancel()


def test_a_busy_daemons_socket_is_not_taken_for_a_leftover(tmp_path: Path) -> None:
    """A connect to a daemon whose backlog is full fails at once (EAGAIN): a second daemon
    given the same path took that for a leftover socket, removed it, and cut the first
    one's clients off."""
    from kvfs._control import DaemonBusy, _claim, connect_sync

    path = tmp_path / "busy.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(os.fspath(path))
        listener.listen(0)
        waiting = []
        for _ in range(4):  # fill the backlog (never accepted)
            c = socket.socket(socket.AF_UNIX)
            c.setblocking(False)
            try:
                c.connect(os.fspath(path))
            except BlockingIOError:
                c.close()
                break
            waiting.append(c)
        try:
            with pytest.raises(DaemonBusy):
                connect_sync(path, timeout=0.2)
            with pytest.raises(FileExistsError, match="another kvfs daemon answers"):
                _claim(path)
            assert path.exists()
        finally:
            for c in waiting:
                c.close()


async def test_a_command_finds_its_daemon_by_any_spelling_of_its_store(
    make_config: MakeConfig,
    run: Callable[..., tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command given its socket and another store's data is refused; one given the
    first of the daemon's data directories (its socket is there) was refused too, and one
    talking to a daemon too old to say which store it serves failed every time."""
    import kvfs._control as control
    from kvfs._settings import control_socket_path

    cfg = make_config(ndev=2)
    first, second = (str(d) for d in cfg.data_dirs)
    sock = control_socket_path(cfg)
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        await store.put("x/1", b"1")

        def commands() -> None:
            assert run("ls", "x", "--data", first, "--daemon")[0] == 0
            both = f"{first},{second}"
            assert run("ls", "x", "--data", both, "--socket", str(sock), "--daemon")[0] == 0
            rc, _, err = run("ls", "x", "--data", second, "--socket", str(sock), "--daemon")
            assert rc == 2 and "serves" in err, err
            monkeypatch.setattr(control, "METHODS", control.METHODS - {"identity"})
            assert run("ls", "x", "--data", second, "--socket", str(sock), "--daemon")[0] == 0

        await trio.to_thread.run_sync(commands)
        n.cancel_scope.cancel()


async def test_a_frame_announced_over_the_limit_is_answered_and_logged_in_one_line(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A header announcing more than the frame limit (a client of another protocol, 4 bytes
    of garbage) dropped the connection without a word, so the client was told the daemon
    had died, and logged a traceback at ERROR for the peer's mistake."""
    import struct

    reply = await _answered_and_dropped(make_config, tmp_path, struct.pack(">I", 0xFFFFFFFF))
    assert reply[:2] == [1, "ValueError"] and "4294967295" in reply[2], reply
    _one_warning(caplog)


async def test_a_client_of_another_protocol_is_answered_at_once_and_logged_in_one_line(
    make_config: MakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An HTTP request on the socket (curl --unix-socket) had its "GET " read as a frame of
    1.2 GB: the daemon waited STALL_SECONDS (60) for the rest of it, and then dropped the
    client without a word. (The client's 30 s timeout here is only a guard.)"""
    http = b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: curl/8.5.0\r\n\r\n"
    reply = await _answered_and_dropped(make_config, tmp_path, http)
    assert reply[:2] == [1, "ValueError"] and "no kvfs request" in reply[2], reply
    _one_warning(caplog)


async def _answered_and_dropped(make_config: MakeConfig, tmp_path: Path, sent: bytes) -> Any:
    """The daemon's answer to ``sent``, after which it closed the connection (a frame whose
    body cannot be skipped loses the stream); the daemon still answers the next client."""
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> Any:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(os.fspath(sock))
                s.settimeout(30)
                s.sendall(sent)
                reply = read_frame_sync(s)
                assert s.recv(10) == b""
            with open_remote_store_sync(sock) as r:
                assert r.ping()
            return reply

        reply = await trio.to_thread.run_sync(sync_side)
        n.cancel_scope.cancel()
    return reply


def _one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The control channel logged one line above INFO, a warning with no traceback."""
    mine = [r for r in caplog.records if r.name == "kvfs.control" and r.levelno > logging.INFO]
    assert [(r.levelno, r.exc_info) for r in mine] == [(logging.WARNING, None)], mine


async def test_a_page_crosses_the_channel_without_copies_and_is_let_go_after_the_answer(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A put's page was held about twice in the daemon (the frame's buffer, then msgpack's
    bytes of it), and kept until the next request on the connection: an idle pooled
    connection held its last page. A get's answer was the store's bytes and a packed body
    of them, and the client packed a put's page into a body too. Measured here with
    tracemalloc in one process (client and daemon): the page itself, made before, is not
    counted; the buffer a get reads into is the daemon's only copy (an mmap, untraced)."""
    import tracemalloc

    size = 32 << 20
    page, into = os.urandom(size), bytearray(size)
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)
        r = SyncRemoteStore(sock)
        tracemalloc.start()
        try:
            await trio.to_thread.run_sync(r.put, "s/p/0", page)
            put_peak = tracemalloc.get_traced_memory()[1]
            await trio.testing.wait_all_tasks_blocked()  # the daemon waits for a request
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert await trio.to_thread.run_sync(lambda: r.get("s/p/0", into=into)) == size
            get_peak = tracemalloc.get_traced_memory()[1] - held
        finally:
            tracemalloc.stop()
            r.close()
        assert bytes(into) == page
        assert put_peak < 1.3 * size, put_peak / size  # the frame's buffer (before: 3.1)
        assert held < 0.2 * size, held / size  # (before: 1.0)
        assert get_peak < 1.3 * size, get_peak / size  # the client's frame (before: 3.0)
        n.cancel_scope.cancel()


def test_pages_decoded_as_views_are_the_messages_msgpack_decodes() -> None:
    """A page near the top of a message comes as a view into the frame, found by walking
    the msgpack before it (every kind of item), and the rest as msgpack decodes it."""
    from kvfs._control import MalformedFrame, body_pieces, decode, packed

    big = memoryview(os.urandom(3 << 20))
    info = kvfs.Extent(device=0, path="p", offset=0, length=1)
    before = [None, True, False, -1, -200, 2**40, -(2**40), 1.5, "é" * 40, "x" * 300]
    before += ["y" * 70_000, b"b" * 10, b"c" * 300, b"d" * 70_000, {"k": [1, {2: 3}]}, info]
    messages = {  # each with its number of views
        1: ["put", ["s/p/0", big], {"attrs": {"a": "b"}, "pin": True}],
        2: [0, big],
        3: big,
        4: [*before, big, [big, *before, big], *before],
        5: [0, [[big]]],  # (deeper than two levels: msgpack's own bytes)
    }
    views = {1: 1, 2: 1, 3: 1, 4: 3, 5: 0}
    for i, m in messages.items():
        body = bytearray(b"".join(body_pieces(m)))
        assert body == packed(m)
        got = decode(body, views=True)
        assert _as_bytes(got) == decode(body)
        assert _views(got) == views[i], i
    body = packed(["put", ["s/p/0", big], {}])
    for bad in (body[:-1], body + b"\x00", body[:6] + b"\xc1" + body[7:]):  # (0xc1: unused)
        with pytest.raises(MalformedFrame):
            decode(bytearray(bad), views=True)


def _views(x: Any) -> int:
    if isinstance(x, list):
        return sum(_views(y) for y in x)
    return isinstance(x, memoryview)


def _as_bytes(x: Any) -> Any:
    if isinstance(x, memoryview):
        return bytes(x)
    if isinstance(x, list):
        return [_as_bytes(y) for y in x]
    return x


async def test_a_page_frame_cut_short_or_overlong_is_answered_and_the_connection_goes_on(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A put whose page's length runs past its frame, or is followed by stray bytes, is no
    request: the daemon answers so, stores nothing and reads the next request."""
    import msgpack

    page = os.urandom(3 << 20)
    sock = tmp_path / "c.sock"
    async with kvfs.open_store(make_config()) as store, trio.open_nursery() as n:
        await n.start(control_service, store, sock)

        def sync_side() -> None:
            body = msgpack.packb(["put", ["s/p/0", page], {}], use_bin_type=True)
            at = body.index(b"\xc6")
            longer = body[: at + 1] + (len(page) + 1).to_bytes(4, "big") + body[at + 5 :]
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(os.fspath(sock))
                for bad in (longer, body + b"\x00"):
                    s.sendall(len(bad).to_bytes(4, "big") + bad)
                    reply = read_frame_sync(s)
                    assert reply[:2] == [1, "ValueError"] and "malformed" in reply[2], reply
                s.sendall(len(body).to_bytes(4, "big") + body)
                assert read_frame_sync(s)[0] == 0
            with open_remote_store_sync(sock) as r:
                assert r.get("s/p/0") == page
                buf = bytearray(len(page) + 10)
                assert r.get("s/p/0", into=buf) == len(page) and buf[: len(page)] == page

        await trio.to_thread.run_sync(sync_side)
        async with open_remote_store(sock) as r:
            await r.put("s/p/1", memoryview(page)[1:])
            assert await r.get("s/p/1") == page[1:]
            buf = bytearray(len(page))
            assert await r.get("s/p/1", into=buf) == len(page) - 1 and buf[:-1] == page[1:]
            assert await r.read_range("s/p/1", 5, 2 << 20) == page[6 : 6 + (2 << 20)]
        n.cancel_scope.cancel()


def test_a_record_with_a_field_this_side_does_not_know_still_decodes() -> None:
    """A record from a newer daemon (one more field, as PageInfo's pin_until was) failed to
    decode: `PageInfo.__init__() got an unexpected keyword argument`, and every ls or stat
    through that daemon with it."""
    import msgpack

    from kvfs._control import _RECORD_EXT, decode

    fields = {
        "path": "s/p", "session": "s", "size": 3, "checksum": "ab", "created": 1.0,
        "atime": 2.0, "pinned": False, "tier": "local", "attrs": {}, "extents": (),
        "colour": "blue",
    }  # fmt: skip
    body = msgpack.packb(["PageInfo", fields], use_bin_type=True)
    msg = msgpack.packb([0, msgpack.ExtType(_RECORD_EXT, body)], use_bin_type=True)
    assert decode(msg) == [0, kvfs.PageInfo(**{k: v for k, v in fields.items() if k != "colour"})]


def test_a_throttle_logs_one_line_per_interval_and_counts_the_rest() -> None:
    # (a failing disk's errors, on the mount and the control channel: one line per
    # DEVICE_ERROR_LOG_SECONDS, the next one saying how many were held back)
    from kvfs._events import Throttle

    now = [100.0]
    t = Throttle(10.0, clock=lambda: now[0])
    assert t.due() == 0
    assert [t.due() for _ in range(4)] == [None] * 4
    now[0] += 9.9
    assert t.due() is None
    now[0] += 0.1
    assert t.due() == 5
    now[0] += 10.0
    assert t.due() == 0
