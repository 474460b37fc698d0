"""The model scenario of ``kvfs demo``: compute once, spill, reload in a new process.

:func:`model_scenario` runs, against a store described by a :class:`~kvfs.StoreConfig`:

1. a randomly initialised Llama-shaped transformer (no weights to download; CPU torch)
   prefills an agent's context and decodes a few tokens from its in-memory cache;
2. the cache goes to kvfs (session ``agent-demo``), and, if the store has an archive tier,
   the session is spilled to it (local copies dropped);
3. a **new process** opens the same store, loads the longest cached prefix (restoring it
   from the archive on access), computes the last token and decodes as many tokens;
4. the tokens of both processes are compared, and the recompute time is printed beside
   the reload time.

``make demo`` can call :func:`model_scenario` with its store's config, or run
``python -m kvfs.integrations.demo`` (a fresh store and ``file://`` archive in a temporary
directory). ``--child CONFIG_JSON`` is the second process's entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvfs
from kvfs.bench._common import at_least

__all__ = ["model_scenario"]

SESSION = "agent-demo"


def _config_to_json(cfg: kvfs.StoreConfig) -> str:
    d = dataclasses.asdict(cfg)
    d["data_dirs"] = [str(p) for p in cfg.data_dirs]
    d["index_dir"] = str(cfg.index_dir) if cfg.index_dir else None
    return json.dumps(d)


def _config_from_json(text: str) -> kvfs.StoreConfig:
    d = json.loads(text)
    d["data_dirs"] = tuple(Path(p) for p in d["data_dirs"])
    d["index_dir"] = Path(d["index_dir"]) if d["index_dir"] else None
    return kvfs.StoreConfig(**d)


def _setup(small: bool) -> tuple[Any, Any]:
    try:
        from ._models import BENCH_MODEL, ModelShape, random_llama
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "the model demo needs the engines extra: pip install -e .[engines] "
            "(torch==2.13.0 first)"
        ) from e
    shape = (
        ModelShape(
            layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=32000
        )
        if small
        else BENCH_MODEL
    )
    return shape, random_llama(shape)


#: The shortest context with something to reload: one whole 256-token page before the last
#: token (the one the second process computes). A shorter one saved nothing, and the
#: scenario ended in "no session 'agent-demo'" at its spill.
MIN_TOKENS = 257


def _context(shape: Any, tokens: int) -> list[int]:
    import torch

    return torch.randint(
        0, shape.vocab, (tokens,), generator=torch.Generator().manual_seed(42)
    ).tolist()


def model_scenario(
    config: kvfs.StoreConfig,
    *,
    tokens: int = 2048,
    decode: int = 16,
    small: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the scenario (see the module docstring); returns its figures.

    The store must not be open in this process (the second process opens it). Spills only
    if ``config.archive_url`` is set. Raises RuntimeError without the engines extra, or if
    the second process fails or decodes other tokens.
    """
    import torch

    from ._hfcompat import cache_of
    from ._models import greedy_decode
    from .transformers import TransformersKV

    if tokens < MIN_TOKENS:
        raise ValueError(f"a context of {tokens} tokens holds no whole page: at least {MIN_TOKENS}")
    shape, model = _setup(small)
    ids = _context(shape, tokens)
    with (
        kvfs.open_store_sync(config) as store,
        TransformersKV(store, model, model_id=shape.model_id) as kv,
    ):
        g = kv.geometry
        echo(
            f"model: random Llama-shaped transformer, {g.describe()}; "
            f"{g.bytes_per_token // 1024} KiB of KV per token"
        )
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            first = int(out.logits[0, -1].argmax())
            recompute = time.perf_counter() - t0
        echo(f"prefill of the agent's {tokens}-token context: {recompute:.2f} s (recompute)")
        saved = kv.save(SESSION, ids, cache_of(out))
        pages = store.list(session=SESSION)
        echo(
            f"saved to kvfs session {SESSION!r}: {len(pages)} pages, "
            f"{sum(p.size for p in pages) / 2**20:.0f} MiB in {saved.seconds:.2f} s (also "
            f"named under 'prefix-cache' for other sessions; the bytes are stored once)"
        )
        want = greedy_decode(model, first, cache_of(out), decode)
        del out
        spilled = None
        if config.archive_url:
            t0 = time.perf_counter()
            store.spill(SESSION)
            store.spill("prefix-cache")
            spilled = time.perf_counter() - t0
            echo(
                f"session spilled to the archive ({config.archive_url}): {spilled:.2f} s; "
                f"local copies dropped"
            )
    echo("a new process opens the store and continues the session...")
    t0 = time.perf_counter()
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfs.integrations.demo",
            "--child",
            _config_to_json(config),
            "--tokens",
            str(tokens),
            "--decode",
            str(decode),
        ]
        + (["--small"] if small else []),
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the second process failed:\n{child.stderr.strip()}")
    res = json.loads(child.stdout.strip().splitlines()[-1])
    echo(
        f"  reloaded {res['reused_tokens']} tokens of KV from kvfs in {res['load_s']:.2f} s "
        f"(reload{' from the archive' if spilled is not None else ''}), computed "
        f"{res['computed_tokens']} token(s) in {res['compute_s']:.2f} s "
        f"(process start and model set-up: {time.perf_counter() - t0 - res['ttft_s']:.1f} s)"
    )
    same = res["tokens"] == want
    echo(
        f"recompute {recompute:.2f} s vs reload {res['ttft_s']:.2f} s to the first token: "
        f"{recompute / res['ttft_s']:.1f}x"
    )
    echo(
        f"{decode} tokens decoded in the new process are "
        f"{'identical to' if same else 'DIFFERENT from'} those of the original cache"
    )
    if not same:
        raise RuntimeError("the restored cache decoded other tokens than the original")
    return {
        "tokens": tokens,
        "recompute_s": recompute,
        "reload_s": res["ttft_s"],
        "load_s": res["load_s"],
        "spill_s": spilled,
        "same_tokens": same,
        "kv_bytes": tokens * g.bytes_per_token,
        "model": g.describe(),
    }


def _child(config_json: str, tokens: int, decode: int, small: bool) -> dict[str, Any]:
    """The second process: load the prefix, compute the last token, decode."""
    from ._models import greedy_decode
    from .transformers import TransformersKV

    if tokens < MIN_TOKENS:
        raise ValueError(f"a context of {tokens} tokens holds no whole page: at least {MIN_TOKENS}")
    shape, model = _setup(small)
    ids = _context(shape, tokens)
    with (
        kvfs.open_store_sync(_config_from_json(config_json)) as store,
        TransformersKV(store, model, model_id=shape.model_id) as kv,
    ):
        t0 = time.perf_counter()
        res = kv.prefill(SESSION, ids, save=False)
        ttft = time.perf_counter() - t0
        got = greedy_decode(model, int(res.logits.argmax()), res.cache, decode)
    return {
        "reused_tokens": res.reused_tokens,
        "computed_tokens": res.computed_tokens,
        "load_s": res.load_seconds,
        "compute_s": res.compute_seconds,
        "ttft_s": ttft,
        "tokens": got,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfs.integrations.demo [--data DIR]``: the scenario on a fresh store with a
    ``file://`` archive beside it (in DIR, default a temporary directory removed after)."""
    ap = argparse.ArgumentParser(
        prog="python -m kvfs.integrations.demo",  # (argparse would say demo.py)
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--data",
        type=Path,
        default=None,
        help="directory for the store and its archive (must not hold a store)",
    )
    ap.add_argument(
        "--tokens",
        type=at_least(MIN_TOKENS),
        default=2048,
        help=f"context length, at least {MIN_TOKENS} (default 2048)",
    )
    ap.add_argument("--decode", type=at_least(1), default=16, help="tokens to decode (default 16)")
    ap.add_argument("--small", action="store_true", help="a 4-layer model, for a quick look")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the second process (StoreConfig JSON)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.tokens, a.decode, a.small)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvfs-model-demo-") as tmp:
        root = a.data or Path(tmp)
        cfg = kvfs.StoreConfig(
            data_dirs=(root / "nvme0", root / "nvme1"),
            archive_url=f"file://{(root / 'archive').absolute()}",
            extra={"archive": {"interval": 0}},
        )
        model_scenario(cfg, tokens=a.tokens, decode=a.decode, small=a.small)
    if a.data is not None:
        print(f"the store stays in {a.data}: {' '.join(map(shlex.quote, look_command(cfg)))}")
    return 0


def look_command(cfg: kvfs.StoreConfig) -> list[str]:
    """The ``kvfs ls`` that shows the demo's store (its devices and archive, not DIR)."""
    return [
        "kvfs",
        "ls",
        "--data",
        ",".join(str(d) for d in cfg.data_dirs),
        "--archive",
        str(cfg.archive_url),
    ]


if __name__ == "__main__":
    sys.exit(main())
