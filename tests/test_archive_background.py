"""The archive tier's background passes and the rules on what leaves the local tier:
content shared with a session still in use stays local; a page only the archive holds is
always named by its session's manifest; pins hold against the watermark pass; one session
that cannot spill, or a session deleted under the pass, costs neither the other sessions
nor the daemon; a restore counts as an access; retiring a host leaves nothing uncollected.

Found by a review of the tier (tenth session); each test fails on the code before it.
Then the sweep of incomplete uploads killed puts leave (twenty-sixth session), and a store
run under exactly the least-privilege IAM policy docs/archive.md gives."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
import trio
from _archive_dir import named, objects
from _corrupt import flip_stored_byte
from botocore.exceptions import ClientError

import kvfs
from cli._store_cmds import render_stats
from kvfs import ArchiveUnavailable, PageKey
from tests.test_archive import archived_cfg, kv_page

Config = Callable[..., kvfs.StoreConfig]


def _url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'archive'}"


def _pressured(make_config: Config, url: str, **archive: object) -> kvfs.StoreConfig:
    """A 4 MiB store whose watermark pass spills any session at once."""
    archive = {"upload_processes": 0, "idle_seconds": 0, **archive}
    archive.setdefault("high_watermark", 0.1)
    archive.setdefault("low_watermark", 0.05)
    return archived_cfg(make_config, url, **archive).replace(capacity=4 << 20)


def test_spilling_a_session_keeps_content_another_session_still_holds(
    make_config: Config, tmp_path: Path
) -> None:
    """Sessions d and e hold the same content. Spilling d used to drop the shared local copy
    while no manifest of e named it: e's page lived only in the archive, unlisted there, and
    once d was deleted another host's collection deleted the object. Now the copy stays
    until e's manifest names it too (e spills), and e reads it after all of that."""
    url = _url(tmp_path)
    same = kv_page(1)
    kd, ke = PageKey.semantic("d", "p", 0), PageKey.semantic("e", "p", 0)
    a_cfg = archived_cfg(make_config, url, name="a", upload_processes=0)
    with kvfs.open_store_sync(a_cfg) as a:
        a.put(kd, same)
        a.put(ke, same)
        a.put(PageKey.semantic("d", "p", 1), kv_page(2))  # d's own content goes
        a.spill("d")
        assert a.stat(ke).tier == "local+archive"
        assert a.stat(PageKey.semantic("d", "p", 1)).tier == "archive"
        a.delete_session("d")
    with kvfs.open_store_sync(archived_cfg(make_config, url, name="b", upload_processes=0)) as b:
        kb = PageKey.semantic("x", "p", 0)
        b.put(kb, same)
        b.spill("x")
        b.delete_session("x")  # no manifest names the object now: it is collected
    assert kvfs.checksum(same).hex() not in objects(tmp_path / "archive")
    with kvfs.open_store_sync(a_cfg) as a:
        assert a.get(ke) == same  # its local copy
        a.spill("e")  # e's manifest names it: now it may go
        assert a.stat(ke).tier == "archive"
        assert a.get(ke) == same


def test_content_shared_by_spilled_sessions_leaves_with_the_last(
    make_config: Config, tmp_path: Path
) -> None:
    url = _url(tmp_path)
    prompt = kv_page(3)
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        for sess in ("a", "b", "c"):
            s.put(PageKey.semantic(sess, "sys", 0), prompt)
        s.spill("a")
        s.spill("b")
        assert s.stat(PageKey.semantic("c", "sys", 0)).tier == "local+archive"  # c uses it
        s.spill("c")
        assert {s.stat(PageKey.semantic(x, "sys", 0)).tier for x in "abc"} == {"archive"}
        assert s.statistics().used_bytes == 0
        assert kvfs.checksum(prompt).hex() in named(tmp_path / "archive")


def test_content_shared_by_sessions_spilled_one_open_at_a_time_leaves_with_the_last(
    make_config: Config, tmp_path: Path
) -> None:
    """`kvfs spill a`, then `kvfs spill b`: each a new process, which knew nothing of what
    the earlier one's manifests named (kept in memory), so the content both hold never
    left the local tier, however often they were spilled."""
    url, prompt = _url(tmp_path), kv_page(5)
    cfg = archived_cfg(make_config, url, upload_processes=0)
    with kvfs.open_store_sync(cfg) as s:
        for sess in ("a", "b"):
            s.put(PageKey.semantic(sess, "sys", 0), prompt)
        s.put(PageKey.semantic("a", "own", 0), kv_page(6))
    for sess in ("a", "b"):
        with kvfs.open_store_sync(cfg) as s:
            s.spill(sess)
    with kvfs.open_store_sync(cfg) as s:
        assert {s.stat(PageKey.semantic(x, "sys", 0)).tier for x in "ab"} == {"archive"}
        assert s.statistics().used_bytes == 0
        assert s.get(PageKey.semantic("b", "sys", 0)) == prompt


def test_a_drop_skips_content_a_session_without_a_naming_manifest_holds(
    make_config: Config, tmp_path: Path
) -> None:
    """The check sits inside the drop's transaction: a put that shared the content into a
    new session after the manifests were written keeps the copy local (an eviction or a
    spill racing a put)."""
    with kvfs.open_store_sync(archived_cfg(make_config, _url(tmp_path), upload_processes=0)) as s:
        same = kv_page(4)
        s.put(PageKey.semantic("a", "p", 0), same)
        pol = s.engine.policy
        pol.call(pol.spiller.spill_session, "sessions/a", False)  # archived and named, kept
        h = kvfs.checksum(same)
        s.put(PageKey.semantic("late", "p", 0), same)  # after a's manifest was written
        named_a = {"sessions/a": {("sessions/a/p/layer-000", h)}}
        both = {**named_a, "sessions/late": {("sessions/late/p/layer-000", h)}}
        assert pol.aindex.drop_local_many([h], named_a) == []
        assert s.engine.index.blob(h).local
        assert [r.hash for r in pol.aindex.drop_local_many([h], both)] == [h]


def test_the_watermark_pass_keeps_a_pinned_page_local(make_config: Config, tmp_path: Path) -> None:
    """An unpinned cold session holding a pinned page spills, but the pinned page stays local
    (an explicit `kvfs spill` of the session still takes it: it was asked for)."""
    with kvfs.open_store_sync(_pressured(make_config, _url(tmp_path))) as s:
        pinned = PageKey.semantic("s", "p", 0)
        s.put(pinned, kv_page(0), pin=True)
        for i in range(1, 8):
            s.put(PageKey.semantic("s", "p", i), kv_page(i))
        pol = s.engine.policy
        assert pol.call(pol.spiller.relieve_pressure) == 1
        assert s.stat(PageKey.semantic("s", "p", 1)).tier == "archive"
        assert s.stat(pinned).tier == "local+archive"
        s.spill("s")
        assert s.stat(pinned).tier == "archive"


def test_a_session_whose_pinned_pages_keep_the_store_over_the_watermark_spills_once(
    make_config: Config, tmp_path: Path
) -> None:
    """Its pinned pages keep the store over the high watermark: every pass spilled the
    session again, freeing nothing, a manifest written each time, for as long as it lasted.
    Now it is left alone until it changes."""
    with kvfs.open_store_sync(_pressured(make_config, _url(tmp_path))) as s:
        for i in range(10):  # ~480 KiB pinned, over the 410 KiB high watermark
            s.put(PageKey.semantic("s", "pinned", i), kv_page(i), pin=True)
        s.put(PageKey.semantic("s", "p", 0), kv_page(20))
        pol = s.engine.policy
        assert pol.call(pol.spiller.relieve_pressure) == 1
        assert s.stat(PageKey.semantic("s", "p", 0)).tier == "archive"
        written = s.statistics().extra["archive"]["manifests_written"]
        assert pol.call(pol.spiller.relieve_pressure) == 0
        assert pol.call(pol.spiller.relieve_pressure) == 0
        assert s.statistics().extra["archive"]["manifests_written"] == written
        s.put(PageKey.semantic("s", "p", 1), kv_page(21))  # changed: worth a pass again
        assert pol.call(pol.spiller.relieve_pressure) == 1
        assert s.stat(PageKey.semantic("s", "p", 1)).tier == "archive"


def test_a_session_deleted_under_the_watermark_pass_costs_neither_the_pass_nor_the_store(
    make_config: Config, tmp_path: Path
) -> None:
    """The pass lists cold sessions, then spills them one by one; a user's delete of one
    in between made spill_session raise SessionNotFound out of the background task, which
    took the whole store (the daemon) down."""
    cfg = _pressured(make_config, _url(tmp_path), interval=0.05)

    async def main() -> None:
        async with kvfs.open_store(cfg) as s:
            eng = s.engine
            spiller = eng.policy.spiller
            real = spiller.spill_session
            deleted: list[str] = []

            async def spill(d: str, *args: object, **kw: object) -> int:
                if d == "sessions/s2" and not deleted:  # the delete lands in the window
                    await trio.to_thread.run_sync(eng.delete_session, "s2")
                    deleted.append(d)
                return await real(d, *args, **kw)  # type: ignore[arg-type]

            spiller.spill_session = spill  # type: ignore[method-assign]
            for n, sess in enumerate(("s1", "s2", "s3")):
                for i in range(8):
                    await s.put(PageKey.semantic(sess, "p", i), kv_page(100 * n + i))
            with trio.fail_after(30):
                while not deleted or eng.index.session_usage("sessions/s3")["local_bytes"]:
                    await trio.sleep(0.05)
            assert await s.get(PageKey.semantic("s3", "p", 0)) == kv_page(200)  # still up

    trio.run(main)


def test_a_session_that_cannot_spill_holds_up_neither_the_others_nor_retention(
    make_config: Config, tmp_path: Path
) -> None:
    """A cold session with a damaged local page failed every pass first: no other session
    spilled, and the retention step after it in the same pass never ran."""
    # 15 pages of 48 KiB are under the high watermark, 16 above it: the pressure begins
    # once both sessions are whole (at 0.15 it began while "good" was being written, and
    # the pages put after its spill had read the session stayed local)
    cfg = _pressured(make_config, _url(tmp_path), interval=0.05, high_watermark=0.18)

    async def main() -> None:
        async with kvfs.open_store(cfg) as s:
            eng = s.engine
            for n, sess in enumerate(("bad", "good")):
                for i in range(8):
                    await s.put(PageKey.semantic(sess, "p", i), kv_page(100 * n + i))
                if sess == "bad":  # damaged before the pressure begins
                    flip_stored_byte(await s.stat(PageKey.semantic("bad", "p", 3)), 100)
            with trio.fail_after(30):  # "good" spills although "bad" fails first every pass
                while (await s.statistics()).extra["archive"]["sessions_spilled"] == 0:
                    await trio.sleep(0.05)
            assert eng.index.session_usage("sessions/good")["local_bytes"] == 0
            assert eng.index.session_usage("sessions/bad")["local_bytes"] > 0
            assert (await s.statistics()).extra["archive"]["errors"] >= 1

    trio.run(main)

    # retention runs although the pass before it fails every time
    cfg = _pressured(
        make_config, _url(tmp_path), name="r", interval=0.05, high_watermark=0.15, retention=1
    )

    async def expiring() -> None:
        async with kvfs.open_store(cfg) as s:
            eng = s.engine
            for i in range(16):
                await s.put(PageKey.semantic("bad", "p", i), kv_page(300 + i))
                if i == 3:
                    flip_stored_byte(await s.stat(PageKey.semantic("bad", "p", 3)), 100)
            await s.put(PageKey.semantic("old", "p", 0), kv_page(400))
            with trio.fail_after(30):
                while any(x.session == "old" for x in eng.sessions()):
                    await trio.sleep(0.05)

    trio.run(expiring)


def test_a_restored_session_is_not_expired_by_the_next_retention_pass(
    make_config: Config, tmp_path: Path
) -> None:
    """Host B restores a session host A spilled longer ago than B's retention. The restore
    kept A's last access, so B's next retention pass deleted the session it had just been
    asked for, and B's manifest, superseding A's, hid it from every host. Its pages kept
    theirs, and were the first an eviction took."""
    url = _url(tmp_path)
    data = kv_page(5)
    with kvfs.open_store_sync(archived_cfg(make_config, url, name="a", upload_processes=0)) as a:
        a.put(PageKey.semantic("agent", "p", 0), data)
        a.spill("agent")
    time.sleep(2.5)
    b_cfg = archived_cfg(make_config, url, name="b", upload_processes=0, retention=2)
    with kvfs.open_store_sync(b_cfg) as b:
        b.put(PageKey.semantic("used-before", "p", 0), kv_page(6))
        b.engine.flush_atimes()
        assert b.restore("agent") == len(data)
        assert time.time() - b.session_info("agent").atime < 2
        # its pages too: they were the first an eviction took (least recently used)
        assert time.time() - b.stat(PageKey.semantic("agent", "p", 0)).atime < 2
        [first] = b.engine.index.eviction_candidates(1)
        assert first.hash == kvfs.checksum(kv_page(6))
        pol = b.engine.policy
        assert pol.call(pol.spiller.expire_sessions) == 0
        assert "agent" in [x.session for x in b.sessions()]
        assert [x["session"] for x in b.archived_sessions()] == ["agent"]


def test_an_archive_failure_while_retiring_a_host_leaves_nothing_uncollected(
    make_config: Config, tmp_path: Path
) -> None:
    """The objects a retired host's manifests named were queued for collection only after
    all of them were deleted: a failure between two deletes left objects no manifest names
    and no queue holds, in the bucket for good. Each is now queued before its manifest goes."""
    arch = tmp_path / "archive"
    url = _url(tmp_path)
    h_cfg = archived_cfg(make_config, url, name="h", upload_processes=0, retention=1)
    with kvfs.open_store_sync(h_cfg) as h:
        for n, sess in enumerate(("s1", "s2")):
            h.put(PageKey.semantic(sess, "p", 0), kv_page(10 + n))
            h.spill(sess)
        pol = h.engine.policy
        pol.call(pol.spiller.hosts.tick)  # its heartbeat
        hid = h.engine.store_id
    os.utime(arch / "hosts" / hid, (1, 1))  # silent for decades
    r_cfg = archived_cfg(make_config, url, name="r", upload_processes=0, retention=1)
    with kvfs.open_store_sync(r_cfg) as r:
        pol = r.engine.policy
        store = pol.store
        real = store.delete
        deletes = [0]

        async def flaky(key: str) -> None:
            if key.startswith("manifests/"):
                deletes[0] += 1
                if deletes[0] == 2:
                    raise ArchiveUnavailable(f"delete {key}: endpoint down (injected)")
            await real(key)

        store.delete = flaky  # type: ignore[method-assign]
        with pytest.raises(ArchiveUnavailable, match="injected"):
            pol.call(pol.spiller.hosts.tick)
        store.delete = real  # type: ignore[method-assign]
        pol.call(pol.spiller.hosts.tick)  # retires the rest
        pol.call(pol.spiller.flush_pending)  # r's collection
        assert not named(arch) and not objects(arch)


def test_a_renamed_archive_only_page_is_always_named_by_some_manifest(
    make_config: Config, tmp_path: Path
) -> None:
    """A rename queues the manifests of both sessions. The source's was written first: when
    the destination's write then failed, the page was named by no manifest until the retry
    (and another host deleting the same content could collect its object). Now the
    manifests that gain content go first."""
    arch = tmp_path / "archive"
    with kvfs.open_store_sync(archived_cfg(make_config, _url(tmp_path), upload_processes=0)) as s:
        page = kv_page(20)
        s.put(PageKey.semantic("a", "p", 0), page)
        s.spill("a")
        s.put(PageKey.semantic("b", "p", 0), kv_page(21))
        s.spill("b")
        pol = s.engine.policy
        store = pol.store
        real = store.put

        async def down_for_b(key: str, data: bytes, **kw: object) -> bool:
            if "sessions%2Fb@" in key:
                raise ArchiveUnavailable(f"put {key}: endpoint down (injected)")
            return await real(key, data, **kw)  # type: ignore[arg-type]

        store.put = down_for_b  # type: ignore[method-assign]
        s.rename(PageKey.semantic("a", "p", 0), PageKey.semantic("b", "p", 1))
        with pytest.raises(ArchiveUnavailable, match="injected"):
            pol.call(pol.spiller.flush_pending)
        assert kvfs.checksum(page).hex() in named(arch)  # a's manifest still names it
        store.put = real  # type: ignore[method-assign]
        pol.call(pol.spiller.flush_pending)
        assert kvfs.checksum(page).hex() in named(arch)
        assert s.get(PageKey.semantic("b", "p", 1)) == page


def test_a_delete_made_without_the_archive_configured_reaches_it_later(
    make_config: Config, tmp_path: Path
) -> None:
    """`kvfs rm --data DIR` offline opens the store with no archive; the deleted session's
    manifest stayed in the archive, which listed and restored it again. The deletion is now
    queued in the index and done at the next open with the archive."""
    url = _url(tmp_path)
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        for sess in ("gone", "kept"):
            s.put(PageKey.semantic(sess, "p", 0), kv_page(30 if sess == "gone" else 31))
            s.spill(sess)
    with kvfs.open_store_sync(make_config(ndev=2)) as s:  # the same data, no archive
        assert s.delete_session("gone") == 1
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        pol = s.engine.policy
        pol.call(pol.spiller.flush_pending)  # (a daemon's first background pass)
        assert [x["session"] for x in s.archived_sessions()] == ["kept"]
        with pytest.raises(kvfs.SessionNotFound):
            s.restore("gone")
        assert kvfs.checksum(kv_page(30)).hex() not in objects(tmp_path / "archive")
        assert s.get(PageKey.semantic("kept", "p", 0)) == kv_page(31)


def test_a_store_opened_without_its_archive_drops_archived_copies_instead_of_pages(
    make_config: Config, tmp_path: Path
) -> None:
    """Opened without the archive it has (``kvfs put --offline`` or ``kvfs fsck --repair``
    with ``--data`` alone), a store deleted pages whose data the archive held: a put over
    the capacity evicted them by deletion, fsck --repair deleted a damaged copy's pages as
    "held nowhere else", and the next open with the archive collected their objects too.
    Now only the local copies go; the archive brings them back."""
    url = _url(tmp_path)
    pages = {PageKey.semantic("old", "p", i): kv_page(50 + i) for i in range(4)}
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        for k, v in pages.items():
            s.put(k, v)
        s.spill("old")
        s.restore("old")  # local and archived
    used = sum(len(v) for v in pages.values())
    offline = make_config(ndev=2, capacity=used + 64 * 1024)  # the same data, no archive
    with kvfs.open_store_sync(offline) as s:
        first = next(iter(pages))
        flip_stored_byte(s.stat(first), 100)
        report = s.fsck(repair=True)
        assert report["damaged_pages"] == [first.path]
        assert "the archive holds it" in report["repaired"][0], report["repaired"]
        s.put("new/p0", os.urandom(2 * len(pages[first])))  # evicts archived copies
        assert all(s.stat(k).tier in ("archive", "local+archive") for k in pages)
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        pol = s.engine.policy
        pol.call(pol.spiller.flush_pending)  # (a daemon's first background pass)
        assert {k: s.get(k) for k in pages} == pages
        assert all(kvfs.checksum(v).hex() in objects(tmp_path / "archive") for v in pages.values())


def test_a_host_back_after_being_taken_for_gone_names_its_pages_before_it_drops_them(
    make_config: Config, tmp_path: Path
) -> None:
    """A host cut off from the archive for longer than twice its retention is retired by
    the others: its manifests go. Back, it trusted what it remembered its manifests to name
    and dropped local copies that no manifest named any more (collected by the others)
    until its next heartbeat noticed, up to an hour later. Now a drop after an overdue
    heartbeat beats first."""
    arch = tmp_path / "archive"
    cfg = archived_cfg(make_config, _url(tmp_path), upload_processes=0, retention=1)
    with kvfs.open_store_sync(cfg) as s:
        k = PageKey.semantic("agent", "p", 0)
        s.put(k, kv_page(40))
        s.spill("agent")
        s.restore("agent")  # local again; its manifest names it
        pol = s.engine.policy
        pol.call(pol.spiller.hosts.tick)  # its heartbeat
        for d in ("manifests", "hosts"):  # another host retires it meanwhile
            for f in (arch / d).iterdir():
                f.unlink()
        time.sleep(2 * pol.spiller.hosts.interval + 0.2)  # its heartbeat is overdue
        assert s.evict(k) > 0
        assert kvfs.checksum(kv_page(40)).hex() in named(arch)  # named again before the drop
        assert s.get(k) == kv_page(40)


def test_a_restore_whose_session_came_back_meanwhile_is_no_error(
    make_config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore that found no room for a page another session's restore of the same
    content then brought back failed with "45056 of its 45056 bytes are local; the rest
    does not fit" (a two-host chaos run did). The session is what was asked: no error."""
    from kvfs._archive import ArchivingPolicy

    url = f"file://{tmp_path / 'archive'}"
    with kvfs.open_store_sync(archived_cfg(make_config, url, upload_processes=0)) as s:
        s.put(PageKey.semantic("s", "p", 0), kv_page(90))
        s.spill("s")
        s.restore("s")

        async def no_room(self: ArchivingPolicy, d: str, progress: object) -> int:
            e = kvfs.CapacityExceeded("no room for 4096 bytes")
            e.restored = 7  # type: ignore[attr-defined]
            raise e

        monkeypatch.setattr(ArchivingPolicy, "_restore_session", no_room)
        assert s.restore("s") == 7  # everything is local: what the no-room was about came back
        s.evict(session="s")
        with pytest.raises(kvfs.CapacityExceeded, match="0 of its .* bytes are local"):
            s.restore("s")


def test_incomplete_uploads_of_a_killed_put_are_aborted_by_the_background_task(
    make_config: Config, s3_server: object
) -> None:
    """A daemon (or an upload worker) killed between the parts of a large page's upload
    left an incomplete multipart upload in the bucket: no listing, collection or retention
    saw it, and S3 bills its parts until aborted. The background task aborts those of its
    own objects once stale (moto dates every upload 2010); another program's uploads in the
    same bucket stay, even with the store at the bucket's root."""
    bucket = s3_server.new_bucket()  # type: ignore[attr-defined]
    client = s3_server.client()  # type: ignore[attr-defined]
    for key in ("blobs/killed", "elsewhere/blobs/theirs", "backup.tar"):
        uid = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * 99)
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}&addressing=path"  # type: ignore[attr-defined]

    def incomplete() -> list[str]:
        return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", ())]

    async def main() -> None:
        async with kvfs.open_store(archived_cfg(make_config, url, upload_processes=0)) as s:
            with trio.fail_after(30):
                while not (await s.statistics()).extra["archive"]["uploads_aborted"]:
                    await trio.sleep(0.05)
            st = await s.statistics()
            assert st.extra["archive"]["uploads_aborted"] == 1
            assert sorted(incomplete()) == ["backup.tar", "elsewhere/blobs/theirs"]
            assert "killed uploads aborted 1" in render_stats(st)  # (kvfs stats)

    trio.run(main)


def test_credentials_that_may_not_abort_uploads_cost_one_warning(
    make_config: Config, s3_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A key allowed to put, get and list but not to list incomplete uploads (a tight IAM
    policy) gets one warning pointing at the bucket's lifecycle rule; the store works on."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()  # type: ignore[attr-defined]
    url = f"s3://{bucket}/kv?endpoint={s3_server.endpoint}&addressing=path"  # type: ignore[attr-defined]
    policy = [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {
            "Effect": "Deny",
            "Action": ["s3:ListBucketMultipartUploads", "s3:ListMultipartUploads"],
            "Resource": "*",
        },
    ]

    async def main() -> None:
        cfg = archived_cfg(make_config, url, upload_processes=0)
        async with kvfs.open_store(cfg) as s:
            spiller = s.engine.policy.spiller
            with trio.fail_after(30):
                while not spiller._sweep_denied:
                    await trio.sleep(0.05)
            assert await spiller.sweep_uploads() == 0  # not tried again
            await s.put(PageKey.semantic("a", "p", 0), b"kv")
            assert await s.spill("a") > 0
            assert await s.get(PageKey.semantic("a", "p", 0)) == b"kv"
            assert (await s.statistics()).extra["archive"]["errors"] == 0

    with iam_credentials(s3_server, policy), caplog.at_level("WARNING", "kvfs"):  # type: ignore[arg-type]
        trio.run(main)
    lines = [r.getMessage() for r in caplog.records if "lifecycle rule" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "s3:ListBucketMultipartUploads" in lines[0]


def test_a_server_that_cannot_list_incomplete_uploads_costs_one_warning(
    make_config: Config, s3_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Some S3 gateways answer ListMultipartUploads 501 NotImplemented: the sweep of
    incomplete uploads failed at every start and every hour after, each time an error
    counted and logged. Now the store says so once, asks no more, and works on."""
    from _s3 import OlderS3Server

    server = OlderS3Server(s3_server.endpoint, refuses="upload listing")  # type: ignore[attr-defined]
    bucket = s3_server.new_bucket()  # type: ignore[attr-defined]
    url = f"s3://{bucket}/kv?endpoint={server.endpoint}&addressing=path"

    async def main() -> None:
        async with kvfs.open_store(archived_cfg(make_config, url, upload_processes=0)) as s:
            spiller = s.engine.policy.spiller
            with trio.fail_after(30):  # (the background task's sweep, at its start)
                while not server.refused or not (
                    (await s.statistics()).extra["archive"]["errors"]
                    or any("lifecycle rule" in r.getMessage() for r in caplog.records)
                ):
                    await trio.sleep(0.05)
            assert await spiller.sweep_uploads() == 0
            assert len(server.refused) == 1  # not asked again
            await s.put(PageKey.semantic("a", "p", 0), b"kv")
            assert await s.spill("a") > 0
            assert await s.get(PageKey.semantic("a", "p", 0)) == b"kv"
            assert (await s.statistics()).extra["archive"]["errors"] == 0

    try:
        with caplog.at_level("WARNING", "kvfs"):
            trio.run(main)
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "lifecycle rule" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "NotImplemented" in lines[0]


def _documented_policy(bucket: str, prefix: str) -> list[dict[str, Any]]:
    """The least-privilege policy docs/archive.md gives, for ``s3://bucket/prefix``."""
    text = (Path(__file__).parent.parent / "docs" / "archive.md").read_text()
    (block,) = re.findall(r"^```json\n(.*?)^```", text, flags=re.M | re.S)
    doc = json.loads(block.replace("BUCKET", bucket).replace("PREFIX", prefix))
    for statement in doc["Statement"]:  # moto's names for what AWS checks as these actions
        statement["Action"] += [a for d in statement["Action"] for a in _MOTO_NAMES.get(d, ())]
    return doc["Statement"]  # type: ignore[no-any-return]


#: moto authorizes a bucket's HEAD as s3:HeadBucket, where AWS checks s3:ListBucket
_MOTO_NAMES = {"s3:ListBucket": ["s3:HeadBucket"]}


def test_a_store_works_under_the_documented_least_privilege_policy(
    make_config: Config, s3_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Every call a store makes (the open's check, spills of small and multipart objects,
    restores, deletes and their collection, heartbeats, the sweep of killed uploads) is
    allowed by the policy docs/archive.md gives, and nothing outside its prefix is."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()  # type: ignore[attr-defined]
    client = s3_server.client()  # type: ignore[attr-defined]
    uid = client.create_multipart_upload(Bucket=bucket, Key="kv/blobs/killed")["UploadId"]
    client.upload_part(Bucket=bucket, Key="kv/blobs/killed", UploadId=uid, PartNumber=1, Body=b"x")
    url = f"s3://{bucket}/kv?endpoint={s3_server.endpoint}&addressing=path"  # type: ignore[attr-defined]
    big = os.urandom(6 << 20)  # above the 5 MiB threshold below: a multipart upload
    small = kv_page(1)

    async def main() -> None:
        cfg = archived_cfg(
            make_config,
            url,
            interval=0.05,  # (the background pass collects the deleted session's objects)
            upload_processes=0,
            store_options={"multipart_threshold": 5 << 20, "part_size": 5 << 20},
        ).replace(capacity=64 << 20)
        async with kvfs.open_store(cfg) as s:
            await s.put(PageKey.semantic("a", "p", 0), big)
            await s.put(PageKey.semantic("a", "p", 1), small)
            assert await s.spill("a") > 0
            assert await s.get(PageKey.semantic("a", "p", 0)) == big  # restored
            assert await s.restore("a") >= 0
            await s.delete_session("a")
            with trio.fail_after(30):
                while True:
                    st = (await s.statistics()).extra["archive"]
                    if st["uploads_aborted"] == 1 and not st["pending_deletes"]:
                        break
                    await trio.sleep(0.05)
            assert st["errors"] == 0, st

    policy = _documented_policy(bucket, "kv")
    with iam_credentials(s3_server, policy), caplog.at_level("WARNING", "kvfs"):  # type: ignore[arg-type]
        trio.run(main)
        # and it is least privilege: the same identity is refused outside its prefix (a
        # session of its own: boto3's default one keeps the keys it first found)
        own = boto3.session.Session().client(
            "s3",
            endpoint_url=s3_server.endpoint,  # type: ignore[attr-defined]
            region_name="us-east-1",
        )
        with pytest.raises(ClientError, match="AccessDenied"):
            own.put_object(Bucket=bucket, Key="other/x", Body=b"x")
        own.put_object(Bucket=bucket, Key="kv/x", Body=b"x")  # (and it is this identity)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert s3_server.keys(bucket, "kv/blobs/") == []  # type: ignore[attr-defined]


def _clock_store(*args: str, clock: str | None = None) -> str:
    """tests/_clock_store.py in a child process, under ``faketime`` when ``clock`` is
    given (``+3d``: this host's clock three days ahead, the archive's, moto's in this
    process, right). Its output."""
    cmd = [sys.executable, str(Path(__file__).parent / "_clock_store.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    if clock is not None:
        # (trio and the index's timeouts keep the real monotonic clock, as a stepped
        # wall clock leaves it)
        cmd = ["faketime", "-f", clock, *cmd]
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_retention_waits_while_this_hosts_clock_is_ahead_of_the_archives(
    tmp_path: Path, s3_server: object
) -> None:
    """A host whose clock jumped three days ahead (a wrong clock at boot, a VM restored
    from a snapshot) took every session for three days older: with a retention of one day,
    its first pass deleted all of them from every tier, the archive's copies included. It
    now waits, saying so, while its clock is ahead of the archive's; with the clocks
    agreeing, it deletes only the session truly older than the retention."""
    bucket = s3_server.new_bucket()  # type: ignore[attr-defined]
    url = f"s3://{bucket}/kv?endpoint={s3_server.endpoint}&addressing=path"  # type: ignore[attr-defined]
    dirs = f"{tmp_path / 'd0'},{tmp_path / 'd1'}"
    _clock_store("put", dirs, url, "two-days-old", clock="-2d")
    _clock_store("put", dirs, url, "fresh")
    ahead = json.loads(_clock_store("retention", dirs, url, "86400", clock="+3d"))
    assert ahead["expired"] == 0 and ahead["sessions"] == ["fresh", "two-days-old"], ahead
    assert ahead["paused"]["ahead_s"] >= 3 * 86400 - 5, ahead
    assert "retention PAUSED: this host's clock is 3d ahead" in ahead["stats"], ahead["stats"]
    agreeing = json.loads(_clock_store("retention", dirs, url, "86400"))
    assert "PAUSED" not in agreeing.pop("stats")
    assert agreeing == {"expired": 1, "paused": None, "sessions": ["fresh"]}, agreeing
