"""What a page put and got through the control channel costs the daemon in memory.

Mounts a store with ``kvfs mount --foreground`` (a real daemon, its own process) and writes
a page of ``--mib`` MiB through the mount; then, through the control socket with
:class:`kvfs.SyncRemoteStore`, gets it (without a buffer, then into one), puts a second page
and gets that. (The first page is written through the mount so that the first gets find no
heap the daemon kept from a put.) Before each step the daemon's peak
resident memory is reset (``/proc/PID/clear_refs``); after it, the peak (``VmHWM``) is
read. The figure printed is that peak above the daemon's resident memory before the step,
in MiB and in pages (a page = 1.00), for the daemon and for this client process, and what
the daemon still holds half a second after the step (its resident memory then, above the
same).

    .venv/bin/python scripts/control_memory.py --mib 256

Needs /dev/fuse and permission to mount (root, or fusermount3).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _memory import mounted_daemon, proc_status, reset_peak

from kvfs import SyncRemoteStore

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="the page's size in MiB (256)")
    args = ap.parse_args()
    size = args.mib * MiB
    with tempfile.TemporaryDirectory(prefix="kvfs-ctlmem-") as tmp:
        options = ["--data", f"{tmp}/d0,{tmp}/d1", "--capacity", "4GiB"]
        with mounted_daemon(tmp, options) as (daemon, mnt, sock):
            page = os.urandom(size)
            into = bytearray(size)
            # (through the mount: the gets measured first find no heap kept from a put)
            (mnt / "s" / "p").mkdir(parents=True)
            (mnt / "s" / "p" / "0").write_bytes(page)
            r = SyncRemoteStore(sock)
            r.ping()
            steps = [
                ("get", lambda: r.get("s/p/0")),
                ("get into", lambda: r.get("s/p/0", into=into)),
                ("put", lambda: r.put("s/p/1", page)),
                ("get", lambda: r.get("s/p/1")),
            ]
            print(f"page {args.mib} MiB; peak above the resident memory before each step (MiB)")
            print(f"{'step':10} {'daemon':>7} {'pages':>6} {'client':>7} {'pages':>6} {'held':>6}")
            for name, step in steps:
                d0, c0 = reset_peak(daemon.pid), reset_peak("self")
                got = step()
                d, c = proc_status(daemon.pid, "VmHWM") - d0, proc_status("self", "VmHWM") - c0
                del got
                time.sleep(0.5)  # (the daemon lets go of a request once it has answered)
                held = (proc_status(daemon.pid, "VmRSS") - d0) / size
                print(
                    f"{name:10} {d / MiB:7.0f} {d / size:6.2f} {c / MiB:7.0f} {c / size:6.2f} {held:6.2f}"
                )
            assert r.get("s/p/1") == page and bytes(into) == page
            r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
