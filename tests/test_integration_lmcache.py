"""LMCache's filesystem storage (the ``fs`` remote connector) on kvfs, unchanged.

LMCache writes one file per 256-token chunk (a 28-byte metadata header, then the KV
tensor bytes) into any directory: the kvfs mount is meant to be that directory. These
tests drive the real connector from the ``lmcache`` package on CPU torch:

* chunks stored by LMCache load back bit-exactly, from a fresh connector (a new process's
  view), and each file holds the tensor bytes unchanged after LMCache's header;
* the files carried through a kvfs store (object API pages named ``lmcache/<file>``) and
  written out to another directory are read back by LMCache bit-exactly.

The round trip runs with the connector's directory on a real kvfs FUSE mount and on a
plain directory.
Heavy (``lmcache`` pulls about 1.9 GB): in its own extra. Run this suite with::

    python -m venv /path/lmcache-venv
    /path/lmcache-venv/bin/pip install torch==2.13.0     # CPU wheel first
    /path/lmcache-venv/bin/pip install -e '.[dev,engines,lmcache]'
    /path/lmcache-venv/bin/pytest tests/test_integration_lmcache.py
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs the engines extra: pip install -e .[engines]")
pytest.importorskip(
    "lmcache",
    reason="needs the lmcache extra (heavy: see this module's "
    "docstring for a separate venv): pip install -e .[lmcache]",
)

import torch  # noqa: E402

with warnings.catch_warnings():
    # The same deprecation as below (pytestmark), raised at import time.
    warnings.filterwarnings(
        "ignore",
        message="`LoggingHandler` in `opentelemetry-sdk` is deprecated",
        category=DeprecationWarning,
    )
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend


import kvfs  # noqa: E402

# lmcache 0.5.6 installs opentelemetry's deprecated LoggingHandler whenever it creates a
# logger (at import and while discovering its connector modules); that is not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning"
)

LAYERS, CHUNK, KV_HEADS, HEAD_DIM = 4, 256, 4, 32
META_BYTES = 28  # LMCache's per-file metadata header (RemoteMetadata) in 0.5.x


class FsCache:
    """One LMCache ``fs`` connector over ``root``, with its own CPU memory backend."""

    def __init__(self, root: Path, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,
            max_local_cpu_size=0.2,
            remote_url=f"fs://localhost:0{root}",
            remote_serde="naive",
        )
        self.meta = LMCacheMetadata(
            model_name="kvfs-test-model",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
        )
        self.backend = LocalCPUBackend(self.config, self.meta)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = CreateConnector(
            self.config.remote_url, self.loop, self.backend, self.config, self.meta
        )

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey("kvfs-test-model", 1, 0, chunk_hash, self.dtype)

    def put(self, chunk_hash: int, kv: torch.Tensor) -> None:
        obj = self.backend.allocate(kv.shape, self.dtype)
        assert obj is not None
        obj.tensor.copy_(kv)
        self.run(self.conn.put(self.key(chunk_hash), obj))
        obj.ref_count_down()

    def get(self, chunk_hash: int) -> torch.Tensor | None:
        obj = self.run(self.conn.get(self.key(chunk_hash)))
        if obj is None:
            return None
        out = obj.tensor.clone()
        obj.ref_count_down()
        return out

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        self.backend.close()


@pytest.fixture
def fs_cache(tmp_path: Path) -> Iterator[Callable[[Path, torch.dtype], FsCache]]:
    made: list[FsCache] = []

    def make(root: Path, dtype: torch.dtype) -> FsCache:
        made.append(FsCache(root, dtype))
        return made[-1]

    yield make
    for c in made:
        c.close()


def chunks(dtype: torch.dtype, n: int = 3) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (LAYERS, 2, CHUNK, KV_HEADS * HEAD_DIM)  # LMCache's KV_2LTD chunk layout
    return {1000 + i: torch.randn(shape, generator=g).to(dtype) for i in range(n)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunks_round_trip_bit_exactly(
    fs_cache: Callable[..., FsCache], kvfs_dir: Path, dtype: torch.dtype
) -> None:
    root = kvfs_dir / "lmcache"
    data = chunks(dtype)
    writer = fs_cache(root, dtype)
    for h, kv in data.items():
        writer.put(h, kv)
    files = sorted(p for p in root.iterdir())
    assert len(files) == len(data) and all(p.suffix == ".data" for p in files)  # no temp left
    reader = fs_cache(root, dtype)  # a fresh connector: nothing in memory
    for h, kv in data.items():
        got = reader.get(h)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert reader.get(999) is None
    # On disk: LMCache's header, then the tensor bytes as they are.
    for h, kv in data.items():
        raw = (root / (writer.key(h).to_string().replace("/", "-SEP-") + ".data")).read_bytes()
        assert raw[META_BYTES:] == kv.contiguous().view(torch.uint8).numpy().tobytes()


def test_files_carried_through_a_kvfs_store(
    fs_cache: Callable[..., FsCache], tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> None:
    """LMCache's files as kvfs pages (engine-named, session ``lmcache``) and back out."""
    dtype = torch.bfloat16
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = chunks(dtype, 2)
    writer = fs_cache(src, dtype)
    for h, kv in data.items():
        writer.put(h, kv)
    with kvfs.open_store_sync(make_config()) as store:
        for f in src.iterdir():
            store.put(f"lmcache/{f.name}", f.read_bytes())
        pages = store.list(path_prefix="lmcache/")
        assert len(pages) == len(data)
        dst.mkdir()
        for p in pages:
            (dst / p.path.split("/", 1)[1]).write_bytes(store.get(p.path))  # type: ignore[arg-type]
    reader = fs_cache(dst, dtype)
    for h, kv in data.items():
        got = reader.get(h)
        assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
