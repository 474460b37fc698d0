"""FUSE operations: KV pages as files (see docs/mount.md for the user's view).

Every handler runs on the trio loop and sends disk, hashing and SQLite work to worker threads
under one :class:`trio.CapacityLimiter`, so the loop never blocks. No exception escapes a
handler (:mod:`kvfs._fuse_guard`). This module holds names, attributes, directories, unlink,
rename, statfs and extended attributes; file contents are in :mod:`kvfs._fuse_files`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pyfuse3
import trio

from ._budget import ByteBudget
from ._dirs import DirRow
from ._errors import KvfsError, PageNotFound
from ._events import log_event
from ._fuse_ahead import AheadBudget
from ._fuse_behind import WriterThreads
from ._fuse_files import FileOps
from ._fuse_guard import child_of, decode_name, fuse_error, guard
from ._fuse_nodes import Handle, Kind, Node, NodeTable, Pending, owner, process_group
from ._fuse_ns import (
    META_NAME,
    child_path,
    dir_exists,
    is_session_dir,
    list_dir,
    own_attrs,
    parent_of,
    validate_dir,
    validate_page,
)
from ._fuse_xattr import extents_xattr
from ._keys import MAX_NAME_BYTES, SESSIONS_DIR
from ._reads import session_pinned
from ._store import Store
from ._writes import ATTR_GID, ATTR_MODE, ATTR_MTIME, ATTR_UID, ATTR_XATTR, RESERVED_ATTRS

__all__ = ["ATTR_XATTR", "XATTRS", "KvfsOperations"]

log = logging.getLogger("kvfs.fuse")
XATTRS = (
    "user.kvfs.checksum",
    "user.kvfs.size",
    "user.kvfs.tier",
    "user.kvfs.pinned",
    "user.kvfs.session",
    "user.kvfs.extents",
)
#: the longest list of extended attribute names Linux hands to a process (XATTR_LIST_MAX)
XATTR_LIST_MAX = 64 * 1024


def _page_attrs(node: Node) -> dict[str, str] | None:
    """The free-form attributes of a page or of a file being written (None otherwise)."""
    if node.pending is not None:
        return node.pending.attrs
    if node.kind is Kind.PAGE and node.page is not None:
        return own_attrs(node.page.attrs)
    return None


def _attr_value(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise fuse_error(errno.EINVAL) from None


def _identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(device, inode) of a directory; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def keep_heap() -> None:
    """Keep freed 1 MiB request buffers in the heap (glibc; a no-op elsewhere).

    Every write request arrives as a fresh 1 MiB ``bytes`` and every read answer is one.
    glibc's default (dynamic mmap threshold, trim above 2x it) hands such blocks back to the
    kernel and faults them in again: profiled, page faults and zeroing took ~20% of the
    daemon's CPU per written MiB. With a fixed 32 MiB mmap threshold and 256 MiB trim
    threshold the same memory is reused; the daemon keeps at most that much more resident.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD


class KvfsOperations(FileOps, pyfuse3.Operations):
    """pyfuse3 operations over a :class:`~kvfs.Store`. Call :meth:`aclose` after unmounting."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(
        self,
        store: Store,
        *,
        direct_io: bool = False,
        threads: int = 16,
        entry_timeout: float = 1.0,
        attr_timeout: float = 1.0,
        read_ahead: int = 16,
        read_ahead_budget: int = 256 << 20,
        write_behind: int = 8,
        write_behind_budget: int = 256 << 20,
    ) -> None:
        super().__init__()
        keep_heap()
        self.store = store
        self.engine = store.engine
        self.direct_io = direct_io
        self.limiter = trio.CapacityLimiter(threads)
        self.table = NodeTable(owner(), entry_timeout, attr_timeout)
        self.dirs = self.engine.dirs
        self.pending: dict[str, Node] = {}
        #: names whose file is being committed right now: wait, then look again
        self.settling: dict[str, trio.Event] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._stale: dict[str, float] = {}  # path -> when an open of it was answered ESTALE
        #: writes accepted ahead of the disk per file being written (0: off); needs a nursery
        self.write_behind = write_behind
        #: bytes accepted ahead of the disk over all files being written, at most
        self.write_behind_budget = ByteBudget(write_behind_budget, fair=False)  # (see its doc)
        #: the threads writing queued writes, over all files being written (one a file,
        #: hundreds of files at once took hundreds of threads, and failed writes where a
        #: cgroup caps a container's processes)
        self.writer_threads = WriterThreads(threads)
        #: requests prefetched past a sequential reader (0: off); needs :attr:`nursery`
        self.read_ahead = read_ahead
        #: bytes prefetched and not yet read, over all open files, at most
        self.read_ahead_budget = AheadBudget(read_ahead_budget)
        #: where read-ahead runs; the mount sets it (without one, no read-ahead)
        self.nursery: trio.Nursery | None = None
        cfg = store.engine.config
        #: the store's directories as they were at the start (device, inode): one removed
        #: and made again (a write's makedirs does) is another directory, without the index
        self._store_dirs = {str(d): _identity(d) for d in (*cfg.data_dirs, cfg.index_path.parent)}
        #: the store's directories found gone, and said so in the log (see store_gone)
        self._gone: set[str] = set()

    def store_gone(self) -> bool:
        """True when a directory of the store (a data directory, the index's) is missing,
        or is not the one it was: removed under the running daemon (``rm -rf``). The guard
        then answers EIO without a traceback: every lookup failed with one (the index
        could not be opened by a new thread), flooding the log with the same error. The
        first request to find a directory gone logs it, once, in one line.

        The daemon goes on answering, EIO where the store is needed: stopping it would
        unmount, and an engine writing there would then fill the disk under the mountpoint
        instead of getting errors. ``kvfs umount`` stops it."""
        missing = [d for d, was in self._store_dirs.items() if _identity(d) != was]
        new = [d for d in missing if d not in self._gone]
        if new:
            self._gone.update(new)
            log.error(
                "the store's directory %s is gone (removed while the daemon ran?): requests "
                "that need it fail with EIO; unmount (kvfs umount) and check the store "
                "(kvfs fsck)",
                ", ".join(new),
            )
        return bool(missing)

    # -- names ------------------------------------------------------------------------
    def _writing_under(self, path: str) -> bool:
        """A file is being written somewhere below directory ``path``."""
        return any(p.startswith(path + "/") for p in self.pending)

    async def _resolve(self, parent: Node, name: str) -> Node:
        """The node ``name`` in ``parent`` means now. Raises FUSEError(ENOENT)."""
        path = child_path(parent.path, name)
        while path in self.settling:
            await self.settling[path].wait()
        if path in self.pending:
            return self.pending[path]
        # Index lookups on the loop, as for open (docs/mount.md): one indexed read each on a
        # read-only connection that never waits for writers costs less than a thread hop
        # (scripts/mount_metadata_latency.py: checking a missing name 0.18 -> 0.06 ms, a stat
        # of an uncached name 0.13 -> 0.06 ms).
        if name == META_NAME and is_session_dir(parent.path):
            # Also in a directory whose session has just gone (its last page deleted): `rm -r`
            # listed the file before, and unlinks it after the pages (see unlink).
            return self.table.bind(path, Kind.META)
        row = self.engine.index.page(path)
        if row is not None:
            return self.table.bind(path, Kind.PAGE, row)
        if self._writing_under(path) or dir_exists(self.engine, self.dirs, path):
            return self.table.bind(path, Kind.DIR)
        raise fuse_error(errno.ENOENT)

    @guard
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: Any = None
    ) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.table.bind(parent.path.rpartition("/")[0], Kind.DIR)
        elif len(name) > MAX_NAME_BYTES:
            raise fuse_error(errno.ENAMETOOLONG)
        else:
            try:
                node = await self._resolve(parent, name.decode("utf-8"))
            except UnicodeDecodeError:
                raise fuse_error(errno.ENOENT) from None  # no page can have this name
        attrs = await self._entry(node)
        node.nlookup += 1
        return attrs

    async def forget(self, inode_list: Any) -> None:
        try:
            for ino, n in inode_list:
                self.table.forget(ino, n)
        except Exception:  # forget must not raise at all
            log.error("forget failed", exc_info=True)

    @guard
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return await self._entry(self.table.get(inode))

    @guard
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self.table.get(inode)
        writer = None
        if node.kind is Kind.PENDING:
            writer = next((x for x in self.handles.values() if x.node is node and x.writable), None)
        if writer is not None:
            # Not beside its writer's close (another thread's, a child's exit): the close
            # committed the writer and the truncate then found it closed, answered EIO
            # with an "unexpected error" logged. After that close, a truncate through the
            # writer's descriptor makes the page's next version, as any later one does. A
            # chmod, chown or utime too: set on the file once its commit had read them,
            # it answered 0 and the page kept what it was created with.
            async with writer.close_lock:
                if writer.committed and node.kind is Kind.PENDING:
                    # That close discarded the file (a write of it had failed, its writer
                    # was killed): no page, and a closed writer, whose truncate raised
                    # ValueError (EIO, "unexpected error"). Its failure, as a write says.
                    raise fuse_error(writer.failed or errno.ENOENT)
                return await self._setattr(node, attr, fields, fh)
        return await self._setattr(node, attr, fields, fh)

    async def _setattr(
        self, node: Node, attr: Any, fields: Any, fh: Any
    ) -> pyfuse3.EntryAttributes:
        mtime = attr.st_mtime_ns if fields.update_mtime else None
        if node.kind is Kind.PENDING:
            w = node.pending
            assert w is not None
            if fields.update_size:
                for x in [x for x in self.handles.values() if x.node is node]:
                    await self._drain(x)
                try:
                    # Shrinking too: the file is not a page yet, so its close publishes
                    # what the truncate left (it answered EINVAL, and the close published
                    # the bytes the writer had cut).
                    await self._thread(w.writer.truncate, attr.st_size)
                    w.queued_end = min(w.queued_end, attr.st_size)
                except OSError as e:
                    # as a failed write: the file is discarded, and its close says why (it
                    # was published as an empty page after `truncate -s 1G` got ENOSPC)
                    for x in self.handles.values():
                        if x.node is node and x.writable:
                            x.failed = x.failed or e.errno or errno.EIO
                    raise
            _set_pending(w, attr, fields, mtime)
        elif node.kind is Kind.PAGE:
            assert node.page is not None
            h = self.handles.get(fh) if fh is not None else None
            if fields.update_size and h is not None and h.node is node and h.writable:
                # its writer's ftruncate, once a dup's close or a rename committed the page
                await self._truncate_again(h, attr.st_size)
            elif fields.update_size and attr.st_size != self._attrs(node).st_size:
                # Committed pages are immutable. (Compared with the size the file shows: a
                # page whose writer built a longer next version answered a truncate to the
                # committed size 0, and kept the longer one; one to its own size, EPERM.)
                raise fuse_error(errno.EPERM)
            new: dict[str, str] = {}
            if fields.update_mode:
                new[ATTR_MODE] = f"{attr.st_mode & 0o7777:o}"
            if fields.update_uid:
                new[ATTR_UID] = str(attr.st_uid)
            if fields.update_gid:
                new[ATTR_GID] = str(attr.st_gid)
            if mtime is not None:
                new[ATTR_MTIME] = str(mtime)
            if new:
                await self._thread(self.engine.set_page_attrs, node.path, new)
                row = await self._thread(self.engine.index.page, node.path)
                if row is not None and row.hash == node.page.hash:
                    node.page = row
                # The next version a writer builds (Handle.again) is this file too: it was
                # committed at close with the mode and owner of when it began and the time
                # of its last write, undoing a chmod or utime made meanwhile. (Under its
                # lock: a version being begun now reads node.page, already changed, or is
                # changed here once it is made.)
                for x in [x for x in self.handles.values() if x.node is node and x.writable]:
                    async with x.again_lock:
                        if x.again is not None:
                            _set_pending(x.again, attr, fields, mtime)
        elif node.kind is Kind.DIR:
            a = self._attrs(node)
            if node.path in ("", SESSIONS_DIR) and (
                (fields.update_uid and attr.st_uid != a.st_uid)
                or (fields.update_gid and attr.st_gid != a.st_gid)
            ):
                raise fuse_error(errno.EPERM)  # (to the owner it has: a no-op, as tar -x does)
            drow = DirRow(
                node.path,
                attr.st_mode if fields.update_mode else a.st_mode,
                attr.st_uid if fields.update_uid else a.st_uid,
                attr.st_gid if fields.update_gid else a.st_gid,
                mtime if mtime is not None else a.st_mtime_ns,
            )
            await self._thread(self.dirs.put, drow)
        elif fields.update_size or fields.update_mode or fields.update_uid or fields.update_gid:
            raise fuse_error(errno.EPERM)
        return await self._entry(node)

    async def _truncate_again(self, h: Handle, size: int) -> None:
        """Truncate the next version of a page that ``h``'s writer builds (it writes on
        after a dup's close or a rename committed the page), as a file being written
        truncates; made for it when there is none yet (a truncate to the page's own size
        makes none). Its next close commits it. Raises FUSEError: the errno of a failed
        write or truncate of that version (which is then discarded, as for a write)."""
        node = h.node
        assert node.page is not None
        if self.table.by_path.get(node.path) != node.ino:
            return  # unlinked or replaced since: a version no name will ever show
        async with h.write_lock, h.again_lock:
            if h.again_failed:
                raise fuse_error(h.again_failed)
            try:
                if h.again is None:
                    if size == node.page.size:
                        return
                    h.again = await self._thread(self._next_version, node)
                    node.rewriting += 1
                    node.stale_cache = True
                await self._thread(h.again.writer.truncate, size)
                h.again.mtime_ns = time.time_ns()
            except BaseException as e:
                # as a failed write: this version is discarded at close, which says why
                h.again_failed = getattr(e, "errno", None) or errno.EIO
                raise

    # -- directories ------------------------------------------------------------------
    @guard
    async def opendir(self, inode: int, ctx: Any) -> int:
        return self._fh(Handle(self._dir(inode)))

    @guard
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        h = self._handle(fh)
        if start_id == 0:
            await self._settle_closed_empty(h.node.path)
            # The listing is taken once per pass, so offsets stay stable while it is read.
            ls = await self._thread(list_dir, self.engine, self.dirs, h.node.path)
            base = h.node.path
            # "." and ".." first, as every file system lists them (ls -a, scripts counting
            # entries); the kernel takes no lookup of them from a readdirplus reply
            h.entries = [(".", Kind.DIR, None), ("..", Kind.DIR, None)]
            h.entries += [
                (child_path(base, d), Kind.DIR, None) for d in sorted(ls.dirs) if d not in ls.pages
            ]
            # (.kvfs.json is not listed, as ZFS's .zfs is not: reached by name only, it is
            # not copied by the tools that copy or move a session directory (cp -a, rsync,
            # tar, mv's copy), whose destination generates its own)
            h.entries += [(r.path, Kind.PAGE, r) for _n, r in sorted(ls.pages.items())]
        for i in range(start_id, len(h.entries)):
            path, kind, row = h.entries[i]
            if i < 2:
                up = self.table.at(parent_of(h.node.path)) if i and h.node.path else None
                dot = self._attrs(up or h.node)
                if not pyfuse3.readdir_reply(token, path.encode(), dot, i + 1):
                    break
                continue
            node = self.table.bind(path, kind, row)
            ok = pyfuse3.readdir_reply(
                token, path.rsplit("/", 1)[-1].encode(), self._attrs(node), i + 1
            )
            if not ok:
                self.table.maybe_drop(node)
                break
            node.nlookup += 1

    @guard
    async def releasedir(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None:
            h.node.opens -= 1
            self.table.maybe_drop(h.node)

    @guard
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        path = child_of(parent, name)
        validate_dir(path)
        try:
            await self._resolve(parent, decode_name(name))
            raise fuse_error(errno.EEXIST)
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ENOENT:
                raise
        await self._thread(self.dirs.put, DirRow(path, *self._dir_defaults(ctx, mode)))
        node = self.table.bind(path, Kind.DIR)
        node.nlookup += 1
        return self._attrs(node)

    @staticmethod
    def _dir_defaults(ctx: Any, mode: int) -> tuple[int, int, int, int]:
        return ((mode & ~ctx.umask) & 0o7777, ctx.uid, ctx.gid, time.time_ns())

    @guard
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        path = child_of(parent, name)
        if path in ("", SESSIONS_DIR):
            raise fuse_error(errno.EBUSY)
        node = self.table.at(path)
        if node is not None and node.kind is not Kind.DIR:
            raise fuse_error(errno.ENOTDIR)
        ls = await self._thread(list_dir, self.engine, self.dirs, path)
        if ls.dirs or ls.pages or self._writing_under(path):
            raise fuse_error(errno.ENOTEMPTY)
        if node is None and not await self._thread(dir_exists, self.engine, self.dirs, path):
            raise fuse_error(errno.ENOENT)
        await self._thread(self._drop_dir, path)
        self.table.detach(path)

    def _drop_dir(self, path: str) -> None:
        self.dirs.remove(path)
        if self.engine.index.session(path) is not None:
            with contextlib.suppress(KvfsError):  # gone meanwhile
                # "bar/", not "bar": a bare name means sessions/bar when that exists
                self.engine.delete_session(path + "/")

    @guard
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        path = child_of(parent, name)
        while path in self.settling:
            # Its writer's close is committing it: unlink the page once it is one (the
            # unlink answered ENOENT, and the page appeared after it)
            await self.settling[path].wait()
        node = self.pending.pop(path, None)
        if node is not None:
            assert node.pending is not None
            node.pending.unlinked = True
        elif name == META_NAME.encode() and is_session_dir(parent.path):
            # It describes the session's pages: it goes with them (a no-op once they are
            # gone, so that `rm -r` of a session directory succeeds), not before.
            pages = functools.partial(self.engine.index.pages, session=parent.path, limit=1)
            if await self._thread(pages):
                raise fuse_error(errno.EPERM)
        else:
            try:
                await self._thread(self.engine.delete, path)
            except PageNotFound:
                if await self._thread(dir_exists, self.engine, self.dirs, path):
                    raise fuse_error(errno.EISDIR) from None
                raise
        self.table.detach(path)

    @guard
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Any,
    ) -> None:
        src_dir, dst_dir = self._dir(parent_inode_old), self._dir(parent_inode_new)
        src, dst = child_of(src_dir, name_old), child_of(dst_dir, name_new)
        if flags & ~pyfuse3.RENAME_NOREPLACE:  # EXCHANGE, WHITEOUT: not offered
            raise fuse_error(errno.EINVAL)
        node = await self._resolve(src_dir, decode_name(name_old))
        try:
            target: Node | None = await self._resolve(dst_dir, decode_name(name_new))
        except pyfuse3.FUSEError:
            target = None
        if target is not None and flags & pyfuse3.RENAME_NOREPLACE:
            raise fuse_error(errno.EEXIST)
        if node.kind is Kind.META or (target is not None and target.kind is Kind.META):
            raise fuse_error(errno.EPERM)
        if target is node:
            return
        # A file being written under the target name is closed after the rename, not beside
        # it: the rename replaces it, and its close (which finds it unlinked) commits
        # nothing. Beside it, the close committed that file over the page the rename had
        # just put there, both answered 0, and the name kept the file the rename replaced.
        closing = None
        if target is not None and target.kind is Kind.PENDING:
            closing = next(
                (x for x in self.handles.values() if x.node is target and x.writable), None
            )
        async with contextlib.AsyncExitStack() as held:
            if closing is not None:
                await held.enter_async_context(closing.close_lock)
            if node.kind is Kind.PAGE:
                # Not beside the commit of a next version of the page (its writer wrote on
                # after a flush committed it, then closed): that commit went to the name it
                # had begun under, which came back holding the new bytes while the new
                # name kept the old ones. After it, the rename moves what it committed.
                for x in [x for x in self.handles.values() if x.node is node and x.writable]:
                    await held.enter_async_context(x.again_lock)
            await self._rename_file(node, target, src, dst, ctx)

    async def _rename_file(
        self, node: Node, target: Node | None, src: str, dst: str, ctx: Any
    ) -> None:
        """:meth:`rename`'s moves, once its names are resolved and checked."""
        if node.kind is Kind.DIR:
            await self._rename_dir(src, dst, target)
        elif target is not None and target.kind is Kind.DIR:
            raise fuse_error(errno.EISDIR)
        elif node.kind is Kind.PENDING:
            validate_page(dst)
            if node.pending is not None and not _by_its_writer(node.pending, ctx):
                # Only its writer publishes it: another process's rename committed the bytes
                # written so far, and a kill of the writer then left that partial page.
                raise fuse_error(errno.EBUSY)
            h = next((x for x in self.handles.values() if x.node is node and x.writable), None)
            if h is None:  # its writer closed it this instant: being committed
                raise fuse_error(errno.EBUSY)
            # Not beside a flush of it (its writer's close from another thread): both
            # committed the one writer, one under each name; the rename answered 0 with the
            # page left under the old name, or EIO with it under the new one.
            async with h.close_lock:
                closed = h.committed
                if not closed:
                    await self._finish(h, dst, hold=True)
            if closed:
                # That close committed it meanwhile: the page is renamed, as after a close
                # that came first (it answered EBUSY, which a close just before the rename
                # never gets), or it discarded it: no such file.
                if node.kind is not Kind.PAGE:
                    raise fuse_error(errno.ENOENT)
                await self._thread(self.engine.rename, src, dst)
        else:
            validate_page(dst)
            await self._thread(self.engine.rename, src, dst)
        if target is not None:
            if target.kind is Kind.PENDING and target.pending is not None:
                # A writer was making a file under the name that was just replaced.
                target.pending.unlinked = True
                self.pending.pop(dst, None)
            self.table.unbind(target)
        if node.kind is Kind.DIR:
            self.table.move_tree(node, dst)  # (empty directories below it)
        else:
            self.table.move(node, dst)

    async def _rename_dir(self, src: str, dst: str, target: Node | None) -> None:
        if SESSIONS_DIR in (src, dst):
            # always there (as for rmdir): a rename would leave it, or replace it (an empty
            # directory took its place, its mode and owner with it)
            raise fuse_error(errno.EBUSY)
        # Every directory of the tree lands where mkdir could make it: under sessions/,
        # none below a prefix (`mv e sessions/s` with e/a/c made sessions/s/a/c).
        validate_dir(dst)
        for p in self.dirs.tree(src):
            validate_dir(dst + p[len(src) :])
        ls = await self._thread(list_dir, self.engine, self.dirs, src)
        if (
            ls.pages
            or ls.meta
            or self._writing_under(src)
            or ls.dirs
            and await self._thread(self._pages_under, src)
        ):
            raise fuse_error(errno.EXDEV)  # not atomic for a tree of pages: mv copies instead
        if target is not None:
            tl = await self._thread(list_dir, self.engine, self.dirs, dst)
            if tl.dirs or tl.pages or self._writing_under(dst):
                raise fuse_error(errno.ENOTEMPTY)
        # A tree of empty directories moves whole (it was EXDEV: mv copied it)
        await self._thread(self._move_dirs, src, dst)

    def _pages_under(self, path: str) -> bool:
        """(thread) A page lies somewhere below directory ``path``."""
        return bool(self.engine.index.pages(path_prefix=path + "/", limit=1))

    def _move_dirs(self, src: str, dst: str) -> None:
        """(thread) The rows of ``src`` and the empty directories below it, now under
        ``dst`` (``src`` itself implicit: a row made with its owner and the time)."""
        rows = {p: self.dirs.get(p) for p in self.dirs.tree(src)}
        if src not in rows:
            rows[src] = DirRow(src, 0o755, self.table.uid, self.table.gid, time.time_ns())
        self.dirs.remove_many(list(rows))
        for p, row in rows.items():
            assert row is not None
            self.dirs.put(DirRow(dst + p[len(src) :], row.mode, row.uid, row.gid, row.mtime_ns))

    @guard
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        raise fuse_error(errno.EPERM)

    @guard
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        raise fuse_error(errno.EPERM)

    @guard
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        raise fuse_error(errno.EPERM)

    # -- file system ------------------------------------------------------------------
    @guard
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        e = self.engine
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = e.capacity // 4096
        # What the cap leaves, or what the disks hold if that is less (a cap given beyond
        # them): df promised room that a write then found full (ENOSPC)
        room = max(0, e.capacity - e.used - e.reserved)
        disks = sum(await self._thread(e.tier.free_bytes_per_filesystem))
        s.f_bfree = s.f_bavail = min(room, disks) // 4096
        s.f_files = s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s

    @guard
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself

    # -- extended attributes ----------------------------------------------------------
    @guard
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        node = self.table.get(inode)
        key = name.decode("utf-8", "replace")
        if key.startswith(ATTR_XATTR):  # a page attribute (model, dtype...)
            attrs = _page_attrs(node)
            if attrs is None or key[len(ATTR_XATTR) :] not in attrs:
                raise fuse_error(pyfuse3.ENOATTR)
            return attrs[key[len(ATTR_XATTR) :]].encode()
        if node.kind is not Kind.PAGE or key not in XATTRS:
            raise fuse_error(pyfuse3.ENOATTR)
        assert node.page is not None
        info = await self._thread(self.engine.stat, node.path)
        if info.checksum != node.page.hash.hex():
            raise fuse_error(errno.ESTALE)
        field = key.rsplit(".", 1)[1]
        if field == "extents":  # work per stripe chunk: off the loop
            return await self._thread(extents_xattr, info.extents, info.size, self.engine.tier.unit)
        if field == "pinned":  # kept from eviction: the page pinned, or its session
            held = info.pinned
            if not held:
                held = await self._thread(session_pinned, self.engine, node.page.session)
            return b"1" if held else b"0"
        return str(getattr(info, field)).encode()

    @guard
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.table.get(inode)
        mine = [f"{ATTR_XATTR}{k}".encode() for k in sorted(_page_attrs(node) or ())]
        return [x.encode() for x in XATTRS] + mine if node.kind is Kind.PAGE else mine

    @guard
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        node = self.table.get(inode)
        async with self._not_closing(node):
            attrs, key = self._settable(node, name, ctx)
            listed = sum(len(x) + 1 for x in XATTRS) + sum(
                len(ATTR_XATTR.encode() + k.encode()) + 1 for k in {*attrs, key}
            )
            if listed > XATTR_LIST_MAX:  # listxattr could not answer: every copy would lose them
                raise fuse_error(errno.E2BIG)
            attrs[key] = _attr_value(value)

    @guard
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        node = self.table.get(inode)
        async with self._not_closing(node):
            attrs, key = self._settable(node, name, ctx)
            if attrs.pop(key, None) is None:
                raise fuse_error(pyfuse3.ENOATTR)

    @contextlib.asynccontextmanager
    async def _not_closing(self, node: Node) -> AsyncIterator[None]:
        """Hold the close of the file ``node`` is being written as (if it is) for the block:
        a page attribute set while that close committed the file was set after the commit
        had read them, answered 0 and lost. After it, the file is a page (EPERM)."""
        h = None
        if node.kind is Kind.PENDING:
            h = next((x for x in self.handles.values() if x.node is node and x.writable), None)
        if h is None:
            yield
            return
        async with h.close_lock:
            yield

    def _settable(self, node: Node, name: bytes, ctx: Any) -> tuple[dict[str, str], str]:
        """The attributes a ``user.kvfs.attr.<k>`` change goes to, and ``k``: those of a file
        being written, committed with it, changed by its writer only (EBUSY for another
        process, which cannot open it either). ENOTSUP for every other name (the read-only
        ``user.kvfs.*`` ones too: the errno cp -a, mv and rsync -X skip quietly; with EPERM,
        mv within the mount printed an error per attribute); EPERM on a committed page,
        whose attributes are as immutable as its bytes."""
        try:
            key = name.decode()
        except UnicodeDecodeError:
            raise fuse_error(errno.EINVAL) from None
        if key == ATTR_XATTR:  # the page-attribute prefix with no name: a bad name
            raise fuse_error(errno.EINVAL)
        if not key.startswith(ATTR_XATTR):
            raise fuse_error(errno.ENOTSUP)
        if key[len(ATTR_XATTR) :].startswith(RESERVED_ATTRS):
            raise fuse_error(errno.EPERM)  # the mount's own (mode, owner, mtime)
        pending = node.pending
        if pending is None or pending.unlinked:
            raise fuse_error(errno.EPERM if node.kind is Kind.PAGE else errno.ENOTSUP)
        if not _by_its_writer(pending, ctx):
            raise fuse_error(errno.EBUSY)
        return pending.attrs, key[len(ATTR_XATTR) :]

    # -- shutdown ---------------------------------------------------------------------
    async def aclose(self) -> None:
        """After unmount: discard unfinished writes, end every lease, close the dir table.
        Idempotent. A file still being written is not committed (it was never closed)."""
        for fh in list(self.handles):
            h = self.handles.pop(fh)
            try:
                if h.writable and not h.committed and h.node.pending is not None:
                    await self._drain(h)
                    await self._abort(h.node.pending.writer)
                    log_event(
                        "discard",
                        level=logging.WARNING,
                        target=h.node.path,
                        reason="still being written when the mount stopped",
                        bytes=h.node.pending.writer.size,
                    )
                await self._close_handle(h)
            except Exception:
                log.error("closing a handle at shutdown failed", exc_info=True)
        self.pending.clear()


def _set_pending(w: Pending, attr: Any, fields: Any, mtime: int | None) -> None:
    """A setattr's mode, owner and mtime on a file being written, committed with it."""
    w.mode = attr.st_mode if fields.update_mode else w.mode
    w.uid = attr.st_uid if fields.update_uid else w.uid
    w.gid = attr.st_gid if fields.update_gid else w.gid
    w.mtime_ns = mtime if mtime is not None else w.mtime_ns


def _by_its_writer(pending: Pending, ctx: Any) -> bool:
    """The request comes from the process writing ``pending`` (any of its threads)."""
    return pending.writer_tgid is None or process_group(ctx.pid) == pending.writer_tgid
