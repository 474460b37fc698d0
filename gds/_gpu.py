"""GPU targets: kvikio ``CuFile`` reads into device memory, and host staging then copy.

Everything GPU-related is imported inside functions: importing this module needs neither
cupy nor kvikio, and the host path never calls into it.

* ``kvikio``: each piece is one ``CuFile.pread`` into the right slice of the destination.
  kvikio uses cuFile (real GPUDirect Storage: NVMe DMA straight into GPU memory) where the
  system has it, and its compatibility mode (POSIX reads into a bounce buffer, then a copy)
  otherwise. Verification reads each finished 1 MiB leaf back into pinned host memory and
  hashes it there (``readback``): device-to-host copies run at PCIe speed, several times
  faster than the NVMe they check, and overlap the reads still in flight.
* ``staged``: O_DIRECT reads into page-aligned host memory exactly as the host path, each
  leaf verified on the host, and only verified leaves are copied to the device. Needs cupy
  but not kvikio; the GPU never holds unverified bytes.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import Any

from kvfs import CorruptPage, KvfsError
from kvfs._aligned import address_of, aligned_buffer
from kvfs._checksum import LEAF

from ._host import HostTarget
from ._source import Piece

__all__ = [
    "GPU_SKIP_REASON",
    "BackendUnavailable",
    "KvikioTarget",
    "PinnedPool",
    "StagedTarget",
    "copy_to_device",
    "device_bytes",
    "gpu_status",
    "stage_to_host",
]

GPU_SKIP_REASON = "needs an NVIDIA GPU with kvikio and cupy; run on the device machine"
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


class BackendUnavailable(KvfsError, RuntimeError):
    """The requested backend cannot run here (no GPU, no cupy, no kvikio); the message
    says which and how to install it."""


def gpu_status() -> dict[str, str | None]:
    """``{"cupy": why not or None, "kvikio": why not or None, "kvikio_mode": ...}``.

    Imports cupy and kvikio (only call this when a GPU path is wanted). Never raises.
    """
    out: dict[str, str | None] = {"cupy": None, "kvikio": None, "kvikio_mode": None}
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            out["cupy"] = "no CUDA device"
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
        out["cupy"] = f"cupy unusable: {type(e).__name__}: {e}"
    try:
        import kvikio
        import kvikio.defaults

        out["kvikio_mode"] = kvikio_mode(kvikio)
    except Exception as e:  # noqa: BLE001
        out["kvikio"] = f"kvikio unusable: {type(e).__name__}: {e}"
    if out["cupy"] is not None and out["kvikio"] is None:
        out["kvikio"] = out["cupy"]
    return out


def import_kvikio(threads: int) -> Any:
    """Import kvikio, first defaulting ``KVIKIO_NTHREADS`` to the fast path's thread count:
    kvikio's own pool defaults to one thread, which would serialise every piece. An explicit
    ``KVIKIO_NTHREADS`` wins; it only takes effect before kvikio's first import.
    Raises ImportError."""
    os.environ.setdefault("KVIKIO_NTHREADS", str(max(1, threads)))
    import kvikio

    return kvikio


def kvikio_mode(kvikio: Any) -> str:
    """kvikio's compatibility-mode setting as text (its API changed across releases)."""
    d = kvikio.defaults
    try:
        return f"compat_mode={d.get('compat_mode')}"
    except Exception:  # noqa: BLE001 - older kvikio: compat_mode() -> bool
        return f"compat_mode={d.compat_mode()}"


def device_bytes(obj: object, size: int) -> tuple[Any, int]:
    """A flat ``cupy.uint8`` view of GPU memory (no copy) and its device id.

    Accepts cupy arrays, torch CUDA tensors (any dtype, bf16 included: they are viewed by
    pointer) and any ``__cuda_array_interface__`` object. Raises TypeError, ValueError (not
    contiguous, smaller than ``size``), BackendUnavailable (no cupy).
    """
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            "GPU destinations need cupy: pip install 'kvfs[gpu]' "
            "(CUDA 12) or 'kvfs[gpu-cu13]' (CUDA 13)"
        ) from e
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "element_size", None)):
        t: Any = obj  # a torch tensor: its interface refuses bf16, so go by pointer
        if not t.is_cuda:
            raise TypeError("a CPU torch tensor is host memory: pass tensor.numpy()")
        if not t.is_contiguous():
            raise ValueError("destination tensor must be contiguous")
        nbytes = t.numel() * t.element_size()
        dev = int(t.device.index or 0)
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, device_id=dev)
        flat = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    else:
        arr = obj if isinstance(obj, cupy.ndarray) else cupy.asarray(obj)
        if not arr.flags.c_contiguous:
            raise ValueError("destination array must be C-contiguous")
        flat = arr.reshape(-1).view(cupy.uint8)
        dev = int(arr.device.id)
    if flat.nbytes < size:
        raise ValueError(
            f"destination of {flat.nbytes} bytes is smaller than the page ({size} bytes)"
        )
    return flat, dev


class PinnedPool:
    """A bounded set of pinned host buffers of ``size`` bytes, allocated on first use."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count
        self._free: list[Any] = []
        self._made = 0
        self._cv = threading.Condition()

    def take(self) -> Any:
        with self._cv:
            while not self._free and self._made >= self.count:
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        import cupyx
        import numpy as np

        return cupyx.empty_pinned((self.size,), dtype=np.uint8)

    def give(self, buf: Any) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


def _memcpy(dst: int, src: int, n: int, kind: int, device: int) -> None:
    import cupy

    with cupy.cuda.Device(device):
        cupy.cuda.runtime.memcpy(dst, src, n, kind)


class KvikioTarget:
    """Reads pieces with kvikio ``CuFile.pread`` straight into a GPU buffer."""

    kind = "kvikio"

    def __init__(self, flat: Any, device: int, pinned: PinnedPool, threads: int) -> None:
        self._kvikio = import_kvikio(threads)
        self.flat, self.device, self.pinned = flat, device, pinned

    def open(self, path: str) -> tuple[Any, str]:
        try:
            return self._kvikio.CuFile(path, "r"), path
        except RuntimeError as e:  # kvikio reports a missing file as a RuntimeError
            if not os.path.exists(path):
                raise FileNotFoundError(errno.ENOENT, "no such data file", path) from e
            raise

    def close(self, handle: tuple[Any, str]) -> None:
        handle[0].close()

    def read(self, handle: tuple[Any, str], p: Piece, name: str) -> None:
        import cupy

        f, path = handle
        try:
            with cupy.cuda.Device(self.device):
                got = f.pread(self.flat[p.page_off : p.page_off + p.n], p.n, p.file_off).get()
        except RuntimeError:
            # kvikio's compatibility mode raises for a read past the end of the file
            if _file_size(path, name) < p.file_off + p.n:
                raise CorruptPage(
                    f"page {name!r}: a data file is shorter than its extents"
                ) from None
            raise
        if got != p.n:
            raise CorruptPage(f"page {name!r}: a data file is shorter than its extents")

    def leaf(self, lo: int, hi: int, check: Callable[[memoryview], None] | None) -> None:
        if check is None:
            return
        buf = self.pinned.take()
        try:
            _memcpy(int(buf.ctypes.data), int(self.flat.data.ptr) + lo, hi - lo, _D2H, self.device)
            check(memoryview(buf)[: hi - lo])
        finally:
            self.pinned.give(buf)

    def finish(self) -> None:
        """Nothing to flush: kvikio's reads completed into device memory."""

    def abort(self) -> None:
        """Nothing to undo: the destination is the caller's, left partly written."""


class StagedTarget:
    """O_DIRECT into page-aligned host staging, verify each leaf there, then copy it over."""

    kind = "staged"

    def __init__(self, flat: Any, device: int, size: int, *, direct: bool, bounce: Any) -> None:
        import cupy

        self.flat, self.device = flat, device
        self.staging = aligned_buffer(size)
        self.host = HostTarget(self.staging, direct=direct, bounce=bounce)
        with cupy.cuda.Device(device):
            # the copies go on their own stream, which ``finish`` waits for: a synchronous
            # copy from pageable memory may return before its DMA lands, and work on other
            # non-blocking streams would not wait for it
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def open(self, path: str) -> Any:
        return self.host.open(path)

    def close(self, handle: Any) -> None:
        self.host.close(handle)

    def read(self, handle: Any, p: Piece, name: str) -> None:
        self.host.read(handle, p, name)

    def leaf(self, lo: int, hi: int, check: Callable[[memoryview], None] | None) -> None:
        view = self.staging[lo:hi]
        if check is not None:
            check(view)
        if hi > lo:
            import cupy

            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.memcpyAsync(
                    int(self.flat.data.ptr) + lo, address_of(view), hi - lo, _H2D, self.stream.ptr
                )

    def finish(self) -> None:
        """Wait until every checked leaf's copy has landed on the device (the staging buffer
        goes with this target)."""
        self.stream.synchronize()

    def abort(self) -> None:
        """Nothing to undo: the destination is the caller's, left partly written."""


def _file_size(path: str, name: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError as e:
        raise CorruptPage(f"page {name!r}: a data file is missing ({path})") from e


def copy_to_device(flat: Any, device: int, data: bytes) -> None:
    """Copy host bytes to the start of a flat device buffer and wait until they are there."""
    if not data:
        return
    import cupy
    import numpy as np

    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        flat[: len(data)].set(np.frombuffer(data, np.uint8), stream=stream)
        stream.synchronize()


def stage_to_host(obj: object, chunk: int = 64 * LEAF) -> memoryview:
    """Copy a GPU buffer into a new page-aligned host buffer (for writes: the store hashes
    and writes host bytes, so the checksum is of exactly what was stored)."""
    flat, dev = device_bytes(obj, 0)
    n = int(flat.nbytes)
    buf = aligned_buffer(n)
    for o in range(0, n, chunk):
        take = min(chunk, n - o)
        _memcpy(address_of(buf[o : o + take]), int(flat.data.ptr) + o, take, _D2H, dev)
    return buf
