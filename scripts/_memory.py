"""What the memory scripts share (scripts/*_memory.py): memory read from /proc, a daemon
mounted in a process of its own (``kvfs mount --foreground``), a measured call, a child
process's answer, a store spilled to a ``file://`` archive, and the cost per page."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def measured(call: Callable[[], T]) -> tuple[T, int, int, float]:
    """``call()``'s result, this process's resident memory just before it, its peak
    resident memory during it (VmHWM, reset first) and the seconds it took."""
    before = reset_peak("self")
    t = time.perf_counter()
    got = call()
    took = time.perf_counter() - t
    return got, before, proc_status("self", "VmHWM"), took


def child_output(script: str, *args: str) -> list[str]:
    """The words a child run of ``script`` with ``args`` printed; SystemExit with its
    stderr when it failed."""
    out = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"{args[0]} failed:\n{out.stderr}")
    return out.stdout.split()


def as_child(children: dict[str, Callable[..., object]]) -> bool:
    """Whether this run is one of the script's own children (``sys.argv[1]`` one of
    ``children``' flags): then that child has run, given the rest of the arguments."""
    if len(sys.argv) > 1 and sys.argv[1] in children:
        children[sys.argv[1]](*sys.argv[2:])
        return True
    return False


def page_counts(doc: str, pages: list[int], session: bool = True) -> argparse.Namespace:
    """The parent's arguments: ``--pages`` (default ``pages``) and, with ``session``,
    ``--session`` (pages a session, 400)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=pages)
    if session:
        ap.add_argument("--session", type=int, default=400, help="pages a session (400)")
    return ap.parse_args()


def archive_config(tmp: str, **archive: object) -> object:
    """A store in ``tmp`` on two data directories (``durable=False``, no O_DIRECT), with a
    ``file://`` archive there, upload threads rather than worker processes and no
    background task; ``archive``: more archive options."""
    import kvfs

    return kvfs.StoreConfig(
        data_dirs=(Path(tmp, "d0"), Path(tmp, "d1")),
        durable=False,
        direct_io=False,
        archive_url=f"file://{tmp}/archive",
        extra={"archive": {"interval": 0, "upload_processes": 0, **archive}},
    )


def fill_spilled(store: Any, n: int, per_session: int) -> list[str]:
    """Put ``n`` pages of 64 distinct bytes into ``store`` in sessions of ``per_session``
    and spill each (the archive alone holds them); the sessions' names."""
    sessions = []
    for first in range(0, n, per_session):
        session = f"sessions/s{first // per_session:05d}"
        store.put_many(
            (f"{session}/p/layer-{i - first:04d}", i.to_bytes(8, "little") * 8)
            for i in range(first, min(n, first + per_session))
        )
        store.spill(session)
        sessions.append(session)
    return sessions


def per_page(rows: list[tuple[int, ...]], names: list[str]) -> str:
    """The line saying what each page added between the first and the last ``rows``
    (pages, then one figure per name) cost, in bytes."""
    (n0, *a), (n1, *b) = rows[0], rows[-1]
    costs = (
        f"{name} {(y - x) / (n1 - n0):.0f} bytes" for name, x, y in zip(names, a, b, strict=True)
    )
    return "per page added: " + ", ".join(costs)


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
