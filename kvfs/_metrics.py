"""Observability: Prometheus metrics over HTTP, and the daemon's log destination.

:func:`render_metrics` writes the figures ``kvfs stats`` shows in the Prometheus text
exposition format (0.0.4). Per-session series are bounded: the ``max_sessions`` largest
sessions by bytes get their own series, labelled with the session's name and its directory
(``session="s1",dir="sessions/s1"``: a semantic session and an engine's directory may share a
name), the rest are summed under ``session="_other"``, so the series count never grows with
the number of sessions.

:func:`metrics_service` is a daemon service: a small trio HTTP/1.0 handler answering
``GET /metrics``. :func:`setup_logging` sends the ``kvfs`` loggers to stderr or journald.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from collections.abc import Callable

import trio

from ._store import Store
from ._types import DeviceStatistics, SessionInfo, StoreStatistics

__all__ = ["metrics_service", "render_metrics", "setup_logging"]

log = logging.getLogger("kvfs.metrics")


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def __call__(
        self,
        name: str,
        kind: str,
        help: str,
        value: float | None,
        labels: dict[str, object] | None = None,
    ) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self.lines.append(f"# HELP {name} {help}")
            self.lines.append(f"# TYPE {name} {kind}")
        if value is not None:
            self.sample(name, value, labels)

    def sample(self, name: str, value: float, labels: dict[str, object] | None = None) -> None:
        """One sample line, with no HELP or TYPE: a summary's ``_sum`` and ``_count`` are
        samples of its family, not families of their own."""
        lab = (
            ("{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}") if labels else ""
        )
        self.lines.append(f"{name}{lab} {_number(value)}")


def _number(value: float) -> str:
    """A sample's value as the exposition format takes it, every digit kept: ``:g`` kept six,
    so the restore latency's ``_sum`` stood still between scrapes once past 1e5 seconds, and a
    ``rate()`` over it read 0 and then a jump."""
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render_metrics(
    st: StoreStatistics, sessions: list[SessionInfo], *, max_sessions: int = 20
) -> str:
    """The exposition text for one scrape."""
    w = _Writer()
    g, c = "gauge", "counter"
    w(
        "kvfs_capacity_bytes",
        g,
        "Cap on bytes held locally (a capacity of 0 configured: the free space at open, less headroom).",
        st.capacity_bytes,
    )
    w("kvfs_used_bytes", g, "Bytes the local tier holds on disk.", st.used_bytes)
    w("kvfs_reserved_bytes", g, "Bytes reserved by writes in progress.", st.reserved_bytes)
    w("kvfs_pages", g, "Pages in the index.", st.pages)
    w("kvfs_sessions", g, "Sessions in the index.", st.sessions)
    w("kvfs_local_contents", g, "Distinct contents held locally.", st.local_blobs)
    w("kvfs_logical_bytes", g, "Sum of page sizes (before deduplication).", st.logical_bytes)
    per_device: list[tuple[str, str, str, Callable[[DeviceStatistics], int]]] = [
        ("kvfs_device_used_bytes", g, "Bytes used per data device.", lambda d: d.used_bytes),
        ("kvfs_device_free_bytes", g, "Free bytes per data device.", lambda d: d.free_bytes),
        (
            "kvfs_device_errors_total",
            c,
            "Disk errors (EIO, ENXIO, ENODEV, EROFS) per data device since the store opened.",
            lambda d: d.errors,
        ),
        (
            "kvfs_device_failing",
            g,
            "1 while a data device is left out of new placements after a recent disk error.",
            lambda d: int(d.failing),
        ),
    ]
    for name, kind, help_, value in per_device:
        for d in st.devices:
            w(name, kind, help_, value(d), {"device": d.index, "path": d.path})
    w("kvfs_puts_total", c, "Pages stored.", st.puts)
    w("kvfs_dedup_puts_total", c, "Puts whose content was already held.", st.dedup_puts)
    w("kvfs_gets_total", c, "Page reads.", st.gets)
    arch = st.extra.get("archive")
    a: dict[str, object] = arch if isinstance(arch, dict) else {}
    # The tiers as `kvfs stats` shows them: for the archive, hits are pages restored and
    # misses restores refused (the object failed its checksum)
    w(
        "kvfs_hits_total",
        c,
        "Reads served from the local tier; for the archive, pages restored.",
        st.hits,
        {"tier": "local"},
    )
    if a:
        w("kvfs_hits_total", c, "", a.get("blobs_restored", 0), {"tier": "archive"})  # type: ignore[arg-type]
    w(
        "kvfs_misses_total",
        c,
        "Reads that had to restore from the archive; for the archive, restores refused "
        "because the object failed its checksum.",
        st.misses,
        {"tier": "local"},
    )
    if a:
        w("kvfs_misses_total", c, "", a.get("corrupt_objects", 0), {"tier": "archive"})  # type: ignore[arg-type]
    w("kvfs_corrupt_reads_total", c, "Reads that failed their checksum.", st.corrupt_reads)
    # (page bytes, as kvfs stats shows READ and WRITTEN: a read that restored its page
    # counts, and a deduplicated put counts its size though it wrote no data)
    w("kvfs_read_bytes_total", c, "Page bytes read (gets and mount reads served).", st.bytes_read)
    w("kvfs_written_bytes_total", c, "Page bytes put (deduplicated puts too).", st.bytes_written)
    w("kvfs_evictions_total", c, "Local copies dropped, by reason.", None)
    for reason, n in sorted(st.evictions.items()):
        w("kvfs_evictions_total", c, "", n, {"reason": reason})
    w("kvfs_archive_enabled", g, "1 when an archive tier is configured.", 1 if a else 0)
    if a:
        w("kvfs_spill_queue", g, "Sessions waiting to be spilled.", a.get("spill_queue", 0))  # type: ignore[arg-type]
        w(
            "kvfs_archive_pending_deletes",
            g,
            "Archive objects queued to be deleted.",
            a.get("pending_deletes", 0),  # type: ignore[arg-type]
        )
        for key, help in (
            ("bytes_spilled", "Bytes uploaded to the archive."),
            ("bytes_restored", "Bytes restored from the archive."),
            ("sessions_spilled", "Sessions spilled."),
            ("sessions_expired", "Sessions deleted by the retention setting."),
            ("hosts_retired", "Hosts sharing the archive retired after their silence."),
            ("uploads_aborted", "Incomplete uploads of killed puts aborted in the archive."),
            ("errors", "Archive errors."),
        ):
            w(f"kvfs_archive_{key}_total", c, help, a.get(key, 0))  # type: ignore[arg-type]
        w(
            "kvfs_restore_latency_seconds",
            "summary",
            "Seconds each restore took (quantiles: the last 1024; sum, count: all).",
            None,
        )
        for q, key in (("0.5", "restore_p50_s"), ("0.99", "restore_p99_s")):
            v = a.get(key)
            if isinstance(v, (int, float)):
                w("kvfs_restore_latency_seconds", "summary", "", float(v), {"quantile": q})
        # The summary's sum and count: every restore since the store opened, so a rate()
        # over them gives the mean latency of any window (the quantiles are of the last
        # 1024 restores only).
        w.sample("kvfs_restore_latency_seconds_sum", float(a.get("restore_seconds", 0.0)))  # type: ignore[arg-type]
        w.sample("kvfs_restore_latency_seconds_count", a.get("blobs_restored", 0))  # type: ignore[arg-type]
    # A session really named "_other" is summed with the rest, never shown alone: two
    # series with one label set made the scrape invalid. The directory is a label too, for
    # the same reason: sessions/lmcache and an engine's lmcache/ are both "lmcache".
    top = sorted(
        (s for s in sessions if s.session != "_other"), key=lambda s: (-s.bytes, s.session)
    )
    shown = top[:max_sessions]
    rest = top[max_sessions:] + [s for s in sessions if s.session == "_other"]
    for name, help, attr in (
        (
            "kvfs_session_bytes",
            "Bytes per session (largest sessions; the rest summed as _other).",
            "bytes",
        ),
        ("kvfs_session_local_bytes", "Local bytes per session.", "local_bytes"),
        ("kvfs_session_pages", "Pages per session.", "pages"),
    ):
        w(name, g, help, None)
        for s in shown:
            w(name, g, "", getattr(s, attr), {"session": s.session, "dir": s.dir})
        if rest:
            w(name, g, "", sum(getattr(s, attr) for s in rest), {"session": "_other"})
    return "\n".join(w.lines) + "\n"


async def _answer(stream: trio.SocketStream, store: Store, max_sessions: int) -> None:
    request = b""
    with trio.move_on_after(10):
        while b"\r\n\r\n" not in request and len(request) < 16384:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            request += chunk
    line = request.split(b"\r\n", 1)[0].split()
    if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] in (b"/metrics", b"/"):
        st = await store.statistics()
        sessions = await store.sessions()
        body = render_metrics(st, sessions, max_sessions=max_sessions).encode()
        head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    else:
        body = b"not found: GET /metrics\n"
        head = b"HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n"
    await stream.send_all(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


async def metrics_service(
    store: Store,
    *,
    port: int,
    address: str = "127.0.0.1",
    max_sessions: int = 20,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` on ``address:port`` until cancelled; reports the bound port (useful
    with ``port=0``). Raises OSError when the port cannot be bound."""

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _answer(stream, store, max_sessions)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            except Exception:  # noqa: BLE001 - a scrape failing must not stop the daemon
                log.exception("metrics: scrape failed")

    try:
        listeners = await trio.open_tcp_listeners(port, host=address)
    except OSError as e:  # ("Address already in use" alone did not say which)
        raise OSError(e.errno, f"metrics port {address}:{port}: {e.strerror}") from e
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", address, bound)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(bound)
        await trio.sleep_forever()


class JournaldHandler(logging.Handler):
    """Native journald protocol: one datagram per record, with MESSAGE, PRIORITY and the
    structured fields of ``kvfs.events`` lines (upper-cased, prefixed ``KVFS_``)."""

    PRIORITY = {
        logging.DEBUG: 7,
        logging.INFO: 6,
        logging.WARNING: 4,
        logging.ERROR: 3,
        logging.CRITICAL: 2,
    }

    def __init__(self, path: str = "/run/systemd/journal/socket") -> None:
        super().__init__()
        if not os.path.exists(path):  # a setting that cannot work here: a usage error
            raise ValueError(f'journald is not running here (no {path}); use log_target = "stderr"')
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {
                "MESSAGE": self.format(record),
                "PRIORITY": str(self.PRIORITY.get(record.levelno, 6)),
                "SYSLOG_IDENTIFIER": "kvfs",
                "LOGGER": record.name,
            }
            event = getattr(record, "kvfs_event", None)
            if event:
                fields["KVFS_EVENT"] = str(event)
            data = b"".join(f"{k}={v.replace(chr(10), ' ')}\n".encode() for k, v in fields.items())
            self.sock.sendto(data, self.path)
        except OSError:
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def setup_logging(level: str = "info", target: str = "stderr") -> None:
    """Send the ``kvfs`` loggers at ``level`` to stderr or journald. Raises ValueError for an
    unknown level or target, or journald asked for but absent."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    if target == "stderr":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif target == "journald":
        handler = JournaldHandler()
    else:
        raise ValueError(f"unknown log target {target!r} (stderr or journald)")
    root = logging.getLogger("kvfs")
    root.setLevel(lvl)
    root.addHandler(handler)
    root.propagate = False
