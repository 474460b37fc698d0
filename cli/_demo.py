"""``kvfs demo``: kvfs doing its main job, on the embedded defaults.

The default scenario (needs the ``engines`` extra, which ``make demo`` installs): a randomly
initialised Llama-shaped transformer prefills an agent's context, the KV cache goes to kvfs,
the session is spilled to the ``file://`` archive, a new process restores it and continues
decoding from it (recompute time printed beside reload time); then the store is mounted and
``ls`` on the mount, ``kvfs ls`` and ``kvfs stats`` show what happened.

``kvfs demo --objects`` is the object API alone, in a few seconds:

Writes a small KV cache the way an inference engine would: several sessions (conversations),
each with a few prefix chunks of a few layers, every page a numpy array of K and V. The first
prefix chunk of every session is the same system prompt, so its pages are stored once
(deduplicated). Everything is read back and compared byte for byte (into page-aligned numpy
buffers, so the reads use O_DIRECT), then the sessions and the store's statistics are shown.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

import kvfs
from kvfs.bench._common import at_least
from kvfs.integrations.demo import MIN_TOKENS

from ._util import EXIT, fmt_bytes, print_json, print_table

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
        help="kvfs at work: a model's KV cache saved, spilled, reloaded in a new process",
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
    p.add_argument(
        "--objects", action="store_true", help="only the object API part (no model, no mount)"
    )
    p.add_argument(
        "--tokens",
        type=at_least(MIN_TOKENS),
        default=2048,
        help=f"agent context length, at least {MIN_TOKENS} (default 2048)",
    )
    p.add_argument("--small", action="store_true", help="a 4-layer model, for a quick look")
    p.add_argument("--no-mount", action="store_true", help="skip the mount step")
    p.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    return _main(args) if args.objects else _model_main(args)


def _model_main(args: argparse.Namespace) -> int:
    """The full scenario: model -> kvfs -> archive -> new process; then mount, ls, stats."""
    import shutil
    import subprocess

    from cli.__main__ import main as kvfs_main

    try:
        import torch  # noqa: F401

        from kvfs.integrations.demo import model_scenario
    except ImportError as e:
        raise RuntimeError(
            f"the model demo needs the engines extra ({e}); run `make demo`, "
            "or `kvfs demo --objects` for the object API alone"
        ) from None
    root = args.data.absolute()
    store, archive, mnt = root / "store", root / "archive", root / "mnt"
    if os.path.ismount(mnt):  # left by an earlier run
        kvfs_main(["umount", "--force", str(mnt)])
    for d in (store, archive):  # the scenario starts from an empty store every run
        shutil.rmtree(d, ignore_errors=True)
    dirs = (store / "nvme0", store / "nvme1")
    url = f"file://{archive}"
    cfg = kvfs.StoreConfig(data_dirs=dirs, archive_url=url, extra={"archive": {"interval": 0}})
    sel = ["--data", ",".join(map(str, dirs)), "--archive", url]
    print(f"== kvfs demo: store in {store}, archive {url} ==\n", flush=True)
    res = model_scenario(
        cfg, tokens=args.tokens, small=args.small, echo=lambda m: print(m, flush=True)
    )
    mounted = False
    prefixes: list[str] = []
    # The commands below, as printed, work when pasted into a shell after this line (the
    # demo runs them with the same settings as flags).
    print(
        f"\n$ export KVFS_DATA_DIRS={','.join(map(str, dirs))} KVFS_ARCHIVE_URL={url}",
        flush=True,
    )
    if not args.no_mount:
        mnt.mkdir(parents=True, exist_ok=True)
        print(f"$ kvfs mount {mnt}", flush=True)
        mounted = kvfs_main(["mount", *sel, str(mnt)]) == 0
    try:
        if mounted:
            sess = mnt / "sessions" / "agent-demo"
            prefixes = sorted(n for n in os.listdir(sess) if not n.startswith("."))
            print(f"$ ls {sess}   # one directory per 256-token prefix chunk", flush=True)
            print("  " + "  ".join(prefixes[:4]) + ("  ..." if len(prefixes) > 4 else ""))
            layers = sorted(os.listdir(sess / prefixes[0]))
            print(f"$ ls {sess / prefixes[0]}   # one file per layer", flush=True)
            print("  " + "  ".join(layers[:6]) + ("  ..." if len(layers) > 6 else ""), flush=True)
            subprocess.run(["du", "-sh", "--apparent-size", str(sess)], check=False)
            first = sess / prefixes[0]
            t0 = time.perf_counter()
            n = sum(len((first / name).read_bytes()) for name in layers)
            print(
                f"read {fmt_bytes(n)} of one prefix chunk through the mount (any engine can) "
                f"in {time.perf_counter() - t0:.2f} s, checksums verified",
                flush=True,
            )
        chunk = f"sessions/agent-demo/{prefixes[0]}" if mounted else "agent-demo"
        for cmd in (["ls"], ["ls", chunk], ["stats"]):
            print(f"\n$ kvfs {' '.join(cmd)}", flush=True)
            kvfs_main([*cmd, *sel])
    finally:
        if mounted:
            print(f"\n$ kvfs umount {mnt}", flush=True)
            if kvfs_main(["umount", str(mnt)]) == EXIT["refused"]:  # in use: by whom, said
                time.sleep(1)
                kvfs_main(["umount", "--force", str(mnt)])  # the demo's own mount: never left
    print(
        f"\nrecompute {res['recompute_s']:.2f} s vs reload from the archive "
        f"{res['reload_s']:.2f} s to the first token; decoded tokens identical: "
        f"{res['same_tokens']}"
    )
    return 0


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
        ["SESSION", "MODEL", "PAGES", "SIZE", "LOCAL", "PINNED"],  # (as kvfs ls names them)
        [
            (
                s.session,
                s.model or "-",
                s.pages,
                fmt_bytes(s.bytes),
                fmt_bytes(s.local_bytes),
                "yes" if s.pinned else "",
            )
            for s in sessions
        ],
    )
    saved = st.logical_bytes - st.local_bytes
    print()
    print_table(
        ["STATISTIC", "VALUE"],
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
