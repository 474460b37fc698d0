"""Removing and checking data: delete, rename, evict, statistics and fsck.

Deletes and evictions run the index transaction first (the page disappears), then unlink
the files, deferred while the data is leased (:meth:`Engine._drop_files`). A crash between
the two leaves orphans, swept at the next start. Functions here take the
:class:`~kvfs._engine.Engine` whose state they use; the engine's public methods are the
entry points.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._aligned import aligned_buffer
from ._checksum import leaf_hash, tree_hash
from ._errors import (
    ArchiveUnavailable,
    CorruptPage,
    KvfsError,
    PageNotFound,
    SessionNotFound,
)
from ._events import log_event
from ._index import BlobRow, PageRow
from ._keys import SESSIONS_DIR, PageKey, as_key, session_name
from ._types import DeviceStatistics, StoreStatistics
from ._writes import leaves_now

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = [
    "after_delete",
    "delete",
    "delete_blob_pages",
    "delete_evicted_pages",
    "delete_session",
    "evict",
    "expire_session",
    "fsck",
    "rename",
    "statistics",
]


# -- delete -------------------------------------------------------------------------------
def delete(eng: Engine, k: PageKey) -> None:
    gone, freed = eng.index.delete_pages([k.path])
    if not gone:
        raise PageNotFound(f"no page {k.path!r}")
    after_delete(eng, gone, freed)


def delete_session(eng: Engine, session: str) -> int:
    d = eng.resolve_session(session)
    n = expire_session(eng, d, None)
    if n is None:
        raise SessionNotFound(f"no session {session_name(d)!r}")
    return n


def expire_session(eng: Engine, d: str, untouched_since: float | None) -> int | None:
    """Delete session directory ``d`` from every tier; returns the pages removed, or None
    when there is no such session. With ``untouched_since`` (retention), only an unpinned
    session holding no pinned page and untouched since then (None otherwise: it was
    touched or pinned meanwhile)."""
    deleted = eng.index.delete_session(d, untouched_since=untouched_since)
    if deleted is None:
        return None
    after_delete(eng, *deleted)
    _forget_dirs(eng, d)
    return len(deleted[0])


def _forget_dirs(eng: Engine, d: str) -> None:
    """The directories mkdir made on the mount in deleted semantic session ``d`` go with it.
    An engine's own directories stay, emptied: the engine made them once and writes on
    into them (LMCache's and vLLM's trees), and must not find them gone."""
    if d.startswith(f"{SESSIONS_DIR}/"):
        eng.dirs.remove_many(eng.dirs.tree(d))


def after_delete(eng: Engine, gone: builtins.list[PageRow], freed: builtins.list[BlobRow]) -> None:
    """What follows the index's removal of pages: their data's files, the policy's view."""
    for b in freed:
        eng._drop_files(b)
    for d in {p.session for p in gone}:
        eng.index.drop_session_if_empty(d)
    if gone:
        eng.policy.pages_removed(gone)


def delete_blob_pages(eng: Engine, blob: BlobRow, reason: str) -> int:
    deleted = eng.index.delete_blob_pages(blob.hash, keep_pinned=True)
    if deleted is None:
        return 0  # pinned since it was chosen
    gone, freed = deleted
    after_delete(eng, gone, freed)
    with eng._cap_lock:
        eng._evictions[reason] += 1
    n = sum(b.disk_bytes for b in freed if b.extents is not None)
    log_event(
        "evict",
        content=blob.hash.hex()[:16],
        reason=reason,
        pages=len(gone),
        bytes=n,
        archived=False,
    )
    return n


def delete_evicted_pages(eng: Engine, pages: builtins.list[PageRow], reason: str) -> int:
    gone, freed = eng.index.delete_pages(p.path for p in pages)
    after_delete(eng, gone, freed)
    bytes_of = {b.hash: b.disk_bytes for b in freed if b.extents is not None}
    by_content = collections.Counter(p.hash for p in gone)
    with eng._cap_lock:
        eng._evictions[reason] += len(by_content)
    for h, n in by_content.items():  # one line per content, as a capacity eviction logs
        b = bytes_of.get(h, 0)  # 0: another session's page still holds it
        log_event("evict", content=h.hex()[:16], reason=reason, pages=n, bytes=b, archived=False)
    return sum(bytes_of.values())


def rename(eng: Engine, s: PageKey, d: PageKey) -> None:
    try:
        old, freed = eng.index.rename_page(s.path, d.path, d.session_dir)
    except KeyError:
        raise PageNotFound(f"no page {s.path!r}") from None
    if s.path == d.path:
        return
    if freed is not None:
        eng._drop_files(freed)
    eng.index.drop_session_if_empty(old.session)
    # The archive's manifests of both sessions list the old name and the replaced data.
    eng.policy.pages_removed([old, dataclasses.replace(old, path=d.path, session=d.session_dir)])


# -- eviction -----------------------------------------------------------------------------
def evict(
    eng: Engine,
    target: PageKey | str | None,
    session: str | None,
    reason: str,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    if session is not None:
        d = eng.resolve_session(session)
        if eng.index.session(d) is None:
            raise SessionNotFound(f"no session {session_name(d)!r}")
        pages = eng.index.pages(session=d)
    elif target is not None:
        p = eng.index.page(as_key(target).path)
        if p is None:
            raise PageNotFound(f"no page {as_key(target).path!r}")
        pages = [p]
    else:
        raise ValueError("evict needs a page or a session")
    evictable = {b.hash for b in eng.index.eviction_candidates(1 << 62)}
    with eng._evict_lock:
        hashes = sorted({p.hash for p in pages})
        blobs = [b for b in map(eng.index.blob, hashes) if b is not None and b.local]
        local = {b.hash for b in blobs}
        blobs = [b for b in blobs if b.hash in evictable and not eng.is_leased(b.hash)]
        # Evicting by deletion (no archive) removes the pages named, not their data: a pin
        # on another session sharing it does not keep these (--force deleted nothing then)
        pinned = {
            d for d in {p.session for p in pages} if (row := eng.index.session(d)) and row.pinned
        }
        mine = [
            p
            for p in pages
            if p.hash in local
            and not p.pinned
            and p.session not in pinned
            and not eng.is_leased(p.hash)  # a reader holds it: kept, as every eviction does
        ]
        if not blobs and not mine:
            return 0
        return eng.policy.evict_pages(mine, blobs, reason, progress)


# -- statistics ---------------------------------------------------------------------------
def statistics(eng: Engine) -> StoreStatistics:
    c = eng.index.counts()
    free = eng.tier.free_bytes()
    with eng._cap_lock:
        k = dict(eng._counters)
        return StoreStatistics(
            capacity_bytes=eng.capacity,
            used_bytes=eng.used,
            reserved_bytes=eng.reserved,
            pages=c["pages"],
            sessions=c["sessions"],
            local_blobs=c["local_blobs"],
            local_bytes=c["local_bytes"],
            logical_bytes=c["logical_bytes"],
            puts=k.get("puts", 0),
            dedup_puts=k.get("dedup_puts", 0),
            gets=k.get("gets", 0),
            hits=max(0, k.get("gets", 0) - k.get("misses", 0)),  # (see Engine.note_read)
            misses=k.get("misses", 0),
            corrupt_reads=k.get("corrupt_reads", 0),
            bytes_written=k.get("bytes_written", 0),
            bytes_read=k.get("bytes_read", 0),
            evictions=dict(eng._evictions),
            extra={**eng.policy.statistics(), **_settings(eng)},
            devices=tuple(
                DeviceStatistics(i, str(r), eng.dev_used[i], free[i])
                for i, r in enumerate(eng.tier.roots)
            ),
        )


def _settings(eng: Engine) -> dict[str, object]:
    """What the store runs with, and the mount serving it: a daemon's own flags, which
    ``kvfs config`` (files, environment, its own flags) cannot know."""
    cfg = eng.config
    out: dict[str, object] = {
        "settings": {
            "stripe_unit": cfg.stripe_unit,
            "direct_io": cfg.direct_io,
            "durable": cfg.durable,
            "io_threads": cfg.io_threads,
            "index": str(cfg.index_path),
        }
    }
    if eng.mounted is not None:
        out["mount"] = dict(eng.mounted)
    return out


# -- verification -------------------------------------------------------------------------
def fsck(
    eng: Engine, *, repair: bool, verify_data: bool, progress: object, archive: bool = False
) -> dict[str, builtins.list[str]]:
    out: dict[str, builtins.list[str]] = {
        "missing": [],
        "corrupt": [],
        "orphans": [],
        #: the pages whose data is missing or corrupt (what a user knows them by)
        "damaged_pages": [],
        "repaired": [],
    }
    tier = eng.tier
    # Files first, then what may own them: a file written meanwhile is either not listed,
    # or its writer is still alive (uncommitted), or the index names it (committed).
    listed = builtins.list(tier.all_files())
    owned = tier.writing_files()
    with eng._cap_lock:  # deleted while a reader holds them: they go when it is done
        owned.update(
            (e[0], e[1]) for bs in eng._deferred.values() for b in bs for e in b.extents or ()
        )
    owned |= eng.index.all_extent_files()
    out["orphans"] = [tier.abspath(dev, rel) for dev, rel in listed if (dev, rel) not in owned]
    blobs = eng.index.local_blobs()
    bad: builtins.list[BlobRow] = []
    for i, b in enumerate(blobs):
        assert b.extents is not None
        if callable(progress):
            progress(i, len(blobs))  # (contents checked, contents to check)
        missing = [  # (each file once: a striped page has several extents in one file)
            path
            for path in dict.fromkeys(tier.abspath(e[0], e[1]) for e in b.extents)
            if not os.path.exists(path)
        ]
        if missing:
            out["missing"] += missing
            bad.append(b)
            continue
        if verify_data:
            buf = aligned_buffer(b.size)
            try:
                for p in tier.pieces(b.extents, 0, b.size):
                    tier.read_piece(p, buf)
                ok = tree_hash(b.size, leaves_now(buf) if b.size else leaf_hash(b"")) == b.hash
            except OSError:
                ok = False
            if not ok:
                out["corrupt"].append(b.hash.hex())
                bad.append(b)
    if callable(progress):
        progress(len(blobs), len(blobs))
    # A copy deleted (or replaced by a new put of the same bytes) while it was checked
    # looks missing or corrupt: only a copy the index still holds is damaged.
    bad = [b for b in bad if _same_copy(eng, b)]
    for b in bad:  # a put of the same bytes replaces the copy instead of sharing it
        eng.note_damaged(b)
    kept = {b.hash.hex() for b in bad}
    out["corrupt"] = [h for h in out["corrupt"] if h in kept]
    held = {tier.abspath(e[0], e[1]) for b in bad for e in b.extents or ()}
    out["missing"] = [p for p in out["missing"] if p in held]
    names = {b.hash: [p.path for p in eng.index.pages_of_blob(b.hash)] for b in bad}
    out["damaged_pages"] = sorted(p for paths in names.values() for p in paths)
    if repair:
        for path in out["orphans"]:
            try:
                os.unlink(path)
                out["repaired"].append(f"removed orphan {path}")
            except FileNotFoundError:
                pass
            except OSError as e:  # (one left does not stop the rest of the repair)
                out["repaired"].append(f"could not remove orphan {path}: {e}")
        out["unrecoverable"] = []
        for b in bad:
            # A damaged local copy of archived data comes back from the archive (or, while
            # the archive cannot be reached, is dropped: restored on access); data held
            # nowhere else cannot be served, so its pages go.
            try:
                healed = eng.policy.heal(b, "fsck")
            except (CorruptPage, PageNotFound) as e:
                # The archive's copy is missing or damaged too: held nowhere here. (It was
                # "dropped; the archive holds it", exit 0, and the next fsck was clean.)
                out["unrecoverable"] += names[b.hash]
                out["repaired"].append(
                    f"dropped the damaged local copy of {b.hash.hex()[:16]}; the archive's "
                    f"copy cannot be read either ({e}): {', '.join(names[b.hash])} cannot "
                    "be read until another host sharing the archive uploads it again"
                )
                continue
            except KvfsError as e:
                out["repaired"].append(
                    f"dropped the damaged local copy of {b.hash.hex()[:16]}; the archive "
                    f"holds it (restored on access; now: {e})"
                )
                continue
            if healed is not None:
                out["repaired"].append(
                    f"restored {b.hash.hex()[:16]} from the archive ({', '.join(names[b.hash])})"
                )
                continue
            gone = eng.index.delete_blob_pages(b.hash, keep_pinned=False, copy=b.extents)
            if gone is None:
                continue  # a new copy since (deleted and put again): it is not this one
            after_delete(eng, *gone)
            with eng._cap_lock:
                eng._evictions["fsck"] += 1
            out["repaired"].extend(
                f"deleted {p.path}: its data was damaged and held nowhere else" for p in gone[0]
            )
    if archive:  # then the archive's copies: a download of each
        base = len(blobs)

        def archive_progress(done: int, total: int) -> None:
            if callable(progress):
                progress(base + done, base + total)

        try:
            out.update(eng.policy.check_archive(repair=repair, progress=archive_progress))
        except ArchiveUnavailable as e:  # what was checked and repaired here still counts
            out["archive_error"] = [str(e)]
    return out


def _same_copy(eng: Engine, b: BlobRow) -> bool:
    cur = eng.index.blob(b.hash)
    return cur is not None and cur.extents == b.extents
