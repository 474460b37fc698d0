"""docs/cli.md and docs/configuration.md are generated from the real parser and option
table; these fail when either is stale, check what every command offers, and that every
command the other docs show still parses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _doc_commands import DocCommand, doc_commands, invocations, problems

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


def test_every_command_the_docs_show_parses_with_the_current_cli() -> None:
    """Nothing checked the ``kvfs ...``, ``python -m kvfs.bench...`` and ``scripts/...``
    commands written in the README and docs/: an option renamed or a command removed left
    them telling users to type what the CLI refuses (docs/benchmarks.md records each figure
    with its command, so a stale one there cannot be re-run). tests/_doc_commands.py says
    what counts as a command and what is skipped on purpose."""
    checked, wrong = 0, []
    for cmd in doc_commands():
        found = invocations(cmd)
        if isinstance(found, str):
            continue
        for inv in found:
            checked += 1
            if (problem := problems(cmd, inv)) is not None:
                wrong.append(f"{cmd.where}: {cmd.text}\n    {problem}")
    assert not wrong, "\n".join(wrong)
    assert checked > 150  # (an extraction that finds nothing passes nothing)


@pytest.mark.parametrize(
    ("text", "whole", "problem"),
    [
        ("kvfs pin --ttl 2h SESSION", False, "kvfs pin has no option --ttl"),
        ("kvfs bench store --rep 3", True, "kvfs bench store has no option --rep"),
        ("kvfs lsx", False, "kvfs has no command lsx"),
        ("kvfs bench store --repeat x", True, "--repeat: not an integer"),
        ("sudo KVFS_X=1 .venv/bin/kvfs ls -l --nope", False, "kvfs ls has no option --nope"),
        ("nvidia-smi; python3 -m kvfs.bench.gds --sizes 1 --nope", True, "no option --nope"),
        ("python -m kvfs.bench.store", True, "has no main"),
        (".venv/bin/python scripts/fuse_ceiling.py --mib 4 --nope 1", True, "no option --nope"),
        ("scripts/mount_metadata_latency.py --mib 4", True, "takes no arguments"),
        # (a script whose parser is built by scripts/_memory.py's page_counts)
        ("scripts/recovery_memory.py --pages 1 --nope", True, "no option --nope"),
        ("scripts/no_such.py", False, "does not exist"),
        ("scripts/fuse_ceiling.py --writeback [--clients 4 | --mibs 16]", True, "--mibs"),
    ],
)
def test_the_doc_command_check_finds_what_the_cli_refuses(
    text: str, whole: bool, problem: str
) -> None:
    """The check of the docs' commands must fail where a user's shell would: an option
    renamed (even one argparse would still take as a prefix), a command gone, a bad value,
    a benchmark module with no main, a script's option or the script itself gone."""
    cmd = DocCommand("test", text, whole)
    found = invocations(cmd)
    assert not isinstance(found, str), found
    assert any(problem in (problems(cmd, inv) or "") for inv in found)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("kvfs bench store: 1 data dir(s), stripe unit 4 MiB; rounds' kvfs/raw", "prints"),
        ("kvfs ls: warning: something", "prints"),
        ("kvfs  boto3 alone  ratio", "table"),
        ("kvfs COMMAND --json", "placeholder"),
        ("make demo    # shows kvfs at work", "no command"),
    ],
)
def test_the_doc_command_check_skips_output_and_placeholders(text: str, why: str) -> None:
    found = invocations(DocCommand("test", text, True))
    assert isinstance(found, str) and why in found


_PATH = re.compile(
    r"(?<![\w/.-])((?:kvfs|objectstore|gds|cli|tests|scripts|docs|\.ci)/[\w/.*-]*"
    r"(?:\.(?:py|md|txt|sh|toml)|\*|/run))(?:::(\w+))?"
)


def test_every_file_test_and_link_the_docs_name_exists() -> None:
    """Nothing checked the paths the docs send readers to (``kvfs/_spill.py``,
    ``tests/test_gds.py::test_...``, ``[archive](docs/archive.md)``): a module split or a
    test renamed left them pointing at nothing. Placeholders (``kvfs/bench/<name>.py``) are
    not paths."""
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    missing, found = [], 0
    for doc in ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]:
        text = (ROOT / doc).read_text()
        for m in _PATH.finditer(text):
            found += 1
            files = sorted(ROOT.glob(m.group(1)))
            if not files or (m.group(2) and f"def {m.group(2)}(" not in files[0].read_text()):
                missing.append(f"{doc}: {m.group(0)}")
        for m in re.finditer(r"`(?:(test_\w+\.py)::)?(test_\w+)`", text):
            found += 1
            in_file = (ROOT / "tests" / m.group(1)).read_text() if m.group(1) else tests
            if f"def {m.group(2)}(" not in in_file:
                missing.append(f"{doc}: {m.group(0)}")
        for m in re.finditer(r"\]\(([^)#\s:]+)(?:#[\w-]+)?\)", text):
            found += 1
            if not (ROOT / doc).parent.joinpath(m.group(1)).exists():
                missing.append(f"{doc}: link {m.group(1)}")
    assert not missing, "\n".join(missing)
    assert found > 50
