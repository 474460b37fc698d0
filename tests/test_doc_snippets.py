"""The Python examples of the README and docs/ run as written, against a temporary store
(real files, a real FUSE mount and moto's S3 where they need one). Only their placeholder
paths are replaced, each checked to be there first (a path the docs changed must not send
a test to /nvme0), and what an example leaves to its reader (the bytes, the model, the
buffers) is given to it."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _kvfs_mount import ServedMount

import kvfs

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def example(doc: str, index: int, paths: dict[str, str]) -> str:
    """The ``index``-th ```python block of ``doc``, dedented, with each key of ``paths``
    (which must be in it) replaced by its value."""
    text = (ROOT / doc).read_text()
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, flags=re.M | re.S)
    code = textwrap.dedent(blocks[index][1])
    for old, new in paths.items():
        assert old in code, f"{doc}'s example {index} no longer says {old}: update this test"
        code = code.replace(old, new)
    return code


def run_example(doc: str, index: int, paths: dict[str, str], **names: Any) -> dict[str, Any]:
    ns: dict[str, Any] = {"kvfs": kvfs, **names}
    exec(compile(example(doc, index, paths), f"{doc} example {index}", "exec"), ns)
    return ns


def test_the_readme_object_api_example_stores_and_reads_a_page(tmp_path: Path) -> None:
    """The README's only example ran, but nothing kept it so."""
    kv_bytes = os.urandom(3 * MiB + 17)
    data = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    paths = {'"/nvme0/kvfs"': repr(data[0]), '"/nvme1/kvfs"': repr(data[1])}
    run_example("README.md", 0, paths, kv_bytes=kv_bytes)
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=data)) as store:
        key = kvfs.PageKey("sessions/agent-42/9f3ab1c2/layer-017")  # (its comment's name)
        assert store.get(key) == kv_bytes
        assert store.stat(key).attrs == {"model": "llama-3.3-70b", "dtype": "bf16"}


def test_the_archive_configuration_example_spills_to_its_bucket(
    tmp_path: Path, s3_server: Any
) -> None:
    """Nothing ran docs/archive.md's configuration: it holds every [archive] setting, and a
    setting renamed or a URL form dropped would have left it failing at the open."""
    s3_server.client().create_bucket(
        Bucket="kv-archive", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    paths = {
        '"/nvme0/kvfs", "/nvme1/kvfs"': f'"{tmp_path}/nvme0", "{tmp_path}/nvme1"',
        "region=eu-west-1": f"region=eu-west-1&endpoint={s3_server.endpoint}",
    }
    cfg = run_example("docs/archive.md", 0, paths)["cfg"]
    with kvfs.open_store_sync(cfg) as store:
        store.put(kvfs.PageKey.semantic("agent-42", "p", 0), b"kv" * 5000)
        store.spill("agent-42")
    assert any(k.startswith("prod/manifests/") for k in s3_server.keys("kv-archive"))


def test_the_fast_path_example_runs_with_host_buffers(
    tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> None:
    """docs/gds.md's example wrote a page under the key it had just read: PageExists, since
    pages are write-once."""
    size = 5 * MiB + 3
    cfg = make_config(ndev=2)
    pages = [os.urandom(size) for _ in range(3)]
    with kvfs.open_store_sync(cfg) as store:
        for i, page in enumerate(pages):
            store.put(kvfs.PageKey.semantic("agent-42", "9f3ab1", i), page)
    mounted = kvfs.StoreConfig(data_dirs=[tmp_path / "mounted"])
    with kvfs.open_store_sync(mounted) as store:
        store.put(kvfs.PageKey.semantic("s", "p", 3), pages[2])
    done: list[int] = []
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(mounted, mp):
        ns = run_example(
            "docs/gds.md",
            0,
            {"/mnt/kvfs/": f"{mp}/"},
            cfg=cfg,
            key=kvfs.PageKey.semantic("agent-42", "9f3ab1", 0),
            new_key=kvfs.PageKey.semantic("agent-42", "9f3ab1", 9),
            dest=kvfs.aligned_buffer(size),
            dests=[kvfs.aligned_buffer(size) for _ in pages],
            gpu_tensor=b"a host buffer here",
            compute=lambda i, buf: done.append(i),
        )
    assert ns["n"] == size and bytes(ns["dest"]) == pages[2]  # (the by-path read came last)
    assert [bytes(d) for d in ns["dests"]] == pages and done == [0, 1, 2]
    assert ns["info"].size == len(b"a host buffer here")


def test_the_mount_attribute_example_commits_the_page_with_its_attribute(
    tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> None:
    """docs/mount.md's example opened a page in a prefix directory nobody had made
    (ENOENT on a fresh mount)."""
    kv_bytes = os.urandom(100_000)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(), mp):
        run_example("docs/mount.md", 0, {"/mnt/kv/": f"{mp}/"}, kv_bytes=kv_bytes)
        page = mp / "sessions/agent-42/p0/layer-000"
        assert page.read_bytes() == kv_bytes
        assert os.getxattr(page, "user.kvfs.attr.model") == b"Qwen/Qwen2.5-7B@a09a3545"


# The example passes past_key_values, the name transformers 4.40 to 5.24 all take (5.24
# warns that it renamed it `cache`); the guide says so beside it.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_the_user_guide_transformers_examples_run(tmp_path: Path) -> None:
    """The user guide's layer-by-layer example called build_cache without importing it."""
    pytest.importorskip("torch", reason="needs the engines extra: pip install -e .[engines]")
    pytest.importorskip("transformers", reason="needs the engines extra: pip install -e .[engines]")
    import torch

    from kvfs.integrations._models import ModelShape, random_llama
    from kvfs.integrations.transformers import TransformersKV

    shape = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    model = random_llama(shape, max_positions=1024)
    ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    data = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    paths = {'"/nvme0/kvfs"': repr(data[0]), '"/nvme1/kvfs"': repr(data[1])}
    ns = run_example("docs/user-guide.md", 0, paths, model=model, input_ids=ids)
    assert (ns["res"].computed_tokens, ns["hit"].tokens) == (300, 256)

    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=data)) as store:
        kv = TransformersKV(store, model, model_id="meta-llama/Llama-3.1-8B@<revision>")
        ns = run_example("docs/user-guide.md", 1, {}, kv=kv, ids=ids, model=model)
        assert len(ns["kvs"]) == 2 and ns["cache"].get_seq_length() == 256

    # The page format's example reads a page file: one a plain directory holds here.
    pages = tmp_path / "pages"
    pages.mkdir()
    with TransformersKV(str(pages), model, model_id="m@1") as kv:
        kv.prefill("agent-42", ids)
    [page] = (pages / "sessions/agent-42").glob("c00000-*/layer-000")
    ns = run_example(
        "docs/user-guide.md",
        2,
        {"/mnt/kvfs/sessions/agent-42/c00000-5c30.../layer-000": str(page)},
    )
    assert ns["t"]["key"].shape == (2, 256, 32)


def test_every_toml_example_is_a_configuration_kvfs_accepts(run: Any, tmp_path: Path) -> None:
    """Nothing loaded the configuration examples: a setting renamed in kvfs/_settings.py
    would have left the user guide's [archive] example an error (exit 2) for whoever
    copied it."""
    found = 0
    for doc in ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]:
        text = (ROOT / doc).read_text()
        for i, block in enumerate(re.findall(r"^ *```toml\n(.*?)^ *```", text, re.M | re.S)):
            path = tmp_path / f"{Path(doc).stem}-{i}.toml"
            path.write_text(textwrap.dedent(block))
            rc, _, err = run("config", "--config", str(path))
            assert rc == 0, f"{doc}'s TOML example {i}: {err}"
            found += 1
    assert found >= 2
