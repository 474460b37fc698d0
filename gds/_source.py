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

import errno
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfs import CorruptPage, KvfsError, PageKey
from kvfs._mountinfo import kvfs_mount_of_fd

__all__ = [
    "NotAKvfsPage",
    "PageSource",
    "Piece",
    "decode_extents",
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
    ``held`` is set instead of files for a page whose bytes are in memory.
    """

    name: str
    size: int
    checksum: bytes
    leaves: bytes | None
    files: tuple[str, ...]
    extents: tuple[tuple[int, int, int], ...]
    #: the page's bytes, already verified, when no backing file can be read: an archive-only
    #: page with no local room (the archive's memory copy), or a page file on the mount
    #: that can only be read through the mount. ``files`` and ``extents`` are then empty.
    held: bytes | None = field(default=None, repr=False)
    #: by key: the index row of the data this source describes (what a heal replaces)
    blob: Any = field(default=None, repr=False)
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


def _path(v: Any) -> str:
    """A data file's path as the attribute gives it: absolute (a relative one would be
    opened from wherever the reader runs)."""
    if not isinstance(v, str) or not os.path.isabs(v):
        raise ValueError(f"{v!r} is not an absolute path")
    return v


def _int(v: Any, least: int) -> int:
    if type(v) is not int or v < least:
        raise ValueError(f"{v!r} is not an integer >= {least}")
    return v


def decode_extents(
    raw: bytes | str, name: str = "page"
) -> tuple[tuple[str, ...], tuple[tuple[int, int, int], ...]]:
    """Turn a ``user.kvfs.extents`` value into ``(files, extents)`` as :class:`PageSource`
    holds them: absolute paths, and ``(file index, offset, length)`` in page order.

    Two forms (docs/mount.md): the explicit JSON list ``[[file, offset, length], ...]``, and
    the striping rule ``{"v": 2, "files": [...], "unit": U, "header": H, "size": S}``, in
    which chunk ``c`` is ``min(U, S - c*U)`` bytes at ``H + (c // n) * U`` of
    ``files[c % n]`` (``n = len(files)``), ``U`` a multiple of 4096; runs of one file that
    touch are merged. Raises CorruptPage for anything else (``name`` says which page in the
    message).
    """
    try:
        v = json.loads(raw)
        if isinstance(v, list):
            if not all(isinstance(t, list) and len(t) == 3 for t in v):
                raise ValueError("an entry is not [file, offset, length]")
            return _index_files([(_path(p), _int(o, 0), _int(n, 0)) for p, o, n in v])
        if not isinstance(v, dict) or v.get("v") != 2:
            raise ValueError("neither a list nor a version 2 object")
        files = v["files"]
        if not files or not isinstance(files, list):
            raise ValueError("files is not a list of paths")
        files = [_path(f) for f in files]
        unit, header, size = _int(v["unit"], 1), _int(v["header"], 0), _int(v["size"], 0)
        if unit % ALIGN:  # the daemon's stripe units are (kvfs.StoreConfig checks)
            raise ValueError(f"unit {unit} is not a multiple of {ALIGN}")
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise CorruptPage(f"{name}: malformed {XATTR_EXTENTS}: {e}") from None
    n = len(files)
    if n == 1:  # every chunk touches the one before: one run, however many chunks
        return tuple(files), ((0, header, size),)
    ext: list[tuple[int, int, int]] = []
    for c in range(max(1, -(-size // unit))):
        f, off, length = c % n, header + (c // n) * unit, min(unit, size - c * unit)
        if ext and ext[-1][0] == f and ext[-1][1] + ext[-1][2] == off:
            ext[-1] = (f, ext[-1][1], ext[-1][2] + length)
        else:
            ext.append((f, off, length))
    return tuple(files), tuple(ext)


def source_from_engine(
    engine: Any,
    key: PageKey | str,
    *,
    check: Callable[[int], None] | None = None,
    disk_error: OSError | None = None,
) -> PageSource:
    """Lease a page of ``engine`` (a :class:`kvfs.Engine`) and describe its backing files.

    A page held only in the archive tier is restored to the local tier first (as
    ``Engine.get`` does), after ``check(size)`` (the destination's checks: what it raises
    is raised before anything is downloaded). With ``disk_error`` (a read of its local
    copy failed so: its disk fails), the archive's verified copy held in memory instead
    (``Engine.read_around``, which raises ``disk_error`` when there is none). Raises
    PageNotFound, StoreClosed, ArchiveUnavailable. The lease is held until the returned
    source is released; on an error nothing is held.
    """
    cm = engine.lease(key)
    page, blob = cm.__enter__()
    held: bytes | None = None
    restored = not blob.local  # (a miss, counted by _restore: its read is no hit)
    try:
        if check is not None:
            check(blob.size)
        if disk_error is not None and not restored:
            held = engine.read_around(blob, page, disk_error)
        elif restored:
            got = engine._restore(blob, page)
            if isinstance(got, bytes):  # no local room: the archive's verified memory copy
                held = got
            else:
                blob = got
        files: tuple[str, ...] = ()
        extents: tuple[tuple[int, int, int], ...] = ()
        if held is None:
            assert blob.extents is not None
            files, extents = _index_files(
                [(engine.tier.abspath(d, rel), off, n) for d, rel, off, n in blob.extents]
            )
    except BaseException:
        cm.__exit__(*sys.exc_info())
        raise

    def release(ok: bool) -> None:
        try:
            if ok:
                engine.note_read(page, blob.size, restored=restored)
        finally:
            cm.__exit__(None, None, None)

    return PageSource(
        name=page.path,
        size=blob.size,
        checksum=blob.hash,
        leaves=blob.leaves,
        files=files,
        extents=extents,
        held=held,
        blob=blob,
        _release=release,
    )


def source_from_mount(
    path: str | os.PathLike[str],
    *,
    through: bool = False,
    handle: int | None = None,
    check: Callable[[int], None] | None = None,
) -> PageSource:
    """Open a page file on a kvfs mount and read its extents from its xattrs (``through``:
    read the page through the mount instead, which verifies what it serves).

    The open handle keeps the page leased (the daemon does not evict or unlink data while a
    handle is open) until the source is released. ``handle``: that file already open (a
    descriptor of ``path``), used instead of opening the name again and left open on
    release (the caller closes it), so that a second source of one read describes the
    page the first one held, whatever the name holds by then. A page the mount holds only
    in the archive is restored first by reading one byte of it through the mount (as any
    reader's first read does), after ``check(size)`` (as for :func:`source_from_engine`). Where the backing files cannot be used, the page is read
    through the open handle instead (``held``): the daemon serves it from its memory copy (no local
    room for the restore), or the name was replaced or unlinked between the open and the
    attribute reads (ESTALE, ENOENT: the handle still reads the page it opened).

    Raises FileNotFoundError, NotAKvfsPage (no ``user.kvfs.extents``), CorruptPage
    (attributes that contradict each other; a file on no kvfs mount whose attributes name
    no data files that hold its page: nothing would verify a read through it).
    """
    name = os.fspath(path)
    fd = os.open(path, os.O_RDONLY) if handle is None else handle
    try:
        found = None if through else _mount_attrs(fd, name)
        if found is not None and check is not None:
            check(found[0])
        if found is not None and found[0] > 0 and not found[3]:
            os.pread(fd, 1, 0)  # archive-only: a read through the mount restores it
            found = _mount_attrs(fd, name)
        data: bytes | None = None
        if found is None or (found[0] > 0 and not found[3]):
            if kvfs_mount_of_fd(fd) is None:
                # only a mount verifies what it serves: a plain file's bytes would be
                # handed over as the page, checked against nothing (the open file's mount:
                # its name may lead onto a mount by now, a symlink moved)
                raise CorruptPage(
                    f"{name!r}: its kvfs attributes name no data files that hold its page, "
                    "and it is on no kvfs mount, which could serve the page verified"
                )
            data = _read_through(fd, name)
            found = (len(data), b"", (), ())
        size, checksum, files, extents = found
    except BaseException:
        if handle is None:
            os.close(fd)
        raise

    def release(ok: bool) -> None:
        if handle is None:
            os.close(fd)

    return PageSource(
        name=name,
        size=size,
        checksum=checksum,
        leaves=None,
        files=files,
        extents=extents,
        held=data,
        _release=release,
    )


def _mount_attrs(
    fd: int, name: str
) -> tuple[int, bytes, tuple[str, ...], tuple[tuple[int, int, int], ...]] | None:
    """``(size, checksum, files, extents)`` from an open page file's xattrs; None when the
    name the file was opened by no longer holds its page, or held another page while the
    attributes were read (each is read on its own: the checksum is read again last, and
    the size must be what the extents cover and what the open file's own size is)."""
    try:
        first = os.getxattr(fd, XATTR_CHECKSUM)
        raw = os.getxattr(fd, XATTR_EXTENTS)
        size_raw = os.getxattr(fd, XATTR_SIZE)
        if os.getxattr(fd, XATTR_CHECKSUM) != first:
            return None
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            raise NotAKvfsPage(
                f"{name!r} has no kvfs extents attribute: not a page on a kvfs mount"
            ) from e
        if e.errno in (errno.ESTALE, errno.ENOENT):
            return None
        raise
    try:
        size, checksum = int(size_raw), bytes.fromhex(first.decode())
    except ValueError as e:  # (UnicodeDecodeError too)
        raise CorruptPage(f"{name!r}: malformed kvfs attributes: {e}") from None
    if size != os.fstat(fd).st_size:
        # a page on the mount is as long as its size attribute says; attributes set by
        # hand on another file can say anything, and the extents below are built one per
        # stripe unit of the size they claim (10**12 bytes would exhaust memory)
        return None
    files, extents = decode_extents(raw, repr(name))
    if sum(n for _, _, n in extents) != size and extents:
        return None  # the extents of one page, the size of another
    return size, checksum, files, extents


def _read_through(fd: int, name: str) -> bytes:
    """The whole page, read through the mount (which verifies what it serves: EIO is a
    page that failed its checksum, CorruptPage here)."""
    chunks: list[bytes] = []
    pos = 0  # (preads: a handle shared by two sources of one read has no offset to trust)
    while True:
        try:
            b = os.pread(fd, 16 << 20, pos)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            raise CorruptPage(f"{name!r}: the mount could not serve it whole (EIO)") from e
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        pos += len(b)
