"""What deleting an archived page costs as the bucket's manifests grow.

Deleting the last reference to some content deletes its archive object, but only once no
manifest of any host names it, so a collection must know every manifest's pages. This
script fills a moto S3 server (its own process, on loopback) with N one-page sessions, then
times, in the same run:

* ``sequential GETs``: reading every manifest one after the other (what a collection did
  before the ninth session), the baseline;
* ``cold``: a collection's read of the manifests with nothing cached (concurrent GETs);
* ``delete``: a delete of one page, end to end (its manifest rewritten, the collection, the
  object deleted), medians of ``--deletes``; only the rewritten manifest is read again.

    .venv/bin/python scripts/collect_cost.py --sessions 250 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import boto3

import kvfs
from kvfs import PageKey
from kvfs.bench.archive import _moto


def run(endpoint: str, root: Path, sessions: int, deletes: int) -> dict[str, float]:
    bucket = f"collect-{sessions}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    ).create_bucket(Bucket=bucket)
    cfg = kvfs.StoreConfig(
        data_dirs=(root / f"d{sessions}",),
        archive_url=f"s3://{bucket}/kv?endpoint={endpoint}&addressing=path",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        for n in range(sessions):
            for i in range(2):
                s.put(PageKey.semantic(f"s{n}", "p", i), f"{n}-{i}".encode() * 1000)
            s.spill(f"s{n}")
        policy = s.engine.policy  # type: ignore[attr-defined]
        spiller, store = policy.spiller, policy.store

        async def sequential() -> None:
            for key in await store.list_all("manifests/"):
                await store.get(key)

        t0 = time.perf_counter()
        policy.call(sequential)
        seq = time.perf_counter() - t0
        t0 = time.perf_counter()
        policy.call(spiller._named, frozenset())
        cold = time.perf_counter() - t0
        times = []
        for n in range(deletes):
            t0 = time.perf_counter()
            s.delete(PageKey.semantic(f"s{n}", "p", 0))
            times.append(time.perf_counter() - t0)
    return {"sequential": seq, "cold": cold, "delete": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[250, 1000])
    p.add_argument("--deletes", type=int, default=9)
    args = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")  # moto takes any credentials
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    print("sessions  sequential GETs (s)  cold read (s)  delete, median (s)  delete / sequential")
    with _moto() as endpoint, tempfile.TemporaryDirectory() as tmp:
        for n in args.sessions:
            r = run(endpoint, Path(tmp), n, args.deletes)
            print(
                f"{n:8d}  {r['sequential']:19.3f}  {r['cold']:13.3f}  {r['delete']:18.3f}"
                f"  {r['delete'] / r['sequential']:18.3f}x"
            )


if __name__ == "__main__":
    main()
