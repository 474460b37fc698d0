"""``kvfs config --check``: try what the configuration asks for before a daemon does.

Each data directory and the index's directory is written to and synced as the store will
(O_DIRECT where ``direct_io`` is on), the FUSE device and ``fusermount3`` are looked for,
and the archive is opened and given one object to store (as a page's object is, in its
``storage_class``), read back and delete, under ``kvfs-check/`` of its prefix (which no
collection touches): a server that refuses what boto3 or kvfs sends says so here, with
its fix, not at the first spill. A multipart upload is not tried (it would send 5 MiB).
Nothing else is written: a directory that does not exist yet is only said to be creatable,
and the store's index is not opened (a running daemon holds it).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

import kvfs
from kvfs._mountinfo import fs_type

from ._util import fmt_bytes

__all__ = ["Check", "run_checks"]

PROBE = "kvfs-check"


@dataclass
class Check:
    """One thing checked: ``status`` ok, warn (works, but look) or fail (will not)."""

    check: str
    status: str
    detail: str


def run_checks(cfg: kvfs.StoreConfig, socket: Path) -> list[Check]:
    """Every check of ``cfg``, in order: directories, FUSE, the daemon on ``socket``, the
    archive."""
    out = _directories(cfg)
    out += _fuse()
    out.append(_daemon(socket))
    if cfg.archive_url:
        out += _archive(cfg)
    return out


def _existing(d: Path) -> Path:
    """``d``, or its nearest ancestor that exists."""
    while not d.exists() and d != d.parent:
        d = d.parent
    return d


def _probe_write(d: Path, direct: bool) -> None:
    """Write, sync and remove one 4 KiB file in ``d`` as the store writes its data files.
    Raises OSError."""
    name = d / f".{PROBE}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    fd = os.open(name, flags, 0o600)
    try:
        with mmap.mmap(-1, 4096) as buf:  # (page-aligned memory, as O_DIRECT needs)
            buf.write(b"k" * 4096)
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            name.unlink()


def _why(e: OSError, direct: bool) -> str:
    if e.errno == errno.EINVAL and direct:
        return (
            "O_DIRECT is not supported on this file system (tmpfs before Linux 6.6, some "
            "network and FUSE file systems): set store.direct_io = false (KVFS_DIRECT_IO=0)"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write here ({e.strerror}): give the daemon's user write access"
    if e.errno == errno.ENOSPC:
        return "the file system is full"
    return f"{e.strerror or e}"


def _directory(what: str, d: Path, direct: bool) -> tuple[Check, os.statvfs_result | None, int]:
    """The check of one directory the store writes to, its file system's statvfs and
    device (None, 0 when it cannot be read)."""
    here = _existing(d.absolute())
    try:
        st = os.statvfs(here)
        dev = os.stat(here).st_dev
    except OSError as e:
        return Check(what, "fail", f"cannot be read: {e.strerror}"), None, 0
    where = f"{fs_type(here) or '?'}, {fmt_bytes(st.f_bavail * st.f_frsize)} free"
    if here != d.absolute():
        if os.access(here, os.W_OK | os.X_OK):
            return Check(what, "ok", f"not there yet; it will be made in {here} ({where})"), st, dev
        return Check(what, "fail", f"not there, and {here} is not writable"), st, dev
    try:
        _probe_write(d, direct)
    except OSError as e:
        return Check(what, "fail", _why(e, direct)), st, dev
    return Check(what, "ok", f"writable{' with O_DIRECT' * direct} ({where})"), st, dev


def _directories(cfg: kvfs.StoreConfig) -> list[Check]:
    out: list[Check] = []
    seen: dict[int, int] = {}  # st_dev -> the first data directory on it
    total = 0
    for i, d in enumerate(Path(p) for p in cfg.data_dirs):
        check, st, dev = _directory(f"data dir {i}: {d}", d, cfg.direct_io)
        out.append(check)
        if st is None:
            continue
        if dev in seen:
            out.append(
                Check(
                    check.check,
                    "warn",
                    f"on the same file system as data dir {seen[dev]}: pages striped over both "
                    "share one device's bandwidth (one directory per NVMe device)",
                )
            )
        else:
            seen[dev] = i
            total += st.f_blocks * st.f_frsize
    index = cfg.index_path.parent
    if index not in {Path(p) for p in cfg.data_dirs}:
        out.append(_directory(f"index dir: {index}", index, False)[0])
    if cfg.capacity and total and cfg.capacity > total:
        out.append(
            Check(
                "capacity",
                "warn",
                f"{fmt_bytes(cfg.capacity)} is more than the data directories' file systems "
                f"hold ({fmt_bytes(total)}): the disks fill before the cap is reached",
            )
        )
    return out


def _fuse() -> list[Check]:
    out: list[Check] = []
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
        out.append(Check("FUSE device", "ok", "/dev/fuse opens"))
    except OSError as e:
        fix = "load the fuse module (modprobe fuse)" if e.errno == errno.ENOENT else e.strerror
        out.append(Check("FUSE device", "fail", f"/dev/fuse: {fix}; kvfs mount cannot work"))
    found = shutil.which("fusermount3")
    out.append(
        Check("fusermount3", "ok", found)
        if found
        else Check(
            "fusermount3",
            "fail",
            "not found: kvfs mount needs it (apt install fuse3), for auto_unmount too",
        )
    )
    return out


def _daemon(socket: Path) -> Check:
    from kvfs._remote import SyncRemoteStore

    remote = SyncRemoteStore(socket)
    try:
        remote.ping(timeout=5)
        return Check("daemon", "ok", f"a daemon answers on {socket}")
    except (kvfs.KvfsError, OSError):
        return Check("daemon", "ok", "none running for these data directories")
    finally:
        remote.close()


def _archive(cfg: kvfs.StoreConfig) -> list[Check]:
    from kvfs._archive import ArchiveConfig
    from objectstore import open_objectstore, parse_url
    from objectstore._s3 import _CONDITIONAL, S3Store

    url = cfg.archive_url
    options: dict[str, Any] = dict(ArchiveConfig.from_extra(cfg.extra).store_options or {})
    if url.startswith("file:"):
        options["create"] = False  # (a check makes nothing; the store makes it at its open)
        # (as the store reads it: %-escapes decoded, file://localhost/DIR is /DIR)
        where = Path(parse_url(url)[1])
        if not where.exists():
            ok = os.access(_existing(where), os.W_OK | os.X_OK)
            detail = "not there yet; the store makes it" if ok else "not there, nor creatable"
            return [Check(f"archive: {url}", "ok" if ok else "fail", detail)]

    async def probe() -> list[Check]:
        try:
            store = await open_objectstore(url, **options)
        except (kvfs.KvfsError, ValueError) as e:
            return [Check(f"archive: {url}", "fail", str(e))]
        out = [Check(f"archive: {url}", "ok", "reachable")]
        key, data = f"{PROBE}/{uuid.uuid4().hex}", os.urandom(4096)
        try:
            # (cold: as a page's object is put, in its storage_class where one is set)
            await store.put(key, data, if_absent=True, cold=True)
            got = await store.get(key)
            await store.delete(key)
            if got != data:
                out.append(Check("archive round trip", "fail", "an object read back differs"))
            else:
                out.append(Check("archive round trip", "ok", "put, get and delete of one object"))
        except (kvfs.KvfsError, OSError) as e:
            out.append(Check("archive round trip", "fail", str(e)))
            with contextlib.suppress(Exception):
                await store.delete(key)  # (what a failed get left, if it can go)
        finally:
            await store.aclose()
        if isinstance(store, S3Store) and _CONDITIONAL in store._lacks:
            out.append(
                Check(
                    "conditional puts",
                    "warn",
                    "this server refuses If-None-Match: kvfs HEADs each object first instead",
                )
            )
        return out

    return trio.run(probe)
