"""Reading a ``file://`` archive's layout directly, for checks at the end of a test."""

from __future__ import annotations

from pathlib import Path

import msgpack


def objects(archive: Path) -> set[str]:
    """The blob objects stored (checksums, hex)."""
    return {p.name for p in (archive / "blobs").glob("*")}


def named(archive: Path) -> set[str]:
    """Every blob any manifest names (checksums, hex)."""
    out: set[str] = set()
    for m in (p for p in (archive / "manifests").rglob("*") if p.is_file()):
        out.update(p["hash"].hex() for p in msgpack.unpackb(m.read_bytes(), raw=False)["pages"])
    return out
