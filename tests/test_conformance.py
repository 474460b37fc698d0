"""The page store conformance suite (kvfs.testing) against the async Store and the sync facade,
with one device and with three devices and a tiny stripe unit."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest

import kvfs
from kvfs.testing import PageStoreTests

KiB = 1024


class TestAsyncStoreOneDevice(PageStoreTests):
    stripe_unit = 4 << 20

    @pytest.fixture
    async def store(
        self, make_config: Callable[..., kvfs.StoreConfig]
    ) -> AsyncIterator[kvfs.Store]:
        async with kvfs.open_store(make_config(ndev=1, stripe_unit=self.stripe_unit)) as s:
            yield s


class TestAsyncStoreStriped(PageStoreTests):
    stripe_unit = 16 * KiB

    @pytest.fixture
    async def store(
        self, make_config: Callable[..., kvfs.StoreConfig]
    ) -> AsyncIterator[kvfs.Store]:
        async with kvfs.open_store(make_config(ndev=3, stripe_unit=self.stripe_unit)) as s:
            yield s


class TestSyncStoreOneDevice(PageStoreTests):
    stripe_unit = 4 << 20

    @pytest.fixture
    def store(self, make_config: Callable[..., kvfs.StoreConfig]) -> Iterator[kvfs.SyncStore]:
        with kvfs.open_store_sync(make_config(ndev=1, stripe_unit=self.stripe_unit)) as s:
            yield s


class TestSyncStoreStriped(PageStoreTests):
    stripe_unit = 16 * KiB

    @pytest.fixture
    def store(self, make_config: Callable[..., kvfs.StoreConfig]) -> Iterator[kvfs.SyncStore]:
        with kvfs.open_store_sync(make_config(ndev=3, stripe_unit=self.stripe_unit)) as s:
            yield s
