"""A short run of scripts/mount_chaos.py: writers, tmp + rename publishers, read and mmap
readers, unlinks, object-API clients, spills, restores, evictions and pins at once on a
real mount with a moto S3 archive, the daemon killed with SIGKILL twice. Every page read
must be whole and its own, no unexpected errno, no error in the daemon's log, and a clean
fsck at the end (the script's exit status says so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_chaos_on_a_mount_with_kills_finds_nothing(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "scripts" / "mount_chaos.py"), "--seconds", "14"]
    argv += ["--kill-every", "6", "--archive", "s3", "--dir", str(tmp_path)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=ROOT)
    out = r.stdout + r.stderr[-4000:]
    assert r.returncode == 0, out
    assert "daemon killed 2 times; 0 findings" in r.stdout, out
    counts = {
        line.split(None, 1)[1]: int(line.split()[0])
        for line in r.stdout.splitlines()
        if line.strip() and line.split()[0].isdigit()
    }
    for what in ("read", "read by mmap", "published by rename", "spill", "restore", "api put"):
        assert counts.get(what, 0) > 0, f"the run did no {what!r}:\n{out}"
