"""`kvfs demo` and `kvfs bench store` run end to end (tiny sizes: correctness, not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.__main__ import main
from kvfs._mountinfo import fs_type


def test_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(2):  # a second run reuses the store and starts its sessions afresh
        assert main(["demo", "--objects", "--data", str(tmp_path / "demo"), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["verified"] and out["pages"] == 96
        st = out["statistics"]
        assert st["dedup_puts"] == 24 and st["pages"] == 96 and st["corrupt_reads"] == 0
        assert st["logical_bytes"] - st["local_bytes"] == 24 * out["page_bytes"]
        assert [s["session"] for s in out["sessions"]] == [f"demo-{i}" for i in range(4)]
        assert out["sessions"][0]["pinned"]
    assert main(["demo", "--objects", "--data", str(tmp_path / "demo")]) == 0
    text = capsys.readouterr().out
    assert "saved by dedup" in text and "demo-3" in text
    # its tables read as kvfs ls's: headers in capitals, PINNED empty where not pinned
    lines = text.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("SESSION"))) :]
    assert table[0].split() == ["SESSION", "MODEL", "PAGES", "SIZE", "LOCAL", "PINNED"]
    rows = [x.split() for x in table[2:6]]
    assert rows[0][-1] == "yes" and all(len(r) == len(rows[0]) - 1 for r in rows[1:]), table


def test_bench_store_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for d in "ab":
        (tmp_path / d).mkdir()  # (made by the user: a benchmark creates no --data)
    assert (
        main(
            [
                "bench",
                "store",
                "--sizes",
                "1",
                "--clients",
                "1,2",
                "--total",
                "4",
                "--data",
                f"{tmp_path / 'a'},{tmp_path / 'b'}",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert [(r["size_mib"], r["clients"]) for r in res["rows"]] == [(1, 1), (1, 2)]
    for r in res["rows"]:
        assert r["bytes"] == 4 << 20
        assert all(r[k] > 0 for k in ("raw_put", "kvfs_put", "raw_get", "kvfs_get"))
    assert not any(any((tmp_path / d).iterdir()) for d in "ab")  # cleaned up


def test_bench_store_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--index", "3000", "--data", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["pages"] == 3000 and res["swept_on_restart"] == 0
    assert res["commits_per_s_full"] > 0 and res["lookups_per_s"] > 0


def test_bench_store_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--sizes", "0"]) == 2
    assert "--sizes takes positive integers" in capsys.readouterr().err


def test_bad_inputs_are_told_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What a first user typed wrong is named, exit 2, before any work: Python's own int()
    message, a bench run on tmpfs, a bench endpoint without a bucket (after minutes of
    tensor generation), a config.json that is not JSON (no file name)."""
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{bad")
    cases = [
        (["bench", "store", "--sizes", "abc"], "--sizes takes positive integers"),
        (["bench", "fuse", "--clients", "1,x"], "--clients takes positive integers"),
        (["bench", "archive", "--endpoint", "http://127.0.0.1:1"], "--endpoint needs --bucket"),
        (["size", "--hf-config", str(bad_json)], f"{bad_json}: not JSON"),
    ]
    if fs_type("/dev/shm") == "tmpfs":
        cases.append((["bench", "fuse", "--dir", "/dev/shm"], "/dev/shm is on tmpfs"))
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, (argv, err)
    assert main(["size", "--model", "Llama-3.1-8B", "--archive", "1PB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["archive_tokens"] > 0


def test_model_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `make demo` runs: model -> kvfs -> archive -> new process; mount, ls, stats."""
    pytest.importorskip("torch", reason="needs the engines extra (make test installs it)")
    assert main(["demo", "--data", str(tmp_path / "d"), "--small", "--tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "decoded tokens identical: True" in out
    assert "layer-000" in out  # listed through the mount
    assert "agent-demo" in out and "local+archive" in out  # kvfs ls through the daemon
    assert "DEVICE" in out and "TIER" in out  # kvfs stats tables
    assert not (tmp_path / "d" / "mnt").is_mount()
    # the commands it shows work as printed, pasted after its `export` line (it printed
    # `kvfs ls` and ran it with --data and --archive a user could not see)
    export = next(x for x in out.splitlines() if x.startswith("$ export "))
    env = dict(kv.split("=", 1) for kv in export.removeprefix("$ export ").split())
    assert "$ kvfs ls\n" in out
    got = subprocess.run(
        [sys.executable, "-m", "cli", "ls", "--json"],
        env={**os.environ, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    assert "agent-demo" in [s["session"] for s in json.loads(got.stdout)]
