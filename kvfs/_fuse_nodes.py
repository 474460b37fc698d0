"""Inodes and open files of the mount: plain state, no I/O (used by :mod:`kvfs._fuse`).

An inode stands for one *content* under one name: a committed page (its checksum fixed), a
file being written, a directory, or a session's metadata file. When a name starts to mean
other content (a page replaced through the object API), lookup hands out a new inode, so
the kernel's page cache of the old one (``keep_cache``) can never serve the new bytes.
An inode lives while the kernel holds it (lookup count) or a file on it is open.
"""

from __future__ import annotations

import enum
import os
import stat
import time
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from ._dirs import DirRow
from ._engine import PageWriter
from ._fuse_ns import attr_int, page_mode
from ._index import BlobRow, PageRow
from ._writes import ATTR_GID, ATTR_MODE, ATTR_MTIME, ATTR_UID

__all__ = ["Handle", "Kind", "Node", "NodeTable", "Pending", "process_group"]


class Kind(enum.Enum):
    DIR = "dir"
    PAGE = "page"
    PENDING = "pending"
    META = "meta"


@dataclass(eq=False)
class Pending:
    """A file being written: the engine's streaming writer plus the POSIX metadata it will be
    committed with. ``unlinked``: its name was removed, so closing it discards the bytes."""

    writer: PageWriter
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    unlinked: bool = False
    #: the end of the furthest write queued behind (not in the writer yet): the size a
    #: stat must show (numpy.memmap writes the last byte, then maps the file by its size)
    queued_end: int = 0
    #: a descriptor of it was closed before any write: a ``touch``, whose release (the
    #: commit) the kernel sends after close returned, or a shell's dup2 (writes follow)
    closed_empty: bool = False
    #: page attributes set as ``user.kvfs.attr.*`` extended attributes while it is written
    attrs: dict[str, str] = field(default_factory=dict)
    #: the process (thread group) that created it: the only one that may set those
    writer_tgid: int | None = None

    def commit_attrs(self) -> dict[str, str]:
        return {
            **self.attrs,
            ATTR_MODE: f"{self.mode & 0o7777:o}",
            ATTR_UID: str(self.uid),
            ATTR_GID: str(self.gid),
            ATTR_MTIME: str(self.mtime_ns),
        }


@dataclass(eq=False)
class Node:
    ino: int
    path: str
    kind: Kind
    page: PageRow | None = None
    pending: Pending | None = None
    nlookup: int = 0
    opens: int = 0
    #: the name's content changed under this inode (a replace raced an open, see
    #: ``open``): the kernel may cache the old bytes for it, so opens go past the cache
    uncached: bool = False
    #: handles writing a next version of this committed page (see ``Handle.again``): the
    #: writes land in this inode's page cache before they are committed, so opens go past it
    rewriting: int = 0
    #: handles open for writing (the file's writer, from create): the name stays this node's
    writers: int = 0
    #: this inode's page cache may hold bytes its page does not (a next version was written
    #: through it): the next open drops it (no keep_cache)
    stale_cache: bool = False
    #: a ``.kvfs.json``: its last rendering and when that content first appeared, so that
    #: stat and read agree and its mtime moves only when the session does (tar, rsync)
    meta: bytes = b""
    meta_ns: int = 0

    def render_meta(self, content: bytes) -> bytes:
        if content != self.meta:
            self.meta, self.meta_ns = content, time.time_ns()
        return content


def process_of(pid: int) -> tuple[int, int] | None:
    """``(pid, start time)``: a process as :func:`killed_by` finds it again (a pid alone
    may be reused). None when it is gone already."""
    fields = _stat_fields(pid)
    return None if fields is None else (pid, int(fields[19]))


def process_group(tid: int) -> int | None:
    """The process (thread group id) of thread ``tid``: FUSE names the calling thread, and
    any thread of a writer is that writer. None when it is gone."""
    with suppress(OSError, ValueError), open(f"/proc/{tid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
    return None


def killed_by(proc: tuple[int, int] | None) -> int:
    """The signal that is ending process ``proc`` (from :func:`process_of`), else 0.

    A file's close and its writer's death look the same to a file system: the kernel closes
    a dying process's files, and FUSE sends the FLUSH and RELEASE a close sends. But while it
    closes them the process is exiting (PF_EXITING in /proc/PID/stat) with its exit status
    set: a signal there (SIGKILL, an unhandled SIGTERM, a crash) means it never finished
    writing. A process that exits normally without closing (status without a signal), and
    one already reaped, count as a close."""
    if proc is None:
        return 0
    fields = _stat_fields(proc[0])
    if fields is None or int(fields[19]) != proc[1] or len(fields) < 50:
        return 0
    if not int(fields[6]) & _PF_EXITING:
        return 0
    return int(fields[49]) & 0x7F


_PF_EXITING = 0x4


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2 :].decode().split()


@dataclass(eq=False)
class Handle:
    """An open file. Read handles hold an engine lease (``lease``) until release."""

    node: Node
    lease: AbstractContextManager[tuple[PageRow, BlobRow]] | None = None
    held: tuple[PageRow, BlobRow] | None = None
    content: bytes | None = None  # the metadata file's bytes, fixed at open
    ahead: Any = None  # a ReadAhead while a page is open for reading
    direct: bool = False  # opened with direct_io: no page cache of the mount's own
    behind: Any = None  # a WriteBehind once a file being written gets writes
    writable: bool = False
    wrote: bool = False
    #: errno of a failed write or commit: the file is discarded at close, and every later
    #: write, fsync and close through this handle raises it (it was never published)
    failed: int = 0
    #: the process that created the file being written (:func:`process_of`), and the signal
    #: that killed it before it closed the file (:func:`killed_by`): then it is discarded
    opener: tuple[int, int] | None = None
    killed: int = 0
    committed: bool = False
    #: held by a flush or the release while it commits or discards the file being written:
    #: two flushes at once (the writer's close, and a child's close of the descriptor it
    #: inherited, which a fork and exec sends) both committed the one writer, and the
    #: second failed ("writer is closed") or returned before the page was there
    close_lock: trio.Lock = field(default_factory=trio.Lock)
    #: held by a write, and by a commit while it drains the writes queued and marks the
    #: handle committed: a write that waited for room in its queue (write-behind) while a
    #: child's close drained and committed the file went on into the committed writer, lost
    #: (the writer's close returned 0, its page missing that write or holding zeros there)
    write_lock: trio.Lock = field(default_factory=trio.Lock)
    #: writes after this handle's page was committed (a dup'd fd closed first): the next
    #: version of the page, committed over it by the next flush or the release
    again: Pending | None = None
    #: held while ``again`` is made, written or committed: the kernel sends a mapping's
    #: writeback as several WRITEs at once, and each would otherwise make its own version
    again_lock: trio.Lock = field(default_factory=trio.Lock)
    #: errno of a failed write to a next version: it is discarded, not committed (sticky:
    #: every later version through this handle would miss that write too)
    again_failed: int = 0
    #: a directory handle's listing: (path, kind, page row)
    entries: list[tuple[str, Kind, PageRow | None]] = field(default_factory=list)


class NodeTable:
    """inode -> node and path -> inode. Plain functions: call only from the trio thread."""

    def __init__(self, owner: tuple[int, int], entry_timeout: float, attr_timeout: float) -> None:
        self.uid, self.gid = owner
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.started_ns = time.time_ns()
        self.nodes: dict[int, Node] = {}
        self.by_path: dict[str, int] = {}
        self._next = pyfuse3.ROOT_INODE + 1
        root = Node(pyfuse3.ROOT_INODE, "", Kind.DIR, nlookup=1)
        self.nodes[root.ino] = root
        self.by_path[""] = root.ino

    def get(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(2) from None  # ENOENT: the kernel forgot it already

    def at(self, path: str) -> Node | None:
        ino = self.by_path.get(path)
        return self.nodes.get(ino) if ino is not None else None

    def bind(self, path: str, kind: Kind, page: PageRow | None = None) -> Node:
        """The node for ``path`` as it is now: the known one if it still means the same
        content, else a new inode (the old one stays until the kernel forgets it)."""
        n = self.at(path)
        if n is not None and n.writers > 0:
            # Its writer goes on writing next versions under this name. A listing (readdir)
            # or a lookup read from the index just before one was committed showed the
            # previous version: a new inode for it took the name, and the writer's later
            # writes and its close's commit went nowhere ("replaced meanwhile"), its close
            # answered 0 and the page left a prefix of what it wrote.
            return n
        if (
            n is not None
            and n.kind is kind
            and (
                kind is not Kind.PAGE
                or (
                    n.page is not None
                    and page is not None
                    and n.page.hash == page.hash
                    and n.page.created == page.created
                )
            )
        ):
            if page is not None:
                n.page = page
            return n
        n = Node(self._next, path, kind, page=page)
        self._next += 1
        self.nodes[n.ino] = n
        self.by_path[path] = n.ino
        return n

    def move(self, node: Node, dst: str) -> None:
        if self.by_path.get(node.path) == node.ino:
            del self.by_path[node.path]
        node.path = dst
        self.by_path[dst] = node.ino

    def move_tree(self, node: Node, dst: str) -> None:
        """:meth:`move` for a directory and every node named below it."""
        pre = node.path + "/"
        below = [(p, ino) for p, ino in self.by_path.items() if p.startswith(pre)]
        self.move(node, dst)
        for p, ino in below:
            self.move(self.nodes[ino], dst + "/" + p[len(pre) :])

    def unbind(self, node: Node) -> None:
        """``node`` no longer has a name (replaced or failed); it lives while known or open."""
        if self.by_path.get(node.path) == node.ino:
            del self.by_path[node.path]
        self.maybe_drop(node)

    def detach(self, path: str) -> None:
        """The name is gone; its node lives on while open or known to the kernel."""
        ino = self.by_path.pop(path, None)
        if ino is not None:
            self.maybe_drop(self.nodes[ino])

    def forget(self, ino: int, n: int) -> None:
        node = self.nodes.get(ino)
        if node is not None:
            node.nlookup -= n
            self.maybe_drop(node)

    def maybe_drop(self, node: Node) -> None:
        if node.nlookup > 0 or node.opens > 0 or node.ino == pyfuse3.ROOT_INODE:
            return
        self.nodes.pop(node.ino, None)
        if self.by_path.get(node.path) == node.ino:
            del self.by_path[node.path]

    # -- attributes -------------------------------------------------------------------
    def attrs(self, node: Node, dirrow: DirRow | None = None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = 1 << 20  # large I/O: cp and Python's io size their buffers by this
        a.entry_timeout = self.entry_timeout
        a.attr_timeout = self.attr_timeout
        now = self.started_ns
        if node.kind is Kind.DIR:
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
            if dirrow is not None:
                a.st_mode = stat.S_IFDIR | (dirrow.mode & 0o7777)
                a.st_uid, a.st_gid, now = dirrow.uid, dirrow.gid, dirrow.mtime_ns
            a.st_size = 4096
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
        elif node.kind is Kind.PAGE:
            p = node.page
            assert p is not None
            a.st_mode = page_mode(p)
            a.st_nlink = 1 if self.by_path.get(node.path) == node.ino else 0  # 0: unlinked
            a.st_uid = attr_int(p.attrs, ATTR_UID, self.uid)
            a.st_gid = attr_int(p.attrs, ATTR_GID, self.gid)
            a.st_size = p.size
            a.st_mtime_ns = attr_int(p.attrs, ATTR_MTIME, int(p.created * 1e9))
            a.st_ctime_ns = int(p.created * 1e9)
            a.st_atime_ns = int(p.atime * 1e9)
        elif node.kind is Kind.PENDING:
            w = node.pending
            assert w is not None
            a.st_mode = stat.S_IFREG | (w.mode & 0o7777)
            a.st_nlink = 0 if w.unlinked else 1
            a.st_uid, a.st_gid = w.uid, w.gid
            a.st_size = max(w.writer.size, w.queued_end)
            a.st_atime_ns = a.st_ctime_ns = a.st_mtime_ns = w.mtime_ns
            a.entry_timeout = a.attr_timeout = 0
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
            a.st_size = len(node.meta)
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.meta_ns
            a.entry_timeout = a.attr_timeout = 0
        a.st_blocks = -(-a.st_size // 512)
        return a


def owner() -> tuple[int, int]:
    return os.getuid(), os.getgid()
