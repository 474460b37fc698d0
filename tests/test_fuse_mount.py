"""A real FUSE mount (the daemon in a subprocess, ``--foreground``) used by ordinary tools.

Every mount is unmounted in teardown (``fusermount3 -u -z``) whatever happened, and a test
fails when the daemon logged an error or a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import trio
from _kvfs_mount import ServedMount, daemon_mount, fresh_stat, index_is_clean

import kvfs
from gds._source import decode_extents
from kvfs._daemon import READY_FD_ENV, _alive

MiB = 1 << 20
KVFS = [sys.executable, "-m", "cli"]

if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:  # pragma: no cover
    pytest.fail(
        "these tests need /dev/fuse and fusermount3 (scripts/bootstrap.sh installs fuse3)",
        pytrace=False,
    )


def mounted(mp: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(mp) for line in f)


class Mount:
    """One daemon serving ``self.mp`` from ``self.data``; its log is ``self.log``."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.root, self.extra = root, list(extra)
        self.mp, self.data, self.log = root / "mnt", root / "data", root / "daemon.log"
        self.mp.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen = 0

    def start(self) -> None:
        r, w = os.pipe()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *KVFS,
                    "mount",
                    "--foreground",
                    "--data",
                    str(self.data),
                    *self.extra,
                    str(self.mp),
                ],
                stdout=log,
                stderr=log,
                pass_fds=(w,),
                env={**os.environ, READY_FD_ENV: str(w)},
            )
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.read().decode().strip()
        assert msg == "ok", f"mount failed: {msg}\n{self.log.read_text()}"
        assert mounted(self.mp)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        self.proc = None
        return rc

    def new_errors(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = text.splitlines()[self._seen :]
        self._seen += len(lines)
        return [x for x in lines if " ERROR " in x or "Traceback" in x or " CRITICAL " in x]

    def cleanup(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        subprocess.run(["fusermount3", "-u", "-z", str(self.mp)], capture_output=True)


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator[object]:
    made: list[Mount] = []

    def make(name: str = "m", *extra: str, start: bool = True) -> Mount:
        m = Mount(tmp_path / name, *extra)
        made.append(m)
        if start:
            m.start()
        return m

    yield make
    errors = []
    for m in made:
        errors += m.new_errors()
        m.cleanup()
    assert not errors, "the daemon logged errors:\n" + "\n".join(errors)


@pytest.fixture
def mnt(make_mount: object) -> Path:
    return make_mount().mp  # type: ignore[operator, no-any-return]


def write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_ordinary_tools(mnt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(12):
        d = src / f"d{i % 3}" / f"sub{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"model@1@0@{i:040x}@bf16.data").write_bytes(os.urandom(1000 * i + 1))
    (src / "empty-dir").mkdir()
    subprocess.run(["cp", "-r", str(src), str(mnt / "cp")], check=True)
    subprocess.run(["diff", "-r", str(src), str(mnt / "cp")], check=True)
    found = subprocess.run(
        ["find", str(mnt / "cp"), "-type", "f"], check=True, capture_output=True, text=True
    ).stdout.split()
    assert len(found) == 12
    du = int(
        subprocess.run(
            ["du", "-sb", str(mnt / "cp")], check=True, capture_output=True, text=True
        ).stdout.split()[0]
    )
    assert du >= sum(1000 * i + 1 for i in range(12))
    # tar in and out
    subprocess.run(f"tar cf - -C {src} . | tar xf - -C {mnt}/cp/empty-dir", shell=True, check=True)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(f"tar cf - -C {mnt}/cp/empty-dir . | tar xf - -C {out}", shell=True, check=True)
    subprocess.run(["diff", "-r", str(src), str(out)], check=True)
    # rsync -a: the second run finds nothing to do (modes and mtimes were kept)
    subprocess.run(["rsync", "-a", f"{src}/", f"{mnt}/rs/"], check=True)
    again = subprocess.run(
        ["rsync", "-ai", f"{src}/", f"{mnt}/rs/"], check=True, capture_output=True, text=True
    ).stdout
    assert again.strip() == ""
    subprocess.run(["diff", "-r", str(src), str(mnt / "rs")], check=True)
    subprocess.run(["rm", "-r", str(mnt / "rs")], check=True)
    assert not (mnt / "rs").exists()
    # shell redirection: the shell dup2s the fd and closes the original before writing
    subprocess.run(
        f"echo hello > {mnt}/echo.txt && cat {mnt}/echo.txt > {tmp_path}/e", shell=True, check=True
    )
    assert (tmp_path / "e").read_text() == "hello\n"


def test_python_reads_and_semantic_layout(mnt: Path) -> None:
    data = np.random.default_rng(1).integers(0, 255, 6 * MiB + 123, dtype=np.uint8).tobytes()
    (mnt / "sessions" / "agent-42" / "9f3ab1").mkdir(parents=True)
    for layer in range(3):
        write(mnt / "sessions/agent-42/9f3ab1" / f"layer-{layer:03d}", data)
    assert os.listdir(mnt / "sessions") == ["agent-42"]
    assert os.listdir(mnt / "sessions/agent-42") == ["9f3ab1"]  # (.kvfs.json: by name only)
    assert os.listdir(mnt / "sessions/agent-42/9f3ab1") == ["layer-000", "layer-001", "layer-002"]
    p = mnt / "sessions/agent-42/9f3ab1/layer-001"
    assert p.stat().st_size == len(data)
    assert p.stat().st_mode & 0o222 == 0o200  # created 0644 (umask 022)
    with open(p, "rb") as f:
        assert f.read() == data
    buf = bytearray(len(data))
    with open(p, "rb", buffering=0) as f:
        assert f.readinto(buf) == len(data)
    assert buf == data
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 5 * MiB + 7) == data[5 * MiB + 7 : 5 * MiB + 7 + 4096]
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            assert m[MiB : MiB + 100] == data[MiB : MiB + 100] and len(m) == len(data)
    finally:
        os.close(fd)
    arr = np.memmap(p, dtype=np.uint8, mode="r")
    assert arr[-123:].tobytes() == data[-123:]
    del arr
    meta = json.loads((mnt / "sessions/agent-42/.kvfs.json").read_text())
    assert meta["pages"] == 3 and meta["bytes"] == 3 * len(data)
    # a session directory backs up with tar, even naming .kvfs.json (it changed size and
    # mtime at every stat: "file changed as we read it", exit 1, a NUL-padded copy)
    for _ in range(3):
        tar = ["tar", "cf", str(mnt.parent / "s.tar"), "-C", str(mnt), "sessions/agent-42"]
        tar.append("sessions/agent-42/.kvfs.json")
        subprocess.run(tar, check=True)  # (not to /dev/null: GNU tar then reads nothing)


def test_o_direct_read(mnt: Path) -> None:
    data = os.urandom(4 * MiB)
    write(mnt / "direct", data)
    assert os.statvfs(mnt).f_bsize == 4096
    buf = mmap.mmap(-1, MiB)  # page aligned
    fd = os.open(mnt / "direct", os.O_RDONLY | os.O_DIRECT)
    try:
        got = bytearray()
        while n := os.preadv(fd, [buf], len(got)):
            got += buf[:n]
    finally:
        os.close(fd)
    assert got == data


def test_safetensors(mnt: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    tensors = {
        f"layer.{i}.k": np.random.default_rng(i).standard_normal((64, 128)).astype(np.float32)
        for i in range(4)
    }
    save_file(tensors, str(mnt / "kv.safetensors"))
    with safe_open(str(mnt / "kv.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(f.get_tensor(k), v)


def test_immutable_pages_and_atomic_replace(mnt: Path) -> None:
    write(mnt / "page", b"v1" * 1000)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_TRUNC):
        with pytest.raises(PermissionError) as ei:
            os.open(mnt / "page", flags)
        assert ei.value.errno == errno.EPERM
    with pytest.raises(PermissionError):
        os.truncate(mnt / "page", 0)
    # replace by rename (how LMCache publishes): readers of the old file keep the old bytes
    with open(mnt / "page", "rb") as old:
        write(mnt / "page.tmp", b"v2" * 3000)
        os.replace(mnt / "page.tmp", mnt / "page")
        assert old.read() == b"v1" * 1000
    assert (mnt / "page").read_bytes() == b"v2" * 3000
    assert not (mnt / "page.tmp").exists()
    with open(mnt / "page", "rb") as f:
        os.unlink(mnt / "page")
        assert f.read() == b"v2" * 3000  # an open file outlives its name
    assert not (mnt / "page").exists()


def test_writes_after_a_dup_closed_make_the_next_version(mnt: Path) -> None:
    """POSIX close semantics: closing a dup'd descriptor commits the page (that close is a
    FUSE flush), but the original descriptor may go on writing; its writes make the next
    version (committed bytes plus new writes), published whole at its own close. Readers
    see one version or the other, never a mix. Once unlinked, later writes go nowhere."""
    p = mnt / "dup.bin"
    with open(p, "wb", buffering=0) as f:
        with os.fdopen(os.dup(f.fileno()), "wb", buffering=0) as dup:
            dup.write(b"y" * 100)
        assert p.read_bytes() == b"y" * 100  # committed by the dup's close
        f.write(b"x" * 10)  # the shared offset is 100
        assert p.read_bytes() == b"y" * 100  # the next version is not visible yet
    assert p.read_bytes() == b"y" * 100 + b"x" * 10
    with pytest.raises(PermissionError):
        os.open(p, os.O_WRONLY)  # a new open for writing: still an immutable page
    # unlinked while its writer goes on: the new bytes are discarded with the name
    q = mnt / "gone.bin"
    with open(q, "wb", buffering=0) as f:
        with os.fdopen(os.dup(f.fileno()), "wb", buffering=0) as dup:
            dup.write(b"z" * 10)
        os.unlink(q)
        f.write(b"w" * 10)
    assert not q.exists()


def test_bad_names(mnt: Path) -> None:
    cases = [
        (mnt / "sessions" / "s" / "layer-000", errno.EINVAL),  # not <s>/<prefix>/<layer>
        (mnt / ".kvfs-private", errno.EINVAL),  # reserved
        (mnt / ("x" * 256), errno.ENAMETOOLONG),
    ]
    (mnt / "sessions" / "s").mkdir(parents=True)
    for path, want in cases:
        with pytest.raises(OSError) as ei:
            write(path, b"x")
        assert ei.value.errno == want, path
    os.mkdir(mnt / "sessions/s/p")
    with pytest.raises(OSError) as ei:
        os.mkdir(mnt / "sessions/s/p/l")  # layers are files
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(OSError) as ei:
        os.open(os.fsencode(mnt) + b"/bad\xff", os.O_CREAT | os.O_WRONLY, 0o644)
    assert ei.value.errno == errno.EINVAL
    assert os.listdir(mnt / "sessions/s") == ["p"]


def test_xattrs_and_gds_path(mnt: Path) -> None:
    data = os.urandom(9 * MiB + 5)
    (mnt / "sessions/s/p").mkdir(parents=True)
    p = mnt / "sessions/s/p/layer-010"
    write(p, data)
    names = os.listxattr(p)
    assert names == [
        "user.kvfs.checksum",
        "user.kvfs.size",
        "user.kvfs.tier",
        "user.kvfs.pinned",
        "user.kvfs.session",
        "user.kvfs.extents",
    ]
    with open(p, "rb"):  # hold a lease, as the fast path does, and read the backing files
        assert os.getxattr(p, "user.kvfs.checksum").decode() == kvfs.checksum(data).hex()
        assert os.getxattr(p, "user.kvfs.size") == str(len(data)).encode()
        assert os.getxattr(p, "user.kvfs.pinned") == b"0"
        assert os.getxattr(p, "user.kvfs.session") == b"s"
        assert os.getxattr(p, "user.kvfs.tier") == b"local"
        back = bytearray()
        files, runs = decode_extents(os.getxattr(p, "user.kvfs.extents"))
        assert all(os.path.isabs(f) for f in files)
        for fi, off, length in runs:
            with open(files[fi], "rb") as f:
                back += os.pread(f.fileno(), length, off)
    assert back == data
    with pytest.raises(OSError) as ei:
        os.setxattr(p, "user.kvfs.pinned", b"1")
    assert ei.value.errno == errno.ENOTSUP


def test_concurrent_publishers_and_readers(mnt: Path) -> None:
    """Writers publish complete versions by tmp + rename; readers only ever see whole ones."""
    size = 512 * 1024
    versions = {i: bytes([i]) * size for i in range(1, 9)}
    write(mnt / "shared", versions[1])
    stop = threading.Event()
    problems: list[str] = []

    def publisher(w: int) -> None:
        for j in range(6):
            v = 1 + (w * 6 + j) % 8
            tmp = mnt / f"shared.tmp.{w}.{j}"
            write(tmp, versions[v])
            os.replace(tmp, mnt / "shared")

    def reader() -> None:
        while not stop.is_set():
            try:
                got = (mnt / "shared").read_bytes()
            except FileNotFoundError:
                problems.append("the name vanished during a replace")
                continue
            if got not in versions.values():
                problems.append(f"partial or mixed read: {len(got)} bytes")

    def own_pages(w: int) -> None:
        for j in range(5):
            d = os.urandom(200_000 + j)
            write(mnt / f"own-{w}-{j}", d)
            if (mnt / f"own-{w}-{j}").read_bytes() != d:
                problems.append(f"own-{w}-{j} read back wrong")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    writers = [threading.Thread(target=publisher, args=(w,)) for w in range(3)]
    writers += [threading.Thread(target=own_pages, args=(w,)) for w in range(3)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not problems, problems[:5]
    assert sorted(x for x in os.listdir(mnt) if x.startswith("shared")) == ["shared"]


def test_mmap_of_a_name_replaced_behind_the_mount(make_mount: object) -> None:
    """An open through a dentry the kernel still caches for the replaced page is answered
    ESTALE; the kernel redoes the lookup and opens the new page normally, so mmap (which a
    page-cache-bypassing open refuses with ENODEV) works and shows the new bytes."""
    m = make_mount()  # type: ignore[operator]
    old, new = b"o" * 8192, b"n" * 12288
    write(m.mp / "r", old)
    assert (m.mp / "r").read_bytes() == old  # the kernel now caches the name (1 s)
    with kvfs.open_remote_store_sync(m.data / "kvfs.sock") as st:
        st.put("r", new, replace=True)
    for _ in range(2):
        with open(m.mp / "r", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == new


def test_a_scratch_file_lives_until_its_last_close(mnt: Path) -> None:
    """A file unlinked while open (tempfile.TemporaryFile on a mount: no O_TMPFILE) lives
    until its last descriptor closes: the close of a duplicate (a child that had it as
    stdout) discarded it, and reads then failed with ENOENT, writes with EBADF."""
    with tempfile.TemporaryFile(dir=mnt) as f:
        subprocess.run(["echo", "hello from the child"], stdout=f, check=True)
        f.seek(0)
        assert f.read() == b"hello from the child\n"
        f.write(b"more")
        f.seek(0)
        assert f.read() == b"hello from the child\nmore"
    fd, p = tempfile.mkstemp(dir=mnt)
    try:
        os.write(fd, b"1" * 10)
        os.unlink(p)
        os.close(os.dup(fd))
        assert os.write(fd, b"2" * 10) == 10
        assert os.pread(fd, 30, 0) == b"1" * 10 + b"2" * 10
    finally:
        os.close(fd)
    assert os.listdir(mnt) == ["sessions"]  # (always there)


def test_a_writer_reads_its_own_version_after_a_dup_committed_it(mnt: Path) -> None:
    """Once a duplicate's close committed the page, its writer's descriptor reads the
    version it wrote (held), not whatever the name holds: it read another publisher's
    bytes after a replace, and ENOENT after an unlink."""
    for then in ("replace", "unlink"):
        with open(mnt / "out", "w+b") as f:
            f.write(b"mine" * 10)
            f.flush()
            os.close(os.dup(f.fileno()))  # the first close commits the page
            if then == "replace":
                write(mnt / "other.tmp", b"OTHER" * 10)
                os.replace(mnt / "other.tmp", mnt / "out")
            else:
                os.unlink(mnt / "out")
            f.seek(0)
            assert f.read() == b"mine" * 10, then
        if then == "replace":
            assert (mnt / "out").read_bytes() == b"OTHER" * 10
            os.unlink(mnt / "out")


def test_a_writer_killed_before_it_closed_leaves_no_page(mnt: Path) -> None:
    """The kernel closes a killed process's files as a close does, and the daemon committed
    what had been written: a dd killed with SIGKILL mid-write left a page of the bytes it had
    written (964 MB of 2 GB), and one killed before its first write an empty page."""
    for sig in (signal.SIGKILL, signal.SIGTERM):
        dd = subprocess.Popen(
            ["dd", "if=/dev/zero", f"of={mnt}/killed", "bs=1M", "count=100000"],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                if (mnt / "killed").stat().st_size > 4 << 20:
                    break
            time.sleep(0.01)
        dd.send_signal(sig)
        assert dd.wait() == -sig
        # its FLUSH is answered before the dying process goes on: the name is gone now
        assert "killed" not in os.listdir(mnt), sig
    script = (
        "import sys, time; f = open(sys.argv[1], 'wb'); print('open', flush=True); time.sleep(60)"
    )
    py = subprocess.Popen(
        [sys.executable, "-c", script, str(mnt / "empty")], stdout=subprocess.PIPE
    )
    assert py.stdout is not None and py.stdout.readline() == b"open\n"
    py.kill()
    py.wait()
    py.stdout.close()
    assert "empty" not in os.listdir(mnt)
    # a process that exits normally without closing is done writing: its file is a page
    done = "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY); os.write(fd, b'x' * 5000); os._exit(0)"
    subprocess.run([sys.executable, "-c", done, str(mnt / "exited")], check=True)
    assert (mnt / "exited").read_bytes() == b"x" * 5000


def test_a_file_closed_without_writes_is_listed_once_close_returns(mnt: Path) -> None:
    """`touch f; ls` lists f: the release that commits an empty file comes after close
    returned, and a listing taken meanwhile missed it (most of the time)."""
    (mnt / "t").mkdir()
    for i in range(60):
        open(mnt / "t" / f"py{i}", "wb").close()
        assert f"py{i}" in os.listdir(mnt / "t"), i
        subprocess.run(["touch", str(mnt / "t" / f"touch{i}")], check=True)
        assert f"touch{i}" in os.listdir(mnt / "t"), i


def test_a_file_closed_without_writes_counts_in_its_sessions_metadata(mnt: Path) -> None:
    """`touch` of a layer, then `.kvfs.json` counted the session's pages without it (most
    of the time): it was rendered before the release that commits an empty file came."""
    (mnt / "sessions" / "s" / "p").mkdir(parents=True)
    for i in range(20):
        open(mnt / "sessions" / "s" / "p" / f"layer-{i:03d}", "wb").close()
        doc = json.loads((mnt / "sessions" / "s" / ".kvfs.json").read_bytes())
        assert doc["pages"] == i + 1, doc


def test_a_session_directory_moves_and_copies_with_ordinary_tools(
    mnt: Path, tmp_path: Path
) -> None:
    """mv, cp -a and rsync -a of a session directory succeed: its generated .kvfs.json is
    not listed, so they do not try to copy it (it could be neither moved nor made in the
    destination: mv failed with the pages in both places, cp -a and rsync exited non-zero)."""
    src = mnt / "sessions" / "a" / "p"
    src.mkdir(parents=True)
    for i in range(2):
        write(src / f"layer-00{i}", b"%d" % i * 5000)
    subprocess.run(["mv", str(mnt / "sessions/a"), str(mnt / "sessions/b")], check=True)
    assert not (mnt / "sessions/a").exists()
    assert sorted(os.listdir(mnt / "sessions/b/p")) == ["layer-000", "layer-001"]
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-a", str(mnt / "sessions/b"), str(backup)], check=True)
    assert not (backup / ".kvfs.json").exists()
    subprocess.run(["cp", "-a", str(backup), str(mnt / "sessions/c")], check=True)
    subprocess.run(["rsync", "-a", f"{backup}/", f"{mnt}/sessions/d/"], check=True)
    for s in "bcd":
        assert (mnt / "sessions" / s / "p/layer-001").read_bytes() == b"1" * 5000
        assert json.loads((mnt / "sessions" / s / ".kvfs.json").read_text())["pages"] == 2
    subprocess.run(["rm", "-r", *(str(mnt / "sessions" / s) for s in "bcd")], check=True)
    assert os.listdir(mnt / "sessions") == []


def test_a_write_sets_the_files_mtime(mnt: Path) -> None:
    """mtime is the last write's time, while written and once committed (it was the
    create's: make, find -newer and cp -u saw the file older than it is); a utime after
    the writes (cp -p, rsync -a, tar -x) is kept."""
    fd = os.open(mnt / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"a")
        time.sleep(0.3)
        before_last = time.time_ns()
        os.write(fd, b"b")
        assert os.fstat(fd).st_mtime_ns >= before_last
    finally:
        os.close(fd)
    assert os.stat(mnt / "f").st_mtime_ns >= before_last
    with open(mnt / "g", "wb") as f:
        f.write(b"g")
        f.flush()
        os.utime(f.fileno(), ns=(10**18, 10**18))
    assert os.stat(mnt / "g").st_mtime_ns == 10**18


def test_a_file_being_written_shrinks_and_grows_with_truncate(make_mount: object) -> None:
    """A file still being written is truncated as any file: ftruncate shrinking it was
    EINVAL, yet its close published the bytes the writer had cut; truncate by name, and
    Python's write, seek(0), truncate() rewrite, too."""
    m = make_mount("trunc", "--stripe-unit", "64KiB")  # type: ignore[operator]
    data = os.urandom(300 * 1024)  # five stripe units
    with open(m.mp / "shrunk", "wb") as f:
        f.write(data)
        f.flush()
        os.ftruncate(f.fileno(), 100_000)
        assert os.fstat(f.fileno()).st_size == 100_000
        f.seek(200_000)
        f.write(b"tail")  # past the cut: zeros between, not the bytes that were cut
    assert (m.mp / "shrunk").read_bytes() == data[:100_000] + bytes(100_000) + b"tail"
    with open(m.mp / "by-name", "wb") as f:
        f.write(data[:5000])
        f.flush()
        os.truncate(m.mp / "by-name", 1000)
        os.truncate(m.mp / "by-name", 3000)  # grows with zeros
    assert (m.mp / "by-name").read_bytes() == data[:1000] + bytes(2000)
    with open(m.mp / "rewritten", "w+b") as f:
        f.write(data)
        f.seek(0)
        f.truncate()
        f.write(b"short")
        f.seek(0)
        assert f.read() == b"short"  # its writer reads what the file holds now
    assert (m.mp / "rewritten").read_bytes() == b"short"


def test_a_data_directory_removed_under_the_daemon_is_logged_once(make_mount: object) -> None:
    """rm -rf of the data directory under a running daemon: requests get EIO and the log
    says once, in one line, which directory is gone (every lookup logged a traceback),
    also once the directory was made again (as a write's makedirs does: not the store's)."""
    for name, again in (("gone", False), ("made-again", True)):
        m = make_mount(name)  # type: ignore[operator]
        shutil.rmtree(m.data)
        if again:
            m.data.mkdir()
        for page in ("a", "b", "c"):
            with pytest.raises(OSError) as ei:
                os.stat(m.mp / page)
            assert ei.value.errno == errno.EIO
        errors = m.new_errors()
        assert len(errors) == 1, errors
        assert f"the store's directory {m.data} is gone" in errors[0]


def test_nothing_written_after_the_data_directory_went_is_acknowledged(
    make_mount: object,
) -> None:
    """A file created, or closed, after the data directory was removed under the daemon
    fails with EIO: a worker thread that had the index open already committed into the
    removed file, close said success, and after a restart the page did not exist."""
    m = make_mount("written-after")  # type: ignore[operator]
    write(m.mp / "before", b"x")
    files = [open(m.mp / f"open-before-{i}", "wb") for i in range(8)]  # noqa: SIM115
    for f in files:
        f.write(b"y")  # (the files exist before the directory goes)
    shutil.rmtree(m.data)
    for f in files:
        f.write(b"z")
        with pytest.raises(OSError) as ei:
            f.close()
        assert ei.value.errno == errno.EIO
    for name in ("after", "later"):
        with pytest.raises(OSError) as ei:
            write(m.mp / name, b"w" * 4096)
        assert ei.value.errno == errno.EIO
    errors = m.new_errors()
    assert len(errors) == 1, errors
    assert f"the store's directory {m.data} is gone" in errors[0]


def test_an_open_page_whose_name_went_has_no_links(mnt: Path) -> None:
    """fstat of an open page whose name was unlinked or replaced says st_nlink 0, as for
    a file being written (it said 1)."""
    for then in ("unlink", "replace"):
        write(mnt / "p", b"old")
        with open(mnt / "p", "rb") as f:
            assert os.fstat(f.fileno()).st_nlink == 1
            if then == "unlink":
                os.unlink(mnt / "p")
            else:
                write(mnt / "p.tmp", b"new")
                os.replace(mnt / "p.tmp", mnt / "p")
            assert os.fstat(f.fileno()).st_nlink == 0, then
            assert f.read() == b"old"
        if then == "replace":
            assert os.stat(mnt / "p").st_nlink == 1
            os.unlink(mnt / "p")


def test_enospc_with_small_capacity(make_mount: object) -> None:
    m = make_mount("small", "--capacity", "8MiB", "--stripe-unit", "1MiB")  # type: ignore[operator]
    with pytest.raises(OSError) as ei:
        write(m.mp / "too-big", os.urandom(12 * MiB))
    assert ei.value.errno == errno.ENOSPC
    assert not (m.mp / "too-big").exists()  # nothing half-written became visible
    st = os.statvfs(m.mp)
    assert st.f_blocks * st.f_bsize == 8 * MiB
    write(m.mp / "fits", b"y" * MiB)
    assert (m.mp / "fits").read_bytes() == b"y" * MiB
    # fsync reports a write answered at once that failed behind it (it said success, and
    # the close that followed discarded the file: a writer checking fsync lost its data)
    fd = os.open(m.mp / "too-big-2", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        with pytest.raises(OSError) as ei:
            for _ in range(8):  # with its header, one block more than the cap
                os.write(fd, os.urandom(MiB))
            os.fsync(fd)
        assert ei.value.errno == errno.ENOSPC
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    assert not (m.mp / "too-big-2").exists()
    # a file grown past the cap by truncate is discarded too, and its close says so (it was
    # published as an empty page)
    r = subprocess.run(["truncate", "-s", "1G", str(m.mp / "sized")], capture_output=True)
    assert r.returncode != 0 and not (m.mp / "sized").exists()
    f = open(m.mp / "sized-py", "wb")  # noqa: SIM115
    with pytest.raises(OSError) as ei:
        os.ftruncate(f.fileno(), 1 << 30)
    assert ei.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as ei:
        f.close()
    assert ei.value.errno == errno.ENOSPC and not (m.mp / "sized-py").exists()


def test_a_full_disk_under_the_mount(make_mount: object) -> None:
    """Data on a real 16 MiB tmpfs with the cap above it: writes get ENOSPC and publish
    nothing, rm frees room, and the daemon restarts on a disk another writer filled to the
    last byte (the index's reserve) and can delete everything."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    m = make_mount("full", "--capacity", "1GiB", start=False)  # type: ignore[operator]
    m.data.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(m.data)], check=True)
    try:
        m.start()
        (m.mp / "eng").mkdir()
        written = []
        with pytest.raises(OSError) as ei:
            for i in range(20):
                write(m.mp / "eng" / f"f{i}", os.urandom(MiB))
                written.append(f"f{i}")
        assert ei.value.errno == errno.ENOSPC
        assert sorted(os.listdir(m.mp / "eng")) == sorted(written)  # the failed one: absent
        os.unlink(m.mp / "eng" / written[0])
        write(m.mp / "eng" / "again", b"a" * MiB)
        assert m.stop() == 0
        filler = m.data / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            f.write(bytes(16 * MiB))
        assert os.statvfs(m.data).f_bavail == 0
        m.start()
        assert len(os.listdir(m.mp / "eng")) == len(written)
        shutil.rmtree(m.mp / "eng")
        assert os.statvfs(m.data).f_bavail * 4096 >= 8 * MiB
        assert m.stop() == 0
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(m.data)], check=False)


def test_remount_and_sigkill(make_mount: object) -> None:
    m = make_mount("crash")  # type: ignore[operator]
    data = os.urandom(3 * MiB)
    write(m.mp / "kept", data)
    (m.mp / "empty").mkdir()
    assert m.stop() == 0
    assert not mounted(m.mp)
    m.start()
    assert (m.mp / "kept").read_bytes() == data
    assert (m.mp / "empty").is_dir()
    # SIGKILL with a file half-written: auto_unmount removes the mount, a remount is clean.
    f = open(m.mp / "half", "wb")  # noqa: SIM115 - left open on purpose
    try:
        f.write(b"z" * MiB)
        f.flush()
        watchdogs = fusermount3_children(m.proc.pid)
        # (gone already, it could not unmount: say so rather than wait)
        assert len(watchdogs) == 1, f"the daemon's fusermount3 watchdog: {watchdogs}"
        m.stop(signal.SIGKILL)
        deadline = time.monotonic() + 60  # the kill lands once a syscall in flight ends
        while mounted(m.mp) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not mounted(m.mp), (
            f"auto_unmount did not clean up after SIGKILL (watchdog: {proc_state(*watchdogs)})"
        )
        with pytest.raises(OSError):
            f.close()
    finally:
        # (closed whatever happened: left open, it failed the next test with a ResourceWarning)
        with contextlib.suppress(OSError):
            f.close()
    m.start()
    assert (m.mp / "kept").read_bytes() == data
    assert not (m.mp / "half").exists()
    assert sorted(os.listdir(m.mp)) == ["empty", "kept", "sessions"]


def proc_state(pid: int) -> str:
    """A process's state and where it sleeps in the kernel, or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return f"pid {pid} {state} in {f.read() or '-'}"
    except OSError:
        return f"pid {pid} gone"


def fusermount3_children(parent: int | None = None) -> set[int]:
    """The ``fusermount3`` children of ``parent`` (this process), zombies included."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") :]
            if comm == "fusermount3" and int(rest.split()[2]) == parent:
                found.add(int(name))
    return found


def fd_links() -> dict[int, str]:
    """This process's descriptors and what each is."""
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            links[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return links


def open_sockets() -> set[str]:
    return {x for x in fd_links().values() if x.startswith("socket:")}


def test_in_process_mounts_leave_no_fusermount3(tmp_path: Path) -> None:
    # auto_unmount's fusermount3 watchdog and libfuse's socket to it outlived each unmount
    # until the process exited: one of each per mount in a long-lived process.
    cfg = kvfs.StoreConfig(data_dirs=[tmp_path / "data"])
    mp = tmp_path / "mnt"
    mp.mkdir()
    children, sockets = fusermount3_children(), open_sockets()
    for i in range(3):
        with ServedMount(cfg, mp):
            assert len(fusermount3_children() - children) == 1  # the mount's own watchdog
            write(mp / f"f{i}", b"x")
        assert not mounted(mp)
        # (the watchdog exits by itself once told; it is waited for, a zombie counts too)
        deadline = time.monotonic() + 60
        while fusermount3_children() - children and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fusermount3_children() - children == set()
        assert open_sockets() - sockets == set()


def test_a_failed_mount_leaves_no_fusermount3(tmp_path: Path) -> None:
    # With auto_unmount libfuse keeps its socket to fusermount3 and never waits for it even
    # when the mount fails (and with a subtype it tries twice): each failed mount left two
    # zombies and two descriptors. "blkdev" (smuggled in through fsname) makes the kernel
    # refuse the mount after fusermount3 has started: its source is no block device.
    from kvfs._mount import MountError, MountOptions, serve_mount

    cfg = kvfs.StoreConfig(data_dirs=[tmp_path / "data"])
    mp = tmp_path / "mnt"
    mp.mkdir()
    children, sockets = fusermount3_children(), open_sockets()

    async def main() -> None:
        async with kvfs.open_store(cfg) as store:
            with pytest.raises(MountError):
                await serve_mount(store, mp, MountOptions(fsname="kvfs-test,blkdev"))

    for _ in range(2):
        trio.run(main)
    assert not mounted(mp)
    assert fusermount3_children() - children == set()
    assert open_sockets() - sockets == set()


def test_the_mount_names_its_store_by_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The embedded defaults give a relative data directory, and `mount` and `df` showed
    # "kvfs:kvfs-data": which store that was depended on where the daemon was started.
    monkeypatch.chdir(tmp_path)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with (
        ServedMount(kvfs.StoreConfig(data_dirs=[Path("kvfs-data")]), mp),
        open("/proc/self/mountinfo") as f,
    ):
        (line,) = [x for x in f if x.split()[4] == str(mp)]
    assert line.split(" - ")[1].split()[1] == f"kvfs:{tmp_path / 'kvfs-data'}"


def test_the_watchdogs_socket_is_numbered_below_dev_fuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dying process's descriptors are released last-numbered first, and libfuse's socket to
    # the watchdog was numbered above /dev/fuse: the watchdog could wake while the connection
    # was still up, see its open of the mountpoint aborted (ECONNABORTED, not ENOTCONN) and
    # leave the dead mount (test_remount_and_sigkill failed so on a loaded machine).
    from kvfs import _fusermount

    found: list[_fusermount.Watchdog | None] = []
    real = _fusermount.find_watchdog

    def recorded(before: _fusermount.Snapshot | None) -> _fusermount.Watchdog | None:
        found.append(real(before))
        return found[-1]

    monkeypatch.setattr(_fusermount, "find_watchdog", recorded)
    cfg = kvfs.StoreConfig(data_dirs=[tmp_path / "data"])
    mp = tmp_path / "mnt"
    mp.mkdir()
    fds = fd_links()
    with ServedMount(cfg, mp):
        (wd,) = found
        assert wd is not None
        now = fd_links()
        dev = [fd for fd, link in now.items() if link == "/dev/fuse" and fd not in fds]
        assert len(dev) == 1 and wd.fd < dev[0], (wd, dev)
        assert now[wd.fd] == wd.link
    assert fd_links().items() <= fds.items()  # (the descriptor held for it closed too)


def test_a_watchdog_slow_to_exit_is_reaped_without_a_trio_thread_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Past REAP_WAIT the thread left waiting for the watchdog held a token of trio's default
    # thread limiter until it exited: a watchdog that never exits took one of the slots
    # every to_thread call of the daemon shares, for good.
    from kvfs import _fusermount

    monkeypatch.setattr(_fusermount, "REAP_WAIT", 0.1)
    pid = os.posix_spawnp("sleep", ["sleep", "2"], os.environ)

    async def main() -> int:
        await _fusermount.Watchdog(pid, -1, "").release()
        return trio.to_thread.current_default_thread_limiter().borrowed_tokens

    assert trio.run(main) == 0
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")  # reaped by the thread left behind: no zombie


MOUNT_THEN_SPAWN = """
import subprocess, sys, trio, kvfs
from kvfs._mount import serve_mount

async def main():
    cfg = kvfs.StoreConfig(data_dirs=[sys.argv[1]])
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as nursery:
        await nursery.start(serve_mount, store, sys.argv[2])
        child = subprocess.Popen(["sleep", "600"], close_fds=False)
        print(child.pid, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def test_sigkill_cleans_up_despite_a_child_that_kept_descriptors(tmp_path: Path) -> None:
    # libfuse's socket to the watchdog was inheritable: a child started without closing
    # descriptors (close_fds=False, os.system, posix_spawn) held it, and the watchdog saw
    # the SIGKILLed process gone only when that child ended too, leaving a dead mount.
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", MOUNT_THEN_SPAWN, str(tmp_path / "data"), str(mp)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert mounted(mp)
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while mounted(mp) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not mounted(mp), "the mount outlived its daemon"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


MOUNT_AND_WAIT = """
import sys, trio, kvfs
from kvfs._mount import serve_mount

async def main():
    cfg = kvfs.StoreConfig(data_dirs=[sys.argv[1]])
    async with kvfs.open_store(cfg) as store, trio.open_nursery() as nursery:
        await nursery.start(serve_mount, store, sys.argv[2])
        print("mounted", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def test_sigkill_cleans_up_on_a_busy_machine(tmp_path: Path) -> None:
    # The watchdog's socket was released before /dev/fuse when the daemon died: with every
    # CPU busy, the dying daemon was descheduled between the two releases, the watchdog's
    # check of the mount was aborted instead of failing with ENOTCONN, and the dead mount
    # stayed (12 of 20 kills here; 0 of 20 with the socket numbered below /dev/fuse).
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    left = []
    try:
        for i in range(8):
            mp = tmp_path / f"mnt{i}"
            mp.mkdir()
            proc = subprocess.Popen(
                [sys.executable, "-c", MOUNT_AND_WAIT, str(tmp_path / f"data{i}"), str(mp)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "mounted"
                for tid in os.listdir(f"/proc/{proc.pid}/task"):  # (the hogs go first)
                    os.setpriority(os.PRIO_PROCESS, int(tid), 19)
                proc.kill()
                proc.wait(timeout=60)
                deadline = time.monotonic() + 30
                while mounted(mp) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if mounted(mp):
                    left.append(mp.name)
            finally:
                proc.kill()
                proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert left == [], f"dead mounts left after SIGKILL: {left}"


def test_detached_mount_and_umount(tmp_path: Path) -> None:
    mp, data = tmp_path / "mnt", tmp_path / "data"
    mp.mkdir()
    try:
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(data), str(mp)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert mounted(mp)
        write(mp / "x", b"1")
        # In use (a file open): refused, as umount(8) would; the reader is not cut off.
        with open(mp / "x", "rb") as reader:
            r = subprocess.run([*KVFS, "umount", str(mp)], capture_output=True, text=True)
            assert r.returncode == 9 and "in use" in r.stderr and "--force" in r.stderr
            assert mounted(mp) and reader.read() == b"1"
        r = subprocess.run(
            [*KVFS, "umount", "--json", str(mp)], capture_output=True, text=True, timeout=90
        )
        assert r.returncode == 0, r.stderr
        assert not mounted(mp)
        assert json.loads(r.stdout)["mountpoint"] == str(mp)
        r = subprocess.run([*KVFS, "umount", str(mp)], capture_output=True, text=True)
        assert r.returncode == 7 and "no kvfs mount" in r.stderr
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(tmp_path / "new"), str(tmp_path / "missing")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "does not exist" in r.stderr
        assert not (tmp_path / "new").exists()  # a mount that fails creates no store
        (tmp_path / "afile").write_bytes(b"")
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(tmp_path / "afile"), str(mp)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2 and "afile is not a directory" in r.stderr, r.stderr
        # a log in a directory that is not there: told, not made (nor the store)
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(tmp_path / "new"), "--log", str(tmp_path / "no/l")]
            + [str(mp)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2 and "no is not a directory" in r.stderr, r.stderr
        assert not (tmp_path / "no").exists() and not (tmp_path / "new").exists()
        # --force unmounts a mount in use; its readers get ENOTCONN from then on
        r = subprocess.run([*KVFS, "mount", "--data", str(data), str(mp)], capture_output=True)
        assert r.returncode == 0
        # a data directory another daemon serves: exit 6 (locked), as the store commands
        (tmp_path / "mp2").mkdir()
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(data), str(tmp_path / "mp2")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 6 and "in use by pid" in r.stderr, r.stderr
        # an archive it cannot open: exit 8 (archive unavailable)
        r = subprocess.run(
            [*KVFS, "mount", "--data", str(tmp_path / "d8"), str(tmp_path / "mp2")]
            + ["--archive", f"file://{tmp_path / 'afile' / 'archive'}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 8 and "Not a directory" in r.stderr, r.stderr
        reader = open(mp / "x", "rb")  # noqa: SIM115 - its close fails too (ENOTCONN)
        r = subprocess.run([*KVFS, "umount", "--force", str(mp)], capture_output=True)
        assert r.returncode == 0 and not mounted(mp)
        with pytest.raises(OSError):
            reader.read()
        with contextlib.suppress(OSError):
            reader.close()
        log = (data / "kvfs-daemon.log").read_text()
        assert "ERROR" not in log and "Traceback" not in log, log
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def _as_nobody(script: str) -> str:
    """Run a shell script as uid/gid 65534: "ok", or "EACCES" when it was refused."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    r = subprocess.run(
        ["/bin/sh", "-c", script], capture_output=True, text=True, preexec_fn=drop, timeout=60
    )
    if r.returncode == 0:
        return "ok"
    return "EACCES" if "Permission denied" in r.stderr else f"rc={r.returncode}: {r.stderr}"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_access_control(tmp_path: Path) -> None:
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="kvfs-acl-"))  # traversable by everyone
    try:
        top.chmod(0o755)
        private = Mount(top / "private")
        private.data = tmp_path / "d1"
        private.mp.parent.chmod(0o755)
        private.start()
        write(private.mp / "page", b"secret")
        # Without --allow-other nobody but the mounting user gets in.
        assert _as_nobody(f"ls {private.mp}") == "EACCES"
        private.stop()
        shared = Mount(top / "shared", "--allow-other")
        shared.data = tmp_path / "d2"
        shared.mp.parent.chmod(0o755)
        shared.start()
        write(shared.mp / "page", b"public")
        os.mkdir(shared.mp / "drop")
        os.chmod(shared.mp / "drop", 0o1777)
        p = str(shared.mp)
        probe = {
            f"cat {p}/page": "ok",  # 0644, owned by root: readable
            f"touch {p}/mine": "EACCES",  # root's 0755 directory
            f"echo x >> {p}/page": "EACCES",  # the mode says no (before immutability)
            f"echo x > {p}/drop/mine": "ok",
        }  # a 1777 directory
        for script, want in probe.items():
            assert _as_nobody(script) == want, script
        assert (shared.mp / "drop" / "mine").stat().st_uid == 65534
        shared.stop()
        assert not private.new_errors() and not shared.new_errors()
    finally:
        for m in ("private", "shared"):
            subprocess.run(["fusermount3", "-u", "-z", str(top / m / "mnt")], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


async def test_run_daemon_starts_services_and_unmounts(tmp_path: Path) -> None:
    """The async core in this process: services start with the store before the mount, and
    cancelling the daemon unmounts and stops them."""
    import trio

    from kvfs._daemon import run_daemon
    from kvfs._mount import MountOptions

    mp = tmp_path / "mnt"
    mp.mkdir()
    events: list[str] = []

    async def service(store: kvfs.Store, *, task_status: trio.TaskStatus[None]) -> None:
        events.append(f"started with {type(store).__name__}")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            events.append("stopped")

    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "data",))
    try:
        async with trio.open_nursery() as nursery:
            store = await nursery.start(run_daemon, cfg, mp, MountOptions(), [service])
            await store.put("lmcache/x", b"from the object API")
            # FUSE requests are served by this trio loop: touch the mount from a thread.
            got = await trio.to_thread.run_sync((mp / "lmcache" / "x").read_bytes)
            assert got == b"from the object API"
            assert await trio.to_thread.run_sync(mounted, mp)
            nursery.cancel_scope.cancel()
        assert events == ["started with Store", "stopped"]
        assert not mounted(mp)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


@pytest.mark.parametrize("keep", [False, True])
def test_the_stop_signals_after_the_daemon_returns(keep: bool) -> None:
    """Once run_daemon returns its signals get their previous handlers back; for
    ``kvfs mount`` (``keep_absorbing``: the process exits next) they stay ignored. A
    SIGTERM that came between the store's close and the process's exit killed a daemon
    that had stopped cleanly (exit -15, its state file left)."""
    from kvfs._daemon import STOP_SIGNALS, _Stopping

    async def run() -> None:
        with _Stopping().handling_signals(keep_absorbing=keep):
            assert all(callable(signal.getsignal(s)) for s in STOP_SIGNALS)

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        trio.run(run)
        after = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        assert after == ({s: signal.SIG_IGN for s in STOP_SIGNALS} if keep else before)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_corrupted_backing_byte_is_eio_never_data(mnt: Path) -> None:
    """A flipped byte in a backing file: the leaf holding it reads as EIO through the mount
    (buffered backing reads verify every 1 MiB leaf), the other leaves still read."""
    data = os.urandom(3 * MiB)
    (mnt / "corrupt").mkdir()
    p = mnt / "corrupt/page.bin"
    write(p, data)
    files, runs = decode_extents(os.getxattr(p, "user.kvfs.extents"))
    path, off = files[runs[0][0]], runs[0][1]
    with open(path, "r+b") as f:  # flip one byte inside the second 1 MiB leaf
        pos = off + MiB + 12345
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing served from the mount's cache
        assert os.pread(fd, MiB, 0) == data[:MiB]
        assert os.pread(fd, MiB, 2 * MiB) == data[2 * MiB :]
        with pytest.raises(OSError) as ei:
            os.pread(fd, MiB, MiB)
        assert ei.value.errno == errno.EIO
    finally:
        os.close(fd)


# -- found by a review of the mount (tenth session); each failed before its fix ------------
def kvfs_cli(m: object, *args: str) -> str:
    """A kvfs command against the daemon serving mount ``m``."""
    data = str(m.data)  # type: ignore[attr-defined]
    r = subprocess.run([*KVFS, *args, "--data", data], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_kvfs_ls_of_an_empty_directory_on_the_mount_lists_nothing(make_mount: object) -> None:
    """kvfs ls of a directory made with mkdir and still empty lists no pages and exits 0,
    as ls does (it said "no page, session or directory", exit 3); a name that is not there
    is still exit 3."""
    m = make_mount("lsdir")  # type: ignore[operator]
    for d in ("empty", "sessions/s1", "engine/sub"):
        (m.mp / d).mkdir(parents=True)
        assert json.loads(kvfs_cli(m, "ls", str(m.mp / d), "--json")) == []
    r = subprocess.run([*KVFS, "ls", "empty", "--json"], cwd=m.mp, capture_output=True, text=True)
    assert (r.returncode, json.loads(r.stdout)) == (0, []), r.stderr
    r = subprocess.run([*KVFS, "ls", str(m.mp / "nothing")], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr


def test_touch_chown_and_tar_on_the_mount_root_keep_it_listable(
    make_mount: object, tmp_path: Path
) -> None:
    """A setattr on the root stored a directory row with an empty path, which readdir then
    listed as an entry with an empty name: `ls` of the root failed with EIO, across remounts.
    `tar -x` into the root also failed to chown "." to the owner it already had."""
    m = make_mount()  # type: ignore[operator]
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"x" * 5000)
    subprocess.run(["touch", str(m.mp)], check=True)
    os.chown(m.mp, os.getuid(), os.getgid())
    subprocess.run(f"tar cf - -C {src} . | tar xf - -C {m.mp}", shell=True, check=True)
    assert sorted(os.listdir(m.mp)) == ["d", "sessions"]
    m.stop()
    m.start()
    assert sorted(os.listdir(m.mp)) == ["d", "sessions"]
    assert (m.mp / "d" / "f").read_bytes() == b"x" * 5000


def test_touch_of_a_directory_sets_its_mtime_across_remounts(make_mount: object) -> None:
    """utime on a directory (`touch dir`, `touch -d`, tar and rsync restoring times) is kept
    like a file's: the mtime, in kvfs-dirs.sqlite3; a directory's atime is not kept apart
    (it reads as its mtime)."""
    m = make_mount()  # type: ignore[operator]
    (m.mp / "made").mkdir()
    for d, name in (("eng/sub", "f"), ("sessions/s/p", "layer-000")):
        (m.mp / d).mkdir(parents=True)
        write(m.mp / d / name, b"x")
    dirs = ["", "sessions", "sessions/s", "sessions/s/p", "made", "eng", "eng/sub"]
    for i, d in enumerate(dirs):
        subprocess.run(["touch", str(m.mp / d)], check=True)
        os.utime(m.mp / d, ns=(5 * 10**17, 10**18 + i))
        assert os.stat(m.mp / d).st_mtime_ns == 10**18 + i, d
    m.stop()
    m.start()
    for i, d in enumerate(dirs):
        st = os.stat(m.mp / d)
        assert st.st_mtime_ns == st.st_atime_ns == 10**18 + i, d
    assert (m.mp / "eng" / "sub" / "f").read_bytes() == b"x"


def test_rmdir_of_a_directory_leaves_the_session_of_the_same_name(make_mount: object) -> None:
    """rmdir of an empty top-level directory `bar` deleted the semantic session
    `sessions/bar` (a bare name means that one when it exists)."""
    m = make_mount()  # type: ignore[operator]
    (m.mp / "bar").mkdir()
    write(m.mp / "bar" / "x", b"data")
    kvfs_cli(m, "pin", "bar/")  # the directory's session stays, pinned, once empty
    (m.mp / "bar" / "x").unlink()
    (m.mp / "sessions" / "bar" / "p").mkdir(parents=True)
    write(m.mp / "sessions" / "bar" / "p" / "layer-000", b"precious")
    os.rmdir(m.mp / "bar")
    assert (m.mp / "sessions" / "bar" / "p" / "layer-000").read_bytes() == b"precious"
    assert "bar" not in os.listdir(m.mp)


def test_a_shared_writable_mapping_commits_every_write(make_mount: object) -> None:
    """numpy.memmap(mode="w+"): the first close commits the file as sized, then the mapping's
    writeback arrives as several writes at once after it. Each made its own next version and
    only the last was committed: most of the writes were lost, and the others' reservations
    and files leaked."""
    m = make_mount()  # type: ignore[operator]
    p = m.mp / "mm" / "f"
    p.parent.mkdir()
    n = 6 * MiB
    arr = np.memmap(p, dtype=np.uint8, mode="w+", shape=(n,))
    arr[:] = 7
    arr.flush()
    del arr
    data = p.read_bytes()
    assert len(data) == n and data.count(b"\x07") == n
    st = json.loads(kvfs_cli(m, "stats", "--json"))
    assert st["reserved_bytes"] == 0
    assert st["pages"] == 1 and n <= st["used_bytes"] < n + MiB  # (its header, alignment)


def test_readers_see_committed_bytes_while_a_writer_builds_the_next_version(mnt: Path) -> None:
    """A writer that closed a duplicate of its fd (committing the page) and writes on: its
    writes sit in the inode's page cache, uncommitted; a reader opening meanwhile got them."""
    p = mnt / "v" / "page"
    p.parent.mkdir()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"A" * (2 * MiB))
        os.close(os.dup(fd))  # commits version 1
        assert p.read_bytes() == b"A" * (2 * MiB)
        os.pwrite(fd, b"B" * MiB, 0)  # the next version, not committed yet
        assert p.read_bytes() == b"A" * (2 * MiB)
    finally:
        os.close(fd)  # commits version 2
    assert p.read_bytes() == b"B" * MiB + b"A" * MiB


def committed_by_its_writer(mnt: Path, name: str, how: str, flags: int) -> tuple[Path, int]:
    """The page ``name``, 100 bytes of A, committed while its writer goes on (``how``: a dup
    of its descriptor closed, or the open file renamed to ``name``); and that descriptor."""
    p = mnt / name
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(p if how == "dup" else tmp, os.O_CREAT | flags, 0o644)
    try:
        os.write(fd, b"A" * 100)
        if how == "dup":
            os.close(os.dup(fd))
        else:
            os.rename(tmp, p)
    except BaseException:
        os.close(fd)
        raise
    return p, fd


def test_an_appending_writer_goes_on_at_the_end_once_its_page_was_committed(mnt: Path) -> None:
    """A stat of a page whose writer builds its next version (a dup closed, or the open
    file renamed) said the committed size: the kernel took it as the file's size, and the
    writer's next O_APPEND write landed there, over the bytes it had written since."""
    for how in ("dup", "rename"):
        p, fd = committed_by_its_writer(mnt, f"log-{how}", how, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"B" * 100)
            assert os.fstat(fd).st_size == 200, how
            os.write(fd, b"C" * 100)
        finally:
            os.close(fd)
        assert p.read_bytes() == b"A" * 100 + b"B" * 100 + b"C" * 100, how


def test_a_writer_truncates_its_next_version_once_its_page_was_committed(mnt: Path) -> None:
    """A writer's ftruncate once a dup's close or a rename committed its page, as it wrote
    on: a truncate to the committed size answered 0 and did nothing (the close published
    the longer version), one to the size it had written, EPERM. It truncates the version
    it builds, as a file being written truncates; a truncate by name stays EPERM."""
    for how in ("dup", "rename"):
        p, fd = committed_by_its_writer(mnt, f"t-{how}", how, os.O_WRONLY)
        try:
            os.write(fd, b"B" * 100)
            os.ftruncate(fd, 200)  # its own size: nothing to do
            os.ftruncate(fd, 100)  # the committed size
            assert os.fstat(fd).st_size == 100, how
            os.ftruncate(fd, 50)
            os.write(fd, b"C" * 10)  # at offset 200: zeros before it
            with pytest.raises(PermissionError):
                os.truncate(p, 10)  # by name, not through its descriptor: a committed page
            assert p.read_bytes() == b"A" * 100, how  # the committed version meanwhile
        finally:
            os.close(fd)
        assert p.read_bytes() == b"A" * 50 + bytes(150) + b"C" * 10, how


def test_a_writer_reads_back_what_it_wrote_once_its_page_was_committed(mnt: Path) -> None:
    """An O_RDWR writer whose page a dup's close or a rename committed, writing on: reads
    through its descriptor answered the committed version, without the writes it had made
    since (those it reads back from the page cache aside)."""
    for how in ("dup", "rename"):
        p, fd = committed_by_its_writer(mnt, f"rw-{how}", how, os.O_RDWR)
        try:
            os.pwrite(fd, b"B" * 10, 5)
            os.write(fd, b"C" * 100)
            want = b"A" * 5 + b"B" * 10 + b"A" * 85 + b"C" * 100
            assert os.pread(fd, 1000, 0) == want, how
            assert p.read_bytes() == b"A" * 100, how  # another open: the committed version
        finally:
            os.close(fd)
        assert p.read_bytes() == want, how


def test_chmod_and_utime_of_a_page_its_writer_rewrites_are_kept(mnt: Path) -> None:
    """chmod and utime of a page while its writer built the next version (it wrote after a
    rename of the open file committed it) were undone when its close committed that
    version: the page had the mode of when that version's first write came, and the mtime
    of its last write. (Within a second the kernel's cached attributes hid it: fresh_stat.)"""
    when = 1_600_000_000_123_456_789
    fd = os.open(mnt / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"a")
        os.rename(mnt / "f", mnt / "g")  # committed; this fd writes the next version
        os.write(fd, b"b")
        os.chmod(mnt / "g", 0o600)
        os.utime(mnt / "g", ns=(when, when))
    finally:
        os.close(fd)
    assert (mnt / "g").read_bytes() == b"ab"
    s = fresh_stat(mnt / "g")
    assert (s.st_mode & 0o7777, s.st_mtime_ns) == (0o600, when)


def test_a_page_renamed_while_its_writer_builds_the_next_version_gets_it(mnt: Path) -> None:
    """A page renamed while its writer built the next version (it wrote on after a rename
    of the open file committed it): that writer's close committed the version under the
    old name, which came back, and the new name kept the previous version."""
    fd = os.open(mnt / "a", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"1")
        os.rename(mnt / "a", mnt / "b")  # committed; this fd writes the next version
        os.write(fd, b"2")
        os.rename(mnt / "b", mnt / "c")
    finally:
        os.close(fd)
    assert sorted(os.listdir(mnt)) == ["c", "sessions"]
    assert (mnt / "c").read_bytes() == b"12"


def test_a_directory_holding_a_file_being_written_does_not_rename_empty(mnt: Path) -> None:
    """A directory rename ignored files still being written in it: the file was later
    published under the old name, which came back; and an empty directory replaced one
    whose only entry was such a file."""
    (mnt / "d1").mkdir()
    with open(mnt / "d1" / "f", "wb") as f:
        f.write(b"1" * 1000)
        f.flush()
        with pytest.raises(OSError) as ei:
            os.rename(mnt / "d1", mnt / "d2")
        assert ei.value.errno == errno.EXDEV  # mv copies instead
        (mnt / "e").mkdir()
        with pytest.raises(OSError) as ei:
            os.rename(mnt / "e", mnt / "d1")
        assert ei.value.errno == errno.ENOTEMPTY
    assert (mnt / "d1" / "f").read_bytes() == b"1" * 1000


def test_mv_and_cp_a_within_the_mount_are_quiet(mnt: Path, tmp_path: Path) -> None:
    """Copying pages within the mount copies their read-only user.kvfs.* attributes too;
    EPERM made mv print an error per attribute of every file (ENOTSUP is skipped)."""
    write(mnt / "src.bin", os.urandom(10_000))
    (mnt / "a").mkdir()
    write(mnt / "a" / "f", os.urandom(10_000))
    for cmd in (["cp", "-a", "src.bin", "copy.bin"], ["mv", "a", "b"]):
        r = subprocess.run(cmd, cwd=mnt, capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "", (cmd, r.stderr)
    assert (mnt / "copy.bin").read_bytes() == (mnt / "src.bin").read_bytes()
    assert os.listdir(mnt / "b") == ["f"]


def test_a_name_over_255_bytes_is_enametoolong_on_lookup_too(mnt: Path) -> None:
    with pytest.raises(OSError) as ei:
        os.stat(mnt / ("a" * 300))
    assert ei.value.errno == errno.ENAMETOOLONG


def test_rm_r_of_a_session_directory(mnt: Path) -> None:
    """`rm -r sessions/s` failed: rm listed .kvfs.json, removed the pages (and with them the
    session), then found .kvfs.json gone (ENOENT), and the directory stayed."""
    for prefix in ("p0", "p1"):
        (mnt / "sessions" / "s" / prefix).mkdir(parents=True)
        for layer in range(3):
            write(mnt / "sessions" / "s" / prefix / f"layer-{layer:03d}", os.urandom(5000))
    with pytest.raises(OSError) as ei:  # while it describes pages, it is not deleted alone
        os.unlink(mnt / "sessions" / "s" / ".kvfs.json")
    assert ei.value.errno == errno.EPERM
    r = subprocess.run(["rm", "-r", str(mnt / "sessions" / "s")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert os.listdir(mnt / "sessions") == []


def test_kvfs_rm_of_a_session_takes_the_directories_made_in_it(make_mount: object) -> None:
    """`kvfs rm s` deleted the pages of sessions/s but left the directories mkdir had made
    in it (kept so an empty one survives a remount): `ls sessions` still listed s, and so
    did every mount after it. The daemon's rm, and an offline rm between mounts, alike.
    An engine's own directory stays, emptied: the engine writes on into it."""
    m = make_mount()  # type: ignore[operator]
    for s in ("s", "t"):
        (m.mp / "sessions" / s / "p0").mkdir(parents=True)
        (m.mp / "sessions" / s / "empty").mkdir()
        write(m.mp / "sessions" / s / "p0" / "layer-000", b"kv")
    (m.mp / "engine").mkdir()
    write(m.mp / "engine" / "page", b"kv")
    kvfs_cli(m, "rm", "s", "engine/")  # through the daemon
    assert os.listdir(m.mp / "sessions") == ["t"] and os.listdir(m.mp / "engine") == []
    m.stop()
    kvfs_cli(m, "rm", "t")  # offline
    m.start()
    assert os.listdir(m.mp / "sessions") == []
    write(m.mp / "engine" / "page", b"kv")  # the engine writes on


def test_ls_a_lists_dot_and_dot_dot(mnt: Path) -> None:
    """Directories listed no "." and "..": `ls -a` showed neither, unlike every other file
    system (and `ls -ai` must show each with its directory's inode)."""
    (mnt / "d" / "e").mkdir(parents=True)
    write(mnt / "d" / "page", b"kv")
    for d, up in ((mnt, mnt.parent), (mnt / "d", mnt), (mnt / "d" / "e", mnt / "d")):
        r = subprocess.run(["ls", "-ai", str(d)], capture_output=True, text=True, check=True)
        inos = {name: int(ino) for ino, name in (line.split() for line in r.stdout.splitlines())}
        assert inos["."] == os.stat(d).st_ino and inos[".."] == os.stat(up).st_ino, r.stdout
    assert sorted(os.listdir(mnt / "d")) == ["e", "page"]
    found = subprocess.run(["find", "."], cwd=mnt, capture_output=True, text=True, check=True)
    assert sorted(found.stdout.split()) == [".", "./d", "./d/e", "./d/page", "./sessions"]


def test_page_attributes_are_set_as_xattrs_while_writing(make_mount: object) -> None:
    """Pages written through the mount could carry no attributes (model, dtype...): the
    session showed no model in `kvfs ls`, and a page copied within the mount lost them.
    `user.kvfs.attr.<k>` sets one on a file being written; the page is committed with it."""
    m = make_mount()  # type: ignore[operator]
    p = m.mp / "sessions" / "s" / "p" / "layer-000"
    p.parent.mkdir(parents=True)
    with open(p, "wb") as f:
        f.write(b"kv" * 1000)
        os.setxattr(f.fileno(), "user.kvfs.attr.model", b"org/model@rev")
        os.setxattr(f.fileno(), "user.kvfs.attr.dtype", b"bf16")
        os.setxattr(f.fileno(), "user.kvfs.attr.gone", b"x")
        os.removexattr(f.fileno(), "user.kvfs.attr.gone")
        assert os.getxattr(f.fileno(), "user.kvfs.attr.dtype") == b"bf16"
        for name, value, err in (
            ("user.kvfs.attr.fs.mode", b"777", errno.EPERM),  # the mount's own
            ("user.kvfs.attr.bad", b"\xff", errno.EINVAL),  # not UTF-8
            (b"user.kvfs.attr.\xff", b"1", errno.EINVAL),  # (an EIO and a logged error)
            ("user.kvfs.attr.", b"1", errno.EINVAL),  # no name (was ENOTSUP)
            ("user.other", b"1", errno.ENOTSUP),
        ):
            with pytest.raises(OSError) as ei:
                os.setxattr(f.fileno(), name, value)
            assert ei.value.errno == err, name
        # more names than listxattr can list (64 KiB): every copy would have lost them all
        with pytest.raises(OSError) as ei:
            for i in range(300):
                os.setxattr(f.fileno(), f"user.kvfs.attr.{i:03d}" + "n" * 230, b"1")
        assert ei.value.errno == errno.E2BIG and i > 200
        for name in [x for x in os.listxattr(f.fileno()) if x.endswith("n" * 230)]:
            os.removexattr(f.fileno(), name)
        # another process can no more change them than open the file (it changed them)
        other = subprocess.run(
            [sys.executable, "-c", f"import os; os.setxattr({str(p)!r}, 'user.kvfs.attr.x', b'1')"],
            capture_output=True,
            text=True,
        )
        assert "Device or resource busy" in other.stderr, other.stderr
    assert os.getxattr(p, "user.kvfs.attr.model") == b"org/model@rev"
    assert [x for x in os.listxattr(p) if ".attr." in x] == [
        "user.kvfs.attr.dtype",
        "user.kvfs.attr.model",
    ]
    with pytest.raises(OSError) as ei:  # as immutable as the bytes, once committed
        os.setxattr(p, "user.kvfs.attr.dtype", b"fp8")
    assert ei.value.errno == errno.EPERM
    info = json.loads(kvfs_cli(m, "ls", "s", "--json"))[0]
    assert info["attrs"]["model"] == "org/model@rev" and info["attrs"]["dtype"] == "bf16"
    assert json.loads(kvfs_cli(m, "ls", "--json"))[0]["attrs"]["model"] == "org/model@rev"
    # cp -a within the mount, and out to a plain directory and back, keeps them, quietly
    r = subprocess.run(["cp", "-a", str(p), str(p.with_name("layer-001"))], capture_output=True)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert os.getxattr(p.with_name("layer-001"), "user.kvfs.attr.dtype") == b"bf16"
    out = m.mp.parent / "plain"  # (the test's tmp_path: ext4 or tmpfs, both keep user.*)
    for src, dst in ((p, out), (out, p.with_name("layer-002"))):
        r = subprocess.run(["cp", "-a", str(src), str(dst)], capture_output=True)
        assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert os.getxattr(p.with_name("layer-002"), "user.kvfs.attr.model") == b"org/model@rev"
    assert os.listxattr(m.mp / "sessions" / "s") == []  # a directory has none


def test_a_next_version_missing_a_write_is_never_published(make_mount: object) -> None:
    """A file renamed (or a dup closed) while its writer goes on: later writes make the
    next version. A write to it that failed (ENOSPC) did not stop it: close returned 0 and
    the page lost that write. Now the close fails and the page stays as it was."""
    m = make_mount("next", "--capacity", "8MiB", "--stripe-unit", "1MiB")  # type: ignore[operator]
    fd = os.open(m.mp / "tmp", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"A" * 1024)
        os.rename(m.mp / "tmp", m.mp / "page")  # published: b"A" * 1024
        os.pwrite(fd, b"B" * 1024, 0)
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, b"C", 300 << 20)  # past the cap
        assert ei.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, b"D", 2048)  # the version misses a write: the rest fail too
        assert ei.value.errno == errno.ENOSPC
    finally:
        with pytest.raises(OSError) as ei:
            os.close(fd)
    assert ei.value.errno == errno.ENOSPC
    assert (m.mp / "page").read_bytes() == b"A" * 1024


def test_a_writer_killed_while_rewriting_its_published_file_leaves_the_last_version(
    mnt: Path,
) -> None:
    """A writer publishes by rename, writes on, and is killed: its unfinished next version
    was committed at the kernel's close, as a first version never is."""
    script = (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1] + '.tmp', os.O_CREAT | os.O_WRONLY, 0o644)\n"
        "os.write(fd, b'HEADER-v1|')\n"
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "os.write(fd, b'half-of-v2')\n"
        "print('written', flush=True)\n"
        "time.sleep(60)\n"
    )
    py = subprocess.Popen([sys.executable, "-c", script, str(mnt / "k")], stdout=subprocess.PIPE)
    assert py.stdout is not None and py.stdout.readline() == b"written\n"
    assert (mnt / "k").read_bytes() == b"HEADER-v1|"
    py.kill()
    py.wait()
    py.stdout.close()
    assert (mnt / "k").read_bytes() == b"HEADER-v1|"


def test_only_its_writer_publishes_a_file_being_written(mnt: Path) -> None:
    """Another process renamed a file still being written: that committed the bytes so far
    as a page, which the writer's SIGKILL then left behind. It is EBUSY now (the writer
    may rename it, as before)."""
    script = (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o644)\n"
        "os.write(fd, b'PART')\n"
        "print('written', flush=True)\n"
        "time.sleep(60)\n"
    )
    py = subprocess.Popen([sys.executable, "-c", script, str(mnt / "w")], stdout=subprocess.PIPE)
    try:
        assert py.stdout is not None and py.stdout.readline() == b"written\n"
        with pytest.raises(OSError) as ei:
            os.rename(mnt / "w", mnt / "w2")
        assert ei.value.errno == errno.EBUSY
    finally:
        py.kill()
        py.wait()
        assert py.stdout is not None
        py.stdout.close()
    assert not (mnt / "w2").exists() and not (mnt / "w").exists()


def test_directory_renames_an_engine_or_mv_may_try(mnt: Path) -> None:
    """sessions/ itself is EBUSY (the rename succeeded and left it in place, as it always
    is); a tree of empty directories moves whole (it was EXDEV); flags the mount does not
    offer are EINVAL (RENAME_WHITEOUT renamed plainly)."""
    import ctypes

    with pytest.raises(OSError) as ei:
        os.rename(mnt / "sessions", mnt / "s2")
    assert ei.value.errno == errno.EBUSY
    assert sorted(os.listdir(mnt)) == ["sessions"]
    (mnt / "x" / "y" / "z").mkdir(parents=True)
    os.chmod(mnt / "x" / "y", 0o700)
    os.rename(mnt / "x", mnt / "moved")
    assert sorted(os.listdir(mnt)) == ["moved", "sessions"]
    assert os.listdir(mnt / "moved" / "y") == ["z"]
    assert os.stat(mnt / "moved" / "y").st_mode & 0o7777 == 0o700
    write(mnt / "moved" / "y" / "z" / "page", b"p" * 10)  # the moved tree works
    assert (mnt / "moved" / "y" / "z" / "page").read_bytes() == b"p" * 10
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "moved", mnt / "again")  # holds a page now
    assert ei.value.errno == errno.EXDEV
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_whiteout = -100, 4
    rc = libc.renameat2(
        at_fdcwd,
        os.fsencode(mnt / "moved" / "y" / "z" / "page"),
        at_fdcwd,
        os.fsencode(mnt / "moved" / "y" / "z" / "page2"),
        rename_whiteout,
    )
    assert rc == -1 and ctypes.get_errno() == errno.EINVAL


def test_a_tree_of_empty_directories_moves_into_sessions_only_as_it_could_be_made(
    mnt: Path,
) -> None:
    """A tree of empty directories renamed into sessions/ landed below a prefix (`mv e
    sessions/s` with e/a/c made sessions/s/a/c, where mkdir is EINVAL: layers are files);
    and an empty directory renamed onto an empty sessions/ replaced it, its mode with it,
    where rmdir sessions is EBUSY."""
    (mnt / "e" / "a" / "c").mkdir(parents=True)
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "e", mnt / "sessions" / "s")
    assert ei.value.errno == errno.EINVAL
    assert sorted(os.listdir(mnt)) == ["e", "sessions"] and os.listdir(mnt / "sessions") == []
    assert os.listdir(mnt / "e" / "a") == ["c"]
    os.rename(mnt / "e" / "a", mnt / "sessions" / "s")  # a session holding a prefix: fine
    assert os.listdir(mnt / "sessions" / "s") == ["c"]
    os.rmdir(mnt / "sessions" / "s" / "c")
    os.rmdir(mnt / "sessions" / "s")
    (mnt / "f").mkdir(mode=0o700)
    with pytest.raises(OSError) as ei:
        os.rename(mnt / "f", mnt / "sessions")
    assert ei.value.errno == errno.EBUSY
    assert sorted(os.listdir(mnt)) == ["e", "f", "sessions"]
    assert os.stat(mnt / "sessions").st_mode & 0o7777 == 0o755


def test_a_socket_that_cannot_be_removed_at_exit_does_not_fail_a_clean_stop(
    make_mount: object,
) -> None:
    """Its control socket's directory gone read-only (the data disk remounted so after an
    error), a daemon stopped by SIGTERM closed the store cleanly and then exited 1 with
    "Read-only file system" as its error: systemd took the stop for a failure (and a
    Restart=on-failure unit restarted it). The leftover socket is replaced at the next start."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    m = make_mount("ro-socket", start=False)  # type: ignore[operator]
    sockdir = m.root / "sock"
    sockdir.mkdir()
    m.extra += ["--socket", str(sockdir / "kvfs.sock")]
    m.start()
    subprocess.run(["mount", "--bind", str(sockdir), str(sockdir)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(sockdir)], check=True)
        assert m.stop() == 0, m.log.read_text()
        assert "kvfs mount:" not in m.log.read_text()
    finally:
        subprocess.run(["umount", "-l", str(sockdir)], check=False)
    m.start()
    assert m.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_detached_mount_interrupted_while_its_daemon_starts_leaves_no_mount(
    tmp_path: Path, sig: int
) -> None:
    """Ctrl-C on `kvfs mount` (or `timeout`'s SIGTERM) while the detached daemon was still
    starting ended the command ("interrupted", exit 130) and left the daemon, in its own
    session, to mount a moment later: a script saw the mount fail, and its retry found "already
    a mount point". The daemon is held stopped here until the command has been signalled."""
    mp, err = tmp_path / "mnt", tmp_path / "err"
    with open(err, "wb") as out, _detached_mount_held(tmp_path, out) as (parent, child):
        # (signalled once it waits for the daemon: signalled while still starting it, in
        # subprocess.Popen, it could not know the child yet; see the note in _detach)
        deadline = time.monotonic() + 60
        while not _waiting_on_a_pipe(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        parent.send_signal(sig)
        os.kill(child, signal.SIGCONT)
        rc = parent.wait(timeout=60)
        assert rc in (130, -signal.SIGTERM), err.read_text()
        assert "Traceback" not in err.read_text(), err.read_text()
        # the daemon has exited with the command, and mounted nothing
        assert not _alive(child), proc_state(child)
        assert not mounted(mp)


@contextlib.contextmanager
def _detached_mount_held(
    root: Path, out: IO[bytes] | int
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`kvfs mount` (detached) of ``root/data`` at ``root/mnt``, its output to ``out``, and
    its daemon held stopped (SIGSTOP) as soon as it runs: (the command, the daemon's pid).
    Afterwards both are gone and nothing is mounted, whatever happened."""
    mp, data = root / "mnt", root / "data"
    mp.mkdir()
    parent = subprocess.Popen(
        [*KVFS, "mount", "--data", str(data), str(mp)], stdout=out, stderr=out
    )
    child = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline:
            child = _daemon_child(parent.pid)
        assert child is not None, "the daemon was not started"
        os.kill(child, signal.SIGSTOP)
        yield parent, child
    finally:
        parent.kill()
        parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def _waiting_on_a_pipe(pid: int) -> bool:
    """Whether the process ``pid`` sleeps in a read of a pipe."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text().endswith("pipe_read")
    except OSError:
        return False


def _daemon_child(pid: int) -> int | None:
    """The detached daemon that the `kvfs mount` process ``pid`` runs, once it runs it."""
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            if b"--foreground" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                return int(child)
    return None


def test_a_daemon_whose_starter_is_gone_before_it_is_ready_unmounts_and_exits(
    tmp_path: Path,
) -> None:
    """A detached daemon reports "ready" on a pipe to the `kvfs mount` that started it. One
    whose starter was gone by then (interrupted inside subprocess.Popen, before it knew the
    child to stop; or killed) mounted all the same, after the command had reported a failure
    or said nothing. It now unmounts, says why in its log and exits 1. Here the reading end
    is closed before the daemon even starts."""
    mp, data, log = tmp_path / "mnt", tmp_path / "data", tmp_path / "daemon.log"
    mp.mkdir()
    r, w = os.pipe()
    os.close(r)  # (the starter is gone)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*KVFS, "mount", "--foreground", "--data", str(data), str(mp)],
            stdout=out,
            stderr=out,
            pass_fds=(w,),
            env={**os.environ, READY_FD_ENV: str(w)},
        )
    os.close(w)
    try:
        assert proc.wait(timeout=60) == 1, log.read_text()
        assert not mounted(mp)
        text = log.read_text()
        assert "mounted" in text and "the command that started this daemon is gone" in text, text
        assert "Traceback" not in text, text
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_a_detached_mount_killed_while_its_daemon_starts_leaves_no_mount(tmp_path: Path) -> None:
    """`kvfs mount` killed (SIGKILL: it cannot stop its daemon) while the daemon starts: the
    daemon finds nobody to tell it is ready, unmounts and exits; it stayed mounted."""
    with _detached_mount_held(tmp_path, subprocess.DEVNULL) as (parent, child):
        parent.kill()
        parent.wait()
        os.kill(child, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), proc_state(child)
        assert not mounted(tmp_path / "mnt")
        text = (tmp_path / "data" / "kvfs-daemon.log").read_text()
        assert "the command that started this daemon is gone" in text, text


# A daemon (kvfs._daemon.main, as `kvfs mount --foreground` runs it) with one more service,
# which holds the daemon while it starts (argv[3] "start") or stops (argv[3] "stop"): it
# makes the file argv[4] then and waits for the file argv[5]. With "serve" the FUSE loop is
# held instead, mounted but before it answers anything (a loaded machine's slow start): the
# daemon's first stat of its mount waits for it.
_HELD_DAEMON = """
import faulthandler, logging, signal, sys, trio
from pathlib import Path
import pyfuse3
from kvfs import StoreConfig
from kvfs._daemon import main
from kvfs._mount import MountOptions

data, mp, when, holding, release = sys.argv[1:6]

async def hold():
    with trio.CancelScope(shield=True):
        Path(holding).touch()
        while not Path(release).exists():
            await trio.sleep(0.01)

if when == "serve":
    fuse_loop = pyfuse3.main

    async def held_fuse_loop(*args, **kwargs):
        await hold()
        await fuse_loop(*args, **kwargs)

    pyfuse3.main = held_fuse_loop

async def service(store, *, task_status):
    if when == "start":
        await hold()
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        if when == "stop":
            await hold()

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
faulthandler.register(signal.SIGUSR1, all_threads=True)  # (_HeldDaemon.wait, on a timeout)
config = StoreConfig(data_dirs=(Path(data),))
sys.exit(main(config, mp, MountOptions(), foreground=True, services=[service]))
"""


class _HeldDaemon:
    """_HELD_DAEMON in a subprocess; ``wait_held()`` returns once the service holds it."""

    def __init__(self, root: Path, when: str) -> None:
        self.mp, self.data, self.log = root / "mnt", root / "data", root / "daemon.log"
        self.holding, self.release = root / "holding", root / "release"
        self.mp.mkdir()
        argv = [sys.executable, "-c", _HELD_DAEMON, str(self.data), str(self.mp), when]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*argv, str(self.holding), str(self.release)], stdout=out, stderr=out
            )

    def wait_held(self) -> None:
        deadline = time.monotonic() + 60
        while not self.holding.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.01)

    def wait(self, timeout: float = 60) -> int:
        """The daemon's exit status; past ``timeout``, fails with its log and where each of
        its threads was (faulthandler, on SIGUSR1)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            log = self.log.read_text()
            raise AssertionError(f"the daemon did not exit in {timeout} s:\n{log}") from None

    def signal(self, sig: int) -> None:
        """Send ``sig`` and return once the daemon took it (none waits to be delivered), or
        it is gone."""
        self.proc.send_signal(sig)
        while self.proc.poll() is None:
            with open(f"/proc/{self.proc.pid}/status") as f:
                pending = [x.split()[1] for x in f if x.startswith(("SigPnd:", "ShdPnd:"))]
            if all(int(p, 16) == 0 for p in pending):
                return
            time.sleep(0.01)

    def cleanup(self) -> None:
        self.release.touch()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mp)], capture_output=True)


def test_signals_while_the_daemon_closes_are_absorbed(tmp_path: Path) -> None:
    """A second SIGTERM (or SIGINT) while the daemon unmounted and closed the store after the
    first one killed it there (exit -15: its signal handler was gone with the first signal),
    the index left unclean (recounted at the next open) and the mount left to auto_unmount.
    Now every signal after the first is absorbed, the first of them logged, and the daemon
    closes the store and exits 0. (SIGKILL is the hard stop.)"""
    d = _HeldDaemon(tmp_path, "stop")
    try:
        deadline = time.monotonic() + 60
        while not mounted(d.mp):
            assert d.proc.poll() is None and time.monotonic() < deadline, d.log.read_text()
            time.sleep(0.01)
        (d.mp / "f").write_bytes(b"x" * 10_000)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_held()  # the daemon is closing now
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            d.signal(sig)
        d.release.touch()
        assert d.wait() == 0, d.log.read_text()
        text = d.log.read_text()
        assert text.count("SIGTERM: unmounting") == 1, text
        assert text.count("already stopping") == 1, text
        assert "Traceback" not in text and "ERROR" not in text, text
        assert not mounted(d.mp)
    finally:
        d.cleanup()
    assert index_is_clean(d.data)
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(d.data,))) as store:
        assert store.get("f") == b"x" * 10_000


def test_a_signal_before_the_mount_is_ready_stops_the_daemon_cleanly(tmp_path: Path) -> None:
    """SIGTERM while the daemon starts (its store open, the mount not yet made) stops it
    before it mounts, with the exit status of that signal and one line saying so (it
    failed with "RuntimeError: child exited without calling task_status.started()")."""
    d = _HeldDaemon(tmp_path, "start")
    try:
        d.wait_held()
        d.signal(signal.SIGTERM)
        d.release.touch()
        assert d.wait() == 128 + signal.SIGTERM, d.log.read_text()
        text = d.log.read_text()
        assert "kvfs mount: SIGTERM before the mount was ready: not mounted" in text, text
        assert "RuntimeError" not in text and "Traceback" not in text, text
        assert not mounted(d.mp)
    finally:
        d.cleanup()


def test_a_signal_while_the_mount_first_answers_stops_the_daemon(tmp_path: Path) -> None:
    """SIGTERM after the mount was made, while the daemon's first stat of it waited for the
    FUSE loop: the loop was cancelled before it answered, and the stat (in a thread nothing
    could cancel) waited for an answer that never came, so the daemon never unmounted nor
    exited. Now it unmounts (which ends the stat) and exits with that signal's status."""
    d = _HeldDaemon(tmp_path, "serve")
    try:
        d.wait_held()
        assert mounted(d.mp)  # (from the mount table: a stat would wait too)
        d.signal(signal.SIGTERM)
        d.release.touch()
        assert d.wait() == 128 + signal.SIGTERM, d.log.read_text()
        text = d.log.read_text()
        assert "kvfs mount: SIGTERM before the mount was ready: not mounted" in text, text
        assert "Traceback" not in text, text
        assert not mounted(d.mp)
    finally:
        d.cleanup()


def test_a_listing_while_a_file_is_rewritten_leaves_its_writer_the_name(
    tmp_path: Path, make_config: Callable[..., kvfs.StoreConfig]
) -> None:
    # A child's close (a thread forking beside the writer) committed the file so far, and
    # the writer's later writes built next versions. A readdir whose listing was read just
    # before one was committed gave the name a new inode for the previous version: the
    # writer's further writes and its close's commit then went nowhere, its close returned
    # 0, and the page kept a prefix of what it wrote (4 files in 15 on the dev VM).
    stop = threading.Event()

    def forking() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            time.sleep(0.01)

    def listing(d: Path) -> None:
        while not stop.is_set():
            os.listdir(d)
            time.sleep(0.02)

    with daemon_mount(make_config(ndev=2), tmp_path / "mnt") as mp:
        (mp / "lm").mkdir()
        busy = [
            threading.Thread(target=forking),
            threading.Thread(target=listing, args=(mp / "lm",)),
        ]
        for t in busy:
            t.start()
        try:
            wrote = {}
            for i in range(15):
                data = wrote[f"f{i}"] = os.urandom(1 << 20)
                with open(mp / f"lm/f{i}.tmp", "wb", buffering=0) as f:
                    for off in range(0, len(data), 64 << 10):
                        f.write(data[off : off + (64 << 10)])
                        time.sleep(0.02)  # (an engine writing layer by layer)
                os.replace(mp / f"lm/f{i}.tmp", mp / f"lm/f{i}")
        finally:
            stop.set()
            for t in busy:
                t.join()
        short = [k for k, v in wrote.items() if (mp / "lm" / k).read_bytes() != v]
        assert short == []
