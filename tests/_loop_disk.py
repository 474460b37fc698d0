"""A disk that fails under a running store: a real ext4 file system on a loop device,
mounted for each test (root, as CI runs), then shut down with ext4's own ioctl
(``EXT4_IOC_SHUTDOWN``: every later I/O on it fails with EIO, as a device that dropped off
the bus) and, for what a comeback finds, mounted again. The ``loop_disk`` fixture
(tests/conftest.py) gives one to tests/test_device_failure.py (a data device) and
tests/test_index_failure.py (the index's disk)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["LoopDisk", "made_loop_disk"]

#: _IOR('X', 125, __u32): shut the file system down; flag 2 (NOLOGFLUSH) drops what its
#: journal has not committed, as a power cut would.
EXT4_IOC_SHUTDOWN = 0x8004587D
NOLOGFLUSH = 2


@dataclass
class LoopDisk:
    """An ext4 file system on a loop device, mounted at ``path``."""

    image: Path
    path: Path
    loop: str = ""

    def mount(self) -> None:
        subprocess.run(["mount", self.loop, str(self.path)], check=True)

    def shut_down(self) -> None:
        """Every I/O under ``path`` fails with EIO from now on, until ``comeback``."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, NOLOGFLUSH.to_bytes(4, "little"))
        finally:
            os.close(fd)

    def comeback(self) -> None:
        """Unmount and mount again: what the journal holds is what the disk has."""
        subprocess.run(["umount", str(self.path)], check=True)
        self.mount()


@contextmanager
def made_loop_disk(tmp_path: Path, size: int = 64 << 20) -> Iterator[LoopDisk]:
    """A LoopDisk of ``size`` bytes (a sparse image) under ``tmp_path``, mounted;
    unmounted and detached after. Skips the test where there is no root, no tool or no
    loop device."""
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root (CI runs as root)")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    disk = LoopDisk(tmp_path / "disk.img", tmp_path / "disk")
    disk.path.mkdir()
    with open(disk.image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(disk.image)], check=True)
    made = subprocess.run(
        ["losetup", "-f", "--show", str(disk.image)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"no loop device here: {made.stderr.strip()}")
    disk.loop = made.stdout.strip()
    try:
        disk.mount()
        yield disk
    finally:
        if subprocess.run(["umount", str(disk.path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk.path)], check=False)
        subprocess.run(["losetup", "-d", disk.loop], check=False)
