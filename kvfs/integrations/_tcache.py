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


#: The cache layers whose ``keys``/``values`` are the whole prefix's KV, token by token.
#: Any other kind is refused by name: a quantized layer's ``keys`` hold only its residual
#: (the latest tokens, unquantized), a sliding-window layer's only the window, a linear-
#: attention layer's a recurrent state. Saved, such tensors were the KV of other tokens
#: than the prefix names said, and other sessions loaded them.
WHOLE_KV_LAYERS = ("DynamicLayer", "StaticLayer")


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a transformers cache or a legacy tuple cache.

    Raises ValueError for a cache whose tensors are not the whole prefix's plain KV
    (quantized, sliding-window, linear-attention layers), TypeError for what is no cache.
    """
    if any("Quantized" in c.__name__ for c in type(cache).__mro__):
        raise ValueError(
            f"a {type(cache).__name__} holds most of its KV quantized and only the latest "
            f"tokens as tensors; kvfs stores the plain KV of a whole prefix (DynamicCache, "
            f"StaticCache)"
        )
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for i, layer in enumerate(layers):
            kind = type(layer).__name__
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"layer {i} is a sliding-window layer: it does not hold the "
                    f"whole prefix, and kvfs stores whole prefixes only"
                )
            if kind not in WHOLE_KV_LAYERS:
                raise ValueError(
                    f"layer {i} of the cache is of type {kind}, whose tensors are not the whole "
                    f"prefix's KV; kvfs stores {' and '.join(WHOLE_KV_LAYERS)} layers only"
                )
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                raise ValueError(f"layer {i} of the cache holds no KV tensors ({kind})")
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
