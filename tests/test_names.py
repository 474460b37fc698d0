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


#: every call that takes a session name
SESSION_CALLS: list[Callable[[object, str], object]] = [
    lambda s, n: s.session_info(n),  # type: ignore[attr-defined]
    lambda s, n: s.set_session_attrs(n, {"a": "b"}),  # type: ignore[attr-defined]
    lambda s, n: s.delete_session(n),  # type: ignore[attr-defined]
    lambda s, n: s.pin_session(n),  # type: ignore[attr-defined]
    lambda s, n: s.unpin_session(n),  # type: ignore[attr-defined]
    lambda s, n: s.evict(session=n),  # type: ignore[attr-defined]
    lambda s, n: s.spill(n),  # type: ignore[attr-defined]
    lambda s, n: s.restore(n),  # type: ignore[attr-defined]
    lambda s, n: s.list(session=n),  # type: ignore[attr-defined]
]


def test_a_name_that_is_not_utf8_is_invalid_through_a_daemon_too(
    mounted: tuple[Path, kvfs.SyncRemoteStore], sync_store: kvfs.SyncStore
) -> None:
    """A session name that is not UTF-8 (``os.fsdecode`` of such bytes, a command's argument)
    is InvalidKey in-process; through a daemon the client failed to pack it and raised
    "a message too large for the control channel"."""
    _mp, remote = mounted
    bad = os.fsdecode(b"agent-\xff")
    for store in (sync_store, remote):
        for call in SESSION_CALLS:
            for arg in (bad, "lmcache/" + bad):
                with pytest.raises(kvfs.InvalidKey, match="not valid UTF-8"):
                    call(store, arg)
    assert remote.sessions() == []  # (the connections are sound)


@pytest.mark.parametrize("prefix", ["", ".", "..", "p/q", "a\x00", os.fsdecode(b"\xff"), 5])
def test_a_prefix_no_key_can_have_is_invalid(
    mounted: tuple[Path, kvfs.SyncRemoteStore], sync_store: kvfs.SyncStore, prefix: object
) -> None:
    """list(session=, prefix=) took any prefix and found nothing (a typo that listed an
    empty session), or raised SQLite's UnicodeEncodeError, or (through a daemon) "too
    large"; a prefix is a key's part, as PageKey.semantic checks it."""
    for store in (sync_store, mounted[1]):
        store.put(kvfs.PageKey.semantic("s", "p", 0), b"x")
        with pytest.raises(kvfs.InvalidKey):
            store.list(session="s", prefix=prefix)  # type: ignore[arg-type]


def test_a_path_prefix_is_any_text(
    mounted: tuple[Path, kvfs.SyncRemoteStore], sync_store: kvfs.SyncStore
) -> None:
    for store in (sync_store, mounted[1]):
        store.put("lm/model@ws@0@ab", b"x")
        assert [p.path for p in store.list(path_prefix="lm/model@")] == ["lm/model@ws@0@ab"]
        assert store.list(path_prefix="lm/..") == []
        for bad in (os.fsdecode(b"lm/\xff"), 5):
            with pytest.raises(kvfs.InvalidKey):
                store.list(path_prefix=bad)  # type: ignore[arg-type]


def test_the_command_says_a_name_is_not_utf8(
    mounted: tuple[Path, kvfs.SyncRemoteStore], run: Callable[..., tuple[int, str, str]]
) -> None:
    mp, remote = mounted
    data = str(Path(remote.identity()["data_dirs"][0]))
    for verb in ("ls", "pin", "evict", "rm", "spill"):
        rc, out, err = run(verb, "--data", data, os.fsdecode(b"agent-\xff"))
        assert rc == 2 and "not valid UTF-8" in err and "too large" not in err, (verb, err)
