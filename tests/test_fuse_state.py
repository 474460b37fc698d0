"""A Hypothesis state machine drives a real kvfs mount (a ``kvfs mount`` daemon) with plain
``os`` calls and checks it against a dict model of what docs/mount.md promises.

Steps: mkdir, rmdir, create a file (O_APPEND or not) and keep it open for writing across
other steps (write, pwrite over it or past its end, ftruncate, close a dup of it, later
close), a tmp + rename publisher, rename and replace of files (onto pages, onto files being
written, the open file itself), renames of directories, unlink, link, symlink and mknod,
chmod, utime, and a remount (the daemon stopped cleanly and started on the same data
directories). After every step every directory lists what the model holds, and every name
stats (type, size, mode, mtime where set) and reads as the model says. Every call the model expects to fail must
fail with the documented errno.

What the model encodes (docs/mount.md, "Semantics" and "Errors"):

* a file being written is not listed and cannot be opened (ENOENT for reading, EBUSY for
  writing, its writer included), but stats by name with the size written so far; its
  writer's close publishes it, and so does its writer's rename (under the new name);
  a dup's close publishes it once written to; writes (and ftruncates) after that build the
  next version, published by the close (or a dup's), over the name the file has then (none,
  when it was unlinked or replaced meanwhile); a write past the end leaves zeros between;
* a committed page is immutable: opening it for writing is EPERM; chmod and utime are kept;
* rename of a file replaces its target atomically; renaming a directory that holds pages
  or files being written is EXDEV, an empty tree moves whole; ``sessions`` is EBUSY;
* under ``sessions/`` directories only at ``<s>`` and ``<s>/<prefix>``, files only at
  ``<s>/<prefix>/<layer>``: EINVAL otherwise;
* hard links, symlinks and mknod are EPERM (once the kernel found the source and the name
  free);
* directories made by mkdir stay (empty ones too) until rmdir, across remounts;
* ``sessions/<s>/.kvfs.json`` stats by name, is not listed, and counts the session's pages.

Where the docs are silent the model takes what a POSIX user expects, and the kernel's own
checks (ENOTDIR, EISDIR, EINVAL for a directory moved into itself) as Linux makes them.
Not modelled: a directory's mtime once its entries changed (kvfs keeps the one mkdir or
utime set, POSIX moves it; docs/mount.md promises only that utime's is kept), atime.

One daemon serves every example; each example starts from an empty tree and leaves it so,
emptied through the mount. ``KVFS_STATE_EXAMPLES=300`` runs that many examples from a random
seed (a longer hunt, not for CI, which runs the same 40 every time).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from _kvfs_mount import DaemonMount, daemon_mount, fresh_stat
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvfs

KiB = 1024
UMASK = 0o022

# A small name space: an engine's tree, semantic pages, and names that collide (a file
# named as a directory, a file or directory where sessions/ allows none).
ENGINE_DIRS = ["e", "e/a", "e/a/c", "f"]
PREFIXES = ["sessions/s/p", "sessions/s/q", "sessions/t/p"]
DIRS = [*ENGINE_DIRS, "sessions/s", "sessions/t", *PREFIXES, "sessions/s/p/bad"]
FILES = [
    *(f"{d}/{n}" if d else n for d in ["", "e", "e/a"] for n in ("x", "y")),
    "e/a/c",  # a directory's name too
    "f",
    *(f"{p}/layer-00{i}" for p in PREFIXES for i in (0, 1)),
    "sessions/s/x",  # EINVAL: not <s>/<prefix>/<layer>
    "sessions/x",
]
NAMES = sorted({*DIRS, *FILES, "sessions"})
MODES = [0o600, 0o644, 0o700, 0o755, 0o444]
MTIMES = [1_600_000_000_123_456_789, 1_700_000_000_000_000_001]
CHUNKS = [b"", b"a" * 10, b"B" * 4096, bytes(range(256)) * 80]  # 20,480: past a stripe unit

dirs = st.sampled_from(DIRS)
files = st.sampled_from(FILES)
names = st.sampled_from(NAMES)
chunks = st.integers(0, len(CHUNKS) - 1)  # an index: short reprs in failure reports

_mount: _Mounted | None = None


class _Mounted:
    """The store and its daemon, remounted in place by :meth:`remount`."""

    def __init__(self, root: Path) -> None:
        self.cfg = kvfs.StoreConfig(
            data_dirs=(root / "nvme0", root / "nvme1"), stripe_unit=16 * KiB
        )
        self.daemon = daemon_mount(self.cfg, root / "mnt")
        self.mp = self.daemon.mountpoint
        self._seen = 0

    def remount(self) -> None:
        self.daemon.stop()
        self.daemon = DaemonMount(
            self.cfg.data_dirs, self.mp, self.daemon.log, "--stripe-unit", str(16 * KiB)
        )

    def new_errors(self) -> list[str]:
        lines = self.daemon.log.read_text(errors="replace").splitlines()
        new, self._seen = lines[self._seen :], len(lines)
        return [x for x in new if " ERROR " in x or "Traceback" in x or " CRITICAL " in x]


@pytest.fixture(scope="module", autouse=True)
def _one_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    global _mount
    old = os.umask(UMASK)
    _mount = _Mounted(tmp_path_factory.mktemp("fuse-state"))
    try:
        yield
        assert not (errors := _mount.new_errors()), "the daemon logged errors:\n" + "\n".join(
            errors
        )
    finally:
        _mount.daemon.stop()
        _mount = None
        os.umask(old)


def parent(path: str) -> str:
    return path.rpartition("/")[0]


@dataclass
class Page:
    data: bytes
    mode: int
    mtime: int | None  # None: set by a write, at a time the model does not know


@dataclass
class Dir:
    mode: int
    mtime: int | None


@dataclass
class Writer:
    """A file this process holds open for writing."""

    fd: int
    #: the name its inode has now (None once unlinked or replaced)
    path: str | None
    data: bytearray
    mode: int
    mtime: int | None
    #: opened O_APPEND: every write goes to the end
    append: bool = False
    #: the descriptor's offset, where its next plain write goes
    pos: int = 0
    #: a write of a byte or more came (a dup's close of a file never written commits none)
    wrote: bool = False
    #: its name holds a page it committed (a dup's close, a rename of the open file); writes
    #: since then (``dirty``) build the next version, which its close publishes
    committed: bool = False
    dirty: bool = False


class FuseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        assert _mount is not None
        self.m = _mount
        self.pages: dict[str, Page] = {}
        self.dirs: dict[str, Dir] = {"sessions": Dir(0o755, None)}
        self.writers: list[Writer] = []
        self.remounted = False
        #: what this example did, for the messages of invariants that fail intermittently
        #: (Hypothesis replays, and prints, only a failure it can repeat)
        self.trace: list[str] = []
        assert sorted(os.listdir(self.m.mp)) == ["sessions"], "not emptied"
        assert os.listdir(self.m.mp / "sessions") == [], "not emptied"

    def p(self, path: str) -> Path:
        return self.m.mp / path

    # -- the model ------------------------------------------------------------------------
    def kind(self, path: str) -> str | None:
        if path == "" or path in self.dirs:
            return "dir"
        if path in self.pages:
            return "page"
        if any(w.path == path and not w.committed for w in self.writers):
            return "pending"
        return None

    def _named(self, path: str) -> Writer | None:
        return next((w for w in self.writers if w.path == path), None)

    def _under(self, d: str) -> list[str]:
        """Every name below directory ``d``: directories, pages, files being written."""
        pre = d + "/" if d else ""
        named = [w.path for w in self.writers if w.path is not None]
        return [x for x in [*self.dirs, *self.pages, *named] if x.startswith(pre) and x != d]

    def _parent_errno(self, path: str) -> int | None:
        """What a path walk to ``path``'s directory meets: ENOENT, ENOTDIR, or nothing."""
        up = parent(path)
        chain = []
        while up:
            chain.append(up)
            up = parent(up)
        for d in reversed(chain):
            k = self.kind(d)
            if k is None:
                return errno.ENOENT
            if k != "dir":
                return errno.ENOTDIR
        return None

    @staticmethod
    def _bad_file(path: str) -> bool:
        parts = path.split("/")
        return parts[0] == "sessions" and len(parts) != 4

    @staticmethod
    def _bad_dir(path: str) -> bool:
        parts = path.split("/")
        return parts[0] == "sessions" and len(parts) > 3

    def _changed(self, *paths: str) -> None:
        """Entries ``paths`` were made or removed: their directories' mtimes are not the
        model's to know (POSIX moves them; kvfs keeps the one mkdir or utime set)."""
        for x in paths:
            if parent(x) in self.dirs:
                self.dirs[parent(x)].mtime = None

    def _drop_name(self, path: str) -> None:
        """``path`` no longer names what it named (unlinked or replaced)."""
        self.pages.pop(path, None)
        for w in self.writers:
            if w.path == path:
                w.path = None

    # -- calls ----------------------------------------------------------------------------
    def call(self, want: int | None, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args)``, which must fail with errno ``want`` (None: succeed)."""
        what = f"{fn.__name__}{tuple(str(a).replace(str(self.m.mp), '') for a in args)}"
        self.trace.append(what)
        event(f"{fn.__name__}: {'ok' if want is None else errno.errorcode[want]}")
        try:
            r = fn(*args, **kw)
        except OSError as e:
            got = errno.errorcode.get(e.errno or 0, e.errno)
            wanted = "success" if want is None else errno.errorcode[want]
            assert e.errno == want, f"{what}: {got}, the model says {wanted}"
            return None
        assert want is None, f"{what} succeeded, the model says {errno.errorcode[want]}"
        return r

    # -- directories ----------------------------------------------------------------------
    @initialize(made=st.sets(st.sampled_from([d for d in DIRS if not d.endswith("/bad")])))
    def some_directories(self, made: set[str]) -> None:
        """Start from a tree of directories (else most steps would meet ENOENT)."""
        for d in sorted(made):
            for up in [*(d.split("/")[:i] for i in range(1, d.count("/") + 1)), d.split("/")]:
                if self.kind("/".join(up)) is None:
                    self.mkdir("/".join(up), 0o755)

    @rule(path=dirs, mode=st.sampled_from(MODES))
    def mkdir(self, path: str, mode: int) -> None:
        want = self._parent_errno(path)
        if want is None and self.kind(path) is not None:
            want = errno.EEXIST
        if want is None and self._bad_dir(path):
            want = errno.EINVAL
        self.call(want, os.mkdir, self.p(path), mode)
        if want is None:
            self.dirs[path] = Dir(mode & ~UMASK, None)
            self._changed(path)

    @rule(path=st.sampled_from([*DIRS, "sessions", "f", "e/x"]))
    def rmdir(self, path: str) -> None:
        k = self.kind(path)
        want = self._parent_errno(path)
        if want is None:
            if k is None:
                want = errno.ENOENT
            elif k != "dir":
                want = errno.ENOTDIR
            elif path == "sessions":
                want = errno.EBUSY
            elif self._under(path):
                want = errno.ENOTEMPTY
        self.call(want, os.rmdir, self.p(path))
        if want is None:
            del self.dirs[path]
            self._changed(path)

    # -- files being written --------------------------------------------------------------
    def _create(self, path: str, mode: int, excl: bool, append: bool = False) -> Writer | None:
        k = self.kind(path)
        want = self._parent_errno(path)
        if want is None:
            if excl and k is not None:
                want = errno.EEXIST
            elif k == "dir":
                want = errno.EISDIR
            elif k == "page":
                want = errno.EPERM  # immutable
            elif k == "pending":
                want = errno.EBUSY  # being written (by this very process: still)
            elif self._bad_file(path):
                want = errno.EINVAL
        # (O_RDWR: its writer reads back through its descriptor, read_back)
        flags = os.O_CREAT | os.O_RDWR | os.O_TRUNC | (os.O_EXCL if excl else 0)
        fd = self.call(want, os.open, self.p(path), flags | (os.O_APPEND if append else 0), mode)
        if fd is None:
            return None
        self.trace.append(f"  -> fd {fd}")
        w = Writer(fd, path, bytearray(), mode & ~UMASK, None, append)
        self._changed(path)
        self.writers.append(w)
        return w

    @precondition(lambda self: len(self.writers) < 3)
    @rule(
        path=files, mode=st.sampled_from([0o644, 0o600]), excl=st.booleans(), append=st.booleans()
    )
    def create(self, path: str, mode: int, excl: bool, append: bool) -> None:
        self._create(path, mode, excl, append)

    @precondition(lambda self: len(self.writers) < 3)
    @rule(data=st.data(), name=st.sampled_from(["x", "layer-000"]), c=chunks)
    def create_and_write(self, data: st.DataObject, name: str, c: int) -> None:
        """A file in a directory that exists (most drawn paths have none), written to."""
        d = data.draw(st.sampled_from(["", *sorted(self.dirs)]))
        w = self._create(f"{d}/{name}" if d else name, 0o644, excl=False)
        if w is not None:
            self._write(w, CHUNKS[c])

    def _write(self, w: Writer, data: bytes, at: int | None = None) -> None:
        """A write at the descriptor's offset (its end, O_APPEND), or a pwrite ``at``."""
        self.trace.append(f"write({w.fd}, {len(data)}, at={at}) to {w.path}")
        if at is None:
            assert os.write(w.fd, data) == len(data)
        else:
            assert os.pwrite(w.fd, data, at) == len(data)
        # (Linux's pwrite on an O_APPEND descriptor appends too: pwrite(2), BUGS)
        off = len(w.data) if w.append else w.pos if at is None else at
        if at is None:
            w.pos = off + len(data)
        if not data:
            return  # (no write reaches the mount: nothing changes)
        w.data[len(w.data) : off] = bytes(max(0, off - len(w.data)))  # a hole: zeros
        w.data[off : off + len(data)] = data
        w.wrote = True
        self._written(w)

    def _written(self, w: Writer) -> None:
        """``w``'s file changed (a write, a truncate): its mtime is now."""
        w.mtime = None
        if w.committed:
            w.dirty = True
            if w.path is not None:
                self.pages[w.path].mtime = None

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2), c=chunks)
    def write(self, i: int, c: int) -> None:
        self._write(self.writers[i % len(self.writers)], CHUNKS[c])

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2), c=chunks, where=st.sampled_from(["start", "middle", "past"]))
    def pwrite(self, i: int, c: int, where: str) -> None:
        """A write at an offset: over what was written, or past the end (a hole; 20,000 past
        it skips a stripe unit, and its data directory)."""
        w = self.writers[i % len(self.writers)]
        at = {"start": 0, "middle": len(w.data) // 2, "past": len(w.data) + 20_000}[where]
        self._write(w, CHUNKS[c], at)

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2), size=st.sampled_from(["zero", "half", "same", "longer"]))
    def ftruncate(self, i: int, size: str) -> None:
        """The writer truncates its file (shrinks it, grows it with zeros): a file being
        written, or the next version of the page it committed."""
        w = self.writers[i % len(self.writers)]
        n = {"zero": 0, "half": len(w.data) // 2, "same": len(w.data)}.get(size, len(w.data) + 3000)
        self.call(None, os.ftruncate, w.fd, n)
        w.data[n:] = b""
        w.data += bytes(n - len(w.data))
        self._written(w)

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2))
    def close_a_dup(self, i: int) -> None:
        """A duplicate of the writer's descriptor is closed (numpy's tofile, a child that
        had it): that close commits what was written, and the writer writes on."""
        w = self.writers[i % len(self.writers)]
        if not w.wrote and not w.committed:
            # (a close before any write, a shell's dup2, commits nothing: the release does,
            # and each listing of its directory waits 0.1 s for that release meanwhile)
            return
        self.trace.append(f"close(dup({w.fd})) of {w.path}")
        os.close(os.dup(w.fd))
        if w.path is None:
            return  # unlinked or replaced: nothing to commit
        if not w.committed and w.wrote:
            self.pages[w.path] = Page(bytes(w.data), w.mode, w.mtime)
            w.committed = True
            event("close a dup: committed")
        elif w.committed and w.dirty:  # the next version
            self.pages[w.path].data = bytes(w.data)
            w.dirty = False
            event("close a dup: next version")

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2))
    def read_back(self, i: int) -> None:
        """The writer reads its file through its descriptor: what it wrote, the next version
        it builds included. (Not once its committed page's name went: it reads the version
        it holds, its later writes went nowhere, docs/mount.md.)"""
        w = self.writers[i % len(self.writers)]
        if w.committed and w.path is None:
            return
        self.trace.append(f"pread({w.fd}) of {w.path}")
        got = os.pread(w.fd, len(w.data) + 100, 0)
        assert got == bytes(w.data), f"{w.path}: read back {len(got)} bytes, after {self.trace}"

    def _close(self, w: Writer) -> None:
        event(f"close: {'unnamed' if w.path is None else 'committed' if w.committed else 'new'}")
        self.trace.append(f"close({w.fd}) of {w.path}")
        self.writers.remove(w)
        os.close(w.fd)
        if w.path is None:
            return  # unlinked or replaced: its bytes went with the name
        if not w.committed:
            self.pages[w.path] = Page(bytes(w.data), w.mode, w.mtime)
            if not w.wrote:
                self._await_release(w.path)
        elif w.dirty:  # the next version, with the page's own mode and times
            self.pages[w.path].data = bytes(w.data)

    def _await_release(self, path: str) -> None:
        """Wait until a file closed without a write is a page. Its commit is the release,
        which the kernel sends after close returned (the close of a descriptor never written
        may be a shell's dup2, writes to follow: docs/mount.md, "Which close commits"). A
        listing waits for it a tenth of a second at most: on a busy 2-CPU machine a listing
        taken right after such a close missed the file (twice in ~1,500 random examples,
        not repeatable)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                os.close(os.open(self.p(path), os.O_RDONLY))
                return
            except FileNotFoundError:
                assert time.monotonic() < deadline, f"{path} closed empty: never a page"
                time.sleep(0.005)

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2))
    def close(self, i: int) -> None:
        self._close(self.writers[i % len(self.writers)])

    @rule(final=files, tmp=st.sampled_from(["x.tmp", "layer-009"]), c=chunks)
    def publish(self, final: str, tmp: str, c: int) -> None:
        """write tmp; close; os.replace(tmp, final), as LMCache publishes."""
        if self.kind(parent(final)) != "dir" or self._parent_errno(final) is not None:
            return
        w = self._create(f"{parent(final)}/{tmp}" if parent(final) else tmp, 0o644, excl=True)
        if w is None:
            return
        self._write(w, CHUNKS[c])
        src = w.path
        assert src is not None
        self._close(w)
        self._rename(src, final, replace=True)

    # -- names ----------------------------------------------------------------------------
    def _rename_errno(self, src: str, dst: str) -> int | None:
        ks, kd = self.kind(src), self.kind(dst)
        want = self._parent_errno(src) or self._parent_errno(dst)
        if want is not None:
            return want
        if ks is None:
            return errno.ENOENT
        if src == dst:
            return None
        if dst.startswith(src + "/"):
            return errno.EINVAL  # (the kernel's) a directory into itself
        if src.startswith(dst + "/"):
            return errno.ENOTEMPTY  # (the kernel's) onto a directory above it
        if ks == "dir" and kd is not None and kd != "dir":
            return errno.ENOTDIR
        if ks != "dir" and kd == "dir":
            return errno.EISDIR
        if ks == "dir":
            if "sessions" in (src, dst):
                return errno.EBUSY
            tree = [x for x in [src, *self._under(src)] if x in self.dirs]
            if any(self._bad_dir(dst + x[len(src) :]) for x in tree):
                return errno.EINVAL  # a directory that would land below a prefix
            if any(x not in self.dirs for x in self._under(src)):
                return errno.EXDEV  # pages or files being written below: not atomic
            if kd == "dir" and self._under(dst):
                return errno.ENOTEMPTY
            return None
        if self._bad_file(dst):
            return errno.EINVAL
        return None

    def _rename(self, src: str, dst: str, replace: bool) -> None:
        want = self._rename_errno(src, dst)
        self.call(want, os.replace if replace else os.rename, self.p(src), self.p(dst))
        if want is not None or src == dst:
            return
        self._changed(src, dst)
        ks = self.kind(src)
        if ks == "dir":
            self.dirs.pop(dst, None)
            for d in [src, *self._under(src)]:
                self.dirs[dst + d[len(src) :]] = self.dirs.pop(d)
            return
        w = self._named(src)
        self._drop_name(dst)
        event(f"renamed: {ks}{' being rewritten' if w and w.committed and w.dirty else ''}")
        if ks == "pending":  # its writer's rename publishes it under the new name
            assert w is not None
            self.pages[dst] = Page(bytes(w.data), w.mode, w.mtime)
            w.committed, w.dirty = True, False
        else:
            self.pages[dst] = self.pages.pop(src)
        if w is not None:
            w.path = dst

    @rule(src=names, dst=names, replace=st.booleans())
    def rename(self, src: str, dst: str, replace: bool) -> None:
        self._rename(src, dst, replace)

    def _existing(self) -> list[str]:
        named = [w.path for w in self.writers if w.path is not None]
        return sorted({*self.pages, *self.dirs, *named} - {"sessions"})

    @precondition(lambda self: self._existing())
    @rule(data=st.data(), dst=names, replace=st.booleans())
    def rename_existing(self, data: st.DataObject, dst: str, replace: bool) -> None:
        """As ``rename``, of a name that exists (most drawn names do not)."""
        self._rename(data.draw(st.sampled_from(self._existing())), dst, replace)

    @precondition(lambda self: self.pages and len(self.writers) < 3)
    @rule(data=st.data(), excl=st.booleans())
    def create_over_page(self, data: st.DataObject, excl: bool) -> None:
        self._create(data.draw(st.sampled_from(sorted(self.pages))), 0o644, excl)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def unlink_page(self, data: st.DataObject) -> None:
        self.unlink(data.draw(st.sampled_from(sorted(self.pages))))

    @precondition(lambda self: self.writers)
    @rule(i=st.integers(0, 2), dst=files)
    def rename_open_file(self, i: int, dst: str) -> None:
        """The writer renames the file it holds open (publishing it, when not yet)."""
        w = self.writers[i % len(self.writers)]
        if w.path is not None:
            self._rename(w.path, dst, replace=True)

    @rule(path=st.sampled_from([*FILES, "e", "sessions/s/.kvfs.json"]))
    def unlink(self, path: str) -> None:
        k = self.kind(path)
        want = self._parent_errno(path)
        if path.endswith("/.kvfs.json"):
            session = parent(path)
            if want is None and k is None and self._pages_of(session):
                want = errno.EPERM  # it goes with the session's pages, not before
        elif want is None and k is None:
            want = errno.ENOENT
        elif want is None and k == "dir":
            want = errno.EISDIR
        self.call(want, os.unlink, self.p(path))
        if want is None:
            self._drop_name(path)
            self._changed(path)

    @precondition(lambda self: self._existing())
    @rule(data=st.data(), dst=names, how=st.sampled_from(["link", "symlink", "mknod"]))
    def link(self, data: st.DataObject, dst: str, how: str) -> None:
        """Hard links, symlinks and device nodes (a regular file's mknod too) are EPERM,
        once the kernel's own checks pass (the link's source found, its name free)."""
        src = data.draw(st.sampled_from(self._existing()))
        want = None
        if how == "link":
            want = self._parent_errno(src) or (None if self.kind(src) else errno.ENOENT)
        want = want or self._parent_errno(dst)
        if want is None and self.kind(dst) is not None:
            want = errno.EEXIST
        if how == "link":
            self.call(want or errno.EPERM, os.link, self.p(src), self.p(dst))
        elif how == "symlink":
            self.call(want or errno.EPERM, os.symlink, src, self.p(dst))
        else:
            self.call(want or errno.EPERM, os.mknod, self.p(dst), 0o644 | stat.S_IFREG)

    def _pages_of(self, session: str) -> list[str]:
        return [x for x in self.pages if x.startswith(session + "/")]

    # -- attributes -----------------------------------------------------------------------
    def _target(self, path: str) -> Page | Dir | Writer | None:
        k = self.kind(path)
        if k == "dir":
            return self.dirs.get(path)
        if k == "page":
            return self.pages[path]
        if k == "pending":
            return self._named(path)
        return None

    @rule(path=names, mode=st.sampled_from(MODES))
    def chmod(self, path: str, mode: int) -> None:
        want = self._parent_errno(path) or (None if self.kind(path) else errno.ENOENT)
        self.call(want, os.chmod, self.p(path), mode)
        t = self._target(path)
        if want is None and t is not None:
            t.mode = mode

    @rule(path=names, mtime=st.sampled_from(MTIMES))
    def utime(self, path: str, mtime: int) -> None:
        want = self._parent_errno(path) or (None if self.kind(path) else errno.ENOENT)
        self.call(want, os.utime, self.p(path), ns=(mtime, mtime))
        t = self._target(path)
        if want is None and t is not None:
            t.mtime = mtime

    # -- the daemon -----------------------------------------------------------------------
    @precondition(lambda self: not self.remounted)
    @rule(go=st.booleans())
    def remount(self, go: bool) -> None:
        """Stop the daemon cleanly and mount the same data directories again (files still
        being written are closed first: an unmount does not commit them). At most once
        an example: a daemon takes most of a second to start."""
        if not go:
            return
        for w in list(self.writers):
            self._close(w)
        self.m.remount()
        self.remounted = True

    # -- what the mount shows -------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        for d in ["", *self.dirs]:
            want = sorted(x.rpartition("/")[2] for x in [*self.dirs, *self.pages] if parent(x) == d)
            got = sorted(os.listdir(self.p(d)))
            assert got == want, f"listing of {d!r}: {got}, not {want}, after {self.trace}"
            s = fresh_stat(self.p(d))  # (past the kernel's cached attributes)
            assert stat.S_ISDIR(s.st_mode), d
            if d:
                m = self.dirs[d]
                assert s.st_mode & 0o7777 == m.mode, f"{d}: mode {s.st_mode & 0o7777:o}"
                assert m.mtime is None or s.st_mtime_ns == m.mtime, f"{d}: mtime"
            if d.startswith("sessions/") and d.count("/") == 1:
                doc = json.loads(self.p(f"{d}/.kvfs.json").read_bytes())
                assert doc["pages"] == len(self._pages_of(d)), f"{d}/.kvfs.json: {doc}"
        for path, page in self.pages.items():
            w = self._named(path)
            s = fresh_stat(self.p(path))
            assert stat.S_ISREG(s.st_mode), path
            # (while its writer builds the next version, the size is that version's)
            assert s.st_size == len(w.data if w else page.data), f"{path}: size {s.st_size}"
            assert s.st_mode & 0o7777 == page.mode, f"{path}: mode {s.st_mode & 0o7777:o}"
            assert page.mtime is None or s.st_mtime_ns == page.mtime, f"{path}: mtime"
            with open(self.p(path), "rb") as f:
                assert f.read() == page.data, f"{path}: content"
        for w in self.writers:
            if w.path is None or w.committed:
                continue
            s = fresh_stat(self.p(w.path))  # by name: found, with the size written so far
            assert s.st_size == len(w.data), f"{w.path} being written: size {s.st_size}"
            assert s.st_mode & 0o7777 == w.mode, f"{w.path} being written: mode"
            assert w.mtime is None or s.st_mtime_ns == w.mtime, f"{w.path}: mtime"
            self.call(errno.ENOENT, os.open, self.p(w.path), os.O_RDONLY)
        assert not (errors := self.m.new_errors()), "the daemon logged:\n" + "\n".join(errors)

    def teardown(self) -> None:
        """Close what is open and empty the tree, through the mount."""
        for w in self.writers:
            os.close(w.fd)
        self.writers.clear()
        for top, subdirs, pages in os.walk(self.m.mp, topdown=False):
            for name in pages:
                os.unlink(os.path.join(top, name))
            for name in subdirs:
                if top != str(self.m.mp) or name != "sessions":
                    os.rmdir(os.path.join(top, name))
        os.chmod(self.m.mp / "sessions", 0o755)


FuseMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVFS_STATE_EXAMPLES", "40")),
    stateful_step_count=30,
    deadline=None,
    derandomize="KVFS_STATE_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFuseMachine = FuseMachine.TestCase
