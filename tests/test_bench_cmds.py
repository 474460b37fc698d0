"""`kvfs bench gds` and `kvfs bench ttft` run end to end at tiny sizes (correctness, not speed:
the figures go to docs/benchmarks.md, never into an assertion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.__main__ import main


def test_bench_gds_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gds", "--sizes", "1", "--layers", "2", "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    methods = {r["method"] for r in res["results"]}
    assert {"raw", "fastpath", "store.get"} <= methods
    assert all(r["gbps"] > 0 for r in res["results"])
    assert "[1/1] 1 MiB pages" in captured.err  # progress on stderr


def test_bench_ttft_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="needs the engines extra (make test installs it)")
    args = ["bench", "ttft", "--model", "small", "--tokens", "256,512", "--repeat", "1"]
    assert main([*args, "--dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert [r["tokens"] for r in res["rows"]] == [256, 512]
    assert all(r["same_first_token"] for r in res["rows"])  # the loaded cache gives the same token
    assert "[2/2] 512 tokens" in captured.err
