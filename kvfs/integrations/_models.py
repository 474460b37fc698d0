"""Randomly initialised Llama-shaped models: real transformers, no weights to download.

Used by the tests, ``kvfs bench ttft`` and the demo. The weights are random but the
computation is the real one (attention, RoPE, GQA, MLP), so prefill costs what a model of
this shape costs and decoding from a cache exercises every path a trained model would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._hfcompat import cache_of, forward

__all__ = ["BENCH_MODEL", "ModelShape", "greedy_decode", "random_llama"]


@dataclass(frozen=True)
class ModelShape:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    vocab: int = 1000
    dtype: str = "float32"
    seed: int = 0

    @property
    def model_id(self) -> str:
        """A name that identifies the weights: every field of the shape (two shapes that
        differed only in their MLP width shared an id, and one reused the other's KV) and
        the seed that drew them."""
        return (
            f"random-llama-L{self.layers}-H{self.hidden}-h{self.heads}-kv{self.kv_heads}"
            f"-d{self.head_dim}-I{self.intermediate}-V{self.vocab}-{self.dtype}-seed{self.seed}"
        )


#: The field notes' reference: 8 layers, hidden 1024, 8 KV heads of 128, fp32 = 64 KiB/token.
BENCH_MODEL = ModelShape(
    layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2816, vocab=32000
)


def random_llama(shape: ModelShape, max_positions: int = 32768) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` with weights drawn from ``shape.seed`` (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(cfg)
    return model.to(getattr(torch, shape.dtype)).eval()


@torch.inference_mode()
def greedy_decode(model: Any, first_token: int, cache: Any, steps: int) -> list[int]:
    """Feed ``first_token`` then ``steps - 1`` greedy picks through ``cache``; the tokens."""
    out = [first_token]
    tok = first_token
    for _ in range(steps - 1):
        res = forward(model, torch.tensor([[tok]]), cache)
        cache = cache_of(res)
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
    return out
