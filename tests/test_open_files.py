"""A daemon, and a store, out of file descriptors (RLIMIT_NOFILE).

The daemon holds a data file open per device for each file being written through the mount
(and SQLite a connection per worker thread), so an engine with hundreds of files open for
writing needs more descriptors than the soft limit most services start with. These tests
start the daemon under a small limit: it raises its soft limit to the hard one; where the
hard limit is reached, the calls that need a descriptor fail with EMFILE, said once in the
log, and nothing is lost or published torn (docs/mount.md, "Errors").
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _kvfs_mount import DaemonMount

import kvfs

KiB = 1024
CHUNK = 70 * KiB  # over a 64 KiB stripe unit: each round of writes reaches another device


def daemon(tmp_path: Path, nofile: tuple[int, int]) -> DaemonMount:
    data = [tmp_path / f"nvme{i}" for i in range(3)]
    mp = tmp_path / "mnt"
    mp.mkdir()
    return DaemonMount(
        data, mp, tmp_path / "daemon.log", "--stripe-unit", str(64 * KiB), nofile=nofile
    )


def write_interleaved(
    d: Path, n: int, rounds: int = 3, prefix: str = "w"
) -> tuple[dict[str, bytes], list[int]]:
    """``n`` files open for writing at once in ``d``, each written ``rounds`` times in
    turn, then closed: the content of those whose writes and close all succeeded, and the
    errnos the others got."""
    files = {f"{prefix}{i}": open(d / f"{prefix}{i}", "wb", buffering=0) for i in range(n)}  # noqa: SIM115
    content = {name: b"" for name in files}
    errors: list[int] = []
    for r in range(rounds):
        for name, f in files.items():
            chunk = bytes([r + 1]) * CHUNK
            try:
                f.write(chunk)
                content[name] += chunk
            except OSError as e:
                errors.append(e.errno or 0)
                content[name] = b"!"  # (its close must fail too: never published)
    for name, f in files.items():
        try:
            f.close()
        except OSError as e:
            errors.append(e.errno or 0)
            content.pop(name)
    return content, errors


def test_the_daemon_raises_its_open_files_limit_for_many_writers(tmp_path: Path) -> None:
    # A soft limit of 64 (hard 4096): 100 files open for writing need ~300 descriptors.
    # Before, every write past the soft limit failed with EMFILE.
    with daemon(tmp_path, (64, 4096)) as mp:
        d = mp / "engine"
        d.mkdir()
        written, errors = write_interleaved(d, 100)
        assert errors == []
        assert len(written) == 100
        for name, data in written.items():
            assert (d / name).read_bytes() == data
    assert (
        "open files limit (RLIMIT_NOFILE) raised from 64 to 4096"
        in (tmp_path / "daemon.log").read_text()
    )


def test_a_daemon_out_of_descriptors_answers_emfile_and_loses_nothing(tmp_path: Path) -> None:
    pages = {f"p{i}": os.urandom(100 * KiB + i) for i in range(10)}
    with daemon(tmp_path, (80, 80)) as mp:
        d = mp / "engine"
        d.mkdir()
        for name, data in pages.items():
            (d / name).write_bytes(data)
        # 40 files open for writing need ~120 descriptors: some writes cannot be made
        files = {f"w{i}": open(d / f"w{i}", "wb", buffering=0) for i in range(40)}  # noqa: SIM115
        for f in files.values():
            try:
                f.write(b"x" * CHUNK)
                f.write(b"y" * CHUNK)
            except OSError as e:
                assert e.errno == errno.EMFILE
        # meanwhile: readers and a listing get the page or EMFILE, never EIO
        for name, data in pages.items():
            try:
                assert (d / name).read_bytes() == data
            except OSError as e:
                assert e.errno == errno.EMFILE, e
        try:
            assert set(pages) <= set(os.listdir(d))
        except OSError as e:
            assert e.errno == errno.EMFILE, e
        # and a client of the control channel waits to be accepted, or gets EMFILE
        try:
            with kvfs.open_remote_store_sync(tmp_path / "nvme0" / "kvfs.sock", timeout=2) as c:
                assert c.get("engine/p0") == pages["p0"]
        except kvfs.DaemonUnavailable:
            pass
        except OSError as e:
            assert e.errno == errno.EMFILE, e
        closed = set()
        for name, f in files.items():
            try:
                f.close()
                closed.add(name)
            except OSError as e:
                assert e.errno == errno.EMFILE, e
        assert len(closed) < len(files)  # (the limit was met)
        # once the files are closed everything works again; each close that returned 0
        # published its page whole, and no other was published
        assert set(os.listdir(d)) == set(pages) | closed
        for name in closed:
            assert (d / name).read_bytes() == b"x" * CHUNK + b"y" * CHUNK
        for name, data in pages.items():
            assert (d / name).read_bytes() == data
        written, errors = write_interleaved(d, 5, prefix="again")
        assert errors == [] and all((d / n).read_bytes() == b for n, b in written.items())
    log = (tmp_path / "daemon.log").read_text()
    said = [x for x in log.splitlines() if "Too many open files" in x]
    assert said and all(" WARNING " in x for x in said), log
    mount_said = [x for x in said if " kvfs.fuse: " in x]
    assert mount_said and "the daemon's open files limit is 80" in mount_said[0], log
    assert " ERROR " not in log and "Traceback" not in log, log


def test_a_store_out_of_descriptors_raises_emfile_and_stays_clean(tmp_path: Path) -> None:
    # In a process of its own: the limit and the descriptors held are the process's.
    script = textwrap.dedent(
        """
        import errno, os, resource, sys, threading
        import kvfs
        dirs = tuple(os.path.join(sys.argv[1], f"nvme{i}") for i in range(2))
        cfg = kvfs.StoreConfig(data_dirs=dirs, stripe_unit=65536)
        with kvfs.open_store_sync(cfg) as s:
            s.put("e/kept", b"k" * 200_000)
            resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            held = []
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            got = []
            def calls():  # a thread of its own: its first read opens an index connection
                for name, call in [
                    ("stat", lambda: s.stat("e/kept")),
                    ("exists", lambda: s.exists("e/kept")),
                    ("get", lambda: s.get("e/kept")),
                    ("put", lambda: s.put("e/new", b"n" * 200_000)),
                ]:
                    try:
                        call()
                        got.append(f"{name}: ok")
                    except Exception as e:
                        got.append(f"{name}: {type(e).__name__} {getattr(e, 'errno', None)}")
            t = threading.Thread(target=calls)
            t.start()
            t.join()
            for fd in held:
                os.close(fd)
            print("; ".join(got))
            assert s.get("e/kept") == b"k" * 200_000
            assert not s.exists("e/new")
            assert not any(s.fsck().values())
        with kvfs.open_store_sync(cfg) as s:
            print("reopened:", sorted(p.path for p in s.list()))
        """
    )
    cp = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    # Before, the index's first read in a thread raised SQLite's bare OperationalError
    # ("unable to open database file"), which the mount answered EIO with a traceback.
    assert lines[0] == (
        f"stat: OSError {errno.EMFILE}; exists: OSError {errno.EMFILE}; "
        f"get: OSError {errno.EMFILE}; put: OSError {errno.EMFILE}"
    ), cp.stdout
    assert lines[1] == "reopened: ['e/kept']"
