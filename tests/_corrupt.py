"""Corrupting stored pages on purpose, for the tests that prove corruption is caught, and
what ``fsck`` reports of a store with nothing wrong."""

from __future__ import annotations

import os

import kvfs

#: ``fsck()`` of a store with nothing wrong, no repair asked for and no archive check: every
#: finding of the local check empty. Compared whole, so that a finding added without a
#: test shows up as a key no test expected.
CLEAN_FSCK = {
    "missing": [],
    "corrupt": [],
    "unreadable": [],
    "orphans": [],
    "missing_blob_rows": [],
    "bad_blob_rows": [],
    "wrong_refs": [],
    "wrong_page_size": [],
    "damaged_pages": [],
    "repaired": [],
}


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0xFF) -> None:
    """XOR ``mask`` into the byte at ``offset`` of the file at ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def flip_stored_byte(info: kvfs.PageInfo, page_off: int, mask: int = 0xFF) -> None:
    """XOR ``mask`` into the stored byte at ``page_off`` of a page, in its backing file (found
    through the page's extents)."""
    pos = 0
    for e in info.extents:
        if pos <= page_off < pos + e.length:
            flip_byte(e.path, e.offset + page_off - pos, mask)
            return
        pos += e.length
    raise AssertionError(f"offset {page_off} is not in the page")


def flip_mounted_byte(extents_xattr: bytes, page_off: int, mask: int = 0xFF) -> None:
    """As :func:`flip_stored_byte`, for a page known by its ``user.kvfs.extents`` value on
    a mount (``page_off`` within its first extent)."""
    from gds import decode_extents

    files, extents = decode_extents(extents_xattr)
    f, off, n = extents[0]
    assert page_off < n, f"offset {page_off} is not in the first extent"
    flip_byte(files[f], off + page_off, mask)
