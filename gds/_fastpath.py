""":class:`FastPath`: page data straight from the striped backing files into a buffer.

Backends (``backend=`` on the constructor or per call):

* ``"host"``: O_DIRECT ``preadv`` into page-aligned host memory in parallel threads.
  Never imports kvikio or cupy.
* ``"kvikio"``: kvikio ``CuFile.pread`` into GPU memory (GPUDirect Storage where present,
  kvikio's compatibility mode otherwise).
* ``"staged"``: O_DIRECT into host staging, verify, copy to the GPU (cupy, no kvikio).
* ``"auto"`` (default): ``host`` for host buffers; for GPU buffers ``kvikio`` if it imports,
  else ``staged``. Deciding never imports a GPU library for a host buffer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import trio

from kvfs import CorruptPage, PageInfo, PageKey
from kvfs._aligned import BouncePool, address_of, as_bytes_view
from kvfs._checksum import LEAF
from kvfs._keys import as_key
from kvfs._local import is_disk_error
from kvfs._mountinfo import kvfs_mount_of_fd
from kvfs._writes import check_attrs

from ._gpu import (
    BackendUnavailable,
    KvikioTarget,
    PinnedPool,
    StagedTarget,
    copy_to_device,
    device_bytes,
    import_kvikio,
)
from ._gpu import stage_to_host as _stage_to_host
from ._host import HostTarget, UnalignedDestination, host_view, is_device_buffer
from ._loader import LayerLoader, wait
from ._read import PageRead, Target
from ._source import ALIGN, DEFAULT_PIECE, PageSource, source_from_engine, source_from_mount

__all__ = ["BACKENDS", "FastPath"]

BACKENDS = ("auto", "host", "kvikio", "staged")
KeyLike = PageKey | str
T = TypeVar("T")


class FastPath:
    """Reads (and writes) pages bypassing the store's copy and the FUSE daemon.

    ``store`` is a :class:`kvfs.Store`, :class:`kvfs.SyncStore` or :class:`kvfs.Engine`
    (None for by-path reads only). The fast path owns an I/O pool (``threads`` readers:
    each piece of a striped page is one request, so every device is read in parallel) and
    a hash pool, unless pools are given. ``verify`` (default True) checks every byte against
    the stored BLAKE3 leaves; turning it off is for benchmarks of the raw path.

    Calls that return futures raise argument errors (TypeError, ValueError, InvalidKey,
    UnalignedDestination, BackendUnavailable) and lookup errors (PageNotFound) at once;
    the future raises CorruptPage (checksum mismatch, missing or short data file) or OSError
    (docs/gds.md lists them all).
    A future resolves only after every byte is in the destination, the data is verified,
    and the lease is released. Futures cannot be cancelled once returned.
    """

    def __init__(
        self,
        store: Any = None,
        *,
        backend: str = "auto",
        threads: int = 8,
        hash_threads: int | None = None,
        verify: bool = True,
        max_piece: int = DEFAULT_PIECE,
        direct: bool = True,
        allow_unaligned: bool = False,
        io_pool: Executor | None = None,
        hash_pool: Executor | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if max_piece <= 0 or max_piece % ALIGN:
            raise ValueError(f"max_piece must be a positive multiple of {ALIGN}")
        self.engine = getattr(store, "engine", store)
        if self.engine is not None and not hasattr(self.engine, "lease"):
            raise TypeError(
                "FastPath needs a store opened here (kvfs.Store, kvfs.SyncStore, kvfs.Engine) "
                f"or None for reads by path, not {type(store).__name__}"
            )
        if threads <= 0:
            raise ValueError("threads must be > 0")
        self.backend = backend
        self.verify = verify
        self.max_piece = max_piece
        self.direct = direct
        self.allow_unaligned = allow_unaligned
        self.threads = threads
        self._own: list[ThreadPoolExecutor] = []
        self._io = io_pool or self._pool(threads, "kvfs-gds-io")
        self._hash = hash_pool or self._pool(
            hash_threads or max(2, os.cpu_count() or 2), "kvfs-gds-hash"
        )
        self._writer = self._pool(2, "kvfs-gds-write")
        # Aligned destinations only bounce a page's last partial 4 KiB; unaligned ones
        # (allow_unaligned) bounce every byte, at most this many MiB at a time.
        self._bounce = BouncePool(LEAF, 4)
        self._pinned = PinnedPool(LEAF, max(2, os.cpu_count() or 2))
        self._closed = False
        # reads and writes in flight (a read by key may start again after a heal): close
        # waits for them before it stops the pools, its own or the caller's
        self._inflight: set[Future[Any]] = set()
        self._inflight_lock = threading.Lock()

    def _pool(self, n: int, name: str) -> ThreadPoolExecutor:
        p = ThreadPoolExecutor(n, thread_name_prefix=name)
        self._own.append(p)
        return p

    # -- choosing a backend -----------------------------------------------------------
    def backend_for(self, dest: object, backend: str | None = None) -> str:
        """The backend a read into ``dest`` would use. Raises BackendUnavailable, ValueError."""
        b = backend or self.backend
        if b not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {b!r}")
        device = is_device_buffer(dest)
        if b == "auto":
            if not device:
                return "host"
            try:
                import_kvikio(self.threads)
            except ImportError:
                return "staged"
            return "kvikio"
        if b == "host" and device:
            raise ValueError(
                "the host backend reads into host memory; this destination is "
                "GPU memory (use backend='kvikio' or 'staged')"
            )
        if b in ("kvikio", "staged") and not device:
            raise ValueError(
                f"the {b} backend reads into GPU memory; for host buffers use "
                "backend='host' (O_DIRECT, no GPU library involved)"
            )
        if b == "kvikio":
            try:
                import_kvikio(self.threads)
            except ImportError as e:
                raise BackendUnavailable(
                    "backend 'kvikio' needs kvikio: pip install "
                    "'kvfs[gpu]' (CUDA 12) or 'kvfs[gpu-cu13]' (CUDA 13)"
                ) from e
        return b

    def _check(self, b: str, dest: object, size: int, allow_unaligned: bool) -> None:
        """Refuse a destination :meth:`_target` would refuse, building nothing: a page only
        the archive holds is restored after this (it was restored, then the destination
        refused). Raises what _target raises."""
        if b == "host":
            view = host_view(dest, size)[:size]
            if address_of(view) % ALIGN and self.direct and not allow_unaligned:
                raise UnalignedDestination(
                    "destination is not 4 KiB aligned: allocate it with kvfs.aligned_buffer "
                    "(or numpy over one), or pass allow_unaligned=True to read through "
                    "bounce buffers"
                )
        else:
            device_bytes(dest, size)

    def _target(self, b: str, dest: object, size: int, allow_unaligned: bool) -> Target:
        if b == "host":
            self._check(b, dest, size, allow_unaligned)
            return HostTarget(host_view(dest, size)[:size], direct=self.direct, bounce=self._bounce)
        flat, dev = device_bytes(dest, size)
        if b == "kvikio":
            return KvikioTarget(flat[:size], dev, self._pinned, self.threads)
        return StagedTarget(flat[:size], dev, size, direct=self.direct, bounce=self._bounce)

    # -- reads ------------------------------------------------------------------------
    def _start(
        self,
        make_source: Callable[[Callable[[int], None]], PageSource],
        into: object,
        backend: str | None,
        verify: bool | None,
        allow_unaligned: bool | None,
    ) -> Future[int]:
        b = self.backend_for(into, backend)
        unaligned = self.allow_unaligned if allow_unaligned is None else allow_unaligned
        src = make_source(lambda size: self._check(b, into, size, unaligned))
        try:
            if src.held is not None:
                return self._copy_held(b, into, src, unaligned)
            target = self._target(b, into, src.size, unaligned)
        except BaseException:
            src.release(False)
            raise
        read = PageRead(
            src,
            target,
            io_pool=self._io,
            hash_pool=self._hash,
            verify=self.verify if verify is None else verify,
            max_piece=self.max_piece,
        )
        return read.start()

    def _copy_held(self, b: str, into: object, src: PageSource, unaligned: bool) -> Future[int]:
        """A page whose verified bytes are in memory (see PageSource.held): copied into the
        destination now, with the argument checks of a read from the backing files."""
        data = src.held
        assert data is not None
        if b == "host":
            self._target(b, into, src.size, unaligned)  # refuses what a file read refuses
            host_view(into, src.size)[: src.size] = data
        else:
            flat, dev = device_bytes(into, src.size)
            copy_to_device(flat, dev, data)
        src.release(True)
        out: Future[int] = Future()
        out.set_running_or_notify_cancel()
        out.set_result(src.size)
        return out

    def _need_engine(self) -> Any:
        if self.engine is None:
            raise ValueError("reads by key need a store: FastPath(store)")
        return self.engine

    def read(
        self,
        key: KeyLike,
        into: object,
        *,
        backend: str | None = None,
        verify: bool | None = None,
        allow_unaligned: bool | None = None,
    ) -> Future[int]:
        """Start reading page ``key`` into ``into``; the future gives the page size.

        The page is leased before this returns and until the future resolves: eviction and
        delete leave its files in place meanwhile. Raises PageNotFound now; the future
        raises CorruptPage.
        """
        eng = self._need_engine()
        sources: list[PageSource] = []
        around: list[OSError] = []  # the disk error a second read goes around

        def make(check: Callable[[int], None]) -> PageSource:
            src = source_from_engine(
                eng, key, check=check, disk_error=around[0] if around else None
            )
            sources.append(src)
            return src

        def start(disk_error: OSError | None = None) -> Future[int]:
            if disk_error is not None:
                around.append(disk_error)
            return self._start(make, into, backend, verify, allow_unaligned)

        out: Future[int] = self._begin()
        try:
            first = start()
        except BaseException as e:
            out.set_exception(e)  # (no longer in flight)
            raise
        first.add_done_callback(lambda f: self._heal_or_pass(eng, sources, f, out, start))
        return out

    def _begin(self) -> Future[Any]:
        """The future of a call under way, in flight from now on: :meth:`close` waits for
        it until it resolves, so the caller resolves it whatever happens. Raises
        RuntimeError when closed (checked with the same lock as close's, so a call either
        sees it closed or is waited for)."""
        out: Future[Any] = Future()
        out.set_running_or_notify_cancel()  # as a read's own: one in flight is not called back
        with self._inflight_lock:
            if self._closed:
                raise RuntimeError("this FastPath is closed")
            self._inflight.add(out)
        out.add_done_callback(self._forget)
        return out

    def _forget(self, f: Future[Any]) -> None:
        with self._inflight_lock:
            self._inflight.discard(f)

    @staticmethod
    def _heal_or_pass(
        eng: Any,
        sources: list[PageSource],
        done: Future[int],
        out: Future[int],
        start: Callable[..., Future[int]],
    ) -> None:
        """``done``'s outcome into ``out``; when the local copy failed its checksum and the
        archive holds the page, that copy (the data the failed read was given, even if the
        key names other data by now) is replaced from the archive, as ``get`` does, and the
        read runs once more. When its disk failed (EIO...), the read runs once more from
        the archive's copy held in memory, as ``get``'s does (the local copy stays)."""
        err = done.exception()
        blob = sources[-1].blob if sources else None
        if isinstance(err, OSError) and is_disk_error(err) and blob is not None and blob.archived:
            try:
                start(disk_error=err).add_done_callback(lambda f: _settle(out, f))
            except BaseException as e:  # never leave ``out`` unresolved
                out.set_exception(e)
            return
        if not isinstance(err, CorruptPage):
            _settle(out, done)
            return
        try:
            eng.corrupt_read(str(err))  # counted and logged, as a get's
            if blob is None:
                raise err
            if eng.index.blob(blob.hash) is not None:
                eng.heal(blob, err)  # raises err when there is no other copy
            # else the data read is gone (its key replaced or deleted since): the key's
            # current data, or PageNotFound, is the answer
            start().add_done_callback(lambda f: _settle(out, f))
        except BaseException as e:  # never leave ``out`` unresolved
            out.set_exception(e)

    def read_path(
        self,
        path: str | os.PathLike[str],
        into: object,
        *,
        backend: str | None = None,
        verify: bool | None = None,
        allow_unaligned: bool | None = None,
    ) -> Future[int]:
        """Start reading a page file on a kvfs mount by its ``user.kvfs.extents`` xattr.

        The file stays open (the daemon's lease) until the future resolves. Only the root
        checksum is known by path, so corruption is reported once all bytes are in. A read
        that fails its checksum, or finds a data file gone, is done once more through the
        file opened at the call (the mount verifies, and from the archive heals, what it
        serves, and reads the page that file holds, whatever the name holds by then): the
        attributes are the inode's, not the open file's, so another process's open of a
        name replaced behind the kernel's back could hand this read another page's
        extents, unleased. Raises FileNotFoundError, NotAKvfsPage, and CorruptPage for
        attributes that do not parse, now; the future raises CorruptPage (the fast read's
        error, whatever the read through the mount then failed with).
        """
        out: Future[int] = self._begin()  # (before the open: a closed FastPath says so)

        def start(through: bool = False) -> Future[int]:
            return self._start(
                lambda check: source_from_mount(path, through=through, handle=handle, check=check),
                into,
                backend,
                verify,
                allow_unaligned,
            )

        try:
            # opened once, for the read and for its second try: a second open of the name
            # would read whatever the name holds by then, or find it gone
            handle = os.open(path, os.O_RDONLY)
            try:
                first = start()
            except BaseException:
                os.close(handle)
                raise
        except BaseException as e:
            out.set_exception(e)  # (no longer in flight)
            raise
        first.add_done_callback(lambda f: self._through_or_pass(handle, f, out, start))
        return out

    @staticmethod
    def _through_or_pass(
        handle: int,
        done: Future[int],
        out: Future[int],
        start: Callable[..., Future[int]],
    ) -> None:
        """``done``'s outcome into ``out``; a CorruptPage of a file opened on a kvfs
        mount (``handle``'s mount, not what its name leads to by now) is answered by a read
        through the mount instead (a file elsewhere, with attributes of its own making, has
        nothing that verifies it). ``handle`` is closed before ``out`` resolves, as a
        read's own files are."""
        err = done.exception()
        is_open = [True]

        def settle(f: Future[int], error: BaseException | None = None) -> None:
            """``error``, else ``f``'s outcome, into ``out``, once ``handle`` is closed."""
            if is_open:
                is_open.clear()
                try:
                    os.close(handle)
                except OSError as e:
                    error = error or f.exception() or e
            if error is not None:
                out.set_exception(error)
            else:
                _settle(out, f)

        try:
            if not isinstance(err, CorruptPage) or kvfs_mount_of_fd(handle) is None:
                settle(done)
                return

            def second(f: Future[int]) -> None:
                # (the first error says which bytes)
                settle(f, err if f.exception() is not None else None)

            start(through=True).add_done_callback(second)
        except BaseException as e:  # never leave ``out`` unresolved
            if not out.done():
                settle(done, err if isinstance(err, CorruptPage) else e)

    def read_many(
        self, keys: Sequence[KeyLike], intos: Sequence[object], **kw: Any
    ) -> list[Future[int]]:
        """Start reading many pages at once (all layers of a prefix); their pieces share the
        pool in order, so the reads overlap and the first pages finish first. If a lookup
        fails, the reads already started are waited for, then the error is raised: nothing
        writes into a destination after that (a caller may prefill into them)."""
        if len(keys) != len(intos):
            raise ValueError("need one destination per key")
        started: list[Future[int]] = []
        try:
            for k, d in zip(keys, intos, strict=True):
                started.append(self.read(k, d, **kw))
        except BaseException:
            wait_futures(started)
            raise
        return started

    def layer_keys(self, session: str, prefix: str) -> list[str]:
        """The page paths of one prefix of a session, in layer order (``layer-NNN`` by
        number, then other names by name), ready for :meth:`read_many` / :meth:`load_layers`."""
        eng = self._need_engine()

        def order(path: str) -> tuple[int, int, str]:
            n = PageKey(path).layer_index  # layer-NNN: by number (layer-1000 after 999)
            return (0, n, path) if n is not None else (1, 0, path)

        return sorted((p.path for p in eng.list(session=session, prefix=prefix)), key=order)

    def load_layers(
        self, keys: Sequence[KeyLike], intos: Sequence[Any], *, ahead: int | None = None, **kw: Any
    ) -> LayerLoader[Any]:
        """A :class:`LayerLoader` over ``keys`` (in layer order), reading ``ahead`` layers
        beyond the one being consumed (None: all at once)."""
        if len(keys) != len(intos):
            raise ValueError("need one destination per key")
        return LayerLoader(lambda i: self.read(keys[i], intos[i], **kw), intos, ahead)

    # -- writes -----------------------------------------------------------------------
    def write(
        self,
        key: KeyLike,
        data: object,
        *,
        attrs: dict[str, str] | None = None,
        pin: bool = False,
        replace: bool = False,
    ) -> Future[PageInfo]:
        """Store ``data`` (host buffer or GPU memory) as a new page through the store.

        GPU memory is first copied into page-aligned host memory; the store then writes the
        striped files with O_DIRECT, computes the BLAKE3 leaves of exactly those bytes and
        commits the index entry, so index and checksum are right by construction. The
        source buffer may be reused once the future resolves. Raises InvalidKey (the key,
        attrs), TypeError, ValueError (not a C-contiguous buffer) now; the future raises
        PageExists, CapacityExceeded as ``Store.put`` does.
        """
        eng = self._need_engine()
        out: Future[PageInfo] = self._begin()
        try:
            # The arguments are checked at the call, as a read's are; the future raises
            # what the store answers
            k, attrs = as_key(key), check_attrs(attrs)
            device = is_device_buffer(data)
            host_data = None if device else as_bytes_view(data, kinds="or GPU memory")

            def run() -> PageInfo:
                host = _stage_to_host(data) if device else host_data
                return eng.put(k, host, attrs=attrs, pin=pin, replace=replace)

            # (close waits for ``out``, so the pool is not stopped under this submit)
            self._writer.submit(run).add_done_callback(lambda f: _settle(out, f))
        except BaseException as e:
            out.set_exception(e)  # (no longer in flight)
            raise
        return out

    # -- trio -------------------------------------------------------------------------
    async def aread(self, key: KeyLike, into: object, **kw: Any) -> int:
        """``await`` form of :meth:`read` for trio (lookup in a worker thread)."""
        fut = await trio.to_thread.run_sync(lambda: self.read(key, into, **kw))
        return await wait(fut)

    async def aread_path(self, path: str | os.PathLike[str], into: object, **kw: Any) -> int:
        fut = await trio.to_thread.run_sync(lambda: self.read_path(path, into, **kw))
        return await wait(fut)

    async def aload_layers(
        self, keys: Sequence[KeyLike], intos: Sequence[Any], *, ahead: int | None = None, **kw: Any
    ) -> LayerLoader[Any]:
        """:meth:`load_layers` for trio: made in a worker thread, since the first reads start
        as it is made (each looks its page up, and restores one only the archive holds)."""
        return await trio.to_thread.run_sync(
            lambda: self.load_layers(keys, intos, ahead=ahead, **kw)
        )

    async def awrite(self, key: KeyLike, data: object, **kw: Any) -> PageInfo:
        return await wait(self.write(key, data, **kw))

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Wait for reads and writes in flight, then stop the pools it owns. Idempotent."""
        with self._inflight_lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._inflight)  # every call under way: see _begin
        wait_futures(pending)  # a read that heals reads again, on these pools
        for p in (self._writer, self._io, self._hash):
            if p in self._own:
                p.shutdown(wait=True)

    def __enter__(self) -> FastPath:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _settle(out: Future[T], done: Future[T]) -> None:
    """Copy a finished future's result or exception into ``out``."""
    err = done.exception()
    if err is not None:
        out.set_exception(err)
    else:
        out.set_result(done.result())
