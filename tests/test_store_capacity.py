"""The capacity cap: never exceeded (accounting and files on disk), eviction by policy,
pinned pages and pinned sessions never evicted, CapacityExceeded when nothing may go."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import kvfs
from kvfs._settings import as_toml, load_settings

KiB, MiB = 1024, 1 << 20


def snapshot(cfg: kvfs.StoreConfig) -> dict[str, tuple[int, int]]:
    """{path: (inode, size)} of every data file, read by one directory walk."""
    out = {}
    for root in cfg.data_dirs:
        for dirpath, _dirs, files in os.walk(Path(root) / "blobs"):
            for f in files:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                out[p] = (st.st_ino, st.st_size)
    return out


def coexisting_bytes(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> int:
    """A lower bound of the bytes on disk at every instant between two walks: a file seen by
    both (same inode; names are never reused) existed throughout that interval. One walk
    alone is not a snapshot: it can count a file deleted mid-walk and its successor."""
    return sum(min(sa, b[p][1]) for p, (ia, sa) in a.items() if p in b and b[p][0] == ia)


def files_bytes(cfg: kvfs.StoreConfig) -> tuple[int, int]:
    """(sum of file sizes, sum of allocated blocks) of every data file, as `du` sees them."""
    size = blocks = 0
    for root in cfg.data_dirs:
        for dirpath, _dirs, files in os.walk(Path(root) / "blobs"):
            for f in files:
                try:
                    st = os.stat(os.path.join(dirpath, f))
                except FileNotFoundError:
                    continue  # removed while we walked
                size += st.st_size
                blocks += st.st_blocks * 512
    return size, blocks


def test_concurrent_puts_never_exceed_cap(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    cap = 3 * MiB
    cfg = make_config(ndev=3, stripe_unit=64 * KiB, capacity=cap)
    violations: list[str] = []
    stop = threading.Event()
    with kvfs.open_store_sync(cfg) as store:

        def watch() -> None:
            before = snapshot(cfg)
            while not stop.is_set():
                st = store.statistics()
                if st.used_bytes > cap or st.used_bytes + st.reserved_bytes > cap:
                    violations.append(f"accounted {st.used_bytes}+{st.reserved_bytes} > {cap}")
                now = snapshot(cfg)
                if (on_disk := coexisting_bytes(before, now)) > cap:
                    violations.append(f"files on disk {on_disk} > {cap}")
                before = now

        def writer(t: int) -> int:
            rng = random.Random(t)
            n = 0
            for i in range(25):
                size = rng.choice([1, 5000, 64 * KiB, 64 * KiB + 1, 300 * KiB, 700 * KiB])
                data = (bytes([t, i % 256]) * (size // 2 + 1))[:size]  # some repeat: dedup
                store.put(f"t{t}/p{i}", data)
                n += 1
            return n

        w = threading.Thread(target=watch)
        w.start()
        try:
            with ThreadPoolExecutor(12) as ex:
                assert sum(ex.map(writer, range(12))) == 300
        finally:
            stop.set()
            w.join()
        st = store.statistics()
        assert not violations, violations[:5]
        assert st.evictions.get("capacity", 0) > 0  # the cap really was reached
        assert st.used_bytes == files_bytes(cfg)[0] <= cap
        assert st.reserved_bytes == 0
        # Whatever is still listed reads back whole.
        for info in store.list(path_prefix=""):
            assert len(store.get(info.path)) == info.size
        assert store.fsck()["orphans"] == []


def test_capacity_exceeded_when_everything_is_pinned(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        i = 0
        with pytest.raises(kvfs.CapacityExceeded) as ei:
            while True:
                store.put(f"pinned/p{i}", os.urandom(100 * KiB), pin=True)
                i += 1
        assert isinstance(ei.value, OSError) and "not enough left" in str(ei.value)
        before = store.statistics()
        assert i >= 5 and before.pages == i
        assert files_bytes(cfg)[0] == before.used_bytes  # the refused put left no file
        with pytest.raises(kvfs.CapacityExceeded, match="larger than the capacity"):
            store.put("huge", bytes(2 * MiB))
        # Unpinning one page makes room again: it is evicted for the next put.
        store.unpin("pinned/p0")
        store.put("fits", os.urandom(100 * KiB))
        assert not store.exists("pinned/p0")
        assert all(store.exists(f"pinned/p{j}") for j in range(1, i))


def test_no_page_is_deleted_for_room_that_cannot_be_made(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Without an archive, evicting deletes: a put too large for what could go deleted
    every unpinned page, then failed anyway."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        for i in range(6):
            store.put(f"pinned/p{i}", os.urandom(128 * KiB), pin=True)
        loose = {f"loose/p{i}": os.urandom(64 * KiB) for i in range(2)}
        for k, v in loose.items():
            store.put(k, v)
        with pytest.raises(kvfs.CapacityExceeded, match="not enough left"):
            store.put("too-big", os.urandom(600 * KiB))
        assert all(store.get(k) == v for k, v in loose.items())
        assert store.statistics().evictions.get("capacity", 0) == 0
        store.put("fits", os.urandom(100 * KiB))  # what can be made room for still is
        assert store.statistics().evictions.get("capacity", 0) >= 1


def test_a_large_duplicate_needs_no_room(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A page larger than the bytes hashed before the write, put again under another key
    with no room for a second copy: it shares the copy held. It reserved room for one
    first, so it failed when that copy's page was pinned, and evicted (without an archive:
    deleted) that page when it was not."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=4 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        pinned, loose = os.urandom(3 * MiB), os.urandom(3 * MiB)
        store.put("a/pinned", pinned, pin=True)
        used = store.statistics().used_bytes
        store.put("b/pinned", pinned)
        st = store.statistics()
        assert (st.used_bytes, st.reserved_bytes, st.evictions) == (used, 0, {})
        assert store.get("b/pinned") == pinned
        store.delete("a/pinned")
        store.delete("b/pinned")

        store.put("a/loose", loose)
        store.put("b/loose", loose)
        assert store.exists("a/loose") and store.get("b/loose") == loose
        st = store.statistics()
        assert (st.used_bytes, st.reserved_bytes, st.evictions) == (used, 0, {})
        assert store.fsck()["orphans"] == []


def test_pinned_pages_and_sessions_are_never_evicted(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    cfg = make_config(ndev=3, stripe_unit=32 * KiB, capacity=2 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        keep = {}
        for layer in range(4):
            k = kvfs.PageKey.semantic("pinned-session", "p", layer)
            keep[k] = os.urandom(60 * KiB)
            store.put(k, keep[k])
        store.pin_session("pinned-session")
        for layer in range(3):
            k = kvfs.PageKey.semantic("loose", "p", layer)
            keep[k] = os.urandom(70 * KiB)
            store.put(k, keep[k], pin=True)
        for i in range(60):  # far more than fits: constant eviction
            store.put(kvfs.PageKey.semantic(f"churn{i % 5}", f"p{i}", 0), os.urandom(90 * KiB))
        st = store.statistics()
        assert st.evictions.get("capacity", 0) >= 30
        for k, data in keep.items():
            assert store.get(k) == data
        assert st.used_bytes <= cfg.capacity


def test_eviction_is_least_recently_used(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    """Between session directories and between bursts of access the order is LRU."""
    from kvfs._policy import AccessClock

    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=4 * (64 * KiB + 4 * KiB))
    with kvfs.open_store_sync(cfg) as store:
        for name in "abcd":
            store.put(f"{name}/p", os.urandom(64 * KiB))
        store.engine.clock = AccessClock()  # the get below is a later burst, however fast
        store.get("a/p")  # a is now the most recently used
        store.put("e/p", os.urandom(64 * KiB))
        assert {p.path for p in store.list(path_prefix="")} == {"a/p", "c/p", "d/p", "e/p"}
        assert store.statistics().evictions == {"capacity": 1}


@contextlib.contextmanager
def _prefix_then_another_page(
    make_config: Callable[..., kvfs.StoreConfig], room: int
) -> Iterator[tuple[kvfs.SyncStore, list[kvfs.PageKey]]]:
    """A store with room for ``room`` pages holding four chunks of a prefix, written in
    order, then a page of another session (evicting what did not fit)."""
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=room * (64 * KiB + 4 * KiB))
    with kvfs.open_store_sync(cfg) as store:
        chunks = [kvfs.PageKey.semantic("agent", f"c{i:03d}", 0) for i in range(4)]
        for k in chunks:
            store.put(k, os.urandom(64 * KiB))
        store.put("other/p", os.urandom(64 * KiB))
        yield store, chunks


def test_a_prefix_written_in_order_is_evicted_tail_first(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A prefix is usable from its head only. Its chunks, saved in order, had each a later
    access time than the one before, so LRU evicted chunk 0 first: what stayed was of no
    use to an engine (it recomputes from the first missing chunk)."""
    with _prefix_then_another_page(make_config, room=4) as (store, chunks):
        store.put("other/q", os.urandom(64 * KiB))
        left = {p.path for p in store.list(session="agent")}
        assert left == {chunks[0].path, chunks[1].path}


def test_a_prefix_read_in_order_is_evicted_tail_first(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Read back chunk after chunk, a prefix's pages were stamped in that order and LRU took
    the head first; one burst of reads now counts as one access, and eviction takes the
    newest-written pages of it first."""
    from kvfs._policy import AccessClock

    with _prefix_then_another_page(make_config, room=5) as (store, chunks):
        store.engine.clock = AccessClock()  # the reads below are a later burst, however fast
        for k in chunks:
            store.get(k)
        store.put("other/q", os.urandom(64 * KiB))  # other/p is the least recently used
        assert not store.exists("other/p")
        store.put("other/r", os.urandom(64 * KiB))
        left = {p.path for p in store.list(session="agent")}
        assert left == {k.path for k in chunks[:3]}


def test_access_bursts_end_after_a_gap_or_a_span() -> None:
    """The access clock's rule, at given times: one directory's accesses less than ``gap``
    apart share the first one's time, for at most ``span``; each directory has its own."""
    from kvfs._policy import AccessClock

    c = AccessClock(gap=5, span=60)
    assert [c.stamp("s", t) for t in (100, 101, 104, 108.5)] == [100, 100, 100, 100]
    assert c.stamp("t", 109) == 109  # another directory: its own burst
    assert c.stamp("s", 114) == 114  # 5.5 s after the last access: a new burst
    assert [c.stamp("s", t) for t in range(115, 180, 4)] == [114] * 15 + [175, 175]  # 61 s on
    assert c.stamp("s", 50) == 50  # the clock was set back: a new burst, not a time ahead


def test_an_access_timed_just_before_its_bursts_start_is_of_that_burst() -> None:
    """Parallel readers each read the clock, then wait for the access clock's lock: one
    whose time was a little earlier than the burst's first access (taken by another reader
    that got the lock first) began a new burst at its own time, taken for a clock set back.
    The first page read then had a later time than all the others of the burst, and
    eviction took the prefix's head before that page."""
    from kvfs._policy import AccessClock

    c = AccessClock(gap=5, span=60)
    assert [c.stamp("s", t) for t in (100.002, 100.0, 100.001, 103)] == [100.002] * 4
    assert c.stamp("s", 107.5) == 100.002  # (within the gap of the latest access, 103)
    assert c.stamp("s", 101) == 100.002  # late, but within the gap of the burst's start
    assert c.stamp("s", 94) == 94  # more than the gap before it: the clock was set back


def test_default_cap_is_what_the_disks_hold(make_config: Callable[..., kvfs.StoreConfig]) -> None:
    """Without a configured cap the cap is what the disks hold when the store opens, less
    the headroom kept on each for the index (1%, at least 64 MiB, at most a quarter).
    Directories on one file system share its free space: it counted once per directory, a
    cap twice what the disk held (so the disk filled before eviction began)."""
    from kvfs._engine import headroom

    with kvfs.open_store_sync(make_config(ndev=2)) as store:
        st = store.statistics()
        free = st.devices[0].free_bytes  # both directories are on this one file system
        assert st.used_bytes == 0 and st.capacity_bytes > 0
        assert abs(st.capacity_bytes - (free - headroom(free))) <= 256 * MiB  # others write too
        assert st.capacity_bytes < free


def test_put_waits_for_writes_in_flight_instead_of_failing(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Room held only by another write in flight is not 'nothing left to evict': that write
    will commit (and become evictable) or give its room back, so the put waits for it."""
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        w = store.begin_write("engine/big.bin")
        w.write(0, os.urandom(700 * KiB))  # holds most of the cap, not yet a page
        result: list[object] = []
        t = threading.Thread(
            target=lambda: result.append(store.put("other/p", os.urandom(400 * KiB)))
        )
        t.start()
        t.join(0.5)
        assert t.is_alive() and not result  # waiting, neither failed nor over the cap
        w.commit()  # the write in flight becomes an evictable page; the put evicts it
        t.join(10)
        assert not t.is_alive() and isinstance(result[0], kvfs.PageInfo)
        assert not store.exists("engine/big.bin") and store.exists("other/p")
        st = store.statistics()
        assert st.used_bytes <= cfg.capacity and st.reserved_bytes == 0
        assert st.evictions.get("capacity") == 1


def test_a_streaming_write_growing_past_the_cap_says_so(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A file written in pieces (`dd` onto the mount) that grows past the whole capacity can
    never fit: it is told so at once (it was told "nothing left that may be evicted" after
    one more eviction attempt), and gives its room back."""
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        store.put("cache/p0", os.urandom(100 * KiB))
        w = store.begin_write("engine/huge.bin")
        with pytest.raises(kvfs.CapacityExceeded, match="larger than the capacity cap"):
            for off in range(0, 2 * MiB, 128 * KiB):
                w.write(off, bytes(128 * KiB))
        w.abort()
        st = store.statistics()
        assert st.reserved_bytes == 0 and st.used_bytes <= cfg.capacity


def test_a_streaming_write_that_just_fits_is_not_refused(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A writer reserves room ahead of its writes; near the cap that room is not there, and
    a page that fits must still be written (it was refused for the room ahead): alone, and
    beside a pinned page that leaves exactly its size free."""
    cap = 4 * MiB
    cfg = make_config(ndev=1, stripe_unit=1 * MiB, capacity=cap)
    with kvfs.open_store_sync(cfg) as store:
        tier = store.engine.tier
        for name in ["alone", "beside-pin"]:
            if name == "beside-pin":
                store.put("pinned/p", os.urandom(cap // 2), pin=True)
            size = cap - store.statistics().used_bytes - 12 * KiB  # (one leaf header on disk)
            data = os.urandom(size)
            assert tier.disk_bytes(size) <= cap - store.statistics().used_bytes
            w = store.begin_write(f"engine/{name}.bin")
            for off in range(0, size, 128 * KiB):
                w.write(off, data[off : off + 128 * KiB])
            w.commit()
            assert store.get(f"engine/{name}.bin") == data
            st = store.statistics()
            assert st.used_bytes <= cap and st.reserved_bytes == 0
            store.delete(f"engine/{name}.bin")


def test_a_page_pinned_after_eviction_chose_its_data_is_kept(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Eviction picks unpinned data, then deletes it; a client that pins a page sharing that
    data in between (a deduplicated put with pin=True) keeps it: the pin is checked again in
    the deleting transaction (it was deleted, acknowledged pin and all)."""
    import threading

    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        shared = os.urandom(100 * KiB)
        store.put("x/a", shared)
        eng = store.engine
        chosen = eng.is_leased  # asked of each victim after it was chosen
        fired: list[bool] = []

        def pin_meanwhile(h: bytes) -> bool:
            if not fired:
                fired.append(True)
                t = threading.Thread(target=lambda: store.put("y/pinned", shared, pin=True))
                t.start()
                t.join(30)
            return chosen(h)

        eng.is_leased = pin_meanwhile  # type: ignore[method-assign]
        with pytest.raises(kvfs.CapacityExceeded):
            store.put("x/big", os.urandom(960 * KiB))
        assert fired
        assert store.get("y/pinned") == shared and store.get("x/a") == shared
        st = store.statistics()
        assert st.used_bytes <= cfg.capacity and st.reserved_bytes == 0


@pytest.mark.parametrize("ndev", [1, 3])
def test_the_devices_used_bytes_add_up_to_the_stores(
    make_config: Callable[..., kvfs.StoreConfig], ndev: int
) -> None:
    """Each device's share of a page's disk bytes was rounded down: one device showed
    425,982 bytes used where the store showed 425,984."""
    cfg = make_config(ndev=ndev)
    with kvfs.open_store_sync(cfg) as s:
        rnd = random.Random(ndev)
        for i in range(12):
            s.put(f"sessions/s/p/layer-{i:03d}", os.urandom(rnd.randrange(1, 300_000)))
        st = s.statistics()
        assert sum(d.used_bytes for d in st.devices) == st.used_bytes
        for i in range(0, 12, 2):
            s.delete(f"sessions/s/p/layer-{i:03d}")
        st = s.statistics()
        assert sum(d.used_bytes for d in st.devices) == st.used_bytes
    with kvfs.open_store_sync(cfg) as s:  # (the accounting saved at close)
        st = s.statistics()
        assert sum(d.used_bytes for d in st.devices) == st.used_bytes


def test_the_capacity_given_is_kept_with_the_store(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A daemon mounted with --capacity 20MiB, then an offline `kvfs put` (which gives no
    capacity) took the disks' free space as its cap: a 30 MiB page went in, past the cap,
    and the next mounted write deleted it to get back under."""
    cfg = make_config(ndev=1, capacity=1 << 20)
    with kvfs.open_store_sync(cfg) as s:
        assert s.statistics().capacity_bytes == 1 << 20
    default = cfg.replace(capacity=0)
    with kvfs.open_store_sync(default) as s:
        assert s.statistics().capacity_bytes == 1 << 20
        with pytest.raises(kvfs.CapacityExceeded):
            s.put("big", os.urandom(2 << 20))
    with kvfs.open_store_sync(cfg.replace(capacity=4 << 20)) as s:  # a new one replaces it
        s.put("big", os.urandom(2 << 20))
    with kvfs.open_store_sync(default) as s:
        assert s.statistics().capacity_bytes == 4 << 20


def test_a_capacity_given_can_be_taken_back(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A cap once given was kept for good: an open without one kept to it, and no setting
    went back to what the disks hold. DISK_CAPACITY (`--capacity disk`, `capacity = "disk"`)
    does, and the opens after it that give none keep to the disks too."""
    cfg = make_config(ndev=1, capacity=1 << 20)
    with kvfs.open_store_sync(cfg) as s:
        assert s.statistics().capacity_bytes == 1 << 20
    disks = cfg.replace(capacity=kvfs.DISK_CAPACITY)
    with kvfs.open_store_sync(disks) as s:
        disk_cap = s.statistics().capacity_bytes
        assert disk_cap > 4 << 20
        s.put("big", os.urandom(2 << 20))  # over the old cap
    with kvfs.open_store_sync(cfg.replace(capacity=0)) as s:
        assert s.statistics().capacity_bytes > 4 << 20  # the kept cap is gone
        assert s.exists("big")
    # the same through the settings (the daemon's `kvfs mount --capacity disk`)
    data = ",".join(map(str, cfg.data_dirs))
    with kvfs.open_store_sync(cfg) as s:
        assert s.statistics().capacity_bytes == 1 << 20
    settings = load_settings(env={}, flags={"data_dirs": data, "capacity": "disk"})
    assert "disk" in as_toml(settings)
    with kvfs.open_store_sync(settings.store_config()) as s:
        assert s.statistics().capacity_bytes > 4 << 20
    with kvfs.open_store_sync(load_settings(env={}, flags={"data_dirs": data}).store_config()) as s:
        assert s.statistics().capacity_bytes > 4 << 20
    with pytest.raises(ValueError, match="DISK_CAPACITY"):
        cfg.replace(capacity=-2)


def test_two_streaming_writers_each_holding_half_the_cap_do_not_wait_for_each_other(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each writer's next write needs room the other holds. Each waited for the other's
    reservation to go, which it could not while its owner waited too, until the deadline.
    Now the later waiter fails at once (ENOSPC on the mount); its writer gives up, and the
    earlier one gets the room. (The deadline is made long: only the wait's end is checked.)"""
    import kvfs._engine
    import kvfs._writes

    monkeypatch.setattr(kvfs._engine, "RESERVE_WAIT_SECONDS", 600.0)
    monkeypatch.setattr(kvfs._writes, "RESERVE_WAIT_SECONDS", 600.0, raising=False)
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=2 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        writers = [store.begin_write(f"eng/w{i}") for i in range(2)]
        for w in writers:
            w.write(0, bytes(900_000))
        both = threading.Barrier(2)
        outcome: dict[int, str] = {}

        def more(i: int) -> None:
            both.wait()
            try:
                writers[i].write(900_000, bytes(900_000))
                writers[i].commit()
                outcome[i] = "committed"
            except kvfs.CapacityExceeded:
                writers[i].abort()
                outcome[i] = "refused"

        threads = [threading.Thread(target=more, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "the writers wait for each other"
        assert sorted(outcome.values()) == ["committed", "refused"]
        st = store.statistics()
        assert st.used_bytes <= 2 * MiB and st.reserved_bytes == 0


def test_a_streaming_write_left_open_at_close_leaves_nothing(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A writer neither committed nor aborted when the store closes (a script that forgot,
    an engine that stopped mid-file): its files stayed on disk outside the cap, and the next
    open, finding the index closed cleanly, never looked for them."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=8 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        w = store.begin_write("eng/f")
        w.write(0, os.urandom(1 * MiB))
    with pytest.raises(kvfs.StoreClosed):
        w.write(1 * MiB, b"more")
    with kvfs.open_store_sync(cfg) as store:
        assert store.fsck()["orphans"] == []
        on_disk = sum(
            f.stat().st_size
            for d in cfg.data_dirs
            for f in d.rglob("*")
            if f.is_file() and "blobs" in f.parts
        )
        assert on_disk == store.statistics().used_bytes == 0


def test_the_access_clock_forgets_the_bursts_that_ended() -> None:
    """It forgot the bursts that ended only when a session it knew began a new one: a
    daemon whose sessions each came once (agents that never return) grew it without end."""
    from kvfs._policy import AccessClock

    c = AccessClock(gap=2, span=30)
    for i in range(5000):  # all busy at once: none forgotten
        assert c.stamp(f"agent-{i}", 100.0) == 100.0
    assert len(c._bursts) == 5000
    assert c.stamp("later", 200.0) == 200.0  # the others' bursts ended long ago
    assert list(c._bursts) == ["later"]


def test_an_eviction_counts_the_local_copies_it_dropped_not_the_names(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """Evicting a session (no archive: its pages are deleted) whose data another session
    still holds counted one eviction, though no copy left the disk and the statistic says
    "local copies dropped"."""
    data = os.urandom(100_000)
    with kvfs.open_store_sync(make_config(ndev=1)) as s:
        s.put("sessions/a/p/layer-000", data)
        s.put("sessions/b/p/layer-000", data)  # the same content, stored once
        assert s.evict(session="a") == 0
        st = s.statistics()
        assert (st.evictions, st.local_blobs) == ({}, 1)
        assert s.evict(session="b") > 0
        st = s.statistics()
        assert (st.evictions, st.local_blobs) == ({"manual": 1}, 0)


@pytest.mark.parametrize("size", [10 * KiB, 0])
def test_a_streaming_write_cut_short_leaves_no_file_outside_the_cap(
    make_config: Callable[..., kvfs.StoreConfig], size: int
) -> None:
    """A file written on the mount over three devices, then truncated to less than one
    stripe unit before its close: the other devices' files (their 4 KiB headers) stayed,
    named by no extent, so counted nowhere (on disk past the cap) and left behind by the
    page's delete."""
    cfg = make_config(ndev=3, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        data = os.urandom(200 * KiB)
        w = store.begin_write("engine/cut.bin")
        w.write(0, data)
        w.truncate(size)
        assert files_bytes(cfg)[0] <= store.statistics().reserved_bytes
        w.write(size, b"")  # (an empty write: nothing new on disk)
        w.commit()
        assert store.get("engine/cut.bin") == data[:size]
        st = store.statistics()
        assert files_bytes(cfg)[0] == st.used_bytes
        assert store.fsck()["orphans"] == []
        store.delete("engine/cut.bin")
        assert files_bytes(cfg)[0] == store.statistics().used_bytes == 0
        # A write past the cut after the truncate makes those files again
        w = store.begin_write("engine/again.bin")
        w.write(0, data)
        w.truncate(size)
        w.write(130 * KiB, data[:1000])
        w.commit()
        assert store.get("engine/again.bin") == data[:size] + bytes(130 * KiB - size) + data[:1000]
        assert files_bytes(cfg)[0] == store.statistics().used_bytes
        assert store.fsck()["orphans"] == []


@pytest.mark.parametrize("pin", ["page", "session"])
def test_a_page_pinned_while_its_session_is_evicted_is_kept(
    make_config: Callable[..., kvfs.StoreConfig], pin: str
) -> None:
    """``evict(session=...)`` without an archive deletes the session's unpinned pages; it
    read which were pinned before it deleted them, and a pin that landed in between (an
    agent pinning the page it is about to reuse) was deleted, acknowledged pin and all."""
    cfg = make_config(ndev=1, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        kept, other = os.urandom(100 * KiB), os.urandom(100 * KiB)
        store.put("sessions/a/p/layer-000", kept)
        store.put("sessions/a/p/layer-001", other)
        eng = store.engine
        leased = eng.is_leased  # asked of the two contents, then of each page
        fired: list[bool] = []

        def pin_meanwhile(h: bytes) -> bool:
            fired.append(True)
            if len(fired) == 3:  # (the pages' turn: the pins were read by then)
                if pin == "page":
                    store.pin("sessions/a/p/layer-000")
                else:
                    store.pin_session("a")
            return leased(h)

        eng.is_leased = pin_meanwhile  # type: ignore[method-assign]
        store.evict(session="a")
        assert fired
        assert store.get("sessions/a/p/layer-000") == kept
        if pin == "session":
            assert store.get("sessions/a/p/layer-001") == other
        st = store.statistics()
        assert st.used_bytes == files_bytes(cfg)[0] and st.reserved_bytes == 0
        assert not any(store.fsck().values())


def test_a_restore_made_redundant_meanwhile_removes_its_files_before_its_room_goes(
    make_config: Callable[..., kvfs.StoreConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore whose data a put of the same bytes made local while it was written drops
    its copy; it gave that copy's room back first, then removed the files: in between,
    the files on disk were more than the store counted used and reserved, and another
    write could take that room past the cap."""
    from kvfs._local import BlobWriter

    cfg = make_config(
        ndev=1,
        capacity=1 * MiB,
        archive_url=f"file://{tmp_path / 'archive'}",
        extra={"archive": {"interval": 0}},
    )
    with kvfs.open_store_sync(cfg) as store:
        data = os.urandom(100 * KiB)
        store.put("sessions/a/p/layer-000", data)
        store.spill("a")
        assert store.statistics().used_bytes == files_bytes(cfg)[0] == 0
        policy = store.engine.policy
        adopt = policy.aindex.adopt_local_many  # type: ignore[attr-defined]

        def put_first(items: list[tuple[bytes, tuple, int]]) -> list[object]:
            store.put("sessions/b/p/layer-000", data)  # (the same bytes: local again)
            return adopt(items)  # type: ignore[no-any-return]

        policy.aindex.adopt_local_many = put_first  # type: ignore[attr-defined]
        at_abort: list[tuple[int, int]] = []
        abort = BlobWriter.abort

        def watched(w: BlobWriter) -> None:
            st = store.statistics()
            at_abort.append((files_bytes(cfg)[0], st.used_bytes + st.reserved_bytes))
            abort(w)

        monkeypatch.setattr(BlobWriter, "abort", watched)
        assert store.get("sessions/a/p/layer-000") == data
        assert at_abort and all(on_disk <= counted for on_disk, counted in at_abort)
        st = store.statistics()
        assert files_bytes(cfg)[0] == st.used_bytes and st.reserved_bytes == 0
        assert not any(store.fsck().values())


@pytest.mark.parametrize("how", ["evict", "room"])
def test_a_page_pinned_meanwhile_keeps_its_copy_in_a_store_opened_without_its_archive(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path, how: str
) -> None:
    """Opened without its archive (an offline command), a store evicts archived data by
    dropping its local copy. A page pinned after that data was chosen lost its copy all the
    same, its pin acknowledged, and could not be read until the archive was there again."""
    url = f"file://{tmp_path / 'archive'}"
    cfg = make_config(ndev=1, capacity=1 * MiB, archive_url=url, extra={"archive": {"interval": 0}})
    data = os.urandom(100 * KiB)
    with kvfs.open_store_sync(cfg) as store:
        store.put("sessions/a/p/layer-000", data)
        store.spill("a")
        assert store.get("sessions/a/p/layer-000") == data  # (local again, and archived)
    offline = make_config(ndev=1, capacity=1 * MiB)
    with kvfs.open_store_sync(offline) as store:
        eng = store.engine
        leased = eng.is_leased  # asked of each victim after it was chosen
        asked: list[bool] = []

        def pin_meanwhile(h: bytes) -> bool:
            asked.append(True)
            if len(asked) == (2 if how == "evict" else 1):  # (evict: its page's turn)
                store.pin("sessions/a/p/layer-000")
            return leased(h)

        eng.is_leased = pin_meanwhile  # type: ignore[method-assign]
        if how == "evict":
            assert store.evict(session="a") == 0
        else:
            with pytest.raises(kvfs.CapacityExceeded):
                store.put("sessions/b/p/layer-000", os.urandom(960 * KiB))
        assert store.stat("sessions/a/p/layer-000").tier == "local+archive"
        assert store.get("sessions/a/p/layer-000") == data
        st = store.statistics()
        assert st.used_bytes == files_bytes(offline)[0] and st.reserved_bytes == 0


class _HeldAfterCheck:
    """A writer's lock whose acquisition by the thread named ``late`` waits for ``go``: that
    thread has passed the write's closed check and reaches the lock only after an abort."""

    def __init__(self, real: threading.Lock) -> None:
        self.real = real
        self.waiting, self.go = threading.Event(), threading.Event()

    def __enter__(self) -> bool:
        if threading.current_thread().name == "late":
            self.waiting.set()
            self.go.wait(30)
        return self.real.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.real.__exit__(*exc)


def test_a_write_that_reaches_the_lock_after_an_abort_takes_no_room(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A streaming write checked that its writer was open, then waited for the writer's lock
    (behind another write of it waiting for room), and the writer was aborted meanwhile: the
    write went on, reserved room that nothing gave back (used + reserved stayed above what
    the disk holds until the store closed) and wrote data files after the abort removed
    them. It is refused now, once it holds the lock."""
    with kvfs.open_store_sync(make_config(ndev=2)) as s:
        eng = s.engine
        w = eng.begin_write("stream/late")
        w.write(0, b"a" * 10_000)
        gate = _HeldAfterCheck(w._lock)  # type: ignore[arg-type]
        w._lock = gate  # type: ignore[assignment]
        failed: list[BaseException] = []

        def late() -> None:
            try:
                w.write(10_000, b"b" * 300_000)
            except BaseException as e:  # noqa: BLE001 - what the write said, checked below
                failed.append(e)

        t = threading.Thread(target=late, name="late")
        t.start()
        assert gate.waiting.wait(30)
        w.abort()
        gate.go.set()
        t.join(30)
        assert not t.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], ValueError), failed
        assert "closed" in str(failed[0])
        assert eng.reserved == 0 and s.statistics().used_bytes == 0
        data = [p for d in s.config.data_dirs for p in (Path(d) / "blobs").rglob("*")]
        assert not [p for p in data if p.is_file()], data  # (the abort removed them)
        assert not s.fsck()["orphans"]


def test_a_streaming_write_out_of_room_counts_its_own_room_apart(
    make_config: Callable[..., kvfs.StoreConfig],
) -> None:
    """A streaming write that ran out of room said "N reserved by writes in flight", N
    counting its own room: with no other write in flight it read as room others held."""
    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        store.put("pinned/p", os.urandom(600 * KiB), pin=True)
        w = store.engine.begin_write("stream/w")
        w.write(0, os.urandom(200 * KiB))
        own = store.engine.reserved
        assert own > 0
        with pytest.raises(kvfs.CapacityExceeded) as ei:
            w.write(200 * KiB, os.urandom(300 * KiB))
        assert f"0 reserved by other writes in flight (and {own} by this write so far)" in str(
            ei.value
        ), ei.value
        w.abort()
        assert store.engine.reserved == 0


def test_an_abort_waits_for_a_write_past_its_reservation_before_removing_the_files(
    make_config: Callable[..., kvfs.StoreConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming write that had reserved its room (its check made under the lock) and was
    writing its bytes when the writer was aborted: the abort removed the data files, then
    the write made its file again, left on disk outside the cap (nothing reserved it), its
    descriptor open. The abort waits for such a write; the files go after it."""
    from kvfs._local import BlobWriter

    cfg = make_config(ndev=2, stripe_unit=64 * KiB, capacity=1 * MiB)
    with kvfs.open_store_sync(cfg) as store:
        w = store.engine.begin_write("stream/late")
        w.write(0, b"a" * 1000)
        inside, go = threading.Event(), threading.Event()
        write, abort = BlobWriter.write, BlobWriter.abort

        def held_write(self: BlobWriter, off: int, data: memoryview) -> None:
            if threading.current_thread().name == "late":  # (past the lock: room reserved)
                inside.set()
                go.wait(30)
            write(self, off, data)

        def abort_then_go(self: BlobWriter) -> None:
            abort(self)
            go.set()  # (before: the write goes on now, after the files were removed)

        class WaitSays(threading.Condition):
            def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
                go.set()  # (the abort waits for the write: it may go on)
                return super().wait_for(predicate, timeout)

        monkeypatch.setattr(BlobWriter, "write", held_write)
        monkeypatch.setattr(BlobWriter, "abort", abort_then_go)
        w._idle = WaitSays(w._lock)  # type: ignore[attr-defined]
        # (the second unit: the other device's file, which the first write did not make)
        late = threading.Thread(target=w.write, args=(64 * KiB, b"b" * 1000), name="late")
        late.start()
        assert inside.wait(30)
        w.abort()
        late.join(30)
        assert not late.is_alive()
        data = [p for d in cfg.data_dirs for p in (Path(d) / "blobs").rglob("*")]
        assert not [p for p in data if p.is_file()], data
        assert store.statistics().reserved_bytes == 0
