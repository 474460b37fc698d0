"""``kvfs bench store --index N``: the SQLite index alone.

Measures, on one store directory:

* single-page commits per second (one transaction each, as a put does), with the WAL at
  ``synchronous=FULL`` (the default: a put is durable when it returns) and at ``NORMAL``;
* page lookups per second (``page_and_blob``, what every get and stat does) with N pages;
* restart time: closing the engine cleanly and opening it again with N pages indexed (no
  data file is scanned; the open reads the blob rows to rebuild the capacity accounting).

The pages point at data files that do not exist: only the index is measured.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvfs
from kvfs._engine import Engine
from kvfs._index import PageCommit
from kvfs.bench._common import machine

__all__ = ["print_index_bench", "run_index_bench"]

TIMED_COMMITS = 2000


def _commit(eng: Engine, i: int) -> None:
    h = i.to_bytes(8, "little") + os.urandom(24)
    eng.index.commit_page(
        PageCommit(
            path=f"sessions/s{i % 1000}/p{i // 1000}/layer-{i % 80:03d}",
            session=f"sessions/s{i % 1000}",
            h=h,
            size=4 << 20,
            leaves=b"\0" * 128,
            extents=[(0, f"blobs/{h.hex()[:2]}/{h.hex()}", 4096, 4 << 20)],
            disk_bytes=(4 << 20) + 4096,
            attrs={"model": "bench"},
            pinned=False,
            replace=True,
            session_attrs={},
        )
    )


def run_index_bench(
    data: Path, n: int, *, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    cfg = kvfs.StoreConfig(data_dirs=(data,))
    out: dict[str, Any] = {"machine": machine(data_dir=str(data)), "pages": n}
    eng = Engine(cfg)
    try:
        k = max(1, min(TIMED_COMMITS, n // 2))  # timed commits per setting
        for sync in ("FULL", "NORMAL"):
            eng.index._db.execute(f"PRAGMA synchronous={sync}")
            base = 0 if sync == "FULL" else k
            t0 = time.perf_counter()
            for i in range(base, base + k):
                _commit(eng, i)
            out[f"commits_per_s_{sync.lower()}"] = k / (time.perf_counter() - t0)
            progress(
                f"  {k} commits at synchronous={sync}: {out[f'commits_per_s_{sync.lower()}']:.0f}/s"
            )
        done = 2 * k
        with eng.index._lock:  # fill the rest fast: one big transaction per 10k pages
            while done < n:
                stop = min(n, done + 10_000)
                eng.index._db.execute("BEGIN")
                for i in range(done, stop):
                    h = i.to_bytes(8, "little") + os.urandom(24)
                    eng.index._db.execute(
                        "INSERT INTO blobs VALUES (?,?,?,?,?,?,?,?,?)",
                        (
                            h,
                            4 << 20,
                            b"\0" * 128,
                            1,
                            kvfs._index._pack(
                                [(0, f"blobs/{h.hex()[:2]}/{h.hex()}", 4096, 4 << 20)]
                            ),
                            (4 << 20) + 4096,
                            0,
                            time.time(),
                            time.time(),
                        ),
                    )
                    eng.index._db.execute(
                        "INSERT OR REPLACE INTO pages VALUES (?,?,?,?,?,?,?,?)",
                        (
                            f"sessions/s{i % 1000}/p{i // 1000}/layer-{i % 80:03d}",
                            f"sessions/s{i % 1000}",
                            h,
                            4 << 20,
                            time.time(),
                            time.time(),
                            0,
                            kvfs._index._pack({}),
                        ),
                    )
                eng.index._db.execute("COMMIT")
                done = stop
                progress(f"  filled {done}/{n} pages")
        eng.index._db.execute("PRAGMA synchronous=FULL")
        paths = [r[0] for r in eng.index._q("SELECT path FROM pages")]
        out["pages"] = len(paths)
        sample = random.Random(1).choices(paths, k=min(100_000, len(paths)))
        t0 = time.perf_counter()
        for p in sample:
            if eng.index.page_and_blob(p) is None:
                raise RuntimeError(f"lost page {p}")
        out["lookups_per_s"] = len(sample) / (time.perf_counter() - t0)
        progress(f"  {len(sample)} lookups: {out['lookups_per_s']:.0f}/s")
    finally:
        eng.close()
    t0 = time.perf_counter()
    eng = Engine(cfg)
    out["restart_s"] = time.perf_counter() - t0
    out["swept_on_restart"] = len(eng.recovered_orphans)
    eng.close()
    out["index_bytes"] = cfg.index_path.stat().st_size
    progress(f"  restart with {out['pages']} pages: {out['restart_s']:.3f} s")
    return out


def print_index_bench(res: dict[str, Any]) -> None:
    from cli._util import fmt_bytes, print_table

    m = res["machine"]
    print(
        f"kvfs bench store --index: {m['host']}, {m['cpus']} CPUs, kernel {m['kernel']}, "
        f"Python {m['python']}; index in {m['data_dir']}"
    )
    print_table(
        ["measure", "value"],
        [
            ("pages indexed", res["pages"]),
            ("index file", fmt_bytes(res["index_bytes"])),
            ("commits/s, synchronous=FULL (default)", f"{res['commits_per_s_full']:.0f}"),
            ("commits/s, synchronous=NORMAL", f"{res['commits_per_s_normal']:.0f}"),
            ("lookups/s (page + blob)", f"{res['lookups_per_s']:.0f}"),
            ("restart (clean close, reopen)", f"{res['restart_s']:.3f} s"),
            ("files swept on restart", res["swept_on_restart"]),
        ],
        align="lr",
    )
