"""A daemon, and a store, out of file descriptors (RLIMIT_NOFILE).

The daemon holds a data file open per device for each file being written through the mount
(and SQLite a connection per worker thread), so an engine with hundreds of files open for
writing needs more descriptors than the soft limit most services start with. These tests
start the daemon under a small limit: it raises its soft limit to the hard one.
"""

from __future__ import annotations

from pathlib import Path

from _kvfs_mount import DaemonMount

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
