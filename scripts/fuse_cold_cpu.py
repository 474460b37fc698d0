"""Who is busy while one reader reads cold pages through a kvfs mount.

A diagnostic for the cold-read gap of ``kvfs bench fuse`` (``docs/benchmarks.md``, FUSE
mount): mounts a fresh store with a ``kvfs mount`` daemon, writes ``--pages`` pages of
``--mib`` MiB through it, then ``--rounds`` times drops the page cache and reads every page
with 1 MiB reads, each time after reading the same bytes cold from the data files (the
baseline of ``kvfs bench fuse``). It prints both throughputs, the CPU time of each of the
daemon's threads (the FUSE loop is the thread named ``python``; the others are its worker
threads) as a share of the reading time, and the whole machine's user, system, I/O-wait and
idle time during the reads only. ``--warm-backing`` reads the data files once after each
drop, into their page cache: before the daemon read them with O_DIRECT (commit 4b8c2ac)
its reads then hit memory, which showed what the mount gave when the disk was not the
limit; since then the daemon reads past that cache, so the option shows no difference.
``--read-ahead-kb N`` sets the mount's kernel read-ahead (the daemon sets 1024) once it is
up: how many read requests the kernel keeps in flight for one reader.

    .venv/bin/python scripts/fuse_cold_cpu.py
    .venv/bin/python scripts/fuse_cold_cpu.py --warm-backing
    .venv/bin/python scripts/fuse_cold_cpu.py --read-ahead-kb 4096
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvfs.bench.fuse import _drop_caches, _extents, _mounted, _read_extents

MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[str, tuple[str, int]]:
    """tid -> (thread name, user + system ticks) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            st = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        fields = st[st.rindex(")") + 2 :].split()
        out[tid] = (st[st.index("(") + 1 : st.rindex(")")], int(fields[11]) + int(fields[12]))
    return out


def machine() -> list[int]:
    """user, nice, system, idle, iowait, ... ticks of the whole machine (/proc/stat)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--pages", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warm-backing", action="store_true")
    ap.add_argument("--read-ahead-kb", type=int, default=0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        with _mounted(root, False) as mp:
            if args.read_ahead_kb:
                dev = mp.stat().st_dev
                Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text(
                    str(args.read_ahead_kb)
                )
            (mp / "pages").mkdir()
            for i in range(args.pages):
                data = os.urandom(args.mib * MiB)  # distinct pages: equal ones share their data
                with open(mp / "pages" / f"p{i}", "wb") as f:
                    for o in range(0, len(data), MiB):
                        f.write(data[o : o + MiB])
            pid = int(
                subprocess.run(
                    ["pgrep", "-f", f"mount --foreground --data {root}"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()[0]
            )
            buf = bytearray(MiB)
            busy = [0] * 10
            elapsed = backing = 0.0
            extents = [_extents(mp / "pages" / f"p{i}") for i in range(args.pages)]
            before = threads(pid)
            for _ in range(args.rounds):
                _drop_caches([])
                t0 = time.perf_counter()
                _read_extents(extents)  # the baseline: the same bytes from the data files
                backing += time.perf_counter() - t0
                _drop_caches([])
                if args.warm_backing:
                    for fn in (root / "data").rglob("*"):
                        if fn.is_file():
                            with open(fn, "rb") as f:
                                while f.read(8 * MiB):
                                    pass
                m0, t0 = machine(), time.perf_counter()
                for i in range(args.pages):
                    fd = os.open(mp / "pages" / f"p{i}", os.O_RDONLY)
                    while os.readv(fd, [buf]):
                        pass
                    os.close(fd)
                elapsed += time.perf_counter() - t0
                busy = [b + (y - x) for b, x, y in zip(busy, m0, machine(), strict=False)]
            after = threads(pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = args.rounds * args.pages * args.mib * MiB
    print(
        f"{args.pages} x {args.mib} MiB pages, {args.rounds} rounds"
        f"{', data files warm' if args.warm_backing else ''}"
        f"{f', read_ahead_kb {args.read_ahead_kb}' if args.read_ahead_kb else ''}: "
        f"{total / elapsed / 1e9:.2f} GB/s through the mount, {total / backing / 1e9:.2f} GB/s "
        f"from the data files cold, ratio {backing / elapsed:.2f}; {elapsed:.2f} s reading"
    )
    for tid, (name, ticks) in sorted(after.items(), key=lambda kv: -kv[1][1]):
        used = (ticks - before.get(tid, (name, 0))[1]) / TICK
        if used > 0:
            print(f"  daemon thread {name:16s} {used:5.2f} s CPU = {used / elapsed:4.0%} of it")
    user, _nice, system, idle, iowait = busy[:5]
    all_ = sum(busy)
    print(
        "  machine during the reads: "
        + ", ".join(
            f"{k} {v / all_:.0%}"
            for k, v in (("user", user), ("system", system), ("iowait", iowait), ("idle", idle))
        )
        + f" of {all_ / TICK:.2f} CPU-seconds ({os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
