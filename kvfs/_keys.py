"""Page keys and their one mapping to paths.

A page is named by a relative POSIX path. Two families share one namespace:

* semantic keys ``sessions/<session>/<prefix>/<layer>``, built with :meth:`PageKey.semantic`;
  an integer layer ``n`` is spelled ``layer-NNN`` (zero-padded to three digits, so ``ls``
  sorts layers numerically for models up to 1000 layers);
* any other relative path an engine chooses (LMCache, vLLM and llm-d name their own files),
  built with :meth:`PageKey.from_path`.

A page's *session* is the directory that groups it for pin, spill and evict: the session
``<s>`` for semantic keys (its directory is ``sessions/<s>``), and the directory holding the
file for any other path (``.`` for files at the top level).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from ._errors import InvalidKey

__all__ = ["MAX_NAME_BYTES", "MAX_PATH_BYTES", "SESSIONS_DIR", "PageKey", "session_dir"]

SESSIONS_DIR = "sessions"
MAX_NAME_BYTES = 255  # NAME_MAX on Linux
MAX_PATH_BYTES = 1024
#: Names kvfs itself shows on the mount (``.kvfs.json``) and never accepts as pages.
RESERVED_PREFIX = ".kvfs"
_LAYER_RE = re.compile(r"^layer-(\d+)$")


def _check_part(part: str, what: str) -> str:
    if not isinstance(part, str):
        raise InvalidKey(f"{what} must be a string, not {type(part).__name__}")
    if part == "":
        raise InvalidKey(f"{what} is empty")
    if part in (".", ".."):
        raise InvalidKey(f"{what} may not be {part!r}")
    if "/" in part:
        raise InvalidKey(f"{what} {part!r} may not contain '/'")
    if "\x00" in part:
        raise InvalidKey(f"{what} {part!r} contains a NUL byte")
    try:
        n = len(part.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidKey(f"{what} {part!r} is not valid UTF-8") from e
    if n > MAX_NAME_BYTES:
        raise InvalidKey(f"{what} is {n} bytes long; the limit is {MAX_NAME_BYTES}")
    if part.startswith(RESERVED_PREFIX):
        raise InvalidKey(f"{what} {part!r}: names starting with {RESERVED_PREFIX!r} are reserved")
    return part


def layer_name(layer: int | str) -> str:
    """Spell a layer: ``17`` -> ``layer-017``; a string is taken as the name itself."""
    if isinstance(layer, bool):
        raise InvalidKey("layer must be an int or a name, not a bool")
    if not isinstance(layer, str) and hasattr(layer, "__index__"):
        layer = operator.index(layer)  # numpy's integers too (a loop over a tensor's layers)
    if isinstance(layer, int):
        if layer < 0:
            raise InvalidKey(f"layer index {layer} is negative")
        return f"layer-{layer:03d}"
    if not isinstance(layer, str):
        raise InvalidKey(f"layer must be an int or a name, not {type(layer).__name__}")
    return _check_part(layer, "layer")


def split_path(path: str) -> tuple[str, ...]:
    """Validate a relative page path and return its parts. Leading/trailing '/' are rejected."""
    if not isinstance(path, str):
        raise InvalidKey(f"path must be a string, not {type(path).__name__}")
    if path == "":
        raise InvalidKey("path is empty")
    if path.startswith("/"):
        raise InvalidKey(f"path {path!r} must be relative to the store root")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidKey(f"path is longer than {MAX_PATH_BYTES} bytes")
    parts = tuple(path.split("/"))
    for p in parts:
        _check_part(p, f"path {path!r}: component")
    return parts


def session_dir(session: str) -> str:
    """The directory of a session: ``agent-42`` -> ``sessions/agent-42``; a path stays itself.

    A name without '/' is a semantic session. A name with '/' (or ``.``) is the directory
    holding engine-named pages. ``sessions/<s>`` is accepted too and means the semantic one.
    """
    if not isinstance(session, str):
        raise InvalidKey(f"session must be a string, not {type(session).__name__}")
    if session.rstrip("/") == ".":  # ("./" too, as "lmcache/" is lmcache)
        return "."
    if "/" not in session:
        _check_part(session, "session")
        return f"{SESSIONS_DIR}/{session}"
    parts = split_path(session.rstrip("/"))
    if parts[0] == SESSIONS_DIR and len(parts) != 2:
        raise InvalidKey(f"{session!r}: a session under {SESSIONS_DIR}/ is sessions/<name>")
    return "/".join(parts)


def check_list_filter(session: str | None, prefix: str | None, path_prefix: str | None) -> None:
    """Raise InvalidKey unless ``list`` can take these: a session name (:func:`session_dir`),
    a prefix as :meth:`PageKey.semantic` takes one, a path prefix that is text (any start of
    a path: ``lmcache/model@``)."""
    if session is not None:
        session_dir(session)
    if prefix is not None:
        _check_part(prefix, "prefix")
    if path_prefix is not None:
        if not isinstance(path_prefix, str):
            raise InvalidKey(f"path_prefix must be a string, not {type(path_prefix).__name__}")
        try:
            path_prefix.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidKey(f"path prefix {path_prefix!r} is not valid UTF-8") from e


def session_name(d: str) -> str:
    """What a user calls the session in directory ``d``: ``sessions/agent-42`` ->
    ``agent-42``; an engine directory is its own name (as ``kvfs ls`` shows both)."""
    prefix = f"{SESSIONS_DIR}/"
    return d[len(prefix) :] if d.startswith(prefix) else d


@dataclass(frozen=True, order=True, slots=True)
class PageKey:
    """The validated name of a page. Build with :meth:`semantic` or :meth:`from_path` (or
    ``PageKey(path)``, which checks the same). Raises :class:`InvalidKey`."""

    path: str

    def __post_init__(self) -> None:
        # Every key is checked where it is made, ``PageKey("../x")`` included: a key held
        # is a valid key, in-process as through the daemon.
        parts = split_path(self.path)
        if parts[0] == SESSIONS_DIR and len(parts) != 4:
            raise InvalidKey(
                f"{self.path!r}: pages under {SESSIONS_DIR}/ are named "
                f"{SESSIONS_DIR}/<session>/<prefix>/<layer>"
            )

    @classmethod
    def semantic(cls, session: str, prefix: str, layer: int | str) -> PageKey:
        """Key for (session, prefix, layer). Raises :class:`InvalidKey` on a bad part."""
        s = _check_part(session, "session")
        p = _check_part(prefix, "prefix")
        return cls(f"{SESSIONS_DIR}/{s}/{p}/{layer_name(layer)}")

    @classmethod
    def from_path(cls, path: str | PageKey) -> PageKey:
        """Key for a relative path. Under ``sessions/`` only ``sessions/<s>/<prefix>/<layer>``."""
        return path if isinstance(path, PageKey) else cls(path)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.path.split("/"))

    @property
    def is_semantic(self) -> bool:
        return self.path.startswith(SESSIONS_DIR + "/")

    @property
    def session_dir(self) -> str:
        """The directory that is this page's session (see the module docstring)."""
        parts = self.parts
        if self.is_semantic:
            return "/".join(parts[:2])
        return "/".join(parts[:-1]) or "."

    @property
    def session(self) -> str:
        """User-facing session name: ``agent-42`` for semantic keys, the directory otherwise."""
        return self.parts[1] if self.is_semantic else self.session_dir

    @property
    def prefix(self) -> str | None:
        return self.parts[2] if self.is_semantic else None

    @property
    def layer(self) -> str | None:
        return self.parts[3] if self.is_semantic else None

    @property
    def layer_index(self) -> int | None:
        """The integer layer of a semantic key spelled ``layer-NNN``, else None."""
        if not self.is_semantic:
            return None
        m = _LAYER_RE.match(self.parts[3])
        return int(m.group(1)) if m else None

    def __str__(self) -> str:
        return self.path


def as_key(key: PageKey | str) -> PageKey:
    return key if isinstance(key, PageKey) else PageKey.from_path(key)
