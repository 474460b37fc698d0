"""Run by tests/test_archive_background.py in a child process, under ``faketime`` where a
test wants this host's clock off: ``put DIRS URL SESSION`` stores one page of SESSION (its
last access is then this process's now); ``retention DIRS URL SECONDS`` opens the store
with its background task and that retention, and prints, as JSON, what its first retention
pass did (``expired``: sessions deleted; ``paused``: the fields of a ``retention-paused``
event, or null), the sessions left and what ``kvfs stats`` says."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import trio

import kvfs
from cli._store_cmds import render_stats


def config(dirs: str, url: str, **archive: object) -> kvfs.StoreConfig:
    return kvfs.StoreConfig(
        data_dirs=tuple(Path(d) for d in dirs.split(",")),
        archive_url=url,
        extra={"archive": {"upload_processes": 0, **archive}},
    )


class Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.paused: dict[str, object] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "kvfs_event", None) == "retention-paused":
            self.paused = dict(record.kvfs_fields)  # type: ignore[attr-defined]


async def retention(dirs: str, url: str, seconds: float) -> dict[str, object]:
    events = Events()
    logging.getLogger("kvfs").addHandler(events)
    async with kvfs.open_store(config(dirs, url, retention=seconds, interval=0.05)) as s:
        with trio.fail_after(30):  # (the first pass comes after one interval)
            while True:
                expired = (await s.statistics()).extra["archive"]["sessions_expired"]
                if expired or events.paused:
                    break
                await trio.sleep(0.05)
        st = await s.statistics()
        return {
            "expired": expired,
            "paused": events.paused,
            "sessions": sorted(i.session for i in await s.sessions()),
            "stats": render_stats(st),
        }


def main() -> None:
    what, dirs, url, arg = sys.argv[1:5]
    if what == "put":
        with kvfs.open_store_sync(config(dirs, url)) as s:
            s.put(kvfs.PageKey.semantic(arg, "p", 0), b"kv" * 1000)
        return
    print(json.dumps(trio.run(retention, dirs, url, float(arg))))


if __name__ == "__main__":
    main()
