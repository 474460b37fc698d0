"""The mount's namespace: which names exist, as seen from the index and the mount's own table.

Blocking helpers (SQLite reads) called from worker threads by :mod:`kvfs._fuse`. What exists:

* pages: every row of the index, under its own path;
* directories: implicit ones (``sessions``, every session directory, every directory above a
  page) and explicit ones made with ``mkdir`` (kept in :class:`~kvfs._dirs.DirTable`, so an
  empty directory survives a remount). An implicit directory disappears with its last page;
* ``sessions/<s>/.kvfs.json``: a read-only view of the session's metadata.

Files being written are not here: they live in the operations object until their writer
closes them (see :mod:`kvfs._fuse`).
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass

from ._dirs import DirTable
from ._engine import Engine
from ._errors import InvalidKey, SessionNotFound
from ._index import PageRow
from ._keys import SESSIONS_DIR, PageKey, split_path
from ._types import SessionInfo
from ._writes import ATTR_MODE, RESERVED_ATTRS

__all__ = [
    "META_NAME",
    "Listing",
    "attr_int",
    "child_path",
    "dir_exists",
    "is_session_dir",
    "list_dir",
    "own_attrs",
    "parent_of",
    "session_json",
    "session_of",
    "validate_dir",
    "validate_page",
]

#: The read-only metadata file in every semantic session directory.
META_NAME = ".kvfs.json"


def own_attrs(attrs: dict[str, str]) -> dict[str, str]:
    """A page's attributes but for the mount's own (mode, owner, mtime)."""
    return {k: v for k, v in attrs.items() if not k.startswith(RESERVED_ATTRS)}


def child_path(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def parent_of(path: str) -> str:
    """The directory holding ``path`` ("" for the mount's root)."""
    return path.rpartition("/")[0]


def _depth_under_sessions(path: str) -> int | None:
    parts = path.split("/")
    return len(parts) if parts[0] == SESSIONS_DIR else None


def validate_page(path: str) -> PageKey:
    """The key a file at ``path`` would be. Raises InvalidKey (bad name, wrong depth)."""
    return PageKey.from_path(path)


def validate_dir(path: str) -> None:
    """Raise InvalidKey unless a directory may be made at ``path``: valid names, and under
    ``sessions/`` only ``sessions/<s>`` and ``sessions/<s>/<prefix>`` (pages sit one below)."""
    split_path(path)
    depth = _depth_under_sessions(path)
    if depth is not None and depth > 3:
        raise InvalidKey(
            f"{path!r}: directories under {SESSIONS_DIR}/ are "
            f"{SESSIONS_DIR}/<session>/<prefix>; layers are files"
        )


def dir_exists(engine: Engine, dirs: DirTable, path: str) -> bool:
    """Whether ``path`` is a directory now (the root and ``sessions`` always are)."""
    if path in ("", SESSIONS_DIR) or dirs.get(path) is not None or dirs.has_under(path):
        return True
    if path.startswith(SESSIONS_DIR + "/") and path.count("/") > 2:
        return False
    if engine.index.session(path) is not None:
        return True
    return bool(engine.index.pages(path_prefix=path + "/", limit=1))


@dataclass(slots=True)
class Listing:
    """A directory's entries: sub-directory names, pages by name, and whether it has the
    session metadata file."""

    dirs: set[str]
    pages: dict[str, PageRow]
    meta: bool


def list_dir(engine: Engine, dirs: DirTable, path: str) -> Listing:
    """Entries of directory ``path`` (blocking: index reads)."""
    out = Listing(set(dirs.children(path)), {}, False)
    parts = path.split("/") if path else []
    idx = engine.index
    if not parts:
        out.dirs.add(SESSIONS_DIR)
        for s in idx.sessions():
            if s.dir != ".":
                out.dirs.add(s.dir.split("/", 1)[0])
        rows = idx.pages(session=".")
    elif parts[0] == SESSIONS_DIR and len(parts) == 1:
        out.dirs.update(
            s.dir.split("/")[1] for s in idx.sessions() if s.dir.startswith(SESSIONS_DIR + "/")
        )
        rows = []
    elif parts[0] == SESSIONS_DIR and len(parts) == 2:
        out.meta = idx.session(path) is not None
        out.dirs.update(p.path.split("/")[2] for p in idx.pages(session=path))
        rows = []
    elif parts[0] == SESSIONS_DIR:
        rows = idx.pages(path_prefix=path + "/")
    else:
        pre = path + "/"
        out.dirs.update(
            s.dir[len(pre) :].split("/", 1)[0] for s in idx.sessions() if s.dir.startswith(pre)
        )
        rows = idx.pages(session=path)
    for r in rows:
        out.pages[r.path.rsplit("/", 1)[-1]] = r
    return out


def session_json(engine: Engine, session_path: str) -> bytes:
    """The contents of ``sessions/<s>/.kvfs.json`` (a session with no pages left, gone
    from the index, shows as empty)."""
    try:
        info = engine.session_info(session_path)
    except SessionNotFound:
        name = session_path.split("/", 1)[1]
        info = SessionInfo(name, session_path, 0.0, 0.0, False, {}, 0, 0, 0, 0)
    doc = {
        "session": info.session,
        "dir": info.dir,
        "model": info.model,
        "pinned": info.pinned,
        "pin_until": info.pin_until,
        "pages": info.pages,
        "bytes": info.bytes,
        "local_bytes": info.local_bytes,
        "archived_bytes": info.archived_bytes,
        "created": info.created,
        "atime": info.atime,
        "attrs": info.attrs,
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def attr_int(attrs: dict[str, str], name: str, default: int) -> int:
    """A number the mount keeps in a page attribute (owner, mtime), else ``default``: a
    page another kvfs put with a bad one still stats, as its whole directory lists."""
    try:
        return int(attrs[name])
    except (KeyError, ValueError):
        return default


def page_mode(row: PageRow) -> int:
    """st_mode of a committed page: what chmod set on the mount, else r--r--r--."""
    try:
        return stat.S_IFREG | (int(row.attrs[ATTR_MODE], 8) & 0o7777)
    except (KeyError, ValueError):
        return stat.S_IFREG | 0o444


def is_session_dir(path: str) -> bool:
    """``sessions/<s>``: the directory that shows ``.kvfs.json``."""
    return path.startswith(SESSIONS_DIR + "/") and path.count("/") == 1


def session_of(meta_path: str) -> str:
    return meta_path.rsplit("/", 1)[0]
