"""Page checksums: a two-level BLAKE3 tree over fixed 1 MiB leaves.

``leaf_i = blake3(page[i MiB : (i+1) MiB])`` and
``checksum = blake3(b"kvfs-tree-v1" || le64(size) || leaf_0 || leaf_1 || ...)``.

Why a tree: leaves hash in parallel threads (BLAKE3 releases the GIL), a ranged read (the
FUSE mount reads 128 KiB-1 MiB at a time) verifies only the leaves it touches, and the leaf
size is fixed, independent of the stripe unit, so the same bytes have the same checksum on
every host and every configuration: the checksum is also the dedup identity.
"""

from __future__ import annotations

import blake3

__all__ = ["DIGEST", "LEAF", "leaf_hash", "leaf_hasher", "leaves_of", "tree_hash", "verify_leaves"]

LEAF = 1 << 20
DIGEST = 32
_DOMAIN = b"kvfs-tree-v1"


def leaf_hash(data: memoryview | bytes) -> bytes:
    return blake3.blake3(data).digest()


def leaf_hasher() -> blake3.blake3:
    """An incremental leaf hash: ``update`` with a leaf's bytes in order, then ``digest``
    (equal to :func:`leaf_hash` of the whole leaf). Lets a reader verify a leaf as it lands."""
    return blake3.blake3()


def tree_hash(size: int, leaves: bytes) -> bytes:
    """Root checksum from the concatenated leaf digests."""
    if len(leaves) != n_leaves(size) * DIGEST:
        raise ValueError("leaf digests do not match the page size")
    return blake3.blake3(_DOMAIN + size.to_bytes(8, "little") + leaves).digest()


def n_leaves(size: int) -> int:
    return max(1, -(-size // LEAF))


def leaves_of(data: memoryview | bytes) -> bytes:
    """All leaf digests of a buffer, computed in this thread."""
    mv = memoryview(data).cast("B")
    if len(mv) == 0:
        return leaf_hash(b"")
    return b"".join(leaf_hash(mv[o : o + LEAF]) for o in range(0, len(mv), LEAF))


def checksum(data: memoryview | bytes) -> bytes:
    mv = memoryview(data).cast("B")
    return tree_hash(len(mv), leaves_of(mv))


def verify_leaves(data: memoryview, page_offset: int, leaves: bytes) -> int | None:
    """Check ``data`` (starting at a leaf boundary ``page_offset``) against stored leaves.

    Returns the index of the first bad leaf, or None when all match.
    """
    assert page_offset % LEAF == 0
    first = page_offset // LEAF
    for i, o in enumerate(range(0, len(data), LEAF)):
        want = leaves[(first + i) * DIGEST : (first + i + 1) * DIGEST]
        if leaf_hash(data[o : o + LEAF]) != want:
            return first + i
    return None
