"""Names end to end: what the object API accepts is what the mount, the control channel and
the ``kvfs`` command show and accept, and a bad name is InvalidKey everywhere."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _kvfs_mount import daemon_mount
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfs
from kvfs._manifest import is_session_manifest, manifest_key, session_key_part
from objectstore import check_key

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


# -- a property over names: the API, the mount and the archive agree -------------------------
_ODD = "%+@#? \n\t-_.~\\é€\U0010ffff"
_part = st.one_of(
    st.text(st.sampled_from("ab" + _ODD) | st.characters(codec="utf-8"), min_size=1, max_size=8),
    st.sampled_from(["", ".", "..", ".kvfs.json", "sessions", "a\x00", os.fsdecode(b"\xff")]),
    # at the limit of a name, in characters of one to four bytes
    st.builds(
        lambda c, extra: c * ((255 + extra) // len(c.encode())),
        st.sampled_from(["x", "é", "€", "\U0010ffff"]),
        st.integers(-3, 3),
    ),
)
_key = st.one_of(
    st.tuples(_part, _part, _part).map(lambda t: "sessions/" + "/".join(t)),
    st.lists(_part, min_size=1, max_size=4).map("/".join),
)


def _valid(path: str) -> bool:
    try:
        kvfs.PageKey(path)
    except kvfs.InvalidKey:
        return False
    return True


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(paths=st.lists(_key, min_size=1, max_size=6, unique=True))
def test_every_name_the_api_takes_the_mount_shows_and_the_mount_takes_no_other(
    mounted: tuple[Path, kvfs.SyncRemoteStore], paths: list[str]
) -> None:
    """Each name the API takes is listed in its directory on the mount, read and unlinked
    there; each it refuses (InvalidKey, nothing else) the mount refuses too, storing nothing."""
    mp, st_ = mounted
    good: dict[str, bytes] = {}
    try:
        for i, path in enumerate(paths):
            try:
                st_.put(path, f"{i}".encode())
            except kvfs.PageExists:
                continue  # a page above or below one put before: not a file and a directory
            except kvfs.InvalidKey:
                assert not _valid(path)
                # (the kernel resolves "", "." and ".." itself, and takes no NUL)
                if not {"", ".", ".."} & set(path.split("/")) and "\x00" not in path:
                    _mount_refuses(mp, path)
                continue
            assert _valid(path)
            good[path] = f"{i}".encode()
        assert sorted(p.path for p in st_.list(path_prefix="")) == sorted(good)
        for path, data in good.items():
            on_mount = mp / path
            assert on_mount.name in os.listdir(on_mount.parent), path
            assert on_mount.read_bytes() == data
            session = kvfs.PageKey(path).session_dir + "/"
            assert path in [p.path for p in st_.list(session=session)]
        for path in good:
            os.unlink(mp / path)
        assert st_.list(path_prefix="") == []
    finally:
        for p in st_.list(path_prefix=""):
            st_.delete(p.path)


def _mount_refuses(mp: Path, path: str) -> None:
    try:
        fd = os.open(os.fsencode(mp) + b"/" + os.fsencode(path), os.O_CREAT | os.O_WRONLY)
    except OSError as e:
        # EINVAL, ENAMETOOLONG: the name; ENOENT, ENOTDIR, EISDIR: a directory on its way
        # that is not there (refused itself), or is no directory
        ok = (errno.EINVAL, errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
        assert e.errno in ok, (path, e)
    else:
        os.close(fd)
        pytest.fail(f"the mount made {path!r}, which the API refuses")


@given(sessions=st.lists(_key, min_size=2, max_size=8, unique=True))
def test_manifest_keys_are_one_per_session_and_fit_a_file_archive(sessions: list[str]) -> None:
    """Two sessions never share a manifest key, and every key is one an S3 bucket and a
    file:// archive (255 bytes a component) can hold."""
    dirs = {kvfs.PageKey(p).session_dir for p in sessions if _valid(p)}
    parts = {session_key_part(d) for d in dirs}
    assert len(parts) == len(dirs)
    for d in dirs:
        key = manifest_key(d, "0123456789abcdef0123456789abcdef")
        assert check_key(key) == key
        assert all(len(c.encode()) <= 255 for c in key.split("/"))
        assert is_session_manifest(key, d)
        assert not any(is_session_manifest(key, o) for o in dirs - {d})


def test_the_top_level_directory_is_a_session_with_its_slash_too(
    sync_store: kvfs.SyncStore,
) -> None:
    """``lmcache/`` is the directory lmcache, but ``./`` was InvalidKey ("component may not
    be '.'") where ``.`` is the top level's session."""
    sync_store.put("top.bin", b"x")
    assert kvfs.session_dir("./") == "."
    assert sync_store.session_info("./").dir == "."
    assert [p.path for p in sync_store.list(session="./")] == ["top.bin"]
