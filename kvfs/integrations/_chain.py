"""Prefix names: a hash chain over fixed-size token chunks, the same in every process.

Chunk ``i`` of a token sequence is named by ``h_i = BLAKE3(h_{i-1} || tokens of chunk i)``,
with ``h_{-1}`` a seed derived from the model geometry (:class:`Geometry`, model id
included). Token ids are hashed as little-endian 64-bit integers. Nothing depends on
Python's ``hash()`` (randomised per process) or on the platform: two processes on two hosts
that see the same model and the same tokens compute the same names, so they find each
other's pages; two models of different geometry or identity never collide.

A chunk's name covers the whole prefix up to its end, so the KV stored under it is valid
exactly for that prefix (KV of a token depends on every token before it).
"""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Sequence

import blake3

from ._format import FORMAT, Geometry

__all__ = ["chunk_names", "geometry_seed", "is_chunk_name"]

NAME_HEX = 32  # 128 bits of the digest: collisions are not a practical concern
_NAME_RE = re.compile(rf"c\d{{5,}}-[0-9a-f]{{{NAME_HEX}}}")


def geometry_seed(g: Geometry) -> bytes:
    """The chain's seed: a digest of the format and the geometry (model id included)."""
    text = "\n".join(f"{k}={v}" for k, v in sorted(g.to_attrs().items()))
    return blake3.blake3(f"{FORMAT}\n{text}".encode()).digest()


def chunk_names(tokens: Sequence[int], g: Geometry, max_chunks: int | None = None) -> list[str]:
    """Names of the full chunks of ``tokens`` (a trailing partial chunk has no name).

    A name is ``c<index>-<hex>``: the index makes listings readable, the hex is the chained
    digest. ``tokens`` is any sequence of integers (a list, a numpy array or a torch tensor
    of an integer dtype). Raises ValueError on a token id outside 0..2**63-1 or one that
    is no integer (``1.5`` was named as ``1``: two prefixes, one name).
    """
    c = g.chunk_tokens
    n = len(tokens) // c
    if max_chunks is not None:
        n = min(n, max_chunks)
    h = geometry_seed(g)
    out = []
    for i in range(n):
        try:
            chunk = [operator.index(t) for t in tokens[i * c : (i + 1) * c]]
            data = struct.pack(f"<{c}q", *chunk)
        except (TypeError, struct.error) as e:
            raise ValueError(f"token ids must be integers in 0..2**63-1: {e}") from None
        if min(chunk) < 0:
            raise ValueError("token ids must be non-negative")
        h = blake3.blake3(h + data).digest()
        out.append(f"c{i:05d}-{h.hex()[:NAME_HEX]}")
    return out


def is_chunk_name(name: str) -> bool:
    """Whether ``name`` is spelled as :func:`chunk_names` spells a chunk's name."""
    return _NAME_RE.fullmatch(name) is not None
