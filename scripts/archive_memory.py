"""What large pages cost in memory on their way to and from the archive tier.

Mounts a store with ``kvfs mount --foreground`` (a real daemon, its own process, with its
upload workers) and a ``file://`` archive, puts ``--pages`` distinct pages of ``--mib`` MiB
in one session through the control socket (:class:`kvfs.SyncRemoteStore`), then: spills the
session, restores it, checks the archive (``fsck --check-archive``), evicts the restored
session again, and reads one page back (a restore in the daemon). Before each step the peak
resident memory of the daemon and of its child processes is reset
(``/proc/PID/clear_refs``); after it, the peak (``VmHWM``) is read. The figures printed
are those peaks above the resident memory before the step, in pages (a page = 1.00): the
daemon's, and the largest of one upload worker's.

    .venv/bin/python scripts/archive_memory.py --mib 512 --pages 8
    .venv/bin/python scripts/archive_memory.py --mib 512 --pages 8 --kind fp16

``--kind random`` pages are incompressible (stored raw); ``fp16`` pages are normal values
in fp16, which zstd+shuffle compresses to ~85%. Needs /dev/fuse and permission to mount,
and about 3 x pages x mib of free disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _memory import mounted_daemon, proc_status, reset_peak

from kvfs import SyncRemoteStore

MiB = 1 << 20


def _family(pid: int) -> list[int]:
    """``pid`` and its child processes (the upload workers, fusermount3)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [pid, *kids]


def _page(kind: str, size: int) -> bytearray:
    rng = np.random.default_rng(1)
    if kind == "random":
        return bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    out = np.empty(size // 2, dtype=np.float16)
    for i in range(0, len(out), 1 << 24):
        out[i : i + (1 << 24)] = rng.standard_normal(min(1 << 24, len(out) - i), dtype=np.float32)
    return bytearray(out.tobytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="each page's size in MiB (512)")
    ap.add_argument("--pages", type=int, default=8, help="pages in the session (8)")
    ap.add_argument("--kind", choices=["random", "fp16"], default="random")
    args = ap.parse_args()
    size = args.mib * MiB
    page = _page(args.kind, size)
    with tempfile.TemporaryDirectory(prefix="kvfs-archmem-") as tmp:
        options = ["--data", f"{tmp}/d0,{tmp}/d1", "--archive", f"file://{tmp}/archive"]
        options += ["--capacity", f"{2 * args.pages * args.mib}MiB"]
        with mounted_daemon(tmp, options) as (daemon, _, sock):
            r = SyncRemoteStore(sock)
            for i in range(args.pages):
                page[:8] = i.to_bytes(8, "little")  # distinct pages: nothing deduplicated
                r.put(f"s/p/{i}", page, attrs={"dtype": "fp16"})
            last = args.pages - 1
            steps = [
                ("spill", lambda: r.spill("s/p")),
                ("restore", lambda: r.restore("s/p")),
                ("fsck --check-archive", lambda: r.fsck(archive=True)),
                ("evict (restored)", lambda: r.evict(session="s/p")),
                ("get (restores it)", lambda: r.get(f"s/p/{last}", into=page)),
            ]
            print(f"{args.pages} pages of {args.mib} MiB ({args.kind}); peak above the resident")
            print("memory before each step, in pages")
            print(f"{'step':22} {'daemon':>7} {'worker':>7} {'seconds':>8}")
            for name, step in steps:
                time.sleep(0.5)  # (the daemon lets go of what the last step held)
                pids = _family(daemon.pid)
                before = {}
                for pid in pids:
                    before[pid] = reset_peak(pid)
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                peak = {}
                for pid in pids:
                    try:
                        peak[pid] = (proc_status(pid, "VmHWM") - before[pid]) / size
                    except (FileNotFoundError, KeyError):  # (a worker that ended)
                        peak[pid] = float("nan")
                workers = [v for pid, v in peak.items() if pid != daemon.pid]
                print(f"{name:22} {peak[daemon.pid]:7.2f} {max(workers, default=0):7.2f} {dt:8.1f}")
            page[:8] = last.to_bytes(8, "little")
            assert r.get(f"s/p/{last}") == page
            r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
