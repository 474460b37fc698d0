"""vLLM's native file-system offloading tier on a kvfs mount, unchanged.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU tier and
secondary tiers; the ``fs`` tier (``vllm.v1.kv_offload.tiering.fs``) writes one file per
offloaded chunk, ``<root>/<model>_<config hash>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``
(names from ``FileMapper``), holding the CPU tier's block bytes unchanged. It probes
O_DIRECT once (falling back to buffered I/O where a filesystem refuses it), writes
``<name>_<random>.tmp`` and ``os.replace``-s it into place, and reads with ``os.readv``
straight into the CPU tier's buffer.

These tests drive that real code from the ``vllm`` wheel (0.33.0, installed without its
dependencies next to CPU torch): ``FileMapper``, ``probe_o_direct`` and the tier's
``batch_store_block`` / ``batch_load_block`` over a memoryview of a CPU tensor, as
``FileSystemTierManager.submit_store`` / ``submit_load`` call them, with the root on a
real kvfs FUSE mount and on a plain directory. Run::

    bash scripts/engine-suites.sh install vllm
    bash scripts/engine-suites.sh test vllm

What this does not run: the connector and tier manager around these calls need a
``VllmConfig`` of a loaded model and the GPU worker that copies GPU blocks into the CPU
tier; and vLLM's C helper for the same I/O (``vllm.fs_io_C``) links CUDA libraries
(``libnvrtc``), so on CPU the tier's pure-Python path is the one that runs.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (CPU wheel): see this module's docstring")
pytest.importorskip(
    "vllm", reason="needs vllm in a venv of its own: bash scripts/engine-suites.sh install vllm"
)

import torch  # noqa: E402

with warnings.catch_warnings():
    # Importing vllm compiles a torch function, which warns about torch.jit: not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.fs.io import (
        batch_load_block,
        batch_store_block,
        probe_o_direct,
    )

import kvfs  # noqa: E402

# A CPU tier of 8 blocks; one block: K and V of 4 layers, 16 tokens, 4 heads of 64, bf16.
BLOCKS, BLOCK_SHAPE = 8, (2, 4, 16, 4, 64)


def mapper(root: Path) -> FileMapper:
    return FileMapper(
        root_dir=str(root),
        model_name="meta-llama/Llama-3.1-8B",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        dtype="bfloat16",
    )


def cpu_tier(seed: int | None) -> torch.Tensor:
    """The CPU tier's buffer, ``[blocks, block bytes]`` as vLLM views it, in page-aligned
    memory as vLLM allocates it (O_DIRECT needs that): random, or zeros."""
    shape = (BLOCKS, *BLOCK_SHAPE)
    n = torch.Size(shape).numel() * 2
    tier = torch.frombuffer(kvfs.aligned_buffer(n), dtype=torch.uint8).view(BLOCKS, -1)
    tier.zero_()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        tier.copy_(
            torch.randn(shape, generator=g).to(torch.bfloat16).view(BLOCKS, -1).view(torch.uint8)
        )
    return tier


def keys(n: int) -> list[bytes]:
    return [make_offload_key(bytes([i]) * 32, 0) for i in range(1, n + 1)]


def test_blocks_round_trip_bit_exactly(kvfs_dir: Path) -> None:
    root = kvfs_dir / "vllm"
    fm = mapper(root)
    os.makedirs(os.path.dirname(fm.get_config_file_path()), exist_ok=True)
    use_o_direct = probe_o_direct(os.path.dirname(fm.get_config_file_path()))
    src = cpu_tier(seed=3)
    block = src.stride(0)
    view = memoryview(src.numpy())
    ks = keys(4)
    chunks = [1, 3, 4, 6]  # CPU-tier slots the scheduler offloads
    paths = [fm.get_file_name(k) for k in ks]  # type: ignore[arg-type]
    batch_store_block(paths, view, [c * block for c in chunks], block, use_o_direct)
    batch_store_block(paths[:1], view, [chunks[0] * block], block, use_o_direct)  # exists: skip
    for p in paths:
        assert Path(p).stat().st_size == block
        assert not any(n.endswith(".tmp") for n in os.listdir(os.path.dirname(p)))

    # Another engine (same model and config) loads them into other slots of its tier.
    dst = cpu_tier(seed=None)
    other = mapper(root)
    assert [other.get_file_name(k) for k in ks] == paths  # type: ignore[arg-type]
    slots = [0, 2, 5, 7]
    batch_load_block(
        paths, memoryview(dst.numpy()), [s * block for s in slots], block, use_o_direct
    )
    for c, s in zip(chunks, slots, strict=True):
        assert torch.equal(dst[s], src[c])
    for p, c in zip(paths, chunks, strict=True):
        assert Path(p).read_bytes() == src[c].numpy().tobytes()


def test_missing_block_fails_the_load_after_the_good_ones(kvfs_dir: Path) -> None:
    root = kvfs_dir / "vllm"
    fm = mapper(root)
    src = cpu_tier(seed=5)
    block = src.stride(0)
    ks = keys(3)
    paths = [fm.get_file_name(k) for k in ks]  # type: ignore[arg-type]
    batch_store_block(paths[:2], memoryview(src.numpy()), [0, block], block, False)
    dst = cpu_tier(seed=None)
    with pytest.raises(FileNotFoundError) as exc:
        batch_load_block(
            paths[::-1][1:] + paths[-1:],
            memoryview(dst.numpy()),
            [0, block, 2 * block],
            block,
            False,
        )
    assert exc.value.num_succeeded == 2  # type: ignore[attr-defined]
    assert torch.equal(dst[0], src[1]) and torch.equal(dst[1], src[0])
