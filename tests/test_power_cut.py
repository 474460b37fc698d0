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
from _loop_disk import made_loop_disk
from test_store_crash import WRITER, _verify

import kvfs
from tests._crash_writer import STRIPE

ROUNDS = 8


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
        env = {**os.environ, "CRASH_DURABLE": "1" if durable else "0"}
        rng = random.Random(int.from_bytes(os.urandom(4), "little"))
        acked: set[str] = set()
        cut_with_acks = 0
        for rnd in range(ROUNDS):
            p = subprocess.Popen(
                [sys.executable, str(WRITER), str(rnd), *map(str, dirs)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            assert p.stdout is not None
            first = p.stdout.readline()
            if first != b"ready\n":
                p.kill()
                raise AssertionError(f"writer did not start: {first!r} {p.stderr.read()!r}")  # type: ignore[union-attr]
            time.sleep(rng.uniform(0.05, 0.4))
            disk.shut_down()  # the power goes: the writer's next I/O fails
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate(timeout=60)
            got = [ln for ln in out.decode().split("\n")[:-1] if ln]
            cut_with_acks += bool(got)
            if durable:
                acked |= set(got)
            disk.comeback()  # power back: the journal replayed, as at boot
            with kvfs.open_store_sync(cfg) as store:
                report = store.fsck()
                assert not any(report[k] for k in ("orphans", "missing", "corrupt")), report
                visible = _verify(store, acked)
                for path in sorted(visible):  # room for the next rounds; keep some
                    if hash(path) % 3:
                        store.delete(path)
                        acked.discard(path)
        assert cut_with_acks >= ROUNDS // 2, "the power was mostly cut before a first put"
