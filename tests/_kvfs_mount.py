"""A kvfs store mounted with FUSE by a trio loop in a thread, for synchronous tests."""

from __future__ import annotations

import threading
from pathlib import Path

import trio

import kvfs
from kvfs._mount import MountOptions, serve_mount

__all__ = ["ServedMount"]


class ServedMount:
    """A kvfs store mounted with FUSE by a trio loop in a thread, for synchronous tests."""

    def __init__(self, cfg: kvfs.StoreConfig, mountpoint: Path) -> None:
        self.cfg, self.mountpoint = cfg, mountpoint
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        async with kvfs.open_store(self.cfg) as store, trio.open_nursery() as nursery:
            self.token = trio.lowlevel.current_trio_token()
            self.scope = nursery.cancel_scope
            await nursery.start(serve_mount, store, self.mountpoint, MountOptions())
            self.ready.set()

    def __enter__(self) -> Path:
        self.thread.start()
        if not self.ready.wait(60) or self.error is not None:
            raise RuntimeError(f"mount failed: {self.error!r}") from self.error
        return self.mountpoint

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(60)
        if self.error is not None:
            raise self.error
