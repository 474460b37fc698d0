"""Where a page's bytes are: a :class:`PageSource`, held in place while it is read.

Two ways to get one, following the 3FS split (metadata through the store or the mount,
data straight from the backing files):

* :func:`source_from_engine`: by key, through the object API. An Engine lease is taken
  before the extents are looked up, so the backing files cannot be evicted or unlinked
  (delete included) until :meth:`PageSource.release` is called.
* :func:`source_from_mount`: by path on a kvfs FUSE mount. The file is opened (an open read
  handle on the mount holds a lease in the daemon) and the extents, size and checksum come
  from its ``user.kvfs.*`` extended attributes. The file stays open until release.

Neither reads any page data.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfs import CorruptPage, KvfsError, PageKey

__all__ = [
    "NotAKvfsPage",
    "PageSource",
    "Piece",
    "plan_pieces",
    "source_from_engine",
    "source_from_mount",
]

#: Largest single read the fast path issues (per file, per request).
DEFAULT_PIECE = 4 << 20
ALIGN = 4096

XATTR_CHECKSUM = "user.kvfs.checksum"
XATTR_SIZE = "user.kvfs.size"
XATTR_EXTENTS = "user.kvfs.extents"


class NotAKvfsPage(KvfsError, OSError):  # type: ignore[misc]
    """A path given to the by-path fast path has no kvfs extents attribute (not a kvfs
    mount, or a directory / control file on it)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One read: ``n`` bytes at ``file_off`` of ``files[file]`` into page bytes at ``page_off``."""

    file: int
    file_off: int
    page_off: int
    n: int


@dataclass(eq=False)
class PageSource:
    """A page's size, checksum and backing extents, held in place until :meth:`release`.

    ``files`` are absolute paths; ``extents`` are ``(file index, offset, length)`` in page
    order. ``leaves`` holds the stored per-MiB BLAKE3 leaf digests when known (by key), or
    None (by path: only the root checksum is known, so it is checked once at the end).
    """

    name: str
    size: int
    checksum: bytes
    leaves: bytes | None
    files: tuple[str, ...]
    extents: tuple[tuple[int, int, int], ...]
    _release: Callable[[bool], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def release(self, ok: bool = True) -> None:
        """End the lease / close the mount file. Idempotent; never raises for a second call.
        ``ok`` says whether the read succeeded (a successful by-key read updates atimes)."""
        with self._lock:
            fn, self._release = self._release, None
        if fn is not None:
            fn(ok)


def plan_pieces(src: PageSource, max_piece: int = DEFAULT_PIECE) -> list[Piece]:
    """Split a page's extents into reads of at most ``max_piece`` bytes, in page order.

    Consecutive pieces of a striped page alternate devices, so issuing them in this order
    keeps every device busy. Raises CorruptPage if the extents do not add up to the size.
    """
    if max_piece <= 0 or max_piece % ALIGN:
        raise ValueError(f"max_piece must be a positive multiple of {ALIGN}")
    out: list[Piece] = []
    pos = 0
    for fi, foff, length in src.extents:
        done = 0
        while done < length:
            take = min(length - done, max_piece)
            out.append(Piece(fi, foff + done, pos + done, take))
            done += take
        pos += length
    if pos != src.size:
        raise CorruptPage(f"page {src.name!r}: extents cover {pos} bytes, the page has {src.size}")
    return out


def _index_files(
    triples: list[tuple[str, int, int]],
) -> tuple[tuple[str, ...], tuple[tuple[int, int, int], ...]]:
    files: dict[str, int] = {}
    ext = []
    for path, off, length in triples:
        ext.append((files.setdefault(path, len(files)), int(off), int(length)))
    return tuple(files), tuple(ext)


def source_from_engine(engine: Any, key: PageKey | str) -> PageSource:
    """Lease a page of ``engine`` (a :class:`kvfs.Engine`) and describe its backing files.

    A page held only in the archive tier is restored to the local tier first (as
    ``Engine.get`` does). Raises PageNotFound, StoreClosed, ArchiveUnavailable. The lease
    is held until the returned source is released; on an error nothing is held.
    """
    cm = engine.lease(key)
    page, blob = cm.__enter__()
    try:
        if not blob.local:
            blob = engine._restore(blob, page)
        assert blob.extents is not None
        files, extents = _index_files(
            [(engine.tier.abspath(d, rel), off, length) for d, rel, off, length in blob.extents]
        )
    except BaseException:
        cm.__exit__(*sys.exc_info())
        raise

    def release(ok: bool) -> None:
        try:
            if ok:
                engine.touch(page)
        finally:
            cm.__exit__(None, None, None)

    return PageSource(
        name=page.path,
        size=blob.size,
        checksum=blob.hash,
        leaves=blob.leaves,
        files=files,
        extents=extents,
        _release=release,
    )


def source_from_mount(path: str | os.PathLike[str]) -> PageSource:
    """Open a page file on a kvfs mount and read its extents from its xattrs.

    The open handle keeps the page leased (the daemon does not evict or unlink data while a
    handle is open) until the source is released. Raises FileNotFoundError,
    NotAKvfsPage (no ``user.kvfs.extents``), CorruptPage (attributes that contradict each
    other).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            raw = os.getxattr(fd, XATTR_EXTENTS)
            size = int(os.getxattr(fd, XATTR_SIZE))
            checksum = bytes.fromhex(os.getxattr(fd, XATTR_CHECKSUM).decode())
        except OSError as e:
            if e.errno in (61, 95):  # ENODATA, ENOTSUP
                raise NotAKvfsPage(
                    f"{os.fspath(path)!r} has no kvfs extents attribute: not a page on a kvfs mount"
                ) from e
            raise
        triples = json.loads(raw)
        if not isinstance(triples, list) or not all(
            isinstance(t, list) and len(t) == 3 for t in triples
        ):
            raise CorruptPage(f"{os.fspath(path)!r}: malformed {XATTR_EXTENTS}")
        files, extents = _index_files([(str(p), int(o), int(n)) for p, o, n in triples])
    except BaseException:
        os.close(fd)
        raise

    def release(ok: bool) -> None:
        os.close(fd)

    return PageSource(
        name=os.fspath(path),
        size=size,
        checksum=checksum,
        leaves=None,
        files=files,
        extents=extents,
        _release=release,
    )
