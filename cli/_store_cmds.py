"""Store commands: ls, stats, put, get, rm, pin, unpin, evict, spill, restore, fsck.

Each works on the running daemon's store when one answers on the control socket, and on
the data directory itself otherwise (:mod:`cli._target`). Every command has ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import kvfs
from kvfs._config import parse_duration
from kvfs._control import DaemonUnavailable
from kvfs._keys import split_path
from kvfs._maint import FSCK_PROBLEMS
from kvfs._mountinfo import kvfs_mount_of
from kvfs._remote import SyncRemoteStore

from ._target import add_store_flags, map_mount_paths, open_target
from ._util import (
    EXIT,
    Progress,
    Refused,
    count,
    fmt_bytes,
    fmt_duration,
    fmt_span,
    fmt_time,
    name_order,
    print_json,
    print_table,
    printable,
    seconds,
)

__all__ = ["register", "render_stats"]

#: How often `kvfs stats --watch` tries again an archive it found down: each try waits out
#: the endpoint's open_deadline (15 s), and each refresh waited it out.
ARCHIVE_RETRY_SECONDS = 60.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls",
        help="list sessions, or the pages of a session or path prefix",
        description="Offline (no daemon), a store whose archive cannot be reached is listed "
        "from its own index, saying so on stderr: pages only the archive holds show as "
        "archive. --archived needs the archive.",
    )
    p.add_argument("target", nargs="?", metavar="PATH|SESSION")
    p.add_argument(
        "-l", dest="long", action="store_true", help="long listing (checksum, created, attributes)"
    )
    p.add_argument(
        "--sort",
        choices=("name", "size", "age"),
        default="name",
        help="order: name (default; numbers in numeric order, layer-999 before layer-1000), size (largest first), age (oldest access first)",
    )
    p.add_argument(
        "--archived",
        action="store_true",
        help="list the sessions the archive holds (from every host sharing it)",
    )
    add_store_flags(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "hosts",
        help="the hosts sharing the archive: state, sessions, retention, last heartbeat, when "
        "the others take a silent one for gone (or took it)",
        description="STATE: live (its heartbeat is recent), silent (no heartbeat for two of its "
        "intervals), retiring or retired (another host took it for gone: its unpinned sessions "
        "are deleted; RETIRED says when, by the archive's clock), or no-heartbeat (it never "
        "wrote one: kvfs before heartbeats, or a store used without a background task; such "
        "a host is never retired). SESSIONS counts its manifests that hold pages (not the "
        "empty ones that only say a session it took over was deleted). RETIRED, for a host "
        "with a retention: when the others take it for gone if it stays silent (due: at "
        "their next look); never with retention 0 (keep) or no heartbeat.",
    )
    _add_mount(p)
    add_store_flags(p)
    p.set_defaults(func=cmd_hosts)

    p = sub.add_parser(
        "stats",
        help="capacity, use, hits and misses, traffic, spill queue, restore latency, evictions",
        description="Tiers: local HITS are reads served from the local tier, MISSES reads "
        "that had to restore from the archive; archive HITS are pages restored, MISSES "
        "restores refused because the object failed its checksum. READ and WRITTEN are page "
        "bytes read and written (for the archive: restored and spilled). On a mount, each "
        "read the daemon serves counts (a page read whole may be several); reads the "
        "kernel's page cache answers, and the fast path's reads by path, reach no counter. "
        "The counters are the daemon's since it started, or this command's own when no "
        "daemon runs; the figures of the index (pages, sessions, bytes) outlive both. "
        "Offline, a store whose archive cannot be reached is read without it: the archive "
        "line says so (with --json: archive_error in extra).",
    )
    _add_mount(p)
    p.add_argument(
        "--watch",
        type=_watch_seconds,
        metavar="SECONDS",
        nargs="?",
        const=2.0,
        help="refresh every SECONDS (default 2) until interrupted; with --json, one "
        "object per line (JSON Lines). The store is opened for each refresh (a daemon may "
        "start meanwhile); one that finds it busy says so and the next tries again. "
        "Offline, an archive that cannot be reached is not waited for again: it is tried "
        f"again every {ARCHIVE_RETRY_SECONDS:g} s",
    )
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after N refreshes")
    add_store_flags(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("put", help="store a file as a page")
    p.add_argument("file", metavar="FILE", help="file to store ('-': standard input)")
    p.add_argument("key", metavar="PATH", help="page path, e.g. sessions/s1/p0/layer-000")
    p.add_argument("--attr", action="append", default=[], metavar="K=V", help="page attribute")
    p.add_argument("--pin", action="store_true", help="pin the page")
    p.add_argument("--replace", action="store_true", help="replace an existing page")
    add_store_flags(p)
    p.set_defaults(func=cmd_put)

    p = sub.add_parser("get", help="write a page's bytes to a file")
    p.add_argument("key", metavar="PATH")
    p.add_argument(
        "file",
        metavar="FILE",
        nargs="?",
        default="-",
        help="destination ('-' or absent: standard output)",
    )
    add_store_flags(p)
    p.set_defaults(func=cmd_get)

    for name, text, fn in (
        ("rm", "delete pages or whole sessions", cmd_rm),
        ("pin", "pin pages or sessions (never evicted until unpinned, or for a while)", cmd_pin),
        ("unpin", "unpin pages or sessions", cmd_unpin),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("targets", nargs="+", metavar="SESSION|PATH")
        if name == "pin":
            p.add_argument(
                "--for",
                dest="ttl",
                type=_pin_duration,
                metavar="DURATION",
                help="the pin ends after DURATION (90s, 30m, 2h, 7d; a number: seconds), as an "
                "unpin would end it: what a process that crashed pinned is not kept for good. "
                "Pinning again replaces the lifetime: without --for the pin is for good",
            )
        add_store_flags(p)
        p.set_defaults(func=fn)

    p = sub.add_parser(
        "evict",
        help="drop local copies, archived first (with no archive tier: refuses to delete unless --force)",
    )
    p.add_argument("targets", nargs="+", metavar="SESSION|PATH")
    p.add_argument(
        "--force",
        action="store_true",
        help="with no archive tier, delete the pages named (their data stays where another "
        "session shares it): data loss",
    )
    add_store_flags(p)
    p.set_defaults(func=cmd_evict)

    for name, text, more in (
        (
            "spill",
            "upload sessions to the archive and drop the local copies",
            "Prints the page bytes that left the local tier and, beside them, the bytes "
            "uploaded (compressed, and only what the archive lacked).",
        ),
        (
            "restore",
            "bring sessions back from the archive",
            "Prints the page bytes brought back. With --archive (or an archive in the "
            "configuration) and no store in --data yet, makes one: a new host sharing the "
            "archive restores what the others spilled.",
        ),
    ):
        p = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. {more}")
        p.add_argument("sessions", nargs="+", metavar="SESSION")
        add_store_flags(p)
        p.set_defaults(func=cmd_spill_restore, op=name)

    p = sub.add_parser(
        "fsck",
        help="check the index against the files and its rows against each other: missing, "
        "wrong checksums, orphans, lost or wrong rows",
        description="Check the index against the files and its rows against each other. "
        "Prints each kind of finding (docs/cli.md says what each lists); exit 5 when there are problems, or when --repair kept damaged pages it "
        "could not mend (unrecoverable). Offline (no daemon), a store whose archive cannot "
        "be reached is checked without it: archive_error says why, and the exit is 8 (5 "
        "when the local check found problems); --repair is refused then (exit 8, nothing "
        "changed).",
    )
    _add_mount(p)
    p.add_argument(
        "--repair",
        action="store_true",
        help="remove orphans; mend the index's rows (a lost blob row made again from its "
        "files or the archive's copy, sizes, reference counts); restore damaged copies of "
        "archived data from the archive; delete the pages whose data is missing or corrupt "
        "and held nowhere else, except pinned ones (kept, and listed as unrecoverable: exit "
        "5); with --check-archive, upload again the archive objects found damaged whose "
        "data is still held here",
    )
    p.add_argument(
        "--check-archive",
        action="store_true",
        help="also download and verify the archive object of everything this store has "
        "archived (a download of each)",
    )
    add_store_flags(p)
    p.set_defaults(func=cmd_fsck)


# -- helpers --------------------------------------------------------------------------
def _add_mount(p: argparse.ArgumentParser, more: str = "") -> None:
    """MOUNT for a command that names no page or session: which mount's daemon to ask, as
    the others find it from a path on the mount (``kvfs stats /mnt/kv`` from elsewhere was
    a usage error; only a working directory on the mount or --data named the store)."""
    p.add_argument(
        "mount",
        nargs="?",
        metavar="MOUNT",
        help="the mount point, or any path on a kvfs mount: use the store it serves, as a "
        "path on a mount does for ls or pin (--data or --config naming another store is a "
        "usage error; "
        f"without MOUNT, a working directory on a mount does the same){more}",
    )


def _resolve(store: Any, target: str) -> tuple[str, str]:
    """("page", path), ("session", name) or ("directory", "path/"): a directory of pages
    that is no session (a prefix's, as a user pastes it from the mount). Raises
    PageNotFound when it is none of them; InvalidKey when it could be none of them."""
    try:
        return "page", store.stat(target).path
    except (kvfs.PageNotFound, kvfs.InvalidKey):
        pass
    try:
        d = store.session_info(target).dir
    except (kvfs.SessionNotFound, kvfs.InvalidKey):
        below = target.rstrip("/") + "/"
        if below != "/" and store.list(path_prefix=below):
            return "directory", below
        split_path(target.rstrip("/"))  # ('..', empty, NUL: a bad name, not a missing one)
        raise kvfs.PageNotFound(f"no page or session {target!r}") from None
    # the directory itself: a bare name could mean sessions/<name> to the next call
    return "session", d if "/" in d or d == "." else d + "/"


def _emit(args: argparse.Namespace, result: Any, lines: list[str]) -> None:
    if args.json:
        print_json(result)
    else:
        for line in lines:
            print(line)


# -- ls -------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    given = args.target  # (open_target turns a path on the mount into the store's path)
    with open_target(args, from_archive=args.archived, inspect=not args.archived) as store:
        if args.archived:
            return _ls_archived(args, store.archived_sessions())
        if args.target in (None, "."):  # ("." : the mount's root, see map_mount_paths)
            return _ls_sessions(args, store.sessions())
        try:
            pages = [store.stat(args.target)]
        except (kvfs.PageNotFound, kvfs.InvalidKey):
            try:
                store.session_info(args.target)
                pages = store.list(session=args.target)
            except (kvfs.SessionNotFound, kvfs.InvalidKey):
                prefix = args.target.rstrip("/") + "/"
                pages = store.list(path_prefix=prefix)
                # ("sessions/" is always there: on the mount too)
                if not pages and prefix != "sessions/" and not _dir_on_a_mount(given):
                    split_path(args.target.rstrip("/"))  # (a bad name: InvalidKey, exit 2)
                    raise kvfs.PageNotFound(
                        f"no page, session or directory {args.target!r}"
                    ) from None
        # A pinned session keeps its pages as a pin of each would (user.kvfs.pinned says 1)
        held = {d for d in {_session_arg(p) for p in pages} if _session_pinned(store, d)}
    key = {
        "name": lambda p: name_order(p.path),
        "size": lambda p: -p.size,
        "age": lambda p: p.atime,
    }[args.sort]
    pages.sort(key=key)
    if args.json:
        print_json([{**_page_json(p), "session_pinned": _session_arg(p) in held} for p in pages])
        return 0
    headers = ["PATH", "SIZE", "TIER", "PINNED", "ACCESSED"]
    if args.long:
        headers += ["CREATED", "CHECKSUM", "ATTRS"]
    rows = []
    for p in pages:
        pin = _pin_cell(p.pinned, p.pin_until) or ("session" if _session_arg(p) in held else "")
        row = [p.path, fmt_bytes(p.size), p.tier, pin, fmt_time(p.atime)]
        if args.long:
            row += [
                fmt_time(p.created),
                p.checksum[:16],
                ",".join(f"{k}={v}" for k, v in sorted(p.attrs.items())),
            ]
        rows.append(row)
    print_table(headers, rows, empty=f"no pages in {printable(given or args.target)}")
    return 0


def _dir_on_a_mount(target: str | None) -> bool:
    """``target`` is a directory a kvfs mount shows (a path on it, or a name in a working
    directory on it). Made with mkdir and still empty, it has no pages, and the store's API
    knows pages and sessions, not directories: ``kvfs ls`` of it said "no page" (exit 3)
    where ``ls`` shows it."""
    return (
        target is not None
        and os.path.isdir(target)
        and kvfs_mount_of(os.path.abspath(target)) is not None
    )


def _session_arg(p: kvfs.PageInfo) -> str:
    """The page's session as ``session_info`` takes it: a semantic session's name, else its
    directory (``vllm/`` with the slash: the bare name could mean ``sessions/vllm``)."""
    if p.path.startswith("sessions/") or "/" in p.session or p.session == ".":
        return p.session
    return p.session + "/"


def _pin_cell(pinned: bool, until: float | None) -> str:
    """The PINNED column: "yes" for a pin for good, the time left of one with a lifetime."""
    if not pinned:
        return ""
    return "yes" if until is None else f"{fmt_span(max(0.0, until - time.time()))} left"


def _session_pinned(store: Any, session: str) -> bool:
    try:
        return bool(store.session_info(session).pinned)
    except (kvfs.SessionNotFound, kvfs.InvalidKey):
        return False


def _page_json(p: kvfs.PageInfo) -> dict[str, Any]:
    return {
        "path": p.path,
        "session": p.session,
        "size": p.size,
        "tier": p.tier,
        "pinned": p.pinned,
        "pin_until": p.pin_until,
        "atime": p.atime,
        "created": p.created,
        "checksum": p.checksum,
        "attrs": p.attrs,
    }


def _ls_archived(args: argparse.Namespace, sessions: list[dict[str, Any]]) -> int:
    key: Callable[[dict[str, Any]], Any] = {
        "name": lambda s: name_order(s["session"]),
        "size": lambda s: -int(s.get("bytes", 0)),
        "age": lambda s: float(s.get("atime", 0)),
    }[args.sort]
    sessions.sort(key=key)
    if args.json:
        print_json(sessions)
        return 0
    print_table(
        ["SESSION", "PAGES", "SIZE", "SPILLED", "STORE", "HOSTS"],
        [
            [
                s["session"],
                s.get("pages", ""),
                fmt_bytes(int(s.get("bytes", 0))),
                fmt_time(float(s.get("spilled_at", 0))),
                str(s.get("store_id", ""))[:12],  # the host that wrote last
                s.get("hosts", 1),
            ]
            for s in sessions
        ],
        empty="no sessions in the archive",
    )
    return 0


def cmd_hosts(args: argparse.Namespace) -> int:
    with open_target(args) as store:
        hosts = store.archive_hosts()
    if args.json:
        print_json(hosts)
        return 0

    def when(t: object) -> str:
        return fmt_time(float(t)) if isinstance(t, (int, float)) else "-"

    def retired(h: dict[str, Any]) -> str:
        state = h.get("state")
        if state == "retired":
            return when(h.get("retired_at"))
        if state == "retiring":
            return "under way"
        at = h.get("retire_at")
        if not isinstance(at, (int, float)):
            return "never"
        left = at - time.time()
        if left <= 0:
            return "due"
        return f"in {fmt_span(left)}" + (" if silent" if state == "live" else "")

    def retention(h: dict[str, Any]) -> str:
        r = h.get("retention_s")
        if isinstance(r, (int, float)):
            return fmt_duration(float(r)) if r else "keep"
        return "-"  # not known: no heartbeat ever read

    print_table(
        ["STORE", "THIS", "STATE", "SESSIONS", "RETENTION", "HEARTBEAT", "RETIRED"],
        [
            [
                str(h["store_id"]),
                "yes" if h.get("this") else "",
                str(h.get("state", "")),
                h.get("sessions", 0),
                retention(h),
                when(h.get("last_heartbeat")),
                retired(h),
            ]
            for h in hosts
        ],
        align="lllrlll",
        empty="no host has written to the archive yet",
    )
    return 0


def _ls_sessions(args: argparse.Namespace, sessions: list[kvfs.SessionInfo]) -> int:
    key = {
        "name": lambda s: name_order(s.session),
        "size": lambda s: -s.bytes,
        "age": lambda s: s.atime,
    }[args.sort]
    sessions.sort(key=key)
    if args.json:
        print_json(sessions)
        return 0
    headers = ["SESSION", "PAGES", "SIZE", "LOCAL", "ARCHIVED", "PINNED", "ACCESSED"]
    if args.long:
        headers += ["CREATED", "MODEL"]
    rows = []
    for s in sessions:
        row = [
            s.session,
            s.pages,
            fmt_bytes(s.bytes),
            fmt_bytes(s.local_bytes),
            fmt_bytes(s.archived_bytes),
            _pin_cell(s.pinned, s.pin_until),
            fmt_time(s.atime),
        ]
        if args.long:
            row += [fmt_time(s.created), s.model or ""]
        rows.append(row)
    print_table(headers, rows, empty="no sessions")
    return 0


# -- stats ----------------------------------------------------------------------------
def _rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def render_stats(st: kvfs.StoreStatistics, *, own_counters: bool = False) -> str:
    """``kvfs stats`` as text: devices, tiers, hits and misses, traffic, archive, evictions."""
    out: list[str] = []
    cap = fmt_bytes(st.capacity_bytes) if st.capacity_bytes else "disk"
    out.append(
        f"local tier: {fmt_bytes(st.used_bytes)} used of {cap} "
        f"({fmt_bytes(st.reserved_bytes)} reserved); {count(st.pages, 'page')} in "
        f"{count(st.sessions, 'session')}; {count(st.local_blobs, 'distinct content')} "
        f"({fmt_bytes(st.local_bytes)}, {fmt_bytes(st.logical_bytes)} before dedup)"
    )
    rows = [
        [
            d.index,
            d.path,
            fmt_bytes(d.used_bytes),
            fmt_bytes(d.free_bytes),
            d.errors,
            "failing" if d.failing else "ok",
        ]
        for d in st.devices
    ]
    buf = io.StringIO()
    print_table(["DEVICE", "PATH", "USED", "FREE", "ERRORS", "STATE"], rows, file=buf)
    out.append(buf.getvalue().rstrip())
    for d in st.devices:
        if d.last_error is not None and d.last_error_at is not None:
            ago = fmt_duration(max(0.0, time.time() - d.last_error_at))
            out.append(f"device {d.index}: last disk error {ago} ago: {d.last_error}")
    extra = st.extra.get("archive")
    arch: dict[str, Any] | None = extra if isinstance(extra, dict) else None
    a: dict[str, Any] = arch or {}
    buf = io.StringIO()
    print_table(
        ["TIER", "HITS", "MISSES", "HIT RATE", "READ", "WRITTEN"],
        [
            [
                "local",
                st.hits,
                st.misses,
                _rate(st.hits, st.misses),
                fmt_bytes(st.bytes_read),
                fmt_bytes(st.bytes_written),
            ],
            *(
                [
                    [
                        "archive",
                        a.get("blobs_restored", 0),
                        a.get("corrupt_objects", 0),
                        _rate(a.get("blobs_restored", 0), a.get("corrupt_objects", 0)),
                        fmt_bytes(a.get("bytes_restored", 0)),
                        fmt_bytes(a.get("bytes_spilled", 0)),
                    ]
                ]
                if arch
                else []
            ),
        ],
        file=buf,
    )
    out.append(buf.getvalue().rstrip())
    out.append(
        f"puts {st.puts} (deduplicated {st.dedup_puts}), gets {st.gets}, "
        f"corrupt reads {st.corrupt_reads}"
        + (" (this command's own counts: no daemon is running)" if own_counters else "")
    )
    if arch:

        def sec(v: object) -> str:
            return f"{float(v) * 1000:.1f} ms" if isinstance(v, (int, float)) else "-"

        retention = float(a.get("retention_s") or 0)  # type: ignore[arg-type]
        kept = (
            f"sessions expired {a.get('sessions_expired', 0)} (retention {fmt_duration(retention)})"
            if retention
            else "retention: keep"
        )
        paused = a.get("retention_paused_ahead_s")
        if isinstance(paused, (int, float)):
            kept += (
                f", retention PAUSED: this host's clock is {fmt_span(float(paused))} ahead "
                "of the archive's"
            )
        if a.get("hosts_retired"):
            kept += f", hosts retired {a['hosts_retired']}"
        if a.get("pending_deletes"):
            kept += f", objects to delete {a['pending_deletes']}"
        if a.get("uploads_aborted"):
            kept += f", killed uploads aborted {a['uploads_aborted']}"
        out.append(
            f"archive {a.get('url')}: spill queue {a.get('spill_queue', 0)}, sessions "
            f"spilled {a.get('sessions_spilled', 0)}, {kept}, background errors "
            f"{a.get('errors', 0)}, restore latency p50 "
            f"{sec(a.get('restore_p50_s'))} p99 {sec(a.get('restore_p99_s'))}"
        )
    else:
        err = st.extra.get("archive_error")
        out.append(
            f"archive {err.get('url')}: unavailable, not opened ({err.get('error')}); the "
            "figures above are the local tier's"
            if isinstance(err, dict)
            else "archive: none configured"
        )
    ev = ", ".join(f"{k} {v}" for k, v in sorted(st.evictions.items())) or "none"
    out.append(f"evictions: {ev}")
    out += _settings_lines(st.extra)
    return "\n".join(out)


def _settings_lines(extra: dict[str, Any]) -> list[str]:
    """The settings the store runs with, and the mount serving it (a daemon's own flags)."""
    out = []
    s = extra.get("settings")
    if isinstance(s, dict):
        out.append(
            f"settings: stripe unit {fmt_bytes(s.get('stripe_unit', 0))}, O_DIRECT "
            f"{_on(s.get('direct_io'))}, durable {_on(s.get('durable'))}, "
            f"{s.get('io_threads')} I/O threads, index {s.get('index')}"
        )
    m = extra.get("mount")
    if isinstance(m, dict):
        out.append(
            f"mount: {m.get('mountpoint')} (pid {m.get('pid')}), direct_io "
            f"{_on(m.get('direct_io'))}, read-ahead {m.get('read_ahead_kb')} KiB, allow_other "
            f"{_on(m.get('allow_other'))}, {m.get('threads')} threads"
        )
    return out


def _on(v: object) -> str:
    return "on" if v else "off"


class _NotSeconds(str):
    """What followed --watch, and is no number: the MOUNT (``kvfs stats --watch /mnt/kv``)."""


def _watch_seconds(text: str) -> float | _NotSeconds:
    """--watch's SECONDS; a word that is no number is left for MOUNT (--watch's value is
    optional, so argparse gave it the path that followed: "invalid seconds value")."""
    try:
        float(text)
    except ValueError:
        return _NotSeconds(text)
    return seconds(text)


def cmd_stats(args: argparse.Namespace) -> int:
    if isinstance(args.watch, _NotSeconds):
        if args.mount is not None:
            raise ValueError(f"--watch takes a number of seconds, not {str(args.watch)!r}")
        args.mount, args.watch = str(args.watch), 2.0
    if args.count and not args.watch:
        raise ValueError("--count needs --watch (it counts the refreshes)")
    n = 0
    down: str | None = None  # why the archive could not be opened, while it is not tried
    tried = 0.0  # when it was found down (time.monotonic())
    said = False
    while True:
        if down is not None and time.monotonic() - tried >= ARCHIVE_RETRY_SECONDS:
            down = None  # (it may be back)
        # Opened for each refresh: a watch over the data directory itself held its lock
        # all along (a daemon could not start), and one through a daemon ended with it
        try:
            with open_target(args, inspect=True, archive_down=down) as store:
                st = store.statistics()
                own = not isinstance(store, SyncRemoteStore)
                why = getattr(getattr(store, "engine", None), "archive_error", None)
        except (kvfs.StoreLocked, DaemonUnavailable) as e:
            if not args.watch:
                raise
            # (a daemon starting or stopping, another command holding the store a moment)
            print(f"kvfs stats: {e}; trying again in {args.watch:g} s", file=sys.stderr)
            n += 1
            if args.count and n >= args.count:
                return EXIT["locked"]
            time.sleep(args.watch)
            continue
        if args.watch and why is not None and down is None:  # (just tried, and down)
            if not said and not (args.count and n + 1 >= args.count):
                said = True
                print(
                    "kvfs stats: the next refreshes do not wait for the archive; it is tried "
                    f"again every {ARCHIVE_RETRY_SECONDS:g} s",
                    file=sys.stderr,
                )
            down, tried = why, time.monotonic()
        if args.json:
            print_json(st, line=bool(args.watch))  # watching: one object per line
        else:
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            if args.watch:
                print(time.strftime("%H:%M:%S"))
            print(render_stats(st, own_counters=own))
        sys.stdout.flush()
        n += 1
        if not args.watch or (args.count and n >= args.count):
            return 0
        time.sleep(args.watch)


# -- put / get ------------------------------------------------------------------------
def cmd_put(args: argparse.Namespace) -> int:
    attrs = {}
    for a in args.attr:
        k, sep, v = a.partition("=")
        if not sep or not k:
            raise ValueError(f"--attr wants K=V, not {a!r}")
        attrs[k] = v
    map_mount_paths(args)  # (a path on the mount names a page of the mount's store)
    kvfs.PageKey(args.key)  # a bad name is refused before a store is made for it
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(args.file, "rb") as f:
            data = f.read()
    with open_target(args, create=True) as store:
        try:
            info = store.put(
                args.key, data, attrs=attrs or None, pin=args.pin, replace=args.replace
            )
        except kvfs.PageExists as e:  # (the store's word says why, not what to do)
            raise kvfs.PageExists(f"{e} (--replace replaces it)") from None
    _emit(
        args,
        _page_json(info),
        [f"{printable(info.path)}: {fmt_bytes(info.size)} stored ({info.checksum[:16]})"],
    )
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    if args.json and args.file == "-":  # (the output is the page: JSON cannot be beside it)
        raise ValueError("--json describes a page written to a FILE; name one (or drop --json)")
    with open_target(args) as store:
        # (the buffer the page was read or received into: a bytes of it held the page twice)
        data = store.read_page(args.key)
    if args.file == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return 0
    with open(args.file, "wb") as f:
        f.write(data)
    _emit(
        args,
        {"path": args.key, "file": args.file, "size": len(data)},
        [f"{args.key}: {fmt_bytes(len(data))} written to {args.file}"],
    )
    return 0


# -- rm / pin / unpin / evict ---------------------------------------------------------
def _each(
    args: argparse.Namespace, page_op: str, session_op: str, verb: str, note: str = "", **kw: Any
) -> int:
    """``page_op`` or ``session_op`` (with ``kw``, which --json's records show too) on each
    target; ``note`` ends each line said."""
    results: list[dict[str, Any]] = []

    def emit() -> None:
        _emit(
            args,
            results,
            [
                f"{verb} {r['kind']} {printable(r['target'])}"
                + (f" ({count(r['pages'], 'page')})" if r["kind"] != "page" else "")
                + note
                for r in results
            ],
        )

    with open_target(args) as store:
        # Every target is checked before any is acted on: a typo in the last one must not
        # leave the others half done.
        plan = [(t, *_resolve(store, t)) for t in args.targets]
        with _partial(emit, results, verb):
            for t, kind, name in plan:
                if kind == "directory":  # each page below it
                    pages = store.list(path_prefix=name)
                    for p in pages:
                        getattr(store, page_op)(p.path, **kw)
                    r: Any = len(pages)
                else:
                    r = getattr(store, page_op if kind == "page" else session_op)(name, **kw)
                counted = isinstance(r, int) and not isinstance(r, bool)
                # ("result": what the store call returned, kept for scripts that read it;
                # a session's pin returns nothing: its pages are those it holds)
                if counted:
                    pages = r
                elif kind == "page":
                    pages = 1
                else:
                    pages = store.session_info(name).pages
                results.append({"target": t, "kind": kind, "pages": pages, "result": r, **kw})
    emit()
    return 0


@contextlib.contextmanager
def _partial(emit: Callable[[], None], results: list[Any], verb: str) -> Iterator[None]:
    """When a command over several targets fails midway, say what it did before the error."""
    try:
        yield
    except Exception:
        if results:
            emit()
            print(f"(only the {len(results)} above {verb}; then:)", file=sys.stderr)
        raise


def cmd_rm(args: argparse.Namespace) -> int:
    return _each(args, "delete", "delete_session", "deleted")


def cmd_pin(args: argparse.Namespace) -> int:
    if args.ttl is None:
        return _each(args, "pin", "pin_session", "pinned")
    return _each(
        args, "pin", "pin_session", "pinned", f" for {fmt_duration(args.ttl)}", ttl=args.ttl
    )


def _pin_duration(text: str) -> float:
    """--for's DURATION: a bad one is a usage error (exit 2)."""
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"a pin lasts more than 0 seconds, not {text!r}")
    return seconds


def cmd_unpin(args: argparse.Namespace) -> int:
    return _each(args, "unpin", "unpin_session", "unpinned")


def cmd_evict(args: argparse.Namespace) -> int:
    results = []
    with open_target(args) as store:
        archived_tier = "archive" in store.statistics().extra
        plan = []
        for t in args.targets:
            kind, name = _resolve(store, t)
            if kind == "page":
                pages = [store.stat(name)]
            elif kind == "directory":
                pages = store.list(path_prefix=name)
            else:
                pages = store.list(session=name)
            # Without an archive tier an evict deletes, archived or not: a page archived
            # before has its copy there forgotten too (the index queues it for the next
            # open with the archive).
            held = kind == "session" and store.session_info(name).pinned
            doomed = [p for p in pages if p.local and not p.pinned and not held]
            if doomed and not archived_tier and not args.force:
                archived = sum("archive" in p.tier for p in doomed)
                raise Refused(
                    f"{t}: no archive tier is configured, so evicting would delete "
                    f"{len(doomed)} page(s)"
                    + (
                        f" ({archived} of them archived before: open with --archive "
                        "to evict them to it)"
                        if archived
                        else ""
                    )
                    + " (--force to do it anyway)"
                )
            pinned = sum(1 for p in pages if p.local and (p.pinned or held))
            plan.append((t, kind, name, pages, pinned))
        for t, kind, name, pages, pinned in plan:
            # what the archive lacks is uploaded first: the bytes as they go
            with _progress(args, f"evict {t}", 1, fmt=fmt_bytes) as bar:
                if kind == "directory":  # the pages checked above
                    freed = sum(store.evict(key=p.path, progress=_bytes_to(bar)) for p in pages)
                else:
                    where = {"key": name} if kind == "page" else {"session": name}
                    freed = store.evict(**where, progress=_bytes_to(bar))
            # Pages whose data a pinned page elsewhere shares stay local too: counted here
            kept = sum(1 for p in pages if _still_local(store, p.path))
            results.append(
                {
                    "target": t,
                    "kind": kind,
                    "freed_bytes": freed,
                    "pinned_kept": pinned,
                    "local_kept": kept,
                }
            )
    _emit(
        args,
        results,
        [
            f"evicted {r['kind']} {printable(r['target'])}: {fmt_bytes(r['freed_bytes'])} freed"
            + _evict_kept(r["pinned_kept"], r["local_kept"] - r["pinned_kept"])
            for r in results
        ],
    )
    return 0


def _evict_kept(pinned: int, shared: int) -> str:
    """What an eviction left local and why, in one parenthesis (two, back to back, read
    as a stutter)."""
    why = []
    if pinned:
        why.append(f"{pinned} pinned page(s) kept: kvfs unpin first")
    if shared > 0:
        why.append(f"{shared} page(s) kept: their data is shared with a pinned page, or in use")
    return f" ({'; '.join(why)})" if why else ""


def _still_local(store: Any, path: str) -> bool:
    try:
        return bool(store.stat(path).local)
    except kvfs.PageNotFound:
        return False


def _progress(args: argparse.Namespace, label: str, total: int, **kw: Any) -> Progress:
    """A progress bar on a terminal, none with ``--json``: a script that asks for JSON reads
    the output, not a bar (drawn on stderr, it filled a log that took both streams)."""
    return Progress(label, total, enabled=False if args.json else None, **kw)


def _bytes_to(bar: Progress) -> Callable[[int, int], None]:
    """A store's ``progress(bytes done, bytes in all)`` shown on ``bar``."""

    def progress(done: int, total: int) -> None:
        if total:  # nothing to move: no bar
            bar.total = total
            bar.update(done - bar.done)

    return progress


# -- spill / restore / fsck -----------------------------------------------------------
def cmd_spill_restore(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    verb = "spilled" if args.op == "spill" else "restored"

    def emit() -> None:
        _emit(
            args,
            results,
            [
                f"{verb} {printable(r['session'])}: {fmt_bytes(r['bytes'])} in {r['seconds']:.2f}s"
                + (f" ({fmt_bytes(r['uploaded_bytes'])} uploaded)" if "uploaded_bytes" in r else "")
                for r in results
            ],
        )

    with (
        open_target(args, from_archive=args.op == "restore") as store,
        _progress(args, args.op, len(args.sessions), unit=" sessions") as bar,
        _partial(emit, results, verb),
    ):
        # (not for a restore: it may name a session only the archive knows)
        if args.op == "spill" and len(args.sessions) > 1:
            for s in args.sessions:
                store.session_info(s)  # raises SessionNotFound before anything is spilled
        for s in args.sessions:
            t0 = time.perf_counter()
            # and the page bytes of each session as they are archived or come back
            local = _local_bytes(store, s)
            with _progress(args, f"{args.op} {s}", 1, fmt=fmt_bytes) as pages:
                n = getattr(store, args.op)(s, progress=_bytes_to(pages))
            r = {"session": s, "bytes": n, "seconds": round(time.perf_counter() - t0, 3)}
            if args.op == "spill":
                # page bytes that left the local tier, as a restore counts what comes back;
                # what the upload sent (compressed, only what the archive lacked) beside it
                r["bytes"] = max(0, local - _local_bytes(store, s))
                r["uploaded_bytes"] = n
            else:
                # page bytes that came back, as ls counts them: the store's own count is of
                # contents, each once, so pages sharing one (dedup) were counted as one
                r["bytes"] = max(0, _local_bytes(store, s) - local)
            results.append(r)
            bar.update()
    emit()
    return 0


def _local_bytes(store: Any, session: str) -> int:
    """A session's page bytes held locally (0 when there is no such session: the command
    itself then says what is wrong, or that there is no archive)."""
    try:
        return int(store.session_info(session).local_bytes)
    except kvfs.SessionNotFound:
        return 0


def cmd_fsck(args: argparse.Namespace) -> int:
    # (a repair needs the archive: it could delete pages whose good copy is there)
    with open_target(args, inspect=not args.repair) as store:
        engine = getattr(store, "engine", None)
        # opened without the archive it could not reach: a repair would be refused
        offline = engine is not None and engine.archive_error is not None
        # a progress bar per checked content (through a daemon: from its progress frames)
        with _progress(args, "fsck", 1, unit=" contents") as bar:

            def progress(done: int, total: int) -> None:
                bar.total = max(total, 1)
                bar.update(done - bar.done)

            found = store.fsck(repair=args.repair, archive=args.check_archive, progress=progress)
    if not args.repair:  # ("repaired: 0" read as a repair tried; docs/cli.md: --repair's)
        for k in ("repaired", "archive_repaired", "unrecoverable"):
            found.pop(k, None)
    problems = sum(len(found.get(k, ())) for k in FSCK_PROBLEMS)
    lines = [
        f"{k}: {len(v)}"
        # one line each, as ls shows names: a newline in a page's name would split it in two
        + "".join(f"\n  {printable(x)}" for x in v[:20])
        + (f"\n  ... {len(v) - 20} more" if len(v) > 20 else "")
        for k, v in found.items()
    ]
    # archive objects damaged whose data this store does not hold: no repair here
    elsewhere = len(found.get("archive_damaged_pages", ())) if args.repair else 0
    # damaged pages the repair kept: pinned, or damaged in the archive too
    kept = len(found.get("unrecoverable", ()))
    lost = elsewhere + kept
    if not problems:
        verdict = "clean"
    elif args.repair:
        verdict = (
            "repaired"
            + (
                f"; {elsewhere} page(s) whose archive object is damaged are held nowhere here "
                "(another host sharing the archive may hold them)"
                if elsewhere
                else ""
            )
            + (
                f"; {kept} damaged page(s) kept that cannot be read (unrecoverable: the "
                "repaired lines say why)"
                if kept
                else ""
            )
        )
    else:
        does = (
            "removes orphans, mends the index's rows, restores damaged data the archive "
            "holds, and deletes the damaged pages it does not (pinned ones are kept)"
            + (
                "; and uploads again the damaged archive objects held here"
                if args.check_archive
                else ""
            )
        )
        if found.get("unreadable"):  # (a repair leaves them: the device may come back)
            does += (
                "; it leaves the unreadable data and its pages as they are (a device failing "
                "or not mounted: fsck again once it is back)"
            )
        verdict = f"problems found; --repair {does}"
        if offline:  # --repair refuses to open the store without its archive
            verdict = (
                "problems found; the archive could not be checked, and --repair needs it: "
                f"it refuses to run until the archive can be reached, then {does}"
            )
    if found.get("archive_error") and not (offline and problems):  # (said above)
        verdict += "; the archive could not be checked"  # the local check and repair stand
    _emit(args, found, [*lines, verdict])
    if problems and not (args.repair and not lost):
        return EXIT["corrupt"]
    return EXIT["archive"] if found.get("archive_error") else EXIT["ok"]
