"""The commands the documentation shows, found and checked against the real parsers
without running them (tests/test_cli_docs.py).

A *command* is a line of a shell-like fenced block (```sh, ```ini, or one with no language)
or an inline code span of the prose that runs ``kvfs`` (also as ``.venv/bin/kvfs`` or
``python -m cli``), ``python -m kvfs.bench.NAME`` or a ``scripts/*.py``. A fenced line is
a whole command: it must parse as it stands. An inline span is often a mention (```kvfs
pin --for 30m```, ```kvfs rm --data DIR```): its command must exist and every option it
names must be one of that command's, under its full name (argparse would take a prefix,
which stops working once another option shares it).

Deliberately not checked (a command the docs did not mean is worse than one not checked):

* placeholders where the command goes (``kvfs COMMAND``, ``kvfs bench <name>``): they
  stand for any command;
* what a command prints, which some blocks show under it: a benchmark's header
  (``kvfs bench store: 1 data dir(s), ...``), an error line (``kvfs ls: warning: ...``), a
  table's header (``kvfs  boto3 alone  ratio``, columns two spaces apart) and the legend
  under a table (``kvfs TTFT = ...``);
* other programs on the same line (``pip``, ``pytest``, ``nvidia-smi``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: docs/cli.md is generated from the parser itself (test_docs_match_the_real_help).
DOCS = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p.name != "cli.md"),
]
SHELL_FENCES = {"", "sh", "bash", "console", "shell", "ini"}

_PLACEHOLDER = "PLACEHOLDER"  # what an <angle-bracketed> placeholder is read as
_OUTPUT = [
    (re.compile(r"kvfs( [a-z-]+)*:"), "a line a command prints (its header or an error)"),
    (re.compile(r"kvfs {2}"), "a table's header"),
    (re.compile(r"kvfs [A-Z_.<]"), "a placeholder or a legend where the command goes"),
]
_CANDIDATE = re.compile(r"(^|[\s;&|])(\S*/)?(kvfs|python3?)(\s|$)|(^|\s)(\S*/)?scripts/\w+\.py")
_SPLIT = {";", "&&", "||", "|", "&", "(", ")"}
_REDIRECT = {">", ">>", "<", ">&", "&>", "<<", ">|"}


@dataclass(frozen=True)
class DocCommand:
    where: str  # "docs/mount.md:12"
    text: str
    whole: bool  # a fenced line (parse it) or an inline mention (check its names)


@dataclass(frozen=True)
class Invocation:
    program: str  # "kvfs", "kvfs.bench.gds" or "scripts/put_breakdown.py"
    args: tuple[str, ...]


def doc_commands() -> Iterator[DocCommand]:
    """Every fenced shell line and every inline code span of the docs (a span may break
    across lines of its paragraph), each with where it stands."""
    for name in DOCS:
        fence: str | None = None
        para: list[tuple[int, str]] = []
        pending = ""
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            s = line.strip()
            if s.startswith("```"):
                if fence is None:
                    yield from _spans(name, para)
                    fence = s[3:].strip()
                else:
                    fence = None
                continue
            if fence is None:
                if s:
                    para.append((n, line))
                else:
                    yield from _spans(name, para)
            elif fence in SHELL_FENCES:
                if s.endswith("\\"):  # a continued line
                    pending += s[:-1] + " "
                else:
                    yield DocCommand(f"{name}:{n}", pending + s, True)
                    pending = ""
        yield from _spans(name, para)


def _spans(name: str, para: list[tuple[int, str]]) -> Iterator[DocCommand]:
    text = "\n".join(line for _, line in para)
    for m in re.finditer(r"`([^`]+)`", text):
        n = para[0][0] + text.count("\n", 0, m.start())
        yield DocCommand(f"{name}:{n}", " ".join(m.group(1).split()), False)
    para.clear()


def invocations(cmd: DocCommand) -> list[Invocation] | str:
    """The kvfs, bench-module and script invocations in a doc command (a line may hold
    several, joined by ``;``, ``&&`` or pipes), or why it holds none to check."""
    text = re.sub(r"^Exec\w*=", "", cmd.text.replace("\\|", "|"))  # (a systemd unit's line)
    text = re.sub(r"^\$ ", "", text)
    text = re.sub(r"<[^<>]*>", _PLACEHOLDER, text)
    while (opt := re.search(r"\[(-[^\[\]]*)\]", text)) is not None:
        # usage brackets, `[--idle-workers [--idle-io]]`, `[--pages 2 | --mib 16]`: the
        # options in them are checked together (alternatives parse together too)
        text = text[: opt.start()] + opt.group(1).replace("|", " ") + text[opt.end() :]
    if not _CANDIDATE.search(text):
        return "no command of ours"
    for pattern, why in _OUTPUT:
        if pattern.match(text):
            return why
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    out: list[Invocation] = []
    simple: list[str] = []
    for tok in [*tokens, ";"]:
        if tok in _SPLIT:
            if (inv := _invocation(simple)) is not None:
                out.append(inv)
            simple = []
        else:
            simple.append(tok)
    return out or "no command of ours"


def _invocation(tokens: list[str]) -> Invocation | None:
    words: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in _REDIRECT:
            skip = True  # its target
        elif not words and (tok == "sudo" or re.fullmatch(r"[A-Za-z_]\w*=.*", tok)):
            pass  # environment assignments before the program
        else:
            words.append(tok)
    if not words:
        return None
    prog, rest = Path(words[0]).name, words[1:]
    if prog == "kvfs":
        return Invocation("kvfs", tuple(rest))
    if re.fullmatch(r"python3?(\.\d+)?", prog) and rest[:1] == ["-m"] and len(rest) > 1:
        if rest[1] == "cli":
            return Invocation("kvfs", tuple(rest[2:]))
        if rest[1].startswith("kvfs.bench."):
            return Invocation(rest[1], tuple(rest[2:]))
        return None
    if re.fullmatch(r"python3?(\.\d+)?", prog) and rest:
        words = rest
    if re.fullmatch(r"scripts/\w+\.py", words[0]):
        return Invocation(words[0], tuple(words[1:]))
    return None


def problems(cmd: DocCommand, inv: Invocation) -> str | None:
    """What is wrong with one invocation, or None: a command or option its parser does not
    have, or (for a whole command) the error its parser gives."""
    args = list(inv.args)
    if inv.program == "kvfs":
        from cli.__main__ import build_parser

        parser: argparse.ArgumentParser = build_parser()
    elif inv.program.startswith("kvfs.bench."):
        # `python -m kvfs.bench.NAME` runs the module's main, which parses as `kvfs bench NAME`
        module = importlib.import_module(inv.program)
        if not hasattr(module, "main"):
            return f"{inv.program} cannot be run with python -m (it has no main)"
        from cli.__main__ import build_parser

        parser = build_parser()
        args = ["bench", inv.program.rsplit(".", 1)[1], *args]
    else:
        if not (ROOT / inv.program).is_file():
            return f"{inv.program} does not exist"
        found = script_parser(ROOT / inv.program)
        if found is None:
            return f"{inv.program} takes no arguments" if args else None
        parser = found
    if (wrong := _wrong_names(parser, args)) is not None:
        return wrong
    if cmd.whole and not any(a == _PLACEHOLDER or a.isupper() for a in args):
        return _parse_error(parser, args)
    return None


def _wrong_names(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """The first command or option in ``args`` that ``parser`` lacks, under its full name."""
    p, i = parser, 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            return None
        if tok.startswith("-") and len(tok) > 1 and not re.fullmatch(r"-\d.*", tok):
            flag = tok.split("=", 1)[0]
            action = p._option_string_actions.get(flag)
            if action is None:
                return f"{p.prog} has no option {flag}"
            if "=" not in tok and action.nargs != 0:
                i += 1  # its value (one: the docs give several only as the last option)
            continue
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            continue  # a positional argument
        if tok == _PLACEHOLDER or tok == "..." or tok.isupper():
            return None  # any command (a placeholder)
        if tok not in sub.choices:
            return f"{p.prog} has no command {tok}"
        p = sub.choices[tok]
    return None


def _parse_error(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            parser.parse_args(args)
        except SystemExit as e:
            if e.code:
                return err.getvalue().strip().splitlines()[-1]
    return None


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parses(path: Path) -> bool:
    """Whether a script parses arguments: it calls ``parse_args`` itself, or calls a
    function of a module beside it (``from _memory import page_counts``) that does."""
    tree = ast.parse(path.read_text())
    called = {
        n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    if "parse_args" in called:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            sibling = path.parent / f"{node.module}.py"
            if not sibling.is_file():
                continue
            parsing = {
                f.name
                for f in ast.walk(ast.parse(sibling.read_text()))
                if isinstance(f, ast.FunctionDef) and "parse_args" in ast.unparse(f)
            }
            if any(a.name in parsing and (a.asname or a.name) in called for a in node.names):
                return True
    return False


def script_parser(path: Path) -> argparse.ArgumentParser | None:
    """The parser a script's ``main()`` builds, taken from it when it asks it to parse (so
    nothing of the script runs); None for a script that parses no arguments (it is not
    imported: its main would run)."""
    if not _parses(path):
        return None
    spec = importlib.util.spec_from_file_location(f"_doc_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # (as `python scripts/x.py` runs it: its own directory first on the path, where the
    # modules scripts share live, scripts/_memory.py)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))

    def caught(self: argparse.ArgumentParser, *_: object, **__: object) -> None:
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = caught  # type: ignore[method-assign,assignment]
    try:
        module.main()
    except _Parser as e:
        return e.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise AssertionError(f"{path}: main() returned without parsing its arguments")
