"""kvfs.integrations.transformers with real (randomly initialised) Llama-shaped models.

Correctness is decided by decoding: greedy tokens from a cache restored from kvfs must be
identical to those from the in-memory cache it was saved from, for several geometries and
through each page source (object API, plain files as on the mount).

Needs the ``engines`` extra (torch, transformers); skipped with that reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

pytest.importorskip("torch", reason="needs the engines extra: pip install -e .[engines]")
pytest.importorskip("transformers", reason="needs the engines extra: pip install -e .[engines]")

import torch  # noqa: E402
from _corrupt import flip_mounted_byte  # noqa: E402
from _kvfs_mount import ServedMount  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import kvfs  # noqa: E402
from kvfs.integrations import (  # noqa: E402
    DirectoryPages,
    FastPathPages,
    GeometryMismatch,
    chunk_names,
)
from kvfs.integrations._format import Geometry, PageLayout, check_page, parse_header  # noqa: E402
from kvfs.integrations._hfcompat import cache_of, forward  # noqa: E402
from kvfs.integrations._models import ModelShape, greedy_decode, random_llama  # noqa: E402
from kvfs.integrations._tcache import build_cache, cache_tensors  # noqa: E402
from kvfs.integrations.transformers import TransformersKV, geometry_of  # noqa: E402

CHUNK = 64
STEPS = 12
GEOMETRIES = {
    "fp32-gqa-2layers": ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32),
    "bf16-mha-3layers": ModelShape(
        layers=3, hidden=128, heads=4, kv_heads=4, head_dim=32, dtype="bfloat16"
    ),
    "fp32-gqa4-4layers": ModelShape(
        layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512
    ),
}
_MODELS: dict[ModelShape, Any] = {}


def model_of(shape: ModelShape) -> Any:
    if shape not in _MODELS:
        _MODELS[shape] = random_llama(shape, max_positions=2048)
    return _MODELS[shape]


def tokens(n: int, seed: int, vocab: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def prefill(model: Any, ids: list[int], cache: Any = None) -> tuple[int, Any]:
    out = forward(model, torch.tensor([ids]), cache)
    return int(out.logits[0, -1].argmax()), cache_of(out)


@pytest.fixture(params=["object-api", "fast-path", "mount", "directory"])
def target(
    request: pytest.FixtureRequest, make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> Any:
    """Where pages go: a kvfs store (object API, or reads by the fast path's O_DIRECT host
    backend), files on a real kvfs FUSE mount, or plain files in a directory."""
    if request.param == "mount":
        mp = tmp_path / "mnt"
        mp.mkdir()
        with ServedMount(make_config(ndev=2), mp):
            yield mp
    elif request.param == "object-api":
        with kvfs.open_store_sync(make_config(ndev=2)) as store:
            yield store
    elif request.param == "fast-path":
        with kvfs.open_store_sync(make_config(ndev=2)) as store:
            pages = FastPathPages(store)
            try:
                yield pages
            finally:
                pages.close()
    else:
        d = tmp_path / "mount"
        d.mkdir()
        yield d


@pytest.mark.parametrize("geom", list(GEOMETRIES), ids=list(GEOMETRIES))
def test_restored_cache_decodes_identically(geom: str, target: Any) -> None:
    shape = GEOMETRIES[geom]
    model = model_of(shape)
    ids = tokens(4 * CHUNK, seed=1)
    first, cache = prefill(model, ids)
    original = [(k.clone(), v.clone()) for k, v in cache_tensors(cache)]
    with TransformersKV(target, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        saved = kv.save("chat-1", ids, cache)
        assert (saved.chunks, saved.pages_written) == (4, 2 * 4 * shape.layers)
        want = greedy_decode(model, first, cache, STEPS)
        hit = kv.load("chat-1", ids)
    assert (hit.tokens, hit.chunks, hit.sources) == (4 * CHUNK, 4, ("chat-1",) * 4)
    for (k0, v0), (k1, v1) in zip(original, cache_tensors(hit.cache), strict=True):
        assert k1.dtype == k0.dtype and torch.equal(k0, k1) and torch.equal(v0, v1)
    assert greedy_decode(model, first, hit.cache, STEPS) == want


@pytest.mark.parametrize("geom", ["fp32-gqa-2layers", "bf16-mha-3layers"])
def test_longest_cached_prefix_is_reused(geom: str, target: Any) -> None:
    shape = GEOMETRIES[geom]
    model = model_of(shape)
    old = tokens(4 * CHUNK + 20, seed=2)
    _, cache = prefill(model, old)
    # Same first 200 tokens, then another tail: chunks 0-2 (192 tokens) are shared.
    new = old[:200] + tokens(90, seed=3)
    with TransformersKV(target, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        assert kv.save("a", old, cache).chunks == 4  # the 20-token tail is not stored
        assert kv.lookup("a", new) == ["a", "a", "a"]
        hit = kv.load("a", new)
        assert hit.tokens == 3 * CHUNK
        first, restored = prefill(model, new[hit.tokens :], hit.cache)
        # Reference: the in-memory cache cut to the same prefix, continued the same way.
        ref_cache = build_cache(
            model.config,
            [
                (k[:, :, : hit.tokens].clone(), v[:, :, : hit.tokens].clone())
                for k, v in cache_tensors(cache)
            ],
        )
        ref_first, ref_cache = prefill(model, new[hit.tokens :], ref_cache)
        assert first == ref_first
        assert greedy_decode(model, first, restored, STEPS) == greedy_decode(
            model, ref_first, ref_cache, STEPS
        )
        # max_tokens cuts inside a chunk, as a prefill that must compute the last token does.
        part = kv.load("a", old, max_tokens=2 * CHUNK + 5)
        assert part.tokens == 2 * CHUNK + 5 and part.chunks == 3
        assert torch.equal(cache_tensors(part.cache)[0][1], cache_tensors(cache)[0][1][:, :, :133])


def test_prefill_reuses_a_shared_prefix_across_sessions(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    system = tokens(3 * CHUNK, seed=4)
    a, b = system + tokens(40, seed=5), system + tokens(50, seed=6)
    with (
        kvfs.open_store_sync(make_config()) as store,
        TransformersKV(store, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv,
    ):
        ra = kv.prefill("agent-a", a)
        assert (ra.reused_tokens, ra.computed_tokens) == (0, len(a))
        rb = kv.prefill("agent-b", b)
        assert rb.reused_tokens == 3 * CHUNK and rb.sources == ("prefix-cache",) * 3
        full_first, _ = prefill(model, b)
        assert torch.allclose(rb.logits, prefill_logits(model, b), atol=1e-4)
        assert int(rb.logits.argmax()) == full_first
        st = store.statistics()
        # agent-a, agent-b and prefix-cache each name the 3 shared chunks: one copy stored.
        page = store.list(session="agent-a")[0].size
        assert st.logical_bytes == 9 * shape.layers * page
        assert st.local_bytes == 3 * shape.layers * page
        isolated = TransformersKV(
            store, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        )
        assert isolated.load("agent-c", b).tokens == 0


@torch.inference_mode()
def prefill_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_other_geometry_is_refused(target: Any) -> None:
    base = GEOMETRIES["fp32-gqa-2layers"]
    ids = tokens(2 * CHUNK, seed=7)
    _, cache = prefill(model_of(base), ids)
    with TransformersKV(target, model_of(base), model_id=base.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
    others = {
        "layers": ModelShape(layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32),
        "dtype": ModelShape(
            layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, dtype="bfloat16"
        ),
        "kv_heads": ModelShape(layers=2, hidden=128, heads=4, kv_heads=4, head_dim=32),
        "model_id": ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, seed=1),
    }
    for field, shape in others.items():
        with TransformersKV(
            target, model_of(shape), model_id=shape.model_id, chunk_tokens=CHUNK
        ) as kv:
            with pytest.raises(GeometryMismatch, match=field) as e:
                kv.load("s", ids)
            if field == "kv_heads":  # what the store holds is "there", this model "here"
                assert "kv_heads: 2 there, 4 here" in str(e.value), e.value
            other_ids = tokens(2 * CHUNK, seed=8)
            _, other_cache = prefill(model_of(shape), other_ids)
            with pytest.raises(GeometryMismatch, match=field):
                kv.save("s", other_ids, other_cache)
            # A cache of the first model handed to this one is refused too.
            if field != "model_id":
                with pytest.raises(GeometryMismatch):
                    kv.save("fresh", ids, cache)


def test_pages_are_aligned_safetensors(tmp_path: Path) -> None:
    shape = GEOMETRIES["bf16-mha-3layers"]
    model = model_of(shape)
    ids = tokens(CHUNK + 10, seed=9)
    _, cache = prefill(model, ids)
    with TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
    [name] = chunk_names(ids, kv.geometry)
    for layer, (k, v) in enumerate(cache_tensors(cache)):
        f = tmp_path / "sessions" / "s" / name / f"layer-{layer:03d}"
        raw = f.read_bytes()
        assert (8 + struct.unpack("<Q", raw[:8])[0]) % 4096 == 0
        loaded = load_file(str(f))
        assert torch.equal(loaded["key"], k[0, :, :CHUNK]) and loaded["key"].dtype == torch.bfloat16
        assert torch.equal(loaded["value"], v[0, :, :CHUNK])
        # any tool can check a copy: the digest is BLAKE3 of the tensor data
        h = parse_header(raw)
        assert h.metadata["digest"] == "blake3:" + blake3.blake3(raw[h.key_offset :]).hexdigest()


def test_a_page_checks_against_its_digest_once_sealed() -> None:
    g = Geometry("m", layers=1, kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=8)
    lay = PageLayout.build(g, 8, {**g.to_attrs(), "prefix": "p", "layer": "0"})
    buf = lay.buffer()
    buf[lay.data_start :] = os.urandom(lay.size - lay.data_start)
    unsealed = parse_header(buf)  # (PageLayout used alone: no digest, size checked only)
    check_page(unsealed, buf, digest=True)
    with pytest.raises(kvfs.CorruptPage, match="describes a page of"):
        check_page(unsealed, buf[:-1], digest=True)
    assert lay.seal(buf)["digest"] == parse_header(buf).metadata["digest"]
    check_page(parse_header(buf), buf, digest=True)
    buf[lay.size - 1] ^= 1
    with pytest.raises(kvfs.CorruptPage, match="digest"):
        check_page(parse_header(buf), buf, digest=True)
    check_page(parse_header(buf), buf, digest=False)  # a source that verifies its reads


def test_chunk_names_are_the_same_in_another_process() -> None:
    shape = GEOMETRIES["fp32-gqa-2layers"]
    with TransformersKV(
        os.getcwd(), model_of(shape), model_id=shape.model_id, chunk_tokens=CHUNK
    ) as kv:
        g = kv.geometry
    ids = tokens(3 * CHUNK + 5, seed=10)
    here = chunk_names(ids, g)
    code = (
        "import sys, json; from kvfs.integrations import Geometry, chunk_names; "
        "g = Geometry(**json.loads(sys.argv[1])); print(' '.join(chunk_names(json.loads("
        "sys.argv[2]), g)))"
    )
    import json

    geo = {
        f: getattr(g, f)
        for f in ("model_id", "layers", "kv_heads", "head_dim", "dtype", "chunk_tokens")
    }
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(geo), json.dumps(ids)],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == here and len(here) == 3
    assert chunk_names(ids, g.__class__(**{**geo, "head_dim": 64}))[0] != here[0]


def test_corrupt_page_ends_the_prefix(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=11)
    _, cache = prefill(model, ids)
    names = None
    with (
        kvfs.open_store_sync(make_config(ndev=1)) as store,
        TransformersKV(
            store, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv,
    ):
        kv.save("s", ids, cache)
        names = chunk_names(ids, kv.geometry)
        ext = store.stat(f"sessions/s/{names[1]}/layer-001").extents[0]
        with open(ext.path, "r+b") as f:  # flip a byte of the value tensor on disk
            f.seek(ext.offset + ext.length - 100)
            b = f.read(1)
            f.seek(ext.offset + ext.length - 100)
            f.write(bytes([b[0] ^ 0xFF]))
        hit = kv.load("s", ids)
        assert hit.tokens == CHUNK and "corrupt" in hit.note
        assert torch.equal(cache_tensors(hit.cache)[1][1], cache_tensors(cache)[1][1][:, :, :CHUNK])
        # a prefill says why it reused less than was cached (its result dropped the note)
        res = kv.prefill("s", ids, save=False)
        assert res.reused_tokens == CHUNK and "stopped at chunk 1" in res.note, res.note
        # the next save of that KV rewrites the damaged page: the prefix is whole again
        # (it was skipped as present, and every later load stopped there)
        assert kv.save("s", ids, cache).pages_written == 1
        hit = kv.load("s", ids)
        assert hit.tokens == 3 * CHUNK and not hit.note
        assert not any(v for v in store.fsck().values())


def _flip_or_cut(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, 4096)  # the header alone: a power loss with durable=False
    elif how.startswith("header"):  # the digest covers the tensors: a KeyError escaped load
        was, now = {
            "header-tensor": (b'"dtype":"F32"', b'"dtypa":"F32"'),
            "header-geometry": (b'"layers":"2"', b'"layerz":"2"'),
            "header-format": (b'"format":"kvfs-kv/1"', b'"format":"kvfs-kv/2"'),
        }[how]
        data = path.read_bytes()
        assert was in data
        path.write_bytes(data.replace(was, now, 1))
    else:
        with open(path, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            b = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize(
    "how", ["truncated", "flipped", "header-tensor", "header-geometry", "header-format"]
)
def test_a_damaged_page_in_a_plain_directory_ends_the_prefix(tmp_path: Path, how: str) -> None:
    """A plain directory has no kvfs checksum: a truncated page loaded the previous page's
    KV (left in the reused buffer) and a flipped byte loaded as it was. The page's own
    digest and size now end the prefix there. A damaged header (which the digest does not
    cover) raised KeyError or GeometryMismatch from load, for good: the page was never
    rewritten."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=21)
    _, cache = prefill(model, ids)
    with TransformersKV(
        tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
    ) as kv:
        kv.save("s", ids, cache)
        names = chunk_names(ids, kv.geometry)
        page = tmp_path / "sessions" / "s" / names[1] / "layer-000"
        size = page.stat().st_size
        _flip_or_cut(page, how)
        hit = kv.load("s", ids)
        assert kv.save("s", ids, cache).pages_written == 1  # rewritten: whole again
        assert kv.load("s", ids).tokens == 3 * CHUNK
    assert hit.tokens == CHUNK and "chunk 1 (layer 0)" in hit.note, hit.note
    assert hit.bytes_read == shape.layers * size  # the chunk kept, not the ones dropped
    for (k, v), (k0, v0) in zip(cache_tensors(hit.cache), cache_tensors(cache), strict=True):
        assert torch.equal(k, k0[:, :, :CHUNK]) and torch.equal(v, v0[:, :, :CHUNK])


def test_kv_saved_on_the_mount_loads_through_the_object_api_and_fails_clean(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """Pages written through the mount carried the file's attrs, not the format's: the
    object API refused them as "not kvfs-kv/1" (for every session sharing the prefix), and
    a page failing its checksum on the mount raised OSError(EIO) from load(). Then they
    carried no model: the session showed none in `kvfs ls`."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=22)
    _, cache = prefill(model, ids)
    cfg, mp = make_config(ndev=1), tmp_path / "mnt"
    mp.mkdir()
    with (
        ServedMount(cfg, mp),
        TransformersKV(mp, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv,
    ):
        kv.save("agent", ids, cache)
    with kvfs.open_store_sync(cfg) as store:
        assert store.session_info("agent").model == shape.model_id
        with TransformersKV(store, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
            assert kv.load("agent", ids).tokens == 3 * CHUNK
            assert kv.load("other-agent", ids).tokens == 3 * CHUNK  # the shared prefix
            names = chunk_names(ids, kv.geometry)
        ext = store.stat(f"sessions/agent/{names[2]}/layer-001").extents[0]
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + ext.length - 100)
        b = f.read(1)
        f.seek(ext.offset + ext.length - 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with (
        ServedMount(cfg, mp),
        TransformersKV(
            mp, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv,
    ):
        hit = kv.load("agent", ids)
        assert hit.tokens == 2 * CHUNK and "chunk 2 (layer 1)" in hit.note, hit.note
        with pytest.raises(kvfs.CorruptPage), kv.load_layers("agent", ids) as layers:
            list(layers)


def test_a_static_cache_saves_the_tokens_it_holds(tmp_path: Path) -> None:
    """A StaticCache is allocated longer than what it holds: its zeros were saved as KV
    under the prefix's name (and shared), or the save was refused for too few ids."""
    from transformers import StaticCache

    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK + 10, seed=23)
    static = StaticCache(config=model.config, max_cache_len=4 * CHUNK)
    _, cache = prefill(model, ids, static)
    with TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        assert kv.save("a", ids, cache).chunks == 2  # was refused: "holds 256 tokens"
        assert kv.save("b", ids + tokens(3 * CHUNK, seed=24), cache).chunks == 2  # was 4
        hit = kv.load("b", ids + tokens(3 * CHUNK, seed=24))
    assert hit.tokens == 2 * CHUNK
    _, ref = prefill(model, ids[: 2 * CHUNK])
    for (k, v), (k0, v0) in zip(cache_tensors(hit.cache), cache_tensors(ref), strict=True):
        assert torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5)


def test_token_ids_that_are_no_integers_are_refused(tmp_path: Path) -> None:
    """Token ids 1.5 and 1 named the same prefix (``int()``): a float list or tensor saved
    under, and loaded from, another prompt's pages."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(CHUNK, seed=27)
    _, cache = prefill(model, ids)
    floats = [t + 0.5 for t in ids]
    with TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        for bad in (floats, torch.tensor([floats])):
            with pytest.raises(ValueError, match="must be integers"):
                kv.save("a", bad, cache)
            with pytest.raises(ValueError, match="must be integers"):
                kv.load("a", bad)
        assert kv.save("a", torch.tensor([ids]), cache).chunks == 1  # integer tensors do


def test_an_empty_cache_saves_nothing(tmp_path: Path) -> None:
    """A cache that holds no tokens yet (made with or without the model's config, dynamic
    or static) stores nothing; its save raised ValueError or GeometryMismatch."""
    from transformers import DynamicCache, StaticCache

    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=25)
    empties = (
        DynamicCache(config=model.config),
        DynamicCache(),
        StaticCache(config=model.config, max_cache_len=4 * CHUNK),
    )
    with TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        for empty in empties:
            done = kv.save("a", ids, empty)
            assert (done.chunks, done.pages_written, done.bytes_written) == (0, 0, 0)
        assert kv.load("a", ids).tokens == 0


def test_a_session_holding_other_files_is_named_the_same_way_by_every_source(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(CHUNK, seed=25)
    d = tmp_path / "dir"
    (d / "sessions" / "notes" / "misc").mkdir(parents=True)
    (d / "sessions" / "notes" / "misc" / "readme.txt").write_text("hello, not a KV page\n")
    with kvfs.open_store_sync(make_config(ndev=1)) as store:
        store.put("sessions/notes/misc/readme.txt", b"hello, not a KV page\n")
        for where in (d, store):
            with (
                TransformersKV(where, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv,
                pytest.raises(GeometryMismatch, match="not kvfs-kv/1 KV pages"),
            ):
                kv.load("notes", ids)


def test_a_session_named_like_an_engine_directory_is_its_own(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A store holding LMCache's tree ``lmcache/`` refused a session named ``lmcache``
    ("holds pages that are not kvfs-kv/1 KV pages"): the name was taken for that directory,
    as ``kvfs ls lmcache`` takes it when no semantic session has it."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK + 5, seed=26)
    with kvfs.open_store_sync(make_config(ndev=1)) as store:
        store.put("lmcache/llama@1@0@5e0c@bf16.data", os.urandom(4096))
        with TransformersKV(store, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
            assert kv.load("lmcache", ids).tokens == 0
            assert kv.prefill("lmcache", ids).reused_tokens == 0
            assert kv.prefill("lmcache", ids).reused_tokens == 2 * CHUNK
        assert store.exists("lmcache/llama@1@0@5e0c@bf16.data")


def test_a_page_source_of_ones_own_needs_only_the_four_calls(tmp_path: Path) -> None:
    """The guide's four calls were not enough: a ``label`` was required too."""

    class Mine:
        def __init__(self, root: Path) -> None:
            self.inner = DirectoryPages(root)

        def stat(self, key: kvfs.PageKey) -> Any:
            return self.inner.stat(key)

        def read_into(self, key: kvfs.PageKey, buf: memoryview) -> int:
            return self.inner.read_into(key, buf)

        def write(self, key: kvfs.PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
            return self.inner.write(key, data, attrs)

        def sample_attrs(self, session: str) -> dict[str, str] | None:
            return self.inner.sample_attrs(session)

    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=26)
    _, cache = prefill(model, ids)
    with TransformersKV(Mine(tmp_path), model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
        assert kv.load("s", ids).tokens == 2 * CHUNK


class LoggedPages:
    """A real page source (plain files) that logs the layer of every page read, in order."""

    def __init__(self, root: Path) -> None:
        self.inner = DirectoryPages(root)
        self.label = self.inner.label
        self.log: list[int] = []
        self.stat, self.write, self.sample_attrs = (
            self.inner.stat,
            self.inner.write,
            self.inner.sample_attrs,
        )

    def read_into(self, key: kvfs.PageKey, buf: memoryview) -> int:
        n = self.inner.read_into(key, buf)
        self.log.append(int(key.path.rsplit("-", 1)[1]))
        return n


@pytest.mark.parametrize("geom", ["fp32-gqa4-4layers", "bf16-mha-3layers"])
def test_layerwise_load_decodes_identically(geom: str, target: Any) -> None:
    shape = GEOMETRIES[geom]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=21)
    first, cache = prefill(model, ids)
    original = [(k.clone(), v.clone()) for k, v in cache_tensors(cache)]
    with TransformersKV(target, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("chat-1", ids, cache)
        want = greedy_decode(model, first, cache, STEPS)
        with kv.load_layers("chat-1", ids, ahead=1) as layers:
            assert (layers.tokens, layers.chunks, layers.sources) == (3 * CHUNK, 3, ("chat-1",) * 3)
            got = [(i, k, v) for i, k, v in layers]
        page = 2 * CHUNK * shape.kv_heads * shape.head_dim * (4 if shape.dtype == "float32" else 2)
        assert layers.bytes_read > 3 * shape.layers * page
        # max_tokens cuts inside a chunk, as for load().
        with kv.load_layers("chat-1", ids, max_tokens=2 * CHUNK + 5) as part:
            cut = [k for _, k, _v in part]
        assert part.tokens == 2 * CHUNK + 5 and part.chunks == 3
    assert [i for i, _, _ in got] == list(range(shape.layers))
    for (k0, v0), (_, k1, v1), k2 in zip(original, got, cut, strict=True):
        assert k1.dtype == k0.dtype and torch.equal(k0, k1) and torch.equal(v0, v1)
        assert torch.equal(k2, k0[:, :, : 2 * CHUNK + 5])
    restored = build_cache(model.config, [(k, v) for _, k, v in got])
    assert greedy_decode(model, first, restored, STEPS) == want


def test_layerwise_load_yields_each_layer_once_all_its_pages_are_in(tmp_path: Path) -> None:
    shape = GEOMETRIES["fp32-gqa4-4layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=22)
    _, cache = prefill(model, ids)
    pages = LoggedPages(tmp_path)
    with TransformersKV(pages, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
        for ahead in (0, 1, None):
            pages.log.clear()
            seen = []
            with kv.load_layers("s", ids, ahead=ahead) as layers:
                for i, _k, _v in layers:
                    # Every chunk of this layer is in; with ahead=0, no later layer started.
                    assert pages.log.count(i) == 3
                    if ahead == 0:
                        assert max(pages.log) == i
                    seen.append(i)
            assert seen == list(range(shape.layers))
            assert sorted(pages.log) == sorted(list(range(shape.layers)) * 3)
        with kv.load_layers("other", tokens(3 * CHUNK, seed=23)) as none:
            assert (none.tokens, list(none)) == (0, [])


def test_a_page_that_grew_after_the_lookup_is_a_page_that_changed(tmp_path: Path) -> None:
    """A page file that another writer made longer between the lookup and its read no
    longer fits the buffer sized from the lookup: that is a page that changed, as a page
    that vanished is (PageNotFound), not a bare ValueError."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=26)
    _, cache = prefill(model, ids)
    pages = DirectoryPages(tmp_path)
    with TransformersKV(pages, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
        last = chunk_names(ids, kv.geometry)[1]
        with kv.load_layers("s", ids, ahead=0) as layers:
            it = iter(layers)
            assert next(it)[0] == 0
            with open(pages.path(kvfs.PageKey.semantic("s", last, 1)), "ab") as f:
                f.write(bytes(64 * 1024))
            with pytest.raises(kvfs.PageNotFound, match="changed"):
                next(it)


def test_layerwise_load_async(tmp_path: Path) -> None:
    import trio

    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=24)
    _, cache = prefill(model, ids)

    async def main(kv: TransformersKV) -> list[int]:
        async with kv.load_layers("s", ids, ahead=0) as layers:
            return [i async for i, _k, _v in layers]

    with TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv:
        kv.save("s", ids, cache)
        assert trio.run(main, kv) == [0, 1]


@pytest.mark.parametrize("fast", [False, True], ids=["object-api", "fast-path"])
def test_layerwise_load_raises_on_a_corrupt_page(
    fast: bool, make_config: Callable[..., kvfs.StoreConfig]
) -> None:
    from _corrupt import flip_stored_byte

    shape = GEOMETRIES["fp32-gqa4-4layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=25)
    _, cache = prefill(model, ids)
    with kvfs.open_store_sync(make_config(ndev=2)) as store:
        source: Any = FastPathPages(store) if fast else store
        with TransformersKV(
            source, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv:
            kv.save("s", ids, cache)
            info = store.stat(f"sessions/s/{chunk_names(ids, kv.geometry)[2]}/layer-002")
            flip_stored_byte(info, info.size - 100)  # a byte of the value tensor
            seen = []
            with (
                kv.load_layers("s", ids, ahead=1) as layers,
                pytest.raises(kvfs.CorruptPage),
            ):
                for i, _k, _v in layers:
                    seen.append(i)
            assert seen == [0, 1]
            # The full-cache load on the same reads ends the prefix before the bad chunk.
            hit = kv.load("s", ids)
            assert hit.tokens == 2 * CHUNK and "corrupt" in hit.note
        if fast:
            source.close()


def test_batched_cache_is_refused(tmp_path: Path) -> None:
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens(CHUNK, 12), tokens(CHUNK, 13)]))
    with (
        TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv,
        pytest.raises(ValueError, match="batch size 2"),
    ):
        kv.save("s", tokens(CHUNK, 12), cache_of(out))


def test_decodes_identically_after_spill_and_restore(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """The session goes to a file:// archive and comes back: on access on this host, and by
    ``restore`` on a second host that shares only the archive."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK, seed=14)
    first, cache = prefill(model, ids)
    url = f"file://{tmp_path / 'archive'}"

    def cfg(name: str) -> kvfs.StoreConfig:
        return make_config(ndev=2, name=name, archive_url=url, extra={"archive": {"interval": 0}})

    with (
        kvfs.open_store_sync(cfg("host-a")) as a,
        TransformersKV(
            a, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv,
    ):
        kv.save("agent", ids, cache)
        want = greedy_decode(model, first, cache, STEPS)
        assert a.spill("agent") > 0
        assert {p.tier for p in a.list(session="agent")} == {"archive"}
        hit = kv.load("agent", ids)
        assert hit.tokens == 3 * CHUNK
        assert greedy_decode(model, first, hit.cache, STEPS) == want
    with (
        kvfs.open_store_sync(cfg("host-b")) as b,
        TransformersKV(
            b, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv,
    ):
        assert kv.load("agent", ids).tokens == 0  # nothing here until restored
        assert b.restore("agent") > 0
        hit = kv.load("agent", ids)
        assert hit.tokens == 3 * CHUNK
        assert greedy_decode(model, first, hit.cache, STEPS) == want


def test_model_demo_continues_in_a_new_process(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """The ``kvfs demo`` model scenario: spill, then a second process reloads and decodes
    the same tokens (the scenario raises if they differ)."""
    from kvfs.integrations.demo import model_scenario

    cfg = make_config(
        ndev=2, archive_url=f"file://{tmp_path / 'archive'}", extra={"archive": {"interval": 0}}
    )
    lines: list[str] = []
    res = model_scenario(cfg, tokens=600, decode=8, small=True, echo=lines.append)
    assert res["same_tokens"] and res["spill_s"] is not None
    assert any("reloaded 512 tokens" in line for line in lines)  # full chunks only
    with kvfs.open_store_sync(cfg) as store:
        assert len(store.list(session="agent-demo")) == 2 * 4  # 2 full chunks x 4 layers
    # `--data DIR` prints this; `kvfs ls --data DIR` found no store (its devices are below)
    from kvfs.integrations.demo import look_command

    cmd = look_command(cfg)
    r = subprocess.run([sys.executable, "-m", "cli", *cmd[1:]], capture_output=True, text=True)
    assert r.returncode == 0 and "agent-demo" in r.stdout, r.stderr
    # its usage line names the command that runs it (it said "usage: demo.py")
    r = subprocess.run(
        [sys.executable, "-m", "kvfs.integrations.demo", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m kvfs.integrations.demo")


def test_a_random_models_id_names_every_field_of_its_shape() -> None:
    """Two shapes that differed only in their MLP width (or vocabulary) had one id: the
    second model reused 256 tokens of the first's KV, and decoded otherwise than recompute."""
    import dataclasses

    base = ModelShape()
    ids = {base.model_id}
    for f in dataclasses.fields(ModelShape):
        other = getattr(base, f.name)
        changed = other + 1 if isinstance(other, int) else "bfloat16"
        ids.add(dataclasses.replace(base, **{f.name: changed}).model_id)
    assert len(ids) == len(dataclasses.fields(ModelShape)) + 1


def test_a_quantized_cache_is_refused(tmp_path: Path) -> None:
    """A quantized layer's ``keys`` hold only its residual, the latest tokens: a cache
    saved after some decode steps stored the KV of its last tokens under the names of its
    first chunks, in the shared session, and another session loaded it as its prefix."""
    from transformers.cache_utils import Cache, QuantizedCache, QuantizedLayer

    class IdentityQuantized(QuantizedLayer):  # quanto and hqq, without their packages
        def _quantize(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
            return tensor.clone()

        def _dequantize(self, qtensor: torch.Tensor) -> torch.Tensor:
            return qtensor

    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(CHUNK + 8, seed=31)
    with torch.inference_mode():
        cache = Cache(layers=[IdentityQuantized() for _ in range(2)])
        forward(model, torch.tensor([ids[:CHUNK]]), cache)
        for t in ids[CHUNK:]:
            forward(model, torch.tensor([[t]]), cache)
    assert cache.get_seq_length() == CHUNK + 8 and cache.layers[0].keys.shape[2] == 8
    kw = {"model_id": shape.model_id, "chunk_tokens": 4, "shared_session": "shared"}
    with TransformersKV(tmp_path, model, **kw) as kv:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="IdentityQuantized, whose tensors are not"):
            kv.save("q", ids, cache)
        assert kv.load("other", ids).tokens == 0
        with torch.inference_mode():  # was: "KV of shape (0,) does not fit"
            fp8 = QuantizedCache("fp8", model.config)
            forward(model, torch.tensor([ids]), fp8)
        with pytest.raises(ValueError, match="QuantizedCache holds most of its KV quantized"):
            kv.save("q", ids, fp8)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("where", ["directory", "mount"])
def test_a_damaged_first_page_does_not_block_its_session(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, where: str
) -> None:
    """Which model a session belongs to is read from its first page: that page damaged
    (cut to nothing by a power loss, a flipped byte on the mount's disk) made every new
    prompt of the session fail with GeometryMismatch ("not kvfs-kv/1 pages"), or with
    OSError(EIO) on the mount. The next page tells instead."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=41)
    _, cache = prefill(model, ids)
    kw = {"model_id": shape.model_id, "chunk_tokens": CHUNK, "shared_session": None}
    cfg, root = make_config(ndev=1), tmp_path / where
    root.mkdir()
    mounted = ServedMount(cfg, root) if where == "mount" else contextlib.nullcontext()
    with mounted, TransformersKV(root, model, **kw) as kv:  # type: ignore[arg-type]
        kv.save("s", ids, cache)
        first = root / f"sessions/s/{chunk_names(ids, kv.geometry)[0]}/layer-000"
        raw = os.getxattr(first, "user.kvfs.extents") if where == "mount" else b""
    if where == "directory":
        os.truncate(first, 0)
    else:  # (a new mount below: the kernel's cache of the page is gone with the old one)
        flip_mounted_byte(raw, 10)
    mounted = ServedMount(cfg, root) if where == "mount" else contextlib.nullcontext()
    with mounted, TransformersKV(root, model, **kw) as kv:  # type: ignore[arg-type]
        other = tokens(2 * CHUNK + 1, seed=42)
        assert kv.prefill("s", other).save.chunks == 2  # type: ignore[union-attr]
        assert kv.load("s", other).tokens == 2 * CHUNK


def test_a_session_of_another_model_is_refused_though_the_shared_one_has_the_prefix(
    tmp_path: Path,
) -> None:
    """load checked the session only when nothing at all was cached: with the prefix in
    the shared session it succeeded, and prefill then failed after computing, at its save."""
    a, b = GEOMETRIES["fp32-gqa-2layers"], GEOMETRIES["bf16-mha-3layers"]
    ids = tokens(2 * CHUNK, seed=43)
    with (
        TransformersKV(tmp_path, model_of(a), model_id=a.model_id, chunk_tokens=CHUNK) as kv_a,
        TransformersKV(tmp_path, model_of(b), model_id=b.model_id, chunk_tokens=CHUNK) as kv_b,
    ):
        kv_a.prefill("agent-a", ids)
        kv_b.prefill("agent-b", ids)  # b's KV of the prefix is in the shared session now
        for call in (lambda: kv_b.load("agent-a", ids), lambda: kv_b.prefill("agent-a", ids)):
            with pytest.raises(GeometryMismatch, match="session 'agent-a'"):
                call()


def test_a_prefill_whose_save_finds_no_room_keeps_its_result(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """CapacityExceeded from the save threw away the prefill's logits and cache."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(4 * CHUNK + 1, seed=44)
    with (
        kvfs.open_store_sync(make_config(ndev=1, capacity=64 * 1024)) as store,
        TransformersKV(store, model, model_id=shape.model_id, chunk_tokens=CHUNK) as kv,
    ):
        store.put("engine/pinned.bin", b"p" * 60 * 1024, pin=True)
        result = kv.prefill("s", ids)
    assert result.save is None and "not saved" in result.note and "no room" in result.note
    assert result.computed_tokens == len(ids)
    want, _ = prefill(model, ids)
    assert int(result.logits.argmax()) == want


def test_a_prefill_whose_cache_cannot_be_read_computes_everything(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A load that failed (the archive unreachable, a mount whose daemon died) failed the
    prefill: a cache turned a request it could have computed into an error."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(3 * CHUNK + 1, seed=45)
    archive = tmp_path / "archive"
    cfg = make_config(ndev=1, archive_url=f"file://{archive}", extra={"archive": {"interval": 0}})
    with (
        kvfs.open_store_sync(cfg) as store,
        TransformersKV(
            store, model, model_id=shape.model_id, chunk_tokens=CHUNK, shared_session=None
        ) as kv,
    ):
        kv.prefill("s", ids)
        assert store.spill("s") > 0
        archive.rename(tmp_path / "away")  # unmounted, say: the pages are held nowhere else
        result = kv.prefill("s", ids)
        assert result.reused_tokens == 0 and result.computed_tokens == len(ids)
        assert "cache not read" in result.note and "archive" in result.note, result.note
        want, _ = prefill(model, ids)
        assert int(result.logits.argmax()) == want
        (tmp_path / "away").rename(archive)
        assert kv.prefill("s", ids).reused_tokens == 3 * CHUNK  # back: read again


def test_a_model_split_over_devices_is_refused(tmp_path: Path) -> None:
    """Every layer's loaded KV went to the device of the model's first parameter: a model
    split by ``device_map`` failed in its forward pass with a device mismatch."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = random_llama(shape, max_positions=256)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    with pytest.raises(ValueError, match=r"split over several devices \(cuda:0, cuda:1\)"):
        TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK)
    for one in ({"a": "cpu", "b": "cpu"}, {"a": 0, "b": "cuda:0"}, {"a": "cuda", "b": 0}):
        model.hf_device_map = one  # one device, however accelerate spells it
        TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK).close()


def _tiny(config_class: str, model_class: str, **kw: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(vocab_size=1000, **kw)
    return getattr(transformers, model_class)(cfg).eval()


@pytest.mark.parametrize(
    "kw",
    [
        {"multi_query": True, "new_decoder_architecture": False},  # one KV head
        {"new_decoder_architecture": True, "num_kv_heads": 2},  # cached expanded to 4
    ],
    ids=["multi-query", "grouped"],
)
def test_falcon_caches_are_saved_and_reused(tmp_path: Path, kw: dict[str, Any]) -> None:
    """A multi-query Falcon caches one KV head and says so in ``multi_query`` alone (it has no
    ``num_key_value_heads``): the geometry counted every attention head, and each save
    failed with GeometryMismatch."""
    model = _tiny(
        "FalconConfig", "FalconForCausalLM", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, **kw,
    )  # fmt: skip
    ids = tokens(2 * CHUNK + 1, seed=46)
    with TransformersKV(tmp_path, model, model_id="falcon-tiny", chunk_tokens=CHUNK) as kv:
        assert kv.geometry.kv_heads == (1 if kw.get("multi_query") else 4)
        first = kv.prefill("s", ids)
        assert first.save is not None and first.save.chunks == 2, first.note
        again = kv.prefill("s", ids)
    assert again.reused_tokens == 2 * CHUNK and not again.note
    want, _ = prefill(model, ids)
    assert int(again.logits.argmax()) == int(first.logits.argmax()) == want


def test_a_model_with_latent_attention_is_refused(tmp_path: Path) -> None:
    """A DeepSeek-V3 model (multi-head latent attention: keys and values of different
    sizes) was taken, and every save failed with a GeometryMismatch naming 128 KV heads."""
    model = _tiny(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="latent attention"):
        TransformersKV(tmp_path, model, model_id="deepseek-tiny", chunk_tokens=CHUNK)


def test_a_session_pressed_out_by_another_keeps_its_head(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Eviction took a session's pages least recently used first: its first chunk, saved
    first, went first, and a load found nothing to reuse though half its pages were still
    there. A save is one burst of access, which eviction takes from its tail. (One thread
    saves, so that the pages are written in chunk order.)"""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    old, new = tokens(4 * CHUNK, seed=61), tokens(4 * CHUNK, seed=62)
    _, old_cache = prefill(model, old)
    _, new_cache = prefill(model, new)
    kw: dict[str, Any] = {"model_id": shape.model_id, "chunk_tokens": CHUNK, "threads": 1}
    with kvfs.open_store_sync(make_config(ndev=1, name="sizing")) as store:
        with TransformersKV(store, model, **kw) as kv:
            kv.save("old", old, old_cache)
        used = store.statistics().used_bytes  # what one session's pages take on disk
    with (
        kvfs.open_store_sync(make_config(ndev=1, capacity=used + used // 2)) as store,
        TransformersKV(store, model, **kw) as kv,
    ):
        kv.save("old", old, old_cache)
        kv.save("new", new, new_cache)  # half of "old" has to go: its last two chunks
        assert store.statistics().evictions == {"capacity": 4}
        assert kv.load("old", old).tokens == 2 * CHUNK
        assert kv.load("new", new).tokens == 4 * CHUNK


def test_a_session_whose_sampled_pages_are_all_cut_short_is_not_blocked(tmp_path: Path) -> None:
    """The pages of a session's one save, cut to nothing by a power loss (a plain directory,
    ``durable=False``), read as files of another kind: every new prompt of the session
    failed with GeometryMismatch ("not kvfs-kv/1 KV pages; use another session name") for
    good, its save included. A file named as kvfs names KV pages that does not parse is a
    damaged page, which says nothing of the session's model."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(CHUNK + 3, seed=71)
    _, cache = prefill(model, ids)
    kw: dict[str, Any] = {"model_id": shape.model_id, "chunk_tokens": CHUNK}
    with TransformersKV(tmp_path, model, shared_session=None, **kw) as kv:
        kv.save("s", ids, cache)
        pages = sorted((tmp_path / "sessions" / "s").rglob("layer-*"))
        assert len(pages) == shape.layers
        for page in pages:
            os.truncate(page, 0)
        other = tokens(CHUNK + 1, seed=72)
        res = kv.prefill("s", other)
        assert res.reused_tokens == 0 and res.save is not None and res.save.chunks == 1
        assert kv.load("s", other).tokens == CHUNK
    # A file of another kind in a session still refuses it, whatever its name.
    (tmp_path / "sessions" / "t" / "c00000-notes").mkdir(parents=True)
    (tmp_path / "sessions" / "t" / "c00000-notes" / "layer-000").write_text("not a KV page\n")
    with (
        TransformersKV(tmp_path, model, **kw) as kv,
        pytest.raises(GeometryMismatch, match="not kvfs-kv/1 KV pages"),
    ):
        kv.load("t", ids)


class FailsWhileOneRuns:
    """Plain files whose write or read of ``fail`` raises ``error`` once the write or read
    of ``slow`` has started; that one then waits for ``release`` (at most ``hold`` s) and
    records whether the call it belongs to had returned before it finished."""

    def __init__(self, root: Path, fail: str, slow: str, error: OSError, hold: float) -> None:
        import threading

        self.inner = DirectoryPages(root)
        self.fail, self.slow, self.error, self.hold = fail, slow, error, hold
        self.started, self.release = threading.Event(), threading.Event()
        self.returned = False  # (set by the test once the call is back)
        self.after_return: list[bool] = []
        self.stat, self.sample_attrs = self.inner.stat, self.inner.sample_attrs

    def _run(self, key: kvfs.PageKey, call: Callable[[], Any]) -> Any:
        if key.path == self.fail:
            assert self.started.wait(30)
            raise self.error
        if key.path == self.slow:
            self.started.set()
            self.release.wait(self.hold)
            done = call()
            self.after_return.append(self.returned)
            return done
        return call()

    def write(self, key: kvfs.PageKey, data: memoryview, attrs: dict[str, str]) -> bool:
        return bool(self._run(key, lambda: self.inner.write(key, data, attrs)))

    def read_into(self, key: kvfs.PageKey, buf: memoryview) -> int:
        return int(self._run(key, lambda: self.inner.read_into(key, buf)))


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_save_or_load_that_fails_has_nothing_left_running(tmp_path: Path, call: str) -> None:
    """A save whose first page found no room (a load whose first page could not be read:
    the archive gone) raised at once, while the writes (reads) of other pages went on in
    its threads: a caller that freed room after the failed save (deleted the session,
    closed the store) had pages written behind it."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK, seed=73)
    _, cache = prefill(model, ids)
    kw: dict[str, Any] = {"model_id": shape.model_id, "chunk_tokens": CHUNK}
    names = chunk_names(ids, geometry_of(model, shape.model_id, CHUNK))
    if call == "load":
        with TransformersKV(tmp_path, model, shared_session=None, **kw) as kv:
            kv.save("s", ids, cache)
    error = OSError(28, "No space left on device") if call == "save" else ConnectionError("gone")
    pages = FailsWhileOneRuns(
        tmp_path,
        fail=f"sessions/s/{names[0]}/layer-000",
        slow=f"sessions/s/{names[1 if call == 'load' else 0]}/layer-001",
        error=error,
        hold=1.0,  # (only how long the fixed call waits; the old one returned at once)
    )
    with TransformersKV(pages, model, shared_session=None, **kw) as kv:
        with pytest.raises(OSError, match="No space|gone"):
            kv.save("s", ids, cache) if call == "save" else kv.load("s", ids)
        pages.returned = True
        pages.release.set()
    assert pages.after_return == [False]


def test_calls_after_close_raise_store_closed(tmp_path: Path) -> None:
    """After close() a call raised RuntimeError("cannot schedule new futures after
    shutdown") from the thread pool, and only where it had pages to read or write (a load
    of a prefix not cached answered as if open); a layer-wise load begun before close()
    raised it at the next layer it started."""
    shape = GEOMETRIES["fp32-gqa4-4layers"]
    model = model_of(shape)
    ids = tokens(2 * CHUNK + 1, seed=74)
    _, cache = prefill(model, ids)
    kv = TransformersKV(tmp_path, model, model_id=shape.model_id, chunk_tokens=CHUNK)
    kv.save("s", ids, cache)
    layers = kv.load_layers("s", ids, ahead=0)
    assert next(iter(layers))[0] == 0
    kv.close()
    kv.close()  # (idempotent)
    with pytest.raises(kvfs.StoreClosed, match="closed"):
        list(layers)
    for call in (
        lambda: kv.save("s", ids, cache),
        lambda: kv.load("s", ids),
        lambda: kv.load("new", tokens(2 * CHUNK, seed=75)),
        lambda: kv.load_layers("s", ids),
        lambda: kv.lookup("s", ids),
        lambda: kv.prefill("s", ids),
    ):
        with pytest.raises(kvfs.StoreClosed, match="TransformersKV was closed"):
            call()


@pytest.mark.parametrize("session", ["..", "a/b", ""])
def test_an_invalid_session_is_refused_whatever_the_prompt(tmp_path: Path, session: str) -> None:
    """A session name that is no valid key part was refused (InvalidKey) only when a chunk
    of the prompt was looked up: with a prompt shorter than a chunk, a load looked for the
    session's model in ``<root>/sessions/<session>`` (``..``: the root itself) and
    answered, a save of a short cache returned, and a bad ``shared_session`` failed every
    save later instead of at construction."""
    shape = GEOMETRIES["fp32-gqa-2layers"]
    model = model_of(shape)
    short = tokens(CHUNK - 1, seed=76)
    _, cache = prefill(model, short)
    (tmp_path / "sessions" / "s").mkdir(parents=True)
    kw: dict[str, Any] = {"model_id": shape.model_id, "chunk_tokens": CHUNK}
    with TransformersKV(tmp_path, model, **kw) as kv:
        for call in (
            lambda: kv.load(session, short),
            lambda: kv.load_layers(session, short),
            lambda: kv.lookup(session, short),
            lambda: kv.save(session, short, cache),
            lambda: kv.prefill(session, short),
        ):
            with pytest.raises(kvfs.InvalidKey, match="session"):
                call()
    with pytest.raises(kvfs.InvalidKey, match="session"):
        TransformersKV(tmp_path, model, shared_session=session, **kw)
