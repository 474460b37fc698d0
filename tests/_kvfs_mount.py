"""kvfs mounts for tests: served by a trio loop in a thread of the test process
(:class:`ServedMount`), or by a ``kvfs mount`` daemon process (:class:`DaemonMount`).

An in-process mount deadlocks with a client that calls the filesystem from C while holding
the GIL (numpy's ``ndarray.tofile`` fstat/lseek-s its file that way): the FUSE request waits
for the serving thread, which waits for the GIL. Real engines talk to a daemon process; tests
of such clients use :class:`DaemonMount`.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import trio

import kvfs
from kvfs._daemon import READY_FD_ENV
from kvfs._mount import MountOptions, serve_mount

__all__ = [
    "DaemonMount",
    "FreshStat",
    "ServedMount",
    "daemon_mount",
    "fresh_stat",
    "index_is_clean",
]


class DaemonMount:
    """``kvfs mount --foreground`` in a subprocess, returned once mounted; stopped with
    SIGTERM (a clean unmount). The daemon's output goes to ``log``; ``nofile``: the
    (soft, hard) RLIMIT_NOFILE it starts with."""

    def __init__(
        self,
        data_dirs: Sequence[Path],
        mountpoint: Path,
        log: Path,
        *extra: str,
        nofile: tuple[int, int] | None = None,
    ) -> None:
        self.mountpoint, self.log = mountpoint, log
        r, w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
        argv = [sys.executable, "-m", "cli", "mount", "--foreground"]
        argv += ["--data", ",".join(map(str, data_dirs)), *extra, str(mountpoint)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=out,
                pass_fds=(w,),
                env={**env, READY_FD_ENV: str(w)},
                preexec_fn=None if nofile is None else partial(_set_nofile, nofile),
            )
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.read().decode().strip()
        if msg != "ok":
            self.stop()
            raise RuntimeError(f"mount failed: {msg}\n{log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def __enter__(self) -> Path:
        return self.mountpoint

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _set_nofile(limits: tuple[int, int]) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def index_is_clean(data: Path) -> bool:
    """Whether the store in ``data`` was closed cleanly (its index says so: the next open
    does not recount it, as after a crash)."""
    import contextlib
    import sqlite3

    from kvfs._index import meta_value

    db = sqlite3.connect(f"file:{data}/kvfs-index.sqlite3?mode=ro", uri=True)
    with contextlib.closing(db):
        [(clean,)] = db.execute("SELECT v FROM meta WHERE k='clean'").fetchall()
    return meta_value(clean) is True


def daemon_mount(cfg: kvfs.StoreConfig, mp: Path) -> DaemonMount:
    """``cfg``'s store (data directories, stripe unit) mounted at ``mp`` (created) by a
    daemon process; its log beside the mountpoint."""
    mp.mkdir()
    return DaemonMount(
        cfg.data_dirs, mp, mp.with_name(mp.name + ".log"), "--stripe-unit", str(cfg.stripe_unit)
    )


class ServedMount:
    """A kvfs store mounted with FUSE by a trio loop in a thread, for synchronous tests."""

    def __init__(self, cfg: kvfs.StoreConfig, mountpoint: Path) -> None:
        self.cfg, self.mountpoint = cfg, mountpoint
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        async with kvfs.open_store(self.cfg) as store, trio.open_nursery() as nursery:
            self.token = trio.lowlevel.current_trio_token()
            self.scope = nursery.cancel_scope
            await nursery.start(serve_mount, store, self.mountpoint, MountOptions())
            self.ready.set()

    def __enter__(self) -> Path:
        self.thread.start()
        if not self.ready.wait(60) or self.error is not None:
            raise RuntimeError(f"mount failed: {self.error!r}") from self.error
        return self.mountpoint

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(60)
        if self.error is not None:
            raise self.error


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("_r", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("mask", ctypes.c_uint32),
        ("blksize", ctypes.c_uint32),
        ("attributes", ctypes.c_uint64),
        ("nlink", ctypes.c_uint32),
        ("uid", ctypes.c_uint32),
        ("gid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16),
        ("_spare0", ctypes.c_uint16),
        ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("blocks", ctypes.c_uint64),
        ("attributes_mask", ctypes.c_uint64),
        ("atime", _StatxTimestamp),
        ("btime", _StatxTimestamp),
        ("ctime", _StatxTimestamp),
        ("mtime", _StatxTimestamp),
        ("_rest", ctypes.c_uint8 * 128),  # (the struct is 256 bytes)
    ]


class FreshStat(NamedTuple):
    st_mode: int
    st_size: int
    st_mtime_ns: int


def fresh_stat(path: str | os.PathLike[str]) -> FreshStat:
    """``os.stat`` as the daemon answers it now, not as the kernel cached it (FUSE keeps a
    file's attributes for ``attr_timeout``, a second): ``statx`` with
    ``AT_STATX_FORCE_SYNC``. Raises OSError as ``os.stat`` does."""
    at_fdcwd, at_statx_force_sync, statx_basic_stats = -100, 0x2000, 0x7FF
    buf = _Statx()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.statx(
        at_fdcwd, os.fsencode(path), at_statx_force_sync, statx_basic_stats, ctypes.byref(buf)
    )
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))
    return FreshStat(buf.mode, buf.size, buf.mtime.tv_sec * 10**9 + buf.mtime.tv_nsec)
