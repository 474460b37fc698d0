"""Archive layout and the index bookkeeping of the archive tier.

Bucket (or directory) layout under the configured prefix::

    blobs/<checksum hex>                 one object per distinct page content (see _codec)
    manifests/<quoted session dir>@<store id>  msgpack: the session and every archived page
                                         of it, as that host holds it (one per host); a
                                         long name is cut and hashed (session_key_part)
    gc/<store id>-<time>-<random>[.done] collection intents of hosts deleting objects
                                         (kvfs/_collect.py)
    hosts/<store id>                     a host's heartbeat: its retention (kvfs/_hosts.py)
    retired/<store id>                   that host was retired by another, and something of
                                         it stays (its pinned sessions' manifests, tombstones
                                         still superseding a manifest: kvfs/_hosts.py)

A manifest lists only pages whose content is in ``blobs/``; it is written after those
objects are confirmed, in one PUT, so a reader sees the previous manifest or the new one.
Its fields: ``v``, ``session`` (directory), ``name``, ``created``, ``atime``, ``pinned``,
``attrs``, ``store_id`` and ``spilled_at`` of the host that wrote it, ``supersedes`` (the
other hosts' manifest versions it imported: ``{store id: spilled_at}``) and ``pages``: a list
of ``{path, size, hash, leaves, codec, created, pinned, attrs}``. The session and each page
also have ``pin_until`` where their pin has an end (a time.time() of the writer's); without
it a pin is for good, as in manifests written before pins had ends. Readers ignore fields
they do not know, so a kvfs older than ``pin_until`` reads such a manifest and takes its
pins for good. A session's view is :func:`merge_manifests` of its hosts' manifests.

The index keeps a small queue table, ``archive_pending``, of manifests to rewrite and blob
objects to delete, so work that the archive could not take (endpoint down) or that a crash
interrupted is done later, not forgotten.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Callable, Collection, Mapping
from urllib.parse import quote, unquote

import msgpack

from ._checksum import tree_hash
from ._index import _BLOB_COLS, BlobRow, Index, PageRow, _blob, _pack
from ._keys import as_key, session_name

__all__ = [
    "ArchiveIndex",
    "blob_key",
    "build_manifest",
    "manifest_key",
    "pack_manifest",
    "parse_manifest",
]

MANIFESTS = "manifests/"
BLOBS = "blobs/"
VERSION = 1

#: how many pinned pages, or pages of pinned sessions, hold blob ? (pins of session ? aside)
_PINNED_HOLDERS = (
    "SELECT COUNT(*) FROM pages p LEFT JOIN sessions s ON s.dir=p.session"
    " WHERE p.hash=? AND (p.pinned=1 OR s.pinned=1) AND p.session IS NOT ?"
)


def blob_key(h: bytes) -> str:
    return BLOBS + h.hex()


#: the longest quoted session kept whole in a manifest key; a longer one is cut and
#: completed by a hash, so that the key stays one file name of a ``file://`` archive
#: (255 bytes) with ``@`` and a store id
NAME_IN_KEY_MAX = 160


def session_key_part(session_dir: str) -> str:
    """The session as it appears in its manifests' keys: quoted (``@`` and ``+`` never occur
    in it), or, past NAME_IN_KEY_MAX, its first 100 quoted characters, ``+`` and a SHA-256
    of the name (the manifest holds the name itself)."""
    q = quote(session_dir, safe="")
    if len(q) <= NAME_IN_KEY_MAX:
        return q
    digest = hashlib.sha256(session_dir.encode("utf-8", "surrogateescape")).hexdigest()
    return q[:100] + "+" + digest[:40]


def manifest_key(session_dir: str, store_id: str) -> str:
    """This host's manifest of a session: every host sharing the archive writes its own.
    (Not a sub-directory, so that a file archive can hold it beside a manifest of the
    older layout.)"""
    return MANIFESTS + session_key_part(session_dir) + "@" + store_id


def manifest_prefixes(session_dir: str) -> list[str]:
    """Listing prefixes that find every manifest of a session: its own, and for a long name
    the keys kvfs wrote before names were cut (S3 only: they could not be files)."""
    own = MANIFESTS + session_key_part(session_dir)
    legacy = legacy_manifest_key(session_dir)
    if legacy == own or len(legacy.encode()) > 900:
        return [own]
    return [own, legacy]


def legacy_manifest_key(session_dir: str) -> str:
    """Where kvfs before the eighth session kept a session's one manifest (still read)."""
    return MANIFESTS + quote(session_dir, safe="")


def is_session_manifest(key: str, session_dir: str) -> bool:
    legacy = legacy_manifest_key(session_dir)
    own = MANIFESTS + session_key_part(session_dir)
    return key == legacy or key.startswith((legacy + "@", own + "@"))


def session_of_manifest_key(key: str) -> str:
    return unquote(key[len(MANIFESTS) :].split("@", 1)[0])


def merge_manifests(ms: list[dict]) -> dict:
    """One view of a session from the manifests of the hosts that hold it: the union of
    their pages (for a path several name, the page created last), leaving out a manifest
    that another one supersedes (its writer imported that version and wrote its own since,
    so what that one lacks was deleted there, not added elsewhere). Session metadata comes
    from the newest manifest."""
    live = [
        m
        for m in ms
        if not any(
            o is not m and o.get("supersedes", {}).get(m["store_id"], -1.0) >= m["spilled_at"]
            for o in ms
        )
    ] or ms
    live.sort(key=lambda m: m["spilled_at"])
    pages: dict[str, dict] = {}
    for m in live:
        for p in m["pages"]:
            q = pages.get(p["path"])
            if q is None or p.get("created", 0.0) >= q.get("created", 0.0):
                pages[p["path"]] = p
    out = dict(live[-1])
    out["pages"] = [pages[k] for k in sorted(pages)]
    out["versions"] = {m["store_id"]: m["spilled_at"] for m in ms}
    return out


def pack_manifest(m: dict) -> bytes:
    """The manifest's object: msgpack, ending in ``digest``, the SHA-256 of the msgpack of
    every field before it (msgpack has no checksum of its own: a flipped byte in a page's
    path or time would still decode, and be trusted)."""
    body = {k: v for k, v in m.items() if k != "digest"}
    digest = hashlib.sha256(msgpack.packb(body, use_bin_type=True)).digest()
    return msgpack.packb({**body, "digest": digest}, use_bin_type=True)  # type: ignore[no-any-return]


def parse_manifest(data: bytes) -> dict:
    """Raises ValueError on anything that is not a manifest this kvfs reads, or one whose
    bytes changed since it was written."""
    try:
        m = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise ValueError(f"not a manifest: {e}") from e
    v = m.get("v") if isinstance(m, dict) else None
    if isinstance(v, int) and not isinstance(v, bool) and v > VERSION:
        # (said apart from damage: a host sharing the bucket runs a newer kvfs, and this one
        # must be upgraded to read that host's sessions)
        raise ValueError(
            f"a version-{v} manifest, written by a newer kvfs: this one reads version "
            f"{VERSION} (upgrade it)"
        )
    if not isinstance(m, dict) or v != VERSION or not isinstance(m.get("pages"), list):
        raise ValueError(f"not a version-{VERSION} kvfs manifest")
    if "digest" in m:
        digest = m.pop("digest")
        if digest != hashlib.sha256(msgpack.packb(m, use_bin_type=True)).digest():
            raise ValueError("manifest damaged: its digest does not match its bytes")
    elif set(m) - _LEGACY_FIELDS:
        # kvfs before the digest wrote only these: another name is one damaged (the
        # digest's own, perhaps), not a manifest to trust unchecked
        raise ValueError(
            f"manifest damaged: no digest, and fields {sorted(set(m) - _LEGACY_FIELDS)}"
        )
    _check_fields(m, _MANIFEST_FIELDS, "manifest")
    _check_pin_until(m, "manifest")
    if not all(isinstance(v, (int, float)) for v in m.get("supersedes", {}).values()):
        raise ValueError("manifest field 'supersedes' is not {store id: time}")
    d = m["session"]
    for p in m["pages"]:
        if not isinstance(p, dict):
            raise ValueError("a manifest page is not a record")
        _check_fields(p, _PAGE_FIELDS, "manifest page")
        _check_pin_until(p, "manifest page")
        try:
            key = as_key(p["path"])
        except ValueError as e:
            raise ValueError(f"manifest page {p['path']!r}: {e}") from None
        if key.session_dir != d:
            raise ValueError(f"manifest of {d!r} names page {p['path']!r} of another session")
        # Its checksum is the tree hash of its size and leaves: a manifest whose bytes
        # changed (msgpack has no checksum of its own) is refused, never trusted.
        try:
            ok = tree_hash(p["size"], bytes(p["leaves"])) == bytes(p["hash"])
        except ValueError:
            ok = False
        if p["size"] < 0 or not ok:
            raise ValueError(f"manifest page {p['path']!r}: size, leaves and checksum disagree")
    return m


#: what a manifest and each of its pages must hold, and of which type (see the module doc)
_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "session": str,
    "name": str,
    "created": (int, float),
    "atime": (int, float),
    "pinned": bool,
    "attrs": dict,
    "store_id": str,
    "spilled_at": (int, float),
}
#: every field a manifest written before the digest may hold
_LEGACY_FIELDS = {"v", *_MANIFEST_FIELDS, "supersedes", "pages"}
_PAGE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "path": str,
    "size": int,
    "hash": bytes,
    "leaves": bytes,
}


def _check_fields(r: dict, fields: Mapping[str, type | tuple[type, ...]], what: str) -> None:
    for name, kind in fields.items():
        if not isinstance(r.get(name), kind) or (kind is int and isinstance(r[name], bool)):
            raise ValueError(f"{what} field {name!r} is missing or not a {_kind_name(kind)}")
    if "supersedes" in r and not isinstance(r["supersedes"], dict):
        raise ValueError(f"{what} field 'supersedes' is not a map")


def _check_pin_until(r: dict, what: str) -> None:
    """``pin_until`` is optional (kvfs before pins had ends wrote none), but a time."""
    until = r.get("pin_until")
    if "pin_until" in r and (not isinstance(until, (int, float)) or isinstance(until, bool)):
        raise ValueError(f"{what} field 'pin_until' is not a time")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "number" if isinstance(kind, tuple) else kind.__name__


_PENDING_TABLE = (
    "CREATE TABLE IF NOT EXISTS archive_pending ("
    " kind TEXT NOT NULL, k TEXT NOT NULL, since REAL NOT NULL, PRIMARY KEY (kind, k))"
)


def enqueue_in(db: sqlite3.Connection, kind: str, keys: list[str]) -> None:
    """Queue archive work (``manifest``: rewrite a session's; ``forget``: delete an object
    once no manifest names it) inside the caller's index transaction."""
    if keys:
        db.execute(_PENDING_TABLE)  # (a store opened without its archive may lack it)
        # The latest request's time: a manifest written from an index read before it
        # does not settle it (see done).
        db.executemany(
            "INSERT INTO archive_pending VALUES (?,?,?)"
            " ON CONFLICT (kind, k) DO UPDATE SET since=excluded.since",
            [(kind, k, time.time()) for k in keys],
        )


def forget_imports_in(db: sqlite3.Connection, session: str) -> None:
    """Forget, inside the caller's index transaction, which other hosts' manifest versions
    of ``session`` this index imported: this host's manifest of it no longer supersedes
    them (nor, without pages, stays as a tombstone: build_manifest)."""
    db.execute("DELETE FROM archive_imported WHERE session=?", (session,))


class ArchiveIndex:
    """The archive tier's SQL on the store's index (same database, its own small table)."""

    def __init__(self, index: Index) -> None:
        self.index = index
        with index.transaction() as db:
            db.execute(_PENDING_TABLE)
            # Per session: the other hosts' manifest versions this index imported; this
            # host's own manifest supersedes them (see merge_manifests).
            db.execute(
                "CREATE TABLE IF NOT EXISTS archive_imported ("
                " session TEXT NOT NULL, store_id TEXT NOT NULL, spilled_at REAL NOT NULL,"
                " PRIMARY KEY (session, store_id))"
            )

    def imported(self, session: str) -> dict[str, float]:
        rows = self.index._q(
            "SELECT store_id, spilled_at FROM archive_imported WHERE session=?", (session,)
        )
        return {r[0]: r[1] for r in rows}

    def tombstones(self) -> list[str]:
        """The sessions whose manifest here holds no pages but stays, superseding other
        hosts' versions (build_manifest): those imported, none of whose pages is archived
        here (any more)."""
        return [
            r[0]
            for r in self.index._q(
                "SELECT DISTINCT i.session FROM archive_imported i WHERE NOT EXISTS ("
                " SELECT 1 FROM pages p JOIN blobs b ON b.hash=p.hash"
                " WHERE p.session=i.session AND b.archived)"
            )
        ]

    # -- pending work -------------------------------------------------------------------
    def enqueue(self, kind: str, keys: list[str]) -> None:
        if keys:
            with self.index.transaction() as db:
                enqueue_in(db, kind, keys)

    def pending(self, kind: str, older_than: float = 0.0) -> list[str]:
        cutoff = time.time() - older_than
        return [
            r[0]
            for r in self.index._q(
                "SELECT k FROM archive_pending WHERE kind=? AND since<=? ORDER BY since",
                (kind, cutoff),
            )
        ]

    def pending_chunk(self, kind: str, cutoff: float, after: str, limit: int) -> list[str]:
        """Up to ``limit`` of the keys queued (last asked for) at ``time.time()`` ``cutoff``
        or before, in key order, those after ``after``: a queue read a chunk at a time, each
        a short read by the primary key's index (it may hold an entry for every page)."""
        return [
            r[0]
            for r in self.index._q(
                "SELECT k FROM archive_pending WHERE kind=? AND k>? AND since<=?"
                " ORDER BY k LIMIT ?",
                (kind, after, cutoff, limit),
            )
        ]

    def pending_count(self, kind: str) -> int:
        """How many keys :meth:`pending` would list (the queue may hold an entry for every
        page of the store: counted, not listed)."""
        return int(
            self.index._q("SELECT COUNT(*) FROM archive_pending WHERE kind=?", (kind,))[0][0]
        )

    def has_pending(self, kind: str, older_than: float = 0.0) -> bool:
        """Whether :meth:`pending` would list any key (without listing them)."""
        cutoff = time.time() - older_than
        return bool(
            self.index._q(
                "SELECT 1 FROM archive_pending WHERE kind=? AND since<=? LIMIT 1", (kind, cutoff)
            )
        )

    def done(self, kind: str, keys: list[str], asked_before: float = float("inf")) -> None:
        """Settle queued work; with ``asked_before``, only requests older than it (a
        manifest built from the index at that time does not reflect a removal made after)."""
        # Usually nothing is queued (a plain spill): a read, not a write transaction whose
        # fsync would hold the index lock that foreground reads need.
        sql = "FROM archive_pending WHERE kind=? AND k=? AND since<?"
        keys = [k for k in keys if self.index._q("SELECT 1 " + sql, (kind, k, asked_before))]
        if keys:
            with self.index.transaction() as db:
                db.executemany("DELETE " + sql, [(kind, k, asked_before) for k in keys])

    # -- blob state ---------------------------------------------------------------------
    def mark_archived(self, hashes: list[bytes]) -> list[bytes]:
        """Record that the archive holds these blobs' objects. Returns those with no blob
        row here any more (deleted while they uploaded): their objects are queued to be
        forgotten, in the same transaction, or nothing would ever delete them."""
        gone = []
        with self.index.transaction() as db:
            for h in hashes:
                if db.execute("UPDATE blobs SET archived=1 WHERE hash=?", (h,)).rowcount == 0:
                    gone.append(h)
            db.executemany(
                "INSERT INTO archive_pending VALUES ('forget', ?, ?)"
                " ON CONFLICT (kind, k) DO UPDATE SET since=excluded.since",
                [(h.hex(), time.time()) for h in gone],
            )
        return gone

    def drop_local_many(
        self,
        hashes: list[bytes],
        named: Mapping[str, Collection[tuple[str, bytes]]],
        asked: str | None = None,
    ) -> list[BlobRow]:
        """Forget the local copies of archived blobs, in one transaction (the same update as
        ``Index.drop_local``). Returns the rows as they were, for those that were local.

        A copy goes only where every page holding the blob is in ``named`` (session ->
        the pages, as (path, blob), this host's manifest of it names), checked inside the
        transaction: a page only the archive holds must be named by its session's manifest
        (other hosts delete any object no manifest names, and a host rebuilt from the
        archive knows only what manifests list). A put that shared the content into another
        page (of any session) after those manifests were written keeps it local, and so
        does a pin that landed since the caller chose its blobs (see :meth:`droppable`:
        pins of session ``asked`` do not count), and a blob no longer marked archived."""
        out: list[BlobRow] = []
        if not hashes:
            return out
        with self.index.transaction() as db:
            for h in hashes:
                r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
                # (not archived: a page deleted and put again with the same bytes since the
                # caller chose it is a new row the archive does not hold yet, though
                # ``named`` still names the old page under its path)
                if r is None or r[4] is None or not r[6]:
                    continue
                holders = db.execute("SELECT session, path FROM pages WHERE hash=?", (h,))
                if any((path, h) not in named.get(s, ()) for s, path in holders):
                    continue
                if db.execute(_PINNED_HOLDERS, (h, asked)).fetchone()[0]:
                    continue
                # (marked inside the transaction, as Index.drop_local does: a concurrent
                # fsck takes files that no row names and nothing marks for orphans)
                self.index.dropping(_blob(r))
                db.execute("UPDATE blobs SET extents=NULL, disk_bytes=0 WHERE hash=?", (h,))
                out.append(_blob(r))
        return out

    def adopt_local(self, h: bytes, extents: tuple, disk_bytes: int) -> BlobRow | None:
        """Record restored files as the local copy of an archive-only blob; None when the
        blob is gone or already local again (the caller removes its files)."""
        return self.adopt_local_many([(h, extents, disk_bytes)])[0]

    def adopt_local_many(self, items: list[tuple[bytes, tuple, int]]) -> list[BlobRow | None]:
        """:meth:`adopt_local` for several blobs in one transaction (one fsync)."""
        out: list[BlobRow | None] = []
        with self.index.transaction() as db:
            for h, extents, disk_bytes in items:
                n = db.execute(
                    "UPDATE blobs SET extents=?, disk_bytes=? WHERE hash=? AND extents IS NULL",
                    (_pack([list(e) for e in extents]), disk_bytes, h),
                ).rowcount
                if n == 0:
                    out.append(None)
                    continue
                r = db.execute(f"SELECT {_BLOB_COLS} FROM blobs WHERE hash=?", (h,)).fetchone()
                out.append(_blob(r))
        return out

    def droppable(self, h: bytes, session: str | None) -> bool:
        """No pinned page or pinned session holds ``h``, other than ``session`` (asked for)."""
        return self.index._q(_PINNED_HOLDERS, (h, session))[0][0] == 0

    def pages_holding(self, h: bytes) -> list[tuple[str, str]]:
        """(session, path) of every page holding blob ``h``."""
        return [
            (r[0], r[1])
            for r in self.index._q("SELECT session, path FROM pages WHERE hash=?", (h,))
        ]

    def sessions_of_blob(self, h: bytes) -> list[str]:
        return [
            r[0] for r in self.index._q("SELECT DISTINCT session FROM pages WHERE hash=?", (h,))
        ]

    def all_archived(self, sessions: Collection[str]) -> list[str]:
        """Those of ``sessions`` whose every page's content is archived (spilled before,
        as a rule: this host has a manifest of them)."""
        return [
            d
            for d in sessions
            if not self.index._q(
                "SELECT 1 FROM pages p JOIN blobs b ON b.hash=p.hash"
                " WHERE p.session=? AND b.archived=0 LIMIT 1",
                (d,),
            )
        ]

    # -- import from another host's manifest ---------------------------------------------
    def import_manifest(
        self, m: dict, unchanged: Callable[[], bool] = lambda: True, own: str = ""
    ) -> tuple[int, list[PageRow], list[BlobRow]]:
        """Add the manifest's pages that this index does not have, as archive-only data,
        and record the other hosts' manifest versions it came from (``m["versions"]``; this
        host's own manifests supersede them from now on). A page held here under a path the
        manifest names with a page created later is replaced by that one: this host's next
        manifest supersedes the others, and must not bring an older page back for them.
        Returns (pages added, page rows replaced, blob rows whose last reference they were:
        the caller drops their files). One transaction: all or nothing. Nothing is added
        when ``unchanged()``, asked inside the transaction, is False: pages left the
        session here that the manifest may still name, and they must not come back."""
        d = m["session"]
        now = time.time()
        added = 0
        replaced: list[PageRow] = []
        freed: list[BlobRow] = []
        with self.index.transaction() as db:
            if not unchanged():
                return 0, [], []
            db.executemany(
                "INSERT INTO archive_imported VALUES (?,?,?) ON CONFLICT (session, store_id)"
                " DO UPDATE SET spilled_at=max(spilled_at, excluded.spilled_at)",
                [(d, sid, at) for sid, at in m.get("versions", {}).items() if sid != own],
            )
            for p in m["pages"]:
                h = bytes(p["hash"])
                here = db.execute(
                    "SELECT created, hash FROM pages WHERE path=?", (p["path"],)
                ).fetchone()
                if here is not None:
                    if here[0] >= p.get("created", 0.0) or bytes(here[1]) == h:
                        continue  # this host's is as new, or the same bytes
                    gone, fr = self.index._delete_pages(db, [p["path"]])
                    replaced += gone
                    freed += fr
                if db.execute("SELECT 1 FROM blobs WHERE hash=?", (h,)).fetchone():
                    db.execute("UPDATE blobs SET refs=refs+1, archived=1 WHERE hash=?", (h,))
                else:
                    db.execute(
                        f"INSERT INTO blobs ({_BLOB_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
                        (
                            h,
                            p["size"],
                            bytes(p["leaves"]),
                            1,
                            None,
                            0,
                            1,
                            p.get("created", now),
                            m.get("atime", now),
                        ),
                    )
                db.execute(
                    "INSERT INTO pages (path, session, hash, size, created, atime, pinned,"
                    " attrs) VALUES (?,?,?,?,?,?,?,?)",
                    (
                        p["path"],
                        d,
                        h,
                        p["size"],
                        p.get("created", now),
                        m.get("atime", now),
                        int(pinned_now(p, now)),
                        _pack(p.get("attrs", {})),
                    ),
                )
                if pinned_now(p, now):
                    Index._set_pin_until(db, p["path"], "page", p.get("pin_until"))
                added += 1
            if added:
                # The pages just added are archive-only here: a manifest of this host's must
                # name them before anything else happens, or another host deleting the
                # session deletes their objects while this host lists them. Queued in the
                # import's transaction: a crash right after it still gets it written.
                enqueue_in(db, "manifest", [d])
            Index._touch_session(db, d, m.get("atime", now), m.get("attrs") or {})
            # The manifest's pin, and its end: one that ended already is none (its host
            # died before it could rewrite the manifest unpinned). A pin this host has of
            # the session stays as it is.
            if (
                pinned_now(m, now)
                and db.execute(
                    "UPDATE sessions SET pinned=1 WHERE dir=? AND NOT pinned", (d,)
                ).rowcount
            ):
                Index._set_pin_until(db, d, "session", m.get("pin_until"))
        return added, replaced, freed


def build_manifest(
    index: Index,
    d: str,
    store_id: str,
    codecs: dict[bytes, str],
    supersedes: dict[str, float] | None = None,
) -> dict | None:
    """The manifest of session ``d`` from the index: its pages whose data is archived.
    None when the session has no archived page (its manifest should be deleted), unless it
    supersedes other hosts' manifests: then a manifest without pages says so (a tombstone;
    deleting it would bring back what those name and this host deleted)."""
    with index.snapshot():  # (a pin and its end from one state: never a pin without it)
        s = index.session(d)
        s_until = index.pin_until(d, "session") if s is not None and s.pinned else None
        pages = (
            []
            if s is None
            else [
                _with_pin_until(
                    {
                        "path": p.path,
                        "size": p.size,
                        "hash": p.hash,
                        "leaves": leaves,
                        "codec": codecs.get(p.hash, "see-object"),
                        "created": p.created,
                        "pinned": p.pinned,
                        "attrs": p.attrs,
                    },
                    until,
                )
                for p, leaves, until in index.archived_pages(d)
            ]
        )
    if not pages and not supersedes:
        return None
    name = session_name(d)
    now = time.time()
    return _with_pin_until(
        {
            "v": VERSION,
            "session": d,
            "name": name,
            "created": now if s is None else s.created,
            "atime": now if s is None else s.atime,
            "pinned": False if s is None else s.pinned,
            "attrs": {} if s is None else s.attrs,
            "store_id": store_id,
            "spilled_at": time.time(),
            "supersedes": supersedes or {},
            "pages": pages,
        },
        s_until,
    )


def _with_pin_until(record: dict, until: float | None) -> dict:
    """``record`` (a manifest or one of its pages), with ``pin_until`` when its pin has an
    end: absent, a pin is for good, as every manifest before pins had ends said."""
    if until is not None:
        record["pin_until"] = until
    return record


def pinned_now(record: Mapping[str, object], now: float) -> bool:
    """Whether a manifest (its session) or one of its pages is pinned at ``now``: pinned,
    and with no ``pin_until`` or one still to come."""
    until = record.get("pin_until")
    return bool(record.get("pinned")) and (not isinstance(until, (int, float)) or until > now)
