"""The fast path into GPU memory: kvikio CuFile and host staging, bit-exact against the host
path. Marked ``gpu``; skipped with the reason below where there is no GPU, cupy or kvikio.

Run on the device machine: see docs/gds.md ("Running the GPU tests").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _corrupt import flip_stored_byte
from _gds import MiB, aligned, archive_only_with_no_room, fastpath_fixtures, key, rand

import gds
import kvfs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def need_gpu() -> dict[str, str | None]:
    st = gds.gpu_status()
    why = st["cupy"] or st["kvikio"]
    if why is not None:
        pytest.skip(f"{gds.GPU_SKIP_REASON} ({why})")
    print(f"kvikio {st['kvikio_mode']}")
    return st


store, fp = fastpath_fixtures(threads=8)


def host_read(fp: gds.FastPath, k: kvfs.PageKey, n: int) -> np.ndarray:
    dest = aligned(n)
    assert fp.read(k, dest, backend="host").result() == n
    return dest


def poisoned(cp: Any, n: int) -> Any:
    """A GPU buffer full of a pattern the page data is unlikely to keep by chance."""
    return cp.full((n,), 0xA5, dtype=cp.uint8)


@pytest.mark.parametrize("backend", ["kvikio", "staged"])
@pytest.mark.parametrize("size", [1, 4096, 5 * MiB + 123])
def test_read_into_cupy_matches_host_path(
    store: kvfs.SyncStore, fp: gds.FastPath, backend: str, size: int
) -> None:
    import cupy as cp

    data = rand(size, seed=size)
    store.put(key(0), data)
    dest = poisoned(cp, size)
    assert fp.read(key(0), dest, backend=backend).result() == size
    assert np.array_equal(cp.asnumpy(dest), host_read(fp, key(0), size))
    assert np.array_equal(cp.asnumpy(dest), data)


def test_auto_picks_kvikio_for_gpu_memory(fp: gds.FastPath) -> None:
    import cupy as cp

    assert fp.backend_for(cp.empty(16, dtype=cp.uint8)) == "kvikio"
    assert fp.backend_for(aligned(4096)) == "host"


@pytest.mark.parametrize("backend", ["kvikio", "staged"])
def test_read_into_torch_bf16_tensor(store: kvfs.SyncStore, fp: gds.FastPath, backend: str) -> None:
    torch = pytest.importorskip("torch")
    n = 3 * MiB + 4096
    data = rand(n, seed=7)
    store.put(key(0), data)
    t = torch.full((n // 2,), 1.5, dtype=torch.bfloat16, device="cuda")
    assert fp.read(key(0), t, backend=backend).result() == n
    got = t.view(torch.uint8).cpu().numpy()
    assert np.array_equal(got, host_read(fp, key(0), n))


@pytest.mark.parametrize("backend", ["kvikio", "staged"])
def test_flipped_byte_is_an_error_on_the_gpu_path(
    store: kvfs.SyncStore, fp: gds.FastPath, backend: str
) -> None:
    import cupy as cp

    data = rand(3 * MiB)
    info = store.put(key(0), data)
    flip_stored_byte(info, 2 * MiB + 11)
    with pytest.raises(kvfs.CorruptPage, match=f"bytes {2 * MiB}-"):
        fp.read(key(0), cp.empty(data.nbytes, dtype=cp.uint8), backend=backend).result()
    assert not store.engine._leases


def test_write_from_cupy_and_torch(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    import cupy as cp

    data = rand(4 * MiB + 5, seed=3)
    info = fp.write(key(0), cp.asarray(data)).result()
    assert info.checksum == kvfs.checksum(data.tobytes()).hex()
    assert np.array_equal(host_read(fp, key(0), data.nbytes), data)
    torch = pytest.importorskip("torch")
    t = torch.randn(MiB // 2, dtype=torch.bfloat16, device="cuda")
    want = t.view(torch.uint8).cpu().numpy()
    info = fp.write(key(1), t).result()
    assert info.checksum == kvfs.checksum(want.tobytes()).hex()
    back = torch.empty_like(t)
    fp.read(key(1), back).result()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_layer_loader_into_gpu(store: kvfs.SyncStore, fp: gds.FastPath) -> None:
    import cupy as cp

    datas = [rand(MiB + 512 * i, seed=i) for i in range(6)]
    for i, d in enumerate(datas):
        store.put(key(i), d)
    dests = [poisoned(cp, d.nbytes) for d in datas]
    with fp.load_layers([key(i) for i in range(6)], dests, ahead=2) as layers:
        for i, buf in layers:
            assert np.array_equal(cp.asnumpy(buf), datas[i])


@pytest.mark.parametrize("backend", ["kvikio", "staged"])
@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_missing_or_short_data_file_is_corrupt_on_the_gpu_path(
    store: kvfs.SyncStore, fp: gds.FastPath, backend: str, damage: str
) -> None:
    """kvikio reports a missing file, and a read past the end in compatibility mode, as a
    bare RuntimeError; the fast path's contract is CorruptPage."""
    import os

    import cupy as cp

    info = store.put(key(0), rand(3 * MiB))
    path = info.extents[-1].path
    if damage == "missing":
        os.unlink(path)
    else:
        os.truncate(path, info.extents[-1].offset + 4096)
    with pytest.raises(kvfs.CorruptPage, match=damage if damage == "missing" else "shorter"):
        fp.read(key(0), poisoned(cp, 3 * MiB), backend=backend).result(timeout=60)


def test_a_page_held_only_in_memory_reaches_gpu_memory(make_config: Any, tmp_path: Any) -> None:
    """An archive-only page with no local room (served from the archive's memory copy)."""
    import cupy as cp

    data = rand(MiB + 5)
    cfg = archive_only_with_no_room(make_config, f"file://{tmp_path / 'archive'}", data)
    with kvfs.open_store_sync(cfg) as s, gds.FastPath(s) as path:
        dest = poisoned(cp, data.nbytes)
        assert path.read(key(0), dest).result(timeout=60) == data.nbytes
        assert np.array_equal(cp.asnumpy(dest), data)
