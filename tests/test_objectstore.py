"""Conformance suite every object store runs (the contract in objectstore/_abc.py), plus the
errors a bad endpoint, a missing bucket and denied access give."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from kvfs import ArchiveUnavailable
from objectstore import FileStore, ObjectNotFound, ObjectStore, S3Store, open_objectstore

MiB = 1 << 20


@pytest.fixture(params=["file", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    if request.param == "file":
        s: ObjectStore = await open_objectstore(f"file://{tmp_path / 'archive'}")
        assert isinstance(s, FileStore)
    else:
        srv = request.getfixturevalue("s3_server")
        bucket = srv.new_bucket()
        s = await open_objectstore(
            f"s3://{bucket}/pre/fix?endpoint={srv.endpoint}&addressing=path",
            multipart_threshold=5 * MiB,
            part_size=5 * MiB,
        )
        assert isinstance(s, S3Store)
    async with s:
        yield s


async def test_put_get_roundtrip(store: ObjectStore) -> None:
    assert await store.put("blobs/ab/cd", b"hello") is True
    assert await store.get("blobs/ab/cd") == b"hello"
    assert await store.exists("blobs/ab/cd")
    assert not await store.exists("blobs/ab/ce")


async def test_get_into_buffer(store: ObjectStore) -> None:
    await store.put("k", b"0123456789")
    buf = bytearray(16)
    assert await store.get("k", into=buf) == 10
    assert bytes(buf[:10]) == b"0123456789"
    with pytest.raises(ValueError, match="smaller"):
        await store.get("k", into=bytearray(4))


async def test_missing_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        await store.get("nope")
    with pytest.raises(FileNotFoundError):  # the builtin it inherits
        await store.get("dir/nope")


async def test_overwrite_and_conditional_put(store: ObjectStore) -> None:
    assert await store.put("k", b"one")
    assert await store.put("k", b"two")
    assert await store.get("k") == b"two"
    assert await store.put("k", b"three", if_absent=True) is False
    assert await store.get("k") == b"two"
    assert await store.put("fresh", b"x", if_absent=True) is True


async def test_concurrent_conditional_puts_leave_one_object(store: ObjectStore) -> None:
    results: list[bool] = []

    async def racer(i: int) -> None:
        results.append(await store.put("shared", b"same-content", if_absent=True))

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(racer, i)
    assert results.count(True) == 1
    assert await store.get("shared") == b"same-content"
    assert await store.list_all("shared") == ["shared"]


async def test_delete(store: ObjectStore) -> None:
    await store.put("a/b", b"1")
    await store.delete("a/b")
    assert not await store.exists("a/b")
    await store.delete("a/b")  # absent: no error


async def test_puts_racing_deletes_of_the_last_object_in_a_directory(store: ObjectStore) -> None:
    """A file store's delete removes the directory it leaves empty; a put into it at that
    moment found it gone (ENOENT, not retried) and failed with ArchiveUnavailable: a
    collection's intent racing its tidy-up, a spill's upload racing a collection."""

    async def churn(tag: int) -> None:
        for i in range(100):
            assert await store.put(f"gc/{tag}-{i}", b"x", if_absent=True)
            await store.put(f"gc/{tag}-{i}.done", b"y")
            await store.delete(f"gc/{tag}-{i}")
            await store.delete(f"gc/{tag}-{i}.done")

    async with trio.open_nursery() as n:
        for tag in range(4):
            n.start_soon(churn, tag)
    assert await store.list_all("gc/") == []


async def test_modified_is_the_stores_clock(store: ObjectStore) -> None:
    import time

    assert await store.modified("m/absent") is None
    before = time.time()
    await store.put("m/k", b"x")
    first = await store.modified("m/k")
    assert first is not None and abs(first - before) < 60  # same machine: clocks agree
    await trio.sleep(1.1)  # S3 keeps whole seconds
    await store.put("m/k", b"y")
    second = await store.modified("m/k")
    assert second is not None and second > first


async def test_list_versions_change_with_the_content(store: ObjectStore) -> None:
    await store.put("v/a", b"one")
    await store.put("v/b", b"two")
    first = dict(await store.list_versions("v/"))
    assert sorted(first) == ["v/a", "v/b"]
    await store.put("v/a", b"three")
    second = dict(await store.list_versions("v/"))
    if isinstance(store, S3Store):  # the ETag of each object, from the listing itself
        assert second["v/a"] != first["v/a"] and second["v/b"] == first["v/b"] != ""
    else:  # no tags: "" says "read it to know"
        assert set(first.values()) == set(second.values()) == {""}


async def test_list_prefix_sorted(store: ObjectStore) -> None:
    for k in ["m/2", "m/1", "b/x", "m/sub/3", "mz"]:
        await store.put(k, k.encode())
    assert await store.list_all("m/") == ["m/1", "m/2", "m/sub/3"]
    assert await store.list_all() == ["b/x", "m/1", "m/2", "m/sub/3", "mz"]
    assert await store.list_all("none/") == []


async def test_many(store: ObjectStore) -> None:
    for i in range(5):
        await store.put(f"x/{i}", bytes([i]) * 10)
    got = await store.get_many([f"x/{i}" for i in range(5)])
    assert got == {f"x/{i}": bytes([i]) * 10 for i in range(5)}
    await store.delete_many([f"x/{i}" for i in range(5)])
    assert await store.list_all("x/") == []


async def test_large_object_multipart(store: ObjectStore) -> None:
    data = os.urandom(12 * MiB + 123)  # above the 5 MiB threshold: 3 parts on S3
    assert await store.put("big", data)
    assert await store.get("big") == data
    assert await store.put("big", b"other", if_absent=True) is False
    assert await store.get("big") == data


async def test_empty_object(store: ObjectStore) -> None:
    await store.put("empty", b"")
    assert await store.get("empty") == b""


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "trail/"])
async def test_bad_keys(store: ObjectStore, bad: str) -> None:
    with pytest.raises(ValueError):
        await store.put(bad, b"x")


# -- errors naming the cause -------------------------------------------------------------
async def test_missing_bucket_is_named(s3_server) -> None:  # noqa: ANN001
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        await open_objectstore(f"s3://no-such-bucket-kvfs?endpoint={s3_server.endpoint}")


async def test_bad_endpoint_is_named() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ArchiveUnavailable, match="cannot reach") as ei:
        await open_objectstore(f"s3://b?endpoint=http://127.0.0.1:{port}", open_deadline=0.5)
    assert ei.value.__cause__ is not None
    assert "testing" not in str(ei.value)  # credentials never appear in messages


async def test_denied_access_is_named(s3_server, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    # moto checks signatures only with auth enabled; an unknown key id is denied there.
    from moto.core.config import default_user_config

    monkeypatch.setitem(default_user_config["iam"], "load_aws_managed_policies", False)
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEYID0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(ArchiveUnavailable, match="denied") as ei:
        await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}")
    assert "wrong-secret" not in str(ei.value)


async def test_missing_directory_without_create(tmp_path: Path) -> None:
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        await FileStore.open(tmp_path / "absent", create=False)


def test_bad_urls() -> None:
    for url in ["http://x", "s3://", "file://", "s3://user:secret@bucket"]:
        with pytest.raises(ValueError):
            trio.run(open_objectstore, url)


async def test_filestore_crash_leftovers_are_invisible(tmp_path: Path) -> None:
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    await s.put("k", b"v")
    (root / ".objectstore-tmp" / "deadbeef").write_bytes(b"half")  # a put a crash cut short
    assert await s.list_all() == ["k"]
    s2 = await FileStore.open(root)
    assert not (root / ".objectstore-tmp" / "deadbeef").exists()
    assert await s2.get("k") == b"v"


async def test_second_opener_without_sweep_keeps_in_flight_puts(tmp_path: Path) -> None:
    # kvfs's upload workers open the directory their daemon opened: a sweep there would
    # remove a sibling worker's temporary file between its write and its link.
    root = tmp_path / "arch"
    await FileStore.open(root)
    inflight = root / ".objectstore-tmp" / "0123abcd"
    inflight.write_bytes(b"being written by another process")
    s = await open_objectstore(f"file://{root}", verify=False)
    assert inflight.exists()
    assert await s.put("k", b"v", if_absent=True)
    assert await s.get("k") == b"v"
    await open_objectstore(f"file://{root}")  # a first opener sweeps, as after a crash
    assert not inflight.exists()


async def test_file_store_lists_a_prefix_without_reading_other_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing ``gc/`` walks ``gc/`` only, not the (large) ``blobs/`` beside it."""
    async with await open_objectstore(f"file://{tmp_path}") as st:
        for k in ("blobs/aa", "gc/x", "manifests/sessions%2Fa@1", "manifests/sessions%2Fab@1"):
            await st.put(k, b"1")
        walked: list[str] = []
        walk = os.walk

        def spy(top: str, *a: object, **kw: object) -> object:
            walked.append(os.path.relpath(top, tmp_path))
            return walk(top, *a, **kw)  # type: ignore[call-overload]

        monkeypatch.setattr(os, "walk", spy)
        assert await st.list_all("gc/") == ["gc/x"]
        assert await st.list_all("manifests/sessions%2Fa") == [
            "manifests/sessions%2Fa@1",
            "manifests/sessions%2Fab@1",
        ]
        assert walked == ["gc", "manifests"]
        assert await st.list_all("") == [
            "blobs/aa",
            "gc/x",
            "manifests/sessions%2Fa@1",
            "manifests/sessions%2Fab@1",
        ]
