"""Page-aligned buffers and O_DIRECT helpers shared by the local tier and the fast path."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np

__all__ = [
    "ALIGN",
    "BouncePool",
    "address_of",
    "as_bytes_view",
    "aligned_buffer",
    "heap_view",
    "is_aligned",
    "open_direct",
    "round_up",
]

ALIGN = 4096


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_buffer(size: int) -> memoryview:
    """A zero-filled, page-aligned, writable buffer (anonymous mmap) of ``size`` bytes."""
    m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(m)[:size]


def heap_view(n: int) -> memoryview:
    """An ``n``-byte, 4 KiB-aligned, writable view of memory from the heap (not zeroed).

    For O_DIRECT I/O through short-lived buffers: a fresh mmap (:func:`aligned_buffer`)
    costs page faults and zeroing on every call, while heap blocks are reused warm (the
    mount keeps freed blocks in its heap, see ``kvfs._fuse.keep_heap``). The view keeps its
    block alive."""
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return memoryview(raw[start : start + n])  # type: ignore[arg-type]


def address_of(buf: Any) -> int:
    """Address of a buffer's first byte (read-only buffers included)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(memoryview(buf)) else 0


def is_aligned(buf: memoryview, a: int = ALIGN) -> bool:
    return len(buf) % a == 0 and address_of(buf) % a == 0


def open_direct(
    path: str | os.PathLike[str], flags: int, mode: int = 0o640, direct: bool = True
) -> tuple[int, bool]:
    """Open with O_DIRECT where the filesystem allows it; returns (fd, is_direct).

    tmpfs and some overlay filesystems refuse O_DIRECT with EINVAL: fall back to buffered I/O
    there rather than fail, and let the caller know.
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno != 22:  # EINVAL: no O_DIRECT on this filesystem
                raise
    return os.open(path, flags, mode), False


class BouncePool:
    """A bounded pool of aligned buffers for data whose source or target is not aligned."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self._free = [aligned_buffer(size) for _ in range(count)]
        self._cv = threading.Condition()

    def take(self) -> memoryview:
        with self._cv:
            while not self._free:
                self._cv.wait()
            return self._free.pop()

    def give(self, buf: memoryview) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


def as_bytes_view(
    data: object, what: str = "page data", *, writable: bool = False, kinds: str = ""
) -> memoryview:
    """A flat byte view of a C-contiguous buffer. ``what`` names it in errors; ``kinds``
    adds to the list of accepted types in the message (``"or GPU memory"``).

    Raises TypeError (not a buffer, or read-only where ``writable``), ValueError (strided).
    """
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must be a {'writable ' if writable else ''}buffer (bytes, bytearray, "
            f"numpy array, kvfs.aligned_buffer){' ' + kinds if kinds else ''}, "
            f"not {type(data).__name__}{_tensor_hint(data)}"
        ) from None
    if mv.format == "O" or getattr(getattr(data, "dtype", None), "hasobject", False):
        # numpy dtype=object: pointers, meaningless in any other process
        raise TypeError(f"{what} holds Python objects (dtype object), not bytes")
    if writable and mv.readonly:
        raise TypeError(f"{what} is read-only")
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous buffer")
    if mv.nbytes == 0:  # cast() refuses a shape with a zero in it: (0, heads, dim)
        return memoryview(bytearray()) if not mv.readonly else memoryview(b"")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _tensor_hint(data: object) -> str:
    """How to pass a torch tensor, which has no buffer interface: its ``numpy()`` refuses
    bf16, the dtype of most KV caches; a byte view of it works for every dtype."""
    if not (callable(getattr(data, "data_ptr", None)) and hasattr(data, "is_cuda")):
        return ""
    if getattr(data, "is_cuda", False):
        return " (a CUDA tensor is GPU memory: gds.FastPath reads and writes it)"
    return " (a CPU tensor: pass tensor.view(torch.uint8).numpy(), a view of its bytes)"
