"""The mount table as the kernel gives it (``/proc/self/mountinfo``), with no other
dependency: the daemon and the CLI both ask it which mounts exist.

Nothing here touches a FUSE mountpoint or a path on a kvfs mount: a request there waits
for its daemon, for ever if that is stopped (SIGSTOP, Ctrl-Z) or stuck, and ``kvfs mount``
or ``kvfs umount`` of such a mount hung in ``os.path.realpath`` before it read this table.
"""

from __future__ import annotations

import os
import re
import stat

__all__ = [
    "KVFS_FS",
    "fs_type",
    "kvfs_mount_of",
    "kvfs_mount_of_fd",
    "kvfs_mounts",
    "mount_of",
    "mounted_at",
    "mounts",
    "realpath",
]

#: the file system type of a kvfs mount in the mount table
KVFS_FS = "fuse.kvfs"

# The kernel writes a space, tab, newline and backslash in a path as a 3-digit octal escape.
_ESCAPE = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def mounts(path: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """(mountpoint, file system type) of every mount this process sees, in table order.
    Paths are decoded as the file system would (a space, a non-ASCII name)."""
    out = []
    with open(path, "rb") as f:
        for line in f:
            fields = line.split()
            if b"-" not in fields[6:]:
                continue
            sep = fields.index(b"-", 6)
            out.append((_unescape(fields[4]), os.fsdecode(fields[sep + 1])))
    return out


def fs_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system ``path`` is on."""
    return mount_of(path)[1]


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mountpoint, type) of the file system ``path`` is on, whether it exists or not (the
    last mount over its deepest mountpoint above it: a later mount hides an earlier one)."""
    table = mounts()
    return _mount_of(realpath(path, table), table)


def _mount_of(real: str, table: list[tuple[str, str]]) -> tuple[str, str]:
    best, kind = "", ""
    for mp, t in table:
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best):
            best, kind = mp, t
    return best, kind


def mounted_at(path: str, table: list[tuple[str, str]] | None = None) -> str | None:
    """The type of the file system mounted at ``path`` (a real path: the last mount there),
    or None when ``path`` is no mountpoint. From the table alone: ``path`` is not touched."""
    kinds = [t for mp, t in (mounts() if table is None else table) if mp == path]
    return kinds[-1] if kinds else None


def realpath(path: str | os.PathLike[str], table: list[tuple[str, str]] | None = None) -> str:
    """``os.path.realpath(path)``, asking the file system nothing about a FUSE mountpoint or
    a path on a kvfs mount (see the module's doc): a mountpoint is a directory, never a
    symlink, and a kvfs mount holds no symlinks (EPERM), so the path there is already
    real. Other components are looked up as realpath does (a symlink loop is left as it
    is); a path on another FUSE file system may still hang on its own daemon."""
    if table is None:
        try:
            table = mounts()
        except OSError:
            return os.path.realpath(path)
    seen: dict[str, str | None] = {}

    def known_plain(p: str) -> bool:
        t = mounted_at(p, table)
        return (t is not None and t.startswith("fuse")) or _mount_of(p, table)[1] == KVFS_FS

    def join(base: str, rest: str) -> tuple[str, bool]:
        if rest.startswith("/"):
            base = "/"
        while rest:
            name, _, rest = rest.partition("/")
            if name in ("", "."):
                continue
            if name == "..":
                base = os.path.dirname(base)
                continue
            new = os.path.join(base, name)
            try:
                link = not known_plain(new) and stat.S_ISLNK(os.lstat(new).st_mode)
            except OSError:
                link = False
            if not link:
                base = new
                continue
            if new in seen:  # (resolved before, or a loop: left as it is, as realpath does)
                resolved = seen[new]
                if resolved is None:
                    return os.path.join(new, rest), False
                base = resolved
                continue
            seen[new] = None
            base, ok = join(base, os.readlink(new))
            if not ok:
                return os.path.join(base, rest), False
            seen[new] = base
        return base, True

    return os.path.abspath(join(os.getcwd(), os.fspath(path))[0])


def kvfs_mounts() -> list[str]:
    """Mountpoints of kvfs file systems (none when the table cannot be read)."""
    try:
        return [mp for mp, fstype in mounts() if fstype == KVFS_FS]
    except OSError:
        return []


def kvfs_mount_of(path: str | os.PathLike[str]) -> str | None:
    """The kvfs mount ``path`` is on (it need not exist), or None."""
    mp, fstype = mount_of(path)
    return mp if fstype == KVFS_FS else None


def kvfs_mount_of_fd(fd: int) -> str | None:
    """The kvfs mount the open file ``fd`` was opened on, or None (also when ``/proc`` does
    not say). Asked of the open file, not of a name: a name looked up again may lead
    elsewhere by now (a symlink moved, a mount made over a directory)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            mnt = next((line.split()[1] for line in f if line.startswith(b"mnt_id:")), None)
        if mnt is None:
            return None
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                if fields[0] == mnt and b"-" in fields[6:]:
                    kind = os.fsdecode(fields[fields.index(b"-", 6) + 1])
                    return _unescape(fields[4]) if kind == KVFS_FS else None
    except (OSError, IndexError):  # (no /proc, or a line not as Linux writes it)
        return None
    return None  # (its mount is gone from the table: unmounted since the open)
