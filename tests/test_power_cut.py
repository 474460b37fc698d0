"""A power cut under a writer, many times: the store's data and index on a real ext4 file
system (a loop device), cut with ``EXT4_IOC_SHUTDOWN`` and NOLOGFLUSH at a random moment
of a writer's puts, as xfstests' shutdown tests do: what the journal had not committed is
lost, as at a power cut, unlike a SIGKILL (tests/test_store_crash.py), after which the page
cache still writes everything back. Mounted again, every page whose put returned must read
back intact, nothing torn may be visible, and fsck must find nothing after the next open:
this is what the order of the fdatasyncs, the directory syncs and the index commit is for.
A ``durable=False`` store may lose its last puts at a power cut (docs/architecture.md,
"Durability"), but nothing else: it opens, and what it shows is whole.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _kvfs_mount import daemon_mount
from _loop_disk import made_loop_disk
from test_store_crash import WRITER, _verify

import kvfs
from tests._crash_writer import STRIPE, page_data

ROUNDS = 8
TESTS = Path(__file__).parent


def _started(argv: list[str], **env: str) -> subprocess.Popen[bytes]:
    """A child (with ``env`` added to this one's) once it has said ``ready``."""
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TESTS": str(TESTS), **env},
    )
    assert p.stdout is not None
    first = p.stdout.readline()
    if first != b"ready\n":
        p.kill()
        raise AssertionError(f"the child did not start: {first!r} {p.stderr.read()!r}")  # type: ignore[union-attr]
    return p


def _acks(p: subprocess.Popen[bytes]) -> list[str]:
    """What a child killed with SIGKILL acknowledged: its whole lines (one cut by the kill
    has no newline: what it says was done, but not said whole)."""
    p.send_signal(signal.SIGKILL)
    out, _ = p.communicate(timeout=60)
    return [ln for ln in out.decode().split("\n")[:-1] if ln]


def _check(store: kvfs.SyncStore, acked: set[str]) -> None:
    """After the power came back: fsck finds nothing, every acknowledged page is whole,
    and so is every page shown; then most of them go (room for the next rounds)."""
    report = store.fsck()
    assert not any(report[k] for k in ("orphans", "missing", "corrupt")), report
    for p in store.list(path_prefix="crash/"):
        if p.path.endswith(".tmp"):
            store.delete(p.path)  # (closed, not renamed yet: a page too)
    for path in sorted(_verify(store, acked)):
        if hash(path) % 3:
            store.delete(path)
            acked.discard(path)


@pytest.mark.slow
@pytest.mark.parametrize("durable", [True, False])
def test_a_power_cut_loses_no_acknowledged_page(tmp_path: Path, durable: bool) -> None:
    # durable=False: a cut soon after the store was made lost its identity from the index
    # (not synced) but not from the device markers (always synced), and every open after
    # refused the store: "... is device 0 of store X, but is configured as device 0 of
    # store Y".
    with made_loop_disk(tmp_path, 512 << 20) as disk:
        dirs = [disk.path / "nvme0", disk.path / "nvme1"]
        cfg = kvfs.StoreConfig(data_dirs=tuple(dirs), stripe_unit=STRIPE, durable=durable)
        rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        acked: set[str] = set()
        cut_with_acks = 0
        for rnd in range(ROUNDS):
            argv = [sys.executable, str(WRITER), str(rnd), *map(str, dirs)]
            p = _started(argv, CRASH_DURABLE="1" if durable else "0")
            time.sleep(rng.uniform(0.05, 0.4))
            disk.shut_down()  # the power goes: the writer's next I/O fails
            got = _acks(p)
            cut_with_acks += bool(got)
            if durable:
                acked |= set(got)
            disk.comeback()  # power back: the journal replayed, as at boot
            with kvfs.open_store_sync(cfg) as store:
                _check(store, acked)
        assert cut_with_acks >= ROUNDS // 2, "the power was mostly cut before a first put"


#: Writes pages through a mount until killed: ``python -c MOUNT_WRITER MOUNTPOINT ROUND``.
#: Page ``crash/r<ROUND>/p<i>`` holds page_data(ROUND, i); every other one is published as
#: LMCache does (a temporary name, then os.replace). Prints each page's key once its close
#: (and rename) returned.
MOUNT_WRITER = """
import os, sys
sys.path.insert(0, os.environ["TESTS"])
from _crash_writer import page_data
mp, rnd = sys.argv[1], int(sys.argv[2])
os.makedirs(f"{mp}/crash/r{rnd}", exist_ok=True)
print("ready", flush=True)
i = 0
while True:
    final = f"{mp}/crash/r{rnd}/p{i}"
    name = final + ".tmp" if i % 2 else final
    with open(name, "wb") as f:
        f.write(page_data(rnd, i))
    if name != final:
        os.replace(name, final)
    print(f"crash/r{rnd}/p{i}", flush=True)
    i += 1
"""


@pytest.mark.slow
def test_a_power_cut_under_a_mount_loses_no_closed_file(tmp_path: Path) -> None:
    """As above through a ``kvfs mount`` daemon: a file whose close (and rename onto its
    name) returned is a page after the power comes back, whole."""
    with made_loop_disk(tmp_path, 512 << 20) as disk:
        dirs = [disk.path / "nvme0", disk.path / "nvme1"]
        cfg = kvfs.StoreConfig(data_dirs=tuple(dirs), stripe_unit=STRIPE)
        rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        acked: set[str] = set()
        cut_with_acks = 0
        for rnd in range(ROUNDS // 2):
            mp = tmp_path / f"mnt{rnd}"
            mount = daemon_mount(cfg, mp)
            try:
                w = _started([sys.executable, "-c", MOUNT_WRITER, str(mp), str(rnd)])
                time.sleep(rng.uniform(0.1, 0.6))
                disk.shut_down()
                mount.proc.send_signal(signal.SIGKILL)  # (and its writer after it)
                mount.proc.wait(timeout=60)
                got = _acks(w)
            finally:
                mount.stop()
            cut_with_acks += bool(got)
            acked |= set(got)
            disk.comeback()
            with kvfs.open_store_sync(cfg) as store:
                _check(store, acked)
        assert cut_with_acks >= ROUNDS // 4, "the power was mostly cut before a first close"


#: Spills sessions until killed: ``python -c SPILLER ROUND ARCHIVE_URL DIR...``. Session
#: ``r<ROUND>s<j>`` holds pages ``crash/r<ROUND>s<j>/p<i>`` = page_data(ROUND, 10 j + i);
#: prints the session's name once its spill, which drops the local copies, returned.
SPILLER = """
import os, sys
from pathlib import Path
sys.path.insert(0, os.environ["TESTS"])
from _crash_writer import STRIPE, page_data
import kvfs
rnd, url, dirs = int(sys.argv[1]), sys.argv[2], [Path(d) for d in sys.argv[3:]]
cfg = kvfs.StoreConfig(data_dirs=tuple(dirs), stripe_unit=STRIPE, archive_url=url,
                       extra={"archive": {"interval": 0, "upload_processes": 0}})
with kvfs.open_store_sync(cfg) as s:
    print("ready", flush=True)
    j = 0
    while True:
        session = f"r{rnd}s{j}"
        for i in range(4):
            s.put(f"crash/{session}/p{i}", page_data(rnd, 10 * j + i))
        s.spill(f"crash/{session}")
        print(session, flush=True)
        j += 1
"""


@pytest.mark.slow
def test_a_power_cut_keeps_every_spilled_session_restorable(tmp_path: Path) -> None:
    """A spill drops the local copies only once the objects and the manifest are in the
    archive: at a power cut (a ``file://`` archive on the same disk), every session whose
    spill returned comes back whole, and only from the archive."""
    with made_loop_disk(tmp_path, 512 << 20) as disk:
        dirs = [disk.path / "nvme0", disk.path / "nvme1"]
        url = f"file://{disk.path / 'archive'}"
        cfg = kvfs.StoreConfig(data_dirs=tuple(dirs), stripe_unit=STRIPE, archive_url=url)
        rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        spilled: list[tuple[int, str]] = []
        for rnd in range(ROUNDS // 2):
            p = _started([sys.executable, "-c", SPILLER, str(rnd), url, *map(str, dirs)])
            time.sleep(rng.uniform(0.1, 0.8))
            disk.shut_down()
            spilled += [(rnd, session) for session in _acks(p)]
            disk.comeback()
            with kvfs.open_store_sync(cfg) as store:
                report = store.fsck(archive=True)
                assert not any(report[k] for k in ("orphans", "missing", "corrupt")), report
                for r, session in spilled:
                    j = int(session.split("s")[1])
                    keys = [f"crash/{session}/p{i}" for i in range(4)]
                    assert [store.stat(k).tier for k in keys] == ["archive"] * 4, session
                    for i, key in enumerate(keys):
                        assert store.get(key) == page_data(r, 10 * j + i), key
                    store.evict(session=f"crash/{session}")  # (archive-only again)
        assert len(spilled) >= ROUNDS // 4, "the power was mostly cut before a first spill"
