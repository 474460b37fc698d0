"""A conformance suite every page store implementation runs (zarr's ``StoreTests`` pattern).

Subclass :class:`PageStoreTests` in a test module and provide a ``store`` fixture that yields
an object with the store API (``kvfs.Store``, ``kvfs.SyncStore``, a daemon client...): its
methods may be coroutines or plain functions, the suite awaits whatever needs awaiting::

    class TestMyStore(PageStoreTests):
        stripe_unit = 64 * 1024          # sizes around it are tested

        @pytest.fixture
        async def store(self, tmp_path):
            async with kvfs.open_store(data_dirs=[tmp_path / "d"]) as s:
                yield s

The suite needs pytest and pytest-trio in ``trio_mode``. It only uses the public API (put,
get, read_range, stat, exists, list, sessions, delete, delete_session, pin, unpin,
pin_session, unpin_session, evict, put_many, get_many, statistics) and the public errors, so
it holds for any tier: nothing here reads files behind the store's back.
"""

from __future__ import annotations

import inspect
import itertools
import mmap
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import kvfs
from kvfs._aligned import aligned_buffer
from kvfs._checksum import LEAF

__all__ = ["PageStoreTests", "as_async"]

KiB = 1024
_counter = itertools.count()


class as_async:  # noqa: N801 - a thin view, named like a function
    """Every method of ``store`` as a coroutine function, whether it was async or not."""

    def __init__(self, store: object) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        fn = getattr(self._store, name)

        async def call(*args: Any, **kw: Any) -> Any:
            r = fn(*args, **kw)
            return await r if inspect.isawaitable(r) else r

        return call


def fresh_session() -> str:
    return f"s{os.getpid()}-{next(_counter)}"


def payload(n: int, seed: int = 0) -> bytes:
    """Distinct, incompressible-looking bytes (a fixed generator: reproducible failures)."""
    return np.random.default_rng(seed * 7919 + n).integers(0, 256, n, dtype=np.uint8).tobytes()


class PageStoreTests:
    """The contract of a page store. Subclasses provide the ``store`` fixture."""

    #: The store's stripe unit, if it has one: page sizes around it are exercised.
    stripe_unit: int = 64 * KiB

    @pytest.fixture
    def store(self) -> object:
        raise NotImplementedError("a PageStoreTests subclass provides the `store` fixture")

    @pytest.fixture
    def s(self, store: object) -> as_async:
        return as_async(store)

    def boundary_sizes(self) -> list[int]:
        u = self.stripe_unit
        sizes = {
            0,
            1,
            7,
            4095,
            4096,
            4097,
            8191,
            u - 1,
            u,
            u + 1,
            2 * u + 4097,
            3 * u,
            LEAF - 1,
            LEAF,
            LEAF + 1,
            2 * LEAF + 4095,
            3 * LEAF + 123,
        }
        return sorted(x for x in sizes if x >= 0)

    # -- write-once, replace, round trip -------------------------------------------------
    async def test_put_get_round_trip(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p0", 0)
        data = payload(10_000)
        info = await s.put(key, data)
        assert info.size == len(data) and info.path == key.path
        assert await s.get(key) == data
        assert await s.exists(key)
        assert (await s.stat(key)).size == len(data)

    async def test_sizes_around_boundaries(self, s: as_async) -> None:
        sess = fresh_session()
        for i, n in enumerate(self.boundary_sizes()):
            key = kvfs.PageKey.semantic(sess, f"size{n}", i)
            data = payload(n, i)
            await s.put(key, data)
            assert await s.get(key) == data, f"{n} bytes"
            st = await s.stat(key)
            assert st.size == n
            for buf in (bytearray(n), aligned_buffer(n), memoryview(bytearray(n + 1))[1:]):
                assert await s.get(key, into=buf) == n
                assert bytes(buf[:n]) == data, f"{n} bytes into {type(buf).__name__}"

    async def test_write_once(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 1)
        await s.put(key, b"first")
        with pytest.raises(kvfs.PageExists) as ei:
            await s.put(key, b"second")
        assert isinstance(ei.value, FileExistsError)
        assert await s.get(key) == b"first"

    async def test_replace(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 1)
        await s.put(key, payload(5000, 1))
        await s.put(key, payload(7000, 2), replace=True)
        assert await s.get(key) == payload(7000, 2)
        assert (await s.stat(key)).size == 7000

    async def test_buffer_kinds(self, s: as_async) -> None:
        sess = fresh_session()
        arr = np.arange(3 * 5 * 7, dtype=np.float16).reshape(3, 5, 7)
        sources: list[object] = [
            payload(999),
            bytearray(payload(1000)),
            arr,
            memoryview(payload(4096)),
            np.array([1.5, -2.0], dtype=np.float32),
        ]
        for i, src in enumerate(sources):
            key = kvfs.PageKey.semantic(sess, "buf", i)
            await s.put(key, src)
            want = np.asarray(src).tobytes() if isinstance(src, np.ndarray) else bytes(src)  # type: ignore[call-overload]
            assert await s.get(key) == want
        out = np.empty_like(arr)
        assert await s.get(kvfs.PageKey.semantic(sess, "buf", 2), into=out) == arr.nbytes
        assert np.array_equal(out, arr)
        # An mmap (here anonymous; a file mapping works the same) as source and as target.
        m = mmap.mmap(-1, 3 * 4096 + 5)
        m[:] = payload(len(m), 4)
        await s.put(kvfs.PageKey.semantic(sess, "buf", 99), m)
        back = mmap.mmap(-1, len(m))
        assert await s.get(kvfs.PageKey.semantic(sess, "buf", 99), into=back) == len(m)
        assert back[:] == payload(len(m), 4)

    async def test_into_errors(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 0)
        await s.put(key, payload(5000))
        with pytest.raises(ValueError):
            await s.get(key, into=bytearray(4999))
        with pytest.raises(TypeError):
            await s.get(key, into=bytes(5000))
        big = bytearray(b"\xee" * 6000)
        assert await s.get(key, into=big) == 5000
        assert bytes(big[:5000]) == payload(5000) and big[5000:] == b"\xee" * 1000

    async def test_non_contiguous_source_rejected(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 0)
        with pytest.raises((ValueError, TypeError)):
            await s.put(key, np.arange(100, dtype=np.int32)[::2])
        with pytest.raises(TypeError):
            await s.put(key, "a str is not bytes")
        assert not await s.exists(key)

    async def test_empty_page(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 0)
        await s.put(key, b"")
        assert await s.get(key) == b""
        assert await s.get(key, into=bytearray()) == 0
        assert (await s.stat(key)).size == 0

    async def test_read_range(self, s: as_async) -> None:
        key = kvfs.PageKey.from_path(f"{fresh_session()}/ranges.bin")
        n = LEAF + 3 * self.stripe_unit + 77
        data = payload(n, 3)
        await s.put(key, data)
        for off, size in [
            (0, 1),
            (1, 4096),
            (LEAF - 5, 10),
            (n - 10, 100),
            (n, 5),
            (0, n),
            (self.stripe_unit - 1, self.stripe_unit + 2),
        ]:
            assert await s.read_range(key, off, size) == data[off : off + size], (off, size)
        for off, size in [(-5, 10), (-n, 100), (10, -1)]:
            with pytest.raises(ValueError, match="offset >= 0 and size >= 0"):
                await s.read_range(key, off, size)
        assert await s.get(key) == data  # a bad range is not mistaken for a corrupt page

    # -- names, listing, sessions ------------------------------------------------------
    async def test_invalid_keys(self, s: as_async) -> None:
        bad = [
            "",
            "a//b",
            "../x",
            "a/../b",
            "a/./b",
            "/abs",
            "a/b\x00c",
            "x" * 300,
            "/".join(["d" * 200] * 6),
            "sessions/only-two",
        ]
        for path in bad:
            with pytest.raises(kvfs.InvalidKey):
                await s.put(path, b"x")
            with pytest.raises(kvfs.InvalidKey):
                await s.get(path)
        for parts in [
            ("", "p", 0),
            ("s", "..", 0),
            ("s/t", "p", 0),
            ("s", "p", -1),
            ("s", "p\x00", 1),
            ("s", "p", ""),
        ]:
            with pytest.raises(kvfs.InvalidKey):
                kvfs.PageKey.semantic(*parts)  # type: ignore[arg-type]
        assert isinstance(kvfs.InvalidKey("x"), ValueError)

    async def test_missing_pages(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 0)
        for op in ("get", "stat", "delete", "pin"):
            with pytest.raises(kvfs.PageNotFound) as ei:
                await getattr(s, op)(key)
            assert isinstance(ei.value, FileNotFoundError)
        assert not await s.exists(key)
        with pytest.raises(FileNotFoundError):
            await s.read_range(key, 0, 10)

    async def test_list(self, s: as_async) -> None:
        a, b = fresh_session(), fresh_session()
        for sess in (a, b):
            for prefix in ("p1", "p2"):
                for layer in range(3):
                    await s.put(kvfs.PageKey.semantic(sess, prefix, layer), payload(100, layer))
        d = f"engines/{fresh_session()}"  # engine-named files: the directory is the session
        for name in ("x.bin", "y.bin", "sub/z.bin"):
            await s.put(f"{d}/{name}", payload(50))
        got = sorted(p.path for p in await s.list(session=a))
        assert got == sorted(
            kvfs.PageKey.semantic(a, p, la).path for p in ("p1", "p2") for la in range(3)
        )
        assert {p.path for p in await s.list(session=a, prefix="p2")} == {
            kvfs.PageKey.semantic(a, "p2", la).path for la in range(3)
        }
        assert sorted(p.path for p in await s.list(path_prefix=f"{d}/")) == [
            f"{d}/sub/z.bin",
            f"{d}/x.bin",
            f"{d}/y.bin",
        ]
        assert [p.path for p in await s.list(session=d)] == [f"{d}/x.bin", f"{d}/y.bin"]
        assert await s.list(session=fresh_session()) == []

    async def test_sessions_isolated(self, s: as_async) -> None:
        a, b = fresh_session(), fresh_session()
        await s.put(kvfs.PageKey.semantic(a, "same", 0), b"from a", attrs={"model": "m-a"})
        await s.put(kvfs.PageKey.semantic(b, "same", 0), b"from b", attrs={"model": "m-b"})
        assert await s.get(kvfs.PageKey.semantic(a, "same", 0)) == b"from a"
        assert await s.get(kvfs.PageKey.semantic(b, "same", 0)) == b"from b"
        infos = {x.session: x for x in await s.sessions()}
        assert infos[a].pages == 1 and infos[a].model == "m-a" and infos[b].model == "m-b"
        assert await s.delete_session(a) == 1
        assert not await s.exists(kvfs.PageKey.semantic(a, "same", 0))
        assert await s.get(kvfs.PageKey.semantic(b, "same", 0)) == b"from b"
        assert a not in {x.session for x in await s.sessions()}
        with pytest.raises(kvfs.SessionNotFound):
            await s.delete_session(a)

    async def test_attrs(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 3)
        attrs = {"model": "llama", "dtype": "bf16", "shape": "2x8x256x128", "tokens": "0-256"}
        await s.put(key, b"kv", attrs=attrs)
        assert (await s.stat(key)).attrs == attrs
        [info] = await s.list(session=key.session)
        assert info.attrs == attrs and info.checksum == (await s.stat(key)).checksum
        with pytest.raises((kvfs.InvalidKey, TypeError)):
            await s.put(kvfs.PageKey.semantic(key.session, "p", 4), b"kv", attrs={"n": 1})  # type: ignore[dict-item]
        assert not await s.exists(kvfs.PageKey.semantic(key.session, "p", 4))

    async def test_delete(self, s: as_async) -> None:
        key = kvfs.PageKey.semantic(fresh_session(), "p", 0)
        await s.put(key, payload(3000))
        await s.delete(key)
        assert not await s.exists(key)
        await s.put(key, payload(10))  # a deleted key is free again
        assert await s.get(key) == payload(10)

    async def test_rename(self, s: as_async) -> None:
        sess = fresh_session()
        a, b = kvfs.PageKey.semantic(sess, "p", 0), kvfs.PageKey.semantic(sess, "p", 1)
        await s.put(a, payload(5000, 1))
        await s.rename(a, a)  # onto itself: nothing happens, as rename(2) does
        assert await s.get(a) == payload(5000, 1)
        await s.put(b, payload(7000, 2))
        await s.rename(a, b)  # replaces b
        assert not await s.exists(a)
        assert await s.get(b) == payload(5000, 1)
        with pytest.raises(kvfs.PageNotFound):
            await s.rename(a, b)

    # -- pins, eviction ----------------------------------------------------------------
    async def test_pin_flags(self, s: as_async) -> None:
        sess = fresh_session()
        key = kvfs.PageKey.semantic(sess, "p", 0)
        await s.put(key, b"x", pin=True)
        assert (await s.stat(key)).pinned
        await s.unpin(key)
        assert not (await s.stat(key)).pinned
        await s.pin(key)
        assert (await s.stat(key)).pinned
        await s.pin_session(sess)
        assert {x.session: x.pinned for x in await s.sessions()}[sess]
        await s.unpin_session(sess)
        assert not {x.session: x.pinned for x in await s.sessions()}[sess]

    async def test_evict_respects_pins(self, s: as_async) -> None:
        sess, other = fresh_session(), fresh_session()
        pinned = kvfs.PageKey.semantic(sess, "p", 0)
        in_pinned_session = kvfs.PageKey.semantic(other, "p", 0)
        loose = kvfs.PageKey.semantic(sess, "p", 1)
        await s.put(pinned, payload(5000, 1), pin=True)
        await s.put(in_pinned_session, payload(5000, 2))
        await s.pin_session(other)
        await s.put(loose, payload(5000, 3))
        assert await s.evict(pinned) == 0
        assert await s.evict(session=other) == 0
        await s.evict(loose)
        assert await s.get(pinned) == payload(5000, 1)
        assert await s.get(in_pinned_session) == payload(5000, 2)
        # Evicting an unpinned page removes it (no archive) or keeps it readable (archive).
        if await s.exists(loose):
            assert await s.get(loose) == payload(5000, 3)

    # -- dedup, batches, statistics ----------------------------------------------------
    async def test_dedup_in_statistics(self, s: as_async) -> None:
        data = payload(3 * self.stripe_unit + 5, 9)
        before = await s.statistics()
        keys = [kvfs.PageKey.semantic(fresh_session(), "system-prompt", 0) for _ in range(3)]
        for k in keys:
            await s.put(k, data)
        after = await s.statistics()
        assert after.dedup_puts - before.dedup_puts == 2
        assert after.local_blobs - before.local_blobs == 1
        assert after.logical_bytes - before.logical_bytes == 3 * len(data)
        assert after.local_bytes - before.local_bytes == len(data)
        assert len({(await s.stat(k)).checksum for k in keys}) == 1
        await s.delete(keys[0])
        await s.delete(keys[1])
        assert await s.get(keys[2]) == data

    async def test_put_many_get_many(self, s: as_async) -> None:
        sess = fresh_session()
        items = [
            (kvfs.PageKey.semantic(sess, "batch", i), payload(1000 * i + 1, i)) for i in range(12)
        ]
        infos = await s.put_many(items)
        assert [i.path for i in infos] == [k.path for k, _ in items]
        assert await s.get_many([k for k, _ in items]) == [d for _, d in items]
        bufs = [bytearray(len(d)) for _, d in items]
        assert await s.get_many([k for k, _ in items], into=bufs) == [len(d) for _, d in items]
        assert [bytes(b) for b in bufs] == [d for _, d in items]

    async def test_statistics_counts(self, s: as_async) -> None:
        before = await s.statistics()
        sess = fresh_session()
        await s.put(kvfs.PageKey.semantic(sess, "p", 0), payload(4000, 1))
        await s.get(kvfs.PageKey.semantic(sess, "p", 0))
        after = await s.statistics()
        assert after.pages == before.pages + 1
        assert after.puts == before.puts + 1 and after.gets == before.gets + 1
        assert after.used_bytes <= after.capacity_bytes
        assert after.used_bytes >= after.local_bytes
