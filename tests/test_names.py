"""Names end to end: what the object API accepts is what the mount, the control channel and
the ``kvfs`` command show and accept, and a bad name is InvalidKey everywhere."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _kvfs_mount import daemon_mount

import kvfs

LAST = "\U0010ffff"  # the last code point: a valid name's character like any other


@pytest.fixture
def mounted(
    tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> Iterator[tuple[Path, kvfs.SyncRemoteStore]]:
    """A daemon's mount and a client of its control socket."""
    cfg = make_config(ndev=1, name="mounted")
    with (
        daemon_mount(cfg, tmp_path / "mnt") as mp,
        kvfs.open_remote_store_sync(cfg.data_dirs[0] / "kvfs.sock") as st,
    ):
        yield mp, st


def test_a_name_after_the_last_code_point_lists_in_its_directory(
    mounted: tuple[Path, kvfs.SyncRemoteStore],
) -> None:
    """Listings by path prefix ended at prefix + U+10FFFF: a page named with that character
    and more after it was stored, read and counted in its session, but left out of its
    prefix's listing, on the mount (ls of its directory) and in the API."""
    mp, st = mounted
    semantic = kvfs.PageKey.semantic("s", "p", LAST + "z")
    st.put(semantic, b"1")
    st.put("s/p/q", b"2")
    st.put(f"s/p/{LAST}{LAST}x/q", b"3")
    assert [p.path for p in st.list(session="s", prefix="p")] == [semantic.path]
    assert [p.path for p in st.list(path_prefix="sessions/s/p/")] == [semantic.path]
    assert [p.path for p in st.list(path_prefix=f"s/p/{LAST}")] == [f"s/p/{LAST}{LAST}x/q"]
    assert os.listdir(mp / "sessions/s/p") == [LAST + "z"]
    assert (mp / semantic.path).read_bytes() == b"1"
    assert sorted(os.listdir(mp / "s/p")) == ["q", LAST + LAST + "x"]
