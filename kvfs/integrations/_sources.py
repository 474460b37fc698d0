"""Page sources: the one seam between engine integrations and where page bytes live.

An integration names pages with :class:`~kvfs.PageKey` and asks a :class:`PageSource` to
find, read and write them. Three sources exist:

* :class:`StorePages` goes through the object API (a :class:`~kvfs.SyncStore`, an async
  :class:`~kvfs.Store` via its engine, or an :class:`~kvfs.Engine`): checksummed reads,
  deduplicated writes, attrs kept in the index;
* :class:`DirectoryPages` reads and writes plain files ``<root>/<key path>`` in any
  directory, which is what the kvfs FUSE mount shows (``<mount>/sessions/<s>/<prefix>/
  layer-NNN``). Writes go to a temporary name and are renamed into place, so a reader never
  sees half a page.

* :class:`FastPathPages` reads through the fast path (``gds.FastPath``): metadata from the
  object API, data straight from the backing files with O_DIRECT.

Any other object with the four calls of :class:`PageSource` plugs in the same way. A
source whose reads are not verified by kvfs (a plain directory, an object of your own) has
each page checked against the digest in its header instead.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .._engine import Engine
from .._errors import CorruptPage, PageNotFound
from .._keys import SESSIONS_DIR, PageKey, session_dir
from .._mountinfo import kvfs_mount_of
from ._chain import is_chunk_name
from ._format import HEADER_READ, GeometryMismatch, PageHeader, parse_header

__all__ = [
    "DirectoryPages",
    "FastPathPages",
    "PageSource",
    "PageStat",
    "StorePages",
    "as_source",
    "read_file_header",
]


@dataclass(frozen=True, slots=True)
class PageStat:
    """What a source knows about a page without reading it (attrs: None if not cheap)."""

    size: int
    attrs: dict[str, str] | None = None


@runtime_checkable
class PageSource(Protocol):
    """Where pages live. Implementations must be safe to call from several threads.

    Optional attributes: ``label``, a short name for reports ("object API", "directory
    /mnt/kvfs"...), and ``verifies``, True when ``read_into`` itself fails on a damaged
    page (kvfs checksums); otherwise each page read is checked against its header's digest.
    Optional call: ``rewrite(key, data, attrs) -> bool``, a write that replaces the page:
    a save then rewrites a page a load found damaged (without it, that page stays, and
    every later load stops there).
    """

    def stat(self, key: PageKey) -> PageStat | None:
        """Size (and attrs where cheap) of a page, or None if it does not exist."""
        ...

    def read_into(self, key: PageKey, buf: memoryview) -> int:
        """Read the whole page into ``buf`` (at least its size); return its size.

        Raises PageNotFound if it went away; CorruptPage if it fails verification.
        """
        ...

    def write(self, key: PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        """Store a page once: False (and nothing written) if it exists already."""
        ...

    def sample_attrs(self, session: str) -> dict[str, str] | None:
        """The kvfs-kv/1 metadata of one page of ``session`` (the first of its first few
        whose header reads; {} if none is a kvfs-kv/1 page), or None if the session has no
        pages, or none that could be read."""
        ...


def _kv_attrs(attrs: dict[str, str] | None) -> dict[str, str] | None:
    # Pages written through the mount by other writers carry the file's attrs (fs.mode...),
    # not the format's: those say nothing about the page, which its header then tells.
    return attrs if attrs is not None and "format" in attrs else None


_PAGE_NAME = re.compile(r"layer-\d{3,}")

#: Pages a session check reads at most: a damaged one is passed over for the next.
SAMPLE_PAGES = 8


def _header_attrs(reads: Iterable[tuple[str, Callable[[], PageHeader]]]) -> dict[str, str] | None:
    """The metadata in the first kvfs-kv/1 header of ``reads`` (the first few ``(path,
    read)``), else {} when one was some other file, else None (none could be read: no
    verdict). A damaged page, one that vanished, or an EIO from the mount, found first,
    made every new prompt of its session fail: a page after it tells instead. A file named
    as kvfs names KV pages that does not parse is such a damaged page (cut short by a power
    loss), not a file of another kind: a session whose sampled pages were all cut short
    was refused for good, its next save included."""
    verdict: dict[str, str] | None = None
    pending = itertools.islice(reads, SAMPLE_PAGES)
    while True:
        try:
            item = next(pending, None)  # (listing a directory may fail too)
            if item is None:
                return verdict
            path, read = item
            return dict(read().metadata)
        except CorruptPage:
            if not _named_as_page(path):
                verdict = {}
        except GeometryMismatch:  # a well-formed header of another kind
            verdict = {}
        except OSError:  # PageNotFound, EIO
            continue


def _named_as_page(path: str) -> bool:
    """Whether ``path`` ends in ``<chunk name>/layer-NNN``, as kvfs-kv/1 pages are named."""
    *_, chunk, layer = ["", *path.replace(os.sep, "/").split("/")]
    return is_chunk_name(chunk) and _PAGE_NAME.fullmatch(layer) is not None


class StorePages:
    """Pages through the kvfs object API. Thread-safe (the engine is)."""

    def __init__(self, store: object) -> None:
        engine = getattr(store, "engine", store)
        if not isinstance(engine, Engine):
            raise TypeError(
                f"expected a kvfs Store, SyncStore or Engine, not {type(store).__name__}"
            )
        self.engine = engine
        self.label = "object API"
        self.verifies = True  # every read is checked against the page's checksum

    def stat(self, key: PageKey) -> PageStat | None:
        try:
            info = self.engine.stat(key)
        except PageNotFound:
            return None
        return PageStat(size=info.size, attrs=_kv_attrs(info.attrs))

    def read_into(self, key: PageKey, buf: memoryview) -> int:
        n = self.engine.get(key, into=buf)
        assert isinstance(n, int)
        return n

    def write(self, key: PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        if self.engine.exists(key):
            return False
        try:
            self.engine.put(key, data, attrs=attrs)
        except FileExistsError:
            return False  # another writer won the race; pages are write-once
        return True

    def rewrite(self, key: PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        self.engine.put(key, data, attrs=attrs, replace=True)
        return True

    def sample_attrs(self, session: str) -> dict[str, str] | None:
        # (the semantic session: the bare name means an engine's directory of that name
        # when no session has it, and LMCache's tree refused a session "lmcache"). A few
        # pages, not a listing of the session: this runs at every new prompt.
        pages = self.engine.sample_pages(session_dir(session), SAMPLE_PAGES)
        if not pages:
            return None
        attrs = _kv_attrs(pages[0].attrs)
        if attrs is not None:
            return attrs

        def reader(path: str) -> Callable[[], PageHeader]:
            key = PageKey.from_path(path)
            return lambda: read_header(lambda o, n: self.engine.read_range(key, o, n), path)

        return _header_attrs((p.path, reader(p.path)) for p in pages)


class DirectoryPages:
    """Pages as plain files under ``root`` (a kvfs mount, or any directory)."""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = False) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root} is not a directory")
        #: fsync each page before renaming it into place (a mount does its own durability).
        self.durable = durable
        self.label = f"directory {self.root}"
        #: A kvfs mount checks every read against the page's checksum (EIO otherwise);
        #: pages in any other directory are checked against their digest.
        self.verifies = kvfs_mount_of(self.root) is not None

    def path(self, key: PageKey) -> Path:
        return self.root.joinpath(*key.parts)

    def stat(self, key: PageKey) -> PageStat | None:
        try:
            return PageStat(size=os.stat(self.path(key)).st_size)
        except FileNotFoundError:
            return None

    def read_into(self, key: PageKey, buf: memoryview) -> int:
        try:
            f = open(self.path(key), "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError as e:
            raise PageNotFound(f"no page file {self.path(key)}") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if len(buf) < size:
                raise ValueError(f"buffer of {len(buf)} bytes is smaller than {size}")
            done = 0
            while done < size:
                try:
                    n = f.readinto(buf[done:size])
                except OSError as e:
                    if e.errno == errno.EIO:  # the kvfs mount: the page failed its checksum
                        raise CorruptPage(f"{self.path(key)}: {e.strerror}") from e
                    raise
                if not n:
                    raise PageNotFound(f"{self.path(key)} shrank while being read")
                done += n
        return size

    def write(self, key: PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        return self._write(key, data, attrs, replace=False)

    def rewrite(self, key: PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        return self._write(key, data, attrs, replace=True)

    def _write(self, key: PageKey, data: memoryview, attrs: dict[str, str], replace: bool) -> bool:
        # attrs are inside the page (safetensors metadata): plain files need nothing else;
        # on a kvfs mount they become the page's attributes too (the session's model in
        # `kvfs ls`, a listing's attrs without reading headers)
        dest = self.path(key)
        if dest.exists() and not replace:
            return False  # (the common case, told without writing; _publish decides)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb", buffering=0) as f:
                if self.verifies:  # (first: any close of the file would commit it)
                    for k, v in attrs.items():
                        os.setxattr(f.fileno(), f"user.kvfs.attr.{k}", v.encode())
                view = memoryview(data)
                while view:
                    n = f.write(view)
                    view = view[n:]
                if self.durable:
                    os.fsync(f.fileno())
            if replace:
                os.replace(tmp, dest)
                return True
            return _publish(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def sample_attrs(self, session: str) -> dict[str, str] | None:
        sdir = self.root / SESSIONS_DIR / session
        if not sdir.is_dir():
            return None
        pages = (  # lazily: the first readable page is enough
            page
            for prefix in sorted(sdir.iterdir())
            for page in (sorted(prefix.iterdir()) if prefix.is_dir() else ())
            if ".tmp-" not in page.name
        )
        return _header_attrs((str(p), functools.partial(read_file_header, p)) for p in pages)


_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # (glibc 2.28 and later)


def _publish(tmp: Path, dest: Path) -> bool:
    """Give the file ``tmp`` the name ``dest`` unless ``dest`` exists: True if it did; else
    False, with ``tmp`` removed. Atomic: of two writers of one new page, one publishes it
    and the other is told it exists. (A check then ``os.replace`` let both count the page
    as written, the second replacing the first's.)

    renameat2(RENAME_NOREPLACE) where the filesystem has it (ext4, xfs, btrfs, tmpfs, the
    kvfs mount); else a hard link, which fails on an existing name too; else, on a
    filesystem with neither, the check and a rename (the race stays there).
    """
    if _renameat2 is not None:
        at_fdcwd = -100
        rc = _renameat2(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(dest), _RENAME_NOREPLACE)
        err = ctypes.get_errno() if rc else 0
        if rc == 0:
            return True
        if err == errno.EEXIST:
            tmp.unlink()
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(tmp), None, str(dest))
    try:
        os.link(tmp, dest)
    except FileExistsError:
        tmp.unlink()
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        if dest.exists():
            tmp.unlink()
            return False
        os.replace(tmp, dest)
        return True
    tmp.unlink()
    return True


class FastPathPages(StorePages):
    """Pages read by the fast path (``gds``): metadata through the object API, data straight
    from the backing files with O_DIRECT (checksums verified), bypassing the engine's copy.

    Writes and lookups are the object API's. ``fast_path`` is a ``gds.FastPath``; one is
    made (and closed by :meth:`close`) if not given.
    """

    def __init__(self, store: object, fast_path: object | None = None) -> None:
        super().__init__(store)
        if fast_path is None:
            import gds

            fast_path = gds.FastPath(self.engine)
            self._own: object | None = fast_path
        else:
            self._own = None
        self.fast_path = fast_path
        self.label = "fast path"
        self.verifies = bool(getattr(fast_path, "verify", False))

    def read_into(self, key: PageKey, buf: memoryview) -> int:
        return int(self.fast_path.read(key, buf).result())  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._own is not None:
            self._own.close()  # type: ignore[attr-defined]
            self._own = None


def read_header(read_at: Callable[[int, int], bytes], where: str) -> PageHeader:
    """Parse the header of a page that ``read_at(offset, size)`` reads, reading only the
    header's bytes."""
    head = read_at(0, HEADER_READ)
    if len(head) >= 8:
        need = 8 + struct.unpack("<Q", head[:8])[0]
        if len(head) < need <= 100_000_000:
            head += read_at(len(head), need - len(head))
    return parse_header(head, where)


def read_file_header(path: Path) -> PageHeader:
    """Parse the header of a page file, reading only the header's bytes."""
    with open(path, "rb") as f:
        return read_header(lambda o, n: os.pread(f.fileno(), n, o), str(path))


def as_source(target: object) -> PageSource:
    """A PageSource for a store (object API), a directory path, or a PageSource itself."""
    if isinstance(target, (str, os.PathLike)):
        return DirectoryPages(target)
    if isinstance(target, PageSource):
        return target
    if isinstance(target, Engine) or isinstance(getattr(target, "engine", None), Engine):
        return StorePages(target)
    raise TypeError(
        f"cannot read KV pages from a {type(target).__name__}: pass a kvfs store, "
        f"a directory, or a PageSource"
    )
