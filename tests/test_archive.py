"""Archive tier through the object API: spill, restore on access, dedup, watermarks, pins,
deletes, corruption, restart and a second host sharing the bucket. S3 is moto over HTTP."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import trio
from _archive_dir import objects
from _corrupt import flip_byte

import kvfs
from kvfs import PageKey

KiB = 1024


def kv_page(seed: int, n: int = 48 * KiB) -> bytes:
    """fp16 values shaped like a KV tensor (compressible, as real caches are)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n // 2) * 0.5).astype(np.float16).tobytes()


@pytest.fixture(params=["s3", "file"])
def archive_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'archive'}"
    srv = request.getfixturevalue("s3_server")
    return f"s3://{srv.new_bucket()}/kv?endpoint={srv.endpoint}&addressing=path"


def archived_cfg(
    make_config: Callable[..., kvfs.StoreConfig], url: str, name: str = "store", **archive: object
) -> kvfs.StoreConfig:
    archive.setdefault("interval", 0)
    return make_config(ndev=2, name=name, archive_url=url, extra={"archive": archive})


def fill(s: kvfs.SyncStore, session: str, n: int, seed: int = 0) -> dict[PageKey, bytes]:
    out = {}
    for i in range(n):
        k = PageKey.semantic(session, "p0", i)
        out[k] = kv_page(seed * 1000 + i)
        s.put(k, out[k], attrs={"dtype": "fp16"})
    return out


def test_spill_then_restore_on_access(make_config, archive_url: str) -> None:  # noqa: ANN001
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        data = fill(s, "agent", 6)
        assert s.spill("agent") > 0
        infos = s.list(session="agent")
        assert [i.tier for i in infos] == ["archive"] * 6  # keeps its place in ls
        assert s.statistics().used_bytes == 0
        assert s.session_info("agent").archived_bytes == sum(map(len, data.values()))
        for k, v in data.items():
            assert s.get(k) == v
        k0 = next(iter(data))
        assert s.stat(k0).tier == "local+archive"
        s.spill("agent")
        assert s.read_range(k0, 1000, 5000) == data[k0][1000:6000]  # ranged read restores too
        counts = s.statistics()  # each read restored: 7 misses, and no local hit
        assert (counts.gets, counts.hits, counts.misses) == (7, 0, 7)
        assert s.get(k0) == data[k0]
        assert s.statistics().hits == 1
        st = s.statistics().extra["archive"]
        assert st["bytes_restored"] >= sum(map(len, data.values()))
        assert st["restore_p50_s"] is not None
        assert 0 < st["bytes_spilled"] < sum(map(len, data.values()))  # compressed


def test_a_restore_that_fails_leaves_the_hits_as_they_were(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """Hits were gets less misses, and a read whose restore failed (a corrupt object) is a
    miss but no get: each such read took one hit away, so the hits, a counter, went down."""
    archive = tmp_path / "archive"
    with kvfs.open_store_sync(archived_cfg(make_config, f"file://{archive}")) as s:
        s.put("sessions/a/p/layer-000", b"local")
        data = fill(s, "agent", 1)
        assert s.spill("agent") > 0
        assert s.get("sessions/a/p/layer-000") == b"local"
        assert s.statistics().hits == 1
        (obj,) = objects(archive)
        flip_byte(archive / "blobs" / obj, 100)
        for _ in range(2):
            with pytest.raises(kvfs.CorruptPage):
                s.get(next(iter(data)))
        st = s.statistics()
        assert (st.gets, st.hits, st.misses) == (1, 1, 2)


def test_a_bad_buffer_is_refused_before_an_archive_only_page_is_restored(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A get into a buffer too small, read-only or no buffer at all, of a page only the
    archive held, downloaded and restored the page (taking local room) before refusing
    the buffer."""
    archive = tmp_path / "archive"
    with kvfs.open_store_sync(archived_cfg(make_config, f"file://{archive}")) as s:
        data = fill(s, "agent", 1)
        ((k, v),) = data.items()
        assert s.spill("agent") > 0 and len(objects(archive)) == 1
        for into, error in (
            (bytearray(len(v) - 1), ValueError),
            (bytes(len(v)), TypeError),
            (np.zeros(len(v) // 2, np.uint16)[::2], ValueError),
            ("no buffer", TypeError),
        ):
            with pytest.raises(error):
                s.get(k, into)
            assert s.stat(k).tier == "archive", type(into)
        st = s.statistics()
        assert (st.misses, st.extra["archive"]["bytes_restored"], st.used_bytes) == (0, 0, 0)
        buf = bytearray(len(v))
        assert s.get(k, buf) == len(v) and buf == v  # a sound one restores it


@pytest.mark.parametrize("processes", [0, 2])
def test_spill_returns_every_byte_it_uploaded(make_config, tmp_path: Path, processes: int) -> None:  # noqa: ANN001
    """In-process uploads (upload_processes 0) added their sizes to the total concurrently
    and lost some: a spill of 8 pages said an eighth of what it had sent."""
    cfg = archived_cfg(make_config, f"file://{tmp_path / 'ar'}", upload_processes=processes)
    with kvfs.open_store_sync(cfg) as s:
        for i in range(8):
            s.put(PageKey.semantic("a", "p0", i), os.urandom(100_000))  # incompressible
        n = s.spill("a")
        assert n == s.statistics().extra["archive"]["bytes_spilled"]
    blobs = [f for f in (tmp_path / "ar" / "blobs").rglob("*") if f.is_file()]
    assert len(blobs) == 8 and n == sum(f.stat().st_size for f in blobs)


async def test_async_store_spill_restore(make_config, archive_url: str) -> None:  # noqa: ANN001
    cfg = archived_cfg(make_config, archive_url, interval=0.05, idle_seconds=3600)
    async with kvfs.open_store(cfg) as s:
        k = PageKey.semantic("a", "p", 0)
        await s.put(k, kv_page(1))
        assert await s.spill("a") > 0
        assert (await s.stat(k)).tier == "archive"
        assert await s.get(k) == kv_page(1)
        await s.evict(session="a")
        assert await s.restore("a") == len(kv_page(1))
        assert (await s.stat(k)).tier == "local+archive"
        names = [x["session"] for x in await s.archived_sessions()]
        assert names == ["a"]


def test_shared_prefix_is_stored_once(make_config, s3_server) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        system_prompt = [kv_page(100 + i) for i in range(4)]
        for j, sess in enumerate(("a", "b", "c")):
            for i, v in enumerate(system_prompt):
                s.put(PageKey.semantic(sess, "sys", i), v)
            # a turn page of its own (a fixed seed: hash() of a str changes every run, and
            # 1 run in ~100 made two pages equal)
            s.put(PageKey.semantic(sess, "turn", 0), kv_page(500 + j))
        first = s.spill("a")
        assert first > 0
        assert s.spill("b") < first  # only its own turn page is new
        s.spill("c")
        blobs = s3_server.keys(bucket, "blobs/")
        assert len(blobs) == 4 + 3
        assert len(s3_server.keys(bucket, "manifests/")) == 3
        for sess in ("a", "b", "c"):
            for i, v in enumerate(system_prompt):
                assert s.get(PageKey.semantic(sess, "sys", i)) == v


def test_concurrent_readers_trigger_one_download(make_config, archive_url: str) -> None:  # noqa: ANN001
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        k = PageKey.semantic("a", "p", 0)
        big = kv_page(7, 4 << 20)
        s.put(k, big)
        s.spill("a")
        barrier = threading.Barrier(8)
        results: list[bytes] = []

        def reader() -> None:
            barrier.wait()
            results.append(s.get(k))  # type: ignore[arg-type]

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [big] * 8
        st = s.statistics().extra["archive"]
        assert st["blobs_restored"] == 1


def test_corrupted_object_is_never_served(make_config, s3_server) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        good, bad, gone = (PageKey.semantic("a", "p", i) for i in range(3))
        for i, k in enumerate((good, bad, gone)):
            s.put(k, kv_page(i))
        s.spill("a")
        c = s3_server.client()
        key = f"blobs/{s.stat(bad).checksum}"
        obj = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        from kvfs._codec import encode

        forged, _ = encode(bytes(len(kv_page(1))), codec="zstd")  # valid object, wrong bytes
        c.put_object(Bucket=bucket, Key=key, Body=forged)
        c.delete_object(Bucket=bucket, Key=f"blobs/{s.stat(gone).checksum}")
        with pytest.raises(kvfs.CorruptPage, match="checksum"):
            s.get(bad)
        obj[40] ^= 0xFF  # a flipped byte inside the zstd frame
        c.put_object(Bucket=bucket, Key=key, Body=bytes(obj))
        with pytest.raises(kvfs.CorruptPage):
            s.get(bad)
        with pytest.raises(kvfs.CorruptPage, match="missing"):
            s.get(gone)
        assert s.stat(bad).tier == "archive"  # nothing was adopted
        assert s.get(good) == kv_page(0)
        assert s.statistics().corrupt_reads >= 3


@pytest.mark.parametrize("processes", [0, 2])
def test_an_object_whose_header_says_a_huge_size_is_corrupt(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, processes: int
) -> None:
    """A byte flipped high in an object's size field: decoding asked for a buffer of that
    size first, and the read and the session's restore failed with "[Errno 12] Cannot
    allocate memory" (an OSError, not counted as a corrupt object)."""
    archive = tmp_path / "archive"
    cfg = archived_cfg(make_config, f"file://{archive}", upload_processes=processes)
    with kvfs.open_store_sync(cfg) as s:
        ((k, v),) = fill(s, "agent", 1).items()
        assert s.spill("agent") > 0
        (obj,) = objects(archive)
        flip_byte(archive / "blobs" / obj, 15, 0x40)  # the size's high byte
        with pytest.raises(kvfs.CorruptPage, match="header says"):
            s.get(k)
        with pytest.raises(kvfs.CorruptPage, match="header says"):
            s.restore("agent")
        assert s.stat(k).tier == "archive"  # nothing was adopted
        assert s.engine.reserved == 0
        assert s.statistics().extra["archive"]["corrupt_objects"] == 2
        flip_byte(archive / "blobs" / obj, 15, 0x40)  # mended: it reads again
        assert s.get(k) == v


def test_watermarks_spill_coldest_unpinned(make_config, archive_url: str) -> None:  # noqa: ANN001
    page = 60 * KiB  # 64 KiB on disk with its header: 20 pages fill the cap
    cfg = make_config(
        ndev=1,
        capacity=20 * 64 * KiB,
        archive_url=archive_url,
        extra={
            "archive": {
                "interval": 0.05,
                "idle_seconds": 0,
                "high_watermark": 0.9,
                "low_watermark": 0.5,
            }
        },
    )

    async def main() -> None:
        async with kvfs.open_store(cfg) as s:
            await s.pin_session("keep")
            for base, (sess, n) in enumerate((("keep", 5), ("old", 7), ("new", 7))):
                for i in range(n):
                    await s.put(PageKey.semantic(sess, "p", i), kv_page(100 * base + i, page))
                await trio.sleep(0.01)  # distinct access times: "old" is colder than "new"
            with trio.fail_after(60):
                while (await s.statistics()).used_bytes > 0.5 * cfg.capacity:
                    await trio.sleep(0.05)
            keep = await s.session_info("keep")
            assert keep.local_bytes == keep.bytes  # pinned: never spilled by the watermark
            old = await s.session_info("old")
            assert old.local_bytes == 0 and old.archived_bytes == old.bytes
            for i in range(7):
                assert await s.get(PageKey.semantic("old", "p", i)) == kv_page(100 + i, page)
            # asked explicitly, a pinned session spills
            assert await s.spill("keep") > 0
            assert (await s.session_info("keep")).local_bytes == 0

    trio.run(main)


def test_capacity_eviction_spills_instead_of_deleting(make_config, archive_url: str) -> None:  # noqa: ANN001
    cfg = make_config(
        ndev=1, capacity=8 * 64 * KiB, archive_url=archive_url, extra={"archive": {"interval": 0}}
    )
    with kvfs.open_store_sync(cfg) as s:
        data = fill(s, "a", 20)  # more than the cap holds: older pages go to the archive
        assert s.statistics().pages == 20
        for k, v in data.items():
            assert s.get(k) == v


@pytest.mark.parametrize("ahead", [None, 0])
def test_puts_under_pressure_rewrite_a_manifest_per_batch_not_per_put(
    make_config,  # noqa: ANN001
    tmp_path: Path,
    ahead: int | None,
) -> None:
    """A put that must make room evicts ``evict_ahead`` more (capped at capacity / 8), so a
    growing session's manifest (rewritten by every eviction pass, all its pages each time)
    is rewritten once per batch. With evict_ahead 0 it was once per put: the cost of a put
    grew with the session (scripts/put_under_pressure.py, docs/benchmarks.md)."""
    archive: dict[str, object] = {"interval": 0}
    if ahead is not None:
        archive["evict_ahead"] = ahead
    page, cap = 16 * KiB, 64 * 16 * KiB
    url = f"file://{tmp_path / 'archive'}"
    cfg = make_config(ndev=1, capacity=cap, archive_url=url, extra={"archive": archive})
    data = {}
    with kvfs.open_store_sync(cfg) as s:
        for i in range(192):
            k = PageKey.semantic("grow", f"p{i:03d}", 0)
            data[k] = os.urandom(page)
            s.put(k, data[k])
            assert s.statistics().used_bytes <= cap
        st = s.statistics()
        evicted = sum(1 for k in data if s.stat(k).tier == "archive")
        written = st.extra["archive"]["manifests_written"]
        assert evicted >= 192 - 64
        print(f"evict_ahead {ahead}: {evicted} pages evicted, {written} manifests written")
        if ahead is None:  # 128 KiB ahead: 8 pages a pass
            assert written <= evicted // 6, (written, evicted)
        else:
            assert written >= evicted - 1, (written, evicted)
        for k, v in data.items():
            assert s.get(k) == v


def test_delete_removes_archived_copy_and_updates_manifest(make_config, s3_server) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        shared = kv_page(5)
        s.put(PageKey.semantic("a", "p", 0), shared)
        s.put(PageKey.semantic("a", "p", 1), kv_page(6))
        s.put(PageKey.semantic("b", "p", 0), shared)
        s.spill("a")
        s.spill("b")
        assert len(s3_server.keys(bucket, "blobs/")) == 2
        s.delete(PageKey.semantic("a", "p", 1))
        assert len(s3_server.keys(bucket, "blobs/")) == 1
        m = [x for x in s.archived_sessions() if x["session"] == "a"][0]
        assert m["pages"] == 1
        s.delete_session("a")  # the shared blob is still referenced by b
        assert len(s3_server.keys(bucket, "blobs/")) == 1
        assert [x["session"] for x in s.archived_sessions()] == ["b"]
        assert s.get(PageKey.semantic("b", "p", 0)) == shared
        s.delete_session("b")
        left = s3_server.keys(bucket)
        # Only the finished collection intents linger (for gc_window: kvfs/_collect.py).
        assert left and all(k.startswith("gc/") for k in left)
        assert {k + ".done" for k in left if not k.endswith(".done")} == {
            k for k in left if k.endswith(".done")
        }


def test_archive_only_pages_survive_restart(make_config, archive_url: str) -> None:  # noqa: ANN001
    cfg = archived_cfg(make_config, archive_url)
    with kvfs.open_store_sync(cfg) as s:
        data = fill(s, "agent", 3)
        s.spill("agent")
    with kvfs.open_store_sync(cfg) as s:
        assert [i.tier for i in s.list(session="agent")] == ["archive"] * 3
        for k, v in data.items():
            assert s.get(k) == v


def test_second_host_lists_and_restores(make_config, archive_url: str, tmp_path: Path) -> None:  # noqa: ANN001
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        data = fill(a, "agent-42", 4)
        a.set_session_attrs("agent-42", {"model": "llama-test"})
        a.pin_session("agent-42")
        a.spill("agent-42")
    import shutil

    shutil.rmtree(tmp_path / "host-a")  # host A's local disks are lost
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        listed = b.archived_sessions()
        assert [(x["session"], x["pages"], x["attrs"]) for x in listed] == [
            ("agent-42", 4, {"model": "llama-test"})
        ]
        with pytest.raises(kvfs.SessionNotFound):
            b.restore("never-spilled")
        assert b.restore("agent-42") == sum(map(len, data.values()))
        info = b.session_info("agent-42")
        assert info.pinned and info.model == "llama-test" and info.local_bytes == info.bytes
        for k, v in data.items():
            assert b.get(k) == v
        # B adds a turn and spills: A's manifest now lists it too (same session, same bucket)
        b.put(PageKey.semantic("agent-42", "p1", 0), kv_page(99))
        b.spill("agent-42")
        assert [x["pages"] for x in b.archived_sessions()] == [5]


def test_pages_a_host_imported_survive_the_owners_delete(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    """Host B restores A's session but has room for only part of it: the rest stays
    archive-only on B, which lists it. A then deletes the session, and its cleanup deletes
    every object no manifest names: B's manifest, written right after the import, names
    them (none did: B's archive-only pages became unreadable)."""
    url = f"file://{tmp_path / 'archive'}"
    with kvfs.open_store_sync(archived_cfg(make_config, url, name="host-a")) as a:
        data = fill(a, "agent", 8)
        a.spill("agent")
    page_disk = 4 * KiB + 48 * KiB
    b_cfg = make_config(
        ndev=1,
        name="host-b",
        capacity=10 * page_disk,
        archive_url=url,
        extra={"archive": {"interval": 0, "memory_copies": 0}},
    )
    with kvfs.open_store_sync(b_cfg) as b:
        for i in range(4):
            b.put(PageKey.semantic("mine", "p", i), kv_page(5000 + i))
        b.pin_session("mine")  # B's room: 6 pages
        with pytest.raises(kvfs.CapacityExceeded):
            b.restore("agent")
        assert any(not i.local for i in b.list(session="agent"))
        with kvfs.open_store_sync(archived_cfg(make_config, url, name="host-a")) as a:
            a.delete_session("agent")
        b.unpin_session("mine")
        b.delete_session("mine")
        for k, v in data.items():
            assert b.get(k) == v


def test_a_session_with_a_long_name_spills_and_another_host_restores_it(
    make_config,
    archive_url: str,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """A manifest key quoted the whole session name: a long (or non-ASCII) name made a file
    name over 255 bytes, and a file:// archive could not take the session at all."""
    long = "agent-" + "é" * 120 + "-" + "x" * 8  # 254 bytes; 735 characters quoted
    similar = long[:-1] + "y"  # the same first 100 quoted characters
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        data = {**fill(a, long, 3), **fill(a, similar, 2, seed=1)}
        assert a.spill(long) > 0 and a.spill(similar) > 0
        assert a.get(PageKey.semantic(long, "p0", 1)) == data[PageKey.semantic(long, "p0", 1)]
    import shutil

    shutil.rmtree(tmp_path / "host-a")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        listed = sorted((x["session"], x["pages"]) for x in b.archived_sessions())
        assert listed == sorted([(long, 3), (similar, 2)])
        assert b.restore(long) == sum(len(v) for k, v in data.items() if k.session == long)
        b.restore(similar)
        for k, v in data.items():
            assert b.get(k) == v
        b.delete_session(similar)
        assert [x["session"] for x in b.archived_sessions()] == [long]


def test_an_evicted_page_is_in_its_manifest_before_its_local_copy_goes(
    make_config,  # noqa: ANN001
    archive_url: str,
    tmp_path: Path,
) -> None:
    """Eviction drops a local copy only once the session's manifest names the page. Before,
    the manifest was only queued: a host sharing the bucket that deleted the same content
    found no manifest naming its object and deleted it, and the evicted page was lost (found
    by tests/test_archive_hosts.py). A host rebuilt from the archive alone finds it too."""
    import shutil

    same = kv_page(7)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        kb = PageKey.semantic("b", "p", 0)
        b.put(kb, same)
        assert b.evict(session="b") > 0  # archived, then the local copy dropped
        assert [x["session"] for x in b.archived_sessions()] == ["b"]
        with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
            ka = PageKey.semantic("a", "p", 0)
            a.put(ka, same)
            a.spill("a")
            a.delete(ka)  # A's last reference: A deletes the object unless a manifest names it
        assert b.get(kb) == same
    shutil.rmtree(tmp_path / "host-b")  # B's disks are lost: the archive alone has the page
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-c")) as c:
        c.restore("b")
        assert c.get(kb) == same


def test_restore_of_a_known_session_also_brings_pages_another_host_added(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    """A restores the pages it knows while it fetches the manifest; the page B added to the
    shared session comes back in the same call, and the progress ends at the whole total."""
    a_cfg = archived_cfg(make_config, archive_url, name="host-a")
    with kvfs.open_store_sync(a_cfg) as a:
        data = fill(a, "agent-7", 3)
        a.spill("agent-7")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.restore("agent-7")
        extra = PageKey.semantic("agent-7", "p1", 0)
        data[extra] = kv_page(77)
        b.put(extra, data[extra])
        b.spill("agent-7")
    with kvfs.open_store_sync(a_cfg) as a:
        assert [a.stat(k).tier for k in list(data)[:3]] == ["archive"] * 3  # known, evicted
        with pytest.raises(kvfs.PageNotFound):
            a.stat(extra)  # the manifest has it; this index does not yet
        seen: list[tuple[int, int]] = []
        total = sum(map(len, data.values()))
        assert a.restore("agent-7", progress=lambda i, t: seen.append((i, t))) == total
        assert seen[-1] == (total, total)
        assert all(i <= t for i, t in seen)
        for k, v in data.items():
            assert a.stat(k).tier == "local+archive"
            assert a.get(k) == v


def test_known_pages_come_back_while_the_manifest_is_fetched(make_config, archive_url: str) -> None:  # noqa: ANN001
    """The manifest fetch waits here until a known page is local again: a restore that
    fetched the manifest first would never get there (and the fetch would time out)."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        data = fill(s, "a", 4)
        s.spill("a")
        spiller = s.engine.policy.spiller  # type: ignore[attr-defined]
        fetch = spiller.import_session
        local_when_fetched: list[int] = []

        async def after_a_page(d: str) -> int:
            with trio.fail_after(30):
                while s.engine.index.local_disk_bytes() == 0:
                    await trio.sleep(0.005)
            local_when_fetched.append(s.engine.index.local_disk_bytes())
            return await fetch(d)

        spiller.import_session = after_a_page
        assert s.restore("a") == sum(map(len, data.values()))
        assert local_when_fetched and local_when_fetched[0] > 0
        assert all(s.get(k) == v for k, v in data.items())


def test_restore_does_not_bring_back_a_page_deleted_before_the_manifest_was_rewritten(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    """A delete queues a rewrite of the session's manifest (done by the next pass, here held
    back by a grace period); a restore meanwhile must not import the stale manifest's copy
    of the deleted page."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, gc_grace=3600)) as s:
        data = fill(s, "a", 3)
        s.spill("a")
        gone = next(iter(data))
        s.delete(gone)
        assert s.restore("a") == sum(len(v) for k, v in data.items() if k != gone)
        assert not s.exists(gone)
        assert sorted(i.path for i in s.list(session="a")) == sorted(
            k.path for k in data if k != gone
        )


@pytest.mark.parametrize("when", ["listed", "fetched", "checked"])
def test_a_page_deleted_during_its_sessions_restore_is_no_error(
    make_config, archive_url: str, when: str
) -> None:  # noqa: ANN001
    """A session's restore brings back what the session still holds: a page deleted after
    the restore listed it (an engine's unlink racing `kvfs restore`) is left out, also when
    its archive object went with it after the last check, before the download."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        data = fill(s, "a", 3)
        s.spill("a")
        policy = s.engine.policy  # type: ignore[attr-defined]
        gone = next(iter(data))
        if when == "listed":
            listed = policy._archived_blobs

            def then_delete(d: str, *skip: object) -> object:
                rows = listed(d, *skip)
                if not skip:
                    s.engine.delete(gone)  # the object goes too (no grace, no spiller)
                return rows

            policy._archived_blobs = then_delete
        elif when == "fetched":  # the old manifest is in hand; the rewrite lands before import
            from kvfs._manifest import manifest_key

            fetch = policy.store.get

            async def then_delete_fetched(key: str, *a: object, **kw: object) -> object:
                raw = await fetch(key, *a, **kw)
                if key == manifest_key("sessions/a", s.engine.store_id) and s.exists(gone):
                    await trio.to_thread.run_sync(s.engine.delete, gone)
                return raw

            policy.store.get = then_delete_fetched
        else:
            from kvfs._manifest import blob_key

            checked = policy._still_archived
            h = bytes.fromhex(s.stat(gone).checksum)

            async def then_delete_async(blobs: list[object], settle: object) -> object:
                rows = await checked(blobs, settle)
                if any(b.hash == h for b in rows):  # type: ignore[attr-defined]
                    await trio.to_thread.run_sync(s.engine.delete, gone)
                    # and the object with it, as the spiller's next pass would
                    if await policy.store.exists(blob_key(h)):
                        await policy.store.delete(blob_key(h))
                return rows

            policy._still_archived = then_delete_async
        restored, left = s.restore("a"), sum(len(v) for k, v in data.items() if k != gone)
        if when == "fetched":  # the known pages come back while the manifest is fetched:
            assert restored in (left, left + len(data[gone]))  # gone's may be back already
        else:
            assert restored == left
        assert not s.exists(gone)
        assert all(s.get(k) == v for k, v in data.items() if k != gone)
        assert s.statistics().corrupt_reads == 0


def test_unreadable_manifest_fails_the_restore_after_the_known_pages(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    from kvfs._keys import session_dir
    from kvfs._manifest import manifest_key

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        data = fill(s, "a", 3)
        s.spill("a")
        policy = s.engine.policy  # type: ignore[attr-defined]
        policy.call(
            policy.store.put, manifest_key(session_dir("a"), s.engine.store_id), b"not msgpack \xff"
        )
        with pytest.raises(kvfs.CorruptPage, match="unreadable"):
            s.restore("a")
        assert [s.stat(k).tier for k in data] == ["local+archive"] * 3
        assert all(s.get(k) == v for k, v in data.items())


def test_spill_without_archive_is_a_clear_error(sync_store: kvfs.SyncStore) -> None:
    with pytest.raises(kvfs.ArchiveUnavailable, match="no archive"):
        sync_store.spill("x")


def test_unreachable_archive_fails_open_clearly(make_config, s3_server) -> None:  # noqa: ANN001
    # (s3_server for its credentials in the environment: without any, the open says so)
    url = "s3://b?endpoint=http://127.0.0.1:9&open_deadline=0.3"
    with pytest.raises(kvfs.ArchiveUnavailable, match="cannot reach"):
        kvfs.open_store_sync(make_config(archive_url=url)).__enter__()


def test_an_open_refused_for_an_unreachable_archive_leaves_the_store_clean(
    make_config,  # noqa: ANN001
    s3_server,  # noqa: ANN001 - (for its credentials in the environment)
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An open that failed because the archive could not be reached had already marked the
    index in use, and left it so: every later open (each ``kvfs stats`` retried while the
    endpoint was down, then the daemon) recounted the data, swept the disks for orphans and
    warned that the store "was not closed cleanly" after a crash that never happened."""
    cfg = make_config()
    with kvfs.open_store_sync(cfg) as s:
        s.put(PageKey.semantic("a", "p", 0), kv_page(1))
    url = "s3://b?endpoint=http://127.0.0.1:9&open_deadline=0.3"
    for _ in range(2):
        with pytest.raises(kvfs.ArchiveUnavailable, match="cannot reach"):
            kvfs.open_store_sync(make_config(archive_url=url)).__enter__()
    with kvfs.open_store_sync(cfg) as s:
        assert s.get(PageKey.semantic("a", "p", 0)) == kv_page(1)
        assert s.statistics().used_bytes > 0
    assert "not closed cleanly" not in caplog.text


def test_an_open_for_inspection_goes_on_without_an_archive_it_cannot_open(
    make_config,  # noqa: ANN001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose archive could not be opened could not be opened at all, so nothing
    could look at its local tier while the archive was down. Opened with
    ``archive_required=False`` it opens as one without an archive and says why; a repair,
    spill or restore refuses with that reason, and the archive's state is left alone."""
    arch = tmp_path / "arch"
    cfg = archived_cfg(make_config, f"file://{arch}")
    with kvfs.open_store_sync(cfg) as s:
        data = fill(s, "a", 2)
        s.spill("a")
        s.put(PageKey.semantic("b", "p0", 0), kv_page(9))
    arch.rename(tmp_path / "away")  # (a share not mounted now)
    with pytest.raises(kvfs.ArchiveUnavailable, match="does not exist"):
        kvfs.open_store_sync(cfg).__enter__()
    with kvfs.open_store_sync(cfg, archive_required=False) as s:
        assert "does not exist" in str(s.engine.archive_error)
        assert {p.tier for p in s.list(session="a")} == {"archive"}
        assert s.get(PageKey.semantic("b", "p0", 0)) == kv_page(9)
        found = s.fsck()
        assert found["archive_error"] == [s.engine.archive_error] and not found["corrupt"]
        for refused in (lambda: s.fsck(repair=True), lambda: s.spill("b"), lambda: s.restore("a")):
            with pytest.raises(kvfs.ArchiveUnavailable, match="does not exist"):
                refused()
        assert s.statistics().extra["archive_error"]["url"] == f"file://{arch}"
    (tmp_path / "away").rename(arch)
    with kvfs.open_store_sync(cfg) as s:
        assert s.engine.archive_error is None
        assert all(s.get(k) == v for k, v in data.items())
    assert "not closed cleanly" not in caplog.text


def test_an_open_for_inspection_told_the_archive_is_down_does_not_try_it(
    make_config,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    """``kvfs stats --watch`` opens the store for each refresh, and each open tried the
    archive again, waiting out an unreachable endpoint's open_deadline every time. Told
    why it was down (``archive_down``), an open for inspection leaves it alone, here one
    that would open, and says that reason; a required archive cannot be skipped so."""
    arch = tmp_path / "arch"
    cfg = archived_cfg(make_config, f"file://{arch}")
    with kvfs.open_store_sync(cfg) as s:
        fill(s, "a", 1)
        s.spill("a")
    with kvfs.open_store_sync(cfg, archive_required=False, archive_down="down a moment ago") as s:
        assert s.engine.archive_error == "down a moment ago"
        assert s.statistics().extra["archive_error"]["error"] == "down a moment ago"
        with pytest.raises(kvfs.ArchiveUnavailable, match="down a moment ago"):
            s.restore("a")
    with pytest.raises(ValueError, match="archive_required=False"):
        kvfs.open_store_sync(cfg, archive_down="down").__enter__()
    with kvfs.open_store_sync(cfg) as s:
        assert s.engine.archive_error is None and s.restore("a")


def test_rename_and_replace_keep_manifests_consistent(make_config, s3_server) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        a0, a1 = PageKey.semantic("a", "p", 0), PageKey.semantic("a", "p", 1)
        s.put(a0, kv_page(1))
        s.put(a1, kv_page(2))
        s.spill("a")
        s.rename(a0, a1)  # a1's old data loses its last reference
        assert len(s3_server.keys(bucket, "blobs/")) == 1
        assert [x["pages"] for x in s.archived_sessions()] == [1]
        assert s.get(a1) == kv_page(1)


def test_a_held_page_deleted_while_a_session_restore_downloads_it_reads(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A reader holding a page (a file open on the mount) waits for the download a
    session's restore makes of it, and the page is deleted meanwhile: the restore brings
    back what the session still holds, and told the reader "deleted during its restore",
    where a reader alone reads the data it holds from a copy of its own. The object is a
    FIFO, so the download waits until the test writes it, after the delete."""
    import sys

    archive = tmp_path / "archive"
    cfg = archived_cfg(make_config, f"file://{archive}", upload_processes=0)
    with kvfs.open_store_sync(cfg) as s:
        ((k, v),) = fill(s, "agent", 1).items()
        assert s.spill("agent") > 0
        (name,) = objects(archive)
        obj = archive / "blobs" / name
        body = obj.read_bytes()
        obj.unlink()
        os.mkfifo(obj)
        eng = s.engine
        h = bytes.fromhex(name)
        restored: list[int] = []
        read_back: list[object] = []

        def waiting_for_the_restore(t: threading.Thread) -> bool:
            frame = sys._current_frames().get(t.ident or 0)
            names = []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            return "restore_blob" in names and "result" in names

        with eng.lease(k) as (page, blob):
            restore = threading.Thread(target=lambda: restored.append(s.restore("agent")))
            restore.start()
            while h not in eng.policy._inflight:  # (its download waits for the FIFO)
                time.sleep(0.005)

            def read() -> None:
                try:
                    read_back.append(bytes(eng.read_held(page, blob, 0, blob.size)))
                except Exception as e:
                    read_back.append(e)

            reader = threading.Thread(target=read)
            reader.start()
            while not waiting_for_the_restore(reader):
                time.sleep(0.005)
            s.delete(k)
            with open(obj, "wb") as w:
                obj.unlink()
                w.write(body)
            obj.write_bytes(body)  # (kept while a reader holds the data)
            restore.join(30)
            reader.join(30)
            assert restored == [0]  # the session holds nothing now
            assert read_back == [v]  # the reader, its page
        assert not s.exists(k)
        assert s.statistics().used_bytes == 0  # the reader's copy went with its lease


def test_session_restore_with_a_corrupt_object_restores_the_rest(make_config, s3_server) -> None:  # noqa: ANN001
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}?endpoint={s3_server.endpoint}"
    with kvfs.open_store_sync(archived_cfg(make_config, url, concurrency=2)) as s:
        data = fill(s, "a", 8)
        s.spill("a")
        keys = list(data)
        bad = keys[3]
        from kvfs._codec import encode

        forged, _ = encode(bytes(len(data[bad])), codec="zstd")  # valid object, wrong bytes
        s3_server.client().put_object(
            Bucket=bucket, Key=f"blobs/{s.stat(bad).checksum}", Body=forged
        )
        results: list[bytes] = []
        readers = [
            threading.Thread(target=lambda k=k: results.append(s.get(k)))  # type: ignore[misc]
            for k in keys[:2]
        ]
        for t in readers:  # readers racing the session restore for the same pages
            t.start()
        with pytest.raises(kvfs.CorruptPage, match="checksum"):
            s.restore("a")
        for t in readers:
            t.join()
        assert sorted(results) == sorted(data[k] for k in keys[:2])
        assert s.stat(bad).tier == "archive"  # never adopted
        assert [s.stat(k).tier for k in keys if k != bad] == ["local+archive"] * 7
        for k in keys:
            if k != bad:
                assert s.get(k) == data[k]
        st = s.statistics()
        assert st.extra["archive"]["blobs_restored"] == 7
        assert st.used_bytes > 0
        assert s.fsck()["orphans"] == []


def test_an_unreadable_manifest_is_left_out_of_the_listing_with_a_warning(
    make_config, archive_url: str, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    from kvfs._manifest import manifest_key

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        fill(s, "good", 1)
        fill(s, "bad", 1, seed=1)
        s.spill("good")
        s.spill("bad")
        policy = s.engine.policy  # type: ignore[attr-defined]
        policy.call(
            policy.store.put, manifest_key("sessions/bad", s.engine.store_id), b"\xc1 not msgpack"
        )
        with caplog.at_level("WARNING", logger="kvfs"):
            assert [x["session"] for x in s.archived_sessions()] == ["good"]
        assert "unreadable; not listed" in caplog.text and "sessions%2Fbad" in caplog.text
    # Another host's readable manifest of the session does not bring it back into the list
    # (it did, from theirs alone, while its restore raised CorruptPage "unreadable")
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="other")) as o:
        fill(o, "bad", 1, seed=2)
        o.spill("bad")
        assert [x["session"] for x in o.archived_sessions()] == ["good"]
        with pytest.raises(kvfs.CorruptPage, match="unreadable"):
            o.restore("bad")


def test_a_manifest_that_decodes_but_is_not_sound_is_unreadable(
    make_config,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    """msgpack has no checksum: a manifest with a flipped byte often still decodes. One
    missing a field, with a page whose checksum is not its leaves' tree hash, naming a
    page of another session, or not matching its digest (a page's name or time changed:
    the page served under another name, or winning a merge) is treated as unreadable (left out, restore CorruptPage,
    deletion paused): it was trusted, and KeyError broke listing, restores, the deletes of
    every session and close."""
    import msgpack

    from kvfs._manifest import manifest_key, parse_manifest

    url = f"file://{tmp_path / 'archive'}"
    with kvfs.open_store_sync(archived_cfg(make_config, url, name="host-a")) as a:
        fill(a, "good", 2)
        fill(a, "odd", 2, seed=1)
        a.spill("good")
        a.spill("odd")
        policy, key = a.engine.policy, manifest_key("sessions/odd", a.engine.store_id)  # type: ignore[attr-defined]
        raw = policy.call(policy.store.get, key)
    m = parse_manifest(raw)
    p0 = m["pages"][0]
    digest = msgpack.unpackb(raw)["digest"]
    later = {**m, "pages": [{**p0, "created": p0["created"] + 1}, *m["pages"][1:]]}
    bad = {
        "a key's byte flipped": raw.replace(b"hash", b"hasi", 1),
        "no store_id": msgpack.packb({k: v for k, v in m.items() if k != "store_id"}),
        "a checksum flipped": raw.replace(p0["hash"], bytes([p0["hash"][0] ^ 1]) + p0["hash"][1:]),
        "another session's page": raw.replace(b"sessions/odd/", b"sessions/ggg/"),
        # (these decode, and name what could be: only the digest tells)
        "a page's name flipped": raw.replace(b"layer-000", b"layer-100", 1),
        "a page's time changed": msgpack.packb({**later, "digest": digest}),
        "the digest's name flipped": raw.replace(b"digest", b"digesu"),
    }
    for i, (what, body) in enumerate(bad.items()):
        with pytest.raises(ValueError):
            parse_manifest(body)
        with kvfs.open_store_sync(archived_cfg(make_config, url, name=f"host-b{i}")) as b:
            policy = b.engine.policy  # type: ignore[attr-defined]
            policy.call(policy.store.put, key, body)
            assert [x["session"] for x in b.archived_sessions()] == ["good"], what
            with pytest.raises(kvfs.CorruptPage):
                b.restore("odd")
            b.restore("good")
            fill(b, "mine", 1, seed=2)
            b.spill("mine")
            b.delete_session("mine")  # (its objects: kept while a manifest is unreadable)
    with kvfs.open_store_sync(archived_cfg(make_config, url, name="host-a")) as a:
        a.engine.policy.call(a.engine.policy.store.put, key, raw)  # type: ignore[attr-defined]
        assert sorted(x["session"] for x in a.archived_sessions()) == ["good", "odd"]


def test_an_unreadable_manifest_stops_archive_object_deletion(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    """Host B's session names the same content as host A's. A deletes its session while
    B's manifest is unreadable: the object may be B's, so A deletes nothing; once the
    manifest reads again, it names the object and the object stays."""
    from kvfs._keys import session_dir
    from kvfs._manifest import blob_key, manifest_key

    content = kv_page(5)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.put(PageKey.semantic("y", "p", 0), content)
        b.spill("y")
        h = bytes.fromhex(b.stat(PageKey.semantic("y", "p", 0)).checksum)
        b_id = b.engine.store_id
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        a.put(PageKey.semantic("x", "p", 0), content)
        a.spill("x")
        policy = a.engine.policy  # type: ignore[attr-defined]
        store, y_manifest = policy.store, manifest_key(session_dir("y"), b_id)
        good = policy.call(store.get, y_manifest)
        policy.call(store.put, y_manifest, b"\xc1 unreadable")
        a.delete_session("x")
        policy.call(policy.spiller.flush_pending)
        assert policy.call(store.exists, blob_key(h))  # B's data survived
        assert policy.aindex.pending("forget", 0)  # still queued: decided on a later pass
        policy.call(store.put, y_manifest, good)
        policy.call(policy.spiller.flush_pending)
        assert policy.call(store.exists, blob_key(h))  # named by B's manifest: kept
        assert not policy.aindex.pending("forget", 0)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.evict(session="y")
        assert b.get(PageKey.semantic("y", "p", 0)) == content


def test_a_damaged_local_copy_of_archived_data_comes_back_from_the_archive(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    """A flipped byte, or a data file gone, in the local copy of a page the archive holds:
    the read still returns the page (the copy is replaced from the archive, verified there),
    the detection is counted, and the damaged file goes."""
    from _corrupt import flip_stored_byte

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        data = fill(s, "a", 3)
        s.spill("a")
        s.restore("a")
        k0, k1, k2 = data
        before = s.stat(k0)
        assert before.tier == "local+archive"
        flip_stored_byte(before, 1000)
        assert s.get(k0) == data[k0]
        after = s.stat(k0)
        assert after.tier == "local+archive" and after.extents != before.extents
        assert not os.path.exists(before.extents[0].path)  # the damaged file is gone
        info = s.stat(k1)
        for e in info.extents:
            os.unlink(e.path)  # a file lost behind the store's back
        assert s.read_range(k1, 10, 100) == data[k1][10:110]
        st = s.statistics()
        assert st.corrupt_reads >= 2 and st.extra["archive"]["blobs_healed"] == 2
        assert s.get(k2) == data[k2]
        assert not any(s.fsck()[x] for x in ("missing", "corrupt", "orphans"))


def test_fsck_repair_restores_archived_copies_and_deletes_what_is_held_nowhere_else(
    make_config, archive_url: str
) -> None:  # noqa: ANN001
    from _corrupt import flip_stored_byte

    with kvfs.open_store_sync(archived_cfg(make_config, archive_url)) as s:
        archived = fill(s, "a", 1)
        s.spill("a")
        s.restore("a")
        local_only = fill(s, "b", 1, seed=3)
        for k in (*archived, *local_only):
            flip_stored_byte(s.stat(k), 7)
        found = s.fsck()
        assert len(found["corrupt"]) == 2 and found["repaired"] == []
        repaired = s.fsck(repair=True)["repaired"]
        assert sum("from the archive" in r for r in repaired) == 1
        (kb,) = local_only
        assert [r for r in repaired if r.startswith("deleted")] == [
            f"deleted {kb.path}: its data was damaged and held nowhere else"
        ]
        (ka,) = archived
        assert s.get(ka) == archived[ka]
        with pytest.raises(kvfs.PageNotFound):
            s.stat(*local_only)
        assert not any(s.fsck()[x] for x in ("missing", "corrupt", "orphans"))


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "workers"])
def test_a_session_larger_than_the_capacity_restores_what_fits(
    make_config, archive_url: str, processes: int
) -> None:  # noqa: ANN001
    """Also in this process (threads): there a restore made room for its later pages by
    evicting the ones it had just brought back, and returned as if it had succeeded."""
    cfg = make_config(
        ndev=1,
        capacity=6 * 1024 * KiB,
        archive_url=archive_url,
        extra={"archive": {"interval": 0, "upload_processes": processes}},
    )
    with kvfs.open_store_sync(cfg) as s:
        data = {PageKey.semantic("big", "p", i): kv_page(i, 1024 * KiB) for i in range(8)}
        for k, v in data.items():
            s.put(k, v)
        s.spill("big")
        with pytest.raises(
            kvfs.CapacityExceeded, match=r"sessions/big: \d+ of its \d+ bytes are"
        ) as ei:
            s.restore("big")
        assert "in flight" not in str(ei.value) and "raise it" in str(ei.value)
        assert "larger than the whole capacity" in str(ei.value)  # (nothing else holds it)
        local = [k for k in data if s.stat(k).tier == "local+archive"]
        assert 0 < len(local) < 8
        assert s.statistics().reserved_bytes == 0
        assert all(s.get(k) == v for k, v in data.items())  # the rest: restored on access


def test_an_archive_that_is_not_this_stores_is_refused(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    """Archived flags are only true of the archive they were set against: opening with
    another archive, which holds none of this store's sessions, is refused (an eviction
    would otherwise drop the last copy of pages only believed archived); a copy of the
    archive is accepted, and a store that never archived anything may switch freely."""
    import shutil

    first, other = f"file://{tmp_path / 'ar1'}", f"file://{tmp_path / 'ar2'}"
    with kvfs.open_store_sync(archived_cfg(make_config, first)) as s:
        data = fill(s, "a", 2)
        s.spill("a")
    with pytest.raises(kvfs.ArchiveUnavailable, match="archived pages are in file://.*ar1"):
        kvfs.open_store_sync(archived_cfg(make_config, other)).__enter__()
    assert not (tmp_path / "ar2").exists()  # refused, and not made only to be refused
    # another store's archive holding a session of the same name (engines name their
    # directories alike on every host) is not a copy of this one's
    with kvfs.open_store_sync(archived_cfg(make_config, other, name="elsewhere")) as e:
        fill(e, "a", 2, seed=9)
        e.spill("a")
    with pytest.raises(kvfs.ArchiveUnavailable, match="holds none of the 2 of its objects"):
        kvfs.open_store_sync(archived_cfg(make_config, other)).__enter__()
    shutil.copytree(tmp_path / "ar1", tmp_path / "ar2", dirs_exist_ok=True)
    with kvfs.open_store_sync(archived_cfg(make_config, other)) as s:
        assert all(s.get(k) == v for k, v in data.items())  # from the copy
    with kvfs.open_store_sync(archived_cfg(make_config, first, name="fresh")) as s:
        s.put(PageKey.semantic("b", "p", 0), kv_page(1))  # nothing archived yet
    with kvfs.open_store_sync(archived_cfg(make_config, other, name="fresh")) as s:
        assert s.get(PageKey.semantic("b", "p", 0)) == kv_page(1)
    # The same URL naming another place than before: a file:// archive on a share that is
    # not mounted now (an empty directory where it was) is refused too; it was trusted, and
    # spills there dropped local copies that remounting the share then hid.
    with kvfs.open_store_sync(archived_cfg(make_config, first, name="store-3")) as s:
        fill(s, "c", 2, seed=3)
        s.spill("c")
    shutil.move(tmp_path / "ar1", tmp_path / "ar1.share")
    (tmp_path / "ar1").mkdir()
    with pytest.raises(kvfs.ArchiveUnavailable, match="is its file system mounted"):
        kvfs.open_store_sync(archived_cfg(make_config, first, name="store-3")).__enter__()
    assert list((tmp_path / "ar1").iterdir()) == []  # nothing made there: it was refused
    # the archive a directory below the mount point: not there now, and not created there
    shutil.rmtree(tmp_path / "ar1")
    with pytest.raises(kvfs.ArchiveUnavailable, match="does not exist"):
        kvfs.open_store_sync(archived_cfg(make_config, first, name="store-3")).__enter__()
    assert not (tmp_path / "ar1").exists()
    shutil.move(tmp_path / "ar1.share", tmp_path / "ar1")  # mounted again
    with kvfs.open_store_sync(archived_cfg(make_config, first, name="store-3")) as s:
        assert s.get(PageKey.semantic("c", "p0", 0)) == kv_page(3000)


def test_a_manifest_read_before_a_removal_does_not_settle_it(make_config, tmp_path: Path) -> None:  # noqa: ANN001
    """A manifest rewrite settles the queued requests older than its read of the index; a
    removal queued after that read (or queued again after it) stays for the next rewrite.
    Before, any rewrite cleared the queue entry, and a manifest built just before a delete
    kept naming the deleted page (restored elsewhere, its object never collected)."""
    cfg = archived_cfg(make_config, f"file://{tmp_path / 'archive'}")
    with kvfs.open_store_sync(cfg) as s:
        aindex = s.engine.policy.aindex  # type: ignore[attr-defined]
        aindex.enqueue("manifest", ["sessions/x"])
        read_at = time.time()
        time.sleep(0.01)
        aindex.enqueue("manifest", ["sessions/x"])  # asked again, after the read
        aindex.done("manifest", ["sessions/x"], read_at)
        assert aindex.pending("manifest") == ["sessions/x"]
        aindex.done("manifest", ["sessions/x"], time.time() + 1)
        assert aindex.pending("manifest") == []


def test_a_top_level_engine_directory_restores_by_the_name_ls_shows(
    make_config,  # noqa: ANN001
    archive_url: str,
) -> None:
    """``kvfs restore lmcache`` on a host that never held it: the name is no semantic
    session, here or in the archive, so it means the engine directory."""
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        a.put("lmcache/llama@1@0@5e0c@bf16.data", kv_page(5))
        assert a.spill("lmcache") > 0
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        assert "lmcache" in {x["session"] for x in b.archived_sessions()}
        assert b.restore("lmcache") > 0
        assert b.get("lmcache/llama@1@0@5e0c@bf16.data") == kv_page(5)
        with pytest.raises(kvfs.SessionNotFound):
            b.restore("nothing")


@contextlib.contextmanager
def _no_room_for_the_archive(
    make_config,  # noqa: ANN001
    archive_url: str,
    **archive: object,
) -> Iterator[tuple[kvfs.SyncStore, PageKey]]:
    """A store whose capacity is all held by pinned pages, with one archive-only page."""
    cfg = make_config(
        ndev=1,
        capacity=4 * 1024 * KiB,
        archive_url=archive_url,
        extra={"archive": {"interval": 0, **archive}},
    )
    with kvfs.open_store_sync(cfg) as s:
        k = PageKey.semantic("cold", "p", 0)
        s.put(k, kv_page(90, 1024 * KiB))
        s.spill("cold")
        s.pin_session("hold")
        i = 0
        while True:  # fill the cap with pinned pages: nothing is left to evict
            try:
                s.put(PageKey.semantic("hold", "p", i), kv_page(91 + i, 512 * KiB))
            except kvfs.CapacityExceeded:
                break
            i += 1
        yield s, k


def test_an_archive_only_page_with_no_local_room_is_served_from_memory(
    make_config,  # noqa: ANN001
    archive_url: str,
) -> None:
    """Pinned pages hold the whole capacity: a read of an archive-only page cannot restore
    it locally, so its verified bytes are held in memory and served from there (before,
    CapacityExceeded; ENOSPC on the mount)."""
    with _no_room_for_the_archive(make_config, archive_url) as (s, k):
        want = kv_page(90, 1024 * KiB)
        assert s.get(k) == want
        buf = bytearray(len(want))
        assert s.get(k, into=buf) == len(want) and buf == want
        assert s.engine.read_range(k, 1000, 5000) == want[1000:6000]
        assert s.stat(k).tier == "archive"  # no local copy was made
        st = s.statistics()
        assert st.extra["archive"]["memory_reads"] == 3
        assert st.extra["archive"]["memory_copies_bytes"] == len(want)
        assert st.reserved_bytes == 0 and st.used_bytes <= st.capacity_bytes
        s.unpin_session("hold")  # room again: the next read restores it locally
        s.evict(session="hold")
        s.engine.policy._memory.clear()  # type: ignore[attr-defined]
        assert s.get(k) == want and s.stat(k).tier == "local+archive"


def test_readers_with_no_local_room_share_one_download(
    make_config,  # noqa: ANN001
    s3_server,  # noqa: ANN001
    proxy,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Eight readers at once of an archive-only page that has no local room: the download
    they share fails for want of room, and each then downloaded the page into memory for
    itself (eight GETs). They share that download too."""
    url = f"s3://{s3_server.new_bucket()}?endpoint={proxy.endpoint}"
    with _no_room_for_the_archive(make_config, url) as (s, k):
        want = kv_page(90, 1024 * KiB)
        proxy.delay = 0.05  # (a slow endpoint: the readers all arrive while it downloads)
        caplog.set_level(logging.INFO, logger="kvfs.events")
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: s.get(k), range(8)))
        assert all(g == want for g in got)
        downloads = [r for r in caplog.records if "restore-in-memory" in r.getMessage()]
        assert len(downloads) == 1, [r.getMessage() for r in downloads]
        st = s.statistics().extra["archive"]
        assert st["memory_reads"] == 8 and st["memory_copies_bytes"] == len(want)


def test_a_page_larger_than_memory_copies_still_gets_a_clear_error(
    make_config,  # noqa: ANN001
    archive_url: str,
) -> None:
    with _no_room_for_the_archive(make_config, archive_url, memory_copies=512 * KiB) as (s, k):
        with pytest.raises(kvfs.CapacityExceeded, match="archive.memory_copies"):
            s.get(k)
        assert s.statistics().extra["archive"]["memory_reads"] == 0


def test_a_session_pinned_while_eviction_uploads_it_stays_local(
    make_config,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    """Eviction chooses unpinned data, uploads it, then drops the local copies; a pin that
    lands in between (here: while the victims are being chosen) keeps its pages local, as a
    pin promises (they were dropped: nothing lost, but the next read went to the archive)."""
    import threading

    cfg = make_config(
        ndev=1,
        capacity=8 * 64 * KiB,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0, "evict_ahead": 0}},
    )
    with kvfs.open_store_sync(cfg) as s:
        kept = fill(s, "a", 2)
        eng, fired = s.engine, []
        chosen = eng.is_leased  # asked of each victim after it was chosen

        def pin_meanwhile(h: bytes) -> bool:
            if not fired:
                fired.append(True)
                t = threading.Thread(target=s.pin_session, args=("a",))
                t.start()
                t.join(30)
            return chosen(h)

        eng.is_leased = pin_meanwhile  # type: ignore[method-assign]
        others = fill(s, "b", 10, seed=1)  # more than the cap holds: b's oldest pages go
        assert fired
        for k, v in kept.items():
            assert s.stat(k).local, k
            assert s.get(k) == v
        assert any(not s.stat(k).local for k in others)
        assert s.statistics().used_bytes <= cfg.capacity


@pytest.mark.parametrize("workers", [0, 2])
def test_a_put_needing_room_beside_a_copy_whose_file_is_gone(
    make_config,  # noqa: ANN001
    archive_url: str,
    workers: int,
) -> None:
    """Room is made by spilling the coldest pages; the only one that may go has lost its
    data file (behind the store's back). The spill's FileNotFoundError reached the put
    (ENOENT for a write on the mount). Now that copy is taken as damaged and stays; the put
    gets CapacityExceeded (ENOSPC), and fits once the damaged page is deleted."""
    mib = 1 << 20
    cfg = archived_cfg(make_config, archive_url, upload_processes=workers, evict_ahead=0)
    with kvfs.open_store_sync(cfg.replace(capacity=mib * 5 // 2)) as s:
        pages = {i: np.random.default_rng(i).bytes(mib - 64 * 1024) for i in range(3)}
        s.put(PageKey.semantic("old", "p", 0), pages[0])
        s.put(PageKey.semantic("kept", "p", 0), pages[1], pin=True)
        lost = s.stat(PageKey.semantic("old", "p", 0))
        for path in {e.path for e in lost.extents}:
            os.unlink(path)
        with pytest.raises(kvfs.CapacityExceeded):
            s.put(PageKey.semantic("new", "p", 0), pages[2])  # raised FileNotFoundError
        with pytest.raises(kvfs.CorruptPage):
            s.get(PageKey.semantic("old", "p", 0))
        s.delete(PageKey.semantic("old", "p", 0))
        s.put(PageKey.semantic("new", "p", 0), pages[2])
        assert s.get(PageKey.semantic("new", "p", 0)) == pages[2]


def test_an_open_without_the_archive_says_what_reads_as_missing(
    make_config,  # noqa: ANN001
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose pages were spilled, opened without its archive (a mount without
    --archive): `ls` lists them and reads say "missing", and the log said nothing."""
    url = f"file://{tmp_path / 'ar'}"
    with kvfs.open_store_sync(archived_cfg(make_config, url)) as s:
        fill(s, "a", 2)
        s.spill("a")
    with (
        caplog.at_level("WARNING", logger="kvfs"),
        kvfs.open_store_sync(archived_cfg(make_config, "")) as s,
    ):
        assert len(s.list(session="a")) == 2
    said = [r.getMessage() for r in caplog.records if "held only by the archive" in r.getMessage()]
    assert len(said) == 1 and url.removeprefix("file://") in said[0]


def test_fsck_repair_says_when_the_archive_copy_is_gone_too(
    make_config: Callable[..., kvfs.StoreConfig],
    tmp_path: Path,
    run: Callable[..., tuple[int, str, str]],
) -> None:
    """A damaged local copy whose archive object was missing too was reported as "dropped;
    the archive holds it", exit 0, and the next fsck was clean while the page could not
    be read."""
    import json

    from _corrupt import flip_stored_byte

    url = f"file://{tmp_path / 'arch'}"
    cfg = archived_cfg(make_config, url)
    with kvfs.open_store_sync(cfg) as s:
        (k,) = fill(s, "a", 1)
        s.spill("a")
        s.restore("a")
        info = s.stat(k)
        flip_stored_byte(info, 7)
    os.unlink(tmp_path / "arch" / "blobs" / info.checksum)
    data = ",".join(map(str, cfg.data_dirs))
    rc, out, _ = run("fsck", "--repair", "--json", "--data", data, "--archive", url)
    found = json.loads(out)
    assert rc == 5 and found["unrecoverable"] == [k.path], out
    assert any("cannot be read either" in r for r in found["repaired"])


def test_fsck_with_the_archive_unreachable_keeps_its_report(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """An archive unreachable during --check-archive raised after the local repair had
    been done: what was repaired was never said (a second fsck found the orphan gone)."""
    url = f"file://{tmp_path / 'arch'}"
    cfg = archived_cfg(make_config, url)
    with kvfs.open_store_sync(cfg) as s:
        fill(s, "a", 1)
        s.spill("a")
        orphan = cfg.data_dirs[0] / "blobs" / "ee" / "leftover"
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"x")
        os.rename(tmp_path / "arch", tmp_path / "gone")
        try:
            found = s.fsck(repair=True, archive=True)
        finally:
            os.rename(tmp_path / "gone", tmp_path / "arch")
    assert f"removed orphan {orphan}" in found["repaired"] and found["archive_error"]


def test_fsck_repair_between_a_spills_drop_and_its_unlink_finds_no_orphan(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    """A spill commits the drop of its local copies, then removes their files. A repair of
    another client that ran between the two took those files for orphans (the spill's
    transaction did not mark them as leaving the index, as a delete's or an eviction's does)
    and removed them as such: found by a crash-injection run, fsck beside a spill."""
    cfg = archived_cfg(make_config, f"file://{tmp_path / 'archive'}")
    with kvfs.open_store_sync(cfg) as store:
        eng = store.engine
        pages = fill(store, "s", 3)
        drop = eng._drop_files
        found: list[dict[str, list[str]]] = []

        def repair_first(blob: object) -> None:  # fsck of another client, at that instant
            found.append(store.fsck(repair=True))
            drop(blob)  # type: ignore[arg-type]

        eng._drop_files = repair_first  # type: ignore[method-assign]
        try:
            store.spill("s")
        finally:
            eng._drop_files = drop  # type: ignore[method-assign]
        assert len(found) == len(pages)  # (each copy dropped after a repair)
        assert all(f["orphans"] == [] and f["repaired"] == [] for f in found), found
        assert not any(store.fsck().values())
        assert {k: store.get(k) for k in pages} == pages


def test_the_log_says_one_line_per_eviction_pass_not_one_per_page(
    make_config: Callable[..., kvfs.StoreConfig],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every content evicted for room, and every content restored, was an INFO line of its
    # own: a put-heavy daemon under pressure wrote a log line per page it pushed out, and a
    # session read back through the mount one per page (journald throttles, and drops the
    # lines that matter). Per-content lines are DEBUG now; a pass says what it did at INFO.
    import logging

    page = 64 * KiB
    cfg = make_config(
        ndev=1,
        capacity=16 * (page + 4 * KiB) + 8 * KiB,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0}},  # (evict_ahead: each pass frees a few pages)
    )
    with caplog.at_level(logging.INFO, logger="kvfs.events"), kvfs.open_store_sync(cfg) as s:
        for i in range(64):
            s.put(f"a/p{i:02d}", os.urandom(page))
        evicted = s.statistics().evictions["capacity"]
        evicts = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("event=evict ")
        ]
        assert 1 <= len(evicts) <= evicted // 2, (evicted, evicts[:3])  # one line per pass
        assert sum(int(_field(m, "contents")) for m in evicts) == evicted
        put_all = {f"b/p{i}": os.urandom(page) for i in range(8)}
        for k, v in put_all.items():
            s.put(k, v)
        s.evict(session="b")
        caplog.clear()
        assert s.restore("b") == 8 * page
        assert {k: s.get(k) for k in put_all} == put_all
        lines = [r.getMessage() for r in caplog.records]
        assert not [m for m in lines if "content=" in m], lines[:3]


def _field(line: str, name: str) -> str:
    return next(f.split("=", 1)[1] for f in line.split() if f.startswith(name + "="))


def test_page_objects_take_the_storage_class_and_every_object_the_encryption(
    make_config,
    s3_server,  # noqa: ANN001
) -> None:
    """``storage_class`` is for the objects of pages (written once, read seldom), not the
    manifests and heartbeats rewritten every pass (S3's infrequent-access classes bill
    each write at least 30 days); ``sse`` is for all of them. Upload workers included."""
    bucket = s3_server.new_bucket()
    url = (
        f"s3://{bucket}/kv?endpoint={s3_server.endpoint}&addressing=path"
        "&sse=AES256&storage_class=STANDARD_IA"
    )
    cfg = archived_cfg(make_config, url)  # (the default upload workers)
    with kvfs.open_store_sync(cfg) as s:
        data = fill(s, "agent", 4)
        assert s.spill("agent") > 0
        assert s.get(next(iter(data))) == next(iter(data.values()))  # restored
    client = s3_server.client()
    keys = s3_server.keys(bucket)
    assert any(k.startswith("kv/blobs/") for k in keys)
    assert any(k.startswith("kv/manifests/") for k in keys)
    for key in keys:
        head = client.head_object(Bucket=bucket, Key=key)
        assert head.get("ServerSideEncryption") == "AES256", key
        cls = "STANDARD_IA" if key.startswith("kv/blobs/") else "STANDARD"
        assert head.get("StorageClass", "STANDARD") == cls, key


def test_a_versioned_bucket_works_and_keeps_what_kvfs_deletes_as_old_versions(
    make_config,
    s3_server,  # noqa: ANN001
) -> None:
    """On a bucket with versioning on (a common default for backups), a delete leaves a
    delete marker over the old version: content deleted and then put and spilled again
    must be stored again (a conditional put sees no object), and read back. What such a
    bucket keeps is the old versions, which docs/archive.md says how to expire."""
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    url = f"s3://{bucket}/kv?endpoint={s3_server.endpoint}&addressing=path"
    cfg = archived_cfg(make_config, url, upload_processes=0)
    with kvfs.open_store_sync(cfg) as s:
        data = fill(s, "a", 3)
        assert s.spill("a") > 0
        s.delete_session("a")  # (with SyncStore its objects go before it returns)
    assert [k for k in s3_server.keys(bucket) if k.startswith("kv/blobs/")] == []
    versions = client.list_object_versions(Bucket=bucket, Prefix="kv/blobs/")
    assert len(versions.get("Versions", ())) == 3  # kept, under delete markers
    with kvfs.open_store_sync(cfg) as s:
        for k, v in data.items():
            s.put(k, v)
        assert s.spill("a") > 0
        assert s.list(session="a")[0].tier == "archive"
        assert {k: s.get(k) for k in data} == data
    assert len([k for k in s3_server.keys(bucket) if k.startswith("kv/blobs/")]) == 3
