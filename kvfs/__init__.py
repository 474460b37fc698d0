"""kvfs: a filesystem-style store for LLM KV-cache pages.

The object API::

    async with kvfs.open_store(kvfs.StoreConfig(data_dirs=["/nvme0/kvfs", "/nvme1/kvfs"])) as s:
        key = kvfs.PageKey.semantic("agent-42", "9f3ab1", 17)
        await s.put(key, tensor_bytes, attrs={"model": "llama-3.3-70b", "dtype": "bf16"})
        await s.get(key, into=aligned_buffer)
"""

from ._aligned import aligned_buffer
from ._checksum import checksum
from ._config import DISK_CAPACITY, StoreConfig, parse_size
from ._control import DaemonUnavailable
from ._engine import Engine, PageWriter
from ._errors import (
    ArchiveAccessDenied,
    ArchiveUnavailable,
    CapacityExceeded,
    CorruptPage,
    IndexUnavailable,
    InvalidKey,
    KvfsError,
    PageExists,
    PageNotFound,
    SessionNotFound,
    StoreClosed,
    StoreLocked,
)
from ._keys import PageKey, session_dir
from ._policy import TieringPolicy
from ._remote import RemoteStore, SyncRemoteStore, open_remote_store, open_remote_store_sync
from ._store import Store, SyncStore, open_store, open_store_sync
from ._types import DeviceStatistics, Extent, PageInfo, SessionInfo, StoreStatistics

__version__ = "0.1.0"

__all__ = [
    "DISK_CAPACITY",
    "ArchiveAccessDenied",
    "ArchiveUnavailable",
    "CapacityExceeded",
    "CorruptPage",
    "DaemonUnavailable",
    "DeviceStatistics",
    "Engine",
    "Extent",
    "IndexUnavailable",
    "InvalidKey",
    "KvfsError",
    "PageExists",
    "PageInfo",
    "PageKey",
    "PageNotFound",
    "PageWriter",
    "RemoteStore",
    "SessionInfo",
    "SessionNotFound",
    "Store",
    "StoreClosed",
    "StoreConfig",
    "StoreLocked",
    "StoreStatistics",
    "SyncStore",
    "SyncRemoteStore",
    "TieringPolicy",
    "aligned_buffer",
    "checksum",
    "open_remote_store",
    "open_remote_store_sync",
    "open_store",
    "open_store_sync",
    "parse_size",
    "session_dir",
]
