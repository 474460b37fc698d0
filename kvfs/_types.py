"""Frozen records the store hands out: page and session info, statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DeviceStatistics", "Extent", "PageInfo", "SessionInfo", "StoreStatistics"]


@dataclass(frozen=True, slots=True)
class Extent:
    """Where a run of page bytes lives: ``length`` bytes at ``offset`` in ``path``.

    ``offset`` is always 4 KiB aligned, so O_DIRECT and cuFile can read it as it is. Extents are
    listed in page order; concatenated they are the page.
    """

    device: int
    path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PageInfo:
    path: str
    session: str
    size: int
    checksum: str
    created: float
    atime: float
    pinned: bool
    #: "local", "archive" or "local+archive"
    tier: str
    attrs: dict[str, str]
    extents: tuple[Extent, ...] = ()
    #: when the page's own pin ends (a time.time()); None: pinned for good, or not pinned
    pin_until: float | None = None

    @property
    def local(self) -> bool:
        return self.tier.startswith("local")


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session: str
    dir: str
    created: float
    atime: float
    pinned: bool
    attrs: dict[str, str]
    pages: int
    bytes: int
    local_bytes: int
    archived_bytes: int
    #: when the session's pin ends (a time.time()); None: pinned for good, or not pinned
    pin_until: float | None = None

    @property
    def model(self) -> str | None:
        return self.attrs.get("model")


@dataclass(frozen=True, slots=True)
class DeviceStatistics:
    index: int
    path: str
    used_bytes: int
    free_bytes: int
    #: disk errors (EIO, ENXIO, ENODEV, EROFS) this device answered since the store opened
    errors: int = 0
    #: left out of new placements now: its last disk error is recent (see
    #: kvfs._local.FAILING_SECONDS)
    failing: bool = False
    #: the last disk error, and when (time.time())
    last_error: str | None = None
    last_error_at: float | None = None


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    capacity_bytes: int
    used_bytes: int
    reserved_bytes: int
    pages: int
    sessions: int
    #: distinct stored contents held locally, and their bytes
    local_blobs: int
    local_bytes: int
    #: sum of page sizes: what the store would hold without deduplication
    logical_bytes: int
    puts: int
    dedup_puts: int
    gets: int
    hits: int
    misses: int
    corrupt_reads: int
    bytes_written: int
    bytes_read: int
    evictions: dict[str, int] = field(default_factory=dict)
    devices: tuple[DeviceStatistics, ...] = ()
    extra: dict[str, object] = field(default_factory=dict)
