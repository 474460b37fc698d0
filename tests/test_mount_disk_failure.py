"""A data disk that fails under a real mount (a ``kvfs mount`` daemon) while programs write
through it: a real ext4 file system on a loop device (tests/_loop_disk.py) as one of two
data directories, shut down with ``EXT4_IOC_SHUTDOWN``. What each failure leaves is in
docs/architecture.md, "A device that fails"."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from _kvfs_mount import daemon_mount
from _loop_disk import LoopDisk

import kvfs

#: a page of more than one stripe unit is striped over both devices: it cannot avoid the
#: failing one, and its commit fails with EIO
UNIT = 64 << 10
PAGE = 3 * UNIT


def closed_by_a_child(fd: int) -> None:
    """A child that inherited ``fd`` exits (as a fork, or subprocess's fork and exec,
    does): its close of the descriptor is a FUSE flush, which commits the file."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_the_writer_hears_of_a_commit_a_child_close_met_on_a_failing_disk(
    tmp_path: Path, loop_disk: LoopDisk
) -> None:
    # A child's close of the descriptor it inherited committed the file being written; the
    # failing disk failed that commit and its EIO went to the child, which nobody reads.
    # The writer's own close then returned 0 for a page never published (an LMCache
    # writer's os.replace of its tmp file found no file, ENOENT), and a further write
    # answered EBADF, as if the descriptor were not open for writing.
    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "d0", loop_disk.path / "data"), stripe_unit=UNIT)
    with daemon_mount(cfg, tmp_path / "mnt") as mp:
        loop_disk.shut_down()
        fd = os.open(mp / "a.tmp", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, os.urandom(PAGE))
            closed_by_a_child(fd)
            with pytest.raises(OSError) as wrote:
                os.write(fd, os.urandom(PAGE))
        finally:
            try:
                os.close(fd)
                closed = 0
            except OSError as e:
                closed = e.errno
        assert (wrote.value.errno, closed) == (errno.EIO, errno.EIO)
        assert not (mp / "a.tmp").exists()
