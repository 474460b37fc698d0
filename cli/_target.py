"""Which store a command works on: the running daemon's, or the data directory itself.

Every store command takes the same flags (:func:`add_store_flags`). :func:`open_target`
asks the daemon that owns the data directory (over its control socket) when one answers;
otherwise it opens the data directory in-process, which takes the directory's lock, so a
second process (a daemon started meanwhile) cannot write under it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import kvfs
from kvfs._control import DaemonUnavailable
from kvfs._engine import devices_known, is_new_store, too_few_devices
from kvfs._keys import SESSIONS_DIR
from kvfs._local import DEVICE_MARKER
from kvfs._mountinfo import kvfs_mount_of, kvfs_mounts
from kvfs._remote import SyncRemoteStore
from kvfs._settings import Settings, load_settings, unknown_environment

#: How long a command waits for a daemon to answer its first ping: a stopped (SIGSTOP) or
#: stuck daemon made every command wait for ever. Then the daemon counts as not answering.
PING_SECONDS = 10.0

__all__ = [
    "add_store_flags",
    "daemon_services",
    "map_mount_paths",
    "open_target",
    "refuse_store_on_mount",
    "settings_from_args",
]


def add_store_flags(
    p: argparse.ArgumentParser, *, json_flag: bool = True, modes: bool = True
) -> None:
    g = p.add_argument_group("store selection (defaults: configuration file, then $KVFS_*)")
    g.add_argument("--config", metavar="FILE", help="TOML configuration file ($KVFS_CONFIG)")
    g.add_argument("--data", metavar="DIR[,DIR...]", help="data directories ($KVFS_DATA_DIRS)")
    g.add_argument(
        "--archive",
        metavar="URL",
        help="archive URL, file://DIR or s3://BUCKET/PREFIX; '' for none ($KVFS_ARCHIVE_URL)",
    )
    g.add_argument(
        "--socket",
        metavar="PATH",
        help="the daemon's control socket "
        "(default: derived from the data directory; $KVFS_CONTROL_SOCKET)",
    )
    if not modes:  # (a command that never talks to a daemon)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        return
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--daemon",
        dest="mode",
        action="store_const",
        const="daemon",
        help="only talk to a running daemon (exit 7 if none answers)",
    )
    mode.add_argument(
        "--offline",
        dest="mode",
        action="store_const",
        const="offline",
        help="open the data directory directly (fails while a daemon owns it)",
    )
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _answers(socket: Any) -> bool:
    remote = SyncRemoteStore(socket)
    try:
        remote.ping(timeout=PING_SECONDS)
        return True
    except DaemonUnavailable:
        return False
    finally:
        remote.close()


def map_mount_paths(args: argparse.Namespace) -> None:
    """Targets given as paths on a kvfs mount (``/mnt/kv/sessions/agent-1``, a relative
    path that leads onto it from outside, ``mnt/sessions/new/p0/layer-000``, whether or not
    it exists yet, or a name that exists in the working directory when that is on the
    mount) become the store paths
    they show, and the mount's store is the one used (``--data`` or ``--config`` that names
    another store is a usage error: see :func:`_refuse_another_store`).
    Other targets are left alone; an absolute path elsewhere is InvalidKey. A command's
    ``mount`` (the MOUNT of stats, hosts and fsck) is always a path: the mount point or
    any path on it picks the store; one off the mounts, relative or not, is InvalidKey."""
    if getattr(args, "mapped_mount_paths", False):
        return  # (a command that mapped them before it opened the store)
    args.mapped_mount_paths = True
    mounts = sorted(kvfs_mounts(), key=len, reverse=True)
    used: set[str] = set()
    cwd = os.path.abspath(os.curdir)

    def within(path: str, mp: str) -> bool:
        return path == mp or path.startswith(mp.rstrip("/") + "/")

    def mapped(target: str, *, mount: bool = False) -> str:
        """``mount``: ``target`` names a mount (a command's MOUNT), never a page or session,
        so any path off the mounts is refused, a relative one too."""
        path = os.path.abspath(target)
        # A relative path that leads onto a mount from outside it (mnt/sessions/new/p/l,
        # the page a put makes) is on it before it exists: as a name it went to a new
        # ./kvfs-data store, which the put made
        enters = any(within(path, mp) and not within(cwd, mp) for mp in mounts)
        if not (
            mount
            or os.path.isabs(target)
            or target.startswith(".")
            or enters
            or os.path.lexists(target)
        ):
            return target  # a session or page name
        for mp in mounts:
            if within(path, mp):
                rel = path[len(mp) :].strip("/") or "."
                used.add(mp)
                # a directory on the mount means that directory ("name/"), not a session name
                is_dir = os.path.isdir(path) and rel != "." and "/" not in rel
                return rel + "/" if is_dir and rel != SESSIONS_DIR else rel
        if mount or os.path.isabs(target):  # (no store path is absolute: "no such page" misled)
            on = f"the kvfs mounts are {', '.join(mounts)}" if mounts else "none is mounted"
            raise kvfs.InvalidKey(
                f"{target} is not on a kvfs mount ({on}): "
                + (
                    "name its mount point or a path on it, or leave it out to use the mount "
                    "the working directory is on (or --data)"
                    if mount
                    else "name a page or session by its path in the store "
                    "(sessions/agent-1, lmcache/f.data) or by a path on a mount"
                )
            )
        return target

    for name in ("target", "key"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, mapped(value))
    mount = getattr(args, "mount", None)
    if isinstance(mount, str):  # (stats, hosts, fsck: only the store it leads to is used)
        mapped(mount, mount=True)
    for name in ("targets", "sessions"):
        values = getattr(args, name, None)
        if isinstance(values, list):
            setattr(args, name, [mapped(v) for v in values])
    unset = (
        getattr(args, "data", None) is None
        and getattr(args, "config", None) is None
        and not os.environ.get("KVFS_DATA_DIRS")
        and not os.environ.get("KVFS_CONFIG")
    )
    if not used and unset:
        # Run from a directory on the mount with no store named: the mount's store, not a
        # default ./kvfs-data made inside the mount (it was, as a page and a directory)
        here = kvfs_mount_of(os.getcwd())
        used = {here} if here else used
    if len(used) > 1:  # (no store was named then: "no kvfs store in kvfs-data" misled)
        raise ValueError(
            f"the paths given are on {len(used)} kvfs mounts ({', '.join(sorted(used))}): "
            "a command works on one store; run it once for each mount"
        )
    named = _named_data_dirs(args) if used else None
    if named is not None:
        _refuse_another_store(args, named, used)
    elif len(used) == 1:
        state = mount_state(used.pop())
        if state is not None:
            args.data = ",".join(state["data_dirs"])
            args.index_dir = state.get("index_dir")
            if getattr(args, "socket", None) is None:
                args.socket = state.get("control_socket")


def _named_data_dirs(args: argparse.Namespace) -> list[str] | None:
    """The data directories that ``--data`` or the file ``--config`` names, or None when
    neither does (a configuration file may set only the archive, say: then the mount's data
    directories are the store). Raises ValueError (a file that does not parse)."""
    data, config = getattr(args, "data", None), getattr(args, "config", None)
    if data is None and config is None:
        return None
    settings = load_settings(config, flags={"data_dirs": data})
    if settings.sources["data_dirs"] not in ("flag", str(settings.config_file)):
        return None
    return [str(d) for d in settings["data_dirs"]]


def _refuse_another_store(args: argparse.Namespace, named: list[str], used: set[str]) -> None:
    """A path on a mount and ``--data``/``--config`` that name different stores are a
    usage error: the flags won without a word (``kvfs stats /mnt/a --data /other`` reported
    on /other). The same data directories, in any order, are the mount's store. A mount
    whose daemon left no state to compare with is not refused. Raises ValueError."""
    ours = {os.path.realpath(d) for d in named}
    for mp in sorted(used):
        state = mount_state(mp)
        if state is None or {os.path.realpath(d) for d in state["data_dirs"]} == ours:
            continue
        flag = "--data" if getattr(args, "data", None) is not None else f"--config {args.config}"
        raise ValueError(
            f"the kvfs mount {mp} serves the store in {','.join(state['data_dirs'])}, but "
            f"{flag} names {','.join(named)}: name the mount or the store, not both"
        )


def refuse_store_on_mount(config: kvfs.StoreConfig) -> None:
    """A store cannot live on a kvfs mount (its own, or another's): its lock and index
    would be pages. Raises ValueError naming the mount."""
    for d in config.data_dirs:
        mp = kvfs_mount_of(d)
        if mp is not None:
            raise ValueError(
                f"data directory {os.path.abspath(d)} is on the kvfs mount {mp}: a store "
                "cannot live there (give --data a directory elsewhere, or run the command "
                "with a path on the mount to use the mount's store)"
            )


def _check_serves(remote: SyncRemoteStore, sock: Path, config: kvfs.StoreConfig) -> None:
    """Refuse a daemon given by its socket that serves another store than the data
    directories the command names (the store is its lock file: the first data directory's,
    unless ``index_dir``): a ``$KVFS_CONTROL_SOCKET`` left over from another store made
    ``kvfs rm --data B`` delete from store A. A daemon too old to say is trusted. Raises
    ValueError (exit 2)."""
    try:
        theirs = remote.identity()
    except ValueError as e:  # "unknown control method": a daemon from before it was asked
        if "identity" not in str(e):
            raise
        return
    if theirs["lock"] != os.path.realpath(config.lock_path):
        raise ValueError(
            f"the kvfs daemon on {sock} serves {','.join(theirs['data_dirs'])}, not "
            f"{','.join(os.path.realpath(d) for d in config.data_dirs)}: check --socket / "
            "$KVFS_CONTROL_SOCKET, or leave it out"
        )


def _mounted_sockets(config: kvfs.StoreConfig) -> list[str]:
    """The control sockets that mounted daemons of this user recorded for ``config``'s
    data (their state files in the runtime directory)."""
    from kvfs._settings import runtime_dir

    first = os.path.abspath(config.data_dirs[0])
    found = []
    try:
        states = sorted(runtime_dir().glob("mount-*.json"))
    except PermissionError:  # a runtime directory not to trust: nothing in it is used
        return []
    for path in states:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and (state.get("data_dirs") or [None])[0] == first:
            found.append(str(state.get("control_socket") or ""))
    return [f for f in found if f]


def mount_state(mountpoint: str) -> dict[str, Any] | None:
    """What the daemon serving ``mountpoint`` recorded (its pid, data directories)."""
    from kvfs._daemon import state_path

    path = state_path(mountpoint)  # (PermissionError: a runtime directory not to trust)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("data_dirs") else None


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Defaults < file < environment < these flags. Raises ValueError, FileNotFoundError."""
    flags: dict[str, Any] = {
        "data_dirs": getattr(args, "data", None),
        "archive_url": getattr(args, "archive", None),
        "control_socket": getattr(args, "socket", None),
        "index_dir": getattr(args, "index_dir", None),  # (a mount's, see map_mount_paths)
    }
    warn_unknown_environment()
    return load_settings(getattr(args, "config", None), flags=flags)


def warn_unknown_environment() -> None:
    for warning in unknown_environment():
        print(f"kvfs: {warning}", file=sys.stderr)


@contextmanager
def open_target(
    args: argparse.Namespace,
    *,
    create: bool = False,
    from_archive: bool = False,
    inspect: bool = False,
    archive_down: str | None = None,
) -> Iterator[Any]:
    """A SyncStore-like object for the command: the daemon's store or the local one.

    ``from_archive``: the command reads the archive (a restore, ``ls --archived``), so on
    a fresh host, one that shares an archive another host spilled to, the store is made
    when an archive is configured (not the embedded default).

    ``inspect``: the command only reads the local tier (``fsck`` without ``--repair``,
    ``stats``, ``ls``), so a data directory whose archive cannot be opened is opened
    without it, saying so on stderr (``store.engine.archive_error``): the user learns what
    is local while the archive is down. Every other command still refuses to open then.
    ``archive_down`` (with ``inspect``): the archive was found down a moment ago, for this
    reason; the data directory is opened without trying it again (see :class:`Engine`).

    Raises DaemonUnavailable (``--daemon`` and none answers), StoreLocked (the directory is
    owned by a process that does not answer on the control socket), FileNotFoundError (no
    store there and ``create`` is false).
    """
    map_mount_paths(args)
    settings = settings_from_args(args)
    config = settings.store_config()
    mode = getattr(args, "mode", None)
    if mode != "offline":
        first = settings.socket_path()

        def sockets() -> Iterator[Path]:
            yield first
            if settings.sources["control_socket"] == "default":
                # a daemon mounted with its own --socket: its mount's state says where
                yield from (Path(p) for p in _mounted_sockets(config) if Path(p) != first)

        unavailable: DaemonUnavailable | None = None
        for sock in sockets():
            remote = SyncRemoteStore(sock)
            try:
                remote.ping(timeout=PING_SECONDS)
            except DaemonUnavailable as e:
                remote.close()
                unavailable = unavailable or e
                continue
            try:
                if "default" not in (
                    settings.sources["data_dirs"],
                    settings.sources["control_socket"],
                ):
                    _check_serves(remote, sock, config)
                yield remote
            finally:
                remote.close()
            return
        if mode == "daemon" and unavailable is not None:
            if type(unavailable) is DaemonUnavailable:  # (a busy one is there: not this)
                raise DaemonUnavailable(
                    f"{unavailable}: start one with kvfs mount, or drop --daemon to open "
                    "the data directory itself"
                ) from unavailable
            raise unavailable
    refuse_store_on_mount(config)
    new = is_new_store(config)  # (an empty index: what a failed create of old left)
    if from_archive and config.archive_url and settings.sources["archive_url"] != "default":
        create = True
    _check_devices(config, new=new, create=create)
    with ExitStack() as stack:
        try:
            if new:
                store = stack.enter_context(_made_or_undone(config))
            else:
                store = stack.enter_context(
                    kvfs.open_store_sync(
                        config,
                        archive_required=not inspect,
                        archive_down=archive_down if inspect else None,
                    )
                )
        except kvfs.StoreLocked as e:
            if mode == "offline" and _answers(settings.socket_path()):
                raise kvfs.StoreLocked(
                    f"{e}; its daemon serves it on {settings.socket_path()}: drop --offline"
                ) from None
            raise kvfs.StoreLocked(f"{e}; no daemon answers on {settings.socket_path()}") from None
        if new:  # (a forgotten --config writes into a store of its own: say so)
            dirs = ", ".join(str(d) for d in config.data_dirs)
            print(f"kvfs: made a new store in {dirs}", file=sys.stderr)
        why = getattr(store.engine, "archive_error", None)
        if why and getattr(args, "archive_error_said", None) != why:
            # (once: `stats --watch` opens the store for each refresh, and said it each time)
            args.archive_error_said = why
            print(
                f"kvfs: opened without the archive, which cannot be used now ({why}): only "
                "the local tier is inspected",
                file=sys.stderr,
            )
        yield store


@contextmanager
def _made_or_undone(config: kvfs.StoreConfig) -> Iterator[Any]:
    """Open a store that does not exist yet; when the open fails (its archive unreachable on
    a fresh host's ``kvfs restore``), remove what it made: the directories that were not
    there, the contents of those that were empty. Nothing else was in them."""
    dirs = list(dict.fromkeys([*config.data_dirs, config.index_path.parent]))
    before: dict[Path, bool | None] = {}  # was empty (None: made, with its missing parents)
    for d in (x.absolute() for x in dirs):
        if d.exists():
            before[d] = not any(d.iterdir())
            continue
        while not d.parent.exists():
            d = d.parent
        before[d] = None
    opened = kvfs.open_store_sync(config)
    try:
        store = opened.__enter__()
    except BaseException:
        for d, was_empty in before.items():
            if was_empty is None:
                shutil.rmtree(d, ignore_errors=True)
            elif was_empty:
                for x in d.iterdir():
                    if x.is_dir() and not x.is_symlink():
                        shutil.rmtree(x, ignore_errors=True)
                    else:
                        x.unlink(missing_ok=True)
        raise
    with ExitStack() as stack:
        stack.push(opened)  # its __exit__ closes the store
        yield store


def _check_devices(config: kvfs.StoreConfig, *, new: bool, create: bool) -> None:
    """A command opens the store its directories name, and never grows it: a typo in the
    device list (``--data d0,d0-typo``) made d0-typo a device of the store for good, and
    every later open without it failed. A store gets a new device when its daemon starts
    with one (``kvfs mount``) or through the object API. Raises FileNotFoundError (no store
    there) and ValueError (a directory that is not one of the store's devices, or fewer
    directories than it has)."""
    if new:
        marked = [d for d in config.data_dirs[1:] if (d / DEVICE_MARKER).exists()]
        if marked:  # the first directory holds the index
            raise FileNotFoundError(
                f"no kvfs store in {config.data_dirs[0]}, but {marked[0]} is a data directory "
                "of one: give them in their original order (the first holds the index)"
            )
        if not create:
            # (absolute: a relative default, kvfs-data, named no directory to a user who ran
            # the command elsewhere than the mount's own, and the mounts running say where)
            mounts = sorted(kvfs_mounts())
            on = (
                f"; the kvfs mounts are {', '.join(mounts)}: run it from one of them, or "
                "give a path on one"
                if mounts
                else ""
            )
            raise FileNotFoundError(
                f"no kvfs store in {config.data_dirs[0].absolute()} "
                f"(set --data, $KVFS_DATA_DIRS or the configuration file{on})"
            )
        return
    known = devices_known(config)
    # (the store's open refused it too, but with exit 1: a usage error is 2)
    if (why := too_few_devices(config, known)) is not None:
        raise ValueError(why)
    extra = [str(d) for d in config.data_dirs[known:]] if known else []
    if extra:
        raise ValueError(
            f"{', '.join(extra)}: not a data directory of the store in {config.data_dirs[0]}, "
            f"which has {known}; a command does not add devices to a store (its daemon does, "
            "started with them: kvfs mount)"
        )


def daemon_services(config: kvfs.StoreConfig, *, setup_logs: bool = True) -> list[Any]:
    """The daemon's services for ``config``: the control channel always, Prometheus metrics
    when ``metrics_port`` is set. With ``setup_logs`` the ``kvfs`` loggers go to the
    configured target at the configured level (the daemon process itself)."""
    from functools import partial

    from kvfs._control import control_service
    from kvfs._metrics import metrics_service, setup_logging

    d: dict[str, Any] = dict(config.extra.get("daemon") or {})  # type: ignore[call-overload]
    if setup_logs:
        import logging

        level = str(d.get("log_level", "info"))
        if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:  # kvfs --debug mount
            level = "debug"
        setup_logging(level, str(d.get("log_target", "stderr")))
    services: list[Any] = [control_service]
    if d.get("metrics_port"):
        services.append(
            partial(
                metrics_service,
                port=int(d["metrics_port"]),
                address=str(d.get("metrics_address", "127.0.0.1")),
                max_sessions=int(d.get("metrics_sessions", 20)),
            )
        )
    return services
