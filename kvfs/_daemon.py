"""The kvfs daemon: one store, its FUSE mount and the services that share the store.

``run_daemon`` is the async core (tests and embedding); ``main`` is what ``kvfs mount`` calls:
in the foreground it runs until SIGTERM/SIGINT/SIGHUP or an outside unmount (further
signals while it stops are absorbed); otherwise it starts itself again in the foreground,
detached, and returns once the mount answers (or with the daemon's error). A detached
daemon that finds its starter gone when it is ready unmounts and fails. The daemon records
its pid per mountpoint so ``kvfs umount`` can stop it and wait. A SIGKILLed daemon leaves no
dead mount (``auto_unmount``) and no half-written page (the engine sweeps unreferenced files
at the next start).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ._config import StoreConfig
from ._engine import too_few_devices
from ._errors import leaf_errors
from ._fuse_nodes import process_of
from ._mount import BadMountArgument, MountError, MountOptions, check_mountpoint, serve_mount
from ._mountinfo import kvfs_mount_of, kvfs_mounts, realpath
from ._settings import config_socket_path, runtime_dir
from ._store import Store, open_store

__all__ = [
    "LOG_FD_ENV",
    "READY_FD_ENV",
    "STOP_SIGNALS",
    "Service",
    "Stopped",
    "main",
    "run_daemon",
    "state_path",
    "stop_daemon",
]

log = logging.getLogger("kvfs.daemon")

#: ``async def service(store, *, task_status)``: started before the mount, cancelled at exit.
Service = Callable[..., Awaitable[None]]
#: The detached child tells its parent on this fd: ``ok`` or the error.
READY_FD_ENV = "KVFS_READY_FD"
#: The detached child's log, open on this fd: its output moves there once it holds the store.
LOG_FD_ENV = "KVFS_LOG_FD"
#: Each stops the daemon cleanly (unmount, close the store). Once it is stopping, more of them
#: are absorbed: they killed it while it closed the store. SIGKILL is the hard stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(MountError):
    """A stop signal arrived before the mount was ready: nothing was mounted."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} before the mount was ready: not mounted")
        self.signum = signum


def state_path(mountpoint: str | os.PathLike[str]) -> Path:
    """Where the daemon serving ``mountpoint`` records its pid."""
    # (the resolved path: a mount through a symlink, an umount by the real path, or the
    # other way round, name one mount; unresolved, umount missed its daemon)
    digest = hashlib.sha1(realpath(mountpoint).encode()).hexdigest()[:16]
    return runtime_dir() / f"mount-{digest}.json"


async def run_daemon(
    config: StoreConfig,
    mountpoint: str | os.PathLike[str],
    options: MountOptions | None = None,
    services: Sequence[Service] = (),
    *,
    keep_absorbing: bool = False,
    task_status: trio.TaskStatus[Store] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the store, start each service, mount; run until a STOP_SIGNALS signal
    (SIGTERM, SIGINT, SIGHUP), cancellation or an outside unmount; then unmount and close
    the store. Reports the store once mounted.

    The signals are the daemon's from the call to its return: one that arrives before the
    mount is ready stops it (once the store is open) with nothing mounted (Stopped); once
    it is stopping, for whatever reason, more of them are absorbed (the first logged), so
    the unmount and the close always complete. SIGKILL does not wait: the mount goes
    (``auto_unmount``) and the next open recounts, as after a crash. On return the signals
    get their previous handlers back; with ``keep_absorbing`` (a process that exits next,
    as ``kvfs mount`` does) they stay ignored.

    Raises StoreLocked (another process owns the data), MountError, Stopped. Writes still
    open at exit are discarded; committed pages are durable.
    """
    stopping, mounted = _Stopping(), False
    with stopping.handling_signals(keep_absorbing):
        async with open_store(config) as store, trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when, stopping.event, nursery.cancel_scope)
            for service in services:
                await nursery.start(service, store)
            await nursery.start(_mount_then_stop, store, mountpoint, options, stopping.event)
            task_status.started(store)
            mounted = True
    if stopping.signum is not None and not mounted:
        raise Stopped(stopping.signum)


class _Stopping:
    """Whether and why the daemon stops: ``event`` is set by the first STOP_SIGNALS signal
    (kept in ``signum``) or by the end of the mount, and the signals that come after it are
    absorbed, the first of them logged."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.signum: int | None = None
        self._told = False

    @contextlib.contextmanager
    def handling_signals(self, keep_absorbing: bool = False) -> Iterator[None]:
        """Take STOP_SIGNALS in here (the main thread, in trio): each is handled in the loop as
        it comes. (trio.open_signal_receiver queues them for a task, and delivers those left
        again when it closes, to the default handler: one that came while the daemon closed
        the store would kill it as it finished.) On the way out the previous handlers come
        back, or with ``keep_absorbing`` the signals are ignored (one between here and the
        caller's own exit killed a daemon that had closed its store, its state file left)."""
        token = trio.lowlevel.current_trio_token()

        def handler(signum: int, frame: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._on_signal, signum)

        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, signal.SIG_IGN if keep_absorbing else h)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.event.is_set():
            log.info("%s: unmounting", name)
            self.signum = signum
            self.event.set()
        elif not self._told:
            self._told = True
            log.info(
                "%s: already stopping; the store is closing (this and further signals are "
                "ignored; SIGKILL stops the daemon at once, as a crash would)",
                name,
            )


async def _mount_then_stop(
    store: Store,
    mountpoint: str | os.PathLike[str],
    options: MountOptions | None,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[Path],
) -> None:
    try:
        await serve_mount(store, mountpoint, options, task_status=task_status)
    finally:
        stop.set()  # (unmounted from outside: stop the rest too)


async def _cancel_when(stop: trio.Event, scope: trio.CancelScope) -> None:
    await stop.wait()
    scope.cancel()


def main(
    config: StoreConfig,
    mountpoint: str | os.PathLike[str],
    options: MountOptions,
    *,
    foreground: bool,
    child_argv: Sequence[str] | None = None,
    services: Sequence[Service] = (),
    log_file: str | os.PathLike[str] | None = None,
    exit_code: Callable[[BaseException], int] = lambda e: 1,
) -> int:
    """Run the daemon; returns an exit status (0: mounted and, in the foreground, stopped;
    ``exit_code(error)`` when it failed, which a detached daemon's parent returns too).

    Detached (``foreground=False``): runs ``child_argv`` (the same command with
    ``--foreground``) in a new session and waits for its readiness message; its output goes
    to ``log_file`` once it holds the store (before, to this command: see _detach). Errors
    are printed to stderr, one line.

    In the foreground, started so (``READY_FD_ENV``): a daemon that cannot tell its starter
    it is ready (the starter is gone: interrupted, killed) unmounts and fails (StarterGone).
    This is the process's main: once the daemon has stopped, STOP_SIGNALS are ignored.
    """
    # What can be told before anything is created (the store, the detached daemon's log),
    # and touching no FUSE mount (a stopped daemon's hangs a stat, see _mountinfo).
    mountpoint = realpath(mountpoint)  # (a symlink: libfuse failed on it, ENOTCONN)
    made: list[Path] = []  # (what a mount that fails takes away again, if still empty)
    try:
        check_mountpoint(Path(mountpoint))
        for d in config.data_dirs:
            on = kvfs_mount_of(d)
            if on is not None:  # (its lock and index would be another store's pages)
                raise BadMountArgument(f"data directory {d} is on the kvfs mount {on}")
            if d.exists() and not d.is_dir():
                raise BadMountArgument(f"data directory {d} is not a directory")
            if d.is_dir() and not os.access(d, os.W_OK):  # (a read-only file system too)
                raise BadMountArgument(f"data directory {d} is not writable")
        for what, at in _kept_paths(config):
            # (mounted over, it is the mount's: the daemon's own use of it waits on the
            # daemon, which hung for good, in D state, at the first write through the mount)
            if os.path.commonpath([realpath(at), mountpoint]) == mountpoint:
                raise BadMountArgument(
                    f"{what} {at} is under the mountpoint {mountpoint}: the mount would hide it "
                    "from the daemon, which would then wait on itself; keep it outside"
                )
        # (the store's open refused it too, but with exit 1: a usage error is 2)
        if (why := too_few_devices(config)) is not None:
            raise BadMountArgument(why)
        if log_file is not None and not Path(log_file).absolute().parent.is_dir():
            raise BadMountArgument(f"--log {log_file}: {Path(log_file).parent} is not a directory")
        if log_file is not None and not foreground:
            if not os.path.lexists(log_file):
                made.append(Path(log_file))
            try:
                open(log_file, "ab").close()  # noqa: SIM115 - (made now, as the daemon would)
            except OSError as e:
                raise BadMountArgument(f"--log {log_file}: {e.strerror}") from None
    except MountError as e:
        print(f"kvfs mount: {e}", file=sys.stderr)
        return exit_code(e)
    if not foreground:
        if child_argv is None:
            raise ValueError("detaching needs the foreground command line (child_argv)")
        if log_file is None:
            log_file = _default_log(config)
            made += [x for x in (log_file.parent, log_file) if not os.path.lexists(x)]
            log_file.parent.mkdir(parents=True, exist_ok=True)  # (a store made by this mount)
        rc = _detach(child_argv, log_file)
        if rc != 0:
            # A daemon that failed before it held the store (an archive it could not open)
            # left a new data directory holding only an empty log.
            _remove_if_empty(made)
        return rc
    # fusermount3 (auto_unmount) outlives the mount call: it must not hold the pipe open.
    ready_fd, log_fd = _inherited_fd(READY_FD_ENV), _inherited_fd(LOG_FD_ENV)
    if log_fd is not None:
        services = [partial(_output_to_log, log_fd), *services]
    path = state_path(mountpoint)
    raise_open_files_limit()

    async def serve() -> None:
        nonlocal ready_fd
        async with trio.open_nursery() as n:
            await n.start(
                partial(run_daemon, keep_absorbing=True), config, mountpoint, options, services
            )
            _write_state(path, mountpoint, config)
            if ready_fd is not None:
                told, ready_fd = _tell(ready_fd, b"ok\n"), None
                if not told:  # (its pipe closed: nobody will know this mount is there)
                    raise StarterGone(
                        "the command that started this daemon is gone (interrupted or killed "
                        "before the mount was ready, it could not report it): unmounted"
                    )
            sd_notify(b"READY=1")  # (systemd's Type=notify: units after it find the mount)

    try:
        trio.run(serve)
    except BaseException as e:  # noqa: BLE001 - the parent gets one clear line either way
        msg = "; ".join(_describe(x) for x in leaf_errors(e))
        if ready_fd is not None:
            _tell(ready_fd, f"error: {msg}\n".encode())
        leaves = leaf_errors(e)
        if all(isinstance(x, KeyboardInterrupt) for x in leaves):
            return 130
        print(f"kvfs mount: {msg}", file=sys.stderr)
        log.debug("daemon failed", exc_info=True)
        stopped = [x.signum for x in leaves if isinstance(x, Stopped)]
        if stopped:
            return 128 + stopped[0]  # (the status the signal gives a process it ends)
        # (an exit status of 0 or 130 would tell the parent it mounted or was interrupted)
        return next((c for c in map(exit_code, leaves) if c not in (0, 130)), 1)
    finally:
        # The daemon has stopped and this process exits next: a stop signal from here (Ctrl-C
        # pressed once more) has nothing left to stop, and would only turn the exit into a kill
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
    return 0


def _kept_paths(config: StoreConfig) -> Iterator[tuple[str, Path]]:
    """What the daemon keeps on disk while it serves, each with the words for it: the data
    directories, the index directory, a control socket given its own path and a ``file://``
    archive. (The default socket and log are beside the index.)"""
    from objectstore._open import parse_url

    for d in config.data_dirs:
        yield "data directory", Path(d)
    if config.index_dir:
        yield "index directory", Path(config.index_dir)
    daemon = config.extra.get("daemon")
    if isinstance(daemon, dict) and daemon.get("control_socket"):
        yield "control socket", config_socket_path(config)
    if config.archive_url:
        try:
            scheme, location, _ = parse_url(config.archive_url)
        except ValueError:  # (the store's open says what is wrong with it)
            return
        if scheme == "file":
            yield "archive directory", Path(location)


class StarterGone(MountError):
    """The command that started the daemon (``kvfs mount``) was gone when the daemon could
    tell it the mount was ready: nobody knows of the mount, so the daemon unmounts."""


def _describe(e: BaseException) -> str:
    from ._errors import KvfsError

    return str(e) if isinstance(e, (MountError, OSError, KvfsError)) else f"{type(e).__name__}: {e}"


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit,
    and log it; returns (the soft limit before, after), or None when it was left as it was
    (already there, or the kernel refused).

    The daemon holds a data file open per device for every file being written through
    the mount (and SQLite's per worker thread). Under the soft limit most services and
    shells start with (1024; systemd's default hard limit is 524288, its documentation
    asks programs that need more to raise the soft limit themselves), an engine with a
    few hundred files open for writing ran the daemon out of descriptors: writes failed
    with EMFILE and nothing could be committed until some closed. Only the daemon does
    this; an engine that opens the store in its own process keeps its own limits."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # (setrlimit refuses more than fs.nr_open)
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return None
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as e:
        log.warning("could not raise the open files limit from %d to %d: %s", soft, target, e)
        return None
    log.info("open files limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
    return soft, target


def sd_notify(msg: bytes) -> bool:
    """Tell systemd (a ``Type=notify`` service: ``$NOTIFY_SOCKET``) ``msg``; False when
    not run so or the message could not be sent."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr.startswith(("/", "@")):
        return False
    target = "\0" + addr[1:] if addr.startswith("@") else addr  # (@: an abstract socket)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(target)
            s.sendall(msg)
        return True
    except OSError as e:
        log.warning("could not notify systemd (%s): %s", addr, e)
        return False


def _inherited_fd(env: str) -> int | None:
    """The descriptor the starter passed in ``$env`` (taken out of the environment), made
    close-on-exec; None when there is none."""
    value = os.environ.pop(env, None)
    if not value:
        return None
    fd = int(value)
    os.set_inheritable(fd, False)
    return fd


def _tell(fd: int, msg: bytes) -> bool:
    """Write ``msg`` to the starter's pipe and close it; False when the starter could not be
    told (it is gone: EPIPE)."""
    try:
        os.write(fd, msg)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _output_to_log(log_fd: int, store: Store, *, task_status: trio.TaskStatus[None]) -> None:
    """A service, started first: once the store is held (its lock taken), move stdout and
    stderr, until then a file of the starter's, to the log open on ``log_fd``, with what
    they held; the file is emptied, so the starter has nothing left to show of it."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):  # (not a file: nothing to carry over)
        early = bytearray()
        while chunk := os.pread(2, 1 << 16, len(early)):
            early += chunk
        with open(log_fd, "ab", closefd=False) as logf:
            logf.write(early)
        os.ftruncate(2, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    task_status.started()


def _write_state(path: Path, mountpoint: str | os.PathLike[str], config: StoreConfig) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_stale_states(path.parent)
    me = process_of(os.getpid())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                # with the pid, the process: a pid alone may be another's by the time
                # `kvfs umount` reads it (a daemon killed by SIGKILL leaves its file)
                "start": me[1] if me is not None else None,
                "mountpoint": os.path.abspath(mountpoint),
                # absolute, and where the index and the control socket are: a command
                # given a path on the mount reaches this store from any directory
                "data_dirs": [os.path.abspath(d) for d in config.data_dirs],
                "index_dir": os.path.abspath(config.index_dir) if config.index_dir else None,
                "control_socket": str(config_socket_path(config).absolute()),
            }
        )
    )
    os.replace(tmp, path)


def _remove_if_empty(made: Sequence[Path]) -> None:
    """Remove what ``made`` lists (a log file, its directory), deepest first, each only while
    it is empty: what a daemon wrote into them stays."""
    for x in reversed(made):
        with contextlib.suppress(OSError):
            if x.is_dir():
                x.rmdir()  # (refused when not empty)
            elif x.stat().st_size == 0:
                x.unlink()


def _default_log(config: StoreConfig) -> Path:
    return Path(config.index_dir or config.data_dirs[0]) / "kvfs-daemon.log"


def _detach(argv: Sequence[str], log_file: str | os.PathLike[str]) -> int:
    # The daemon's output goes to `early`, this command's, until it holds the store, and
    # then, with what it said so far, to the log (_output_to_log): a daemon that failed to
    # take the store (another daemon serves it) wrote its error into that log, the other's.
    with (
        open(log_file, "ab") as logf,
        tempfile.TemporaryFile() as early,
        open(os.devnull, "rb") as null,
    ):
        r, w = os.pipe()
        try:
            child = subprocess.Popen(
                list(argv),
                stdin=null,
                stdout=early,
                stderr=early,
                pass_fds=(w, logf.fileno()),
                start_new_session=True,
                env={**os.environ, READY_FD_ENV: str(w), LOG_FD_ENV: str(logf.fileno())},
            )
        except BaseException:
            # Interrupted inside Popen, the child may be running all the same, unknown
            # here: with this end closed, it finds nobody to tell it is ready, and stops.
            os.close(r)
            raise
        finally:
            os.close(w)
        try:
            with _sigterm_raised(), os.fdopen(r, "rb") as f:
                msg = f.read().decode(errors="replace").strip()
        except BaseException as e:
            # Interrupted (Ctrl-C, `timeout`'s SIGTERM): the daemon, in a session of its
            # own, went on and mounted after this command had said it failed. It is stopped
            # as a SIGINT stops it (unmounting, if it got that far) and waited for; a second
            # interrupt leaves it.
            child.send_signal(signal.SIGINT)
            child.wait()
            if isinstance(e, _Terminated):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)  # (the exit it would have had)
            raise
        if msg == "ok":
            # The daemon outlives this call on purpose; keep its handle so it is not
            # reported as a leaked child while this process lives (a CLI process exits at
            # once anyway).
            _DETACHED.append(child)
            return 0
        rc = child.wait()
        early.seek(0)
        said = early.read().decode(errors="replace").strip()
    if said:  # (its own words, its error among them, before it held the store: in no log)
        print(said, file=sys.stderr)
        if not msg:
            print(f"kvfs mount: the daemon exited ({rc})", file=sys.stderr)
    else:
        said = msg.removeprefix("error: ") or f"the daemon exited ({rc})"
        # (an empty log, which main then removes if it made it, says nothing more)
        with contextlib.suppress(OSError):
            if os.path.getsize(log_file):
                said += f" (log: {log_file})"
        print(f"kvfs mount: {said}", file=sys.stderr)
    return rc if 0 < rc < 128 else 1  # (killed by a signal: no status of its own)


_DETACHED: list[subprocess.Popen[bytes]] = []


class _Terminated(BaseException):
    """SIGTERM arrived while the command waited for its daemon."""


@contextlib.contextmanager
def _sigterm_raised() -> Iterator[None]:
    """SIGTERM raises _Terminated in here (in the main thread; elsewhere it is left as it is)."""

    def raise_terminated(signum: int, frame: object) -> None:
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # (not the main thread)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, T: stopped, Z: a zombie...), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z")


def _daemon_pid(state: dict[str, Any]) -> int | None:
    """The pid a state file names, if that process is still the daemon that wrote it (the
    same start time) and alive; None for a leftover of a daemon gone."""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        pid = int(state["pid"])
        if process_of(pid) == (pid, int(state["start"])) and _alive(pid):
            return pid
    return None


def _drop_stale_states(directory: Path) -> None:
    """Remove the state files of daemons gone (a SIGKILL leaves its file behind)."""
    for f in directory.glob("mount-*.json"):
        with contextlib.suppress(OSError, ValueError):
            if _daemon_pid(json.loads(f.read_text())) is None:
                f.unlink()


def _mounted(mountpoint: str) -> bool:
    """A kvfs file system is mounted there (another kind is never kvfs's to unmount)."""
    return mountpoint in kvfs_mounts()


class MountBusy(OSError):
    """The mount is in use (open files, a working directory in it): not unmounted."""


class DaemonStopped(TimeoutError):
    """The mount is gone, but its daemon is stopped (SIGSTOP, Ctrl-Z): it cannot exit (and
    let go of the store) until it is continued."""


def stop_daemon(
    mountpoint: str | os.PathLike[str], *, timeout: float = 60.0, force: bool = False
) -> dict[str, Any]:
    """Stop the daemon serving ``mountpoint`` and wait until it has exited and the mount is
    gone. Like umount(8), a mount in use is left alone (MountBusy) unless ``force``: the
    unmount comes first, and only a mount nobody uses can be unmounted, so no reader is cut
    off halfway (it would get ENOTCONN), and the daemon then stops by itself; SIGTERM otherwise
    (--force). Without a live daemon, unmount a
    leftover kvfs mount. Nothing looks at the mount itself (a stopped daemon's would hang
    it): a stopped daemon's (SIGSTOP, Ctrl-Z) is unmounted as any, lazily with ``force``,
    and it is not waited for (DaemonStopped). Raises FileNotFoundError when nothing is
    mounted there, MountBusy, DaemonStopped, TimeoutError."""
    mp = realpath(mountpoint)
    path = state_path(mp)
    pid = None
    with contextlib.suppress(OSError, ValueError):
        pid = _daemon_pid(json.loads(path.read_text()))
    if pid is not None:
        unmounted = False
        if not force and _mounted(mp):
            r = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
            if r.returncode != 0 and _mounted(mp) and "busy" in r.stderr.lower():
                raise MountBusy(
                    errno.EBUSY,
                    f"{mp} is in use (a process has a file open or its working directory in "
                    "it): close those, or unmount anyway with --force (they then get ENOTCONN)",
                )
            unmounted = r.returncode == 0
        # A daemon whose mount is gone stops by itself (a SIGTERM while it closes the store
        # is absorbed now; it killed it once, exit -15): only one still mounted needs it
        if not unmounted:
            with contextlib.suppress(ProcessLookupError):  # (it may be gone already)
                os.kill(pid, signal.SIGTERM)
            if _state(pid) == "T" and _mounted(mp):  # (the SIGTERM waits until it runs again)
                subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True)
    elif _mounted(mp):
        subprocess.run(["fusermount3", "-u", "-z", mp], check=True)
        pid = None
    else:
        raise FileNotFoundError(f"no kvfs mount at {mp}")
    deadline = time.monotonic() + timeout
    while (pid is not None and _alive(pid)) or _mounted(mp):
        if pid is not None and _state(pid) == "T" and not _mounted(mp):
            raise DaemonStopped(
                f"{mp} is unmounted, but its daemon (pid {pid}) is stopped (SIGSTOP, Ctrl-Z): "
                f"it closes the store and exits once continued (kill -CONT {pid})"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon (pid {pid}) did not stop within {timeout:.0f}s")
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        path.unlink()
    for child in list(_DETACHED):  # reap daemons this process started, now gone
        if child.poll() is not None:
            _DETACHED.remove(child)
    return {"mountpoint": mp, "pid": pid}
