"""What scripts/archive_memory.py and scripts/control_memory.py share: a daemon mounted in
a process of its own (``kvfs mount --foreground``), and its memory read from /proc."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def proc_status(pid: int | str, field: str) -> int:
    """A ``/proc/PID/status`` memory field (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int | str) -> int:
    """Set the peak resident memory (VmHWM) back to the current; returns the current."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return proc_status(pid, "VmRSS")


@contextlib.contextmanager
def mounted_daemon(tmp: str, options: list[str]) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``kvfs mount --foreground`` of a store with ``options`` (``--data`` and the rest) at
    ``tmp``/mnt, its control socket ``tmp``/c.sock: yields (daemon, mount point, socket)
    once both are up, and unmounts it after. Raises SystemExit when it does not start."""
    mnt, sock = Path(tmp, "mnt"), Path(tmp, "c.sock")
    mnt.mkdir()
    cmd = [sys.executable, "-m", "cli", "mount", "--foreground", "--socket", str(sock)]
    daemon = subprocess.Popen([*cmd, *options, str(mnt)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (sock.exists() and os.path.ismount(mnt)):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the daemon did not start")
            time.sleep(0.1)
        yield daemon, mnt, sock
    finally:
        subprocess.run([sys.executable, "-m", "cli", "umount", str(mnt)], check=False)
        daemon.wait(60)
