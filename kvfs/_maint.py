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
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
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
from ._local import CorruptedFile, LocalTier, placement, read_marker, unnamed_files
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
    "FSCK_FINDINGS",
    "FSCK_PROBLEMS",
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
    dropped = [b for b in freed if b.extents is not None]
    if dropped:
        with eng._cap_lock:
            eng._evictions[reason] += len(dropped)
    n = sum(b.disk_bytes for b in dropped)
    log_event(
        "evict",
        level=logging.DEBUG,  # (a pass's summary is the INFO line: make_room)
        content=blob.hash.hex()[:16],
        reason=reason,
        pages=len(gone),
        bytes=n,
        archived=False,
    )
    return n


def delete_evicted_pages(eng: Engine, pages: builtins.list[PageRow], reason: str) -> int:
    # (pins read again in the deleting transaction: one made since these were read keeps)
    gone, freed = eng.index.delete_pages((p.path for p in pages), keep_pinned=True)
    after_delete(eng, gone, freed)
    bytes_of = {b.hash: b.disk_bytes for b in freed if b.extents is not None}
    by_content = collections.Counter(p.hash for p in gone)
    if bytes_of:  # local copies dropped, as the statistic says: a content another
        # session's page still holds was counted though nothing left the disk
        with eng._cap_lock:
            eng._evictions[reason] += len(bytes_of)
    for h, n in by_content.items():  # one line per content, as a capacity eviction logs
        b = bytes_of.get(h, 0)  # 0: another session's page still holds it
        log_event(
            "evict",
            level=logging.DEBUG,
            content=h.hex()[:16],
            reason=reason,
            pages=n,
            bytes=b,
            archived=False,
        )
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
    eng._release_expired_pins()  # (before the pins are read: an ended one keeps nothing)
    if session is not None:
        d = eng.resolve_session(session)
        if eng.index.session(d) is None:
            raise SessionNotFound(f"no session {session_name(d)!r}")
        pages = eng.index.pages(session=d)
        name = d
    elif target is not None:
        name = as_key(target).path
        p = eng.index.page(name)
        if p is None:
            raise PageNotFound(f"no page {name!r}")
        pages = [p]
    else:
        raise ValueError("evict needs a page or a session")
    hashes = sorted({p.hash for p in pages})
    evictable = eng.index.evictable(hashes)
    with eng._evict_lock:
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
        t0 = time.monotonic()
        freed = eng.policy.evict_pages(mine, blobs, reason, progress)
    # one line for the call (per content: DEBUG), as a room-making pass logs
    log_event(
        "evict",
        target=name,
        reason=reason,
        bytes=freed,
        archived=not eng.policy.lossy_eviction,
        seconds=time.monotonic() - t0,
    )
    return freed


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
            hits=k.get("hits", 0),  # (see Engine.note_read)
            misses=k.get("misses", 0),
            corrupt_reads=k.get("corrupt_reads", 0),
            bytes_written=k.get("bytes_written", 0),
            bytes_read=k.get("bytes_read", 0),
            evictions=dict(eng._evictions),
            extra={**eng.policy.statistics(), **_settings(eng), **_archive_error(eng)},
            devices=tuple(_device(eng, i, free[i]) for i in range(eng.tier.n)),
        )


def _device(eng: Engine, i: int, free: int) -> DeviceStatistics:
    trouble = eng.tier.trouble(i)
    if trouble is None:
        return DeviceStatistics(i, str(eng.tier.roots[i]), eng.dev_used[i], free)
    return DeviceStatistics(
        i,
        str(eng.tier.roots[i]),
        eng.dev_used[i],
        free,
        errors=trouble.errors,
        failing=i in eng.tier.failing(),
        last_error=trouble.error,
        last_error_at=trouble.last,
    )


def _archive_error(eng: Engine) -> dict[str, object]:
    """The archive configured that the store was opened without, and why (see Engine's
    ``archive_required``): the figures are then the local tier's alone."""
    if eng.archive_error is None:
        return {}
    from ._archive import archive_identity  # (imports objectstore)

    return {
        "archive_error": {
            "url": archive_identity(eng.config.archive_url),
            "error": eng.archive_error,
        }
    }


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
            # (as given, a relative one was read from wherever the command ran)
            "index": str(cfg.index_path.absolute()),
        }
    }
    if eng.mounted is not None:
        out["mount"] = dict(eng.mounted)
    return out


# -- verification -------------------------------------------------------------------------
#: Every kind of finding :func:`fsck` returns, and what it lists (docs/cli.md's table is
#: made from this, and a test checks that fsck returns no other kind).
FSCK_FINDINGS: dict[str, str] = {
    "missing": "data files that blob rows name and that are gone",
    "corrupt": "contents (checksums) whose local copy does not match its checksum or is "
    "shorter than its extents",
    "unreadable": "data files that blob rows name and that could not be read: an I/O "
    "error (a failing device), or their device's directory is not there or not this "
    "store's (its disk not mounted). Not damage: nothing is deleted or marked, and "
    "`--repair` keeps their pages (listed under `unrecoverable`); fsck again once the "
    "device is back",
    "orphans": "data files that no index row names, no writer is writing and no reader "
    "holds (the files of content in `missing_blob_rows` found among them are not listed)",
    "missing_blob_rows": "contents that pages name and no blob row holds (a damaged index): "
    "`--repair` makes the row again from their files when they are found among the "
    "orphans and verify, else from the archive's copy, else the data is held nowhere and "
    "the pages go as damaged ones do",
    "bad_blob_rows": "contents whose blob row's size is not what its extents hold, or whose "
    "leaf digests do not give its checksum (its pages cannot be read): `--repair` takes "
    "them from the local copy, verified, or from the archive's copy",
    "wrong_refs": "contents whose blob row counts more or fewer references than the pages "
    "that name it (too few: deleting one page deleted the data of the others; too many: "
    "it was never freed): `--repair` sets the count, and deletes a row no page names, "
    "with its files",
    "wrong_page_size": "pages whose size is not their data's (`stat` and a read disagreed): "
    "`--repair` sets it",
    "damaged_pages": "the pages the findings above make unreadable, by the names a user "
    "knows them by",
    "repaired": "with `--repair`: what was done, one line each",
    "unrecoverable": "with `--repair`: damaged pages kept that still cannot be read (exit "
    "5): a pinned page whose data is held nowhere else (kept, not deleted: a put of the "
    "same bytes mends a damaged copy; unpinned, the next `--repair` deletes it), and a page "
    "whose data the archive holds no good copy of either, or cannot be asked about (another "
    "host sharing the archive may upload it again)",
    "archive_missing": "with `--check-archive`: archive objects of archived content that are gone",
    "archive_corrupt": "with `--check-archive`: archive objects that do not match their checksum",
    "archive_damaged_pages": "with `--check-archive`: the pages of those objects (with "
    "`--repair`: those whose data is not held here to upload again; exit 5)",
    "archive_repaired": "with `--check-archive --repair`: the objects uploaded again from a "
    "verified local copy",
    "archive_error": "with `--check-archive`: the archive could not be reached, or none is "
    "configured (exit 8, after the local check and repair, which stand). Offline (no "
    "daemon), also without it: the archive configured could not be opened, and the local "
    "check ran without it (exit 8 after it; `--repair` is refused then, and changes nothing)",
}
#: The problems the local check finds (the archive's are added by --check-archive).
_LOCAL_PROBLEMS = (
    "missing",
    "corrupt",
    "unreadable",
    "orphans",
    "missing_blob_rows",
    "bad_blob_rows",
    "wrong_refs",
    "wrong_page_size",
)
#: The findings that are problems: exit 5 until ``--repair`` mends them.
FSCK_PROBLEMS = (*_LOCAL_PROBLEMS, "archive_missing", "archive_corrupt")

_LOST = "no blob row held its data, and no copy of it was found"
_DAMAGED = "its data was damaged and held nowhere else"


def fsck(
    eng: Engine, *, repair: bool, verify_data: bool, progress: object, archive: bool = False
) -> dict[str, builtins.list[str]]:
    out: dict[str, builtins.list[str]] = {
        k: [] for k in (*_LOCAL_PROBLEMS, "damaged_pages", "repaired")
    }
    tier = eng.tier
    # Files first, then what may own them: a file written meanwhile is either not listed,
    # or its writer is still alive (uncommitted), or the index names it (committed). One
    # the index dropped meanwhile is being removed, then deferred while a reader holds it
    # (where it goes before it leaves the files being removed): asked in that order.
    # A device that cannot be read, or is not mounted (its marker gone with its disk), has
    # not lost its files: they are unreadable, never missing or corrupt, so a repair does
    # not delete pages whose data comes back with the device.
    down = _devices_down(eng)

    def owners() -> Iterator[tuple[int, str]]:  # (called once the listing is done)
        yield from tier.writing_files()
        yield from eng.index.local_extent_files()
        yield from eng.index.dropping_files()
        with eng._cap_lock:  # deleted while a reader holds them: they go when it is done
            deferred = [
                (e[0], e[1]) for bs in eng._deferred.values() for b in bs for e in b.extents or ()
            ]
        yield from deferred

    # (and still there: a writer whose put found its data stored already removed its files
    # and was gone from the writers by the time they were read, after the listing)
    orphans = [
        (dev, rel)
        for dev, rel in unnamed_files(lambda: tier.all_files(skip=down), owners)
        if os.path.lexists(tier.abspath(dev, rel))
    ]
    # The rows are read as they are checked, not all at once (a store of millions of
    # pages): counted first for the progress, which rows committed meanwhile may outgrow
    total = eng.index.local_blob_count()
    checked = 0
    bad: builtins.list[BlobRow] = []
    cut_off: builtins.list[BlobRow] = []  # unreadable now: their pages are kept
    #: blob rows whose size or digests are wrong while their local copy verifies, with
    #: the size and digests it verified with
    fixable: dict[bytes, tuple[BlobRow, int, bytes]] = {}
    for b in eng.index.local_blobs():
        assert b.extents is not None
        if callable(progress):  # (contents checked, contents to check)
            progress(checked, max(total, checked + 1))
        checked += 1
        missing: builtins.list[str] = []
        unreadable: builtins.list[str] = []
        short = False
        # (each file once: a striped page has several extents in one file), with the end
        # of its last extent: a file shorter than that is damaged, seen without a read (the
        # check without verify_data took a file cut to its header for a whole one)
        ends: dict[tuple[int, str], int] = {}
        for dev, rel, off, n in b.extents:
            ends[(dev, rel)] = max(ends.get((dev, rel), 0), off + n)
        for (dev, rel), end in ends.items():
            path = tier.abspath(dev, rel)
            try:
                if dev in down:
                    raise OSError(f"device {tier.roots[dev]} cannot be read")
                st = os.stat(path)
                # (what is no regular file there fails its read: unreadable, not short)
                short = short or (stat.S_ISREG(st.st_mode) and st.st_size < end)
            except FileNotFoundError:
                missing.append(path)
            except OSError:
                unreadable.append(path)
        if unreadable:
            out["unreadable"] += unreadable
            cut_off.append(b)
            continue
        if missing:
            out["missing"] += missing
            bad.append(b)
            continue
        if short:
            out["corrupt"].append(b.hash.hex())
            bad.append(b)
            continue
        # The row against itself (no I/O): its extents hold its size, its digests give its
        # checksum. Either wrong, every read of its pages fails.
        held = sum(e[3] for e in b.extents)
        row_ok = held == b.size and _row_verifies(b)
        if verify_data or not row_ok:
            try:
                leaves = _read_leaves(tier, b.extents, held)
            except OSError as e:
                out["unreadable"].append(e.filename)
                cut_off.append(b)
                continue
            if leaves is None or tree_hash(held, leaves) != b.hash:
                out["corrupt"].append(b.hash.hex())
                bad.append(b)
            elif not row_ok:
                fixable[b.hash] = (b, held, leaves)
    if callable(progress):
        progress(checked, checked)
    # A copy deleted (or replaced by a new put of the same bytes) while it was checked
    # looks missing or corrupt: only a copy the index still holds is damaged.
    bad = [b for b in bad if _same_copy(eng, b)]
    fixable = {h: x for h, x in fixable.items() if _same_copy(eng, x[0])}
    for b in bad:  # a put of the same bytes replaces the copy instead of sharing it
        eng.note_damaged(b)
    kept = {b.hash.hex() for b in bad}
    out["corrupt"] = [h for h in out["corrupt"] if h in kept]
    held_files = {tier.abspath(e[0], e[1]) for b in bad for e in b.extents or ()}
    out["missing"] = [p for p in out["missing"] if p in held_files]
    cut_off = [b for b in cut_off if _same_copy(eng, b)]
    cut_files = {tier.abspath(e[0], e[1]) for b in cut_off for e in b.extents or ()}
    out["unreadable"] = [p for p in out["unreadable"] if p in cut_files]
    # The rows against each other: data held by the archive alone (its row against itself),
    # pages whose blob row is gone (their data looked for among the orphans), reference
    # counts, and the size of each page against its data's.
    archive_rows = [b for b in eng.index.blobs_not_local() if not _row_verifies(b)]
    lost = eng.index.pages_without_blob()
    found = _find_lost_data(tier, lost, orphans) if lost and orphans else {}
    theirs = {(e[0], e[1]) for x in found.values() for e in x[0]}
    out["orphans"] = [tier.abspath(dev, rel) for dev, rel in orphans if (dev, rel) not in theirs]
    out["missing_blob_rows"] = sorted(h.hex() for h in lost)
    out["bad_blob_rows"] = sorted(
        [*(h.hex() for h in fixable), *(b.hash.hex() for b in archive_rows)]
    )
    out["wrong_refs"] = [h.hex() for h, _, _ in eng.index.wrong_refs()]
    shaky = set(fixable) | {b.hash for b in archive_rows}  # (their rows' sizes are wrong)
    sizes = {p.path for p, _ in eng.index.wrong_page_sizes() if p.hash not in shaky}
    for h, (_, size, _) in fixable.items():
        sizes.update(p.path for p in eng.index.pages_of_blob(h) if p.size != size)
    out["wrong_page_size"] = sorted(sizes)
    names = {b.hash: [p.path for p in eng.index.pages_of_blob(b.hash)] for b in bad}
    unreachable = sorted({p.path for b in cut_off for p in eng.index.pages_of_blob(b.hash)})
    for h in shaky:
        names[h] = [p.path for p in eng.index.pages_of_blob(h)]
    for h, pages in lost.items():
        names[h] = [p.path for p in pages]
    out["damaged_pages"] = sorted({*unreachable, *(p for paths in names.values() for p in paths)})
    if repair:
        _repair(eng, out, bad, fixable, archive_rows, lost, found, names)
        for path in unreachable:
            out["unrecoverable"].append(path)
            out["repaired"].append(
                f"kept {path}: its data could not be read (see unreadable); nothing was "
                "changed, fsck again once its device is back"
            )
    if eng.archive_error is not None:  # the archive configured could not be opened
        out["archive_error"] = [eng.archive_error]
    elif archive:  # then the archive's copies: a download of each
        base = checked

        def archive_progress(done: int, total: int) -> None:
            if callable(progress):
                progress(base + done, base + total)

        try:
            out.update(eng.policy.check_archive(repair=repair, progress=archive_progress))
        except ArchiveUnavailable as e:  # what was checked and repaired here still counts
            out["archive_error"] = [str(e)]
    return out


def _repair(
    eng: Engine,
    out: dict[str, builtins.list[str]],
    bad: builtins.list[BlobRow],
    fixable: dict[bytes, tuple[BlobRow, int, bytes]],
    archive_rows: builtins.list[BlobRow],
    lost: dict[bytes, builtins.list[PageRow]],
    found: dict[bytes, tuple[tuple, int, bytes, int]],
    names: dict[bytes, builtins.list[str]],
) -> None:
    """What ``fsck(repair=True)`` does about its findings (see :data:`FSCK_FINDINGS`)."""
    out["unrecoverable"] = []
    said = out["repaired"]
    mended: set[bytes] = set()  # rows made or set from verified data: their pages' sizes too
    # The blob rows of lost data whose files were found: before the orphans go, though
    # those files are not listed among them
    for h, (extents, size, leaves, disk) in found.items():
        row = eng.index.add_lost_blob(h, size, leaves, extents, disk, archived=False)
        if row is None:
            continue  # a put of those bytes made one meanwhile, or the pages went
        with eng._cap_lock:
            eng._account(row, +1)
        mended.add(h)
        said.append(
            f"made the blob row of {h.hex()[:16]} again from its files ({', '.join(names[h])})"
        )
    for path in out["orphans"]:
        try:
            os.unlink(path)
            said.append(f"removed orphan {path}")
        except FileNotFoundError:
            pass
        except OSError as e:  # (one left does not stop the rest of the repair)
            said.append(f"could not remove orphan {path}: {e}")
    for hx in out["wrong_refs"]:  # (counted again in the transaction that sets them)
        r = eng.index.fix_refs(bytes.fromhex(hx))
        if r is None:
            continue
        was, now, freed = r
        if freed is not None:
            after_delete(eng, [], [freed])
            said.append(f"deleted the blob row of {hx[:16]} and its files: no page names it")
        elif was != now:
            said.append(f"set the reference count of {hx[:16]} to {now} (it counted {was})")
    for h, (b, size, leaves) in fixable.items():
        if eng.index.fix_blob_row(h, b.extents, size, leaves):
            mended.add(h)
            said.append(
                f"set the size and leaf digests of {h.hex()[:16]} from its verified local copy"
                + (f" ({size} bytes; its row said {b.size})" if size != b.size else "")
            )
    for b in bad:
        # A damaged local copy of archived data comes back from the archive (or, while
        # the archive cannot be reached, is dropped: restored on access); data held
        # nowhere else cannot be served, so its pages go (a pinned one stays: unrecoverable).
        try:
            healed = eng.policy.heal(b, "fsck")
        except (CorruptPage, PageNotFound) as e:
            # The archive's copy is missing or damaged too: held nowhere here. (It was
            # "dropped; the archive holds it", exit 0, and the next fsck was clean.)
            out["unrecoverable"] += names[b.hash]
            said.append(
                f"dropped the damaged local copy of {b.hash.hex()[:16]}; the archive's "
                f"copy cannot be read either ({e}): {', '.join(names[b.hash])} cannot "
                "be read until another host sharing the archive uploads it again"
            )
            continue
        except KvfsError as e:
            said.append(
                f"dropped the damaged local copy of {b.hash.hex()[:16]}; the archive "
                f"holds it (restored on access; now: {e})"
            )
            continue
        if healed is not None:
            said.append(
                f"restored {b.hash.hex()[:16]} from the archive ({', '.join(names[b.hash])})"
            )
            continue
        _delete_damaged(eng, out, b.hash, b.extents, _DAMAGED)
    # Rows of archive-only data, and lost rows whose files were not found: the archive's
    # copy says what they hold, if it has one that verifies
    for b in archive_rows:
        h = b.hash
        try:
            got = eng.policy.find_archived(h)
            why = "the archive holds no copy of it that verifies"
        except KvfsError as e:
            got, why = None, f"the archive could not be asked ({e})"
        if got is not None:
            if eng.index.fix_blob_row(h, None, *got):  # (else: restored or deleted since)
                mended.add(h)
                said.append(
                    f"set the size and leaf digests of {h.hex()[:16]} from the archive's copy"
                )
            continue
        out["unrecoverable"] += names[h]
        said.append(
            f"kept {', '.join(names[h])}: the blob row of their data {h.hex()[:16]} is "
            f"damaged, and {why}"
        )
    for h in lost:
        if h in found:
            continue
        try:
            got = eng.policy.find_archived(h)
        except KvfsError as e:
            out["unrecoverable"] += names[h]
            said.append(
                f"kept {', '.join(names[h])}: no blob row holds their data {h.hex()[:16]}, "
                f"and the archive could not be asked ({e})"
            )
            continue
        if got is None:
            _delete_damaged(eng, out, h, None, _LOST)
            continue
        row = eng.index.add_lost_blob(h, got[0], got[1], None, 0, archived=True)
        if row is not None:
            mended.add(h)
            said.append(
                f"made the blob row of {h.hex()[:16]} again from the archive's copy "
                f"(restored on access): {', '.join(names[h])}"
            )
    # Last, the sizes of pages, from their data's row (one found wrong, or just mended)
    reported = set(out["wrong_page_size"])
    for p, _ in eng.index.wrong_page_sizes():
        if p.path in reported or p.hash in mended:
            fixed = eng.index.fix_page_size(p.path, p.hash)
            if fixed is not None:
                said.append(
                    f"set the size of {p.path} to {fixed} bytes, its data's (it said {p.size})"
                )


def _delete_damaged(
    eng: Engine, out: dict[str, builtins.list[str]], h: bytes, copy: object, why: str
) -> None:
    """Delete the pages of content ``h``, held nowhere else; a pinned page is kept, and
    listed as unrecoverable: a pin must not vanish in a repair. Only while the blob's
    copy is still ``copy`` (None: while no blob row holds ``h``)."""
    deleted = eng.index.delete_unpinned_pages(h, copy)
    if deleted is None:
        return  # a new copy since (deleted and put again): it is not this one
    gone, freed, kept = deleted
    if gone:
        after_delete(eng, gone, freed)
        with eng._cap_lock:
            eng._evictions["fsck"] += 1
        out["repaired"].extend(f"deleted {p.path}: {why}" for p in gone)
    mend = "a put of the same bytes mends it; " if copy is not None else ""
    for p in kept:
        out["unrecoverable"].append(p.path)
        out["repaired"].append(
            f"kept {p.path}, pinned: {why}; it cannot be read ({mend}unpinned, it and its "
            "session, the next fsck --repair deletes it)"
        )


def _row_verifies(b: BlobRow) -> bool:
    """Whether a blob row's size and leaf digests give its checksum."""
    try:
        return tree_hash(b.size, b.leaves) == b.hash
    except ValueError:  # not as many digests as its size has leaves
        return False


def _devices_down(eng: Engine) -> set[int]:
    """The devices whose marker cannot be read or does not say they are this store's:
    failing, or not mounted (the directory under the mount point is there, empty)."""
    down = set()
    for dev, root in enumerate(eng.tier.roots):
        try:
            info = read_marker(root)
        except (OSError, KvfsError):  # (KvfsError: what it holds is no marker)
            info = None
        if info is None or info.get("store") != eng.store_id or info.get("index") != dev:
            down.add(dev)
    return down


def _read_leaves(tier: LocalTier, extents: tuple, size: int) -> bytes | None:
    """The leaf digests of the ``size`` bytes ``extents`` hold; None when a file is gone or
    shorter than its extents. Raises OSError for an I/O error (a failing device: the data
    may come back with it), naming the file in its ``filename``."""
    buf = aligned_buffer(size)
    for p in tier.pieces(extents, 0, size):
        try:
            tier.read_piece(p, buf)
        except (FileNotFoundError, CorruptedFile):
            return None
        except OSError as e:
            # A read's own error (a bad sector's EIO from preadv) names no file, and fsck
            # lists the unreadable files by name: without it the file was left out of
            # ``unreadable`` (exit 0, with its pages among the damaged ones)
            if e.filename is None:
                e.filename = tier.abspath(p.dev, p.file)
            raise
    return leaves_now(buf) if size else leaf_hash(b"")


def lost_data_files(
    tier: LocalTier,
    lost: dict[bytes, builtins.list[PageRow]],
    orphans: builtins.list[tuple[int, str]],
) -> set[tuple[int, str]]:
    """Of ``orphans`` (the files no row names), those that hold, verified, the data of the
    ``lost`` pages, whose blob row is gone (a damaged index): what the sweep of an unclean
    open keeps for fsck --repair, which makes those rows again from them. The other
    leftovers it removes, as ever: kept too, every crash while a pinned page held nowhere
    else is kept added uncounted files."""
    if not orphans:
        return set()
    found = _find_lost_data(tier, lost, orphans)
    return {(e[0], e[1]) for extents, *_ in found.values() for e in extents}


def _find_lost_data(
    tier: LocalTier,
    lost: dict[bytes, builtins.list[PageRow]],
    orphans: builtins.list[tuple[int, str]],
) -> dict[bytes, tuple[tuple, int, bytes, int]]:
    """The data of contents that pages name and no blob row holds, looked for among the
    orphaned files: the files one writer made (one name, on each device it used), laid out
    as their header says, for each size those pages give, verified against the checksum.
    By content: (extents, size, leaf digests, bytes on disk)."""
    sizes = sorted({p.size for pages in lost.values() for p in pages})
    groups: dict[str, dict[int, str]] = {}
    for dev, rel in orphans:
        groups.setdefault(rel, {})[dev] = tier.abspath(dev, rel)
    found: dict[bytes, tuple[tuple, int, bytes, int]] = {}
    for rel, files in groups.items():
        hdr = tier.read_header(min(files), rel)
        try:
            assert hdr is not None
            start, ndev, unit = int(hdr["start"]), int(hdr["ndev"]), int(hdr["unit"])
            on_disk = {dev: os.stat(path).st_size for dev, path in files.items()}
        except (AssertionError, KeyError, TypeError, ValueError, OSError):
            continue  # no kvfs data file, or gone meanwhile
        if not (0 < ndev <= tier.n and unit > 0 and 0 <= start < ndev):
            continue
        for size in sizes:
            extents, want = placement(rel, start, size, unit, ndev)
            if want != on_disk:  # (a writer pads each file to exactly this)
                continue
            try:
                leaves = _read_leaves(tier, extents, size)
            except OSError:
                continue  # (unreadable now: the next fsck looks again)
            h = tree_hash(size, leaves) if leaves is not None else b""
            if h in lost and h not in found:
                assert leaves is not None
                found[h] = (extents, size, leaves, sum(want.values()))
                break
    return found


def _same_copy(eng: Engine, b: BlobRow) -> bool:
    cur = eng.index.blob(b.hash)
    return cur is not None and cur.extents == b.extents
