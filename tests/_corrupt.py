"""Corrupting stored pages on purpose, for the tests that prove corruption is caught."""

from __future__ import annotations

import kvfs


def flip_stored_byte(info: kvfs.PageInfo, page_off: int, mask: int = 0xFF) -> None:
    """XOR ``mask`` into the stored byte at ``page_off`` of a page, in its backing file (found
    through the page's extents)."""
    pos = 0
    for e in info.extents:
        if pos <= page_off < pos + e.length:
            with open(e.path, "r+b") as f:
                f.seek(e.offset + page_off - pos)
                b = f.read(1)
                f.seek(e.offset + page_off - pos)
                f.write(bytes([b[0] ^ mask]))
            return
        pos += e.length
    raise AssertionError(f"offset {page_off} is not in the page")
