"""Fixtures shared by every test module. Area-specific fixtures live beside their tests."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvfs

KiB = 1024
MiB = 1024 * KiB

# The commands the tests start get Ctrl-C's default action, as from a terminal. A shell
# without job control starts a background job (`make test &`, a CI runner's step) with
# SIGINT ignored, which every child inherits: `kvfs mount` then went on through the SIGINT a
# test sent it and mounted (exit 0), where the test expects what Ctrl-C does (exit 130).
# (Python's own handler, unlike an ignored signal, is reset to the default at exec.)
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., kvfs.StoreConfig]:
    """``make_config(ndev=3, stripe_unit=64*KiB, capacity=0, **kw)`` under tmp_path."""

    def make(
        ndev: int = 3,
        stripe_unit: int = 64 * KiB,
        capacity: int = 0,
        name: str = "store",
        **kw: object,
    ) -> kvfs.StoreConfig:
        dirs = tuple(tmp_path / name / f"nvme{i}" for i in range(ndev))
        return kvfs.StoreConfig(data_dirs=dirs, stripe_unit=stripe_unit, capacity=capacity, **kw)  # type: ignore[arg-type]

    return make


@pytest.fixture
def sync_store(make_config: Callable[..., kvfs.StoreConfig]) -> Iterator[kvfs.SyncStore]:
    with kvfs.open_store_sync(make_config()) as s:
        yield s


# -- archive tier: a real S3 server (moto over HTTP on loopback) for the whole session ------
@pytest.fixture(scope="session")
def s3_server() -> Iterator[object]:
    """``S3Server`` (tests/_s3.py): ``.endpoint``, ``.new_bucket()``, ``.keys(bucket)``."""
    from _s3 import running_moto

    with running_moto() as server:
        yield server


@pytest.fixture
def proxy(s3_server) -> Iterator[object]:  # noqa: ANN001
    """A ``TcpProxy`` (tests/_s3.py) in front of the S3 server: ``.endpoint``, ``.down()``,
    ``.up()``, ``.sent`` (bytes clients sent through it)."""
    from urllib.parse import urlsplit

    from _s3 import TcpProxy

    u = urlsplit(s3_server.endpoint)
    p = TcpProxy((u.hostname, u.port))
    yield p
    p.close()


# -- a disk that fails under a running store (tests/_loop_disk.py) --------------------------
@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[object]:
    """A ``LoopDisk`` (tests/_loop_disk.py): ext4 on a loop device mounted at ``.path``;
    ``.shut_down()`` makes every I/O there fail with EIO, ``.comeback()`` mounts it again."""
    from _loop_disk import made_loop_disk

    with made_loop_disk(tmp_path) as disk:
        yield disk


# -- engine suites: a directory on a kvfs mount (or a plain one, the control) -------------
@pytest.fixture(params=["mount", "directory"])
def kvfs_dir(
    request: pytest.FixtureRequest, tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> Iterator[Path]:
    """A directory on a real kvfs FUSE mount served by a ``kvfs mount`` daemon process (as
    an engine meets it), or a plain directory."""
    if request.param == "mount":
        from _kvfs_mount import daemon_mount

        with daemon_mount(make_config(ndev=2, name="mounted"), tmp_path / "mnt") as mp:
            yield mp
    else:
        d = tmp_path / "plain"
        d.mkdir()
        yield d


#: ``run("ls", "--json")`` -> (exit code, stdout, stderr) of the kvfs command, in process.
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """The ``kvfs`` command in this process, from an empty working directory and with no
    ``KVFS_*`` variables leaking in from the environment."""
    from cli.__main__ import main

    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith("KVFS_")]:
        monkeypatch.delenv(var)

    def go(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main([*argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return go
