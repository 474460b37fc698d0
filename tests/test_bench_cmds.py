"""`kvfs bench gds`, `ttft`, `fuse` and `archive` run end to end at tiny sizes (correctness,
not speed: the figures go to docs/benchmarks.md, never into an assertion)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import statistics
import sys
import threading
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli.__main__ import main

#: ``terminal(argv)`` -> (exit code, stdout, what stderr's terminal got)
Terminal = Callable[[list[str]], tuple[int, str, str]]


def _read_terminal(master: int) -> bytes:
    """Everything written to a pseudo-terminal until its last writer closes it."""
    got = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: no writer left, all read
            break
        if not chunk:
            break
        got.append(chunk)
    return b"".join(got)


@pytest.fixture
def terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Terminal:
    """The command in this process with its stderr on a terminal (a pseudo-terminal), as a
    user at one runs it: progress lines show only there."""

    def go(argv: list[str]) -> tuple[int, str, str]:
        master, slave = pty.openpty()
        tty.setraw(slave)  # (a "\n" stays one)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(_read_terminal(master)))
        reader.start()
        try:
            with open(slave, "w") as err, monkeypatch.context() as m:
                m.setattr(sys, "stderr", err)
                capsys.readouterr()
                rc = main(argv)
        finally:
            reader.join()
            os.close(master)
        return rc, capsys.readouterr().out, got[0].decode()

    return go


def test_bench_gds_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gds", "--sizes", "1", "--layers", "2", "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    methods = {r["method"] for r in res["results"]}
    assert {"raw", "fastpath", "store.get"} <= methods
    assert all(r["gbps"] > 0 for r in res["results"])
    assert "[1/1]" not in captured.err  # no progress with --json


def test_bench_ttft_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="needs the engines extra (make test installs it)")
    # 300: one whole page (256 tokens) saved, 299 asked for: it said "same token: NO"
    args = ["bench", "ttft", "--model", "small", "--tokens", "256,300", "--repeat", "1"]
    assert main([*args, "--dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert [r["tokens"] for r in res["rows"]] == [256, 300]
    assert all(r["same_first_token"] for r in res["rows"])  # the loaded cache gives the same token
    assert "[2/2]" not in captured.err  # no progress with --json
    # under one page: a clear error (it was "max() arg is an empty sequence")
    args = ["bench", "ttft", "--model", "small", "--tokens", "128", "--no-archive"]
    assert main([*args, "--dir", str(tmp_path)]) == 2
    assert "must be at least 256 tokens" in capsys.readouterr().err


def test_bench_fuse_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real mount (and the null pyfuse3 file system beside it): every figure
    present and positive, both unmounted, the scratch removed. The cold phases drop only
    the benchmark's own files from the cache (as a user who is not root gets), not the whole
    machine's."""
    from kvfs.bench import fuse

    monkeypatch.setattr(fuse, "_drop_caches", fuse._fadvise_dontneed)
    args = ["bench", "fuse", "--sizes", "1", "--clients", "1,2", "--total", "2"]
    assert main([*args, "--dir", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["size_mib"], r["clients"], r["pages"]) for r in res["results"]] == [
        (1, 1, 2),
        (1, 2, 2),
    ]
    for r in res["results"]:
        for k in ("write_plain", "write_null", "write_mount", "cold_backing", "cold_mount"):
            assert r[f"{k}_gbps"] > 0, k
        assert r["warm_mount_gbps"] > 0
        # GB/s, as the table: it was bytes/s under the table's names
        assert "cold_mount" not in r
        ratio = r["cold_mount_gbps"] / r["cold_backing_gbps"]
        assert r["ratio_cold_vs_backing"] == pytest.approx(ratio)
        assert r["ratio_write_vs_null"] == pytest.approx(
            r["write_mount_gbps"] / r["write_null_gbps"]
        )
    assert res["cache_drop"] == "fadvise"
    assert list(tmp_path.iterdir()) == []
    assert "kvfs-null" not in Path("/proc/mounts").read_text()
    # --repeat: each figure is the median of the rounds, which --json lists
    args = ["bench", "fuse", "--sizes", "1", "--clients", "1", "--total", "1", "--repeat", "3"]
    assert main([*args, "--dir", str(tmp_path), "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert len(r["rounds"]) == 3
    for k in (
        "write_mount_gbps",
        "cold_mount_gbps",
        "ratio_cold_vs_backing",
        "ratio_warm_vs_plain",
    ):
        assert r[k] == sorted(x[k] for x in r["rounds"])[1], k
    # the table shows the durable-for-durable write ratio too (it was only in the JSON)
    args = ["bench", "fuse", "--sizes", "1", "--clients", "1", "--total", "1"]
    assert main([*args, "--dir", str(tmp_path)]) == 0
    head, _, row = capsys.readouterr().out.splitlines()[:3]
    cols = re.split(r"  +", head.strip())
    assert cols[5:9] == ["mount", "ratio", "vs +fsync", "vs null"], cols
    assert len(row.split()) == len(cols) and row.split()[7].endswith("x")


def test_bench_archive_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Against its own moto server (here at nice 5, read back from the running server):
    spill, restore, the baselines, the compression table and the read latencies all come
    back."""
    args = ["bench", "archive", "--pages", "3", "--page-mib", "0.25", "--repeat", "1"]
    args += ["--latency-reads", "20", "--numpy-kv", "--tokens", "64", "--layers", "1"]
    assert main([*args, "--server-nice", "5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert "nice 5" in res["endpoint"]
    for k in ("spill_mbps", "restore_mbps", "boto3_put_mbps", "boto3_get_mbps"):
        assert res[k] > 0, k
    assert [c["dtype"] for c in res["compression"]] == ["fp16", "bf16", "fp32"]
    assert all(0 < c["shuffle_zstd_ratio"] < 1 for c in res["compression"])
    assert res["read_p99_idle_ms"] > 0 and res["reads_during_spill"] >= 20
    assert res["reads_during_boto3"] >= 20 and res["boto3_upload_s"] > 0


def test_bench_archive_floor_times_its_reads_while_the_uploads_run(
    s3_server: Any, tmp_path: Path
) -> None:
    """The latency floor's reads ("while another process uploads the same bytes with plain
    boto3") were timed from the moment the uploader process was started: its Python start
    and boto3 import, longer than the uploads of a small session, were taken for uploading
    (1040 reads beside two 0.1 MiB pages, against 100 during the spill of the same pages).
    They are timed once it is about to upload, on the clock both processes share."""
    import kvfs
    from kvfs.bench import archive

    bucket = s3_server.new_bucket()
    pages = [bytes([i + 1]) * (256 << 10) for i in range(2)]
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "d",))) as s:
        for i, k in enumerate(archive._HOT):  # (the pages the reads time)
            s.put(k, pages[i % 2] + i.to_bytes(8, "little"))
        floor = archive._latency_beside_boto3(
            s, s3_server.endpoint, bucket, "floor", pages, 2, tmp_path
        )
    assert floor["first_read"] >= floor["upload_started"]
    assert len(floor["reads"]) >= 20 and floor["upload_s"] > 0
    assert s3_server.keys(bucket) == ["floor/0", "floor/1"]
    assert not (tmp_path / "floor.bin").exists()


CONTROL = ["bench", "control", "--small", "1000", "--small-pages", "3", "--large", "64KiB"]
CONTROL += ["--large-pages", "2", "--clients", "1", "--repeat", "1", "--no-worker-process"]


def test_bench_control_table_and_progress(terminal: Terminal) -> None:
    """It ran ~26 s with nothing on stderr, and a 1000-byte page size showed as "0 KiB"."""
    rc, out, err = terminal(CONTROL)
    assert rc == 0
    assert "small pages, round 1/1" in err and "large pages, round 1/1" in err
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows[:2]] == [
        ("small", "1000", "B", "put"),
        ("small", "1000", "B", "get"),
    ], out


def test_bench_shows_no_progress_with_json_or_off_a_terminal(
    terminal: Terminal, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line per round came on stderr with --json too, and into a file or pipe that took
    stderr: a script asking for JSON got them in its log. The other commands draw their
    progress bars only on a terminal and never with --json; bench now does the same."""
    rc, out, err = terminal([*CONTROL, "--json"])
    assert rc == 0 and json.loads(out)["results"]
    assert "round" not in err, err
    capsys.readouterr()
    assert main(CONTROL) == 0  # (stderr is pytest's capture: no terminal)
    captured = capsys.readouterr()
    assert "small" in captured.out and "round" not in captured.err, captured.err


def test_bench_ttft_sharing_shows_progress(tmp_path: Path, terminal: Terminal) -> None:
    pytest.importorskip("torch", reason="needs the engines extra (make test installs it)")
    args = ["bench", "ttft", "--sharing", "--model", "small", "--sessions", "2"]
    args += ["--system-tokens", "256", "--user-tokens", "64", "--dir", str(tmp_path)]
    rc, out, err = terminal(args)
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("agent-")]
    assert len(rows) == 2 and all(r.endswith("yes") for r in rows), out  # same first token
    assert "[2/2] session agent-001" in err


@pytest.mark.parametrize(
    "args",
    [
        ["gds", "--rounds", "0"],  # "no median for empty data", after writing every page
        ["gds", "--layers", "-3"],  # ran 32 layers and reported -3
        ["store", "--repeat", "0"],  # said "best of 0 rounds" and ran one
        ["store", "--index", "-5"],
        ["archive", "--pages", "0"],  # "integer modulo by zero"
        ["archive", "--latency-reads", "0"],  # "list index out of range"
        ["ttft", "--sharing", "--sessions", "0"],  # "division by zero"
        ["control", "--clients", "x"],
        ["archive", "--page-mib", "0"],  # "float division by zero", after the whole run
        ["archive", "--page-mib", "-2"],
        ["archive", "--page-mib", "inf"],  # a traceback (OverflowError)
        ["archive", "--page-mib", "nan"],
        ["archive", "--level", "23"],  # refused by zstd only after the model had run
        ["archive", "--level", "0"],  # a level no store can be set to (archive.zstd_level)
    ],
)
def test_bench_refuses_a_count_out_of_range_before_it_starts(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2
    assert f"argument {args[-2]}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "ttft", "--tokens", ","], "--tokens takes positive integers"),  # empty table
        (["bench", "ttft", "--tokens", "abc"], "--tokens takes positive integers"),
        (["bench", "control", "--small", "5"], "--small 5: pages need 8 bytes"),  # "5 B" of 8
        # more than the disk holds: the store's eviction deleted the benchmark's own pages
        (["bench", "gds", "--sizes", "1000000", "--layers", "4"], "MiB free: give --dir"),
        (["bench", "control", "--large", "1TiB", "--large-pages", "9"], "MiB free: give --dir"),
    ],
)
def test_bench_refuses_a_bad_value_before_it_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_a_context_with_no_whole_page(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvfs demo --tokens 100`` saved nothing, then ended in "no session 'agent-demo'"."""
    with pytest.raises(SystemExit) as e:
        main(["demo", "--tokens", "100"])
    assert e.value.code == 2
    assert "must be 257 or more" in capsys.readouterr().err


def test_bench_archive_leaves_the_users_bucket_as_it_was(
    s3_server: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--endpoint``/``--bucket`` every round's objects (the boto3 baseline's, the
    latency floor's, the store's blobs and manifests) stayed in the user's bucket: ~250 MB a
    default run. What was there before stays; a run interrupted half-way deletes its own."""
    from kvfs.bench import archive

    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="theirs/keep", Body=b"x")
    args = ["bench", "archive", "--pages", "3", "--page-mib", "0.25", "--repeat", "2"]
    args += ["--latency-reads", "20", "--numpy-kv", "--tokens", "64", "--layers", "1"]
    args += ["--endpoint", s3_server.endpoint, "--bucket", bucket]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert s3_server.keys(bucket) == ["theirs/keep"]
    # each ratio is the median of the rounds' own (it was best / best, of different rounds)
    for k in ("spill", "restore"):
        assert len(res["round_ratios"][k]) == 2
        assert res[f"{k}_ratio"] == statistics.median(res["round_ratios"][k])

    def interrupted(*_: object) -> None:
        assert len(s3_server.keys(bucket)) > 1  # (uploads were made, and are to be deleted)
        raise KeyboardInterrupt

    monkeypatch.setattr(archive, "_latency", interrupted)
    assert main(args) == 130
    assert "interrupted" in capsys.readouterr().err
    assert s3_server.keys(bucket) == ["theirs/keep"]


def test_bench_archive_baseline_pool_fits_the_concurrency(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """boto3's default pool holds 10 connections, kvfs's is sized to the concurrency: with
    --concurrency 16 the baseline (and the latency floor's uploader process) discarded
    connections ("Connection pool is full") and the ratio favoured kvfs."""
    args = ["bench", "archive", "--pages", "32", "--page-mib", "0.25", "--repeat", "1"]
    args += ["--latency-reads", "20", "--numpy-kv", "--tokens", "64", "--layers", "1"]
    assert main([*args, "--concurrency", "16", "--json"]) == 0
    said = capfd.readouterr().err + caplog.text  # (the uploader process's, this one's)
    assert "Connection pool is full" not in said


def test_bench_archive_ctrl_c_says_interrupted_and_stops_its_server() -> None:
    """A Ctrl-C at the terminal reached the moto server too (one process group): it died
    first and the run ended on a network error, its uploads not deleted. The server now
    outlives the benchmark's own handling of the interrupt, and is stopped last."""
    import signal
    import subprocess

    args = ["bench", "archive", "--pages", "24", "--page-mib", "0.5", "--repeat", "3"]
    args += ["--latency-reads", "20", "--numpy-kv", "--tokens", "64", "--layers", "1"]
    master, slave = pty.openpty()  # stderr on a terminal: the rounds show there
    tty.setraw(slave)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        start_new_session=True,  # its own process group, as a shell gives a command
    )
    os.close(slave)
    err = ""
    while "round 1/3" not in err:  # (in round 2 now: uploads made, the server busy)
        try:
            chunk = os.read(master, 65536).decode()
        except OSError:  # EIO: it exited
            chunk = ""
        assert chunk, err
        err += chunk
    servers = [
        pid
        for pid in (int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())
        if _ppid(pid) == proc.pid and b"moto.server" in _cmdline(pid)
    ]
    assert len(servers) == 1
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    err += _read_terminal(master).decode()
    os.close(master)
    assert proc.wait(timeout=120) == 130, err
    assert err.endswith("kvfs: interrupted\n"), err
    assert "warning" not in err and "Traceback" not in err, err
    import time

    gone_by = time.monotonic() + 30  # (stopped before the benchmark exits; reaped by init)
    while _ppid(servers[0]) and not _zombie(servers[0]):  # (0: gone)
        assert time.monotonic() < gone_by, "the moto server outlived the benchmark"
        time.sleep(0.05)


def test_bench_fuse_killed_leaves_no_daemon_or_mount(tmp_path: Path) -> None:
    """A killed ``kvfs bench fuse`` (SIGKILL, or SIGTERM, which Python does not turn into a
    clean-up) left its kvfs mount daemon and its null pyfuse3 file system serving their
    mounts on its scratch directory, for good. Both now exit with it, and their mounts go."""
    import signal
    import subprocess
    import time

    args = ["bench", "fuse", "--sizes", "1", "--clients", "1", "--total", "4", "--repeat", "400"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args, "--dir", str(tmp_path)],
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def mounts() -> list[str]:
        return [ln for ln in Path("/proc/mounts").read_text().splitlines() if str(tmp_path) in ln]

    helpers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(mounts()) < 2:  # (the kvfs mount and the null one)
            assert proc.poll() is None and time.monotonic() < deadline, mounts()
            time.sleep(0.05)
        helpers = [
            pid
            for pid in (int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())
            if _ppid(pid) == proc.pid
        ]
        assert len(helpers) == 2, [_cmdline(p) for p in helpers]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone_by = time.monotonic() + 60
        while mounts() or any(_ppid(p) and not _zombie(p) for p in helpers):
            assert time.monotonic() < gone_by, (mounts(), helpers)
            time.sleep(0.05)
    finally:  # (what a failed check left: no daemon, no mount)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for line in mounts():
            subprocess.run(["fusermount3", "-u", "-z", line.split()[1]], check=False)


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


#: each benchmark that writes into a directory given on the command line, at its smallest
SCRATCH_FLAGS = {
    "store": ["--sizes", "1", "--clients", "1", "--total", "1", "--data"],
    "gds": ["--sizes", "1", "--layers", "1", "--dir"],
    "control": ["--small-pages", "2", "--large-pages", "2", "--repeat", "1", "--dir"],
    "ttft": ["--model", "small", "--tokens", "256", "--repeat", "1", "--no-archive", "--dir"],
    "fuse": ["--sizes", "1", "--clients", "1", "--total", "1", "--dir"],
}


@pytest.mark.parametrize("bench", sorted(SCRATCH_FLAGS))
def test_bench_refuses_a_scratch_directory_that_is_not_one(
    bench: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing --dir/--data was exit 1 or 3, and ``store --data /nonexistent/x`` made the
    path with its parents and left it; a file was exit 1. Both are usage errors, and
    nothing is created."""
    missing = tmp_path / "no" / "such"
    assert main(["bench", bench, *SCRATCH_FLAGS[bench], str(missing)]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_bytes(b"")
    assert main(["bench", bench, *SCRATCH_FLAGS[bench], str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_bench_refuses_a_read_only_scratch_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only --dir/--data was taken, and each run failed only when it made its scratch
    directory there, with "Read-only file system" and exit 10 (a failing disk's code); fuse
    said it was on tmpfs. It is a usage error, said before any work."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        for bench, flags in sorted(SCRATCH_FLAGS.items()):
            assert main(["bench", bench, *flags, str(ro)]) == 2, bench
            err = capsys.readouterr().err
            assert f"{ro}: not writable" in err, (bench, err)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert list(ro.iterdir()) == []


def test_bench_refuses_a_scratch_directory_on_a_kvfs_mount(
    tmp_path: Path, make_config: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a kvfs mount the benchmarks failed with EINVAL or "Directory not empty" (exit 1)
    and left their kvfs-bench-* directories there; fuse explained, but exited 1."""
    from _kvfs_mount import daemon_mount

    with daemon_mount(make_config(ndev=1, name="mounted"), tmp_path / "mnt") as mp:
        before = sorted(p.name for p in mp.iterdir())
        for bench, flags in sorted(SCRATCH_FLAGS.items()):
            assert main(["bench", bench, *flags, str(mp)]) == 2, bench
            assert f"is on the kvfs mount {mp}" in capsys.readouterr().err, bench
        assert sorted(p.name for p in mp.iterdir()) == before


@pytest.mark.parametrize("bench", ["store", "fuse"])
def test_bench_refuses_a_file_system_too_small_before_it_starts(
    bench: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an 8 MiB file system ``bench store --total 5`` failed half-way with "no page
    'bench/c0/p0'" (exit 3): the store's eviction deleted the benchmark's own pages (raw
    files and pages, 10 MiB, are there together). Here tmp_path says it has 8 MiB free."""
    import os

    real = os.statvfs

    def small(path: Any) -> os.statvfs_result:
        st = list(real(path))
        if Path(path).resolve().is_relative_to(tmp_path):
            st[1], st[3], st[4] = 4096, 2048, 2048  # f_frsize, f_bfree, f_bavail
        return os.statvfs_result(st)

    monkeypatch.setattr(os, "statvfs", small)
    flag = "--data" if bench == "store" else "--dir"
    args = ["bench", bench, "--sizes", "1", "--clients", "1", "--total", "5", flag, str(tmp_path)]
    assert main(args) == 2
    assert f"10 MiB into {tmp_path}, which has 8 MiB free: give {flag}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path on a file system that refuses O_DIRECT with EINVAL, as tmpfs did before
    Linux 6.6 and some overlays still do (the kernel here may take it on tmpfs)."""
    import errno
    import os

    real = os.open

    def open_(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_DIRECT and Path(path).resolve().is_relative_to(tmp_path):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_)
    return tmp_path


@pytest.mark.parametrize("bench", ["store", "gds"])
def test_bench_says_when_the_raw_baseline_was_not_o_direct(
    bench: str, no_o_direct: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where O_DIRECT is refused the "raw O_DIRECT" baseline silently read the page cache:
    the JSON and the table header say which it was, and stderr warns."""
    flag = "--data" if bench == "store" else "--dir"
    args = ["bench", bench, "--sizes", "1", flag, str(no_o_direct)]
    args += ["--clients", "1", "--total", "1"] if bench == "store" else ["--layers", "1"]
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert (res if bench == "store" else res["conditions"])["raw_o_direct"] is False
    assert "refused O_DIRECT: the raw baseline used buffered I/O" in captured.err
    assert main(args) == 0
    assert "buffered (O_DIRECT refused)" in capsys.readouterr().out.splitlines()[0]
    assert list(no_o_direct.iterdir()) == []


def test_bench_ttft_raw_read_records_o_direct_refused(no_o_direct: Path) -> None:
    from types import SimpleNamespace

    from kvfs.bench._common import DirectUse
    from kvfs.bench.ttft import raw_read

    (no_o_direct / "f").write_bytes(b"x" * 8192)
    direct = DirectUse()
    raw_read([SimpleNamespace(path=str(no_o_direct / "f"), offset=0, length=8192)], 2, direct)
    assert not direct.o_direct


def test_bench_store_index_says_where_it_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its figures came without the machine facts every other benchmark records."""
    args = ["bench", "store", "--index", "20", "--data", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["machine"]["cpus"] > 0 and res["machine"]["kernel"] and res["pages"] == 20
    assert main(args) == 0
    assert " CPUs, kernel " in capsys.readouterr().out.splitlines()[0]


def test_bench_control_ratio_is_the_median_of_the_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The ratios were the best remote round over the best in-process round, possibly two
    rounds under different load; bench store takes the median of each round's own."""
    args = ["bench", "control", "--small", "1000", "--small-pages", "3", "--large", "64KiB"]
    args += ["--large-pages", "2", "--clients", "1", "--repeat", "3", "--json"]
    assert main(args) == 0
    for r in json.loads(capsys.readouterr().out)["results"]:
        assert len(r["round_ratios"]) == 3 and len(r["worker_round_ratios"]) == 3
        assert r["ratio"] == statistics.median(r["round_ratios"])
        assert r["worker_ratio"] == statistics.median(r["worker_round_ratios"])


def test_bench_archive_without_list_permission_says_what_it_needs(
    s3_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user who may put, get and delete objects but not list the bucket got botocore's
    "An error occurred (AccessDenied) when calling the ListObjectsV2 operation", exit 1,
    after the KV tensors were made. kvfs's archive lists its manifests and the benchmark
    its own run's keys (to delete only those), so s3:ListBucket is needed: the run says so
    before any work, as an access error (exit 8)."""
    from _s3 import iam_credentials

    bucket = s3_server.new_bucket()
    policy = [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"},
    ]
    args = ["bench", "archive", "--pages", "3", "--page-mib", "0.25", "--repeat", "1"]
    args += ["--latency-reads", "20", "--numpy-kv", "--tokens", "64", "--layers", "1"]
    args += ["--endpoint", s3_server.endpoint, "--bucket", bucket]
    with iam_credentials(s3_server, policy):
        assert main(args) == 8
    err = capsys.readouterr().err
    assert "s3:ListBucket" in err and bucket in err, err
    assert "generating KV tensors" not in err, err  # (before minutes of work)
    assert s3_server.keys(bucket) == []
