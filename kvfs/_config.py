"""Store configuration: one frozen dataclass with every default.

The embedded default needs nothing: data in ``./kvfs-data`` and no cap beyond the disk.
Loading from TOML / environment / flags builds on :meth:`StoreConfig.replace`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DISK_CAPACITY", "StoreConfig", "parse_duration", "parse_size"]

#: ``StoreConfig.capacity`` meaning "what the disks hold", and forgetting the capacity kept
#: with the store (``capacity = "disk"`` in the settings): without it, an open that gives
#: none keeps to the last one given, and a cap once given could never be taken back.
DISK_CAPACITY = -1

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
ALIGN = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": 1000,
    "kib": KiB,
    "m": MiB,
    "mb": 1000**2,
    "mib": MiB,
    "g": GiB,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1024 * GiB,
    "tb": 1000**4,
    "tib": 1024 * GiB,
    "p": 1024**5,
    "pb": 1000**5,
    "pib": 1024**5,
}


def parse_size(text: str | int) -> int:
    """``"64MiB"`` -> 67108864. Accepts ints, decimal (kB, MB) and binary (KiB, MiB) units,
    and fractions of a unit that come to whole bytes (``"1.5GiB"``). Raises ValueError for
    anything else, a negative size, one that is no whole number of bytes (``"0.5"``,
    ``"0.1KiB"``) and one over :data:`MAX_SIZE`."""
    if isinstance(text, int):
        if not 0 <= text <= MAX_SIZE:  # (not DISK_CAPACITY's -1 either: "disk" says that)
            raise ValueError(f"not a size: {text!r} (examples: 4096, 64MiB, 2GB)")
        return text
    s = text.strip().lower().replace(" ", "").replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    # Decimal, not float: "0.5" was truncated to 0 bytes (for a capacity, "the cap kept with
    # the store") and "1048576.7" to 1048576, and a float rounds large sizes besides
    try:
        given = decimal.Decimal(num) if unit in _UNITS and num else None
    except decimal.InvalidOperation:
        given = None
    if given is None or not given.is_finite() or given < 0:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64MiB, 2GB)")
    if given and given.adjusted() > 30:  # (past MAX_SIZE in any unit; too long to multiply)
        raise ValueError(f"not a size: {text!r} (at most {MAX_SIZE} bytes)")
    # Exact or refused: in the default context "1e999999999" raised decimal.Overflow (no
    # ValueError: the CLI said "[<class 'decimal.Overflow'>]"), and the product was rounded
    # to 28 digits, "1.000000000000000000000000000001" to 1 byte and "1e-99999999" to 0
    with decimal.localcontext(_EXACT):
        try:
            value = given * _UNITS[unit]
        except decimal.Inexact:  # (digits past any whole number of bytes)
            raise ValueError(f"not a whole number of bytes: {text!r}") from None
    if value != value.to_integral_value():
        exact = value.normalize(_EXACT)  # (not the default context's 28 digits: "(1 bytes)")
        raise ValueError(f"not a whole number of bytes: {text!r} ({exact:f} bytes)")
    if value > MAX_SIZE:
        raise ValueError(f"not a size: {text!r} (at most {MAX_SIZE} bytes)")
    return int(value)


#: Room for every digit of a product that may be whole (at most 31 digits before the point
#: times a unit of 16 digits): one that must be rounded in it is no whole number of bytes
_EXACT = decimal.Context(
    prec=200, Emin=-999999, Emax=999999, traps=[decimal.InvalidOperation, decimal.Inexact]
)

#: the largest size a setting may give: the index keeps sizes as SQLite integers (a larger
#: capacity was taken, then failed the open with "OverflowError: Integer value out of range")
MAX_SIZE = 2**63 - 1


_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str | float) -> float:
    """``"7d"`` -> 604800.0 seconds. Accepts numbers (seconds) and s, m, h, d, w suffixes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit in _SECONDS and num:
        with contextlib.suppress(ValueError):  # "1.2.3d": the error below
            return float(num) * _SECONDS[unit]
    raise ValueError(f"not a duration: {text!r} (examples: 90, 30m, 12h, 7d)")


@dataclass(frozen=True)
class StoreConfig:
    """Everything a store needs to open. Every field has a default.

    The sizes take what the configuration file and ``--capacity`` take: an int of bytes or
    a string such as ``"64MiB"`` or ``"2GB"`` (:func:`parse_size`), and ``capacity`` also
    ``"disk"`` (:data:`DISK_CAPACITY`); the directories take a ``str`` or a path. The
    fields hold the normalised values (ints, :class:`~pathlib.Path`), as annotated, so a
    type checker wants the ints: ``capacity=kvfs.parse_size("2TiB")``. Raises TypeError
    for a value of the wrong type (``io_threads="8"``, ``direct_io="false"``,
    ``data_dirs=None``) and ValueError for one out of range, each naming the field.
    """

    #: One root directory per NVMe device; pages are striped across them.
    data_dirs: tuple[Path, ...] = (Path("kvfs-data"),)
    #: Hard cap on bytes the local tier holds on disk (headers and 4 KiB padding included).
    #: A cap given is kept with the store. 0: the one kept, else what the disks hold (the
    #: sum of the devices' free space at open, a file system holding several data
    #: directories counted once, less a reserve on each for the index and other writers: 1%,
    #: at least 64 MiB, at most 1/4). DISK_CAPACITY: what the disks hold, the kept cap
    #: forgotten.
    capacity: int = 0
    #: Stripe unit: pages larger than this are split round-robin across devices.
    stripe_unit: int = 4 * MiB
    #: Where the SQLite index lives; default: the first data dir.
    index_dir: Path | None = None
    #: Read and write with O_DIRECT where the buffers allow it.
    direct_io: bool = True
    #: fsync data and index before a put returns (off only for benchmarks of the page cache).
    durable: bool = True
    #: Worker threads for disk I/O and hashing.
    io_threads: int = 8
    #: Archive URL: ``file:///dir`` or ``s3://bucket/prefix``; empty = no archive tier.
    archive_url: str = ""
    #: Free-form per-subsystem settings (archive, daemon...) later issues read.
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked and normalised here, where the caller can see the field it got wrong: a
        # "64MiB" or a "false" used to get as far as a comparison ('<=' not supported
        # between 'str' and 'int') or to be taken as true.
        raw: object = self.data_dirs
        if isinstance(raw, (str, os.PathLike)):
            raw = (raw,)
        if not isinstance(raw, Iterable) or isinstance(raw, bytes):
            raise TypeError(
                "StoreConfig.data_dirs must be a directory or a list of them, "
                f"not {type(raw).__name__}"
            )
        dirs = tuple(_path("data_dirs", d) for d in raw)
        if not dirs:
            raise ValueError("at least one data directory is needed")
        if len({os.path.abspath(d) for d in dirs}) != len(dirs):
            raise ValueError("data directories must be distinct")
        object.__setattr__(self, "data_dirs", dirs)
        index_dir = self.index_dir
        object.__setattr__(
            self,
            "index_dir",
            _path("index_dir", index_dir) if index_dir not in (None, "") else None,
        )
        object.__setattr__(self, "capacity", _size("capacity", self.capacity))
        object.__setattr__(self, "stripe_unit", _size("stripe_unit", self.stripe_unit))
        for name in ("direct_io", "durable"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"StoreConfig.{name} must be True or False, not {getattr(self, name)!r}"
                )
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int):
            raise TypeError(f"StoreConfig.io_threads must be an int, not {self.io_threads!r}")
        if not isinstance(self.archive_url, str):
            raise TypeError(
                "StoreConfig.archive_url must be a string ('' for no archive tier), "
                f"not {self.archive_url!r}"
            )
        if not isinstance(self.extra, dict):
            raise TypeError(f"StoreConfig.extra must be a dict, not {type(self.extra).__name__}")
        if self.stripe_unit <= 0 or self.stripe_unit % ALIGN:
            raise ValueError(f"stripe_unit must be a positive multiple of {ALIGN}")
        if self.capacity < 0 and self.capacity != DISK_CAPACITY:
            raise ValueError("capacity must be >= 0, or DISK_CAPACITY")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")

    @property
    def index_path(self) -> Path:
        return Path(self.index_dir or self.data_dirs[0]) / "kvfs-index.sqlite3"

    @property
    def lock_path(self) -> Path:
        return Path(self.index_dir or self.data_dirs[0]) / "kvfs.lock"

    def replace(self, **changes: object) -> StoreConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _path(name: str, value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"StoreConfig.{name}: a directory is a str or a path, not {value!r}")
    return Path(value)


def _size(name: str, value: object) -> int:
    """A size field's bytes, from an int or a size string (``capacity`` also "disk")."""
    if isinstance(value, str):
        if name == "capacity" and value.strip().lower() == "disk":
            return DISK_CAPACITY
        try:
            return parse_size(value)
        except ValueError as e:
            raise ValueError(f"StoreConfig.{name}: {e}") from None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"StoreConfig.{name} must be an int of bytes or a size such as '64MiB', not {value!r}"
        )
    n = operator.index(value)  # numpy's integers too
    if n > MAX_SIZE:
        raise ValueError(f"StoreConfig.{name}: {n} is over the largest size, {MAX_SIZE} bytes")
    return n
