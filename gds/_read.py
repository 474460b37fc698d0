"""One page read in flight: pieces on the I/O pool, leaf checks on the hash pool, a future.

The same machinery drives every target (host memory, kvikio into GPU memory, host staging
then GPU): a target reads pieces and hands out each finished 1 MiB leaf for checking. The
read never blocks a pool thread waiting on another task, so any pool sizes work, one
thread included.

Order of events for a page:

1. the source is already held (lease or open mount file) when the read starts;
2. every piece is queued on the I/O pool in page order (striped pages: devices alternate);
   a data file is opened for its first piece and closed after its last;
3. when the last byte of a leaf is in, that leaf is queued on the hash pool, so hashing
   overlaps the reads still in flight; a leaf whose digest differs from the stored one
   fails the read;
4. when every piece and leaf task has finished (failed ones included), the root checksum is
   checked, the target finishes, files still open (a failed read's) are closed, the source
   is released, and only then is the future resolved. After the future resolves nothing
   writes into the destination.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from kvfs import CorruptPage
from kvfs._checksum import DIGEST, LEAF, leaf_hash, n_leaves, tree_hash

from ._source import PageSource, Piece, plan_pieces

__all__ = ["PageRead", "Target"]


class Target(Protocol):
    """Where a page read puts its bytes (see ``_host.HostTarget``, ``_gpu``)."""

    kind: str

    def open(self, path: str) -> Any: ...

    def close(self, handle: Any) -> None: ...

    def read(self, handle: Any, p: Piece, name: str) -> None: ...

    def leaf(self, lo: int, hi: int, check: Callable[[memoryview], None] | None) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class PageRead:
    """Drives one page read; create, then :meth:`start`. Resolves ``future`` with the size."""

    def __init__(
        self,
        src: PageSource,
        target: Target,
        *,
        io_pool: Executor,
        hash_pool: Executor,
        verify: bool,
        max_piece: int,
    ) -> None:
        self.src = src
        self.target = target
        self.io_pool = io_pool
        self.hash_pool = hash_pool
        self.verify = verify
        self.max_piece = max_piece
        self.future: Future[int] = Future()
        self.future.set_running_or_notify_cancel()  # reads in flight cannot be called back
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._outstanding = 1  # the starter's own token, dropped at the end of start()
        size = src.size
        self._remaining = [min(LEAF, size - i * LEAF) for i in range(n_leaves(size))]
        self._digests: list[bytes] = [b""] * len(self._remaining)
        self._handles: dict[int, Any] = {}
        self._open_locks = [threading.Lock() for _ in src.files]
        # pieces not yet done, by file: a file is closed after its last one, not when the
        # read resolves (its leaves may wait for the hash pool long after: a batch would
        # hold a descriptor per page and device until hashing catches up)
        self._pieces_left = [0] * len(src.files)

    # -- driving ----------------------------------------------------------------------
    def start(self) -> Future[int]:
        try:
            pieces = plan_pieces(self.src, self.max_piece)
            for p in pieces:
                self._pieces_left[p.file] += 1
            if self.src.size == 0:
                self._schedule_leaves([0])
            with self._lock:
                self._outstanding += len(pieces)
            for i, p in enumerate(pieces):
                try:
                    self.io_pool.submit(self._piece, p)
                except BaseException:
                    with self._lock:
                        self._outstanding -= len(pieces) - i
                    raise
        except BaseException as e:
            self._fail(e)
        finally:
            self._done_one()
        return self.future

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e

    def _done_one(self) -> None:
        with self._lock:
            self._outstanding -= 1
            last = self._outstanding == 0
        if last:
            self._finalize()

    def _handle(self, fi: int) -> Any:
        with self._open_locks[fi]:
            h = self._handles.get(fi)
            if h is None:
                try:
                    h = self.target.open(self.src.files[fi])
                except FileNotFoundError as e:
                    raise CorruptPage(
                        f"page {self.src.name!r}: a data file is missing ({e.filename})"
                    ) from e
                self._handles[fi] = h
            return h

    def _close_after(self, fi: int) -> None:
        """One piece of file ``fi`` is done: close the file after its last."""
        with self._lock:
            self._pieces_left[fi] -= 1
            last = self._pieces_left[fi] == 0
        if last:
            with self._open_locks[fi]:
                h = self._handles.pop(fi, None)
            if h is not None:
                self.target.close(h)

    def _piece(self, p: Piece) -> None:
        try:
            if self._error is not None:
                return  # an earlier failure: skip the I/O, the read fails anyway
            try:
                self.target.read(self._handle(p.file), p, self.src.name)
            except BaseException as e:
                self._fail(e)  # (before a failed close's: the first error is reported)
                raise
            finally:
                self._close_after(p.file)
            ready = []
            lo, hi = p.page_off, p.page_off + p.n
            with self._lock:
                for leaf in range(lo // LEAF, (hi - 1) // LEAF + 1):
                    overlap = min(hi, (leaf + 1) * LEAF) - max(lo, leaf * LEAF)
                    self._remaining[leaf] -= overlap
                    if self._remaining[leaf] == 0:
                        ready.append(leaf)
            self._schedule_leaves(ready)
        except BaseException as e:
            self._fail(e)
        finally:
            self._done_one()

    def _schedule_leaves(self, leaves: list[int]) -> None:
        for leaf in leaves:
            with self._lock:
                self._outstanding += 1
            try:
                self.hash_pool.submit(self._leaf, leaf)
            except BaseException as e:
                with self._lock:
                    self._outstanding -= 1
                self._fail(e)
                return

    def _leaf(self, i: int) -> None:
        try:
            if self._error is not None:
                return
            lo, hi = i * LEAF, min(self.src.size, (i + 1) * LEAF)
            self.target.leaf(lo, hi, (lambda v: self._check(i, v)) if self.verify else None)
        except BaseException as e:
            self._fail(e)
        finally:
            self._done_one()

    def _check(self, i: int, view: memoryview) -> None:
        d = leaf_hash(view)
        self._digests[i] = d
        want = self.src.leaves
        if want is not None and want[i * DIGEST : (i + 1) * DIGEST] != d:
            raise self._corrupt(i)

    def _corrupt(self, i: int | None) -> CorruptPage:
        if i is None:
            return CorruptPage(
                f"page {self.src.name!r} is corrupt: its bytes do not match its checksum"
            )
        return CorruptPage(
            f"page {self.src.name!r} is corrupt: bytes {i * LEAF}-"
            f"{min(self.src.size, (i + 1) * LEAF)} do not match the checksum"
        )

    def _finalize(self) -> None:
        err = self._error
        if (
            err is None
            and self.verify
            and tree_hash(self.src.size, b"".join(self._digests)) != self.src.checksum
        ):
            err = self._corrupt(None)
        if err is None:
            try:
                self.target.finish()
            except BaseException as e:
                err = e
        for h in self._handles.values():
            try:
                self.target.close(h)
            except OSError as e:
                err = err or e
        if err is not None:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.target.abort()
        try:
            self.src.release(err is None)
        except BaseException as e:
            err = err or e
        if err is None:
            self.future.set_result(self.src.size)
        else:
            self.future.set_exception(err)
