"""A data device that fails while the store runs: a real ext4 file system on a loop device,
mounted for each test (root, as CI runs) as one of two data directories, then shut down
with ext4's own ioctl (``EXT4_IOC_SHUTDOWN``: every later I/O on it fails with EIO, as a
device that dropped off the bus) and, for what a comeback finds, mounted again. What
each failure leaves is in docs/architecture.md, "A device that fails"."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest

import kvfs
from kvfs._fuse import KvfsOperations

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


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[LoopDisk]:
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root (CI runs as root)")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    disk = LoopDisk(tmp_path / "disk.img", tmp_path / "disk")
    disk.path.mkdir()
    with open(disk.image, "wb") as f:
        f.truncate(64 << 20)
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


def two_devices(tmp_path: Path, disk: LoopDisk) -> kvfs.StoreConfig:
    """A store on a plain directory (its index there too) and on ``disk``."""
    return kvfs.StoreConfig(data_dirs=(tmp_path / "d0", disk.path / "data"))


def put_all(s: kvfs.SyncStore, pages: dict[str, bytes]) -> None:
    for k, v in pages.items():
        s.put(k, v)


def test_a_device_cut_off_after_the_store_was_made_opens_again(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # The device marker was renamed into place, its directory synced, but its bytes were
    # never: the comeback found an empty marker, and every open refused the store ("is
    # unreadable ... kvfs will not guess"), its pages lost with it.
    cfg = two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000) for i in range(4)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        loop_disk.shut_down()
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        assert {k: s.get(k) for k in pages} == pages


def test_fsck_repair_keeps_the_pages_of_a_device_that_cannot_be_read(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # An I/O error was "corrupt": the copy was marked damaged and --repair deleted its
    # pages (then stopped on an EIO of its own), so the device came back to find them gone.
    cfg = two_devices(tmp_path, loop_disk)
    pages = {f"a/p{i}": os.urandom(100_000) for i in range(6)}
    with kvfs.open_store_sync(cfg) as s:
        put_all(s, pages)
        on_disk = {k: s.stat(k).extents[0].device for k in pages}
        cut = sorted(k for k, dev in on_disk.items() if dev == 1)
        assert cut and len(cut) < len(pages)  # (pages on both devices)
        os.sync()
        loop_disk.shut_down()
        found = s.fsck()
        assert found["corrupt"] == [] and found["missing"] == []
        assert found["unreadable"] and all(
            p.startswith(str(loop_disk.path)) for p in found["unreadable"]
        )
        assert found["damaged_pages"] == cut
        repaired = s.fsck(repair=True)
        assert repaired["unrecoverable"] == cut
        assert sorted(p.path for p in s.list()) == sorted(pages)  # nothing deleted
        for k in pages:
            if k not in cut:
                assert s.get(k) == pages[k]
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:
        assert {k: s.get(k) for k in pages} == pages
        found = s.fsck()
        assert not any(found[k] for k in ("unreadable", "corrupt", "orphans", "damaged_pages"))


async def test_the_mount_says_in_its_log_that_a_disk_fails(
    tmp_path: Path, loop_disk: LoopDisk, caplog: pytest.LogCaptureFixture
) -> None:
    # cat on the mount got EIO and the daemon's log said nothing (a failing disk was
    # news only to the programs it failed): one warning now, and a count of the rest
    from types import SimpleNamespace

    ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
    cfg = kvfs.StoreConfig(data_dirs=(loop_disk.path / "data",), index_dir=tmp_path / "index")
    async with kvfs.open_store(cfg) as store:
        for i in range(3):
            await store.put(f"a/p{i}", os.urandom(100_000))
        ops = KvfsOperations(store)
        try:
            a = (await ops.lookup(pyfuse3.ROOT_INODE, b"a", ctx)).st_ino
            inodes = [(await ops.lookup(a, f"p{i}".encode(), ctx)).st_ino for i in range(3)]
            os.sync()
            loop_disk.shut_down()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvfs.fuse"):
                for ino in inodes:
                    with pytest.raises(pyfuse3.FUSEError) as e:
                        fi = await ops.open(ino, os.O_RDONLY, ctx)
                        try:
                            await ops.read(fi.fh, 0, 100_000)
                        finally:
                            await ops.release(fi.fh)
                    assert e.value.errno == errno.EIO
        finally:
            await ops.aclose()
    said = [r.getMessage() for r in caplog.records if r.name == "kvfs.fuse"]
    assert len(said) == 1 and "Input/output error" in said[0], said  # (then counted)


def test_an_open_while_a_device_fails_says_so(tmp_path: Path, loop_disk: LoopDisk) -> None:
    # the open stopped at the marker with a bare "[Errno 5] Input/output error" (kvfs ls
    # printed only that, exit 1)
    cfg = two_devices(tmp_path, loop_disk)
    with kvfs.open_store_sync(cfg) as s:
        s.put("a/p", b"x" * 100_000)
    loop_disk.shut_down()
    with pytest.raises(kvfs.KvfsError, match=r"cannot be read \(Input/output error; is its disk"):
        kvfs.open_store_sync(cfg).__enter__()
    loop_disk.comeback()
    with kvfs.open_store_sync(cfg) as s:  # nothing changed by the failed open
        assert s.get("a/p") == b"x" * 100_000
