"""Hosts sharing an archive: heartbeats, and retiring the manifests of hosts gone for good.

Retention (``archive.retention``) is applied by each host to its own sessions. A host that
never runs again (its disks gone, a node scaled away) applies nothing, and its manifests
would keep their objects in the bucket forever. So every host with a background task writes
a heartbeat, ``hosts/<store id>`` (msgpack: its retention and heartbeat interval), at start
and every ``interval`` seconds, and looks at the others' heartbeats as often:

* A host's silence is measured by the store's own clock (the heartbeat object's modification
  time against that of the looking host's heartbeat, just written), never by comparing the
  hosts' clocks.
* A host silent for more than twice its retention plus two of its heartbeat intervals has
  not touched any of its sessions for longer than its retention: it would have deleted
  them itself. Its manifests are deleted, except those of a session that is pinned or
  holds a pinned page (a pin whose end, ``pin_until``, has passed is none: by the
  archive's clock, with a margin for the skew of its host's, see ``_pin_margin``), and the
  objects they named are queued for this host's collection, which deletes them only once
  no manifest of any host names them (kvfs/_collect.py). One that holds pages goes also
  where it supersedes another host's (as the host's own retention would have deleted it:
  that drops its copy, not the session on the other hosts); one without pages, a session it
  took over and deleted, stays while a manifest it supersedes is there (``_release``). Its collection intents
  (``gc/<store id>-*``, finished or not) are deleted too: only their host removes them
  otherwise, and a host silent that long stopped deleting long ago. Its heartbeat goes
  first, whatever stays, and only if it is still the one judged silent (a host that beat
  meanwhile is back: left alone); a ``.retiring`` marker beside it says the retirement is
  under way, so that one a failure interrupted is finished by a later pass, and each
  manifest goes only while the heartbeat is still missing. The host is not looked at again.
* Where anything of it stays (a pinned session's manifest, a manifest kept as a tombstone,
  one unreadable), the retiring host writes ``retired/<store id>`` last (msgpack: who
  retired it and when, by the archive's clock, the retention and last heartbeat it had,
  and which of its manifests still hold pages), so that ``kvfs hosts`` says it was
  retired: without it, such a host looked like one that never wrote a heartbeat. A host
  retired with nothing left leaves nothing behind (its retirement is logged).
* What stays is looked at again, by every pass (at most once per heartbeat interval of the
  looker, by the marker's age): a tombstone goes once it supersedes no manifest still there
  (what it hid is gone: its host deleted the session, or was retired itself), found so at
  two looks in a row (a reader that listed the superseded manifest before it went may still
  be reading the tombstone), and the marker goes once none of the host's manifests is
  left. Unreadable manifests stay, and so do pinned ones while a pin of theirs holds: the
  marker records when each of those pins ends, so that one is read again only once its
  pins have ended, and then deleted as the retirement would have deleted it (its objects
  queued for collection). Without this, a fleet whose store ids change kept a marker and
  tombstones per host gone, for ever, and a host retired with pins that ended later kept
  those sessions and their objects for ever. A marker found beside its host's heartbeat
  (a race with the host's return) goes.
* A host whose retention is 0 keeps everything, so nobody retires it; a host that never
  wrote a heartbeat (kvfs before the ninth session, a store used without a background task)
  is never retired either.

A host retired this way that does start again (or was only cut off) finds its heartbeat gone
(its index records that it wrote one; it looks before every drop of a local copy) and
writes all its manifests again, deletes its ``retired/`` marker and beats: it is live
again (a heartbeat outranks a marker in any case, one a race left included, which the next
pass deletes); its own retention
pass deletes the sessions it did not touch meanwhile (all of them, unless pinned), and a page
of another one read before that fails as missing from the archive (docs/archive.md, failure
table).

Each heartbeat also lists which of its host's manifests hold no pages (tombstones: a session
it took over from another host and deleted, see kvfs/_manifest.py), so that ``kvfs hosts``
counts only sessions holding pages from one listing, reading no manifest: a manifest's size
does not tell (a tombstone keeps the session's attributes and the versions it supersedes).
A live host keeps every tombstone it made, so the heartbeat names at most TOMBSTONE_BYTES of
them and counts the rest (``tombstone_count``), which are then subtracted by number.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ._collect import INTENTS
from ._events import log_event
from ._manifest import (
    MANIFESTS,
    legacy_manifest_key,
    pack_manifest,
    parse_manifest,
    pinned_now,
    session_key_part,
)

if TYPE_CHECKING:
    from objectstore import ObjectStore

__all__ = ["HOSTS", "RETIRED", "Hosts", "heartbeat_interval"]

HOSTS = "hosts/"
#: beside a heartbeat deleted by a host retiring that one: the retirement is under way
#: (msgpack: what the retired host's heartbeat said, and who retires it; empty from kvfs
#: before the retired markers)
RETIRING = ".retiring"
#: ``retired/<store id>``: that host was retired and something of it stays (kept apart from
#: ``hosts/``, where kvfs before it would read it as a heartbeat)
RETIRED = "retired/"
#: a heartbeat older than two of its host's intervals plus this is shown as silent (S3 keeps
#: whole seconds, and the looker's clock is compared with the archive's)
SILENT_SLACK = 5.0
#: at most this many bytes of tombstone names in a heartbeat (the first, sorted; the rest
#: are counted): a host keeps every tombstone it made, and a heartbeat listing them all
#: would grow without bound, written again every interval
TOMBSTONE_BYTES = 64 * 1024
log = logging.getLogger("kvfs.archive")


def heartbeat_interval(retention: float) -> float:
    """Seconds between heartbeats: a quarter of the retention, an hour at most."""
    return min(retention / 4, 3600.0) if retention > 0 else 3600.0


class Hosts:
    """This host's heartbeat, and the retirement of hosts silent for good."""

    def __init__(
        self,
        store: ObjectStore,
        store_id: str,
        retention: float,
        count: Callable[[str, int], None],
        absent: Callable[[], Awaitable[None]],
        forget: Callable[[list[bytes]], Awaitable[None]],
        tombstones: Callable[[], Awaitable[list[str]]],
    ) -> None:
        self.store, self.store_id, self.retention = store, store_id, retention
        self.interval = heartbeat_interval(retention)
        self.count = count
        #: called before a heartbeat is written where none is: this host's manifests may
        #: have been deleted by another host that took it for gone
        self.absent = absent
        #: queues objects for this host's collection (durably: before a manifest goes)
        self.forget = forget
        #: this host's manifests without pages, by session key part (session_key_part)
        self.tombstones = tombstones
        self._beaten = False
        #: time.monotonic() of this host's last heartbeat written (None: none yet)
        self.beaten_at: float | None = None
        #: seconds this host's clock was ahead of the archive's at least, at that heartbeat
        #: (<= 0: not ahead; None: not known yet; see beat)
        self.clock_ahead: float | None = None

    @property
    def key(self) -> str:
        return HOSTS + self.store_id

    async def beat(self) -> float | None:
        """Write this host's heartbeat; return its modification time (the store's "now")."""
        if await self.store.modified(self.key) is None:
            # A first start, or another host retired this one (its manifests may be gone):
            # the callback tells them apart and writes the manifests again in the second case.
            if self._beaten:
                log.warning(
                    "archive heartbeat %s was deleted: another host took this one for gone "
                    "(silent for twice its retention); writing its manifests again",
                    self.key,
                )
            await self.absent()
            # Back: no longer retired (before the heartbeat, so that a failure here is
            # retried by the next beat, which finds the heartbeat still missing).
            await self.store.delete(RETIRED + self.store_id)
        tombstones = sorted(await self.tombstones())
        listed, size = [], 0
        for name in tombstones:
            size += len(name.encode()) + 5  # (msgpack's string header, at most)
            if size > TOMBSTONE_BYTES:
                break
            listed.append(name)
        body = {
            "v": 1,
            "retention": self.retention,
            "interval": self.interval,
            "tombstones": listed,
            "tombstone_count": len(tombstones),  # (those not listed are only counted)
        }
        before = time.time()
        await self.store.put(self.key, msgpack.packb(body))
        written = await self.store.modified(self.key)
        if written is not None:
            # The put landed after ``before`` by this clock, and before ``written + 1`` by
            # the archive's (S3 keeps whole seconds, cut down): the difference is how far
            # this clock is ahead at least. Never more, so equal clocks give <= 0.
            self.clock_ahead = before - (written + 1.0)
        # (only now: a retention pass that saw this beat before its clock was compared
        # took the clocks for agreeing, and deleted by the wrong one)
        self._beaten = True
        self.beaten_at = time.monotonic()
        return written

    async def confirm(self) -> None:
        """Beat at once if this host's heartbeat is gone (another host retired it)."""
        if await self.store.modified(self.key) is None:
            await self.beat()

    def overdue(self) -> bool:
        """This host has beaten before but not for two of its intervals (the archive was
        unreachable, or the loop stalled): other hosts may have taken it for gone, and what
        it last wrote may no longer be there."""
        return (
            self.retention > 0
            and self.beaten_at is not None
            and time.monotonic() - self.beaten_at > 2 * self.interval
        )

    async def survey(self) -> list[dict[str, object]]:
        """Every host the archive knows of, from heartbeats, retirement markers and the
        manifest listing, by store id: ``this`` (this host); ``state``: ``live`` (beat
        within two of its intervals, by this host's clock against the archive's),
        ``silent`` (not since), ``retiring`` (another host is retiring it), ``retired``
        (another host retired it; what stays of it is pinned) or ``no-heartbeat`` (never
        wrote one: never retired); ``sessions`` (its manifests that hold pages);
        ``retention_s`` and ``heartbeat_s`` (None: not known), ``last_heartbeat`` (the
        archive's time of it), ``retire_at`` (when others will take it for gone if it stays
        silent; None: never, or retired already), ``retired_at`` (the archive's time of its
        retirement) and ``retired_by`` (the store id that retired it). Reads the heartbeats
        and retirement markers, never a manifest; writes nothing."""
        parts: dict[str, set[str]] = {}
        for key in await self.store.list_all(MANIFESTS):
            head, at, host = key.rpartition("@")
            if at and head:
                parts.setdefault(host, set()).add(head[len(MANIFESTS) :])
        beats, retiring = set(), set()
        for k in await self.store.list_all(HOSTS):
            if k.endswith(RETIRING):
                retiring.add(k[len(HOSTS) : -len(RETIRING)])
            else:
                beats.add(k[len(HOSTS) :])
        retired = {k[len(RETIRED) :] for k in await self.store.list_all(RETIRED)}
        now = time.time()
        out = []
        for host in sorted(beats | retiring | retired | set(parts)):
            mine = parts.get(host, set())
            row: dict[str, object] = {
                "store_id": host,
                "this": host == self.store_id,
                "state": "no-heartbeat",
                "sessions": len(mine),
                "retention_s": None,
                "heartbeat_s": None,
                "last_heartbeat": None,
                "retire_at": None,
                "retired_at": None,
                "retired_by": None,
            }
            beat = await self._read_heartbeat(host) if host in beats else None
            empty: set[str] = set()  # its manifests without pages
            unlisted = 0  # and how many more, not named
            if beat is not None:  # (a heartbeat outranks any marker: the host is back)
                row.update(retention_s=beat.retention, heartbeat_s=beat.interval)
                row["last_heartbeat"] = beat.seen
                silent = now - beat.seen > 2 * beat.interval + SILENT_SLACK
                row["state"] = "silent" if silent else "live"
                if beat.retention > 0:
                    row["retire_at"] = beat.seen + 2 * beat.retention + 2 * beat.interval
                empty, unlisted = beat.tombstones, beat.unlisted
            elif host in retired:  # (written last: its .retiring, if still there, goes next)
                fields, held = await self._retired_row(RETIRED + host)
                row.update(fields, state="retired", sessions=len(mine & held))
            elif host in retiring:
                row.update((await self._retired_row(HOSTS + host + RETIRING))[0])
                row["state"] = "retiring"
            if row["state"] != "retired":
                if host == self.store_id:
                    empty = set(await self.tombstones())  # its own index: up to date
                    unlisted = 0
                # (those only counted are among its manifests listed, unless one is still
                # queued to be written: at worst a session too few then)
                row["sessions"] = max(0, len(mine - empty) - unlisted)
            out.append(row)
        return out

    async def _read_heartbeat(self, host: str) -> _Beat | None:
        """A host's heartbeat (None when it is gone, or unreadable: that host is then
        kept)."""
        key = HOSTS + host
        try:
            info = msgpack.unpackb(await self.store.get(key), raw=False)
            retention, interval = float(info["retention"]), float(info["interval"])
            # (none from kvfs before they were listed)
            tombstones = _strings(info.get("tombstones"))
            count = _number(info.get("tombstone_count"))
            unlisted = max(0, int(count) - len(tombstones)) if count is not None else 0
        except FileNotFoundError:
            return None  # retired by another host meanwhile
        except Exception as e:  # noqa: BLE001 - a damaged heartbeat: that host is kept
            log.warning("archive heartbeat %s is unreadable (%s); host kept", key, e)
            return None
        seen = await self.store.modified(key)
        return None if seen is None else _Beat(retention, interval, seen, tombstones, unlisted)

    async def _heartbeat(self, host: str) -> tuple[float, float, float] | None:
        """A host's heartbeat: its retention, its interval and when it was written (the
        archive's clock); None when it is gone, or unreadable (that host is then kept)."""
        beat = await self._read_heartbeat(host)
        return None if beat is None else (beat.retention, beat.interval, beat.seen)

    async def _retired_row(self, key: str) -> tuple[dict[str, object], set[str]]:
        """What a ``.retiring`` or ``retired/`` marker says of its host, as survey's fields,
        and which of its manifests hold pages (by session key part)."""
        m = await self._marker(key)
        fields = {
            "retention_s": _number(m.get("retention")),
            "heartbeat_s": _number(m.get("interval")),
            "last_heartbeat": _number(m.get("last_heartbeat")),
            "retired_at": None if key.endswith(RETIRING) else _number(m.get("at")),
            "retired_by": m.get("by") if isinstance(m.get("by"), str) else None,
        }
        return fields, _strings(m.get("sessions"))

    async def _marker(self, key: str) -> dict[str, Any]:
        """A ``.retiring`` or ``retired/`` marker's fields ({} where it is empty, gone, or
        unreadable: only what is shown of a retired host is missing then)."""
        try:
            raw = await self.store.get(key)
            info = msgpack.unpackb(raw, raw=False) if raw else {}  # (empty: older kvfs)
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001 - a damaged marker: nothing is decided by it
            log.warning("archive marker %s is unreadable (%s)", key, e)
            return {}
        return info if isinstance(info, dict) else {}

    async def tick(self) -> None:
        """Beat, then retire hosts silent for good (and finish retirements a failure or a
        kill interrupted: their ``.retiring`` markers)."""
        now = await self.beat()
        if now is None:
            return
        keys = await self.store.list_all(HOSTS)
        for key in keys:
            host = key[len(HOSTS) :]
            if host.endswith(RETIRING):
                host = host[: -len(RETIRING)]
                if HOSTS + host in keys:  # it came back: nothing more of it goes
                    await self.store.delete(key)
                else:
                    info = await self._marker(key)
                    await self._retire(host, "an interrupted retirement, resumed", now, info)
            elif host != self.store_id:
                await self._retire_if_silent(host, now)
        await self._tidy_retired(now)

    async def _retire_if_silent(self, host: str, now: float) -> None:
        beat = await self._heartbeat(host)
        if beat is None:
            return
        retention, interval, seen = beat
        if retention <= 0 or now - seen <= 2 * retention + 2 * interval:
            return
        # The heartbeat goes first, and only the one judged: a host that beat since is back
        # (and trusted its manifests: none may go). Once it is gone, a host that comes back
        # finds it missing, before any drop (Spiller._check_named), and writes its manifests
        # again; a manifest is then deleted only while the heartbeat is still missing. A
        # marker says the retirement is under way, so that a failure halfway is resumed
        # (with the heartbeat gone, nothing else would look at this host again); it keeps
        # what the heartbeat said, for kvfs hosts and the retired marker.
        if await self.store.modified(HOSTS + host) != seen:
            return
        info = {
            "v": 1,
            "by": self.store_id,
            "retention": retention,
            "interval": interval,
            "last_heartbeat": seen,
        }
        await self.store.put(HOSTS + host + RETIRING, msgpack.packb(info))
        await self.store.delete(HOSTS + host)
        why = f"silent for more than twice its retention ({retention:g} s) for {now - seen:.0f} s"
        await self._retire(host, why, now, info)

    async def _retire(self, host: str, why: str, now: float, info: dict[str, Any]) -> None:
        """Delete the manifests of ``host`` (its heartbeat gone), except pinned ones, and
        its collection intents; then, where anything of it stays, write its ``retired/``
        marker; then delete its ``.retiring`` marker."""
        deleted = kept = tombstoned = 0
        #: its manifests kept that hold pages (or may: unreadable), by session key part
        held: list[str] = []
        #: when the pins keeping one of them end (by session key part; none: for good)
        ends: dict[str, float] = {}
        margin = self._pin_margin(info)
        listed = set(await self.store.list_all(MANIFESTS))

        async def back() -> bool:
            """The host beat since its heartbeat went: it is back, and trusts what it
            writes from now on (its manifests again, its intents): left alone."""
            if await self.store.modified(HOSTS + host) is None:
                return False
            log.warning("archive host %s came back while being retired: left alone", host)
            await self.store.delete(HOSTS + host + RETIRING)
            return True

        for mkey in listed:
            if not mkey.endswith("@" + host):
                continue
            session_part = mkey[: -len(host) - 1]
            try:
                m: dict[str, Any] = parse_manifest(await self.store.get(mkey))  # type: ignore[arg-type]
            except FileNotFoundError:
                continue
            except ValueError:
                m = _UNREADABLE
            # Looked at once the manifest is read, not before: a host back beats, then
            # writes its manifests again and trusts them, and a read after a look that found
            # no heartbeat could return one of those, which the delete below then took.
            # (A beat and a write between this look and that delete still race it: S3 has
            # no conditional delete.)
            if await back():
                return
            if m is _UNREADABLE:
                kept += 1  # unreadable: what it names is unknown, so it stays
                held.append(session_part[len(MANIFESTS) :])
                continue
            end = _pins_end(m, now - margin)
            if end is not None:  # (a pin that has ended is none)
                kept += 1
                if m["pages"]:
                    held.append(session_part[len(MANIFESTS) :])
                    if end != math.inf:
                        ends[session_part[len(MANIFESTS) :]] = end
                continue
            if await self._release(mkey, m, listed):
                tombstoned += 1
            deleted += 1
        # Its intents would linger in every settle's listing forever: a collection stops
        # deleting half a window after its intent is written, long before this. Unless it
        # is back: then one may be a collection of its, under way, that others must see.
        if await back():
            return
        # (An intent the host, back, writes between that look and this listing goes too,
        # while its collection runs: a window docs/archive.md describes, not closed here.)
        intents = await self.store.list_all(INTENTS + host + "-")
        for k in intents:
            await self.store.delete(k)
        if kept or tombstoned:
            # What stays says whose it is, and kvfs hosts says the host was retired (not
            # "never wrote a heartbeat"). Written last: a host that came back meanwhile
            # (its heartbeat there) outranks it, and it is deleted again at once.
            marker = {
                "v": 1,
                "retention": info.get("retention"),
                "interval": info.get("interval"),
                "last_heartbeat": info.get("last_heartbeat"),
                "by": info.get("by") or self.store_id,
                "at": now,
                "sessions": held,
                "ends": ends,
                "kept": kept,
                "tombstones": tombstoned,
            }
            await self.store.put(RETIRED + host, msgpack.packb(marker))
            if await self.store.modified(HOSTS + host) is not None:
                await self.store.delete(RETIRED + host)
        else:  # (one of an earlier retirement, left by a race with the host's return)
            await self.store.delete(RETIRED + host)
        # Its heartbeat went even where pinned manifests stay: a host only cut off finds it
        # missing when it is back and writes its manifests again. Kept, the host went on
        # trusting manifests deleted here, and dropped local copies of pages whose objects
        # were collected. (What stays is looked at again: _tidy_retired.)
        await self.store.delete(HOSTS + host + RETIRING)
        if deleted or not kept:
            self.count("hosts_retired", 1)
            log_event(
                "host-retired",
                level=logging.WARNING,
                host=host,
                manifests=deleted,
                kept_pinned=kept,
                intents=len(intents),
                message=why,
            )

    async def _release(self, mkey: str, m: dict[str, Any], listed: set[str]) -> bool:
        """Retire manifest ``m`` (at ``mkey``) of a host retired, pinned by nothing: queue
        what it names for this host's collection, then delete it; but a tombstone (no
        pages) that supersedes a manifest still there (in ``listed``) stays, unpinned
        (return True then).

        A manifest with pages goes even where it supersedes another host's (a session the
        retired host restored from that one): the retirement does what the host's own
        retention would have done, and that drops the host's copy, not the session on
        the others (Spiller.expiring). Kept as a tombstone, it hid the session from every
        host while its other host still held it. A tombstone is a deletion the host made
        of a session it took over (``kvfs rm``): deleting it would bring back what the
        manifests it supersedes name."""
        # Queued before the manifest goes: a failure (or a kill) in between leaves the
        # manifest, retired again next time, never objects that nothing would collect.
        await self.forget([bytes(p["hash"]) for p in m["pages"]])
        if not m["pages"] and await self._hides_something(mkey, m, listed):
            # (unpinned: a pin it had has ended, and a kvfs older than pin ends would read
            # it for good)
            if m.get("pinned") or "pin_until" in m:
                tomb = {k: v for k, v in m.items() if k != "pin_until"}
                await self.store.put(mkey, pack_manifest({**tomb, "pinned": False}))
            return True
        await self.store.delete(mkey)
        return False

    def _pin_margin(self, info: dict[str, Any]) -> float:
        """Seconds past its end that a pin of a retired host (its marker's ``info``) is
        still taken to hold its manifest.

        Its end is a time of that host's clock, compared with the archive's (the looker's
        ``now``): they may differ, and the pin must not end early. Its heartbeat interval
        (a quarter of its retention, an hour at most) is far beyond the skew of clocks kept
        in step, and scales as its silence was judged (two intervals of slack): the host
        itself would have deleted the session only at a retention pass after the end, and
        its retirement waited twice its retention already. The looker's own interval where
        the marker does not say (one a kvfs before retired markers left)."""
        return _number(info.get("interval")) or self.interval

    async def _tidy_retired(self, now: float) -> None:
        """Look again at the hosts retired with something left (``retired/`` markers): a
        marker beside its host's heartbeat is stale (the host is back) and goes; for the
        others, at most once per heartbeat interval of the looker (the marker's age tells,
        whoever looked), see :meth:`_tidy`."""
        markers = await self.store.list_all(RETIRED)
        if not markers:
            return
        keys = set(await self.store.list_all(HOSTS))
        listed: set[str] | None = None  # the manifests, listed once per pass at most
        for key in markers:
            host = key[len(RETIRED) :]
            if HOSTS + host + RETIRING in keys:
                continue  # retired again right now: that retirement writes its marker
            if HOSTS + host in keys:
                # Back (it deletes its marker before it beats, and a retiring host can
                # write one just after): a heartbeat outranks a marker, which would stay
                # until the host is retired again. Looked at once more: a host retired
                # since the listing has a marker that must stay.
                if await self.store.modified(HOSTS + host) is not None:
                    await self.store.delete(key)
                    log.info("archive host %s is back: its stale retired marker deleted", host)
                continue
            written = await self.store.modified(key)
            if written is None or now - written < self.interval:
                continue  # gone meanwhile, or looked at (or retired) lately
            if listed is None:
                listed = set(await self.store.list_all(MANIFESTS))
            await self._tidy(host, key, now, listed)

    async def _tidy(self, host: str, key: str, now: float, listed: set[str]) -> None:
        """Delete what is left of a retired ``host`` once nothing needs it, and update (or
        delete) its marker.

        Its manifests with pages stay while a pin of theirs holds (read again only once the
        ends the marker records for them have passed, then deleted as :meth:`_retire`
        would have: :meth:`_release`), unreadable ones stay, and so does a tombstone while
        it supersedes a manifest that is still there (deleting it would bring back what
        that one names and the session's deletion removed: see merge_manifests). One that
        hides nothing any more goes, but only at the second look in a row to find it so (a
        heartbeat interval or more apart): a reader that listed the superseded manifest
        before it went may still be reading the tombstone. Its marker goes once none of its
        manifests is left. Nothing goes while its heartbeat is there (it is back: it owns
        them again), and a manifest is read again right before it goes (a host back,
        writing before its first heartbeat, may have replaced it)."""
        info = await self._marker(key)
        before = _strings(info.get("free"))  # found hiding nothing at the previous look
        # kept at the last look, holding pages (pinned, or unreadable): they stay, and a
        # host gone does not change them, so they are not read again at every look, but
        # for those kept by pins that have ended since (their ends are in the marker; a
        # marker without them, from a kvfs before pin ends, has every one read once)
        known = _strings(info.get("sessions"))
        margin = self._pin_margin(info)
        ends = _ends(info.get("ends"))
        has_ends = isinstance(info.get("ends"), dict)
        held: list[str] = []  # its manifests kept that hold pages (or may: unreadable)
        kept_ends: dict[str, float] = {}  # when the pins keeping them end (none: for good)
        kept = tombstones = deleted = released = 0
        free: list[str] = []
        for mkey in sorted(k for k in listed if k.endswith("@" + host)):
            part = mkey[len(MANIFESTS) : -len(host) - 1]
            end = ends.get(part)  # (None: its pins are for good, or it is unreadable)
            if part in known and has_ends and (end is None or end > now - margin):
                kept += 1
                held.append(part)
                if end is not None:
                    kept_ends[part] = end
                continue
            m = await self._read_manifest(mkey)
            if m is None:
                continue  # deleted since the listing
            if m is _UNREADABLE:
                kept += 1
                held.append(part)
                continue
            end = _pins_end(m, now - margin)
            if end is not None:
                kept += 1
                if m["pages"]:
                    held.append(part)
                    if end != math.inf:
                        kept_ends[part] = end
                continue
            if m["pages"] and part not in known:
                # Not one the retirement kept (for its pins, or unreadable): written since, by
                # the host back before its first heartbeat. It stays, as every manifest with
                # pages stayed before pins had ends.
                kept += 1
                held.append(part)
                continue
            if m["pages"]:
                # Its pins ended since it was kept: it goes as the retirement would have
                # deleted it then, its objects through this host's collection. Only while
                # the heartbeat is missing, and as read (a host back may have rewritten it).
                if await self.store.modified(HOSTS + host) is not None:
                    return  # back: what it wrote is its own again
                if await self._read_manifest(mkey) != m:
                    kept += 1  # rewritten meanwhile: read again at the next look
                    continue
                if await self._release(mkey, m, listed):
                    tombstones += 1  # (a tombstone now, looked at as the others)
                released += 1
                continue
            if await self._hides_something(mkey, m, listed):
                tombstones += 1
                continue
            if part not in before:
                free.append(part)  # (goes at the next look, if still so)
                tombstones += 1
                continue
            if await self.store.modified(HOSTS + host) is not None:
                return  # back: what it wrote is its own again
            if await self._read_manifest(mkey) != m:
                tombstones += 1  # rewritten meanwhile (by the host, back): looked at again
                continue
            await self.store.delete(mkey)
            deleted += 1
        if deleted:
            log_event("retired-host-tombstones", host=host, deleted=deleted, left=kept + tombstones)
        if released:
            log_event(
                "retired-host-pins-ended",
                level=logging.WARNING,
                host=host,
                manifests=released,
                left=kept + tombstones,
            )
        if not kept and not tombstones:
            await self.store.delete(key)
            log.info("archive host %s, retired, has nothing left: its marker deleted", host)
            return
        marker = {
            **info,
            "sessions": held,
            "ends": kept_ends,
            "kept": kept,
            "tombstones": tombstones,
            "free": free,
            "checks": int(_number(info.get("checks")) or 0) + 1,
        }
        await self.store.put(key, msgpack.packb(marker))  # (also dates this look)
        if await self.store.modified(HOSTS + host) is not None:
            await self.store.delete(key)  # back meanwhile: a heartbeat outranks it

    async def _read_manifest(self, key: str) -> dict[str, Any] | None:
        """A manifest (None: gone; _UNREADABLE: it cannot be read, its pages are unknown)."""
        try:
            return parse_manifest(await self.store.get(key))  # type: ignore[arg-type, no-any-return]
        except FileNotFoundError:
            return None
        except ValueError:
            return _UNREADABLE

    async def _hides_something(self, mkey: str, m: dict[str, Any], listed: set[str]) -> bool:
        """Whether manifest ``m`` (at ``mkey``) supersedes another manifest of its session
        that is still there: one of a host it names, of that version or older (as
        merge_manifests decides), or one that cannot be read (it may be)."""
        d, sup = m["session"], m.get("supersedes") or {}
        if not sup:
            return False
        own = MANIFESTS + session_key_part(d) + "@"
        if not mkey.startswith(own):
            return True  # not where its session's manifests are: nothing is known
        legacy = legacy_manifest_key(d)
        # the others' keys, and a legacy manifest (one per session, or a long name uncut)
        candidates = {own + sid for sid in sup} | {legacy + "@" + sid for sid in sup}
        candidates = ((candidates | {legacy}) & listed) - {mkey}
        for key in sorted(candidates):
            o = await self._read_manifest(key)
            if o is _UNREADABLE:
                return True
            if o is not None and sup.get(o["store_id"], -1.0) >= o["spilled_at"]:
                return True
        return False


#: what _read_manifest returns for a manifest that cannot be read
_UNREADABLE: dict[str, Any] = {}


class _Beat(NamedTuple):
    """A heartbeat: its host's retention and interval, when it was written (the archive's
    clock), and its host's manifests without pages (by session key part)."""

    retention: float
    interval: float
    seen: float
    tombstones: set[str]
    #: its tombstones counted but not named (past TOMBSTONE_BYTES of names)
    unlisted: int = 0


def _pins_end(m: dict[str, Any], now: float) -> float | None:
    """When the last pin of manifest ``m`` (its session's or one of its pages') in force at
    ``now`` ends: math.inf for a pin for good, None when no pin is in force."""
    ends = [r.get("pin_until") for r in (m, *m["pages"]) if pinned_now(r, now)]
    if not ends:
        return None
    numbers = [_number(u) for u in ends]
    return math.inf if None in numbers else max(u for u in numbers if u is not None)


def _ends(v: object) -> dict[str, float]:
    """A marker's ``ends``: when the pins keeping each of its host's manifests end."""
    out: dict[str, float] = {}
    for k, u in v.items() if isinstance(v, dict) else ():
        end = _number(u)
        if isinstance(k, str) and end is not None:
            out[k] = end
    return out


def _strings(v: object) -> set[str]:
    return {p for p in v if isinstance(p, str)} if isinstance(v, list) else set()


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
