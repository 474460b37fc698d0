"""The commands against a real mounted daemon (``kvfs mount --foreground`` in a subprocess),
over its control socket: the same results as on a stopped data directory, the pages visible
through the mount, metrics, a missing daemon and a daemon killed in the middle of a command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _kvfs_mount import DaemonMount, index_is_clean

from kvfs._mountinfo import mounts as kvfs_mounts_table

KVFS = [sys.executable, "-m", "cli"]
Run = Callable[..., tuple[int, str, str]]

if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:  # pragma: no cover
    pytest.fail("these tests need /dev/fuse and fusermount3", pytrace=False)


class Daemon(DaemonMount):
    def __init__(self, root: Path, *extra: str) -> None:
        self.data, self.mp = root / "data", root / "mnt"
        self.mp.mkdir(parents=True)
        super().__init__([self.data], self.mp, root / "daemon.log", *extra)

    expected_errors = 0

    def errors(self) -> list[str]:
        return [
            x
            for x in self.log.read_text(errors="replace").splitlines()
            if " ERROR " in x or "Traceback" in x
        ]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "m")
    try:
        yield d
    finally:
        d.stop()
    unexpected = d.errors()[d.expected_errors :]
    assert not unexpected, "the daemon logged errors:\n" + "\n".join(unexpected)


def test_commands_through_the_daemon(daemon: Daemon, run: Run, tmp_path: Path) -> None:
    d = ["--data", str(daemon.data), "--daemon"]
    payload = os.urandom(150_000)
    (tmp_path / "in").write_bytes(payload)
    rc, out, err = run("put", "in", "sessions/s1/p/layer-000", "--attr", "model=m", *d)
    assert rc == 0, err
    # the page is there for every client of the daemon: the mount shows it
    assert (daemon.mp / "sessions/s1/p/layer-000").read_bytes() == payload
    (daemon.mp / "sessions/s2/p").mkdir(parents=True)
    (daemon.mp / "sessions/s2/p/layer-000").write_bytes(b"m" * 5000)
    sessions = json.loads(run("ls", "--json", *d)[1])
    assert {s["session"] for s in sessions} == {"s1", "s2"}
    pages = json.loads(run("ls", "s1", "--json", *d)[1])
    assert pages[0]["attrs"] == {"model": "m"} and pages[0]["size"] == len(payload)
    assert run("get", "sessions/s2/p/layer-000", "out", *d)[0] == 0
    assert (tmp_path / "out").read_bytes() == b"m" * 5000
    st = json.loads(run("stats", "--json", *d)[1])
    assert st["puts"] >= 2 and st["pages"] == 2  # the daemon's own counters
    assert "HIT RATE" in run("stats", *d)[1]
    assert run("pin", "s1", *d)[0] == 0
    assert json.loads(run("ls", "--json", *d)[1])[0]["pinned"]
    assert run("unpin", "s1", *d)[0] == 0
    rc, _, err = run("evict", "s2", *d)
    assert rc == 9 and "--force" in err
    assert run("evict", "s2", "--force", *d)[0] == 0
    assert run("fsck", *d)[0] == 0
    assert run("rm", "s1", *d)[0] == 0
    assert run("ls", "s1", *d)[0] == 3
    rc, _, err = run("rm", "s1", *d)
    assert rc == 3 and err.count("\n") == 1
    rc, _, err = run("spill", "s2", *d)
    assert rc == 8  # this daemon has no archive tier: one structured line, a warning (the
    # caller's mistake, as without --progress; it was an ERROR through the progress path)
    logged = [x for x in daemon.log.read_text().splitlines() if "method=spill" in x]
    assert len(logged) == 1 and " WARNING " in logged[0]
    assert "event=error method=spill target=s2 error=ArchiveUnavailable" in logged[0]
    assert daemon.errors() == []
    # the data directory is the daemon's: opening it directly is refused with a clear line
    rc, _, err = run("ls", "--data", str(daemon.data), "--offline")
    assert rc == 6 and "in use by" in err and "drop --offline" in err


def test_get_through_the_daemon_holds_a_large_page_once(
    daemon: Daemon, run: Run, tmp_path: Path
) -> None:
    """`kvfs get` wrote a bytes made of the daemon's answer: the frame and the bytes, the
    page twice at its peak (tracemalloc, in this process: the client's side)."""
    import tracemalloc

    d = ["--data", str(daemon.data), "--daemon"]
    size = 32 << 20
    payload = os.urandom(size)
    (tmp_path / "in").write_bytes(payload)
    assert run("put", "in", "sessions/s1/p/layer-000", *d)[0] == 0
    tracemalloc.start()
    try:
        rc, _, err = run("get", "sessions/s1/p/layer-000", "out", *d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0, err
    assert (tmp_path / "out").read_bytes() == payload
    assert peak < 1.2 * size, peak / size  # the frame (before: 2.0)


def test_metrics_port_and_event_logs(tmp_path: Path, run: Run) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "kvfs.toml"  # the file's port is overridden by the flag
    conf.write_text(
        f'[archive]\narchive_url = "file://{tmp_path}/arch"\n'
        "[daemon]\nmetrics_port = 1\nmetrics_sessions = 5\n"
    )
    d = Daemon(tmp_path / "m", "--config", str(conf), "--metrics-port", str(port))
    try:
        flags = ["--data", str(d.data), "--daemon"]
        (tmp_path / "f").write_bytes(os.urandom(9000))
        assert run("put", "f", "sessions/a/p/layer-000", *flags)[0] == 0
        assert run("spill", "a", *flags)[0] == 0
        assert run("restore", "a", *flags)[0] == 0
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        )
        assert (
            "kvfs_pages 1" in text
            and 'kvfs_session_bytes{session="a",dir="sessions/a"} 9000' in text
        )
        assert "kvfs_archive_sessions_spilled_total 1" in text
    finally:
        d.stop()
    log = d.log.read_text()
    assert "event=spill target=a bytes=" in log and "event=restore target=a" in log
    assert not d.errors()


def test_missing_daemon_and_killed_mid_command(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cli._target

    d = Daemon(tmp_path / "m")
    flags = ["--data", str(d.data)]
    try:
        (tmp_path / "f").write_bytes(b"q" * 4096)
        assert run("put", "f", "sessions/a/p/layer-000", *flags)[0] == 0
        # freeze the daemon: a command gives up on it (it waited for ever)
        os.kill(d.proc.pid, signal.SIGSTOP)
        monkeypatch.setattr(cli._target, "PING_SECONDS", 0.5)
        rc, _, err = run("ls", "--daemon", *flags)
        assert rc == 7 and "did not answer within 0.5 s (stopped, or stuck)" in err
        # start a command (it connects and waits), then kill the daemon
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
        cmd = subprocess.Popen(
            [*KVFS, "ls", "--daemon", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while not _waiting_on_socket(cmd.pid):
            assert time.monotonic() < deadline and cmd.poll() is None, cmd.communicate()
            time.sleep(0.05)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=60)
        out, err = cmd.communicate(timeout=60)
        assert cmd.returncode == 7, err
        assert "closed the connection" in err and len(err.strip().splitlines()) == 1
    finally:
        d.stop()
    # no daemon now (its socket file is left behind): --daemon says so, the rest go offline
    rc, _, err = run("ls", "--daemon", *flags)
    assert rc == 7 and "no kvfs daemon answers" in err
    rc, out, _ = run("ls", "a", "--json", *flags)
    assert rc == 0 and json.loads(out)[0]["path"] == "sessions/a/p/layer-000"


def _waiting_on_socket(pid: int) -> bool:
    """True once ``pid`` sleeps reading a Unix stream socket (it sent its request), or
    polls one (a socket with a timeout)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().startswith(("unix_stream", "do_sys_poll", "poll_schedule"))
    except OSError:
        return False


_WORKER = """
import sys, kvfs
with kvfs.open_remote_store_sync(sys.argv[1]) as s:
    for i in range(20):
        s.put(f"sessions/w{sys.argv[2]}/p/layer-{i:03d}", bytes([int(sys.argv[2])]) * 5000)
    print(sum(len(s.get(f"sessions/w{sys.argv[2]}/p/layer-{i:03d}")) for i in range(20)))
"""


def test_worker_processes_share_the_daemon_store(daemon: Daemon) -> None:
    """Several engine workers (processes) use one daemon's store through the client."""
    sock = daemon.data / "kvfs.sock"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(sock), str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == str(20 * 5000)
    for w in range(3):
        assert (daemon.mp / f"sessions/w{w}/p/layer-019").read_bytes() == bytes([w]) * 5000


def test_retention_through_a_mounted_daemon(tmp_path: Path, run: Run) -> None:
    """A daemon with ``retention`` deletes an engine directory nobody opened for that long,
    spilled or not, and keeps one whose file is opened and read all along, though the
    kernel's page cache answers those reads (the opens reach the daemon)."""
    conf = tmp_path / "kvfs.toml"
    conf.write_text(
        f'[archive]\narchive_url = "file://{tmp_path}/arch"\n'
        'retention = "4s"\nspill_interval = 0.1\n'
    )
    d = Daemon(tmp_path / "m", "--config", str(conf))
    stop, misreads = threading.Event(), []

    def use(path: Path) -> None:  # an engine reading its cache all along
        while not stop.is_set():
            try:
                if path.read_bytes() != b"used" * 20_000:
                    misreads.append("wrong bytes")
            except OSError as e:
                misreads.append(repr(e))
            time.sleep(0.2)

    try:
        flags = ["--data", str(d.data), "--daemon"]
        used = d.mp / "used" / "model@0@hash.data"
        (d.mp / "used").mkdir()
        used.write_bytes(b"used" * 20_000)
        reader = threading.Thread(target=use, args=(used,))
        reader.start()
        for name in ("idle", "spilled"):
            (d.mp / name).mkdir()
            (d.mp / name / "model@0@hash.data").write_bytes(name.encode() * 20_000)
        assert run("spill", "spilled", *flags)[0] == 0  # the name ls shows
        t0 = time.monotonic()
        while (d.mp / "idle" / "model@0@hash.data").exists() or (
            d.mp / "spilled" / "model@0@hash.data"
        ).exists():
            assert time.monotonic() - t0 < 60, "the untouched directories were never deleted"
            time.sleep(0.2)
        time.sleep(4.5)  # a whole retention more: "used" is still being used
        stop.set()
        reader.join()
        assert not misreads, misreads[:3]
        sessions = {s["session"] for s in json.loads(run("ls", "--json", *flags)[1])}
        assert sessions == {"used"}
        assert os.listdir(d.mp / "idle") == []  # made with mkdir: it stays, empty
        assert not json.loads(run("ls", "--archived", "--json", *flags)[1])
        st = json.loads(run("stats", "--json", *flags)[1])["extra"]["archive"]
        assert st["sessions_expired"] == 2 and st["retention_s"] == 4.0
        assert "retention 4s" in run("stats", *flags)[1]
        assert "event=expire target=idle" in d.log.read_text()
        (me,) = json.loads(run("hosts", "--json", *flags)[1])  # through the daemon
        assert me["this"] and me["retention_s"] == 4.0 and me["sessions"] == 0
    finally:
        stop.set()
        d.stop()
    assert not d.errors()


def test_targets_given_as_paths_on_the_mount(
    daemon: Daemon, run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users paste paths from the mount: they mean the pages and directories they show,
    in the store the mount serves (no --data needed)."""
    page = daemon.mp / "sessions" / "agent-1" / "p0" / "layer-000"
    page.parent.mkdir(parents=True)
    page.write_bytes(b"k" * 100)
    (daemon.mp / "lmcache").mkdir()
    (daemon.mp / "lmcache" / "f.data").write_bytes(b"v" * 10)
    rc, out, err = run("ls", str(daemon.mp / "sessions" / "agent-1"), "--json")
    assert rc == 0, err
    assert [p["path"] for p in json.loads(out)] == ["sessions/agent-1/p0/layer-000"]
    assert run("pin", str(daemon.mp / "lmcache"))[0] == 0
    pinned = {
        s["dir"]: s["pinned"]
        for s in json.loads(run("ls", "--json", "--data", str(daemon.data))[1])
    }
    assert pinned == {"lmcache": True, "sessions/agent-1": False}
    monkeypatch.chdir(daemon.mp / "sessions")  # a name that exists here is that directory
    rc, out, _ = run("ls", "agent-1", "--json")
    assert rc == 0 and json.loads(out)[0]["session"] == "agent-1"
    rc, out, _ = run("ls", "nothing-here", "--json", "--data", str(daemon.data))
    assert rc == 3  # (not a path on the mount: a session name, and there is none)
    # the mount's root lists the sessions, as `kvfs ls` does (it was "no page '.'")
    (daemon.mp / "top.bin").write_bytes(b"t" * 10)
    for root in (str(daemon.mp), ".."):
        rc, out, err = run("ls", root, "--json")
        assert rc == 0, err
        assert {s["dir"] for s in json.loads(out)} == {".", "lmcache", "sessions/agent-1"}


def test_stats_hosts_and_fsck_take_the_mount_or_a_path_on_it(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvfs stats /mnt/kv` from outside the mount was a usage error ("unrecognized
    arguments"): stats, hosts and fsck found a daemon only from a working directory on the
    mount or with --data, where ls, pin or evict took a path on the mount. The daemon here
    has a control socket of its own, which only the mount's state names."""
    conf = tmp_path / "kvfs.toml"
    conf.write_text(f'[archive]\narchive_url = "file://{tmp_path}/arch"\n')
    d = Daemon(tmp_path / "m", "--config", str(conf), "--socket", str(tmp_path / "own.sock"))
    try:
        page = d.mp / "sessions" / "agent-1" / "p0" / "layer-000"
        page.parent.mkdir(parents=True)
        page.write_bytes(b"k" * 100)
        # the mount point, a path on it, and a relative path onto it, among the flags
        for where in (str(d.mp), str(page), "m/mnt/sessions"):
            rc, out, err = run("stats", "--json", where, "--daemon")
            assert rc == 0, (where, err)
            st = json.loads(out)
            assert st["pages"] == 1 and st["extra"]["mount"]["mountpoint"] == str(d.mp)
        rc, out, err = run("stats", str(d.mp))
        assert rc == 0 and f"mount: {d.mp} (pid " in out, err
        # after --watch, whose SECONDS may be left out (it took MOUNT for them: exit 2)
        for args in (("--watch", str(d.mp)), ("--watch", "0.1", str(d.mp))):
            rc, out, err = run("stats", *args, "--count", "1", "--json")
            assert rc == 0 and json.loads(out)["extra"]["mount"]["mountpoint"] == str(d.mp), err
        rc, _, err = run("stats", "--watch", "soon", str(d.mp))
        assert rc == 2 and "--watch takes a number of seconds, not 'soon'" in err
        rc, out, err = run("hosts", str(d.mp), "--json")
        assert rc == 0, err
        (me,) = json.loads(out)
        assert me["this"]
        rc, out, err = run("fsck", "--repair", str(page.parent), "--json")
        assert rc == 0 and json.loads(out)["missing"] == [], err
        # a path off the mounts, or a name that is none on them: the other commands' error
        for cmd in ("stats", "hosts", "fsck"):
            for where in (str(tmp_path), "no-such-dir"):
                rc, _, err = run(cmd, where)
                assert rc == 2 and f"{where} is not on a kvfs mount (the kvfs mounts are " in err
        # none named, from a directory on the mount: as before
        monkeypatch.chdir(page.parent)
        rc, out, err = run("stats", "--json")
        assert rc == 0 and json.loads(out)["extra"]["mount"]["mountpoint"] == str(d.mp), err
    finally:
        d.stop()
    assert not d.errors()


def test_a_path_on_a_mount_and_data_or_config_naming_another_store_is_a_usage_error(
    daemon: Daemon, run: Run, tmp_path: Path
) -> None:
    """`kvfs stats /mnt/a --data /other` reported on /other without a word (and `kvfs ls`
    listed it): --data and --config won over the mount. Now naming two stores is exit 2
    with one line naming both; the mount's own data directories are accepted."""
    page = daemon.mp / "sessions" / "agent-1" / "p0" / "layer-000"
    page.parent.mkdir(parents=True)
    page.write_bytes(b"k" * 100)
    other = tmp_path / "other"
    (tmp_path / "f").write_bytes(b"o" * 10)
    assert run("put", "f", "sessions/elsewhere/p0/layer-000", "--data", str(other))[0] == 0
    conf = tmp_path / "other.toml"
    conf.write_text(f'[store]\ndata_dirs = ["{other}"]\n')
    for flags, named in ((["--data", str(other)], "--data"), (["--config", str(conf)], "--config")):
        for argv in (
            ["stats", str(daemon.mp)],
            ["stats", "--json", str(page)],
            ["ls", str(page.parent.parent)],
            ["pin", str(page.parent.parent)],
        ):
            rc, out, err = run(*argv, *flags)
            assert (rc, out, err.count("\n")) == (2, "", 1), (argv, flags, out, err)
            assert f"{daemon.mp} serves the store in {daemon.data}" in err, err
            assert f"{named}" in err and f"names {other}" in err, err
    assert not json.loads(run("ls", str(page), "--json")[1])[0]["pinned"]
    # the mount's own data directories, by --data or by a file, are its store
    mine = tmp_path / "mine.toml"
    mine.write_text(f'[store]\ndata_dirs = ["{daemon.data}"]\n')
    for flags in (["--data", str(daemon.data)], ["--config", str(mine)]):
        rc, out, err = run("stats", "--json", str(daemon.mp), *flags)
        assert rc == 0 and json.loads(out)["pages"] == 1, err
        rc, out, err = run("ls", str(page.parent.parent), "--json", *flags)
        assert rc == 0, err
        assert [p["path"] for p in json.loads(out)] == ["sessions/agent-1/p0/layer-000"]
    # a file that names no data directory names no store: the mount's is used with it
    only = tmp_path / "only.toml"
    only.write_text("[store]\nio_threads = 2\n")
    rc, out, err = run("stats", "--json", str(daemon.mp), "--config", str(only))
    assert rc == 0 and json.loads(out)["pages"] == 1, err


def test_no_store_here_names_the_directory_in_full_and_the_mounts_running(
    daemon: Daemon, run: Run, tmp_path: Path
) -> None:
    """`kvfs ls` run off the mount, with the embedded defaults, said "no kvfs store in
    kvfs-data": a relative path that named nothing to its user, and not a word of the
    mount running. (The run fixture works in an empty directory: no store there.)"""
    rc, out, err = run("ls")
    assert rc == 3 and not out and err.count("\n") == 1, err
    assert f"no kvfs store in {tmp_path / 'kvfs-data'} " in err, err
    # (its mount among them: others may be running on the machine, listed beside it)
    mounts = err.partition("the kvfs mounts are ")[2].partition(": run it from")[0]
    assert str(daemon.mp) in mounts.split(", "), err
    assert not (tmp_path / "kvfs-data").exists()


def test_paths_on_two_mounts_in_one_command_are_a_usage_error(
    daemon: Daemon, run: Run, tmp_path: Path
) -> None:
    """`kvfs rm /mnt/a/sessions/x /mnt/b/sessions/y` named no store (each mount's is
    used only when all the paths are on it) and failed with "no kvfs store in kvfs-data"."""
    other = Daemon(tmp_path / "m2")
    try:
        for d in (daemon, other):
            (d.mp / "sessions" / "s").mkdir(parents=True)
        both = [str(daemon.mp / "sessions" / "s"), str(other.mp / "sessions" / "s")]
        rc, _, err = run("rm", *both)
        assert rc == 2 and err.count("\n") == 1, err
        assert f"on 2 kvfs mounts ({', '.join(sorted([str(daemon.mp), str(other.mp)]))})" in err
        assert (daemon.mp / "sessions" / "s").is_dir() and (other.mp / "sessions" / "s").is_dir()
    finally:
        other.stop()
    assert not other.errors()


def test_a_relative_path_onto_the_mount_names_its_page_before_it_exists(
    daemon: Daemon, run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From beside the mount, `kvfs put f mnt/sessions/new/p0/layer-000` took the path,
    not there yet, for a page name: it made a new store in ./kvfs-data and stored the page
    there as mnt/sessions/new/p0/layer-000; a get of such a path said "no kvfs store in
    kvfs-data". An absolute path or one that exists already reached the mount's store."""
    monkeypatch.chdir(daemon.mp.parent)
    (tmp_path / "f").write_bytes(b"v" * 10)
    rc, out, err = run("put", str(tmp_path / "f"), "mnt/sessions/new/p0/layer-000", "--json")
    assert rc == 0, err
    assert json.loads(out)["path"] == "sessions/new/p0/layer-000"
    assert (daemon.mp / "sessions/new/p0/layer-000").read_bytes() == b"v" * 10
    assert not (daemon.mp.parent / "kvfs-data").exists()
    rc, _, err = run("get", "mnt/sessions/nope/p0/layer-000", "out")
    assert (rc, err.strip()) == (3, "kvfs get: no page 'sessions/nope/p0/layer-000'")


def test_commands_run_in_a_directory_on_the_mount_use_its_store(
    daemon: Daemon, run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a directory on the mount, with no store named, a command used the default
    ./kvfs-data: there, on the mount. It failed with EINVAL and left a kvfs-data directory
    and its lock file as a page of the mount's store. Now it uses the mount's store; a
    store is never made on a kvfs mount; and `kvfs put` takes a path on the mount as the
    other commands do."""
    (tmp_path / "f").write_bytes(b"v" * 10)
    here = daemon.mp / "lmcx"
    here.mkdir()
    monkeypatch.chdir(here)
    rc, _, err = run("put", str(tmp_path / "f"), str(here / "first"))
    assert rc == 0, err
    rc, _, err = run("put", str(tmp_path / "f"), "./second")
    assert rc == 0, err
    assert (here / "first").read_bytes() == (here / "second").read_bytes() == b"v" * 10
    rc, out, err = run("ls", "--json")
    assert rc == 0, err
    assert {s["dir"]: s["pages"] for s in json.loads(out)} == {"lmcx": 2}
    assert sorted(os.listdir(here)) == ["first", "second"]
    rc, _, err = run("ls", "--data", "store-here")
    assert rc == 2 and "is on the kvfs mount" in err
    (tmp_path / "mp2").mkdir()
    rc, _, err = run("mount", "--data", str(here / "d2"), str(tmp_path / "mp2"), "--foreground")
    assert rc == 2 and "is on the kvfs mount" in err
    assert sorted(os.listdir(here)) == ["first", "second"]


def test_paths_on_a_mount_reach_its_store_wherever_it_keeps_things(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path on the mount reaches the store its daemon serves with no other option, also
    when the daemon was started with relative data directories (from another working
    directory), its own control socket, and its index elsewhere (they were not found)."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "kvfs.toml"
    cfg.write_text(f'[store]\nindex_dir = "{tmp_path / "index"}"\n')
    mp = tmp_path / "mnt"
    mp.mkdir()
    sock = tmp_path / "own.sock"
    d = DaemonMount(
        [Path("data")], mp, tmp_path / "daemon.log", "--config", str(cfg), "--socket", str(sock)
    )
    try:
        page = mp / "sessions" / "a" / "p0" / "layer-000"
        page.parent.mkdir(parents=True)
        page.write_bytes(b"k" * 100)
        monkeypatch.chdir("/")
        rc, out, err = run("ls", str(page.parent.parent), "--json")
        assert rc == 0, err
        assert [p["path"] for p in json.loads(out)] == ["sessions/a/p0/layer-000"]
        assert run("pin", str(page))[0] == 0
        assert json.loads(run("ls", str(page), "--json")[1])[0]["pinned"]
        # the data directory named instead: its daemon's own socket is found all the same
        # (it was "in use by pid N; no daemon answers on .../kvfs.sock")
        rc, out, err = run("ls", "--json", "--data", str(tmp_path / "data"))
        assert rc == 0, err
        assert [s["session"] for s in json.loads(out)] == ["a"]
    finally:
        d.stop()


def test_umount_lets_the_daemon_close_the_store_cleanly(tmp_path: Path, run: Run) -> None:
    """umount unmounted, which stops the daemon by itself, then sent SIGTERM: landing after
    the daemon stopped listening for it, it killed the daemon while it closed the store
    (exit -15 in most runs), the index left unclean (the next open recounts as after a
    crash) and the access times of the last reads lost."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    for _ in range(3):
        d = DaemonMount([tmp_path / "data"], mp, tmp_path / "daemon.log")
        try:
            if (mp / "f").exists():
                assert (mp / "f").read_bytes() == b"x"
            else:
                (mp / "f").write_bytes(b"x")
            assert run("umount", str(mp))[0] == 0
            assert d.proc.wait(timeout=30) == 0
        finally:
            d.stop()
        assert index_is_clean(tmp_path / "data")


def test_stats_shows_the_daemons_own_settings_and_mount(tmp_path: Path, run: Run) -> None:
    """`kvfs config` said a daemon's own mount flags show in `kvfs stats`; they did not."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    flags = ("--stripe-unit", "1MiB", "--direct-io")
    with DaemonMount([tmp_path / "data"], mp, tmp_path / "daemon.log", *flags) as m:
        rc, out, err = run("stats", "--data", str(tmp_path / "data"), "--json")
        assert rc == 0, err
        extra = json.loads(out)["extra"]
        assert extra["settings"]["stripe_unit"] == 1 << 20
        assert extra["mount"]["mountpoint"] == str(m) and extra["mount"]["direct_io"] is True
        rc, out, _ = run("stats", "--data", str(tmp_path / "data"))
        assert "stripe unit 1.0 MiB" in out and f"mount: {m} (pid " in out


def test_a_mountpoint_with_a_space_and_a_non_ascii_name(tmp_path: Path, run: Run) -> None:
    """/proc/self/mountinfo escapes a space (\\040) and leaves UTF-8 as it is: paths on such
    a mount still name its pages, and umount still sees that the mount is in use."""
    root = tmp_path / "kv cache ü"
    mp = root / "mnt ö"
    mp.mkdir(parents=True)
    d = DaemonMount([root / "data"], mp, root / "daemon.log")
    try:
        page = mp / "sessions" / "agent 1" / "p0" / "layer-000"
        page.parent.mkdir(parents=True)
        page.write_bytes(b"k" * 100)
        rc, out, err = run("ls", str(page.parent.parent), "--json")
        assert rc == 0, err
        assert [p["path"] for p in json.loads(out)] == ["sessions/agent 1/p0/layer-000"]
        with open(page, "rb"):
            rc, _, err = run("umount", str(mp))
            assert rc == 9 and "in use" in err
        assert run("umount", str(mp))[0] == 0
        assert d.proc.wait(timeout=30) == 0
        assert str(mp) not in {m for m, _ in kvfs_mounts_table()}
    finally:
        d.stop()


def test_umount_touches_only_its_own_daemon_and_kvfs_mounts(tmp_path: Path, run: Run) -> None:
    """`kvfs umount` trusted what a state file said: a daemon killed by SIGKILL left its pid,
    and once that pid was another process's, umount sent it SIGTERM. It unmounted any file
    system (a tmpfs, lazily); and a mount made through a symlink, asked for by its real
    path, missed its daemon's state and was detached lazily while in use."""
    from kvfs._daemon import state_path

    mp = tmp_path / "mnt"
    mp.mkdir()
    d = DaemonMount([tmp_path / "data"], mp, tmp_path / "daemon.log")
    try:
        state = json.loads(state_path(mp).read_text())
        d.proc.kill()
        d.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while str(mp) in {m for m, _ in kvfs_mounts_table()}:  # (auto_unmount)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with subprocess.Popen(["sleep", "60"]) as other:  # the dead daemon's pid, reused
            state_path(mp).write_text(json.dumps({**state, "pid": other.pid}))
            rc, _, err = run("umount", str(mp))
            assert rc == 7 and "no kvfs mount" in err
            assert other.poll() is None  # not signalled
            other.kill()
    finally:
        d.stop()
    tmpfs = tmp_path / "tmpfs"
    tmpfs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmpfs)], check=True)
    try:
        rc, _, err = run("umount", str(tmpfs))
        assert rc == 7 and str(tmpfs) in {m for m, _ in kvfs_mounts_table()}
    finally:
        subprocess.run(["umount", str(tmpfs)], check=False)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    d = DaemonMount([tmp_path / "data"], link / "mnt", tmp_path / "daemon.log")
    try:
        (mp / "held").write_bytes(b"x")
        with open(mp / "held", "rb"):  # (a reader: the mount is in use)
            rc, _, err = run("umount", str(mp))
            assert rc == 9 and "in use" in err
        assert run("umount", str(link / "mnt"))[0] == 0
        assert d.proc.wait(timeout=30) == 0
    finally:
        d.stop()


def test_a_daemon_under_systemd_says_when_it_is_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example unit is Type=notify: the daemon sends READY=1 to $NOTIFY_SOCKET once the
    mount answers (with Type=simple an engine ordered after it could start before)."""
    import socket

    sock = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(sock))
        s.settimeout(60)
        monkeypatch.setenv("NOTIFY_SOCKET", str(sock))
        mp = tmp_path / "mnt"
        mp.mkdir()
        d = DaemonMount([tmp_path / "data"], mp, tmp_path / "daemon.log")
        try:
            assert s.recv(64) == b"READY=1"
            assert str(mp) in {m for m, _ in kvfs_mounts_table()}
        finally:
            d.stop()


def test_mount_arguments_it_cannot_use_exit_2(tmp_path: Path, run: Run) -> None:
    """A data directory on a read-only file system, and a --log it cannot write (a
    directory), exited 1 with a bare OSError after the daemon had started; they are
    usage errors, told before anything starts."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        rc, _, err = run("mount", "--data", str(ro), str(mp))
        assert rc == 2 and "is not writable" in err, err
    finally:
        subprocess.run(["umount", str(ro)], check=False)
    rc, _, err = run("mount", "--data", str(tmp_path / "d"), "--log", str(tmp_path), str(mp))
    assert rc == 2 and "--log" in err and "Is a directory" in err, err
    assert str(mp) not in {m for m, _ in kvfs_mounts_table()}


def test_what_the_daemon_keeps_under_its_mountpoint_is_a_usage_error(
    tmp_path: Path, run: Run
) -> None:
    """`kvfs mount --data MNT/data MNT` mounted over its own data directory: the first write
    through the mount left the writer and the daemon waiting on each other for good (D
    state, SIGKILL did nothing; only an abort in /sys/fs/fuse/connections ended it). A data
    or index directory, control socket or file:// archive at or under the mountpoint is a
    usage error now, told before anything starts."""
    mp, d = tmp_path / "mnt", str(tmp_path / "d")
    mp.mkdir()
    cases = [
        (["--data", str(mp / "data")], "data directory"),
        (["--data", str(mp)], "data directory"),
        (["--data", d, "--socket", str(mp / "s.sock")], "control socket"),
        (["--data", d, "--archive", f"file://{mp}/arch"], "archive directory"),
    ]
    for flags, what in cases:
        try:
            rc, _, err = run("mount", *flags, str(mp))
            assert rc == 2 and f"{what} " in err and "is under the mountpoint" in err, err
        finally:
            if str(mp) in {m for m, _ in kvfs_mounts_table()}:  # (mounted: nothing written)
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=True)
    assert os.listdir(mp) == []


def test_fewer_data_directories_than_the_store_has_exit_2(tmp_path: Path, run: Run) -> None:
    """`kvfs mount --data d0` (and `kvfs ls --data d0`) of a store striped over d0 and d1
    exited 1 once the store's open refused it; a data directory list it cannot use is a
    usage error (exit 2), told before a daemon starts."""
    import kvfs

    d0, d1, mp = tmp_path / "d0", tmp_path / "d1", tmp_path / "mnt"
    mp.mkdir()
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(d0, d1))) as s:
        s.put("sessions/a/p/layer-000", b"x" * 100)
    for argv in (["mount", "--data", str(d0), str(mp)], ["ls", "--data", str(d0)]):
        rc, _, err = run(*argv)
        assert rc == 2 and "has 2 data directories, but only 1 configured" in err, (argv, err)
    assert str(mp) not in {m for m, _ in kvfs_mounts_table()}
    rc, out, _ = run("ls", "--data", f"{d0},{d1}")
    assert rc == 0 and "a " in out


def test_a_mount_that_fails_leaves_no_new_empty_data_directory(tmp_path: Path, run: Run) -> None:
    """`kvfs mount --data NEW` whose daemon could not open its archive (exit 8) left NEW
    behind, holding only an empty kvfs-daemon.log (and an empty --log file it made): what
    the command made for the daemon goes again when the daemon wrote nothing into it. A
    directory that was there stays, as does a log that was."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    (tmp_path / "file").write_bytes(b"")
    bad = ["--archive", f"file://{tmp_path}/file/arch"]  # (below a file: no archive)
    new, log = tmp_path / "new", tmp_path / "my.log"
    for extra in ([], ["--log", str(log)]):
        rc, _, err = run("mount", "--data", str(new), *bad, *extra, str(mp))
        assert rc == 8 and "Not a directory" in err, err
        assert not new.exists() and not log.exists(), list(tmp_path.iterdir())
    (tmp_path / "old").mkdir()
    log.write_text("kept\n")
    rc, _, _ = run("mount", "--data", str(tmp_path / "old"), *bad, "--log", str(log), str(mp))
    assert rc == 8 and (tmp_path / "old").is_dir() and log.read_text() == "kept\n"
    assert str(mp) not in {m for m, _ in kvfs_mounts_table()}


def test_writes_still_open_when_the_mount_stops_are_logged(tmp_path: Path) -> None:
    """A file still being written when the daemon stops is discarded (it was never closed),
    and the log now says which (it said nothing)."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    d = DaemonMount([tmp_path / "data"], mp, tmp_path / "daemon.log")
    f = open(mp / "unfinished", "wb")  # noqa: SIM115
    try:
        f.write(b"z" * 10_000)
        f.flush()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(OSError):
            f.close()
        d.stop()
    log = (tmp_path / "daemon.log").read_text()
    assert "event=discard target=unfinished" in log and "when the mount stopped" in log, log


def test_log_with_foreground_is_refused(tmp_path: Path, run: Run) -> None:
    """`kvfs mount --foreground --log FILE` ignored --log without a word."""
    (tmp_path / "mnt").mkdir()
    argv = ["mount", "--foreground", "--log", str(tmp_path / "l.log"), "--data", str(tmp_path)]
    rc, _, err = run(*argv, str(tmp_path / "mnt"))
    assert rc == 2 and "--log is the detached daemon's log" in err


def test_a_socket_of_another_store_is_refused(
    daemon: Daemon, run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command took whichever daemon answered on its socket: with a
    ``$KVFS_CONTROL_SOCKET`` left over from store A, ``kvfs rm --data B`` deleted from A."""
    import kvfs
    from kvfs._settings import control_socket_path

    (daemon.mp / "sessions/s/p").mkdir(parents=True)
    (daemon.mp / "sessions/s/p/layer-000").write_bytes(b"a" * 100)
    sock = control_socket_path(kvfs.StoreConfig(data_dirs=[daemon.data]))
    other = tmp_path / "other"
    other.mkdir()
    for how in (["--socket", str(sock)], []):
        if not how:
            monkeypatch.setenv("KVFS_CONTROL_SOCKET", str(sock))
        rc, _, err = run("rm", "sessions/s/p/layer-000", "--data", str(other), *how)
        assert rc == 2 and f"serves {daemon.data}" in err, err
    monkeypatch.delenv("KVFS_CONTROL_SOCKET")
    assert (daemon.mp / "sessions/s/p/layer-000").read_bytes() == b"a" * 100
    rc, out, _ = run("ls", "s", "--data", str(daemon.data), "--socket", str(sock), "--daemon")
    assert rc == 0 and "layer-000" in out


def _kvfs(*argv: str) -> subprocess.CompletedProcess[str]:
    """The kvfs command in a process of its own, given a minute (a hang fails the test)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    return subprocess.run([*KVFS, *argv], capture_output=True, text=True, timeout=60, env=env)


def test_mount_and_umount_beside_a_stopped_daemon(tmp_path: Path) -> None:
    """`kvfs mount` on the mountpoint of a daemon that is stopped (SIGSTOP, Ctrl-Z) hung: it
    looked at the path (a stat waits for the daemon) before the mount table. It now reads the
    table first and says the mountpoint is taken (exit 2, as for any mountpoint in use), and
    touches nothing on that mount: not through a symlink, nor a data directory in it. `kvfs
    umount` hung the same way; it unmounts such a mount (lazily with --force, when in use)
    and, as the daemon cannot exit while stopped, says so at once (exit 1)."""
    from kvfs._daemon import state_path

    d = Daemon(tmp_path / "m")
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "link").symlink_to(d.mp)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        for mp in (d.mp, tmp_path / "link"):
            r = _kvfs("mount", "--data", str(tmp_path / "d2"), str(mp))
            assert r.returncode == 2, r.stderr
            assert f"{d.mp} is already a mount point (fuse.kvfs)" in r.stderr
            assert f"kvfs umount {d.mp}" in r.stderr
        r = _kvfs("mount", "--data", str(d.mp / "sub"), str(other))
        assert r.returncode == 2 and "is on the kvfs mount" in r.stderr, r.stderr
        assert not (tmp_path / "d2").exists()
        r = _kvfs("umount", str(tmp_path / "link"))
        assert r.returncode == 1, r.stderr
        assert f"its daemon (pid {d.proc.pid}) is stopped" in r.stderr
        assert f"kill -CONT {d.proc.pid}" in r.stderr
        assert str(d.mp) not in {m for m, _ in kvfs_mounts_table()}
        os.kill(d.proc.pid, signal.SIGCONT)  # it notices the mount is gone and stops
        assert d.proc.wait(timeout=60) == 0
        assert not state_path(d.mp).exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
    assert not d.errors()
    # in use (a file open) as well: refused, then unmounted lazily with --force. (Nothing
    # is left for the daemon to answer when it stops, not even a release: the page is put
    # before it starts, and the file is held open by another process, as every close of a
    # descriptor on the mount waits for the daemon, a child's copy too.)
    import kvfs

    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "busy" / "data",))) as s:
        s.put("f", b"x")
    d = Daemon(tmp_path / "busy")
    holder = subprocess.Popen(
        ["sh", "-c", 'exec 3<"$0" && echo open && exec sleep 600', str(d.mp / "f")],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"open\n"
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        r = _kvfs("umount", str(d.mp))
        assert r.returncode == 9 and "in use" in r.stderr, r.stderr
        r = _kvfs("umount", "--force", str(d.mp))
        assert r.returncode == 1 and "is stopped" in r.stderr, r.stderr
        assert str(d.mp) not in {m for m, _ in kvfs_mounts_table()}
        os.kill(d.proc.pid, signal.SIGCONT)  # the SIGTERM --force sent takes effect now
        assert d.proc.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
        holder.kill()
        holder.communicate()
        d.stop()
    assert not d.errors()


def test_a_mount_that_fails_writes_nothing_into_the_running_daemons_log(tmp_path: Path) -> None:
    """A second `kvfs mount` of a data directory a daemon serves failed (exit 6, rightly),
    and its daemon wrote the error into the running daemon's log (the default log is the
    data directory's) and pointed the user there. A detached daemon now writes into the log
    only once it holds the store: what it said before (here, the refusal) goes to the
    command that started it; what a daemon that starts said before, to its log after all."""
    data, mp, mp2 = tmp_path / "data", tmp_path / "mnt", tmp_path / "mnt2"
    mp.mkdir()
    mp2.mkdir()
    log = data / "kvfs-daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    r = subprocess.run(
        [*KVFS, "mount", "--data", str(data), str(mp)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "KVFS_NOT_A_SETTING": "1"},  # (the daemon warns before it holds the store)
    )
    try:
        assert r.returncode == 0, r.stderr
        before = log.read_text()
        assert "$KVFS_NOT_A_SETTING is no kvfs setting" in before, before
        assert "mounted" in before, before
        for log_flag in ([], ["--log", str(log)]):
            r = _kvfs("mount", "--data", str(data), *log_flag, str(mp2))
            assert log.read_text() == before
            assert r.returncode == 6, r.stderr
            assert "in use by pid" in r.stderr and "(log:" not in r.stderr, r.stderr
        assert _kvfs("umount", str(mp)).returncode == 0
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    assert "ERROR" not in log.read_text() and "Traceback" not in log.read_text()


def test_the_detached_daemons_log_can_be_rotated_by_copy_and_truncate(tmp_path: Path) -> None:
    """A daemon kept for days logs for days: logrotate's ``copytruncate`` (copy the log,
    then truncate it in place) must leave it writing at the new start of the file, not at
    its old offset past a hole of NUL bytes as large as the old log (the log is opened
    O_APPEND), as docs/mount.md says."""
    data, mp = tmp_path / "data", tmp_path / "mnt"
    mp.mkdir()
    log = data / "kvfs-daemon.log"
    assert _kvfs("mount", "--data", str(data), str(mp)).returncode == 0
    try:
        rotated = tmp_path / "kvfs-daemon.log.1"
        shutil.copyfile(log, rotated)
        os.truncate(log, 0)
        assert "mounted" in rotated.read_text()
        assert _kvfs("umount", str(mp)).returncode == 0
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    after = log.read_bytes()
    assert after and b"\0" not in after, after[:200]
    assert b"unmounted" in after, after
