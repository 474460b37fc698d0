"""``kvfs size``: how much KV a model makes, and what fits where for how long.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes. With a local
capacity, an archive capacity and an arrival rate of new tokens it prints how many tokens
and sessions each tier holds and how long a page stays local before it spills (the local
tier turns over once every ``local capacity / (rate x bytes per token)`` seconds).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import kvfs

from ._util import fmt_bytes, print_json, print_table

__all__ = ["PRESETS", "Geometry", "geometry_from_hf", "register", "size_report"]


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_bytes: float) -> int:
        return int(2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes)


#: Published geometries (from each model's config.json).
PRESETS: dict[str, Geometry] = {
    g.name.lower(): g
    for g in (
        Geometry("Llama-3.3-70B", 80, 8, 128),
        Geometry("Llama-3.1-8B", 32, 8, 128),
        Geometry("Llama-3.1-405B", 126, 8, 128),
        Geometry("Qwen2.5-1.5B", 28, 2, 128),
        Geometry("Qwen2.5-7B", 28, 4, 128),
        Geometry("Qwen2.5-72B", 80, 8, 128),
        Geometry("Mistral-7B", 32, 8, 128),
    )
}
DTYPES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8": 1,
    "int8": 1,
    "int4": 0.5,
}


def geometry_from_hf(path: str | Path) -> Geometry:
    """A Hugging Face ``config.json`` (its ``text_config`` for multimodal models). Raises
    ValueError when the fields are missing, FileNotFoundError."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a transformer config.json (a JSON object is needed)")
    doc = doc.get("text_config", doc)
    try:
        layers = int(doc["num_hidden_layers"])
        heads = int(doc["num_attention_heads"])
        kv = int(doc.get("num_key_value_heads") or heads)
        head_dim = int(doc.get("head_dim") or int(doc["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a transformer config.json we can read ({e})") from None
    return Geometry(
        str(doc.get("_name_or_path") or Path(path).parent.name or "model"), layers, kv, head_dim
    )


def size_report(
    g: Geometry,
    dtype: str,
    *,
    local: int = 0,
    archive: int = 0,
    rate: float = 0.0,
    session_tokens: int = 0,
) -> dict[str, object]:
    """The figures ``kvfs size`` prints. Raises ValueError for an unknown dtype."""
    if dtype.lower() not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    bpt = g.bytes_per_token(DTYPES[dtype.lower()])
    out: dict[str, object] = {"model": asdict(g), "dtype": dtype, "bytes_per_token": bpt}
    for tier, cap in (("local", local), ("archive", archive)):
        if cap:
            out[f"{tier}_tokens"] = cap // bpt
            if session_tokens:
                out[f"{tier}_sessions"] = cap // (bpt * session_tokens)
    if session_tokens:
        out["bytes_per_session"] = bpt * session_tokens
    if rate and local:
        out["local_residency_s"] = local / (rate * bpt)
    if rate and archive:
        out["archive_residency_s"] = archive / (rate * bpt)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("size", help="KV bytes per token for a model, and what fits for how long")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", metavar="PRESET", help=f"a preset: {', '.join(g.name for g in PRESETS.values())}"
    )
    src.add_argument("--hf-config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument(
        "--dtype", default="bf16", help="KV dtype: fp32, fp16, bf16, fp8, int4 (default bf16)"
    )
    p.add_argument("--local", metavar="SIZE", help="local capacity, e.g. 4TiB")
    p.add_argument("--archive", metavar="SIZE", help="archive capacity, e.g. 100TB")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        metavar="TOKENS/S",
        help="arrival rate of new tokens (all engines together)",
    )
    p.add_argument(
        "--session-tokens",
        type=int,
        default=0,
        metavar="N",
        help="tokens per session (context length)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_size)


def _duration(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}"
    return f"{s:.1f} s"


def cmd_size(args: argparse.Namespace) -> int:
    if args.model:
        g = PRESETS.get(args.model.lower())
        if g is None:
            raise ValueError(
                f"unknown model {args.model!r} (presets: "
                f"{', '.join(x.name for x in PRESETS.values())}; or --hf-config)"
            )
    else:
        g = geometry_from_hf(args.hf_config)
    if args.rate < 0 or args.session_tokens < 0:
        raise ValueError("--rate and --session-tokens must be >= 0")
    r = size_report(
        g,
        args.dtype,
        local=kvfs.parse_size(args.local) if args.local else 0,
        archive=kvfs.parse_size(args.archive) if args.archive else 0,
        rate=args.rate,
        session_tokens=args.session_tokens,
    )
    if args.json:
        print_json(r)
        return 0
    rows: list[list[object]] = [
        ["model", f"{g.name} ({g.layers} layers, {g.kv_heads} KV heads, head dim {g.head_dim})"],
        [
            "KV per token",
            f"{fmt_bytes(int(r['bytes_per_token']))} ({r['bytes_per_token']} B, "  # type: ignore[call-overload]
            f"{args.dtype})",
        ],
    ]
    if "bytes_per_session" in r:
        rows.append(["KV per session", fmt_bytes(int(r["bytes_per_session"]))])  # type: ignore[call-overload]
    for tier in ("local", "archive"):
        if f"{tier}_tokens" in r:
            rows.append(
                [
                    f"{tier} holds",
                    f"{r[f'{tier}_tokens']:,} tokens"
                    + (f", {r[f'{tier}_sessions']:,} sessions" if f"{tier}_sessions" in r else ""),
                ]
            )
        if f"{tier}_residency_s" in r:
            verb = "stays local" if tier == "local" else "stays archived"
            rows.append(
                [
                    f"a page {verb}",
                    _duration(float(r[f"{tier}_residency_s"]))  # type: ignore[arg-type]
                    + " before it is displaced",
                ]
            )
    print_table(["FIGURE", "VALUE"], rows, align="ll")
    return 0
