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
  them itself. Its manifests are deleted, except those of a session that is pinned or holds a
  pinned page (pins are never expired), and the objects they named are queued for this host's
  collection, which deletes them only once no manifest of any host names them
  (kvfs/_collect.py). Its collection intents (``gc/<store id>-*``, finished or not) are
  deleted too: only their host removes them otherwise, and a host silent that long stopped
  deleting long ago. Its heartbeat goes first, whatever stays, and only if it is still the
  one judged silent (a host that beat meanwhile is back: left alone); a ``.retiring``
  marker beside it says the retirement is under way, so that one a failure interrupted is
  finished by a later pass, and each manifest goes only while the heartbeat is still
  missing. The host is not looked at again.
* A host whose retention is 0 keeps everything, so nobody retires it; a host that never
  wrote a heartbeat (kvfs before the ninth session, a store used without a background task)
  is never retired either.

A host retired this way that does start again (or was only cut off) finds its heartbeat gone
(its index records that it wrote one; it looks before every drop of a local copy) and
writes all its manifests again; its own retention
pass deletes the sessions it did not touch meanwhile (all of them, unless pinned), and a page
of another one read before that fails as missing from the archive (docs/archive.md, failure
table).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgpack

from ._collect import INTENTS
from ._events import log_event
from ._manifest import MANIFESTS, pack_manifest, parse_manifest

if TYPE_CHECKING:
    from objectstore import ObjectStore

__all__ = ["HOSTS", "Hosts", "heartbeat_interval"]

HOSTS = "hosts/"
#: beside a heartbeat deleted by a host retiring that one: the retirement is under way
RETIRING = ".retiring"
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
    ) -> None:
        self.store, self.store_id, self.retention = store, store_id, retention
        self.interval = heartbeat_interval(retention)
        self.count = count
        #: called before a heartbeat is written where none is: this host's manifests may
        #: have been deleted by another host that took it for gone
        self.absent = absent
        #: queues objects for this host's collection (durably: before a manifest goes)
        self.forget = forget
        self._beaten = False
        #: time.monotonic() of this host's last heartbeat written (None: none yet)
        self.beaten_at: float | None = None

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
        body = {"v": 1, "retention": self.retention, "interval": self.interval}
        await self.store.put(self.key, msgpack.packb(body))
        self._beaten = True
        self.beaten_at = time.monotonic()
        return await self.store.modified(self.key)

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
        """Every host the archive knows of, from heartbeats and manifests, by store id:
        ``this`` (this host), ``sessions`` (its manifests), ``retention_s`` and
        ``heartbeat_s`` (None: no heartbeat), ``last_heartbeat`` (the archive's time of
        it) and ``retire_at`` (when others will take it for gone if it stays silent; None:
        never). Reads each heartbeat, never a manifest; writes nothing."""
        sessions: dict[str, int] = {}
        for key in await self.store.list_all(MANIFESTS):
            head, at, host = key.rpartition("@")
            if at and head:
                sessions[host] = sessions.get(host, 0) + 1
        beats = {
            k[len(HOSTS) :] for k in await self.store.list_all(HOSTS) if not k.endswith(RETIRING)
        }
        out = []
        for host in sorted(beats | set(sessions)):
            row: dict[str, object] = {
                "store_id": host,
                "this": host == self.store_id,
                "sessions": sessions.get(host, 0),
                "retention_s": None,
                "heartbeat_s": None,
                "last_heartbeat": None,
                "retire_at": None,
            }
            beat = await self._heartbeat(host) if host in beats else None
            if beat is not None:
                retention, interval, seen = beat
                row.update(retention_s=retention, heartbeat_s=interval, last_heartbeat=seen)
                if retention > 0:
                    row["retire_at"] = seen + 2 * retention + 2 * interval
            out.append(row)
        return out

    async def _heartbeat(self, host: str) -> tuple[float, float, float] | None:
        """A host's heartbeat: its retention, its interval and when it was written (the
        archive's clock); None when it is gone, or unreadable (that host is then kept)."""
        key = HOSTS + host
        try:
            info = msgpack.unpackb(await self.store.get(key), raw=False)
            retention, interval = float(info["retention"]), float(info["interval"])
        except FileNotFoundError:
            return None  # retired by another host meanwhile
        except Exception as e:  # noqa: BLE001 - a damaged heartbeat: that host is kept
            log.warning("archive heartbeat %s is unreadable (%s); host kept", key, e)
            return None
        seen = await self.store.modified(key)
        return None if seen is None else (retention, interval, seen)

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
                    await self._retire(host, "an interrupted retirement, resumed")
            elif host != self.store_id:
                await self._retire_if_silent(host, now)

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
        # (with the heartbeat gone, nothing else would look at this host again).
        if await self.store.modified(HOSTS + host) != seen:
            return
        await self.store.put(HOSTS + host + RETIRING, b"")
        await self.store.delete(HOSTS + host)
        why = f"silent for more than twice its retention ({retention:g} s) for {now - seen:.0f} s"
        await self._retire(host, why)

    async def _retire(self, host: str, why: str) -> None:
        """Delete the manifests of ``host`` (its heartbeat gone), except pinned ones, and
        its collection intents; then its ``.retiring`` marker."""
        deleted = kept = 0
        listed = set(await self.store.list_all(MANIFESTS))
        for mkey in listed:
            if not mkey.endswith("@" + host):
                continue
            if await self.store.modified(HOSTS + host) is not None:
                log.warning("archive host %s came back while being retired: left alone", host)
                await self.store.delete(HOSTS + host + RETIRING)
                return
            try:
                m: dict[str, Any] = parse_manifest(await self.store.get(mkey))  # type: ignore[arg-type]
            except FileNotFoundError:
                continue
            except ValueError:
                kept += 1  # unreadable: what it names is unknown, so it stays
                continue
            if m.get("pinned") or any(p.get("pinned") for p in m["pages"]):
                kept += 1
                continue
            # Queued before the manifest goes: a failure (or a kill) in between leaves the
            # manifest, retired again next time, never objects that nothing would collect.
            await self.forget([bytes(p["hash"]) for p in m["pages"]])
            session_part = mkey[: -len(host) - 1]
            if any(f"{session_part}@{sid}" in listed for sid in m.get("supersedes", {})):
                # It supersedes manifests still there (the host took the session over from
                # theirs): deleting it would bring back what they name and it deleted.
                # Its pages go; a tombstone keeps saying what is no longer there.
                await self.store.put(mkey, pack_manifest({**m, "pages": []}))
            else:
                await self.store.delete(mkey)
            deleted += 1
        # Its intents would linger in every settle's listing forever: a collection stops
        # deleting half a window after its intent is written, long before this.
        intents = await self.store.list_all(INTENTS + host + "-")
        for k in intents:
            await self.store.delete(k)
        # Its heartbeat went even where pinned manifests stay: a host only cut off finds it
        # missing when it is back and writes its manifests again. Kept, the host went on
        # trusting manifests deleted here, and dropped local copies of pages whose objects
        # were collected. (What stays is never looked at again: pins are never expired.)
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
