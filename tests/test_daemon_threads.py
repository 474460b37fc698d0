"""A daemon that cannot start a thread (a cgroup's pids.max reached: RLIMIT_NPROC does not
bind root). Needs the cgroup v1 pids controller, writable (root)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _kvfs_mount import DaemonMount

PIDS = Path("/sys/fs/cgroup/pids")


@contextlib.contextmanager
def _capped_daemon(tmp_path: Path, more: int) -> Iterator[tuple[Path, DaemonMount]]:
    """A daemon mounted at tmp_path/mnt, a file "before" written, then moved into a cgroup
    that lets it start ``more`` threads than it runs; out of it before it stops."""
    if not os.access(PIDS / "cgroup.procs", os.W_OK):
        pytest.skip("needs the cgroup v1 pids controller at /sys/fs/cgroup/pids, writable")
    cg = PIDS / f"kvfs-test-{os.getpid()}"
    cg.mkdir()
    mp = tmp_path / "mnt"
    mp.mkdir()
    dm = DaemonMount([tmp_path / f"nvme{i}" for i in range(2)], mp, tmp_path / "daemon.log")
    pid = dm.proc.pid
    try:
        (mp / "before").write_bytes(b"b" * 100_000)
        (cg / "pids.max").write_text(f"{len(os.listdir(f'/proc/{pid}/task')) + more}\n")
        (cg / "cgroup.procs").write_text(f"{pid}\n")
        yield mp, dm
    finally:
        if (cg / "cgroup.procs").read_text().split():
            (PIDS / "cgroup.procs").write_text(f"{pid}\n")
        dm.stop()
        cg.rmdir()


def test_a_write_no_thread_can_take_fails_and_its_close_returns(tmp_path: Path) -> None:
    t: threading.Thread | None = None
    # no thread more than it has now: each file's write-behind thread must start
    with _capped_daemon(tmp_path, 0) as (mp, dm):
        try:
            files = [open(mp / f"f{i}", "wb", buffering=0) for i in range(20)]  # noqa: SIM115
            failed = set()
            for r in range(3):
                for i, f in enumerate(files):
                    try:
                        f.write(bytes([i, r]) * 35_000)
                    except OSError:
                        failed.add(i)
            assert failed  # (no thread could be started for some)
            closed: dict[int, object] = {}

            def close_all() -> None:
                for i, f in enumerate(files):
                    try:
                        f.close()
                        closed[i] = 0
                    except OSError as e:
                        closed[i] = e.errno

            # Before, a write whose thread could not start stayed queued: its close hung
            t = threading.Thread(target=close_all, daemon=True)
            t.start()
            t.join(20)
            assert not t.is_alive(), f"closes hung; returned: {closed}"
            (PIDS / "cgroup.procs").write_text(f"{dm.proc.pid}\n")  # (threads start again)
            for i in failed:
                assert closed[i] != 0
                assert not (mp / f"f{i}").exists()  # never published
            for i, status in closed.items():
                if status == 0:
                    want = b"".join(bytes([i, r]) * 35_000 for r in range(3))
                    assert (mp / f"f{i}").read_bytes() == want
            (mp / "after").write_bytes(b"a" * 100_000)
            assert (mp / "after").read_bytes() == b"a" * 100_000
            assert (mp / "before").read_bytes() == b"b" * 100_000
            # nor does a file whose commit could not start keep its room reserved (until
            # the daemon stopped, its files too)
            st = subprocess.run(
                [sys.executable, "-m", "cli", "stats", "--json", str(mp)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert json.loads(st.stdout)["reserved_bytes"] == 0, st.stdout
            # and said once, not as a traceback per request
            log = (tmp_path / "daemon.log").read_text()
            assert "Traceback" not in log and "no thread could be started" in log, log[-3000:]
        finally:
            if t is not None and t.is_alive():
                dm.proc.kill()  # (a hung close would hang the daemon's stop too)


def test_hundreds_of_files_written_at_once_need_few_threads(tmp_path: Path) -> None:
    """Write-behind started a thread for every file being written: 400 files written at
    once took hundreds, and in a cgroup that caps the daemon's processes (a container's
    pid limit) the writes that found none failed. Now the mount's threads (16) write every
    file's queue between them: with room for 80 more threads, all 400 files are written."""
    files = []
    with _capped_daemon(tmp_path, 80) as (mp, _):
        try:
            files = [open(mp / f"f{i}", "wb", buffering=0) for i in range(400)]  # noqa: SIM115
            for r in range(3):
                for i, f in enumerate(files):
                    f.write(bytes([i % 256, r]) * 35_000)
            for f in files:
                f.close()
            for i in range(400):
                want = b"".join(bytes([i % 256, r]) * 35_000 for r in range(3))
                assert (mp / f"f{i}").read_bytes() == want
            log = (tmp_path / "daemon.log").read_text()
            assert "no thread could be started" not in log and "Traceback" not in log, log[-3000:]
        finally:
            for f in files:
                if not f.closed:
                    with contextlib.suppress(OSError):
                        f.close()
