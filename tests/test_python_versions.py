"""kvfs runs on every Python its pyproject claims (``requires-python``), not only on the one
the dev venv has.

The full proof is the suite under that Python (``make test-python PYTHON=python3.10``). What
runs here is the cheap part of it that any interpreter can check: the oldest claimed
Python's grammar, and that every name the packages use from the standard library exists in
that Python.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvfs", "objectstore", "gds", "cli")


def oldest_claimed() -> tuple[int, int]:
    """The lowest Python pyproject's ``requires-python = ">=X.Y"`` allows."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text, re.MULTILINE)
    assert m, 'pyproject.toml has no requires-python = ">=X.Y"'
    return int(m[1]), int(m[2])


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_parses_as_the_oldest_claimed_python_s_grammar() -> None:
    """A newer syntax (``except*``, ``type X = ...``, ``def f[T]()``) is a SyntaxError at
    import on the older Python. ast's feature_version is CPython's best effort at this (ruff's
    target-version checks it too, but only where lint runs)."""
    oldest = oldest_claimed()
    for path in sources():
        ast.parse(path.read_text(), str(path), feature_version=oldest)


def _version_dependent(node: ast.If) -> bool:
    """``if sys.version_info ...`` (each branch for the Pythons it is written for) or
    ``if TYPE_CHECKING`` (never run)."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == "version_info" for n in ast.walk(node.test)
    ) or (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those under a version-dependent ``if``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _version_dependent(node):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but a chain of names."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else [*head, node.attr]
    return None


def stdlib_uses(path: Path) -> set[str]:
    """The standard library's modules and names that ``path`` uses, dotted: what it imports
    (``tomllib``, ``typing.Self``) and the attributes it reads from those
    (``sqlite3.SQLITE_FULL``, ``pathlib.Path.walk``). Attributes of a value (``p.walk()``)
    are out of its sight; mypy, whose python_version is the oldest claimed, looks at those."""
    tree = ast.parse(path.read_text(), str(path))
    stdlib = sys.stdlib_module_names
    bound: dict[str, str] = {}  # local name -> the dotted standard-library name it is
    uses: set[str] = set()
    nodes = list(_nodes(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in stdlib:
                    uses.add(a.name)
                    local = a.asname or a.name.split(".")[0]
                    bound[local] = a.name if a.asname else local
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in stdlib
        ):
            for a in node.names:
                uses.add(f"{node.module}.{a.name}")
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            parts = _dotted(node)
            if parts and parts[0] in bound:
                uses.add(".".join([bound[parts[0]], *parts[1:]]))
    return uses


# Run by each interpreter, with no site-packages: the dotted names of stdin it cannot find.
PROBE = r"""
import importlib, json, sys

def found(dotted):
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], 2):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
        return False
    return True

print(json.dumps([d for d in json.load(sys.stdin) if not found(d)]))
"""


def not_found(python: str, names: list[str]) -> set[str]:
    out = subprocess.run(
        [python, "-I", "-S", "-c", PROBE],
        input=json.dumps(names),
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(out.stdout))


def interpreter(version: tuple[int, int]) -> tuple[str | None, str]:
    """A working ``python3.Y`` for ``version``, from $KVFS_OLDEST_PYTHON, PATH or pyenv; or
    None and why there is none."""
    exe = f"python{version[0]}.{version[1]}"
    pyenv = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    candidates = [
        os.environ.get("KVFS_OLDEST_PYTHON"),
        shutil.which(exe),
        *map(str, sorted(pyenv.glob(f"versions/{version[0]}.{version[1]}.*/bin/{exe}"))),
    ]
    tried = []
    for c in filter(None, candidates):
        r = subprocess.run(
            [c, "-I", "-S", "-c", "import sys; print(tuple(sys.version_info[:2]))"],
            capture_output=True,
            text=True,
        )
        if r.returncode == 0 and r.stdout.strip() == str(version):
            return c, ""
        said = (r.stdout or r.stderr).strip().splitlines()
        tried.append(f"{c} ({said[0] if said else f'exit {r.returncode}'})")
    return None, (
        f"no working {exe} (tried: {', '.join(tried) or 'none on PATH, none in pyenv'}); "
        f"set KVFS_OLDEST_PYTHON to one to run this check"
    )


def test_every_standard_library_name_used_exists_in_the_oldest_claimed_python() -> None:
    """kvfs imported tomllib (new in 3.11) and read sqlite3.SQLITE_FULL (3.11) while claiming
    3.10: ``import kvfs`` there failed, and so did opening a store on a full disk. The dev
    venv's Python cannot tell what an older one lacks (3.11 has no list of 3.10's modules and
    their names, and a list kept here would be one more thing to keep right), so the oldest
    claimed Python itself is asked, bare (no venv or packages needed: only its standard
    library is looked at). Where none is installed this skips, saying so; the names that
    not even this Python finds are left out (a local that shadows a module's name)."""
    oldest = oldest_claimed()
    python, why = interpreter(oldest)
    if python is None:
        pytest.skip(why)
    uses: dict[str, set[Path]] = {}
    for path in sources():
        for name in stdlib_uses(path):
            uses.setdefault(name, set()).add(path.relative_to(ROOT))
    assert "sqlite3.OperationalError" in uses  # (the collector sees what it should)
    names = sorted(uses)
    missing = not_found(python, names) - not_found(sys.executable, names)
    assert not missing, {
        name: sorted(map(str, uses[name])) for name in sorted(missing)
    }  # guard each with `if sys.version_info >= ...` and a fallback, or do without
