"""The mount table as the kernel gives it (``/proc/self/mountinfo``), with no other
dependency: the daemon and the CLI both ask it which mounts exist."""

from __future__ import annotations

import os
import re

__all__ = ["KVFS_FS", "fs_type", "kvfs_mount_of", "kvfs_mounts", "mount_of", "mounts"]

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
    real = os.path.realpath(path)
    best, kind = "", ""
    for mp, t in mounts():
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best):
            best, kind = mp, t
    return best, kind


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
