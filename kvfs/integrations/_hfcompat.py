"""One call for a forward pass with a KV cache, across transformers releases.

transformers 5.24 renamed the forward argument and the output field ``past_key_values`` to
``cache`` (the old name still works there but warns, and is to be removed in 5.40). The
integrations, the bench and the tests call :func:`forward` so they run on either side of
the rename without a warning.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_of", "forward"]

_NEW = "cache"
_OLD = "past_key_values"
_ARG_NAME: dict[type, str] = {}


def _cache_arg(model: Any) -> str:
    kind = type(model)
    name = _ARG_NAME.get(kind)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _NEW if _NEW in params else _OLD
        _ARG_NAME[kind] = name
    return name


def forward(model: Any, input_ids: Any, cache: Any, **kwargs: Any) -> Any:
    """``model(input_ids=..., <cache arg>=cache, use_cache=True, **kwargs)``."""
    kwargs.setdefault("use_cache", True)
    return model(input_ids=input_ids, **{_cache_arg(model): cache}, **kwargs)


def cache_of(output: Any) -> Any:
    """The KV cache a forward pass returned, under whichever name this release uses."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    return getattr(output, _NEW if _NEW in fields else _OLD)
