"""Version glue for transformers' cache objects (the only place that knows their insides).

transformers 5 keeps a ``DynamicCache`` as a list of ``layers`` with ``keys``/``values``
tensors of shape ``[batch, kv_heads, tokens, head_dim]``; 4.x kept ``key_cache`` and
``value_cache`` lists; older code passes tuples of ``(key, value)`` pairs. Reading accepts
all three. Building prefers handing the loaded tensors to the layers as they are (no copy:
a prefix of 4k tokens of a 70B-class model is gigabytes) and falls back to the public
``update`` (one copy) when the layer type is not the plain dynamic one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

__all__ = ["build_cache", "cache_tensors"]


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a transformers cache or a legacy tuple cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                raise ValueError(
                    f"layer {i} of the cache holds no KV tensors ({type(layer).__name__})"
                )
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"layer {i} is a sliding-window layer: it does not hold the "
                    f"whole prefix, and kvfs stores whole prefixes only"
                )
            out.append((k, v))
        return out
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, (tuple, list)):
        return [(kv[0], kv[1]) for kv in cache]
    raise TypeError(f"not a transformers KV cache: {type(cache).__name__}")


def build_cache(config: Any, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` for ``config`` holding ``kvs`` (empty list: an empty cache).

    Raises ValueError if the model has sliding-window layers (kvfs stores whole prefixes).
    """
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # transformers 4.x: no config argument
        cache = DynamicCache()
    layers = getattr(cache, "layers", None)
    if layers:
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError(
                "this model has sliding-window attention layers; kvfs stores "
                "whole prefixes of full-attention layers only"
            )
        if kvs and len(layers) != len(kvs):
            raise ValueError(f"{len(kvs)} layers of KV for a model of {len(layers)} layers")
    for i, (k, v) in enumerate(kvs):
        layer = layers[i] if layers else None
        if (
            layer is not None
            and type(layer).__name__ == "DynamicLayer"
            and hasattr(layer, "lazy_initialization")
        ):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
    return cache
