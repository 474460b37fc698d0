"""The host target: O_DIRECT ``preadv`` from the backing files into page-aligned host memory.

Never imports kvikio or cupy: kvikio cannot do any I/O without a CUDA driver, and this path
must work on machines that have none.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kvfs import CorruptPage, KvfsError
from kvfs._aligned import ALIGN, BouncePool, address_of, as_bytes_view, open_direct, round_up

from ._source import Piece

__all__ = ["HostTarget", "UnalignedDestination", "host_view", "is_device_buffer"]


class UnalignedDestination(KvfsError, ValueError):
    """A host destination is not 4 KiB aligned, so O_DIRECT cannot read into it.

    Allocate with :func:`kvfs.aligned_buffer` (or numpy over it), or pass
    ``allow_unaligned=True`` to read through bounce buffers (one extra memory copy).
    """


def is_device_buffer(obj: object) -> bool:
    """True for GPU memory: cupy arrays, torch CUDA tensors, anything exposing
    ``__cuda_array_interface__``. Never imports a GPU library."""
    try:
        return getattr(obj, "__cuda_array_interface__", None) is not None
    except (AttributeError, TypeError, RuntimeError):
        # torch CPU tensors raise from the property; some dtypes raise TypeError.
        return bool(getattr(obj, "is_cuda", False))


def host_view(obj: object, size: int) -> memoryview:
    """A writable, flat byte view of a host buffer at least ``size`` bytes long.

    Raises TypeError (not a writable buffer), ValueError (not C-contiguous, too small).
    """
    mv = as_bytes_view(obj, "destination", writable=True, kinds="or GPU memory")
    if len(mv) < size:
        raise ValueError(f"destination of {len(mv)} bytes is smaller than the page ({size} bytes)")
    return mv


def _pread_into(fd: int, buf: memoryview, off: int) -> int:
    """Read until ``buf`` is full or EOF; returns bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], off + done)
        if n == 0:
            break
        done += n
    return done


class HostTarget:
    """Reads pieces into one host buffer; thread-safe (pieces never overlap)."""

    kind = "host"

    def __init__(self, dest: memoryview, *, direct: bool, bounce: BouncePool) -> None:
        self.dest = dest
        self.direct = direct
        self.bounce = bounce
        self.base_aligned = address_of(dest) % ALIGN == 0 if len(dest) else True

    def open(self, path: str) -> tuple[int, bool]:
        return open_direct(path, os.O_RDONLY, direct=self.direct)

    def close(self, handle: Any) -> None:
        os.close(handle[0])

    def read(self, handle: tuple[int, bool], p: Piece, name: str) -> None:
        fd, direct = handle
        target = self.dest[p.page_off : p.page_off + p.n]
        if not direct:
            if _pread_into(fd, target, p.file_off) < p.n:
                raise CorruptPage(f"page {name!r}: a data file is shorter than its extents")
            return
        done = 0
        if p.file_off % ALIGN == 0 and address_of(target) % ALIGN == 0:
            head = p.n - p.n % ALIGN
            if head:
                if _pread_into(fd, target[:head], p.file_off) < head:
                    raise CorruptPage(f"page {name!r}: a data file is shorter than its extents")
                done = head
        # The unaligned remainder (a page's last partial 4 KiB, or everything when the
        # destination is unaligned) goes through an aligned bounce buffer.
        while done < p.n:
            fo = p.file_off + done
            base = fo - fo % ALIGN
            b = self.bounce.take()
            try:
                want = min(p.n - done, len(b) - (fo - base))
                span = round_up(fo - base + want)
                if _pread_into(fd, b[:span], base) < fo - base + want:
                    raise CorruptPage(f"page {name!r}: a data file is shorter than its extents")
                target[done : done + want] = b[fo - base : fo - base + want]
            finally:
                self.bounce.give(b)
            done += want

    def leaf(self, lo: int, hi: int, check: Callable[[memoryview], None] | None) -> None:
        """Check a finished leaf in place: the bytes are already where the caller wants them."""
        if check is not None:
            check(self.dest[lo:hi])

    def finish(self) -> None:
        """Nothing to flush: every byte was read straight into the destination."""

    def abort(self) -> None:
        """Nothing to undo: the destination is the caller's, left partly written."""
