"""The ``fusermount3`` watchdog that ``auto_unmount`` leaves beside a mount, ended with it.

With ``auto_unmount``, libfuse mounts through a ``fusermount3`` child that stays alive,
reading one end of a socket pair; the mounting process keeps the other end. When every copy
of that end is closed (normally: the process exits or dies), the watchdog checks the mount
and unmounts it if it is still there and answers ENOTCONN (its daemon is gone). That is what
cleans up after a SIGKILL. But libfuse keeps neither the child's pid nor its own end of the
socket, an inheritable descriptor, and closes neither at unmount: each mount and unmount in a
long-lived process left one ``fusermount3`` running and one descriptor open until the
process exited, and every child started meanwhile without closing descriptors (the next
mount's ``fusermount3``, ``os.system``) held a copy that kept that watchdog waiting.

:func:`find_watchdog` picks out both right after ``pyfuse3.init`` (in the thread that called
it) and makes the socket close-on-exec; :meth:`Watchdog.release` closes it once the session
is closed, so the watchdog makes its check then (nothing mounted: it just exits), and reaps
it. (A child forked without exec still holds a copy of the socket, as it does of the
/dev/fuse descriptor: the watchdog acts once both this process and that child are gone.)

When the process dies, the watchdog unmounts only if opening the mountpoint fails with
ENOTCONN, which it does once the /dev/fuse descriptor is released (the connection is aborted
then). An exiting process closes its descriptors in ascending order, and Linux releases them
in reverse (the last one queued first); libfuse's socket was numbered above /dev/fuse, so it
was released first. The watchdog woke and opened the mountpoint while the connection was still
up: its request was then aborted with ECONNABORTED, not ENOTCONN, and the dead mount stayed
(now and then, on a loaded machine: the dying process had to be descheduled between the two
releases). :func:`snapshot` therefore holds a descriptor open below every one
``pyfuse3.init`` opens, and :func:`find_watchdog` moves the socket there: the connection is
gone before the watchdog is woken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass

import trio

__all__ = ["Snapshot", "Watchdog", "find_watchdog", "release_failed", "snapshot"]

log = logging.getLogger("kvfs.mount")

#: How long :meth:`Watchdog.release` waits for the watchdog to exit before leaving its
#: reaping to a thread (it normally exits in milliseconds: it only looks at the mount).
REAP_WAIT = 10.0


@dataclass
class Snapshot:
    """This process's descriptors (fd -> what /proc shows it is) and this thread's children."""

    fds: dict[int, str]
    children: frozenset[int]
    #: a descriptor (on /dev/null) opened last, numbered below every descriptor opened
    #: after it, where the watchdog's socket moves; -1 if none could be opened
    low: int = -1

    def close(self) -> None:
        """Close ``low`` (a no-op once it holds the watchdog's socket: it is -1 then)."""
        if self.low >= 0:
            with contextlib.suppress(OSError):
                os.close(self.low)
            self.low = -1


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, gone by now)
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def _children() -> frozenset[int]:
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/children") as f:
            return frozenset(int(p) for p in f.read().split())
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: the whole process's children
        me, found = os.getpid(), set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{name}/stat") as f,
                ):
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(name))
        return frozenset(found)


def snapshot() -> Snapshot | None:
    """Taken just before ``pyfuse3.init``, in the thread that calls it; None if /proc
    cannot tell (the watchdog is then left to this process's exit). Never raises. Hand it
    to :func:`find_watchdog` or :func:`release_failed`, which close what it holds."""
    try:
        taken = Snapshot(_fds(), _children())
    except OSError as e:
        log.debug("no snapshot to find the fusermount3 watchdog by: %s", e)
        return None
    # (after the listing: a new descriptor too, but neither a socket nor /dev/fuse)
    with contextlib.suppress(OSError):
        taken.low = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return taken


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _is_comm_socket(fd: int) -> bool:
    """libfuse's end of a socket pair: inheritable (a socket Python made is not), a Unix
    stream socket, its peer credentials this process's (a socket pair's are its creator's)."""
    if not os.get_inheritable(fd):
        return False
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
                return False
            cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    return struct.unpack("3i", cred)[0] == os.getpid()


@dataclass
class Watchdog:
    """A mount's ``fusermount3`` child and this process's end of its socket (-1: none)."""

    pid: int
    fd: int
    link: str  # what /proc/self/fd shows for ``fd``: that it is still the same socket
    released: bool = False

    async def release(self) -> None:
        """Let the watchdog go: call once the session is closed (the mount gone, or this
        process no longer serving it). The watchdog then checks the mount at once: nothing
        mounted, it exits; mounted but dead, it unmounts, as at this process's exit. Waits
        up to REAP_WAIT for it to exit; after that a thread reaps it whenever it does.
        Idempotent."""
        if self.released:
            return
        self.released = True
        with contextlib.suppress(OSError):
            if self.fd >= 0 and os.readlink(f"/proc/self/fd/{self.fd}") == self.link:
                os.close(self.fd)
        if self.pid < 0:
            return
        with trio.move_on_after(REAP_WAIT):
            # (its own limiter: a thread abandoned here keeps its token until the watchdog
            # exits, which would hold a slot of the default one every to_thread call shares)
            await trio.to_thread.run_sync(
                _reap, self.pid, abandon_on_cancel=True, limiter=trio.CapacityLimiter(1)
            )
            return
        log.debug("fusermount3 (pid %d) still running; reaped when it exits", self.pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # (reaped by someone else)
        os.waitpid(pid, 0)


def find_watchdog(before: Snapshot | None) -> Watchdog | None:
    """The watchdog ``pyfuse3.init`` (with ``auto_unmount``) just started, found from what
    is new since ``before``; None unless exactly one new ``fusermount3`` child and exactly
    one new socket of libfuse's kind (anything ambiguous is left alone: the watchdog then
    lives until this process exits, as without this module). Never raises."""
    if before is None:
        return None
    try:
        return _find(before)
    except OSError as e:
        log.debug("fusermount3 watchdog not identified: %s", e)
        return None
    finally:
        before.close()


def _new(before: Snapshot) -> tuple[list[int], dict[int, str], list[int]]:
    """The ``fusermount3`` children, the sockets of libfuse's kind (fd -> link) and the
    /dev/fuse descriptors new since ``before``."""
    pids = [p for p in _children() - before.children if _comm(p) == "fusermount3"]
    new = {fd: link for fd, link in _fds().items() if before.fds.get(fd) != link}
    socks = {
        fd: link for fd, link in new.items() if link.startswith("socket:") and _is_comm_socket(fd)
    }
    return pids, socks, [fd for fd, link in new.items() if link == "/dev/fuse"]


async def release_failed(before: Snapshot | None) -> None:
    """After a ``pyfuse3.init`` that failed: close every socket and reap every
    ``fusermount3`` it left. With ``auto_unmount`` libfuse keeps its end of the socket and
    does not wait for the child even when the mount failed, and it tries twice when a
    subtype is given (once with it, once without): each failed mount left up to two
    descriptors and two zombies. Nothing is mounted, so none of them watches anything.
    Never raises (anything not identified is left, as without this module)."""
    if before is None:
        return
    before.close()
    try:
        pids, fds, _ = _new(before)
    except OSError as e:
        log.debug("what the failed mount left not identified: %s", e)
        return
    for fd, link in fds.items():
        await Watchdog(-1, fd, link).release()
    for pid in pids:
        await Watchdog(pid, -1, "").release()


def _find(before: Snapshot) -> Watchdog | None:
    pids, new, dev = _new(before)
    fds = list(new)
    if len(pids) != 1 or len(fds) != 1:
        log.debug("fusermount3 watchdog not identified (children %s, sockets %s)", pids, fds)
        return None
    fd = fds[0]
    os.set_inheritable(fd, False)
    if len(dev) == 1 and 0 <= before.low < dev[0]:
        # Below /dev/fuse: released after it when this process dies (see the module's doc)
        os.dup2(fd, before.low, inheritable=False)
        os.close(fd)
        fd = before.low
        before.low = -1  # (it holds the socket now: not to be closed)
    else:
        log.debug("fusermount3 socket left at %d (/dev/fuse: %s, low: %d)", fd, dev, before.low)
    return Watchdog(pids[0], fd, new[fds[0]])
