"""The one mapping between page keys and paths (kvfs._keys)."""

from __future__ import annotations

import pytest

import kvfs
from kvfs import PageKey
from kvfs._keys import MAX_NAME_BYTES, MAX_PATH_BYTES, layer_name, split_path


def test_semantic_key_path() -> None:
    k = PageKey.semantic("agent-42", "9f3ab1", 17)
    assert k.path == "sessions/agent-42/9f3ab1/layer-017"
    assert (k.session, k.prefix, k.layer, k.layer_index) == ("agent-42", "9f3ab1", "layer-017", 17)
    assert k.session_dir == "sessions/agent-42" and k.is_semantic
    assert PageKey.from_path(k.path) == k
    assert PageKey.semantic("a", "p", "attn-q").layer_index is None
    assert PageKey.semantic("a", "p", 1234).layer == "layer-1234"


def test_layers_sort_numerically() -> None:
    names = [layer_name(i) for i in range(0, 200, 7)]
    assert names == sorted(names)


def test_engine_paths() -> None:
    k = PageKey.from_path("lmcache/model@1@0@abc@bf16.pt")
    assert not k.is_semantic and k.session == "lmcache" and k.session_dir == "lmcache"
    assert k.prefix is None and k.layer is None and k.layer_index is None
    top = PageKey.from_path("top.bin")
    assert top.session_dir == "." and top.session == "."
    assert PageKey.from_path(PageKey.from_path("a/b")) == PageKey("a/b")
    assert str(PageKey.from_path("a/b")) == "a/b"


def test_session_dir() -> None:
    assert kvfs.session_dir("agent-1") == "sessions/agent-1"
    assert kvfs.session_dir("sessions/agent-1") == "sessions/agent-1"
    assert kvfs.session_dir("lmcache/x/") == "lmcache/x"
    assert kvfs.session_dir(".") == "."
    for bad in ("", "..", "sessions/a/b", "a\x00"):
        with pytest.raises(kvfs.InvalidKey):
            kvfs.session_dir(bad)


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/abs",
        "a//b",
        "a/",
        "./a",
        "a/./b",
        "../a",
        "a/..",
        "a/b\x00",
        ".kvfs.json",
        "d/.kvfs-x",
        "x" * (MAX_NAME_BYTES + 1),
        "é" * 128,
        "/".join(["y" * 100] * 11),
        "sessions/s",
        "sessions/s/p",
        "sessions/s/p/l/extra",
    ],
)
def test_bad_paths(path: str) -> None:
    with pytest.raises(kvfs.InvalidKey) as ei:
        PageKey.from_path(path)
    assert isinstance(ei.value, ValueError) and str(ei.value)


def test_limits_are_exact() -> None:
    assert PageKey.from_path("x" * MAX_NAME_BYTES).path == "x" * MAX_NAME_BYTES
    long_ok = "/".join(["z" * 200] * 5)  # 1004 bytes
    assert len(long_ok) <= MAX_PATH_BYTES and PageKey.from_path(long_ok).path == long_ok
    with pytest.raises(kvfs.InvalidKey, match="longer than"):
        split_path(long_ok + "/" + "w" * (MAX_PATH_BYTES - len(long_ok)))


@pytest.mark.parametrize(
    "parts",
    [
        ("", "p", 0),
        ("s", "", 0),
        ("s", "p", ""),
        ("..", "p", 0),
        ("s", ".", 0),
        ("s/x", "p", 0),
        ("s", "p/q", 0),
        ("s", "p", -1),
        ("s", "p", True),
        ("s\x00", "p", 0),
        (1, "p", 0),
    ],
)
def test_bad_semantic_parts(parts: tuple) -> None:
    with pytest.raises(kvfs.InvalidKey):
        PageKey.semantic(*parts)


def test_unicode_names_round_trip() -> None:
    k = PageKey.semantic("sitzung-ü", "präfix-✓", "layer-007")
    assert PageKey.from_path(k.path) == k and k.layer_index == 7


def test_a_page_and_a_directory_of_pages_cannot_share_a_name(sync_store: kvfs.SyncStore) -> None:
    """On the mount a path is a file or a directory: `kvfs put f dir` over dir/page made the
    mount show dir as a file and dir/page unreachable, and a page under a page was hidden."""
    s = sync_store
    s.put("dir/page", b"1")
    with pytest.raises(kvfs.PageExists, match="is a directory of pages"):
        s.put("dir", b"2")
    with pytest.raises(kvfs.PageExists, match="'dir/page' is a page"):
        s.put("dir/page/sub", b"3")
    s.put("dir/page", b"4", replace=True)  # replacing the page itself is fine
    s.put("dirx", b"5")  # a name that only starts alike
    s.put("other", b"6")
    with pytest.raises(kvfs.PageExists, match="is a directory of pages"):
        s.rename("other", "dir")
    s.rename("dir/page", "dir/page/inner")  # under its own old name: it is gone from there
    assert s.get("dir/page/inner") == b"4" and s.exists("other") and not s.exists("dir")


def test_found_by_an_audit_of_the_object_api(sync_store: kvfs.SyncStore) -> None:
    """Each of these was wrong before (an audit of the object API as a Python user meets it)."""
    import numpy as np

    s = sync_store
    # a numpy integer is a layer index ("layer must be a string, not int64")
    assert PageKey.semantic("s", "p", np.int64(3)).path == "sessions/s/p/layer-003"
    with pytest.raises(kvfs.InvalidKey, match="int or a name, not float"):
        PageKey.semantic("s", "p", 2.5)  # type: ignore[arg-type]
    # an object array's bytes are pointers: stored, they meant nothing anywhere else
    with pytest.raises(TypeError, match="Python objects"):
        s.put("obj", np.array(["hello", 42], dtype=object))
    assert not s.exists("obj")
    # the key's type is named, not the value's ("got 1: str")
    with pytest.raises(kvfs.InvalidKey, match=r"the key 1 \(int\)"):
        s.put("a", b"x", attrs={1: "v"})  # type: ignore[dict-item]
    # a session name that is no string ("argument of type 'int' is not iterable")
    with pytest.raises(kvfs.InvalidKey, match="session must be a string, not int"):
        s.pin_session(5)  # type: ignore[arg-type]
    # unpinning, or setting the attributes of, no session made an empty one that listed
    for call in (lambda: s.unpin_session("typo"), lambda: s.set_session_attrs("typo", {})):
        with pytest.raises(kvfs.SessionNotFound, match="no session 'typo'"):
            call()
    assert [x.session for x in s.sessions()] == []
    # a session below a page can never hold one: pinning it reserved a ghost that listed
    s.put("top.bin", b"x")
    for d in ("top.bin/sub", "top.bin/"):
        with pytest.raises(kvfs.PageExists, match="'top.bin' is a page"):
            s.pin_session(d)
    assert [x.session for x in s.sessions()] == ["."]
    # put_many's items are pairs, checked before any put (an IndexError, some stored)
    with pytest.raises(TypeError, match="item 1 is"):
        s.put_many([("k0", b"0"), ("k1",)])  # type: ignore[list-item]
    assert not s.exists("k0")
    # ... of a valid key and a buffer, the item named: the others were stored, and the error
    # did not say which item failed
    bad: list[tuple[list[tuple[str, object]], type[Exception], str]] = [
        ([("k0", b"0"), ("k1", None), ("k2", b"2")], TypeError, r"item 1 \(k1\): page data"),
        (
            [("k0", b"0"), ("a/../b", b"1")],
            kvfs.InvalidKey,
            r"item 1 \(a/../b\): path .a/../b.: component",
        ),
        ([("k0", b"0"), ("k0", b"1")], ValueError, "item 1 repeats the key of item 0"),
    ]
    for items, error, match in bad:
        with pytest.raises(error, match=match):
            s.put_many(items)
        assert not s.exists("k0")
    s.put("k0", b"0")
    with pytest.raises(TypeError, match=r"item 1 \(k0\): the buffer to read into is read-only"):
        s.get_many(["k0", "k0"], into=[bytearray(1), b"x"])
    # one buffer (or two views of one) for two pages: it held one of them, no error
    shared = np.zeros(4, np.uint8)
    for into in ([shared, shared], [shared[:2], np.zeros(1, np.uint8), shared[1:]]):
        with pytest.raises(ValueError, match="buffers of items 0 and 1 overlap|0 and 2 overlap"):
            s.get_many(["k0"] * len(into), into=into)
    assert s.get_many(["k0", "k0"], into=[shared[:1], shared[1:2]]) == [1, 1]
    # a zero-size array of more than one dimension ("cannot cast view with zeros in shape")
    s.put("empty", np.zeros((0, 8, 128), dtype=np.float16))
    assert s.get("empty") == b"" and s.get("empty", into=np.zeros((0, 8), np.float16)) == 0


def test_attrs_are_what_the_mount_can_show(sync_store: kvfs.SyncStore) -> None:
    """An attribute is the xattr ``user.kvfs.attr.<name>`` on the mount: a name or value
    Linux cannot hand over (XATTR_NAME_MAX, XATTR_SIZE_MAX) is refused at the put, as is a
    mount attribute (``fs.*``) that does not parse: one made its file, and every listing of
    its directory, fail with EIO."""
    s = sync_store
    bad = [
        ({"": "v"}, "must be 1 to 240 bytes"),
        ({"n" * 241: "v"}, "must be 1 to 240 bytes"),
        ({"a\0b": "v"}, "without NUL"),
        ({"big": "v" * (64 * 1024 + 1)}, "65537 bytes; at most 65536"),
        ({"fs.uid": "abc"}, "are the mount's"),
        ({"fs.mode": "999"}, "are the mount's"),
        ({"fs.mode": "17777"}, "are the mount's"),
        ({"fs.gid": "-1"}, "are the mount's"),
        ({"fs.other": "1"}, "are the mount's"),
    ]
    for attrs, match in bad:
        with pytest.raises(kvfs.InvalidKey, match=match):
            s.put("a/p", b"x", attrs=attrs)
        assert not s.exists("a/p")
    s.put("a/p", b"x", attrs={"n" * 240: "v" * 64 * 1024, "fs.mode": "600", "fs.mtime_ns": "-5"})
    s.put("sessions/t/p/layer-000", b"y")  # a session's show in .kvfs.json: any size
    s.set_session_attrs("t", {"notes": "n" * 100_000, "fs.uid": "x"})
    with pytest.raises(kvfs.InvalidKey, match="not valid UTF-8"):
        s.set_session_attrs("t", {"bad": "\udc80"})


def test_a_range_of_no_ints_is_a_type_error_naming_the_argument(
    sync_store: kvfs.SyncStore,
) -> None:
    """``read_range(key, "0", 5)`` or with ``size=None`` failed with "'<' not supported
    between instances of 'str' and 'int'", a float with "'float' object cannot be
    interpreted as an integer", and a bool was taken as 0 or 1."""
    import numpy as np

    s = sync_store
    s.put("r", b"0123456789")
    for offset, size, what in (("0", 5, "offset"), (0, None, "size"), (0.0, 5, "offset")):
        with pytest.raises(TypeError, match=f"a range's {what} is an int, not"):
            s.read_range("r", offset, size)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offset is an int, not True"):
        s.read_range("r", True, 5)
    assert s.read_range("r", np.int64(2), np.uint8(3)) == b"234"  # (numpy's ints are ints)


def test_a_range_of_numpy_ints_of_mixed_kinds_reads_as_python_ints_would(
    sync_store: kvfs.SyncStore,
) -> None:
    """An int64 offset and a uint64 size added up to a float64, which no slice takes
    (TypeError "slice indices must be integers"), and uint64s wrapped around in the leaf
    arithmetic (a RuntimeWarning: overflow, an error under strict warnings)."""
    import numpy as np

    s = sync_store
    s.put("r", b"0123456789")
    assert s.read_range("r", np.int64(2), np.uint64(3)) == b"234"
    assert s.read_range("r", np.uint64(5), np.uint64(3)) == b"567"
    assert s.read_range("r", np.int64(8), np.int64(2**62)) == b"89"
    with s.engine.lease("r") as (page, blob):
        assert bytes(s.engine.read_held(page, blob, np.int64(1), np.uint64(2))) == b"12"


def test_a_torch_tensor_is_refused_with_the_byte_view_to_pass_instead(
    sync_store: kvfs.SyncStore,
) -> None:
    """A torch tensor has no buffer interface: put and get(into=) said only "not Tensor",
    and ``tensor.numpy()``, the obvious way out, refuses bf16, the dtype of most KV."""
    torch = pytest.importorskip("torch", reason="needs the engines extra (make test installs it)")
    s = sync_store
    kv = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    with pytest.raises(TypeError, match=r"pass tensor\.view\(torch\.uint8\)\.numpy\(\)"):
        s.put("t", kv)
    assert not s.exists("t")
    s.put("t", kv.view(torch.uint8).numpy())
    out = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"pass tensor\.view\(torch\.uint8\)\.numpy\(\)"):
        s.get("t", into=out)
    assert s.get("t", into=out.view(torch.uint8).numpy()) == kv.numel() * 2
    assert torch.equal(out, kv)


def test_a_puts_flags_are_true_or_false(sync_store: kvfs.SyncStore) -> None:
    """``put(key, data, replace="no")`` replaced the page (a non-empty string is truthy),
    and ``pin="false"`` pinned it: a flag that is no bool is a TypeError, and the page
    already there is kept."""
    import numpy as np

    s = sync_store
    s.put("f/a", b"first")
    for name, bad in (("replace", "no"), ("replace", 1), ("pin", "false"), ("pin", None)):
        with pytest.raises(TypeError, match=f"put's {name} is True or False, not"):
            s.put("f/a", b"second", **{name: bad})  # type: ignore[arg-type]
    assert s.get("f/a") == b"first" and not s.stat("f/a").pinned
    s.put("f/a", b"third", replace=np.bool_(True), pin=np.bool_(False))  # (numpy's bools)
    assert s.get("f/a") == b"third" and not s.stat("f/a").pinned


@pytest.mark.parametrize("concurrency", [None, 2.5, "4", True])
def test_a_batchs_concurrency_is_an_int(
    make_config,  # noqa: ANN001
    concurrency: object,
) -> None:
    """put_many and get_many with a concurrency that is no int (None, 2.5): "'<' not
    supported between ..." from the sync store, "initial_value must be an int" from trio
    in the async one. A TypeError naming it, before anything is stored."""
    import trio

    cfg = make_config()
    with kvfs.open_store_sync(cfg) as s:
        for call in (
            lambda: s.put_many([("a/x", b"1")], concurrency=concurrency),  # type: ignore[arg-type]
            lambda: s.get_many(["a/x"], concurrency=concurrency),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match="concurrency is an int"):
                call()
        assert not s.exists("a/x")

    async def main() -> None:
        async with kvfs.open_store(cfg) as a:
            with pytest.raises(TypeError, match="concurrency is an int"):
                await a.put_many([("a/x", b"1")], concurrency=concurrency)  # type: ignore[arg-type]
            assert not await a.exists("a/x")

    trio.run(main)
