"""Spill uploads and session restores in worker processes: read, verify, compress and
upload local blobs, or download, decode, verify and write archived ones, outside the daemon,
so the daemon's GIL and CPU stay with foreground reads and writes.

Why a process: boto3's request path is pure Python. Eight upload threads in the daemon hold
its GIL for milliseconds at a time and a foreground ``get`` waits for it (p99 of a 256 KiB
read went from ~0.5 ms idle to 8-12 ms during a spill). A worker has its own interpreter and
runs at the lowest CPU priority (nice 19), so the daemon's threads are only ever delayed by
the few index and trio steps a spill still takes there.

What stays in the daemon: the index, the leases and every decision. A job names each blob's
data files (absolute paths and offsets, kept in place by a lease the daemon holds until the
job has finished, even when the waiting spill is cancelled), its checksum, value size and
codec. The worker reads the files itself, checks the BLAKE3 tree hash (a corrupt local copy
is never uploaded: ``CorruptPage``), HEADs the object while it compresses, and makes a
conditional put; it answers per blob whether it stored the object or found it there. The
daemon marks blobs archived only from those answers, so local copies are still dropped only
after a confirmed upload. A worker that dies (killed, out of memory) fails its jobs with
``WorkerDied``: the daemon starts a fresh worker and tries the job once more, then
raises ``ArchiveUnavailable``; nothing was marked, nothing is dropped, and objects the dead
worker managed to store are found by the next spill's HEAD.

Restores (:func:`restore_batch`, a whole session at a time; a read that misses restores its
one page in the daemon) take the same workers the other way. The daemon reserves room for
each blob and names its files (first device and nonce); the worker downloads, decodes,
checks the tree hash and writes durable files under those names, and answers per blob with
the extents or the error (a corrupt or missing object writes nothing). The daemon syncs the
directories once per batch and commits the files in one index transaction; until then no
row names them. If the worker dies, the daemon removes the files by name and retries once on
a fresh worker; if the caller is cancelled, it removes them once the worker is done.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import trio

from ._aligned import ALIGN, aligned_buffer, open_direct, round_up
from ._checksum import leaves_of, tree_hash
from ._codec import CodecChoice, decode, encode
from ._errors import ArchiveAccessDenied, ArchiveUnavailable, CorruptPage

if TYPE_CHECKING:
    from ._index import Extent
    from ._local import BlobWriter, LocalTier

__all__ = [
    "BlobJob",
    "UploadPool",
    "Uploaded",
    "WorkerUnavailable",
    "scratch_buffer",
    "shutdown_workers",
]

_scratch = threading.local()
_SCRATCH_MAX = 16 << 20


def scratch_buffer(size: int) -> memoryview:
    """A page-aligned buffer of ``size`` bytes that the calling thread reuses for its next
    call (a fresh anonymous mapping costs a page fault per 4 KiB: ~1.5 ms per 2 MiB here).
    Only for data consumed before the thread's next call; sizes over 16 MiB get a new one."""
    if size > _SCRATCH_MAX:
        return aligned_buffer(size)
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratch.buf = aligned_buffer(max(size, 1 << 20))
    return buf[:size]


#: Page bytes that the archive transfers of one trio run hold in memory at once (a worker's
#: batch of uploads or of restores, fsck's check of the archive, a restore in the store's
#: process), besides their number (``concurrency``). Each holds its page two or three times
#: until it is stored or written (read or decoded, shuffled, compressed): four jobs at once
#: in each of two workers were ~23 GiB for 1 GiB pages (a spill of eight of them had its
#: workers OOM-killed), and fsck --check-archive held 16 pages of 512 MiB in the daemon. A
#: page larger than this goes alone.
TRANSFER_BYTES = 512 << 20


class ByteLimiter:
    """Page bytes held at once by the tasks of one trio run, up to ``limit`` (default
    :data:`TRANSFER_BYTES`): :meth:`hold` waits until its bytes fit beside those held, or
    until none are held."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = TRANSFER_BYTES if limit is None else limit
        self.held = 0
        self._freed = trio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        while self.held and self.held + n > self.limit:
            await self._freed.wait()
        self.held += n
        try:
            yield
        finally:
            self.held -= n
            self._freed.set()  # every waiter looks again
            self._freed = trio.Event()


@dataclass(frozen=True)
class BlobJob:
    """One local blob to upload: its checksum, size, value size for the shuffle filter, and
    its data as ``(absolute path, file offset, page offset, length)`` reads in page order.
    ``probe``: HEAD the object before uploading (see :func:`kvfs._archive.worth_probing`),
    while the page is read and compressed. ``expected``: the object should be there (a
    check before local copies are dropped): HEAD it first, and read the page only when
    it is missing."""

    h: bytes
    size: int
    elem: int
    reads: tuple[tuple[str, int, int, int], ...]
    probe: bool = True
    expected: bool = False


@dataclass(frozen=True)
class Uploaded:
    """A worker's answer for one blob: ``stored`` when this upload created the object
    (``nbytes`` of object), else it was there already (another session, host or try)."""

    h: bytes
    stored: bool
    nbytes: int
    codec: str | None


def _unavailable(errors: list[Exception | None]) -> ArchiveUnavailable | None:
    """The first "archive unreachable" among a batch's errors. A refusal (ArchiveAccessDenied)
    is none: it came at once, and it may be one object's (a policy on a prefix, or S3's 403
    for a missing object without s3:ListBucket), so the other batches are still tried."""
    return next(
        (
            e
            for e in errors
            if isinstance(e, ArchiveUnavailable) and not isinstance(e, ArchiveAccessDenied)
        ),
        None,
    )


# -- the worker process -------------------------------------------------------------------
_stores: dict[tuple, Any] = {}
#: ``auto``'s remembered choices, per archive: the workers are shared by every store of a
#: process, and one store's incompressible data must not make another's stored raw
_choices: dict[str, CodecChoice] = {}


def _worker_init() -> None:
    # Linux nice is per thread and inherited by threads created later: set before any.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)


def _open_store(url: str, options: dict[str, Any]) -> Any:
    """The worker's store for ``url``, opened once; S3 stores of one bucket share a client
    (creating one costs ~0.1 s of CPU), whatever their prefix."""
    from objectstore import open_objectstore, parse_url
    from objectstore._s3 import S3Store

    k = (url, tuple(sorted(options.items())))
    st = _stores.get(k)
    if st is not None:
        return st
    scheme, where, q = parse_url(url)
    prefix = q.pop("prefix", "")
    base = (scheme, where, tuple(sorted(q.items())), k[1])
    other = _stores.get(base)
    if isinstance(other, S3Store):
        st = other.at_prefix(prefix)
    else:
        # The daemon checked the bucket (and swept a directory's crash leftovers) when it
        # opened: no check here, so an outage is retried by the first request up to the
        # store's deadline, and no sweep, which would remove the other workers' puts.
        st = trio.run(lambda: open_objectstore(url, verify=False, **options))
        if isinstance(st, S3Store):
            _stores[base] = st
    _stores[k] = st
    return st


def _warm(url: str, options: dict[str, Any]) -> int:
    _open_store(url, options)
    return os.getpid()


def read_verified(job: BlobJob, buf: memoryview) -> memoryview:
    """Read a blob's data files into ``buf`` (aligned, at least ``round_up(size)`` bytes)
    and check its tree hash. Raises CorruptPage (missing or short file, wrong checksum)."""
    fds: dict[tuple[str, bool], int] = {}
    try:
        for path, file_off, dest_off, n in job.reads:
            span = round_up(n)
            direct = file_off % ALIGN == 0 and dest_off % ALIGN == 0 and dest_off + span <= len(buf)
            if (path, direct) not in fds:
                try:
                    fds[(path, direct)] = open_direct(path, os.O_RDONLY, direct=direct)[0]
                except FileNotFoundError as e:  # a damaged copy, not a lookup that failed
                    raise CorruptPage(f"{path} is missing; not uploaded") from e
            fd = fds[(path, direct)]
            target = buf[dest_off : dest_off + (span if direct else n)]
            done = 0
            while done < n:
                got = os.preadv(fd, [target[done:]], file_off + done)
                if got == 0:
                    raise CorruptPage(f"{path} is shorter than its extents; not uploaded")
                done += got
    finally:
        for fd in fds.values():
            os.close(fd)
    data = buf[: job.size]
    if tree_hash(job.size, leaves_of(data)) != job.h:
        raise CorruptPage(
            f"local copy of {job.h.hex()[:16]} does not match its checksum; not uploaded"
        )
    return data


def _read_encode(job: BlobJob, level: int, codec: str, url: str) -> tuple[bytes, str]:
    data = read_verified(job, scratch_buffer(round_up(job.size)))
    choice = _choices.setdefault(url, CodecChoice())
    use = choice.pick(codec, job.elem)
    obj, used = encode(data, level=level, codec=use, elem=job.elem)
    choice.learn(use, job.elem, used)
    return obj, used


def upload_batch(
    url: str,
    options: dict[str, Any],
    jobs: list[BlobJob],
    level: int,
    codec: str,
    concurrency: int,
) -> tuple[list[Uploaded], Exception | None]:
    """Worker entry point: make sure ``blobs/<h>`` exists for every job. Returns the
    answers and, when one failed, the first error (ArchiveUnavailable, CorruptPage, a
    data disk's OSError...): the jobs not begun by then are not tried, those under way
    finish, and every object stored is answered, or nothing would ever delete it."""
    from objectstore._abc import one_error_nursery

    from ._manifest import blob_key

    store = _open_store(url, options)
    out: list[Uploaded] = []
    # (not a nursery that ends the batch at its first error: the answers of the whole batch
    # were lost when that error was not one it returned, a disk's EIO for one, and a job
    # cancelled once its put had landed was never answered either)
    failed: list[Exception] = []

    async def one(job: BlobJob, limit: trio.CapacityLimiter, budget: ByteLimiter) -> None:
        async with limit, budget.hold(job.size):
            if failed:
                return
            try:
                out.append(await upload_one(job))
            except Exception as e:
                failed.append(e)
                if _unavailable([e]) is not None:
                    # the archive is down: the jobs under way would each wait out the
                    # store's deadline too (an object one of them may still store is
                    # found by the next spill's conditional put)
                    batch.cancel()

    async def upload_one(job: BlobJob) -> Uploaded:
        key = blob_key(job.h)
        got: list[tuple[bytes, str]] = []
        if job.expected and await store.exists(key):
            # (read and compressed beside the HEAD, an eviction of restored pages read
            # and compressed every one of them, then dropped the work)
            return Uploaded(job.h, False, 0, None)
        if not job.probe or job.expected:  # the conditional put says whether it was there
            obj, used = await trio.to_thread.run_sync(_read_encode, job, level, codec, url)
            stored = await store.put(key, obj, if_absent=True, cold=True)
            return Uploaded(job.h, stored, len(obj) if stored else 0, used)
        # Compress while the HEAD is in flight; when the object exists the work is dropped.
        async with one_error_nursery() as n:

            async def enc() -> None:
                got.append(await trio.to_thread.run_sync(_read_encode, job, level, codec, url))

            n.start_soon(enc)
            if await store.exists(key):
                n.cancel_scope.cancel()
                return Uploaded(job.h, False, 0, None)
        obj, used = got[0]
        stored = await store.put(key, obj, if_absent=True, cold=True)
        return Uploaded(job.h, stored, len(obj) if stored else 0, used)

    async def run() -> None:
        limit, budget = trio.CapacityLimiter(max(1, concurrency)), ByteLimiter()
        with batch:
            async with trio.open_nursery() as n:
                for job in jobs:
                    n.start_soon(one, job, limit, budget)

    batch = trio.CancelScope()
    trio.run(run)
    return out, failed[0] if failed else None


# -- restores ------------------------------------------------------------------------------
class MissingObject(CorruptPage):
    """A restore worker found no object for a blob the index says is archived."""


@dataclass(frozen=True)
class TierSpec:
    """What a worker needs to write blob files exactly as the store's local tier does."""

    roots: tuple[str, ...]
    unit: int
    direct: bool
    durable: bool


@dataclass(frozen=True)
class RestoreJob:
    """One archived blob to bring back: its checksum and size, its object key, and the
    first device and nonce of the files to write (chosen by the store, which removes them
    by that name if the restore fails)."""

    h: bytes
    size: int
    key: str
    start: int
    nonce: str


@dataclass(frozen=True)
class Restored:
    """A worker's answer for one restore job: the written files' extents, bytes on disk and
    directories (to fsync before the index commit), or the error that left nothing."""

    h: bytes
    extents: tuple | None
    disk: int
    dirs: tuple[str, ...]
    error: Exception | None = None


_tiers: dict[TierSpec, LocalTier] = {}


def _tier(spec: TierSpec) -> LocalTier:
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from ._local import LocalTier

    t = _tiers.get(spec)
    if t is None:
        t = _tiers[spec] = LocalTier(
            tuple(Path(r) for r in spec.roots),
            spec.unit,
            direct=spec.direct,
            durable=spec.durable,
            pool=ThreadPoolExecutor(max(1, len(spec.roots) - 1)),
            bounce_buffers=2,
        )
    return t


def decode_verified(obj: bytes, h: bytes, size: int, what: str) -> memoryview:
    """An archive object's page bytes (in this thread's scratch buffer), checked against
    the blob's size and tree hash. Raises CorruptPage; nothing is written then."""
    data = decode(obj, what, into=scratch_buffer)  # written, then the buffer is reused
    if len(data) != size or tree_hash(len(data), leaves_of(data)) != h:
        raise CorruptPage(f"{what} does not match its checksum; not served")
    return data


def write_restored(w: BlobWriter, data: memoryview) -> tuple[tuple[Extent, ...], int]:
    """Write a verified blob with ``w`` (a BlobWriter): one vectored write per file, the
    files made durable, their directories left for the caller to sync once per batch
    (``w.new_dirs``). Removes what it wrote and raises on failure."""
    try:
        w.write_whole(memoryview(data))
        return w.finish(len(data), sync_dirs=False)
    except BaseException:
        w.abort()
        raise


#: the store process this worker serves (set by _serve): files written for it once it is
#: gone would be orphans no one accounts for (it swept its data directories when it opened
#: again, before they appeared), so a worker stops writing when it sees it gone
_PARENT: int | None = None


def _store_gone() -> bool:
    return _PARENT is not None and os.getppid() != _PARENT


def _restore_one(spec: TierSpec, job: RestoreJob, obj: bytes) -> Restored:
    data = decode_verified(obj, job.h, job.size, f"archive object {job.key}")
    if _store_gone():
        raise ArchiveUnavailable("the store that asked for this restore is gone")
    w = _tier(spec).writer(job.start, direct=True, nonce=job.nonce)
    extents, disk = write_restored(w, data)
    if _store_gone():  # (died while this was written: nothing may be left behind)
        w.abort()
        raise ArchiveUnavailable("the store that asked for this restore is gone")
    return Restored(job.h, extents, disk, tuple(w.new_dirs))


def restore_batch(
    url: str, options: dict[str, Any], spec: TierSpec, jobs: list[RestoreJob], concurrency: int
) -> list[Restored]:
    """Worker entry point: download, decode, verify and write each job's blob as durable
    files that no index row names yet (the store commits them). One answer per job; a job
    that fails (missing or corrupt object, full disk, endpoint down) has its error and no
    files."""
    from objectstore import ObjectNotFound

    store = _open_store(url, options)
    out: list[Restored] = []
    # Once one download finds the archive unreachable, the jobs still waiting for a slot
    # are not tried: each would wait out the store's deadline again (a batch of 14 pages,
    # 4 at a time, took four deadlines, minutes, before the restore said so). A refusal
    # (ArchiveAccessDenied) may be one object's: the others are still tried.
    down: list[ArchiveUnavailable] = []

    async def one(job: RestoreJob, limit: trio.CapacityLimiter, budget: ByteLimiter) -> None:
        try:
            # (the object and its page are held from the download until they are written:
            # only the downloads were limited, and every job of a batch could be decoding)
            async with budget.hold(job.size):
                obj = await download(job, limit)
                out.append(await trio.to_thread.run_sync(_restore_one, spec, job, obj))
        except Exception as e:
            out.append(Restored(job.h, None, 0, (), e))

    async def download(job: RestoreJob, limit: trio.CapacityLimiter) -> bytes:
        async with limit:
            if down:
                raise ArchiveUnavailable(str(down[0]))
            try:
                return await store.get(job.key)
            except ObjectNotFound:
                raise MissingObject(
                    f"archive object {job.key} is missing from {store.url}"
                ) from None
            except ArchiveAccessDenied:
                raise
            except ArchiveUnavailable as e:
                down.append(e)
                raise

    async def run() -> None:
        limit, budget = trio.CapacityLimiter(max(1, concurrency)), ByteLimiter()
        async with trio.open_nursery() as n:
            for job in jobs:
                n.start_soon(one, job, limit, budget)

    trio.run(run)
    return out


def _serve(rfd: int, wfd: int) -> None:
    """A worker's loop: run ``(fn, args)`` jobs from the daemon until it closes the pipe."""
    global _PARENT
    _PARENT = os.getppid()
    # Ctrl-C reaches the whole process group: the store process decides what stops (it
    # closes the pipe, or kills this worker); here it only printed a traceback. So does a
    # SIGTERM to the group (systemd's stop, `kill -- -PGID`): it killed the workers under
    # a daemon closing its store, whose last uploads then failed or ran again. A worker
    # whose store is gone still ends: its pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _worker_init()
    jobs, answers = Connection(rfd, writable=False), Connection(wfd, readable=False)
    while True:
        try:
            fn, args = jobs.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[bool, Any] = (True, fn(*args))
        except Exception as e:
            answer = (False, e)
        try:
            blob = pickle.dumps(answer)
        except Exception as e:  # an error that does not pickle: its text does
            blob = pickle.dumps((False, ArchiveUnavailable(f"{answer[1]!r} ({e})")))
        try:
            answers.send_bytes(blob)
        except OSError:
            return


def _ping() -> int:
    return os.getpid()


# -- the daemon side ----------------------------------------------------------------------
class WorkerDied(Exception):
    """The worker process running a job ended before it answered."""


def _ended(code: int | None) -> str:
    """What ended a worker, from its exit status (None: not known)."""
    if code is None or code >= 0:
        return f"upload worker ended (exit status {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    # the kernel's OOM killer sends SIGKILL: a job's pages held in memory (several copies of
    # each, a few jobs at a time) can be more than the machine has
    hint = " (out of memory?)" if -code == signal.SIGKILL else ""
    return f"upload worker killed by {name}{hint}"


class WorkerUnavailable(Exception):
    """No worker process could be started (no interpreter to run, no processes left...)."""


class _Slot:
    """One worker process, started on demand, and the daemon thread that feeds it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.jobs: Connection | None = None
        self.answers: Connection | None = None

    def start(self) -> None:
        # A fresh interpreter through subprocess, not multiprocessing: multiprocessing's
        # spawn re-runs the caller's main script in the child (a script without a
        # ``__main__`` guard would start workers recursively), and fork would copy the
        # daemon's threads mid-flight.
        rj, wj = os.pipe()
        ra, wa = os.pipe()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from kvfs._uploader import _serve; _serve({rj}, {wa})",
                ],
                pass_fds=(rj, wa),  # and no other: not the store's lock file, for one
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # never into a command's output (--json)
                env=env,
            )
        except BaseException:
            for fd in (wj, ra):
                os.close(fd)
            raise
        finally:
            os.close(rj)
            os.close(wa)
        self.jobs = Connection(wj, readable=False)
        self.answers = Connection(ra, writable=False)

    def stop(self, kill: bool = False) -> None:
        for c in (self.jobs, self.answers):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        self.jobs = self.answers = None
        if self.proc is not None:
            if kill:
                with contextlib.suppress(OSError):
                    self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            try:
                self.start()
            except OSError as e:
                raise WorkerUnavailable(f"cannot start an upload worker: {e}") from e
        assert self.jobs is not None and self.answers is not None
        try:
            self.jobs.send((fn, args))
            ok, value = pickle.loads(self.answers.recv_bytes())
        except (EOFError, OSError) as e:
            code = None
            if self.proc is not None:
                # (its pipe closed as it died: polled at once, it was not reaped yet, and
                # the error said "exit status None" for a worker the OOM killer took)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(timeout=5)
            self.stop(kill=True)
            raise WorkerDied(_ended(code)) from e
        if not ok:
            raise value
        return value


class _Workers:
    """``n`` worker processes fed from one queue (one job per worker at a time)."""

    def __init__(self, n: int) -> None:
        self.slots = [_Slot() for _ in range(n)]
        self._lock = threading.Lock()
        #: jobs being run by a worker right now
        self.running = 0
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple] | None]
        self._queue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._feed, args=(slot,), name=f"kvfs-upload-{i}", daemon=True)
            for i, slot in enumerate(self.slots)
        ]
        for t in self._threads:
            t.start()

    def _feed(self, slot: _Slot) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                slot.stop()
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self.running += 1
            try:
                fut.set_result(slot.run(fn, args))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                with self._lock:
                    self.running -= 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def pids(self) -> list[int]:
        return sorted(s.proc.pid for s in self.slots if s.proc is not None)

    def shutdown(self) -> None:
        """Stop the workers: idle ones at once, busy ones after a short grace (nobody is
        left to use their answers; an interrupted upload is redone by the next spill)."""
        for _ in self.slots:
            self._queue.put(None)
        end = time.monotonic() + 5
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        for slot in self.slots:
            proc = slot.proc  # (its feeding thread may be clearing it meanwhile)
            if proc is not None and proc.poll() is None:
                proc.kill()
                # reaped here, not left to the feeding thread: at exit nothing else would,
                # and the interpreter's teardown warned "subprocess N is still running"
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)


_workers_lock = threading.Lock()
_workers: dict[tuple[int, str], _Workers] = {}


def _aws_environment() -> str:
    """A digest of the ``AWS_*`` variables a worker inherits (its credential chain reads
    them): workers started before they changed would not see the change."""
    h = hashlib.sha256()
    for k in sorted(os.environ):
        if k.startswith("AWS_"):
            h.update(f"{k}={os.environ[k]}\0".encode())
    return h.hexdigest()


def _shared_workers(processes: int) -> _Workers:
    # One set per process count (and AWS environment) for the whole process: a store
    # reopened in the same process (tests, benchmarks, a restarted store) finds its
    # workers started; after the environment changed, a fresh set starts (the old one ends
    # with the process, its jobs in flight undisturbed).
    key = (processes, _aws_environment())
    with _workers_lock:
        w = _workers.get(key)
        if w is None:
            w = _workers[key] = _Workers(processes)
        return w


def _forget_workers() -> None:
    # A forked child inherits the dict but not the threads that feed the workers (nor,
    # if the fork came while one held it, a usable lock), and the workers are its
    # parent's: it starts its own if it ever spills, and its exit leaves the parent's be.
    global _workers_lock
    _workers_lock = threading.Lock()
    _workers.clear()


os.register_at_fork(after_in_child=_forget_workers)


@atexit.register
def shutdown_workers() -> None:
    """Stop every upload worker of this process (they start again on next use)."""
    with _workers_lock:
        ws = list(_workers.values())
        _workers.clear()
    for w in ws:
        w.shutdown()


async def _wait(fut: Future[Any]) -> Any:
    """Wait for a concurrent future without tying up a thread; the job itself goes on if
    the waiting task is cancelled."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: Future[Any]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    fut.add_done_callback(wake)
    await done.wait()
    return fut.result()


class _Hold:
    """The files of one batch, held (leased by the caller) until the last job that reads
    them has ended: released once, by the waiting task or, when that task was cancelled
    while a worker still reads, by the job's completion."""

    def __init__(self, batch: list[BlobJob], release: Callable[[list[BlobJob]], None]) -> None:
        self.batch = batch
        self._release = release
        self._lock = threading.Lock()
        self._abandoned: Future[Any] | None = None
        self._done = False

    def _release_once(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release(self.batch)

    def job_done(self, fut: Future[Any]) -> None:
        with self._lock:
            mine = self._abandoned is fut
        if mine:
            self._release_once()

    def abandon(self, fut: Future[Any]) -> None:
        with self._lock:
            if not fut.done():
                self._abandoned = fut
                return
        self._release_once()

    def finish(self) -> None:
        with self._lock:
            if self._abandoned is not None:
                return
        self._release_once()


class UploadPool:
    """Runs :func:`upload_batch` in ``processes`` worker processes (started on first use,
    shared by every store of this process with the same count). Thread-safe."""

    def __init__(
        self,
        url: str,
        options: dict[str, Any],
        *,
        processes: int,
        concurrency: int,
        level: int,
        codec: str,
    ) -> None:
        self.url = url
        self.options = options
        self.processes = processes
        self.concurrency = concurrency
        self.level = level
        self.codec = codec
        self.restarts = 0

    def pids(self) -> list[int]:
        """The worker processes' ids (empty before first use)."""
        return _shared_workers(self.processes).pids()

    def running(self) -> int:
        """Jobs a worker is running right now (any store's)."""
        return _shared_workers(self.processes).running

    def warm(self) -> None:
        """Start the workers now, so the first spill pays no start-up."""
        w = _shared_workers(self.processes)
        for _ in range(self.processes):
            w.submit(_warm, self.url, self.options)

    async def upload(
        self,
        jobs: list[BlobJob],
        release: Callable[[list[BlobJob]], None],
        batch_done: Callable[[list[Uploaded]], None] | None = None,
    ) -> list[Uploaded]:
        """Upload ``jobs`` in batches spread over the workers; ``batch_done(answers)`` as
        each batch's answers come. ``release(batch)`` is called once per batch when its
        worker is done with the files (also after a failure or a cancellation of the
        caller). A batch that fails does not stop the others: every object stored is
        answered (the caller records it, or nothing would ever delete it), then the first
        error is raised: ArchiveUnavailable, CorruptPage."""
        out: list[Uploaded] = []
        errors: list[Exception] = []

        async def answered(
            batch: list[BlobJob], result: tuple[list[Uploaded], Exception | None]
        ) -> None:
            done, error = result
            out.extend(done)
            if batch_done is not None:
                batch_done(done)
            if error is not None:
                errors.append(error)

        await self._run(
            jobs,
            lambda batch, inner: (
                upload_batch,
                (self.url, self.options, batch, self.level, self.codec, inner),
            ),
            answered,
            release,
            "nothing dropped",
            outage=lambda result: _unavailable([result[1]]),
            refused=lambda batch, e: ([], e),
        )
        if errors:
            raise errors[0]
        return out

    async def restore(
        self,
        jobs: list[RestoreJob],
        spec: TierSpec,
        answered: Callable[[list[RestoreJob], list[Restored]], Awaitable[None]],
        release: Callable[[list[RestoreJob]], None],
        before_retry: Callable[[list[RestoreJob]], None],
    ) -> None:
        """Restore ``jobs`` in batches spread over the workers; ``await answered(batch,
        results)`` as each batch's answers come. ``release(batch)`` is called once per batch
        when no worker writes its files any more: after its answer was handled, after a
        failure, or once the worker is done when the caller was cancelled meanwhile.
        ``before_retry(batch)`` before a batch is tried again on a fresh worker (the dead
        one may have left files). Raises ArchiveUnavailable (a worker died twice)."""
        await self._run(
            jobs,
            lambda batch, inner: (restore_batch, (self.url, self.options, spec, batch, inner)),
            answered,
            release,
            "nothing restored",
            before_retry,
            outage=lambda results: _unavailable([r.error for r in results]),
            refused=lambda batch, e: [Restored(j.h, None, 0, (), e) for j in batch],
        )

    async def _run(
        self,
        jobs: list[Any],
        call: Callable[[list[Any], int], tuple[Callable[..., Any], tuple]],
        answered: Callable[[list[Any], Any], Awaitable[None]],
        release: Callable[[list[Any]], None],
        outcome: str,
        before_retry: Callable[[list[Any]], None] | None = None,
        *,
        outage: Callable[[Any], Exception | None],
        refused: Callable[[list[Any], Exception], Any],
    ) -> None:
        """Run ``jobs`` in batches, ``processes`` batches in flight. Once a batch's answer
        says the archive is unreachable (``outage(result)``), the batches not started yet
        are answered ``refused(batch, error)`` without trying: each would wait out the
        store's deadline again (a restore of a large session, endpoint down, took one
        deadline per batch, minutes, before it said so)."""
        if not jobs:
            return
        per = max(1, -(-len(jobs) // self.processes))
        per = min(per, 4 * max(1, self.concurrency // self.processes))
        batches = [jobs[i : i + per] for i in range(0, len(jobs), per)]
        inner = max(1, -(-self.concurrency // min(self.processes, len(batches))))
        slots = trio.CapacityLimiter(self.processes)
        down: list[Exception] = []

        async def one(batch: list[Any]) -> None:
            hold = _Hold(batch, release)
            try:
                # (the slot is free again while the answer is handled: a commit of restored
                # pages must not keep a worker idle)
                async with slots:
                    result = refused(batch, down[0]) if down else await attempts(batch, hold)
                    if (e := outage(result)) is not None:
                        down.append(e)
                await answered(batch, result)
            finally:
                hold.finish()

        async def attempts(batch: list[Any], hold: _Hold) -> Any:
            for attempt in (1, 2):
                fn, args = call(batch, inner)
                fut = _shared_workers(self.processes).submit(fn, *args)
                fut.add_done_callback(hold.job_done)
                try:
                    return await _wait(fut)
                except WorkerDied as e:
                    self.restarts += 1
                    if attempt == 2:
                        raise ArchiveUnavailable(f"{e}, twice; {outcome}") from e
                    if before_retry is not None:
                        before_retry(batch)
                except BaseException:
                    hold.abandon(fut)  # cancelled: the files stay held until the job ends
                    raise
            raise AssertionError("unreachable")

        from objectstore._abc import one_error_nursery

        async with one_error_nursery() as n:
            for b in batches:
                n.start_soon(one, b)
