"""Mount a store with FUSE and serve it until cancelled or unmounted.

pyfuse3 keeps its session in module globals: one mount per process.
"""

from __future__ import annotations

import errno
import logging
import os
import urllib.parse
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyfuse3
import trio

from . import _fusermount, _mountinfo
from ._fuse import KvfsOperations
from ._store import Store

__all__ = ["BadMountArgument", "MountError", "MountOptions", "serve_mount"]

log = logging.getLogger("kvfs.mount")


class MountError(RuntimeError):
    """The file system could not be mounted; the message says why and what to do."""


class BadMountArgument(MountError, ValueError):
    """A mountpoint, data directory or log path that cannot be used (a usage error: exit 2)."""


@dataclass(frozen=True)
class MountOptions:
    """How the mount behaves. Every field has a default suitable for one user on one host."""

    #: Let other users use the mount (FUSE ``allow_other``; non-root needs ``user_allow_other``
    #: in /etc/fuse.conf). File modes are always enforced by the kernel (``default_permissions``).
    allow_other: bool = False
    #: Bypass the page cache (no mmap then: safetensors' safe_open and numpy.memmap need it).
    direct_io: bool = False
    #: Kernel read-ahead for the mount; 1024 makes cold reads arrive as 1 MiB requests.
    read_ahead_kb: int = 1024
    #: Let fusermount3 unmount if the daemon dies (even by SIGKILL).
    auto_unmount: bool = True
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    #: Worker threads for disk, hashing and index work.
    threads: int = 16
    fsname: str = "kvfs"

    def fuse_options(self) -> set[str]:
        opts = {"default_permissions", f"fsname={self.fsname}", "subtype=kvfs", "noatime"}
        if self.allow_other:
            opts.add("allow_other")
        if self.auto_unmount:
            opts.add("auto_unmount")
        return opts


def check_mountpoint(mountpoint: Path) -> None:
    """Raise BadMountArgument unless ``mountpoint`` (absolute, best resolved) is a directory
    that can be mounted on; MountError without /dev/fuse. A FUSE file system mounted there
    already is told from the mount table, before the path is touched: a stat would wait
    for its daemon, for ever if that is stopped (SIGSTOP, Ctrl-Z) or stuck."""
    try:
        kind = _mountinfo.mounted_at(str(mountpoint))
    except OSError:  # (no table to read: the stat below tells, as it can)
        kind = None
    if kind is not None and kind.startswith("fuse"):
        how = "kvfs umount" if kind == _mountinfo.KVFS_FS else "fusermount3 -u"
        raise BadMountArgument(
            f"{mountpoint} is already a mount point ({kind}): unmount it first ({how} {mountpoint})"
        )
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise BadMountArgument(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise BadMountArgument(
                f"{mountpoint} is a dead FUSE mount (its daemon died); "
                f"run: fusermount3 -u {mountpoint}"
            ) from None
        raise BadMountArgument(f"mountpoint {mountpoint}: {e.strerror}") from None
    if not os.path.isdir(mountpoint):
        raise BadMountArgument(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint) and st.st_dev != os.stat(mountpoint.parent).st_dev:
        raise BadMountArgument(f"{mountpoint} is already a mount point")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing: load the fuse module (modprobe fuse)")


def _option_safe(text: str) -> str:
    """``text`` as a FUSE mount option value: libfuse takes ASCII only and splits at commas,
    so those (and any other byte outside printable ASCII) are written %XX."""
    return urllib.parse.quote(text, safe="/:@._-+~ ")


def set_read_ahead(dev: int, kb: int) -> bool:
    """Raise the mount's read-ahead (its backing-device info is ``0:<minor>``)."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        return True
    except OSError as e:
        log.warning(
            "could not set %s to %d (%s): cold reads will arrive in 128 KiB requests",
            path,
            kb,
            e.strerror,
        )
        return False


async def serve_mount(
    store: Store,
    mountpoint: str | os.PathLike[str],
    options: MountOptions | None = None,
    *,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount ``store`` at ``mountpoint``, report the mountpoint as started once the file system
    answers, and serve until cancelled or unmounted from outside (``fusermount3 -u``).

    On the way out, always: unmount, discard writes still open (never committed), end every
    lease. Raises MountError when mounting fails (nothing is left mounted then).
    """
    opts = options or MountOptions()
    mp = Path(mountpoint).absolute()
    check_mountpoint(mp)
    if opts.fsname == "kvfs":  # show which store is mounted (mount, df, /proc/mounts)
        # (absolute: a relative one, as the embedded defaults give, says nothing elsewhere)
        first = Path(store.config.data_dirs[0]).absolute()
        opts = replace(opts, fsname="kvfs:" + _option_safe(str(first)))
    ops = KvfsOperations(
        store,
        direct_io=opts.direct_io,
        threads=opts.threads,
        entry_timeout=opts.entry_timeout,
        attr_timeout=opts.attr_timeout,
    )
    before = _fusermount.snapshot() if opts.auto_unmount else None
    try:
        pyfuse3.init(ops, str(mp), opts.fuse_options())
    except RuntimeError as e:
        with trio.CancelScope(shield=True):
            # (libfuse leaves its fusermount3 children and sockets even when it failed)
            await _fusermount.release_failed(before)
        await ops.aclose()
        raise MountError(f"mounting {mp} failed ({e}); the kernel log (dmesg) may say more") from e
    # (this thread's new child, and a new socket of a kind only C code makes: pyfuse3.init's)
    watchdog = _fusermount.find_watchdog(before)
    mounted = True
    try:
        async with trio.open_nursery() as nursery:
            ops.nursery = nursery
            nursery.start_soon(_run_main, nursery.cancel_scope)
            # The first stat is answered by the loop just started: the mount is live. Left
            # behind when cancelled: the loop, cancelled too, may never answer it, and the
            # stat ends (ENOTCONN) only once the session is closed below (waited for, it hung
            # a daemon stopped then for ever, mounted).
            st = await trio.to_thread.run_sync(os.stat, mp, abandon_on_cancel=True)
            if opts.read_ahead_kb > 0 and not opts.direct_io:
                set_read_ahead(st.st_dev, opts.read_ahead_kb)
            log.info("mounted %s", mp)
            # what kvfs stats shows of it (the daemon's own flags: kvfs config cannot know them)
            store.engine.mounted = {"mountpoint": str(mp), "pid": os.getpid(), **asdict(opts)}
            task_status.started(mp)
    finally:
        with trio.CancelScope(shield=True):
            if mounted:
                try:
                    pyfuse3.close(unmount=True)
                except Exception:
                    log.error("unmounting %s failed", mp, exc_info=True)
            if watchdog is not None:
                # Not serving any more: the watchdog checks now, not at this process's exit
                # (unmounted, it just exits; still mounted, it unmounts the dead mount).
                await watchdog.release()
            await ops.aclose()
            store.engine.mounted = None
            log.info("unmounted %s", mp)


async def _run_main(scope: trio.CancelScope) -> None:
    try:
        await pyfuse3.main()
    finally:
        scope.cancel()  # unmounted from outside: stop the rest too
