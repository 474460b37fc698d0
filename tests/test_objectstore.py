"""Conformance suite every object store runs (the contract in objectstore/_abc.py), plus the
errors a bad endpoint, a missing bucket and denied access give."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from kvfs import ArchiveAccessDenied, ArchiveUnavailable, CorruptPage
from objectstore import (
    Backoff,
    FileStore,
    ObjectNotFound,
    ObjectStore,
    S3Store,
    open_objectstore,
    parse_url,
)

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


async def test_a_key_that_only_begins_others_holds_no_object(store: ObjectStore) -> None:
    """``d`` while ``d/x`` is stored is a missing key, as on S3: a file store, where it is
    a directory, raised ArchiveUnavailable ("Is a directory") for its delete."""
    await store.put("d/x", b"1")
    assert not await store.exists("d")
    with pytest.raises(ObjectNotFound):
        await store.get("d")
    await store.delete("d")  # absent: no error
    assert await store.get("d/x") == b"1"
    assert await store.list_all() == ["d/x"]


async def test_a_key_beginning_others_and_one_they_begin(store: ObjectStore) -> None:
    """S3 stores ``d`` and ``d/x`` both; a file store, where ``d`` is then a directory,
    cannot. Its conditional put of ``d`` answered False ("already stored") with no object
    there, and the others failed as an outage (ArchiveUnavailable "Is a directory")."""
    await store.put("d/x", b"1")
    await store.put("f", b"2")
    cases = [("d", True), ("d", False), ("f/y", True), ("f/y/z", False)]
    if isinstance(store, S3Store):
        for key, if_absent in cases:
            assert await store.put(key, key.encode(), if_absent=if_absent)
            assert await store.get(key) == key.encode()
        assert await store.list_all() == ["d", "d/x", "f", "f/y", "f/y/z"]
        return
    for key, if_absent in cases:
        with pytest.raises(ValueError, match="cannot both be stored in a file:// archive"):
            await store.put(key, b"x", if_absent=if_absent)
        assert not await store.exists(key)
    assert await store.list_all() == ["d/x", "f"]
    assert await store.get("d/x") == b"1" and await store.get("f") == b"2"


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


async def test_list_prefixes_that_end_mid_name_and_odd_characters(store: ObjectStore) -> None:
    keys = ["blobs/abc", "blobs/ab/x", "blobs/a-c", "t/100% sure", "t/caf\u00e9", "t/\u65e5"]
    for k in keys:
        await store.put(k, k.encode())
    assert await store.list_all("blobs/ab") == ["blobs/ab/x", "blobs/abc"]
    assert await store.list_all("blobs/a") == ["blobs/a-c", "blobs/ab/x", "blobs/abc"]
    assert await store.list_all("t/") == ["t/100% sure", "t/caf\u00e9", "t/\u65e5"]
    assert await store.list_all() == sorted(keys)  # ("-" before "/", as S3's byte order)
    for k in keys:
        assert await store.get(k) == k.encode()


async def test_list_of_a_prefix_no_key_can_begin_is_empty(
    store: ObjectStore, tmp_path: Path
) -> None:
    """A file store walked the directory a prefix's ``..`` named: ``list_all("../")`` gave
    the files beside the archive as keys."""
    (tmp_path / "beside").write_bytes(b"not an object")
    await store.put("k", b"v")
    for prefix in ("../", "../../", "k/../", "/", "//k", "./k"):
        assert await store.list_all(prefix) == [], prefix


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
    with pytest.raises(ArchiveUnavailable, match="does not exist") as ei:
        await open_objectstore(f"s3://no-such-bucket-kvfs?endpoint={s3_server.endpoint}")
    assert str(ei.value).count(s3_server.endpoint) == 1  # named once, not once per layer


async def test_a_vanished_archive_is_unavailable_not_empty(tmp_path: Path, s3_server) -> None:  # noqa: ANN001
    """A deleted archive directory or bucket read as an archive with nothing in it: every
    restore then failed as a corrupt object, a listing showed no sessions, a delete
    "succeeded"."""
    import shutil

    fs = await open_objectstore(f"file://{tmp_path / 'arch'}")
    await fs.put("blobs/aa", b"x")
    shutil.rmtree(tmp_path / "arch")
    for op in (fs.get("blobs/aa"), fs.list_all("blobs/"), fs.exists("blobs/aa"), fs.delete("b")):
        with pytest.raises(ArchiveUnavailable, match="does not exist"):
            await op
    bucket = s3_server.new_bucket()
    s3 = await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}")
    async with s3:
        await s3.put("blobs/aa", b"x")
        s3_server.client().delete_object(Bucket=bucket, Key="blobs/aa")
        s3_server.client().delete_bucket(Bucket=bucket)
        for op in (s3.get("blobs/aa"), s3.list_all("blobs/"), s3.delete("blobs/aa")):
            with pytest.raises(ArchiveUnavailable, match="does not exist"):
                await op


async def test_options_are_parsed_and_checked(tmp_path: Path) -> None:
    # ``create=false`` arrived as the string "false", which is true: the directory was made.
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        await open_objectstore(f"file://{tmp_path / 'absent'}?create=false")
    assert not (tmp_path / "absent").exists()
    s = await open_objectstore(f"file://{tmp_path / 'a'}?durable=no")
    assert isinstance(s, FileStore) and s.durable is False
    for url, match in [
        (f"file://{tmp_path}/a?durable=maybe", "durable must be true or false"),
        (f"file://{tmp_path}/a?endpoint=http://x", "unknown file:// option"),
        ("s3://b?part_size=big", "part_size must be a number"),
        ("s3://b?sse=aes", "sse must be one of AES256, aws:kms, aws:kms:dsse"),
        ("s3://b?sse_kms_key_id=k", "sse_kms_key_id needs sse=aws:kms"),
        ("s3://b?sse=AES256&sse_kms_key_id=k", "sse_kms_key_id needs sse=aws:kms"),
        ("s3://b?storage_class=deep_archive", "DEEP_ARCHIVE: such objects must be restored"),
        ("s3://b?storage_class=GLACIER", "GLACIER: such objects must be restored"),
        ("s3://b?checksums=off", "checksums must be when_supported or when_required"),
    ]:
        with pytest.raises(ValueError, match=match):
            await open_objectstore(url)


@pytest.mark.parametrize(
    "endpoint",
    ["http://AKIAKEY:topsecret@127.0.0.1:9000", "http://topsecret%40127.0.0.1:9000", "ftp://x"],
)
async def test_an_endpoint_with_credentials_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="S3 endpoint") as ei:
        await open_objectstore("s3://b", endpoint=endpoint)
    if "topsecret" in endpoint:
        assert "topsecret" not in str(ei.value) and "credentials" in str(ei.value)


def test_debug_logs_never_show_credentials(s3_server, tmp_path: Path) -> None:  # noqa: ANN001
    """``kvfs --debug`` turned on botocore's debug log, which prints request headers: the
    session token among them."""
    env = {
        **os.environ,
        "AWS_SESSION_TOKEN": "kvfs-test-session-token-5e1f",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    (tmp_path / "f").write_bytes(b"page" * 1000)
    where = ["--data", str(tmp_path / "d"), "--archive"]
    where.append(f"s3://{s3_server.new_bucket()}?endpoint={s3_server.endpoint}")
    err = ""
    for cmd in (["put", "f", "sessions/a/p/layer-000"], ["spill", "a"], ["restore", "a"]):
        r = subprocess.run(
            [sys.executable, "-m", "cli", "--debug", *cmd, *where],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        err += r.stderr
    assert " DEBUG kvfs" in err  # the debug log was on
    assert "kvfs-test-session-token-5e1f" not in err


@pytest.mark.parametrize(
    ("spoilt", "error", "said"),
    [
        ("cut", ArchiveUnavailable, "still failing"),
        ("damaged", CorruptPage, "does not match the checksum the server stored"),
    ],
)
async def test_a_body_spoilt_on_the_way_is_read_again(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    spoilt: str,
    error: type[Exception],
    said: str,
) -> None:
    """A GET whose body the connection dropped raised urllib3's or botocore's own error,
    which nothing retried or named. One whose body came damaged (a faulty NIC, proxy or
    middlebox) raised FlexibleChecksumError (boto3 checks a GET's body against the CRC32
    the server stored with the object), which was taken for permanent. Both are read
    again: the object comes whole. Damaged at every read until the deadline, the object is
    damaged where it is stored: CorruptPage (as the archive down, one such object made a
    whole restore give up on the archive)."""

    def spoil(times: int) -> None:
        if spoilt == "cut":
            proxy.cut_responses(after=100_000, times=times)
        else:
            proxy.corrupt_responses(at=500_000, times=times)

    bucket = s3_server.new_bucket()
    data = os.urandom(MiB)
    try:
        async with (
            await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}") as direct,
            await open_objectstore(f"s3://{bucket}?endpoint={proxy.endpoint}", deadline=3) as s,
        ):
            await direct.put("big", data)
            spoil(2)
            assert await s.get("big") == data
            spoil(1_000_000)
            with pytest.raises(error, match=said):
                await s.get("big")
    finally:
        spoil(0)


async def test_an_http_proxy_down_is_retried_as_the_endpoint_down_is(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through an HTTP proxy (``HTTP_PROXY``, ``HTTPS_PROXY``: boto3 takes them from the
    environment), a proxy restarting refused every call at once with botocore's
    ProxyConnectionError, which nothing retried: a spill or a restore failed on the first
    refused connection, where an endpoint down is retried until the deadline."""
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, f"http://kvfsuser:proxysecret@127.0.0.1:{proxy.port}")
    bucket = s3_server.new_bucket()
    async with await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}") as s:
        await s.put("k", b"through the proxy")
        assert proxy.sent  # (the calls go through it)
        proxy.down()

        async def back_soon() -> None:
            await trio.sleep(0.5)
            proxy.up()

        async with trio.open_nursery() as n:
            n.start_soon(back_soon)
            assert await s.get("k") == b"through the proxy"
            await s.put("k", b"again")
        proxy.down()
        s.backoff = Backoff(deadline=0.5)
        with pytest.raises(ArchiveUnavailable, match="still failing") as ei:
            await s.get("k")
        assert "proxysecret" not in str(ei.value)  # (botocore masks the proxy's password)


async def test_a_read_from_an_endpoint_that_never_answers_ends_when_cancelled(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
) -> None:
    """An endpoint that accepts connections and never answers (a stalled proxy, a
    blackholed route): a get, head or list held its caller, cancelled or not, for the whole
    read timeout, so a reader interrupted or a cleanup bounded to a few seconds waited on.
    Reads now end when their caller is cancelled."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={proxy.endpoint}&read_timeout=30"
    async with await open_objectstore(url) as s:
        await s.put("k", b"v")
        proxy.delay = 40.0  # every forwarded chunk waits: nothing comes back
        try:
            for read in (s.get("k"), s.modified("k"), s.list_all("")):
                with trio.fail_after(10):  # (the thread alone would take 30 s)
                    with trio.move_on_after(0.5) as scope:
                        await read
                assert scope.cancelled_caught
        finally:
            proxy.delay = 0.0
            proxy.down()  # (the stalled pipes end with their connections)


async def test_a_reply_cut_in_its_headers_is_retried_not_taken_as_empty(s3_server, proxy) -> None:  # noqa: ANN001
    """botocore parses a 200 reply cut off in its headers into an empty result: a listing
    with no keys (kvfs's collector took that as "no manifest names these objects" and
    deleted another host's only copies), an object of 0 bytes (reported as corrupt)."""
    bucket = s3_server.new_bucket()
    data = os.urandom(100_000)
    url = f"s3://{bucket}?endpoint={proxy.endpoint}"
    async with await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}") as direct:
        await direct.put("manifests/a", b"m")
        await direct.put("blobs/x", data)
    calls = {
        "list": (lambda s: s.list_all("manifests/"), ["manifests/a"]),
        "get": (lambda s: s.get("blobs/x"), data),
        "head": (lambda s: s.exists("blobs/x"), True),
    }
    for name, (call, want) in calls.items():
        async with await open_objectstore(url, deadline=3) as s:  # a fresh connection pool
            proxy.cut_responses(after=20, times=1)  # inside the status line's headers
            assert await call(s) == want, name
    async with await open_objectstore(url, deadline=1) as s:
        proxy.cut_responses(after=20, times=1_000_000)
        with pytest.raises(ArchiveUnavailable, match="cut off, or not from an S3 server"):
            await s.list_all("manifests/")
    proxy.cut_responses(after=0, times=0)


async def test_an_endpoint_that_is_not_s3_is_refused_at_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server answering 200 to everything passed the bucket check (a HEAD); a spill then
    "uploaded" to it and dropped the only local copies."""
    import http.server

    # credentials of its own (run alone, no S3 fixture has set any)
    for k, v in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y")):
        monkeypatch.setenv(k, v)
    import threading

    class Html(http.server.BaseHTTPRequestHandler):
        def _ok(self) -> None:
            body = b"<html>hello</html>"
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _ok

        def log_message(self, *a: object) -> None:
            """Quiet: a request line per call would bury the test's own output."""

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"s3://b?endpoint=http://127.0.0.1:{srv.server_address[1]}"
        with pytest.raises(ArchiveUnavailable, match="not from an S3 server"):
            await open_objectstore(url, open_deadline=1)
        # opened without the check (kvfs's upload workers), a put is not taken as stored
        s = await open_objectstore(url, verify=False, deadline=1)
        with pytest.raises(ArchiveUnavailable, match="not from an S3 server"):
            await s.put("k", b"v")
        with pytest.raises(ArchiveUnavailable, match="not from an S3 server"):
            await s.exists("k")
        await s.aclose()
    finally:
        srv.shutdown()
        srv.server_close()


async def test_an_endpoint_that_never_answers_gives_up_near_open_deadline() -> None:
    """botocore retried once more on its own, each attempt waiting the whole read timeout
    (60 s): a silent endpoint held ``kvfs mount`` for two minutes, not ``open_deadline``."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel accepts connections; nobody ever answers
        port = listener.getsockname()[1]
        start = trio.current_time()
        with pytest.raises(ArchiveUnavailable, match="cannot reach"):
            await open_objectstore(f"s3://b?endpoint=http://127.0.0.1:{port}", open_deadline=1)
        assert trio.current_time() - start < 30  # was 120 s; about 1-2 s now


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


async def test_denied_access_is_named(s3_server) -> None:  # noqa: ANN001
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()
    policy = [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}"},
    ]  # (moto refuses a bucket's HEAD only when every action on it is)
    with iam_credentials(s3_server, policy):
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        with pytest.raises(ArchiveAccessDenied, match=r"access denied \(403\)") as ei:
            await open_objectstore(f"s3://{bucket}?endpoint={s3_server.endpoint}")
    assert secret not in str(ei.value)
    assert "s3:ListBucket" in str(ei.value)  # what the check at open needs


@pytest.mark.parametrize(
    ("variable", "code"),
    [
        ("AWS_SECRET_ACCESS_KEY", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "InvalidAccessKeyId"),
    ],
)
async def test_a_wrong_secret_key_or_key_id_is_named_with_where_it_is_set(
    s3_server,  # noqa: ANN001
    variable: str,
    code: str,
) -> None:
    """A wrong secret key (or an access key id the server does not know) read as a missing
    permission: "access denied (403): it needs s3:ListBucket ...". The open's first request
    is a HEAD, and S3's 403 to a HEAD has no body to say why; nor has the HEAD of an object,
    the first request of a store opened unchecked (an upload worker's). A request answered
    with a body now tells a wrong key from a refused permission."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/p?endpoint={s3_server.endpoint}"
    with iam_credentials(s3_server, [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]):
        os.environ[variable] = "AKIAWRONGKEY00000000"  # (iam_credentials restores it)
        with pytest.raises(ArchiveAccessDenied, match=code) as ei:
            await open_objectstore(url)
        store = await open_objectstore(url, verify=False)
        try:
            with pytest.raises(ArchiveAccessDenied, match=code) as head:
                await store.exists("blobs/x")
        finally:
            await store.aclose()
    for message in (str(ei.value), str(head.value)):
        assert variable in message and "access denied" not in message, message
        assert "s3:ListBucket" not in message and "AKIAWRONGKEY" not in message, message
    assert "checking the bucket" in str(ei.value) and "head blobs/x" in str(head.value)


async def test_missing_directory_without_create(tmp_path: Path) -> None:
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        await FileStore.open(tmp_path / "absent", create=False)


def test_bad_urls() -> None:
    for url in ["http://x", "s3://", "file://", "s3://user:secret@bucket"]:
        with pytest.raises(ValueError):
            trio.run(open_objectstore, url)
    # '#' starts a fragment: s3://b/team#1 was the archive s3://b/team, options dropped
    for url in ["s3://b/team#1", "s3://b/x#y?endpoint=http://h", "file:///a#b", "s3://b/t#"]:
        with pytest.raises(ValueError, match="cannot hold '#'"):
            trio.run(open_objectstore, url)


def test_file_urls_name_the_directory() -> None:
    """``file://localhost/var/a`` (RFC 8089's local host) made an archive in
    ``localhost/var/a`` under the process's working directory."""
    for url, where in [
        ("file:///var/a", "/var/a"),
        ("file://localhost/var/a", "/var/a"),
        ("file://LOCALHOST/var/a", "/var/a"),
        ("file:/var/a", "/var/a"),
        ("file:///var/my%20archive", "/var/my archive"),
        ("file://rel/a", "rel/a"),
    ]:
        assert parse_url(url)[:2] == ("file", where), url


async def test_the_key_limit_counts_the_prefix(s3_server) -> None:  # noqa: ANN001
    """A key under 1024 bytes with a long prefix was sent (AWS refuses it; moto took it)."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/{'p' * 100}?endpoint={s3_server.endpoint}&addressing=path"
    async with await open_objectstore(url) as s:
        await s.put("k" * 900, b"fits")
        with pytest.raises(ValueError, match="over 1024 bytes with the prefix"):
            await s.put("k" * 1000, b"too long")


async def test_filestore_crash_leftovers_are_invisible(tmp_path: Path) -> None:
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    await s.put("k", b"v")
    crashed = root / ".objectstore-tmp" / "deadbeef"
    crashed.write_bytes(b"half")  # a put a crash cut short, an hour ago
    os.utime(crashed, (time.time() - 3700, time.time() - 3700))
    # a put in flight in another process sharing the directory (another host's, on a
    # shared file system): an open removed it, and that put failed
    inflight = root / ".objectstore-tmp" / "feedface"
    inflight.write_bytes(b"half")
    assert await s.list_all() == ["k"]
    s2 = await FileStore.open(root)
    assert not crashed.exists() and inflight.exists()
    assert await s2.get("k") == b"v"


async def test_filestore_temporary_files_are_no_keys_under_any_prefix(tmp_path: Path) -> None:
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    await s.put("k", b"v")
    (root / ".objectstore-tmp" / "deadbeef").write_bytes(b"half")  # a put a crash cut short
    assert await s.list_all(".objectstore-tmp/") == []
    assert await s.list_all() == ["k"]


async def test_filestore_listing_an_unreadable_directory_is_an_error_not_empty(
    tmp_path: Path,
) -> None:
    """os.walk skips a directory it cannot read: listing ``manifests/`` where that
    directory refused access (EACCES; a failing disk's EIO alike) answered [], as if the
    archive had no manifest, which a collection takes as nothing naming the blobs."""
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    await s.put("manifests/a", b"1")
    await s.put("blobs/ab/x", b"2")
    code = (
        "import trio\n"
        "from objectstore import FileStore\n"
        "async def main():\n"
        f"    s = await FileStore.open({str(root)!r}, sweep=False)\n"
        "    for prefix in ('manifests/', ''):\n"
        "        try:\n"
        "            print(await s.list_all(prefix))\n"
        "        except Exception as e:\n"
        "            print(type(e).__name__, e)\n"
        "trio.run(main)\n"
    )
    drop: list[str] = []
    if os.geteuid() == 0:  # (permissions do not stop root: it lists without the capabilities)
        if not shutil.which("setpriv"):
            pytest.skip("setpriv (util-linux) is needed to list as root without DAC overrides")
        drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    (root / "manifests").chmod(0)
    try:
        out = subprocess.run(
            [*drop, sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    finally:
        (root / "manifests").chmod(0o700)
    assert len(out) == 2, out
    for line in out:
        assert line.startswith("ArchiveAccessDenied") and "access denied" in line, line
    assert await s.list_all() == ["blobs/ab/x", "manifests/a"]


async def test_a_read_only_filestore_with_crash_leftovers_opens(tmp_path: Path) -> None:
    """Opening sweeps a crashed put's temporary file: in an archive this process may not
    write (a share mounted read-only) the sweep's EROFS failed the open, which succeeds
    there without such a file."""
    root, view = tmp_path / "arch", tmp_path / "view"
    s = await FileStore.open(root)
    await s.put("k", b"v")
    crashed = root / ".objectstore-tmp" / "deadbeef"
    crashed.write_bytes(b"half")
    os.utime(crashed, (time.time() - 3700, time.time() - 3700))
    view.mkdir()
    if os.geteuid() == 0:  # (permissions do not stop root: a read-only bind mount does)
        bind = ["mount", "--bind", str(root), str(view)]
        if subprocess.run(bind, capture_output=True).returncode:
            pytest.skip("cannot bind-mount here")
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
            r = await FileStore.open(view)
            assert await r.get("k") == b"v" and await r.list_all() == ["k"]
            with pytest.raises(ArchiveUnavailable, match="Read-only file system"):
                await r.put("k2", b"v")
        finally:
            subprocess.run(["umount", str(view)], check=True)
    else:
        crashed.parent.chmod(0o500)
        try:
            r = await FileStore.open(root)
            assert await r.get("k") == b"v" and await r.list_all() == ["k"]
        finally:
            crashed.parent.chmod(0o700)
    assert crashed.exists()  # (for a host that may write: its open removes it)
    await FileStore.open(root)
    assert not crashed.exists()


async def test_filestore_open_leaves_only_the_directory(tmp_path: Path) -> None:
    """Opening made ``.objectstore-tmp`` at once: a kvfs store that then refused the
    archive (a share not mounted, only its mount point there) left it behind."""
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    assert list(root.iterdir()) == []
    await s.put("k", b"v")  # the first put makes it
    assert await s.get("k") == b"v" and await s.list_all() == ["k"]
    for f in root.iterdir():
        subprocess.run(["rm", "-r", str(f)], check=True)
    root.rmdir()
    with pytest.raises(ArchiveUnavailable, match="does not exist"):
        await s.put("k2", b"v")
    assert not root.exists()


async def test_second_opener_without_sweep_keeps_in_flight_puts(tmp_path: Path) -> None:
    # kvfs's upload workers open the directory their daemon opened: a sweep there would
    # remove a sibling worker's temporary file between its write and its link.
    root = tmp_path / "arch"
    await FileStore.open(root)
    inflight = root / ".objectstore-tmp" / "0123abcd"
    inflight.parent.mkdir()  # (made by the first put)
    inflight.write_bytes(b"being written by another process")
    s = await open_objectstore(f"file://{root}", verify=False)
    assert inflight.exists()
    assert await s.put("k", b"v", if_absent=True)
    assert await s.get("k") == b"v"
    await open_objectstore(f"file://{root}")  # a first opener sweeps only what is old
    assert inflight.exists()
    os.utime(inflight, (time.time() - 3700, time.time() - 3700))  # left by a crash
    await open_objectstore(f"file://{root}")
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


async def test_reads_given_up_on_a_hung_endpoint_leave_trio_s_threads_to_others(
    s3_server,  # noqa: ANN001 - (for its credentials in the environment)
) -> None:
    """A read given up by its caller (``abandon_on_cancel``) keeps its thread until the
    endpoint answers or the read timeout passes, and trio keeps the thread's limiter token
    as long. On trio's default limiter (40 tokens) a burst of such reads against a hung
    endpoint left nothing for every other ``to_thread.run_sync`` of the process (the
    daemon's control calls, the archive's index steps) for up to ``read_timeout``. Archive
    I/O now has threads of its own."""
    from _s3 import SilentServer

    server = SilentServer()
    store = await S3Store.open(
        "hung", endpoint_url=server.endpoint, read_timeout=120, max_connections=64, verify=False
    )
    default = trio.to_thread.current_default_thread_limiter()
    n = int(default.total_tokens)
    try:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(store.get, f"blobs/{i}")
            while server.requests < n:  # every read is in its thread, waiting for an answer
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        # the readers are gone; their threads still wait on the endpoint
        assert default.borrowed_tokens == 0, default.statistics()
        assert await trio.to_thread.run_sync(lambda: "a thread") == "a thread"
    finally:
        server.close()  # the abandoned reads fail now and their threads end
        await store.aclose()


async def test_filestore_refusal_is_access_denied(tmp_path: Path) -> None:
    # kvfs.ArchiveAccessDenied says a file:// archive's EACCES is one (a refusal, not an
    # outage: a restore goes on with the other objects), but FileStore raised the plain
    # ArchiveUnavailable that stops them. An object that cannot be removed: immutable as
    # root (which permissions do not stop), in a directory without write permission else.
    s = await FileStore.open(tmp_path / "arch")
    await s.put("blobs/ab/x", b"data")
    obj, folder = tmp_path / "arch" / "blobs" / "ab" / "x", tmp_path / "arch" / "blobs" / "ab"
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(obj)], capture_output=True).returncode:
            # (ext4, xfs and, since Linux 6.0, tmpfs support it: it runs on the CI machines)
            pytest.skip(f"chattr +i is not supported on the file system of {tmp_path}")
    else:
        folder.chmod(0o500)
    try:
        with pytest.raises(ArchiveAccessDenied, match="access denied"):
            await s.delete("blobs/ab/x")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(obj)], check=True)
        else:
            folder.chmod(0o700)
    assert await s.get("blobs/ab/x") == b"data"


async def test_s3_incomplete_uploads_of_killed_puts_are_aborted_once_stale(s3_server) -> None:  # noqa: ANN001
    """A put killed between its parts leaves an incomplete multipart upload: listed nowhere,
    billed by S3 until aborted. Only those under the store's prefix, and only once older
    than asked by the server's clock (moto dates every upload 2010-11-10)."""
    bucket = s3_server.new_bucket()
    s = await open_objectstore(f"s3://{bucket}/pre/fix?endpoint={s3_server.endpoint}")
    client = s3_server.client()

    def start(key: str) -> str:
        uid = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * 100)
        return uid

    def incomplete() -> list[str]:
        return sorted(
            u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ())
        )

    start("pre/fix/blobs/killed")
    start("pre/fix/manifests/killed")
    start("other/blobs/theirs")  # another store's prefix in the same bucket
    async with s:
        age = time.time() - 1289422113  # 2010-11-10T20:48:33Z
        assert await s.abort_stale_uploads(age + 365 * 86400) == 0  # not that old
        assert len(incomplete()) == 3
        assert await s.abort_stale_uploads(3600) == 2
        assert incomplete() == ["other/blobs/theirs"]
        assert await s.abort_stale_uploads(3600) == 0
        await s.put("k", b"v")  # the store works on
        assert await s.get("k") == b"v"


async def test_a_failed_multipart_put_is_aborted_through_a_busy_server(s3_server) -> None:  # noqa: ANN001
    """A multipart put that fails aborts its upload once, and an abort that S3 answered
    503 SlowDown (as it answers any request while it sheds load) left the parts in the
    bucket, billed, for a day, until a sweep (or for good, where the credentials may not
    list them). An abort the server answers with a temporary error is now tried again."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    with OlderS3Server(s3_server.endpoint, refuses="completion, first abort slowed down") as srv:
        url = f"s3://{bucket}?endpoint={srv.endpoint}&addressing=path"
        async with await open_objectstore(url, multipart_threshold=5 * MiB, part_size=5 * MiB) as s:
            with pytest.raises(ArchiveUnavailable, match="InvalidPart"):
                await s.put("blobs/big", os.urandom(11 * MiB))
        assert [r for r in srv.refused if r.startswith("DELETE")]  # (an abort was slowed)
    assert not s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no markers"])
async def test_a_sweep_goes_through_every_page_of_the_upload_listing(
    s3_server,  # noqa: ANN001
    markers: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S3 lists 1,000 incomplete uploads at a time. A sweep now goes on from the markers
    the server names, and from its last upload listed where it names none (a KeyError
    ended the sweep there). The proxy answers two uploads a page, as such a bucket is
    answered past 1,000; moto itself never pages."""
    from _s3 import UPLOADS_PAGE, OlderS3Server

    kind = "upload listing in pages" + ("" if markers else ", no markers")
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    keys = [f"p/blobs/k{i}" for i in range(3)] + ["p/manifests/m"] * 2  # (two of one key)
    for key in [*keys, "other/blobs/theirs"]:
        uid = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x")
    with OlderS3Server(s3_server.endpoint, refuses=kind) as server:
        url = f"s3://{bucket}/p?endpoint={server.endpoint}&addressing=path"
        async with await open_objectstore(url) as s:
            assert await s.abort_stale_uploads(3600) == len(keys)
        pages = [r for r in server.refused if "uploads" in r]
        assert len(pages) == -(-len(keys) // UPLOADS_PAGE)  # (every page, each once)
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", ())
    assert [u["Key"] for u in left] == ["other/blobs/theirs"]
    assert "nowhere to go on" not in caplog.text


async def test_a_listing_whose_markers_do_not_move_on_ends_the_sweep(
    s3_server,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that answers every page truncated with the same markers (it ignores them
    in the request) ends the sweep with a warning, once it asked for the same page twice,
    instead of asking for ever."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    client = s3_server.client()
    for i in range(3):
        client.create_multipart_upload(Bucket=bucket, Key=f"p/blobs/k{i}")
    with OlderS3Server(s3_server.endpoint, refuses="upload listing in pages, stuck") as server:
        url = f"s3://{bucket}/p?endpoint={server.endpoint}&addressing=path"
        async with await open_objectstore(url) as s:
            with trio.fail_after(30):  # (none old enough: the same uploads at every look)
                assert await s.abort_stale_uploads(1000 * 365 * 86400) == 0
        assert len([r for r in server.refused if "uploads" in r]) == 2
    assert "nowhere to go on from (after p/blobs/k1)" in caplog.text


async def test_filestore_sweeps_only_stale_temporary_files(tmp_path: Path) -> None:
    root = tmp_path / "arch"
    s = await FileStore.open(root)
    await s.put("k", b"v")
    tmp = root / ".objectstore-tmp"
    old, young = tmp / "deadbeef", tmp / "feedface"
    old.write_bytes(b"half")
    young.write_bytes(b"half")  # another process's put in flight
    os.utime(old, (time.time() - 7300, time.time() - 7300))
    assert await s.abort_stale_uploads(7200) == 1
    assert not old.exists() and young.exists()
    assert [p.name for p in tmp.iterdir()] == ["feedface"]  # (nor is its clock probe left)
    assert await s.list_all() == ["k"]


async def test_s3_encryption_and_the_storage_class_of_cold_objects(s3_server) -> None:  # noqa: ANN001
    """Buckets whose policy demands server-side encryption refused every put without it;
    ``sse`` asks for it on every object, and ``storage_class`` keeps the objects put
    ``cold`` (pages') in a cheaper class, single or multipart, and only those."""
    kms = boto3_client(s3_server, "kms").create_key()["KeyMetadata"]["KeyId"]
    for query, want in [
        ("sse=AES256&storage_class=standard_ia", {"ServerSideEncryption": "AES256"}),
        (
            f"sse=aws:kms&sse_kms_key_id={kms}&storage_class=GLACIER_IR",
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": kms},
        ),
    ]:
        bucket = s3_server.new_bucket()
        cls = "STANDARD_IA" if "standard_ia" in query else "GLACIER_IR"
        async with await open_objectstore(
            f"s3://{bucket}/p?endpoint={s3_server.endpoint}&{query}",
            multipart_threshold=5 * MiB,
            part_size=5 * MiB,
        ) as s:
            big = os.urandom(6 * MiB)
            assert await s.put("blobs/small", b"page", cold=True)
            assert await s.put("blobs/big", big, cold=True, if_absent=True)
            assert await s.put("manifests/m", b"manifest")
            assert await s.get("blobs/big") == big and await s.get("blobs/small") == b"page"
        client = s3_server.client()
        for key, cold in [("p/blobs/small", True), ("p/blobs/big", True), ("p/manifests/m", False)]:
            head = client.head_object(Bucket=bucket, Key=key)
            for field, value in want.items():
                assert head.get(field, "").endswith(value), (key, field, head.get(field))
            assert head.get("StorageClass", "STANDARD") == (cls if cold else "STANDARD"), key


def boto3_client(server, service: str):  # noqa: ANN001, ANN201
    import boto3

    return boto3.client(service, endpoint_url=server.endpoint, region_name="us-east-1")


async def test_a_sweep_never_aborts_this_processs_upload_in_flight(s3_server, proxy) -> None:  # noqa: ANN001
    """A server whose clock dates an upload long ago (moto says 2010 of every one) made a
    sweep at a daemon's start abort that daemon's own multipart upload in flight: each of
    its parts then failed until the put's deadline (found by a test whose spill ran beside
    the sweep)."""
    bucket = s3_server.new_bucket()
    proxy.delay = 0.002  # (the upload is slow enough to be seen in flight)
    s = await open_objectstore(
        f"s3://{bucket}/p?endpoint={proxy.endpoint}&addressing=path",
        multipart_threshold=5 * MiB,
        part_size=5 * MiB,
    )
    client = s3_server.client()
    big = os.urandom(11 * MiB)
    async with s, trio.open_nursery() as n:
        n.start_soon(s.put, "blobs/big", big)
        with trio.fail_after(30):
            while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
                await trio.sleep(0.01)
        assert await s.abort_stale_uploads(3600, "blobs/") == 0
    assert await s3_get(s3_server, bucket, "p/blobs/big") == big


async def s3_get(server, bucket: str, key: str) -> bytes:  # noqa: ANN001
    return server.client().get_object(Bucket=bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]


async def test_a_server_without_listobjectsv2_is_an_error_not_a_partial_listing(
    s3_server,  # noqa: ANN001
) -> None:
    """A server that ignores ListObjectsV2's list-type=2 (Ceph RGW before Luminous, some
    gateways) answers a long listing in ListObjects' shape, truncated, without a
    continuation token: a bare KeyError escaped kvfs's listing. It is now
    ArchiveUnavailable naming the cause, and never a listing cut short, which a collection
    would take for the whole."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    client = s3_server.client()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # (one more than a listing's page)
        list(
            pool.map(
                lambda i: client.put_object(Bucket=bucket, Key=f"p/{i:04d}", Body=b"x"), range(1001)
            )
        )
    server = OlderS3Server(s3_server.endpoint, refuses="listing v1")
    try:
        s = await open_objectstore(f"s3://{bucket}/p?endpoint={server.endpoint}&deadline=5")
        async with s:
            with pytest.raises(ArchiveUnavailable, match="ListObjectsV2"):
                [k async for k in s.list("")]
            assert server.refused  # (rewritten: the listings went to the server as V1)
    finally:
        server.close()


async def test_a_host_whose_clock_is_off_is_told_so(s3_server) -> None:  # noqa: ANN001
    """S3 refuses every request of a host whose clock is more than 15 minutes from its own
    (403 RequestTimeTooSkewed, retried as it may be set right meanwhile): the error, at
    open and on any call, named only the code, which says nothing of a clock to a reader."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    server = OlderS3Server(s3_server.endpoint, refuses="clock skew")
    try:
        url = f"s3://{bucket}?endpoint={server.endpoint}&open_deadline=0.5&deadline=0.5"
        with pytest.raises(ArchiveUnavailable, match="clock is more than 15 minutes"):
            await open_objectstore(url)
        s = await open_objectstore(url, verify=False)
        async with s:
            with pytest.raises(ArchiveUnavailable, match="clock is more than 15 minutes"):
                await s.put("k", b"x")
            for call in (s.exists, s.get):  # (a HEAD's 403 has no code of its own)
                with pytest.raises(ArchiveUnavailable, match="clock is more than 15 minutes") as e:
                    await call("k")
                assert not isinstance(e.value, ArchiveAccessDenied)
    finally:
        server.close()


async def test_a_server_with_a_private_cas_certificate_is_named_with_the_fix(
    s3_server,  # noqa: ANN001
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An on-premises MinIO or Ceph over HTTPS mostly has a certificate a CA of its own
    signed, which the system does not trust: the open failed with the TLS error alone. It
    now says to set AWS_CA_BUNDLE, and with it set the store opens and writes."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    server = OlderS3Server(s3_server.endpoint, refuses="nothing", tls=tmp_path)
    try:
        # (when_required: over HTTPS boto3 otherwise streams a put as aws-chunked with a
        # checksum trailer, in chunked transfer encoding, which the test proxy does not take)
        url = f"s3://{bucket}?endpoint={server.endpoint}&checksums=when_required"
        assert url.count("https://") == 1
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        with pytest.raises(ArchiveUnavailable, match="set AWS_CA_BUNDLE") as e:
            await open_objectstore(url)
        assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)  # (the TLS error itself)
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "ca.pem"))
        s = await open_objectstore(url)
        async with s:
            await s.put("k", b"over TLS")
            assert await s.get("k") == b"over TLS"
    finally:
        server.close()


async def test_a_request_a_proxy_timed_out_is_retried(s3_server) -> None:  # noqa: ANN001
    """A reverse proxy in front of MinIO or Ceph RGW (nginx, HAProxy, a load balancer)
    answers 408 Request Timeout to a request whose body came too slowly, a moment's
    trouble that the request sent again gets past: the put failed at once with it."""
    from _s3 import OlderS3Server

    bucket = s3_server.new_bucket()
    with OlderS3Server(s3_server.endpoint, refuses="first put timed out by a proxy") as srv:
        url = f"s3://{bucket}?endpoint={srv.endpoint}&addressing=path&deadline=10"
        async with await open_objectstore(url) as s:
            await s.put("k", b"x")
            assert await s.get("k") == b"x"
        assert len(srv.refused) == 1  # (the first put was answered 408)
