"""A reader's latency while sessions spill, with or without the spill's local unlinks.

A diagnostic beside ``kvfs bench archive`` (which has the goal): starts a moto S3 server on
loopback, then times 256 KiB gets of hot local pages, first idle, then while ``--sessions``
sessions of 24 x 2 MiB KV pages spill one after the other. ``--stub-unlinks`` leaves the
dropped local files in place (measuring only: the store's accounting is then wrong) to show
what the unlinks cost the reader. ``--idle-workers`` puts the upload worker processes in
the idle CPU scheduling class (SCHED_IDLE) and, with ``--idle-io``, the idle I/O class too;
``--idle-server`` does the same to the moto server (an endpoint on other machines would
not share the CPUs): what scheduling alone could give the reader.

    .venv/bin/python scripts/spill_read_latency.py
    .venv/bin/python scripts/spill_read_latency.py --stub-unlinks
    .venv/bin/python scripts/spill_read_latency.py --idle-workers --idle-io --idle-server
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import kvfs
import kvfs._local as L
import kvfs._uploader as U
from kvfs.bench.archive import _HOT, _moto, _pages_from, _reader, _reads_until, kv_tensors


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def to_idle_class(pid: int, io: bool) -> None:
    """Every thread of ``pid`` to SCHED_IDLE (threads started later inherit it), and to the
    idle I/O class (``ionice -c 3``) if ``io``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        if io:
            subprocess.run(["ionice", "-c", "3", "-p", tid], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--stub-unlinks", action="store_true")
    ap.add_argument("--idle-workers", action="store_true")
    ap.add_argument("--idle-io", action="store_true", help="with --idle-workers")
    ap.add_argument("--idle-server", action="store_true")
    args = ap.parse_args()
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    arrs, _ = kv_tensors(512, 4, True)
    pages = _pages_from(arrs, 24, 2 << 20)
    d = Path(tempfile.mkdtemp())
    busy: list[float] = []
    try:
        server: dict[str, int] = {}
        with _moto(0, server) as ep:
            if args.idle_server:
                to_idle_class(server["pid"], False)
            boto3.client("s3", endpoint_url=ep).create_bucket(Bucket="spill-latency")
            cfg = kvfs.StoreConfig(
                data_dirs=(d / "store",),
                archive_url=f"s3://spill-latency/kv?endpoint={ep}",
                extra={"archive": {"interval": 0}},
            )
            with kvfs.open_store_sync(cfg) as s:
                for i, k in enumerate(_HOT):
                    s.put(k, pages[i % len(pages)][: 256 * 1024] + i.to_bytes(8, "little"))
                read = _reader(s)
                s.put(kvfs.PageKey.semantic("warm", "p", 0), pages[0][::-1])
                s.spill("warm")  # workers started, connections open
                if args.idle_workers:
                    for w in list(U._workers.values()):
                        for pid in w.pids():
                            to_idle_class(pid, args.idle_io)
                if args.stub_unlinks:
                    L.LocalTier.unlink = lambda self, extents: None  # type: ignore[method-assign]
                idle = [read(i) for i in range(500)]
                for n in range(args.sessions):
                    for i, pg in enumerate(pages):
                        b = bytearray(pg)
                        b[:8] = (n * 1000 + i + 7).to_bytes(8, "little")  # fresh content
                        s.put(kvfs.PageKey.semantic(f"cold{n}", "p", i), bytes(b))
                    done = threading.Event()

                    def spill(session: str = f"cold{n}", done: threading.Event = done) -> None:
                        s.spill(session)
                        done.set()

                    t = threading.Thread(target=spill)
                    t.start()
                    busy += _reads_until(read, done.is_set, 500)
                    t.join()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(
        f"{'unlinks stubbed' if args.stub_unlinks else 'as is'}"
        f"{', idle workers' if args.idle_workers else ''}{' (cpu+io)' if args.idle_io else ''}"
        f"{', idle server' if args.idle_server else ''}: idle p99 {pct(idle, 0.99):.2f} ms;"
        f" during spills p50 {pct(busy, 0.5):.2f} ms, p99 {pct(busy, 0.99):.2f} ms"
        f" ({len(busy)} reads)"
    )


if __name__ == "__main__":
    main()
