"""Restore one spilled session many times, beside plain downloads of its objects.

A diagnostic for the archive tier's restore path (``kvfs bench archive`` is the benchmark
with the goal): starts a moto S3 server on loopback, spills a session of real-looking KV
pages, then evicts and restores it ``--rounds`` times. It prints the restore throughput
(best and median), the CPU the store's own process spent per restore, the fraction of the
machine's CPU that was busy meanwhile, and the same for plain boto3 downloads of the
session's archived objects at the same concurrency.

    .venv/bin/python scripts/restore_loop.py --rounds 10
    .venv/bin/python scripts/restore_loop.py --rounds 10 --processes 0   # in-process restore
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kvfs
from kvfs.bench.archive import _moto, _pages_from, kv_tensors


def busy() -> tuple[int, int]:
    """Busy and total jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as st:
        f = [int(x) for x in st.readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--page-mib", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--processes", type=int, default=2, help="worker processes (0: none)")
    args = ap.parse_args()
    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    arrs, _ = kv_tensors(512, 4, True)
    pages = _pages_from(arrs, args.pages, args.page_mib << 20)
    total = sum(len(p) for p in pages)
    d = Path(tempfile.mkdtemp())
    try:
        with _moto() as ep:
            client = boto3.client("s3", endpoint_url=ep)
            client.create_bucket(Bucket="restore-loop")
            cfg = kvfs.StoreConfig(
                data_dirs=(d / "store",),
                archive_url=f"s3://restore-loop/kv?endpoint={ep}",
                extra={
                    "archive": {
                        "interval": 0,
                        "concurrency": args.concurrency,
                        "upload_processes": args.processes,
                    }
                },
            )
            with kvfs.open_store_sync(cfg) as s:
                for i, pg in enumerate(pages):
                    s.put(kvfs.PageKey.semantic("cold", "p", i), pg, attrs={"dtype": "fp16"})
                s.spill("cold")
                s.evict(session="cold")
                s.restore("cold")  # warm: workers started, connections open
                walls, cpus = [], []
                rb = [0, 0]
                for _ in range(args.rounds):
                    s.evict(session="cold")
                    t, c = time.perf_counter(), time.process_time()
                    r0 = busy()
                    s.restore("cold")
                    r1 = busy()
                    rb = [rb[0] + r1[0] - r0[0], rb[1] + r1[1] - r0[1]]
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
            objs = client.list_objects_v2(Bucket="restore-loop", Prefix="kv/blobs/")["Contents"]
            keys = [o["Key"] for o in objs]
            stored = sum(o["Size"] for o in objs)
            gets = []
            g0 = busy()
            with ThreadPoolExecutor(args.concurrency) as ex:
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    list(
                        ex.map(
                            lambda k: client.get_object(Bucket="restore-loop", Key=k)[
                                "Body"
                            ].read(),
                            keys,
                        )
                    )
                    gets.append(time.perf_counter() - t)
            g1 = busy()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def mbps(ts: list[float], n: int = total) -> str:
        return f"best {n / min(ts) / 1e6:.0f} median {n / statistics.median(ts) / 1e6:.0f} MB/s"

    print(
        f"restore ({args.processes} worker processes): {mbps(walls)} of page bytes; store "
        f"process CPU {statistics.median(cpus) * 1e3:.0f} ms a restore; machine busy "
        f"{rb[0] / rb[1]:.2f} during the restores"
    )
    print(
        f"boto3 get of the same {len(keys)} objects: {mbps(gets, stored)} of object bytes "
        f"({stored / total:.2f} of the page bytes; {mbps(gets)} counted as page bytes); "
        f"machine busy {(g1[0] - g0[0]) / (g1[1] - g0[1]):.2f}"
    )


if __name__ == "__main__":
    main()
