"""kvfs fast path: page data straight from the striped backing files into GPU or host memory.

Metadata goes through the store (by key) or the mount (by path, ``user.kvfs.extents``);
data is read directly from the backing files, as 3FS splits its KV path. See docs/gds.md.

    with gds.FastPath(store) as fp:
        fp.read(key, gpu_tensor).result()                 # kvikio (GDS or compat mode)
        fp.read(key, kvfs.aligned_buffer(n)).result()     # O_DIRECT, no GPU library
        with fp.load_layers(keys, dests, ahead=2) as layers:
            for i, buf in layers:                         # layer i is in, i+1.. in flight
                ...

Importing this package never imports kvikio or cupy.
"""

from ._fastpath import BACKENDS, FastPath
from ._gpu import GPU_SKIP_REASON, BackendUnavailable, gpu_status
from ._host import UnalignedDestination, is_device_buffer
from ._loader import LayerLoader, wait
from ._source import (
    NotAKvfsPage,
    PageSource,
    decode_extents,
    source_from_engine,
    source_from_mount,
)

__all__ = [
    "BACKENDS",
    "GPU_SKIP_REASON",
    "BackendUnavailable",
    "FastPath",
    "LayerLoader",
    "NotAKvfsPage",
    "PageSource",
    "UnalignedDestination",
    "decode_extents",
    "gpu_status",
    "is_device_buffer",
    "source_from_engine",
    "source_from_mount",
    "wait",
]
