"""The value of ``user.kvfs.extents``: where a page's bytes are, in a size that never grows
with the page.

A page's extents as a list (one ``[file, offset, length]`` per stripe chunk) outgrow the
64 KiB Linux allows an extended attribute as soon as a page has a few hundred chunks (a
multi-GiB page, a small stripe unit), and then a process holding only a mount path could not
take the fast path. Every blob the local tier writes is laid out by one rule, so the value
says the rule's parameters instead (docs/mount.md, "Extended attributes")::

    {"v": 2, "files": [F0, F1, ...], "unit": U, "header": H, "size": S}

Chunk ``c`` (``0 <= c < max(1, ceil(S / U))``) is ``min(U, S - c*U)`` bytes at offset
``H + (c // n) * U`` of ``files[c % n]``, ``n = len(files)``: the files are listed in chunk
order (the first ``n`` chunks' files), so neither the device count nor the first device is
needed. Its size grows with the number of devices only. Extents that do not follow the rule
(none are written today) are given as the explicit list, as long as that fits.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator, Sequence

from ._fuse_guard import fuse_error
from ._types import Extent
from ._writes import XATTR_SIZE_MAX

__all__ = ["XATTR_SIZE_MAX", "extents_xattr", "layout"]


def layout(nfiles: int, unit: int, header: int, size: int) -> Iterator[tuple[int, int, int]]:
    """``(file index, offset, length)`` of each run of a page laid out by the striping rule,
    contiguous chunks of one file merged (as the index stores them), in page order."""
    run: tuple[int, int, int] | None = None
    for c in range(max(1, -(-size // unit))):
        f, off, n = c % nfiles, header + (c // nfiles) * unit, min(unit, size - c * unit)
        if run is not None and run[0] == f and run[1] + run[2] == off:
            run = (f, run[1], run[2] + n)
            continue
        if run is not None:
            yield run
        run = (f, off, n)
    assert run is not None
    yield run


def _compact(extents: Sequence[Extent], size: int, unit: int) -> bytes | None:
    """The rule's parameters if ``extents`` are exactly what the rule gives, else None."""
    files: list[str] = []
    seen: set[str] = set()
    for e in extents:
        if e.path in seen:
            break
        files.append(e.path)
        seen.add(e.path)
    # With two or more runs the first is one whole chunk (runs of one file merge only when
    # there is one file, and then there is one run): it says the unit the blob was cut in.
    if len(extents) > 1:
        unit = extents[0].length
    if unit <= 0:
        return None
    header = extents[0].offset
    want = layout(len(files), unit, header, size)
    for e in extents:
        f, off, n = next(want, (-1, -1, -1))
        if f < 0 or files[f] != e.path or off != e.offset or n != e.length:
            return None
    if next(want, None) is not None:
        return None
    v = {"v": 2, "files": files, "unit": unit, "header": header, "size": size}
    return json.dumps(v, separators=(",", ":")).encode()


def extents_xattr(extents: Sequence[Extent], size: int, unit: int) -> bytes:
    """The ``user.kvfs.extents`` value of a page of ``size`` bytes held in ``extents``
    (absolute paths, page order; empty when the page is not held locally: ``[]``).

    ``unit`` is the store's stripe unit, used where the extents cannot tell it (a page in
    one run). Raises FUSEError(E2BIG) when the extents follow no rule and their explicit
    list is over 64 KiB (the errno Linux gives for an attribute too large to return).
    CPU work proportional to the number of chunks: call it off the trio loop.
    """
    if extents:
        compact = _compact(extents, size, unit)
        if compact is not None:
            return compact
    raw = json.dumps([[e.path, e.offset, e.length] for e in extents]).encode()
    if len(raw) > XATTR_SIZE_MAX:
        raise fuse_error(errno.E2BIG)
    return raw
