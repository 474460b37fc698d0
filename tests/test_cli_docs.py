"""docs/cli.md and docs/configuration.md are generated from the real parser and option
table; these fail when either is stale, and check what every command offers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli.__main__ import build_parser
from cli._docgen import _subparsers, configuration_markdown
from kvfs._settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def test_docs_match_the_real_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "cli._docgen", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_configuration_doc_lists_every_option_and_default() -> None:
    text = configuration_markdown()
    for o in OPTIONS:
        assert f"| `{o.key}` | `{o.env}` |" in text


def test_store_commands_offer_json_and_store_selection() -> None:
    subs = _subparsers(build_parser())
    for name in (
        "ls",
        "stats",
        "put",
        "get",
        "rm",
        "pin",
        "unpin",
        "evict",
        "spill",
        "restore",
        "fsck",
        "config",
        "size",
    ):
        flags = {s for a in subs[name]._actions for s in a.option_strings}
        assert "--json" in flags, name
        if name != "size":
            assert {"--config", "--data", "--socket"} <= flags, name
        if name not in ("size", "config"):  # (config never asks a daemon: it shows the files)
            assert {"--daemon", "--offline"} <= flags, name
