"""``kvfs demo``: the object API on the embedded defaults, in a few seconds.

Writes a small KV cache the way an inference engine would: several sessions (conversations),
each with a few prefix chunks of a few layers, every page a numpy array of K and V. The first
prefix chunk of every session is the same system prompt, so its pages are stored once
(deduplicated). Everything is read back and compared byte for byte (into page-aligned numpy
buffers, so the reads use O_DIRECT), then the sessions and the store's statistics are shown.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

import kvfs

from ._util import fmt_bytes, print_json, print_table

__all__ = ["register", "run_demo"]

SESSIONS = 4
LAYERS = 8
CHUNKS = 3  # prefix chunks per session; chunk 0 is the shared system prompt
TOKENS = 256  # tokens per chunk
KV_HEADS, HEAD_DIM = 8, 64
MODEL = "demo-llama-8l"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="write, read back and list a small KV cache (object API)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=Path("demo-data"),
        help="store directory (default ./demo-data; reused across runs)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_main)


def _kv(seed: int) -> np.ndarray:
    """K and V of one layer for one chunk: (2, kv_heads, tokens, head_dim) float16."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, KV_HEADS, TOKENS, HEAD_DIM), dtype=np.float32).astype(np.float16)


def _prefix_hash(parent: str, chunk_seed: int) -> str:
    """A chained prefix hash as engines compute it: parent hash + this chunk's tokens."""
    return hashlib.blake2b(f"{parent}:{chunk_seed}".encode(), digest_size=8).hexdigest()


def run_demo(data: Path) -> dict[str, object]:
    """Write, verify and summarise the demo cache. Returns what it did (for --json)."""
    cfg = kvfs.StoreConfig(data_dirs=(data,))
    t0 = time.perf_counter()
    with kvfs.open_store_sync(cfg) as store:
        for s in store.sessions():  # a previous run's pages: start clean, keep the store
            if s.session.startswith("demo-"):
                store.delete_session(s.session)
        written: dict[kvfs.PageKey, np.ndarray] = {}
        for si in range(SESSIONS):
            session = f"demo-{si}"
            parent = "root"
            for c in range(CHUNKS):
                # Chunk 0 is the same system prompt in every session: same tokens, same KV.
                seed = 1000 + c if c == 0 else 10_000 * (si + 1) + c
                prefix = _prefix_hash(parent, seed)
                parent = prefix
                items = []
                for layer in range(LAYERS):
                    arr = _kv(seed * 100 + layer)
                    key = kvfs.PageKey.semantic(session, prefix, layer)
                    written[key] = arr
                    items.append((key, arr))
                attrs = {
                    "model": MODEL,
                    "dtype": "float16",
                    "shape": "x".join(map(str, items[0][1].shape)),
                    "tokens": f"{c * TOKENS}-{(c + 1) * TOKENS}",
                }
                store.put_many(items, attrs=attrs)
            if si == 0:
                store.pin_session(session)  # a pinned session is never evicted
        t_write = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = kvfs.aligned_buffer(written[next(iter(written))].nbytes)
        back = np.frombuffer(out, dtype=np.float16)
        for key, arr in written.items():
            n = store.get(key, into=out)
            if n != arr.nbytes or not np.array_equal(back.reshape(arr.shape), arr):
                raise kvfs.CorruptPage(f"{key}: read back differs from what was written")
        t_read = time.perf_counter() - t1
        sessions = [s for s in store.sessions() if s.session.startswith("demo-")]
        st = store.statistics()
    return {
        "data": str(data),
        "pages": len(written),
        "page_bytes": written[next(iter(written))].nbytes,
        "write_seconds": t_write,
        "read_seconds": t_read,
        "verified": True,
        "sessions": sessions,
        "statistics": st,
    }


def _main(args: argparse.Namespace) -> int:
    print(
        f"kvfs demo: writing {SESSIONS} sessions x {CHUNKS} prefix chunks x {LAYERS} layers "
        f"into {args.data}/ ...",
        file=sys.stderr,
    )
    res = run_demo(args.data)
    if args.json:
        print_json(res)
        return 0
    st: kvfs.StoreStatistics = res["statistics"]  # type: ignore[assignment]
    sessions: list[kvfs.SessionInfo] = res["sessions"]  # type: ignore[assignment]
    print(
        f"wrote {res['pages']} pages of {fmt_bytes(res['page_bytes'])} "  # type: ignore[arg-type]
        f"in {res['write_seconds']:.2f} s, read all back verified in "
        f"{res['read_seconds']:.2f} s\n"
    )
    print_table(
        ["session", "model", "pages", "bytes", "local", "pinned"],
        [
            (
                s.session,
                s.model or "-",
                s.pages,
                fmt_bytes(s.bytes),
                fmt_bytes(s.local_bytes),
                "yes" if s.pinned else "no",
            )
            for s in sessions
        ],
    )
    saved = st.logical_bytes - st.local_bytes
    print()
    print_table(
        ["statistic", "value"],
        [
            ("pages", st.pages),
            ("distinct pages stored", st.local_blobs),
            ("logical bytes", fmt_bytes(st.logical_bytes)),
            ("bytes stored", fmt_bytes(st.local_bytes)),
            ("saved by dedup", f"{fmt_bytes(saved)} (the shared system prompt)"),
            ("on disk (with headers)", fmt_bytes(st.used_bytes)),
            ("puts / deduplicated", f"{st.puts} / {st.dedup_puts}"),
            ("gets / checksum failures", f"{st.gets} / {st.corrupt_reads}"),
        ],
        align="ll",
    )
    return 0
