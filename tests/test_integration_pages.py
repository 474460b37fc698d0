"""The engine-neutral parts of kvfs.integrations, without an engine: the kvfs-kv/1 header
parser against damaged and hostile headers, the chunk names' token containers, and the
write-once promise of DirectoryPages on a plain directory and on a real kvfs mount.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from _kvfs_mount import ServedMount

import kvfs
from kvfs.integrations import DirectoryPages, Geometry, chunk_names
from kvfs.integrations._format import PageLayout, check_page, parse_header

G = Geometry("m", layers=1, kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=4)


def _page(key: dict[str, Any], value: dict[str, Any] | None = None, **extra: Any) -> bytes:
    """A page of 8 zero bytes of data whose header has these tensor entries (the digest
    right), so that only the header is in question."""
    data = b"\0" * 8
    meta = {"format": "kvfs-kv/1", "digest": "blake3:" + blake3.blake3(data).hexdigest()}
    head = {"__metadata__": meta, "key": key, "value": value or key, **extra}
    js = json.dumps(head).encode()
    return struct.pack("<Q", len(js)) + js + data


def _raw(js: bytes) -> bytes:
    return struct.pack("<Q", len(js)) + js + b"\0" * 8


def _t(shape: list[Any], offsets: list[Any]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


HOSTILE = {
    # read as int(x): OverflowError escaped, not CorruptPage
    "an infinite dimension": _raw(
        b'{"__metadata__":{"format":"kvfs-kv/1"},'
        b'"key":{"dtype":"F32","shape":[Infinity,1,1],"data_offsets":[0,4]},'
        b'"value":{"dtype":"F32","shape":[Infinity,1,1],"data_offsets":[4,8]}}'
    ),
    # equal to the right ints, so accepted; then a float slice index: TypeError
    "float offsets": _page(_t([1, 1, 1], [0.0, 4.0]), _t([1, 1, 1], [4.0, 8.0])),
    # (-1) * (-1) * 1 elements: a page of shape (-1, -1, 1) was accepted
    "negative dimensions": _page(_t([-1, -1, 1], [0, 4]), _t([-1, -1, 1], [4, 8])),
    "string and float dimensions": _page(
        _t(["1", 1.9, True], [0, 4]), _t(["1", 1.9, True], [4, 8])
    ),
    # json.loads raised RecursionError
    "JSON nested deeper than the parser goes": _raw(b"[" * 100_000 + b"]" * 100_000),
    "metadata nested deeper than the parser goes": _raw(
        b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ),
    # a safetensors reader looks for the other tensor's bytes past the page's end
    "a third tensor": _page(_t([1, 1, 1], [0, 4]), _t([1, 1, 1], [4, 8]), x=_t([1], [8, 12])),
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=list(HOSTILE))
def test_a_hostile_header_is_a_corrupt_page(raw: bytes) -> None:
    with pytest.raises(kvfs.CorruptPage):
        h = parse_header(raw)
        check_page(h, memoryview(raw), digest=True)


def test_a_page_kvfs_writes_still_parses() -> None:
    lay = PageLayout.build(G, 4, G.to_attrs())
    buf = lay.buffer()
    lay.seal(buf)
    h = parse_header(buf)
    assert h.shape == (1, 4, 4) and h.key_offset == lay.key_offset
    check_page(h, buf, digest=True)


CONTAINERS: dict[str, Callable[[list[int]], Any]] = {
    "tuple": tuple,
    "range-like numpy int32": lambda t: np.asarray(t, dtype=np.int32),
    "numpy uint16": lambda t: np.asarray(t, dtype=np.uint16),
    "numpy int64": lambda t: np.asarray(t, dtype=np.int64),
}


@pytest.mark.parametrize("make", CONTAINERS.values(), ids=list(CONTAINERS))
def test_chunk_names_are_the_same_for_any_integer_container(
    make: Callable[[list[int]], Any],
) -> None:
    toks = list(range(1, 9))
    assert chunk_names(make(toks), G) == chunk_names(toks, G)


@pytest.mark.parametrize(
    "bad",
    [[1.5, 2, 3, 4], np.array([1.5, 2.0, 3.0, 4.0]), ["1", "2", "3", "4"]],
    ids=["float", "numpy float", "str"],
)
def test_a_token_that_is_no_integer_is_refused(bad: Any) -> None:
    """1.5 was named as 1: two prefixes with one name, the KV of one loaded for the other."""
    with pytest.raises(ValueError, match="integers"):
        chunk_names(bad, G)


def test_chunk_names_stay_what_they_were() -> None:
    """The names are part of the stored data: a change orphans every stored page."""
    assert chunk_names(list(range(8)), G) == [
        "c00000-394e2052d95b062409850b0d044ea0cd",
        "c00001-eab6fe7a8a906a81893d3e845b00b9c7",
    ]


class _Meanwhile(dict[str, str]):
    """The page's attrs, which run ``then`` when the writer reads them: after it looked for
    the page and before it publishes its own, the moment a second writer can come in."""

    def __init__(self, attrs: dict[str, str], then: Callable[[], None]) -> None:
        super().__init__(attrs)
        self.then: Callable[[], None] | None = then

    def items(self) -> Any:
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return super().items()


def _two_writers(pages: DirectoryPages) -> None:
    key = kvfs.PageKey.semantic("s", chunk_names(list(range(4)), G)[0], 0)
    lay = PageLayout.build(G, 4, G.to_attrs())
    first, second = lay.buffer(), lay.buffer()
    first[lay.data_start :] = b"\1" * (lay.size - lay.data_start)
    second[lay.data_start :] = b"\2" * (lay.size - lay.data_start)
    meta1, meta2 = lay.seal(first), lay.seal(second)
    won: list[bool] = []
    pages.verifies = True  # (the attrs are read, so the second writer comes in)
    wrote = pages.write(
        key, first, _Meanwhile(meta1, lambda: won.append(pages.write(key, second, meta2)))
    )
    assert won == [True]
    assert not wrote  # it was there before this writer published: write once
    buf = memoryview(bytearray(lay.size))
    assert pages.read_into(key, buf) == lay.size
    assert bytes(buf) == bytes(second)  # the page the first writer to publish wrote
    session = pages.root / "sessions" / "s" / key.parts[-2]
    assert sorted(p.name for p in session.iterdir()) == ["layer-000"]  # no temporary left


def test_two_writers_of_a_new_page_in_a_directory_write_it_once(tmp_path: Path) -> None:
    """Both counted the page as written, and the second replaced the first's page."""
    probe = tmp_path / "probe"
    probe.touch()
    try:  # (the writer sets the attrs as xattrs when it reads them: see _two_writers)
        os.setxattr(probe, "user.probe", b"1")
    except OSError as e:
        pytest.skip(f"{tmp_path} takes no user xattrs ({e.strerror})")
    probe.unlink()
    _two_writers(DirectoryPages(tmp_path))


@pytest.fixture
def mnt(make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path) -> Iterator[Path]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=2), mp):
        yield mp


def test_two_writers_of_a_new_page_on_the_mount_write_it_once(mnt: Path) -> None:
    _two_writers(DirectoryPages(mnt))
