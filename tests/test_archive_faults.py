"""Archive faults: SIGKILL mid-spill then restart, and the endpoint going down during a spill.
The S3 endpoint the store sees is a TCP proxy (tests/_s3.py) in front of moto."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvfs
from kvfs import PageKey

KiB = 1024
CHILD = textwrap.dedent("""
    import sys, numpy as np, kvfs
    from kvfs import PageKey
    dirs, url, n = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
    cfg = kvfs.StoreConfig(data_dirs=tuple(dirs), stripe_unit=64 * 1024, archive_url=url,
                           extra={"archive": {"interval": 0, "concurrency": 2}})
    with kvfs.open_store_sync(cfg) as s:
        for i in range(n):
            s.put(PageKey.semantic("victim", "p", i), np.random.default_rng(i).bytes(256 * 1024))
        print("ready", flush=True)
        s.spill("victim")
        print("spilled", flush=True)
""")


def page(i: int) -> bytes:
    import numpy as np

    return np.random.default_rng(i).bytes(256 * KiB)


def proxied_config(
    s3_server: Any, proxy: Any, make_config: Any, *, ndev: int, query: str, **archive: object
) -> tuple[str, kvfs.StoreConfig]:
    """A new bucket and a store config whose archive is that bucket behind the proxy, with
    ``query`` (deadline, connect_timeout) on the URL and ``archive`` beside interval=0."""
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={proxy.endpoint}&{query}"
    return bucket, make_config(
        ndev=ndev, archive_url=url, extra={"archive": {"interval": 0, **archive}}
    )


@contextlib.contextmanager
def older_server(s3_server: Any, refuses: str) -> Iterator[tuple[Any, str, str]]:
    """moto behind tests/_s3.py's OlderS3Server refusing ``refuses``, a new bucket, and an
    archive URL for it through that server that uploads objects over 5 MiB in parts of
    5 MiB: ``(server, bucket, url)``."""
    from _s3 import OlderS3Server

    with OlderS3Server(s3_server.endpoint, refuses=refuses) as server:
        bucket = s3_server.new_bucket()
        url = (
            f"s3://{bucket}/p?endpoint={server.endpoint}&addressing=path&deadline=30"
            f"&multipart_threshold={5 << 20}&part_size={5 << 20}"
        )
        yield server, bucket, url


#: a store's archive settings for these tests: no background spiller, uploads in-process
IN_PROCESS = {"archive": {"interval": 0, "upload_processes": 0}}


def patient(cfg: kvfs.StoreConfig) -> kvfs.StoreConfig:
    """``cfg`` with a 30 s deadline and the default read timeout: for the steps of a
    fault test that speak to the real server, which a loaded CI machine has taken more than
    0.2 s to answer (a test's last restore failed with ArchiveUnavailable)."""
    url, _, query = cfg.archive_url.partition("?")
    kept = [kv for kv in query.split("&") if kv.split("=")[0] not in ("deadline", "read_timeout")]
    return dataclasses.replace(cfg, archive_url=f"{url}?{'&'.join([*kept, 'deadline=30'])}")


def put_pages(s: kvfs.SyncStore, session: str, n: int) -> None:
    for i in range(n):
        s.put(PageKey.semantic(session, "p", i), page(i))


@pytest.mark.slow
def test_sigkill_mid_spill_then_restart(s3_server, proxy, tmp_path: Path) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    n = 24
    dirs = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    slow_url = f"s3://{bucket}?endpoint={proxy.endpoint}&deadline=30"
    proxy.delay = 0.004  # per forwarded chunk: the spill takes seconds, not milliseconds
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, ",".join(dirs), slow_url, str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while not s3_server.keys(bucket, "blobs/"):
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for f in (child.stdout, child.stderr):
            if f is not None:
                f.close()
    uploaded = s3_server.keys(bucket, "blobs/")
    assert 0 < len(uploaded) < n, "the kill did not land mid-spill"
    assert s3_server.keys(bucket, "manifests/") == []  # nothing half-visible
    proxy.delay = 0
    cfg = kvfs.StoreConfig(
        data_dirs=tuple(dirs),
        stripe_unit=64 * KiB,
        archive_url=f"s3://{bucket}?endpoint={s3_server.endpoint}",
        extra={"archive": {"interval": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        infos = s.list(session="victim")
        assert len(infos) == n and all(i.local for i in infos)  # nothing lost locally
        again = s.spill("victim")  # redo: what is already there is not uploaded again
        assert again > 0
        assert len(s3_server.keys(bucket, "blobs/")) == n
        sid = s.engine.store_id  # type: ignore[attr-defined]
        assert s3_server.keys(bucket, "manifests/") == [f"manifests/sessions%2Fvictim@{sid}"]
        assert s.statistics().extra["archive"]["dedup_skipped"] >= len(uploaded)
        assert all(i.tier == "archive" for i in s.list(session="victim"))
        for i in range(n):
            assert s.get(PageKey.semantic("victim", "p", i)) == page(i)
        assert s.fsck()["orphans"] == []


@pytest.mark.slow
def test_endpoint_down_during_spill(s3_server, proxy, make_config) -> None:  # noqa: ANN001
    _, cfg = proxied_config(
        s3_server, proxy, make_config, ndev=2, query="deadline=60&connect_timeout=1"
    )
    with kvfs.open_store_sync(cfg) as s:
        put_pages(s, "cold", 8)
        proxy.down()
        result: list[object] = []

        def spill() -> None:
            try:
                result.append(s.spill("cold"))
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                result.append(e)

        t = threading.Thread(target=spill)
        t.start()
        # Foreground reads and writes keep working while the archive is unreachable.
        for i in range(8):
            s.put(PageKey.semantic("hot", "p", i), page(100 + i))
            assert s.get(PageKey.semantic("hot", "p", i)) == page(100 + i)
            assert s.get(PageKey.semantic("cold", "p", i)) == page(i)
        assert not result, "the spill finished while the endpoint was down"
        assert s.session_info("cold").local_bytes == s.session_info("cold").bytes
        proxy.up()
        t.join(timeout=120)
        assert not t.is_alive()
        assert isinstance(result[0], int) and result[0] > 0, result
        assert s.session_info("cold").local_bytes == 0
        for i in range(8):
            assert s.get(PageKey.semantic("cold", "p", i)) == page(i)


def test_endpoint_down_past_deadline_loses_nothing(s3_server, proxy, make_config) -> None:  # noqa: ANN001
    _, cfg = proxied_config(
        s3_server, proxy, make_config, ndev=1, query="deadline=0.5&connect_timeout=0.5"
    )
    with kvfs.open_store_sync(cfg) as s:
        put_pages(s, "a", 3)
        proxy.down()
        with pytest.raises(kvfs.ArchiveUnavailable):
            s.spill("a")
        assert all(i.tier == "local" for i in s.list(session="a"))
        # cannot upload, so nothing is dropped, and the caller hears why (it returned 0
        # after trying each page alone, a deadline apiece: kvfs evict exited 0)
        with pytest.raises(kvfs.ArchiveUnavailable):
            s.evict(session="a")
        assert all(i.tier == "local" for i in s.list(session="a"))
        for i in range(3):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)
        proxy.up()
        assert s.spill("a") > 0
    os.environ.get("AWS_ACCESS_KEY_ID")  # credentials stay in the environment, untouched


def test_a_put_needing_room_while_the_archive_is_down_tries_one_batch_and_says_why(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    make_config,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each eviction batch waited out the deadline, then the next batch was tried, until
    every local page had been (hours with the default deadline on a large store, the
    eviction lock held all along); the put then failed saying the rest was pinned."""
    _, cfg = proxied_config(
        s3_server, proxy, make_config, ndev=1, query="deadline=0.5&connect_timeout=0.5"
    )
    with kvfs.open_store_sync(cfg.replace(capacity=2 << 20)) as s:
        put_pages(s, "a", 7)
        proxy.down()
        caplog.clear()
        with pytest.raises(kvfs.CapacityExceeded, match="the archive is unreachable"):
            s.put(PageKey.semantic("b", "p", 0), page(9))
        tries = [r for r in caplog.records if "cannot evict" in r.getMessage()]
        assert len(tries) == 1, [r.getMessage() for r in tries]
        assert all(i.tier == "local" for i in s.list(session="a"))  # nothing lost
        proxy.up()
        s.put(PageKey.semantic("b", "p", 0), page(9))
        assert s.get(PageKey.semantic("a", "p", 0)) == page(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_with_the_endpoint_down_stops_trying_once_it_knows(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    make_config,  # noqa: ANN001
    workers: int,
) -> None:
    """Every download (every batch, with upload workers) of a large session waited out the
    store's deadline in turn before the restore said the archive was unreachable: minutes
    with the default deadline. Once one says so, the rest are not tried."""
    concurrency = 2
    _, cfg = proxied_config(
        s3_server,
        proxy,
        make_config,
        ndev=1,
        query="deadline=0.3&connect_timeout=0.3",
        concurrency=concurrency,
        upload_processes=workers,
    )
    with kvfs.open_store_sync(patient(cfg)) as s:
        put_pages(s, "a", 24)
        s.spill("a")
    with kvfs.open_store_sync(cfg) as s:
        policy = s.engine.policy  # type: ignore[attr-defined]
        tried: list[object] = []
        if workers:
            pool, run = policy.uploads, policy.uploads._run

            async def counting(jobs, call, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
                return await run(jobs, lambda b, n: (tried.append(b), call(b, n))[1], *args, **kw)

            pool._run = counting
        else:
            store, get = policy.store, policy.store.get

            async def counting_get(key: str, **kw: object) -> object:
                if key.startswith("blobs/"):
                    tried.append(key)
                return await get(key, **kw)

            store.get = counting_get
        proxy.down()
        with pytest.raises(kvfs.ArchiveUnavailable):
            s.restore("a")
        # one round: a download slot each (a worker each), not all 24 pages (6 batches)
        assert 0 < len(tried) <= max(concurrency, workers), len(tried)
        proxy.up()
    with kvfs.open_store_sync(patient(cfg)) as s:
        s.restore("a")
        for i in range(24):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)


def test_a_restore_worker_stops_downloading_its_batch_once_the_archive_is_unreachable(
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    make_config,  # noqa: ANN001
) -> None:
    """A restore worker tried every page of its batch in turn, ``concurrency / processes``
    at a time, each waiting out the store's deadline: with the defaults a 28-page session
    restored while the endpoint went away took four deadlines (240 s) to say so. Once one
    download says the archive is unreachable, the rest of its batch are not tried. The
    endpoint here reads each request and never answers, so every download tried is seen."""
    from _s3 import SilentServer

    _, cfg = proxied_config(
        s3_server,
        proxy,
        make_config,
        ndev=1,
        query="deadline=0.3&read_timeout=0.2&connect_timeout=0.2",
        concurrency=8,
        upload_processes=2,
    )
    # only the restore from the silent endpoint runs under the 0.3 s deadline
    with kvfs.open_store_sync(patient(cfg)) as s:
        put_pages(s, "a", 24)
        s.spill("a")
    silent = SilentServer()
    with kvfs.open_store_sync(cfg) as s:
        proxy.down()  # (cuts the workers' pooled connections to the real server)
        real, proxy.target = proxy.target, ("127.0.0.1", int(silent.endpoint.rsplit(":", 1)[1]))
        proxy.up()
        try:
            with pytest.raises(kvfs.ArchiveUnavailable):
                s.restore("a")
        finally:
            proxy.down()
            proxy.target = real
            proxy.up()
            silent.close()
        tried = {line.split()[1] for line in silent.lines if "/blobs/" in line}
        # two batches of 12, each 4 at a time: one round each, not all 24 pages
        assert 0 < len(tried) <= 8, sorted(tried)
    with kvfs.open_store_sync(patient(cfg)) as s:
        s.restore("a")
        for i in range(24):
            assert s.get(PageKey.semantic("a", "p", i)) == page(i)


def test_delete_while_endpoint_down_is_finished_later(s3_server, proxy, make_config) -> None:  # noqa: ANN001
    bucket, cfg = proxied_config(
        s3_server,
        proxy,
        make_config,
        ndev=1,
        query="deadline=30&connect_timeout=0.5",
        sync_cleanup_seconds=0.5,
    )
    with kvfs.open_store_sync(cfg) as s:
        put_pages(s, "a", 2)
        s.spill("a")
        assert len(s3_server.keys(bucket, "blobs/")) == 2
        proxy.down()
        s.delete(PageKey.semantic("a", "p", 0))  # local delete succeeds; archive work queued
        assert not s.exists(PageKey.semantic("a", "p", 0))
        assert len(s3_server.keys(bucket, "blobs/")) == 2
        a = s.statistics().extra["archive"]
        # the manifest rewrite, and the object it no longer names (it was counted nowhere)
        assert (a["spill_queue"], a["pending_deletes"]) == (1, 1)
        proxy.up()
    # closing finished the queued work: the manifest first, then the unreferenced object
    assert len(s3_server.keys(bucket, "blobs/")) == 1
    with kvfs.open_store_sync(cfg) as s:
        assert [x["pages"] for x in s.archived_sessions()] == [1]
        assert s.get(PageKey.semantic("a", "p", 1)) == page(1)


def test_an_archive_read_failing_in_a_task_group_raises_archive_unavailable(
    tmp_path: Path,
) -> None:
    """Manifests are read (and archived copies checked) by many tasks at once: when their
    GETs failed (throttled with 503 while listing worked) the error escaped as an
    ExceptionGroup where ArchiveUnavailable is promised: `kvfs rm` of a session whose local
    delete had worked exited 8 with "Exceptions from Trio nursery", and the daemon logged
    it as an unexpected error with a traceback."""
    cfg = kvfs.StoreConfig(
        data_dirs=(tmp_path / "d",),
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        for x in "abc":
            s.put(PageKey.semantic(x, "p", 0), x.encode() * 5000)
            s.spill(x)
        store = s.engine.policy.spiller.store
        real = store.get

        async def throttled(key: str, *a: Any, **kw: Any) -> Any:
            if key.startswith("manifests/") or key.startswith("blobs/"):
                raise kvfs.ArchiveUnavailable(f"GET {key}: 503 SlowDown (injected)")
            return await real(key, *a, **kw)

        store.get = throttled
        with pytest.raises(kvfs.ArchiveUnavailable, match="SlowDown"):
            s.archived_sessions()
        # (fsck says it beside what it checked and repaired here: archive_error)
        assert "SlowDown" in s.fsck(archive=True)["archive_error"][0]
        store.get = real
        assert len(s.archived_sessions()) == 3


def _allow_all_but(*denied: dict[str, object]) -> list[dict[str, object]]:
    return [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}, *denied]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restore_refused_for_some_objects_restores_the_others_and_says_access_denied(
    s3_server,  # noqa: ANN001
    make_config,  # noqa: ANN001
    workers: int,
) -> None:
    """A 403 (credentials, a bucket or IAM policy; S3 also answers 403 for a missing
    object without s3:ListBucket) was taken for an outage: once one object was refused, the
    restore stopped trying the others (the downloads not started, the worker batches not
    started) and said "archive unavailable". It is one object's answer, given at once: every
    other page comes back, and the error says which object, which operation, and the
    permission it needs."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()
    cfg = make_config(
        ndev=1,
        archive_url=f"s3://{bucket}?endpoint={s3_server.endpoint}&deadline=5",
        extra={"archive": {"interval": 0, "concurrency": 1, "upload_processes": workers}},
    )
    n = 12
    keys = [PageKey.semantic("a", "p", i) for i in range(n)]
    with kvfs.open_store_sync(cfg) as s:
        for k in keys:
            s.put(k, page(keys.index(k)))
        s.spill("a")
        hashes = [s.engine.index.page(k.path).hash for k in keys]  # type: ignore[attr-defined]
    refused = {f"blobs/{h.hex()}" for h in hashes[::2]}
    deny = {
        "Effect": "Deny",
        "Action": "s3:GetObject",
        "Resource": [f"arn:aws:s3:::{bucket}/{k}" for k in sorted(refused)],
    }
    with iam_credentials(s3_server, _allow_all_but(deny)), kvfs.open_store_sync(cfg) as s:
        with pytest.raises(kvfs.ArchiveAccessDenied) as got:
            s.restore("a")
        assert isinstance(got.value, PermissionError)
        message = str(got.value)
        assert "access denied (AccessDenied)" in message, message
        assert "s3:GetObject" in message and bucket in message, message
        assert any(k in message for k in refused), message  # the object refused
        tiers = [i.tier for i in s.list(session="a")]
        assert tiers[1::2] == ["local+archive"] * (n // 2), tiers  # every other one is back
        assert tiers[::2] == ["archive"] * (n // 2), tiers
        for i in range(1, n, 2):
            assert s.get(keys[i]) == page(i)
        with pytest.raises(kvfs.ArchiveAccessDenied, match="s3:GetObject"):
            s.get(keys[0])


def test_a_put_needing_room_when_the_archive_refuses_uploads_says_so(
    s3_server,  # noqa: ANN001
    make_config,  # noqa: ANN001
) -> None:
    """A refused upload made the put fail saying "the archive is unreachable": the user
    went looking for an outage where the credentials or a policy were wrong."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()
    cfg = make_config(
        ndev=1,
        capacity=2 << 20,
        archive_url=f"s3://{bucket}?endpoint={s3_server.endpoint}&deadline=5",
        extra={"archive": {"interval": 0}},
    )
    deny = {"Effect": "Deny", "Action": "s3:PutObject", "Resource": "*"}
    with iam_credentials(s3_server, _allow_all_but(deny)), kvfs.open_store_sync(cfg) as s:
        put_pages(s, "a", 7)
        with pytest.raises(kvfs.CapacityExceeded) as got:
            s.put(PageKey.semantic("b", "p", 0), page(9))
        message = str(got.value)
        assert "the archive refused access" in message and "s3:PutObject" in message, message
        assert "unreachable" not in message, message
        assert all(i.tier == "local" for i in s.list(session="a"))  # nothing lost


def test_a_wrong_secret_key_is_named_at_open_and_in_a_spill_not_taken_for_a_permission(
    s3_server,  # noqa: ANN001
    make_config,  # noqa: ANN001
) -> None:
    """A wrong secret key read as a missing permission: the open said "access denied (403):
    it needs s3:ListBucket" (its first request is a HEAD, whose 403 has no body to say
    why), and a spill whose upload workers started with the wrong key "access denied
    (SignatureDoesNotMatch): it needs s3:PutObject". Both name the wrong secret now, and
    the variable to fix."""
    from _s3 import iam_credentials

    from kvfs._uploader import shutdown_workers

    bucket = s3_server.new_bucket()
    cfg = make_config(
        ndev=1,
        archive_url=f"s3://{bucket}?endpoint={s3_server.endpoint}&deadline=5",
        extra={"archive": {"interval": 0, "upload_processes": 2}},
    )
    with iam_credentials(s3_server, _allow_all_but()):
        with kvfs.open_store_sync(cfg) as s:
            put_pages(s, "a", 2)
            os.environ["AWS_SECRET_ACCESS_KEY"] = "wrong"  # (iam_credentials restores it)
            shutdown_workers()  # the next spill's workers start with the wrong key
            with pytest.raises(kvfs.ArchiveAccessDenied) as spill:
                s.spill("a")
            assert all(i.tier == "local" for i in s.list(session="a"))  # nothing lost
        with pytest.raises(kvfs.ArchiveAccessDenied) as at_open:
            kvfs.open_store_sync(cfg).__enter__()
    for message in (str(spill.value), str(at_open.value)):
        assert "the secret access key is wrong (SignatureDoesNotMatch" in message, message
        assert "AWS_SECRET_ACCESS_KEY" in message and "access denied" not in message, message


def test_a_server_refusing_boto3s_default_checksums_is_named_and_the_option_fixes_it(
    s3_server: Any, make_config: Any
) -> None:
    """boto3 1.36 and later send S3's additional checksums (x-amz-checksum-crc32 ...) with
    every upload, which Backblaze B2, older Ceph RGW and MinIO releases and several clouds'
    S3 gateways refuse: every spill failed with the server's 400 and nothing in kvfs could
    stop the headers. The error now names the fix, and ``checksums=when_required`` on the
    archive URL spills and restores there, single-part and multipart, through the upload
    workers too, verified as always by kvfs's own checksums."""
    with older_server(s3_server, "checksums") as (server, _, url):
        small, large = os.urandom(300 * KiB), os.urandom(12 << 20)  # (large: 3 parts)
        keys = [PageKey.semantic("agent", "p", i) for i in range(2)]
        extra = {"archive": {"interval": 0}}
        with kvfs.open_store_sync(make_config(ndev=2, archive_url=url, extra=extra)) as s:
            s.put(keys[0], small)
            s.put(keys[1], large)
            with pytest.raises(kvfs.ArchiveUnavailable) as e:
                s.spill("agent")
            assert "checksums=when_required" in str(e.value), e.value
            assert "x-amz-checksum" in str(e.value)  # the server's own words
            assert server.refused
            assert s.get(keys[0]) == small and s.get(keys[1]) == large  # nothing lost
        refused = len(server.refused)
        cfg = make_config(ndev=2, archive_url=url + "&checksums=when_required", extra=extra)
        with kvfs.open_store_sync(cfg) as s:
            assert s.spill("agent") > 0
            s.evict(session="agent")
            assert {p.tier for p in s.list(session="agent")} == {"archive"}
            assert s.restore("agent") > 0
            assert s.get(keys[0]) == small and s.get(keys[1]) == large
        assert len(server.refused) == refused  # not one checksum header sent


def test_a_server_without_conditional_puts_still_takes_spills(
    s3_server: Any, make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """kvfs uploads content-named objects with If-None-Match: *, which AWS refused with 501
    NotImplemented before August 2024, as some S3 gateways still do: every spill failed.
    Now the store learns it once (one WARNING), checks for the object first instead, and
    spills and restores there, single-part and multipart; content already there is still
    not uploaded again."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvfs")
    with older_server(s3_server, "conditional") as (server, bucket, url):
        small, large = os.urandom(300 * KiB), os.urandom(12 << 20)
        extra = IN_PROCESS
        with kvfs.open_store_sync(make_config(ndev=2, archive_url=url, extra=extra)) as s:
            s.put(PageKey.semantic("a", "p", 0), small)
            s.put(PageKey.semantic("a", "p", 1), large)
            assert s.spill("a") > 0
            assert server.refused  # (it was asked)
            s.evict(session="a")
            assert s.restore("a") > 0
            assert s.get(PageKey.semantic("a", "p", 0)) == small
            assert s.get(PageKey.semantic("a", "p", 1)) == large
        blobs = s3_server.keys(bucket, "p/blobs/")
        # another host, the same content: found there, not uploaded again
        cfg = make_config(ndev=2, name="other", archive_url=url, extra=extra)
        with kvfs.open_store_sync(cfg) as s:
            s.put(PageKey.semantic("b", "p", 0), small)
            s.spill("b")
            s.evict(session="b")
            assert s3_server.keys(bucket, "p/blobs/") == blobs
            assert s.get(PageKey.semantic("b", "p", 0)) == small
        warned = [r for r in caplog.records if "conditional puts" in r.getMessage()]
        # (once: the second store's one put found its object there, which says nothing of
        # the server's conditional puts)
        assert len(warned) == 1, warned


def test_a_multipart_completion_refused_in_a_200_fails_at_once(
    s3_server: Any, make_config: Any
) -> None:
    """MinIO and Ceph RGW answer a CompleteMultipartUpload 200 at once and, when it then
    fails, put the error in the body (AWS may too); botocore makes that a 500, which kvfs
    retried until its deadline whatever the error, here one that no retry changes
    (InvalidPart). Now such an error is as permanent as it would be in a 4xx: the spill
    fails at once naming it, the upload is aborted, and nothing is lost."""
    with older_server(s3_server, "completion") as (server, bucket, url):
        large = os.urandom(12 << 20)
        extra = IN_PROCESS
        with kvfs.open_store_sync(make_config(ndev=2, archive_url=url, extra=extra)) as s:
            s.put(PageKey.semantic("a", "p", 0), large)
            with pytest.raises(kvfs.ArchiveUnavailable) as e:
                s.spill("a")
            assert "InvalidPart" in str(e.value) and "still failing" not in str(e.value)
            assert len(server.refused) == 1, server.refused  # asked once, not retried
            assert s.get(PageKey.semantic("a", "p", 0)) == large  # nothing lost
        client = s3_server.client()
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")  # aborted


def test_a_server_without_encryption_is_named_not_taken_for_one_without_conditional_puts(
    s3_server: Any, make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """MinIO without a KMS answers a put asking for server-side encryption (``sse=``) 501
    NotImplemented, the answer AWS gave a conditional put before August 2024: the store
    warned that the server "does not take conditional puts", believed it from then on, and
    the spill failed with the server's words alone. Now a 501 that the put without
    If-None-Match meets too is not the condition's, and the error names the option."""
    import logging

    caplog.set_level(logging.WARNING, logger="kvfs")
    with older_server(s3_server, "encryption") as (server, _, url):
        url += "&sse=AES256"
        small, large = os.urandom(300 * KiB), os.urandom(12 << 20)
        extra = IN_PROCESS
        with kvfs.open_store_sync(make_config(ndev=2, archive_url=url, extra=extra)) as s:
            for i, data in enumerate((small, large)):
                s.put(PageKey.semantic(f"s{i}", "p", 0), data)
                with pytest.raises(kvfs.ArchiveUnavailable) as e:
                    s.spill(f"s{i}")
                assert "KMS is not configured" in str(e.value)  # the server's words
                assert "sse=" in str(e.value), e.value  # and the option that asked
                assert s.get(PageKey.semantic(f"s{i}", "p", 0)) == data  # nothing lost
        assert not [r for r in caplog.records if "conditional puts" in r.getMessage()]


def test_a_multipart_completion_whose_answer_was_lost_is_not_a_failed_spill(
    s3_server: Any, make_config: Any
) -> None:
    """A CompleteMultipartUpload the server carried out, its answer lost on the way back
    (a reset connection), is tried again: AWS answers it as the first, but MinIO, Ceph RGW
    (and moto) say NoSuchUpload, the upload being done: the spill failed although the
    object was stored. The store now takes the object for its own when its ETag is the one
    its parts make, and the spill goes on."""
    with older_server(s3_server, "completion reply lost") as (server, _, url):
        large = os.urandom(12 << 20)
        extra = IN_PROCESS
        with kvfs.open_store_sync(make_config(ndev=2, archive_url=url, extra=extra)) as s:
            s.put(PageKey.semantic("agent", "p", 0), large)
            assert s.spill("agent") > 0
            assert len(server.lost) == 1 and len(server.refused) == 2  # (lost; retried)
            s.evict(session="agent")
            assert s.restore("agent") > 0
            assert s.get(PageKey.semantic("agent", "p", 0)) == large
