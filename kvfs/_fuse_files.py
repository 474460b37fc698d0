"""The FUSE handlers for file contents: create, open, read, write, flush, release.

Life of a written file: ``create`` starts an engine :class:`~kvfs.PageWriter` (capacity is
reserved as it grows; ENOSPC once eviction cannot make room); writes are written behind
(:mod:`kvfs._fuse_behind`); the first ``flush`` after a write (the writer's ``close``; FUSE's
``release`` comes later and asynchronously) commits it as a page, or a ``rename`` of the open
file commits it under the new name. Until then no other open can see its bytes, and a crash
leaves nothing (the engine sweeps the unreferenced files). Committed pages are immutable:
opening one for writing fails with EPERM, like ``chattr +i``. One exception keeps POSIX
close semantics: a handle whose page its own flush committed (a dup'd descriptor closed
first, the original still open) may go on writing; those writes build the next version of
the page (the committed bytes plus the new writes), which replaces it atomically at the
next flush or the release. Open pages hold an engine
lease, so their data outlives unlink, replace and eviction until the last close.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from ._budget import ByteBudget
from ._dirs import DirTable
from ._engine import Engine
from ._errors import KvfsError, out_of_files
from ._events import log_event
from ._fuse_ahead import AheadBudget, ReadAhead
from ._fuse_behind import WriteBehind, WriterThreads
from ._fuse_guard import child_of, files_error, fuse_error, guard, no_thread
from ._fuse_nodes import (
    Handle,
    Kind,
    Node,
    NodeTable,
    Pending,
    killed_by,
    process_group,
    process_of,
)
from ._fuse_ns import (
    attr_int,
    own_attrs,
    page_mode,
    parent_of,
    session_json,
    session_of,
    validate_page,
)
from ._index import PageRow
from ._writes import ATTR_GID, ATTR_MODE, ATTR_UID, PageWriter

__all__ = ["FileOps"]

log = logging.getLogger("kvfs.fuse")
T = TypeVar("T")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


class FileOps:
    """Mixin of :class:`~kvfs._fuse.KvfsOperations`: the state it shares, and file handlers."""

    engine: Engine
    table: NodeTable
    dirs: DirTable
    limiter: trio.CapacityLimiter
    direct_io: bool
    pending: dict[str, Node]
    settling: dict[str, trio.Event]
    handles: dict[int, Handle]
    _next_fh: int
    _stale: dict[str, float]
    read_ahead: int
    read_ahead_budget: AheadBudget
    write_behind: int
    write_behind_budget: ByteBudget
    writer_threads: WriterThreads
    nursery: trio.Nursery | None

    async def _resolve(self, parent: Node, name: str) -> Node:
        """Look a name up under a directory node; provided by the Operations class that
        mixes this in (kvfs._fuse.KvfsOperations)."""
        raise NotImplementedError

    def store_gone(self) -> bool:
        """True when a directory of the store was removed under the daemon; provided by
        the Operations class that mixes this in."""
        raise NotImplementedError

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=self.limiter)

    async def _abort(self, writer: PageWriter) -> None:
        """Discard what ``writer`` holds (its files, its reserved room) in a thread, or in
        the loop when no thread can be started (a cgroup's pids.max reached): the failed
        writes' room stayed reserved, and their files on disk, until the daemon stopped.
        A writer whose commit ran is done: this does nothing then."""
        try:
            await self._thread(writer.abort)
        except RuntimeError as e:
            if not no_thread(e):
                raise
            writer.abort()

    def _read_held(self, h: Handle, off: int, size: int) -> Any:
        # On the worker thread, one hop per fetch, leaves verified. A cached file's bytes
        # stay in the mount's page cache: read the data files with O_DIRECT into heap
        # memory (no second copy in their cache, no page faults; cold reads of 64 MiB pages
        # 1.24-1.30 -> 1.42-1.48 GB/s: docs/benchmarks.md, FUSE mount, fifth session). A
        # direct_io file has no cache but theirs.
        assert h.held is not None
        return self.engine.read_held(*h.held, off, size, buffered=h.direct)

    def _first_stale(self, path: str) -> bool:
        """True (and remembered for a second) unless ``path`` was answered ESTALE in the
        last second: the kernel retries an open once, so a second ESTALE would reach the
        caller."""
        now = time.monotonic()
        if len(self._stale) > 1024:
            self._stale = {p: t for p, t in self._stale.items() if now - t < 1.0}
        if now - self._stale.get(path, float("-inf")) < 1.0:
            return False
        self._stale[path] = now
        return True

    def _fh(self, h: Handle) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        self.handles[fh] = h
        h.node.opens += 1
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise fuse_error(errno.EBADF) from None

    def _dir(self, ino: int) -> Node:
        n = self.table.get(ino)
        if n.kind is not Kind.DIR:
            raise fuse_error(errno.ENOTDIR)
        return n

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = self.table.attrs(node, self.dirs.get(node.path))
        if node.rewriting > 0:
            # Its writer builds the next version: say that version's size, as for a file
            # being written. The kernel takes a stat's size as the file's, and its writer's
            # next O_APPEND write went to the committed end, over the bytes written since.
            # (Not the larger of the two: a version its writer truncated is shorter.)
            sizes = [
                h.again.writer.size for h in self.handles.values() if h.node is node and h.again
            ]
            a.st_size = max(sizes, default=a.st_size)
            a.st_blocks = -(-a.st_size // 512)
        return a

    async def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        if node.kind is Kind.META:
            await self._render_meta(node)
        return self._attrs(node)

    async def _render_meta(self, node: Node) -> bytes:
        # (`touch` of a layer, then its session's metadata: counted without it, mostly)
        await self._settle_closed_empty(session_of(node.path), below=True)
        data = await self._thread(session_json, self.engine, session_of(node.path))
        return node.render_meta(data)

    async def _settle_closed_empty(self, d: str, *, below: bool = False) -> None:
        """Wait (briefly) for the files of directory ``d`` (``below``: at any depth) closed
        without a write to be committed: ``touch f; ls`` must list f, but the kernel sends
        the release that commits it after close returned, and it may come after this
        readdir. A shell's dup2 (a descriptor closed, writes to follow) is not committed:
        the wait ends."""

        def inside(p: str) -> bool:
            return p.startswith(d + "/") if below else parent_of(p) == d

        deadline = trio.current_time() + 0.1
        while trio.current_time() < deadline:
            waiting = [
                p
                for p, n in self.pending.items()
                if n.pending is not None and n.pending.closed_empty and inside(p)
            ]
            if not waiting:
                break
            await trio.sleep(0.002)
        for settled in [e for p, e in self.settling.items() if inside(p)]:
            with trio.move_on_after(1.0):
                await settled.wait()

    @guard
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dir(parent_inode)
        path = child_of(parent, name)
        key = validate_page(path)
        if path in self.pending:
            raise fuse_error(errno.EBUSY)
        if self.store_gone():  # (its close would commit into an index nothing reads)
            raise fuse_error(errno.EIO)
        writer = await self._thread(self.engine.begin_write, key)
        node = self.table.bind(path, Kind.PENDING)
        node.pending = Pending(
            writer,
            (mode & ~ctx.umask) & 0o7777,
            ctx.uid,
            ctx.gid,
            time.time_ns(),
            writer_tgid=process_group(ctx.pid),
        )
        self.pending[path] = node
        node.writers += 1
        fh = self._fh(Handle(node, writable=True, opener=process_of(ctx.pid)))
        node.nlookup += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=self.direct_io), self._attrs(node)

    @guard
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self.table.get(inode)
        write = bool(flags & _WRITE_FLAGS)
        while node.path in self.settling:
            await self.settling[node.path].wait()
        if node.kind is Kind.DIR:
            raise fuse_error(errno.EISDIR)
        if node.kind is Kind.META:
            if write:
                raise fuse_error(errno.EACCES)
            data = await self._render_meta(node)
            return pyfuse3.FileInfo(fh=self._fh(Handle(node, content=data)), direct_io=True)
        if node.kind is Kind.PENDING:
            # Only its writer's handle may touch a page in the making.
            raise fuse_error(errno.EBUSY if write else errno.ENOENT)
        if write:
            raise fuse_error(errno.EPERM)
        assert node.page is not None
        lease = self.engine.lease(node.path)
        # Taken on the loop, not in a thread: a lease is an index lookup (a read-only SQLite
        # connection that never waits for writers, its pages in memory) and a counter, and
        # the thread hop cost more than the lookup (scripts/mount_metadata_latency.py: an
        # open + close 0.30-0.31 -> 0.18-0.26 ms on the dev VM). Data I/O stays in threads.
        held = lease.__enter__()
        # While a writer's next version of the page is in this inode's page cache, uncommitted,
        # readers go past the cache; once it is committed (or dropped) the next open drops
        # the cache, which may hold its bytes.
        direct = self.direct_io or node.uncached or node.rewriting > 0
        keep = not direct and not node.stale_cache
        if not direct:
            node.stale_cache = False
        if held[1].hash != node.page.hash or node.uncached:
            # The name was replaced after the kernel looked it up (an open racing a rename):
            # this inode's page cache may hold the old bytes, so it must never serve the new
            # ones cached. The name gets a fresh inode at its next lookup, and ESTALE makes
            # the kernel redo this open's lookup with revalidation (namei's LOOKUP_REVAL
            # retry), which finds it: the caller's open then succeeds, mmap included. If
            # the retry races again, that open gets the new bytes past the page cache
            # (direct_io: read works, mmap fails with ENODEV) instead of a second ESTALE.
            node.page, node.uncached, direct = held[0], True, True
            self.table.unbind(node)
            if not self.direct_io and self._first_stale(node.path):
                await self._thread(lease.__exit__, None, None, None)
                raise fuse_error(errno.ESTALE)
        # An open is an access: reads the kernel's page cache answers never reach kvfs, and
        # eviction order and retention (archive.retention) go by access times.
        self.engine.touch(held[0])
        h = Handle(node, lease=lease, held=held, direct=direct)
        if self.nursery is not None and self.read_ahead > 0:
            h.ahead = ReadAhead(
                functools.partial(self._thread, self._read_held, h),
                held[1].size,
                self.read_ahead,
                self.nursery,
                self.engine.tier.unit,
                self.read_ahead_budget,
            )
        fh = self._fh(h)
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep and not direct)

    @guard
    async def read(self, fh: int, off: int, size: int) -> Any:
        h = self._handle(fh)
        if h.content is not None:
            return h.content[off : off + size]
        if h.ahead is not None:
            return await h.ahead.read(off, size)
        if h.again is not None:
            # Its writer reads what it wrote: the next version it builds, not the one its
            # page holds (committed meanwhile, it is the held version once more).
            async with h.again_lock:
                if h.again is not None:
                    return await self._thread(h.again.writer.read, off, size)
        if h.held is not None:
            return await self._thread(self._read_held, h, off, size)
        node = h.node
        if node.kind is Kind.PENDING and node.pending is not None:
            await self._drain(h)
            return await self._thread(node.pending.writer.read, off, size)
        if h.writable:  # committed, and its version is gone already (see _hold)
            raise fuse_error(errno.ENOENT)
        return await self._thread(self.engine.read_range, node.path, off, size)

    @guard
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        async with h.write_lock:
            return await self._write(h, off, buf)

    async def _write(self, h: Handle, off: int, buf: bytes) -> int:
        node = h.node
        while (
            h.writable and h.committed and node.kind is Kind.PENDING and node.path in self.settling
        ):
            # A flush (a child's close of the descriptor it inherited) is committing what
            # this handle wrote so far: the write goes to the next version once that is the
            # page. (It was refused with EBADF: a writer's write failed because its process
            # started another.)
            await self.settling[node.path].wait()
        if h.writable and h.committed and not h.failed and node.kind is Kind.PAGE:
            # This handle's own flush committed the page and its writer goes on writing.
            if self.table.by_path.get(node.path) != node.ino:
                return len(buf)  # unlinked or replaced since: bytes no name will ever show
            async with h.again_lock:
                if h.again_failed:  # (this version misses a write: discarded at close)
                    raise fuse_error(h.again_failed)
                try:
                    if h.again is None:
                        h.again = await self._thread(self._next_version, node)
                        node.rewriting += 1
                        node.stale_cache = True
                    h.again.mtime_ns = time.time_ns()
                    return await self._thread(h.again.writer.write, off, buf)
                except BaseException as e:
                    # As for a first version: a page missing a write is never published
                    h.again_failed = getattr(e, "errno", None) or errno.EIO
                    raise
        if h.committed and h.failed:  # (its commit failed: _finish)
            raise fuse_error(h.failed)
        if not h.writable or h.committed or node.pending is None:
            raise fuse_error(errno.EPERM if node.kind is Kind.PAGE else errno.EBADF)
        h.wrote = True
        node.pending.closed_empty = False
        node.pending.mtime_ns = time.time_ns()  # a write sets mtime (make, find -newer)
        try:
            if self.nursery is not None and self.write_behind > 0:
                if h.behind is None:
                    h.behind = WriteBehind(
                        node.pending.writer.write,
                        self.write_behind,
                        self.write_behind_budget,
                        self.writer_threads,
                    )
                pending = node.pending
                await h.behind.submit(off, buf)
                pending.queued_end = max(pending.queued_end, off + len(buf))
                return len(buf)
            return await self._thread(node.pending.writer.write, off, buf)
        except BaseException as e:
            # A page missing a write is not the page its writer meant: never publish it.
            h.failed = getattr(e, "errno", None) or errno.EIO
            raise

    def _next_version(self, node: Node) -> Pending:
        """A writer holding a copy of a committed page, to be committed over it (thread)."""
        assert node.page is not None
        attrs = node.page.attrs
        writer = self.engine.begin_write(validate_page(node.path))
        try:
            data = self.engine.get(node.path)
            assert isinstance(data, bytes)
            writer.write(0, data)
        except BaseException:
            writer.abort()
            raise
        mode = page_mode(node.page) if ATTR_MODE in attrs else 0o644
        uid, gid = attr_int(attrs, ATTR_UID, 0), attr_int(attrs, ATTR_GID, 0)
        # its other attributes (model, dtype...) go on to the next version
        return Pending(writer, mode, uid, gid, time.time_ns(), attrs=own_attrs(attrs))

    async def _commit_again(self, h: Handle) -> None:
        """Commit a handle's next version of its page over the current one; discard it
        instead when a write to it failed (FUSEError with that errno, so close reports it)
        or its writer was killed by a signal (as a first version would be)."""
        async with h.again_lock:
            again, h.again = h.again, None
            if again is None:  # committed by another flush meanwhile (or never made)
                if h.again_failed:
                    raise fuse_error(h.again_failed)
                return
            h.node.rewriting -= 1
            killed = killed_by(h.opener)
            if h.again_failed or killed:
                await self._abort(again.writer)
                if killed:
                    log_event(
                        "discard",
                        level=logging.WARNING,
                        target=h.node.path,
                        reason=f"its writer was killed by signal {killed} while rewriting it",
                        bytes=again.writer.size,
                    )
                if h.again_failed:
                    raise fuse_error(h.again_failed)
                return
            await self._commit_version(h, again)

    async def _commit_version(self, h: Handle, again: Pending) -> None:
        node = h.node
        if self.table.by_path.get(node.path) != node.ino:  # unlinked or replaced meanwhile:
            await self._abort(again.writer)  # its bytes have no name to go to
            return
        # Under the name the file has now: begun under an older one, renamed since, the
        # version was committed there, bringing that name back over the new one's page
        again.writer.key = validate_page(node.path)
        try:
            node.page, lease, held = await self._thread(self._commit, again, node.path, True)
        except BaseException:
            await self._abort(again.writer)
            raise
        if node.page is None:  # deleted or evicted the instant it appeared
            self.table.unbind(node)
        await self._hold(h, lease, held)

    def _commit(self, w: Pending, path: str, hold: bool) -> tuple[PageRow | None, Any, Any]:
        """(thread) Commit ``w`` as ``path``: its row, and with ``hold`` a lease on that
        version and what it holds. A write handle that stays open after its page was
        committed (a dup's close, a rename) reads that version from then on: not the name,
        which another publisher may replace or unlink (none held, reads ENOENT, when it is
        gone already). One thread hop for all of it.

        Not when the store's directories are gone (removed under the daemon): the commit
        went into the index file still open there, and its close was answered with success
        for a page no restart would find."""
        if self.store_gone():
            w.writer.abort()
            raise OSError(errno.EIO, "the store's directory is gone: nothing is committed")
        info = w.writer.commit(attrs=w.commit_attrs(), replace=True)
        row = self.engine.index.page(path)
        if not hold:
            return row, None, None
        lease = self.engine.lease(path)
        try:
            held = lease.__enter__()
        except KvfsError:  # gone already
            return row, None, None
        if held[1].hash.hex() != info.checksum:  # replaced this instant
            lease.__exit__(None, None, None)
            return row, None, None
        return row, lease, held

    async def _hold(self, h: Handle, lease: Any, held: Any) -> None:
        old, h.lease, h.held = h.lease, lease, held
        if old is not None:
            await self._thread(old.__exit__, None, None, None)

    async def _drain(self, h: Handle) -> None:
        """Wait for a handle's queued writes; a failed one marks the file failed."""
        if h.behind is not None:
            try:
                await h.behind.drain()
            except Exception as e:
                h.failed = h.failed or getattr(e, "errno", None) or errno.EIO
                if not isinstance(e, OSError):  # KvfsErrors are OSErrors or ValueErrors
                    log.error("a queued write failed", exc_info=e)
                elif out_of_files(e):  # (answered as a FUSEError: the guard does not see it)
                    files_error(self, "write", e)

    @guard
    async def flush(self, fh: int) -> None:
        h = self._handle(fh)
        async with h.close_lock:
            await self._flush(h)

    async def _flush(self, h: Handle) -> None:
        # close() sends flush; release follows asynchronously. Committing here makes the page
        # visible when close returns. A flush before any write is a shell's dup2 + close of
        # the original fd (``echo > f``, dd): the writer is not done, release commits.
        pending = h.node.pending
        if h.writable and not h.committed:
            h.killed = h.killed or killed_by(h.opener)
        if h.writable and not h.committed and h.killed:
            await self._finish(h, h.node.path)  # discards it: never a page half-written
        elif h.writable and not h.committed and pending is not None and pending.unlinked:
            # A scratch file (created, then unlinked while open: TemporaryFile) lives until
            # its last close, which is release: this flush is a dup's close (a child that
            # had it as stdout). Only report a write that failed.
            await self._drain(h)
            if h.failed:
                raise fuse_error(h.failed)
        elif h.writable and not h.committed and (h.wrote or h.failed):
            await self._finish(h, h.node.path, hold=True)
        elif h.writable and not h.committed and pending is not None:
            pending.closed_empty = True
        elif h.writable and h.failed:
            # Its commit failed in another descriptor's flush (a child's close of the one
            # it inherited), whose error went to that close: the writer's close must say so
            # too, or it believes a page written that was never published.
            raise fuse_error(h.failed)
        elif h.again is not None:
            await self._commit_again(h)

    @guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        # A page is durable when committed; before that it does not exist. But a write
        # answered at once and written behind may have failed since: say so now, as fsync
        # reports earlier write-back errors (a writer checking fsync, not close, would
        # believe its data safe).
        h = self._handle(fh)
        if h.writable and (not h.committed or h.failed):
            await self._drain(h)
            if h.failed:
                raise fuse_error(h.failed)

    @guard
    async def release(self, fh: int) -> None:
        # (listed until it is closed: a rename onto the file it commits waits for it)
        h = self.handles.get(fh)
        if h is None:
            raise fuse_error(errno.EBADF)
        try:
            async with h.close_lock:
                if h.writable and not h.committed:
                    h.killed = h.killed or killed_by(h.opener)
                    await self._finish(h, h.node.path)
                elif h.again is not None:
                    await self._commit_again(h)
        except pyfuse3.FUSEError:
            if not (h.failed or h.again_failed):  # (those the close reported already)
                raise
        finally:
            self.handles.pop(fh, None)
            await self._close_handle(h)

    async def _close_handle(self, h: Handle) -> None:
        if h.ahead is not None:
            ahead, h.ahead = h.ahead, None
            await ahead.aclose()
        if h.lease is not None:
            lease, h.lease, h.held = h.lease, None, None
            await self._thread(lease.__exit__, None, None, None)
        h.node.opens -= 1
        if h.writable:
            h.node.writers -= 1
        self.table.maybe_drop(h.node)

    async def _finish(self, h: Handle, dst: str, *, hold: bool = False) -> None:
        """Commit (or, if unlinked, discard) the file an open handle is writing, as ``dst``;
        with ``hold``, the handle stays open and reads the committed version (_hold)."""
        node = h.node
        w = node.pending
        assert w is not None
        key = validate_page(dst)
        async with h.write_lock:
            # (no write of this handle is between its check and its queue meanwhile)
            await self._drain(h)
            h.committed = True
        if self.pending.get(node.path) is node:
            del self.pending[node.path]
        if w.unlinked or h.failed or h.killed:
            await self._abort(w.writer)
            self.table.unbind(node)
            if h.killed and not w.unlinked:
                log_event(
                    "discard",
                    level=logging.WARNING,
                    target=node.path,
                    reason=f"its writer was killed by signal {h.killed} before closing it",
                    bytes=max(w.writer.size, w.queued_end),
                )
            if h.failed:
                raise fuse_error(h.failed)  # close() reports it too
            return
        settled = trio.Event()
        names = {node.path, dst}
        for n in names:
            self.settling[n] = settled
        try:
            w.writer.key = key
            row, lease, held = await self._thread(self._commit, w, dst, hold)
        except BaseException as e:
            self.table.unbind(node)
            # Nothing was published: every later write, fsync and close through this
            # handle says so (this flush may be a child's close, not the writer's).
            h.failed = getattr(e, "errno", None) or errno.EIO
            # (a commit that never ran, no thread could be started for it, left the writer
            # holding its room and its files; one that ran is done, and this does nothing;
            # shielded: a cancelled commit's writer is let go of all the same)
            with trio.CancelScope(shield=True):
                await self._abort(w.writer)
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
        if hold:
            await self._hold(h, lease, held)
