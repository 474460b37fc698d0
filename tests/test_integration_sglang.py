"""SGLang HiCache's ``file`` storage backend (``HiCacheFile``) on a kvfs mount, unchanged.

HiCache's third tier writes one raw file per KV page (``<hash>_<model>_<tp rank>_<tp
size>.bin``: the host pool's page, K and V of every layer, as flat bytes) into the
directory named by ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` (a server builds it with
no path: the variable, else ``/tmp/hicache``; these tests pass ``file_path``). It writes ``.<uuid>.tmp`` then ``os.replace``-s it
into place, checks ``exists`` per page and reads each page with ``readinto`` into a host
buffer; its LRU evictor unlinks the oldest files past a size cap.

These tests drive the real ``HiCacheFile`` class from the ``sglang`` package (0.5.23, on
CPU torch) with its directory on a real kvfs FUSE mount (and on a plain directory): pages round-trip bit-exactly
through a fresh backend (a restarted server's view), the longest stored prefix is found,
files hold the page bytes unchanged, the evictor's unlinks free kvfs pages, and after
the mount is gone the pages are kvfs pages (session ``sglang``) of the store.

Heavy (sglang imports triton and a dozen server packages at package import: ~2.6 GB
with CPU torch), so it runs from a venv of its own::

    bash scripts/engine-suites.sh install sglang
    bash scripts/engine-suites.sh test sglang

What this does not run: the HiCache controller that copies GPU pages to the host pool
and calls this backend (it needs CUDA). The page bytes it hands over are the host pool's
``get_data_page(index, flat=True)``, a flat view of the shape used here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (CPU wheel): see this module's docstring")
pytest.importorskip(
    "sglang",
    reason="needs sglang in a venv of its own: bash scripts/engine-suites.sh install sglang",
)

import torch  # noqa: E402
from _kvfs_mount import daemon_mount  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
)

import kvfs  # noqa: E402

# A Llama-shaped host page (layer_first layout): K and V, layers, page tokens, heads, dims.
LAYERS, PAGE, KV_HEADS, HEAD_DIM = 4, 64, 4, 32
MODEL = "meta-llama/Llama-3.1-8B"
SUFFIX = "_meta-llama-Llama-3.1-8B_0_1"  # HiCacheFile's name suffix: model, tp rank, tp size


def storage_config(**extra: object) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=MODEL,
        extra_config=dict(extra) or None,
    )


def pages(dtype: torch.dtype, n: int) -> dict[str, torch.Tensor]:
    """``n`` flat data pages keyed like HiCache keys them (a hex hash per page)."""
    g = torch.Generator().manual_seed(7)
    shape = (2, LAYERS, PAGE, KV_HEADS, HEAD_DIM)
    return {f"{i:04x}" * 16: torch.randn(shape, generator=g).to(dtype).flatten() for i in range(n)}


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment variable wins over the path given in code: keep the test's own.
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pages_round_trip_bit_exactly(kvfs_dir: Path, dtype: torch.dtype) -> None:
    root = kvfs_dir / "sglang"
    data = pages(dtype, 3)
    keys = list(data)
    writer = HiCacheFile(storage_config(), file_path=str(root))
    assert writer.batch_set(keys[:2], [data[k] for k in keys[:2]])
    assert writer.set(keys[2], data[keys[2]])
    assert writer.set(keys[2], data[keys[2]])  # already there: skipped, still a success
    files = sorted(os.listdir(root))
    assert files == sorted(f"{k}{SUFFIX}.bin" for k in keys)  # no .tmp left behind

    # A restarted server: a new backend over the same directory, nothing in memory.
    reader = HiCacheFile(storage_config(), file_path=str(root))
    missing = "ffff" * 16
    assert reader.batch_exists_v2([*keys, missing]).kv_hit_pages == 3
    assert reader.batch_exists_v2([keys[0], missing, keys[1]]).kv_hit_pages == 1
    targets = [torch.zeros_like(data[k]) for k in keys]
    got = reader.batch_get(keys, targets)
    for k, t in zip(keys, got, strict=True):
        assert t is not None and torch.equal(t.view(torch.uint8), data[k].view(torch.uint8))
    assert reader.get(missing, torch.zeros_like(data[keys[0]])) is None
    # On the mount: the page's bytes as they are, nothing added.
    for k in keys:
        raw = (root / f"{k}{SUFFIX}.bin").read_bytes()
        assert raw == data[k].view(torch.uint8).numpy().tobytes()


def test_evictor_unlinks_through_the_mount(kvfs_dir: Path) -> None:
    """With a size cap, HiCacheFile's LRU evictor deletes the oldest pages' files."""
    root = kvfs_dir / "sglang"
    data = pages(torch.bfloat16, 4)
    keys = list(data)
    page_bytes = data[keys[0]].numel() * data[keys[0]].element_size()
    cap = 3 * page_bytes
    backend = HiCacheFile(storage_config(max_size=cap, eviction_ratio=1.0), file_path=str(root))
    for k in keys[:3]:
        assert backend.set(k, data[k])
    backend.get(keys[0], torch.zeros_like(data[keys[0]]))  # keys[0] is now the newest
    assert backend.set(keys[3], data[keys[3]])  # over the cap: keys[1] goes
    assert not (root / f"{keys[1]}{SUFFIX}.bin").exists()
    assert sorted(os.listdir(root)) == sorted(f"{k}{SUFFIX}.bin" for k in keys if k != keys[1])
    fresh = HiCacheFile(storage_config(), file_path=str(root))
    for k in (keys[0], keys[2], keys[3]):
        t = fresh.get(k, torch.zeros_like(data[k]))
        assert t is not None and torch.equal(t, data[k])


def test_pages_are_kvfs_pages(tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]) -> None:
    """What HiCache wrote through the mount is in the store, session ``sglang``."""
    cfg = make_config(ndev=2, name="mounted")
    data = pages(torch.bfloat16, 2)
    with daemon_mount(cfg, tmp_path / "mnt") as mp:
        backend = HiCacheFile(storage_config(), file_path=str(mp / "sglang"))
        assert backend.batch_set(list(data), list(data.values()))
    with kvfs.open_store_sync(cfg) as store:
        listed = {p.path: p for p in store.list(path_prefix="sglang/")}
        assert set(listed) == {f"sglang/{k}{SUFFIX}.bin" for k in data}
        for k, v in data.items():
            assert store.get(f"sglang/{k}{SUFFIX}.bin") == v.view(torch.uint8).numpy().tobytes()
        assert [s.session for s in store.sessions()] == ["sglang"]
