"""The by-path fast path on a real kvfs FUSE mount: extents from ``user.kvfs.extents``,
data straight from the backing files, the open mount file keeping them in place."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _kvfs_mount import ServedMount
from test_gds import KiB, MiB, aligned, rand

import gds
import kvfs


def write(path: Path, data: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.tobytes())


def test_read_by_path_on_a_mount(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    with ServedMount(make_config(ndev=3, stripe_unit=64 * KiB), mp), gds.FastPath() as fp:
        pages = {
            mp / f"sessions/s/p/layer-{i:03d}": rand(MiB * i + 4096 * i + 3, seed=i)
            for i in range(1, 4)
        }
        for p, d in pages.items():
            write(p, d)
        dests = {p: aligned(d.nbytes) for p, d in pages.items()}
        futs = {p: fp.read_path(p, dests[p]) for p in pages}
        for p, d in pages.items():
            assert futs[p].result() == d.nbytes
            assert np.array_equal(dests[p], d)
        # A directory on the mount is no page.
        try:
            fp.read_path(mp / "sessions/s/p", aligned(4096))
        except (gds.NotAKvfsPage, IsADirectoryError):
            pass
        else:
            raise AssertionError("a directory was read as a page")


def test_unlink_on_the_mount_during_a_read(
    make_config: Callable[..., kvfs.StoreConfig], tmp_path: Path
) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    pool.submit(gate.wait)  # the read is queued with the mount file open
    with (
        ServedMount(make_config(ndev=2, stripe_unit=64 * KiB), mp),
        gds.FastPath(io_pool=pool) as fp,
    ):
        p = mp / "sessions/s/p/layer-000"
        data = rand(2 * MiB + 100)
        write(p, data)
        import json

        files = {e[0] for e in json.loads(os.getxattr(p, "user.kvfs.extents"))}
        dest = aligned(data.nbytes)
        fut = fp.read_path(p, dest)
        os.unlink(p)
        assert not p.exists()
        assert all(os.path.exists(f) for f in files)  # the open handle holds the lease
        gate.set()
        assert fut.result() == data.nbytes
        assert np.array_equal(dest, data)
    pool.shutdown()
