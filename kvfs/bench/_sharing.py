"""``kvfs bench ttft --sharing``: many sessions that start with one common system prompt.

Each session's prompt is the system prompt followed by its own tokens. Every session is
prefilled twice in the same run: once by the model alone (the baseline: what serving
without a prefix cache costs), and once through :meth:`TransformersKV.prefill`, which
loads whatever kvfs holds for the prefix (its own session first, then the shared
``prefix-cache`` session), computes the rest and saves the result. The first session
finds nothing; the others find the system prompt.

Reported: the hit rate (prompt tokens served from kvfs), the prefill time with and without
kvfs, the bytes kvfs stores vs the bytes the sessions' pages would take without
deduplication, and whether every session's first token matches the baseline's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["print_sharing", "run_sharing"]


def run_sharing(
    scratch: Path,
    *,
    model: str = "field",
    sessions: int = 8,
    system_tokens: int = 1024,
    user_tokens: int = 256,
) -> dict[str, Any]:
    import torch

    import kvfs
    from kvfs.integrations.transformers import TransformersKV

    from ._common import progress
    from .ttft import conditions, load_model

    shape, m = load_model(model)
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, shape.vocab, (system_tokens,), generator=gen).tolist()
    rows: list[dict[str, Any]] = []
    cfg = kvfs.StoreConfig(data_dirs=(scratch / "nvme0",))
    with (
        torch.inference_mode(),
        kvfs.open_store_sync(cfg) as store,
        TransformersKV(store, m, model_id=shape.model_id) as kv,
    ):
        m(input_ids=torch.randint(0, shape.vocab, (1, 128)))  # warm up
        for i in range(sessions):
            progress(f"kvfs bench ttft --sharing: [{i + 1}/{sessions}] session agent-{i:03d}...")
            toks = system + torch.randint(0, shape.vocab, (user_tokens,), generator=gen).tolist()
            t0 = time.perf_counter()
            base = m(input_ids=torch.tensor([toks]), use_cache=True)
            base_s = time.perf_counter() - t0
            base_first = int(base.logits[0, -1].argmax())
            del base
            t0 = time.perf_counter()
            res = kv.prefill(f"agent-{i:03d}", toks, save=False)
            with_s = time.perf_counter() - t0
            first = int(res.logits.argmax())
            saved = kv.save(f"agent-{i:03d}", toks, res.cache)
            rows.append(
                {
                    "session": f"agent-{i:03d}",
                    "prompt_tokens": len(toks),
                    "reused_tokens": res.reused_tokens,
                    "computed_tokens": res.computed_tokens,
                    "prefill_s": base_s,
                    "kvfs_s": with_s,
                    "load_s": res.load_seconds,
                    "save_s": saved.seconds,
                    "same_first_token": first == base_first,
                }
            )
            del res
        st = store.statistics()
        session_bytes = sum(p.size for r in rows for p in store.list(session=r["session"]))
        g = kv.geometry
    prompt = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["reused_tokens"] for r in rows)
    base_total = sum(r["prefill_s"] for r in rows)
    kvfs_total = sum(r["kvfs_s"] for r in rows)
    return {
        "benchmark": "ttft-sharing",
        "conditions": conditions(scratch, g.describe()),
        "sessions": sessions,
        "system_tokens": system_tokens,
        "user_tokens": user_tokens,
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "hit_rate": reused / prompt,
        "prefill_s_without_kvfs": base_total,
        "prefill_s_with_kvfs": kvfs_total,
        "prefill_time_saved": 1 - kvfs_total / base_total,
        "bytes_without_sharing": session_bytes,
        "bytes_stored": st.local_bytes,
        "dedup_ratio": session_bytes / max(1, st.local_bytes),
        "all_first_tokens_match": all(r["same_first_token"] for r in rows),
        "rows": rows,
    }


def print_sharing(res: dict[str, Any]) -> None:
    from cli._util import fmt_bytes, print_table

    c = res["conditions"]
    print(f"model: {c['model']}; machine: {c['cpus']} CPUs, torch {c['torch']}")
    print(
        f"{res['sessions']} sessions = {res['system_tokens']}-token system prompt + "
        f"{res['user_tokens']} tokens each"
    )
    print_table(
        [
            "session",
            "prompt",
            "from kvfs",
            "computed",
            "prefill alone",
            "with kvfs",
            "of which load",
            "same token",
        ],
        [
            [
                r["session"],
                r["prompt_tokens"],
                r["reused_tokens"],
                r["computed_tokens"],
                f"{r['prefill_s']:.3f} s",
                f"{r['kvfs_s']:.3f} s",
                f"{r['load_s']:.3f} s",
                "yes" if r["same_first_token"] else "NO",
            ]
            for r in res["rows"]
        ],
    )
    print()
    print(f"hit rate: {res['hit_rate']:.1%} of prompt tokens served from kvfs")
    print(
        f"prefill: {res['prefill_s_with_kvfs']:.2f} s with kvfs vs "
        f"{res['prefill_s_without_kvfs']:.2f} s without ({res['prefill_time_saved']:.1%} saved)"
    )
    print(
        f"stored: {fmt_bytes(res['bytes_stored'])} vs {fmt_bytes(res['bytes_without_sharing'])}"
        f" without sharing ({res['dedup_ratio']:.1f}x less)"
    )
