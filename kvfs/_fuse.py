"""FUSE operations: KV pages as files (see docs/mount.md for the user's view).

Every handler runs on the trio loop and sends disk, hashing and SQLite work to worker threads
under one :class:`trio.CapacityLimiter`, so the loop never blocks. No exception escapes a
handler: a :class:`~kvfs.KvfsError` becomes its ``errno``, an :class:`OSError` keeps its own,
anything else is logged at ERROR and answered with EIO (pyfuse3 would end the mount on it).

Life of a written file: ``create`` starts an engine :class:`~kvfs.PageWriter` (capacity is
reserved as it grows; ENOSPC once eviction cannot make room); the first ``flush`` (the
writer's ``close``; FUSE's ``release`` comes later and asynchronously) commits it as a page,
or a ``rename`` of the open file commits it under the new name. Until then no other open can
see its bytes, and a crash leaves nothing (the engine sweeps the unreferenced files).
Committed pages are immutable: opening one for writing fails with EPERM, like ``chattr +i``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from ._errors import KvfsError, PageNotFound
from ._fuse_ahead import ReadAhead
from ._fuse_behind import WriteBehind
from ._fuse_nodes import Handle, Kind, Node, NodeTable, Pending, owner
from ._fuse_ns import (
    ATTR_GID,
    ATTR_MODE,
    ATTR_MTIME,
    ATTR_UID,
    META_NAME,
    DirRow,
    DirTable,
    child_path,
    dir_exists,
    list_dir,
    session_json,
    validate_dir,
    validate_page,
)
from ._keys import MAX_NAME_BYTES, MAX_PATH_BYTES, SESSIONS_DIR
from ._store import Store

__all__ = ["XATTRS", "KvfsOperations"]

log = logging.getLogger("kvfs.fuse")
T = TypeVar("T")
P = ParamSpec("P")
XATTRS = ("user.kvfs.checksum", "user.kvfs.size", "user.kvfs.tier", "user.kvfs.pinned",
          "user.kvfs.session", "user.kvfs.extents")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


def _err(n: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(n)


def _guard(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Answer every failure with an errno; never let pyfuse3 see anything but FUSEError."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except KvfsError as e:
            log.debug("%s%r: %s", fn.__name__, args[1:3], e)
            raise _err(e.errno) from None
        except OSError as e:
            if e.errno is None:
                log.error("%s%r failed", fn.__name__, args[1:3], exc_info=True)
            raise _err(e.errno or errno.EIO) from None
        except Exception:
            log.error("unexpected error in %s%r", fn.__name__, args[1:3], exc_info=True)
            raise _err(errno.EIO) from None

    return wrapper


def _name(name: bytes) -> str:
    if len(name) > MAX_NAME_BYTES:
        raise _err(errno.ENAMETOOLONG)
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise _err(errno.EINVAL) from None


def _child(parent: Node, name: bytes) -> str:
    path = child_path(parent.path, _name(name))
    if len(path.encode()) > MAX_PATH_BYTES:
        raise _err(errno.ENAMETOOLONG)
    return path


class KvfsOperations(pyfuse3.Operations):
    """pyfuse3 operations over a :class:`~kvfs.Store`. Call :meth:`aclose` after unmounting."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, store: Store, *, direct_io: bool = False, threads: int = 16,
                 entry_timeout: float = 1.0, attr_timeout: float = 1.0,
                 read_ahead: int = 8, write_behind: int = 8) -> None:
        super().__init__()
        self.store = store
        self.engine = store.engine
        self.direct_io = direct_io
        self.limiter = trio.CapacityLimiter(threads)
        self.table = NodeTable(owner(), entry_timeout, attr_timeout)
        cfg = self.engine.config
        self.dirs = DirTable((cfg.index_dir or cfg.data_dirs[0]) / "kvfs-dirs.sqlite3")
        self.pending: dict[str, Node] = {}
        #: names whose file is being committed right now: wait, then look again
        self.settling: dict[str, trio.Event] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        #: writes accepted ahead of the disk per file being written (0: off); needs a nursery
        self.write_behind = write_behind
        #: requests prefetched past a sequential reader (0: off); needs :attr:`nursery`
        self.read_ahead = read_ahead
        #: where read-ahead runs; the mount sets it (without one, no read-ahead)
        self.nursery: trio.Nursery | None = None

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=self.limiter)

    def _fh(self, h: Handle) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        self.handles[fh] = h
        h.node.opens += 1
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise _err(errno.EBADF) from None

    def _dir(self, ino: int) -> Node:
        n = self.table.get(ino)
        if n.kind is not Kind.DIR:
            raise _err(errno.ENOTDIR)
        return n

    def _attrs(self, node: Node, meta_size: int = 0) -> pyfuse3.EntryAttributes:
        return self.table.attrs(node, self.dirs.get(node.path), meta_size)

    async def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        size = 0
        if node.kind is Kind.META:
            size = len(await self._thread(session_json, self.engine, _session_of(node.path)))
        return self._attrs(node, size)

    # -- names ------------------------------------------------------------------------
    async def _resolve(self, parent: Node, name: str) -> Node:
        """The node ``name`` in ``parent`` means now. Raises FUSEError(ENOENT)."""
        path = child_path(parent.path, name)
        while path in self.settling:
            await self.settling[path].wait()
        if path in self.pending:
            return self.pending[path]
        if name == META_NAME and _is_session_dir(parent.path):
            if await self._thread(self.engine.index.session, parent.path) is None:
                raise _err(errno.ENOENT)
            return self.table.bind(path, Kind.META)
        row = await self._thread(self.engine.index.page, path)
        if row is not None:
            return self.table.bind(path, Kind.PAGE, row)
        if any(p.startswith(path + "/") for p in self.pending) or await self._thread(
                dir_exists, self.engine, self.dirs, path):
            return self.table.bind(path, Kind.DIR)
        raise _err(errno.ENOENT)

    @_guard
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.table.bind(parent.path.rpartition("/")[0], Kind.DIR)
        else:
            try:
                node = await self._resolve(parent, name.decode("utf-8"))
            except UnicodeDecodeError:
                raise _err(errno.ENOENT) from None  # no page can have this name
            if len(name) > MAX_NAME_BYTES:
                raise _err(errno.ENAMETOOLONG)
        attrs = await self._entry(node)
        node.nlookup += 1
        return attrs

    async def forget(self, inode_list: Any) -> None:
        try:
            for ino, n in inode_list:
                self.table.forget(ino, n)
        except Exception:  # forget must not raise at all
            log.error("forget failed", exc_info=True)

    @_guard
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return await self._entry(self.table.get(inode))

    @_guard
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.table.get(inode)
        mtime = attr.st_mtime_ns if fields.update_mtime else None
        if node.kind is Kind.PENDING:
            w = node.pending
            assert w is not None
            if fields.update_size:
                for x in [x for x in self.handles.values() if x.node is node]:
                    await self._drain(x)
                if attr.st_size < w.writer.size:
                    raise _err(errno.EINVAL)  # a page being written only grows
                await self._thread(w.writer.truncate, attr.st_size)
            w.mode = attr.st_mode if fields.update_mode else w.mode
            w.uid = attr.st_uid if fields.update_uid else w.uid
            w.gid = attr.st_gid if fields.update_gid else w.gid
            w.mtime_ns = mtime if mtime is not None else w.mtime_ns
        elif node.kind is Kind.PAGE:
            assert node.page is not None
            if fields.update_size and attr.st_size != node.page.size:
                raise _err(errno.EPERM)  # committed pages are immutable
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
        elif node.kind is Kind.DIR:
            if node.path in ("", SESSIONS_DIR) and (fields.update_uid or fields.update_gid):
                raise _err(errno.EPERM)
            a = self._attrs(node)
            drow = DirRow(node.path, attr.st_mode if fields.update_mode else a.st_mode,
                          attr.st_uid if fields.update_uid else a.st_uid,
                          attr.st_gid if fields.update_gid else a.st_gid,
                          mtime if mtime is not None else a.st_mtime_ns)
            await self._thread(self.dirs.put, drow)
        elif fields.update_size or fields.update_mode or fields.update_uid or fields.update_gid:
            raise _err(errno.EPERM)
        return await self._entry(node)

    # -- directories ------------------------------------------------------------------
    @_guard
    async def opendir(self, inode: int, ctx: Any) -> int:
        return self._fh(Handle(self._dir(inode)))

    @_guard
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        h = self._handle(fh)
        if start_id == 0:
            # The listing is taken once per pass, so offsets stay stable while it is read.
            ls = await self._thread(list_dir, self.engine, self.dirs, h.node.path)
            base = h.node.path
            h.entries = [(child_path(base, d), Kind.DIR, None) for d in sorted(ls.dirs)
                         if d not in ls.pages]
            if ls.meta:
                h.entries.append((child_path(base, META_NAME), Kind.META, None))
            h.entries += [(r.path, Kind.PAGE, r) for _n, r in sorted(ls.pages.items())]
        for i in range(start_id, len(h.entries)):
            path, kind, row = h.entries[i]
            node = self.table.bind(path, kind, row)
            ok = pyfuse3.readdir_reply(token, path.rsplit("/", 1)[-1].encode(),
                                       self._attrs(node), i + 1)
            if not ok:
                self.table.maybe_drop(node)
                break
            node.nlookup += 1

    @_guard
    async def releasedir(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None:
            h.node.opens -= 1
            self.table.maybe_drop(h.node)

    @_guard
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        path = _child(parent, name)
        validate_dir(path)
        try:
            await self._resolve(parent, _name(name))
            raise _err(errno.EEXIST)
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

    @_guard
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        path = _child(parent, name)
        if path in ("", SESSIONS_DIR):
            raise _err(errno.EBUSY)
        node = self.table.at(path)
        if node is not None and node.kind is not Kind.DIR:
            raise _err(errno.ENOTDIR)
        ls = await self._thread(list_dir, self.engine, self.dirs, path)
        if ls.dirs or ls.pages or any(p.startswith(path + "/") for p in self.pending):
            raise _err(errno.ENOTEMPTY)
        if node is None and not await self._thread(dir_exists, self.engine, self.dirs, path):
            raise _err(errno.ENOENT)
        await self._thread(self._drop_dir, path)
        self.table.detach(path)

    def _drop_dir(self, path: str) -> None:
        self.dirs.remove(path)
        if self.engine.index.session(path) is not None:
            with contextlib.suppress(KvfsError):  # gone meanwhile
                self.engine.delete_session(path)

    # -- files ------------------------------------------------------------------------
    @_guard
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dir(parent_inode)
        path = _child(parent, name)
        key = validate_page(path)
        if path in self.pending:
            raise _err(errno.EBUSY)
        writer = await self._thread(self.engine.begin_write, key)
        node = self.table.bind(path, Kind.PENDING)
        node.pending = Pending(writer, (mode & ~ctx.umask) & 0o7777, ctx.uid, ctx.gid,
                               time.time_ns())
        self.pending[path] = node
        fh = self._fh(Handle(node, writable=True))
        node.nlookup += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=self.direct_io), self._attrs(node)

    @_guard
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self.table.get(inode)
        write = bool(flags & _WRITE_FLAGS)
        while node.path in self.settling:
            await self.settling[node.path].wait()
        if node.kind is Kind.DIR:
            raise _err(errno.EISDIR)
        if node.kind is Kind.META:
            if write:
                raise _err(errno.EACCES)
            data = await self._thread(session_json, self.engine, _session_of(node.path))
            return pyfuse3.FileInfo(fh=self._fh(Handle(node, content=data)), direct_io=True)
        if node.kind is Kind.PENDING:
            # Only its writer's handle may touch a page in the making.
            raise _err(errno.EBUSY if write else errno.ENOENT)
        if write:
            raise _err(errno.EPERM)
        assert node.page is not None
        lease = self.engine.lease(node.path)
        held = await self._thread(lease.__enter__)
        direct = self.direct_io
        if held[1].hash != node.page.hash:
            # The name was replaced after the kernel looked it up (an open racing a rename):
            # the old bytes are gone, so this open gets the new ones, past the page cache,
            # which may hold the old content for this inode.
            node.page, direct = held[0], True
        h = Handle(node, lease=lease, held=held)
        if self.nursery is not None and self.read_ahead > 0:
            h.ahead = ReadAhead(functools.partial(self._thread, self.engine.read_held, *held),
                                held[1].size, self.read_ahead, self.nursery)
        fh = self._fh(h)
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=not direct)

    @_guard
    async def read(self, fh: int, off: int, size: int) -> Any:
        h = self._handle(fh)
        if h.content is not None:
            return h.content[off:off + size]
        if h.ahead is not None:
            return await h.ahead.read(off, size)
        if h.held is not None:
            page, blob = h.held
            return await self._thread(self.engine.read_held, page, blob, off, size)
        node = h.node
        if node.kind is Kind.PENDING and node.pending is not None:
            await self._drain(h)
            return await self._thread(node.pending.writer.read, off, size)
        return await self._thread(self.engine.read_range, node.path, off, size)

    @_guard
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        node = h.node
        if not h.writable or h.committed or node.pending is None:
            raise _err(errno.EPERM if node.kind is Kind.PAGE else errno.EBADF)
        h.wrote = True
        try:
            if self.nursery is not None and self.write_behind > 0:
                if h.behind is None:
                    h.behind = WriteBehind(functools.partial(self._thread, node.pending.writer.write),
                                           self.write_behind, self.nursery)
                await h.behind.submit(off, buf)
                return len(buf)
            return await self._thread(node.pending.writer.write, off, buf)
        except BaseException as e:
            # A page missing a write is not the page its writer meant: never publish it.
            h.failed = getattr(e, "errno", None) or errno.EIO
            raise

    async def _drain(self, h: Handle) -> None:
        """Wait for a handle's queued writes; a failed one marks the file failed."""
        if h.behind is not None:
            try:
                await h.behind.drain()
            except Exception as e:
                h.failed = h.failed or getattr(e, "errno", None) or errno.EIO
                if not isinstance(e, OSError):  # KvfsErrors are OSErrors or ValueErrors
                    log.error("a queued write failed", exc_info=e)

    @_guard
    async def flush(self, fh: int) -> None:
        h = self._handle(fh)
        # close() sends flush; release follows asynchronously. Committing here makes the page
        # visible when close returns. A flush before any write is a shell's dup2 + close of
        # the original fd (``echo > f``, dd): the writer is not done, release commits.
        if h.writable and not h.committed and (h.wrote or h.failed):
            await self._finish(h, h.node.path)

    @_guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        return None  # a page is durable when committed; before that it does not exist

    @_guard
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            raise _err(errno.EBADF)
        try:
            if h.writable and not h.committed:
                await self._finish(h, h.node.path)
        except pyfuse3.FUSEError:
            if not h.failed:
                raise
        finally:
            await self._close_handle(h)

    async def _close_handle(self, h: Handle) -> None:
        if h.ahead is not None:
            ahead, h.ahead = h.ahead, None
            await ahead.aclose()
        if h.lease is not None:
            lease, h.lease, h.held = h.lease, None, None
            await self._thread(lease.__exit__, None, None, None)
        h.node.opens -= 1
        self.table.maybe_drop(h.node)

    async def _finish(self, h: Handle, dst: str) -> None:
        """Commit (or, if unlinked, discard) the file an open handle is writing, as ``dst``."""
        node = h.node
        w = node.pending
        assert w is not None
        key = validate_page(dst)
        await self._drain(h)
        h.committed = True
        if self.pending.get(node.path) is node:
            del self.pending[node.path]
        if w.unlinked or h.failed:
            await self._thread(w.writer.abort)
            self.table.unbind(node)
            if h.failed:
                raise _err(h.failed)  # close() reports it too
            return
        settled = trio.Event()
        names = {node.path, dst}
        for n in names:
            self.settling[n] = settled
        try:
            w.writer.key = key
            await self._thread(functools.partial(w.writer.commit, attrs=w.commit_attrs(),
                                                 replace=True))
            row = await self._thread(self.engine.index.page, dst)
        except BaseException:
            self.table.unbind(node)
            raise
        finally:
            for n in names:
                if self.settling.get(n) is settled:
                    del self.settling[n]
            settled.set()
        node.kind, node.page, node.pending = Kind.PAGE, row, None
        self.table.move(node, dst)
        if row is None:  # evicted or deleted the instant it appeared
            self.table.unbind(node)

    @_guard
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        path = _child(parent, name)
        node = self.pending.pop(path, None)
        if node is not None:
            assert node.pending is not None
            node.pending.unlinked = True
        elif name == META_NAME.encode() and _is_session_dir(parent.path):
            raise _err(errno.EPERM)
        else:
            try:
                await self._thread(self.engine.delete, path)
            except PageNotFound:
                if await self._thread(dir_exists, self.engine, self.dirs, path):
                    raise _err(errno.EISDIR) from None
                raise
        self.table.detach(path)

    @_guard
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        src_dir, dst_dir = self._dir(parent_inode_old), self._dir(parent_inode_new)
        src, dst = _child(src_dir, name_old), _child(dst_dir, name_new)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise _err(errno.EINVAL)
        node = await self._resolve(src_dir, _name(name_old))
        try:
            target: Node | None = await self._resolve(dst_dir, _name(name_new))
        except pyfuse3.FUSEError:
            target = None
        if target is not None and flags & pyfuse3.RENAME_NOREPLACE:
            raise _err(errno.EEXIST)
        if node.kind is Kind.META or (target is not None and target.kind is Kind.META):
            raise _err(errno.EPERM)
        if target is node:
            return
        if node.kind is Kind.DIR:
            await self._rename_dir(src, dst, target)
        elif target is not None and target.kind is Kind.DIR:
            raise _err(errno.EISDIR)
        elif node.kind is Kind.PENDING:
            validate_page(dst)
            h = next(x for x in self.handles.values() if x.node is node and x.writable)
            await self._finish(h, dst)
        else:
            validate_page(dst)
            await self._thread(self.engine.rename, src, dst)
        if target is not None:
            if target.kind is Kind.PENDING and target.pending is not None:
                # A writer was making a file under the name that was just replaced.
                target.pending.unlinked = True
                self.pending.pop(dst, None)
            self.table.unbind(target)
        self.table.move(node, dst)

    async def _rename_dir(self, src: str, dst: str, target: Node | None) -> None:
        validate_dir(dst)
        ls = await self._thread(list_dir, self.engine, self.dirs, src)
        if ls.dirs or ls.pages or ls.meta:
            raise _err(errno.EXDEV)  # not atomic for a tree of pages: mv copies instead
        if target is not None:
            tl = await self._thread(list_dir, self.engine, self.dirs, dst)
            if tl.dirs or tl.pages:
                raise _err(errno.ENOTEMPTY)
        row = self.dirs.get(src)
        await self._thread(self.dirs.remove, src)
        if row is not None:
            await self._thread(self.dirs.put, DirRow(dst, row.mode, row.uid, row.gid, row.mtime_ns))
        else:
            await self._thread(self.dirs.put, DirRow(dst, 0o755, self.table.uid, self.table.gid,
                                                     time.time_ns()))

    @_guard
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        raise _err(errno.EPERM)

    @_guard
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        raise _err(errno.EPERM)

    @_guard
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        raise _err(errno.EPERM)

    # -- file system ------------------------------------------------------------------
    @_guard
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        e = self.engine
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = e.capacity // 4096
        s.f_bfree = s.f_bavail = max(0, e.capacity - e.used - e.reserved) // 4096
        s.f_files = s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s

    @_guard
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself

    # -- extended attributes ----------------------------------------------------------
    @_guard
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        node = self.table.get(inode)
        key = name.decode("utf-8", "replace")
        if node.kind is not Kind.PAGE or key not in XATTRS:
            raise _err(pyfuse3.ENOATTR)
        assert node.page is not None
        info = await self._thread(self.engine.stat, node.path)
        if info.checksum != node.page.hash.hex():
            raise _err(errno.ESTALE)
        field = key.rsplit(".", 1)[1]
        if field == "extents":
            return json.dumps([[x.path, x.offset, x.length] for x in info.extents]).encode()
        if field == "pinned":
            return b"1" if info.pinned else b"0"
        return str(getattr(info, field)).encode()

    @_guard
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        node = self.table.get(inode)
        return [x.encode() for x in XATTRS] if node.kind is Kind.PAGE else []

    @_guard
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise _err(errno.EPERM if name.startswith(b"user.kvfs.") else errno.ENOTSUP)

    @_guard
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise _err(errno.EPERM if name.startswith(b"user.kvfs.") else errno.ENOTSUP)

    # -- shutdown ---------------------------------------------------------------------
    async def aclose(self) -> None:
        """After unmount: discard unfinished writes, end every lease, close the dir table.
        Idempotent. A file still being written is not committed (it was never closed)."""
        for fh in list(self.handles):
            h = self.handles.pop(fh)
            try:
                if h.writable and not h.committed and h.node.pending is not None:
                    await self._drain(h)
                    await self._thread(h.node.pending.writer.abort)
                await self._close_handle(h)
            except Exception:
                log.error("closing a handle at shutdown failed", exc_info=True)
        self.pending.clear()
        await self._thread(self.dirs.close)


def _is_session_dir(path: str) -> bool:
    return path.startswith(SESSIONS_DIR + "/") and path.count("/") == 1


def _session_of(meta_path: str) -> str:
    return meta_path.rsplit("/", 1)[0]
