"""Settings: the embedded defaults, one TOML file, environment variables, then flags.

Each layer overrides the one before it, option by option::

    defaults  <  TOML file (--config FILE or $KVFS_CONFIG)  <  $KVFS_<OPTION>  <  flags

The embedded default needs no file: data in ``./kvfs-data``, archive in ``./kvfs-archive``
through ``file://``. Every option is listed in :data:`OPTIONS` (docs/configuration.md is
checked against it). Secrets (``*_secret*``, ``*password*``, credentials in URLs) are masked
by :func:`masked`.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib is new in 3.11; tomli is the same parser under another name
    import tomli as tomllib

from ._config import DISK_CAPACITY, StoreConfig, parse_duration, parse_size

__all__ = [
    "ARCHIVE_FIELDS",
    "OPTIONS",
    "Option",
    "Settings",
    "as_toml",
    "closest",
    "config_socket_path",
    "control_socket_path",
    "load_settings",
    "masked",
    "private_dir",
    "runtime_dir",
]


@dataclass(frozen=True)
class Option:
    """One setting: its TOML ``section.name``, its environment variable, default and meaning."""

    section: str
    name: str
    kind: str  # "str", "int", "float", "size", "duration", "bool", "paths"
    default: object
    help: str
    #: the smallest and largest value a number may take (None: any)
    limits: tuple[float, float] | None = None

    @property
    def env(self) -> str:
        return "KVFS_" + self.name.upper()

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


# Counts and seconds below these are nonsense that was taken: archive_concurrency = 0 failed
# the open with "max_workers must be greater than 0", a negative metrics_sessions left the
# smallest sessions out of their own series, a negative number of seconds was a typo taken
# for 0 (idle_seconds, gc_grace, spill_interval) or told without the variable (retention)
_AT_LEAST_0 = (0, math.inf)
_AT_LEAST_1 = (1, math.inf)

#: Every option, in the order docs/configuration.md lists them.
OPTIONS: tuple[Option, ...] = (
    Option(
        "store",
        "data_dirs",
        "paths",
        ["kvfs-data"],
        "data directories, one per NVMe device; pages are striped across them",
    ),
    Option(
        "store",
        "capacity",
        "size",
        0,
        "cap on bytes held locally, kept with the store: an open that gives none (0) keeps to the last one given, or with none ever given takes what the disks hold (their free space at open, each file system counted once, less 1% (64 MiB at least) each for the index); disk: what the disks hold, the kept cap forgotten",
    ),
    Option(
        "store",
        "stripe_unit",
        "size",
        4 * 1024 * 1024,
        "pages larger than this are split round-robin across devices (multiple of 4 KiB)",
    ),
    Option("store", "index_dir", "str", "", "where the SQLite index lives (empty: first data dir)"),
    Option("store", "direct_io", "bool", True, "read and write with O_DIRECT where possible"),
    Option("store", "durable", "bool", True, "fsync data and index before a put returns"),
    Option("store", "io_threads", "int", 8, "worker threads for disk I/O and hashing", _AT_LEAST_1),
    Option(
        "archive",
        "archive_url",
        "str",
        "auto",
        "archive tier: file://DIR or s3://BUCKET[/PREFIX]; empty: no archive tier; auto: "
        "file://kvfs-archive beside the default ./kvfs-data when data_dirs is not "
        "configured, no archive tier when it is (a relative file:// path is taken from "
        "the current directory)",
    ),
    Option(
        "archive",
        "idle_seconds",
        "float",
        300.0,
        "a session untouched this long is cold: the background spiller may spill it",
        _AT_LEAST_0,
    ),
    Option(
        "archive",
        "high_watermark",
        "float",
        0.90,
        "fraction of the capacity above which cold unpinned sessions spill, coldest first",
        (0, 1),
    ),
    Option(
        "archive",
        "low_watermark",
        "float",
        0.75,
        "fraction of the capacity they spill down to",
        (0, 1),
    ),
    Option(
        "archive",
        "spill_interval",
        "float",
        1.0,
        "seconds between background spill passes (0: no background spiller)",
        _AT_LEAST_0,
    ),
    Option(
        "archive",
        "zstd_level",
        "int",
        1,
        "zstd level for spilled pages (1-19; 1 compresses byte-shuffled KV about as well as 3)",
        (1, 19),
    ),
    Option(
        "archive",
        "codec",
        "str",
        "auto",
        "auto (byte-shuffle + zstd or zstd alone, whichever is smaller on a sample), zstd, "
        "zstd+shuffle or raw",
    ),
    Option(
        "archive",
        "archive_concurrency",
        "int",
        8,
        "objects uploaded or downloaded at once per spill or restore (with at most 512 MiB "
        "of their pages in memory per process: a larger page goes alone)",
        _AT_LEAST_1,
    ),
    Option(
        "archive",
        "upload_processes",
        "int",
        2,
        "worker processes that spill and restore outside the daemon (0: its own threads)",
        _AT_LEAST_0,
    ),
    Option(
        "archive",
        "gc_grace",
        "float",
        0.0,
        "seconds a deleted page's archive object waits before removal (hosts sharing a bucket)",
        _AT_LEAST_0,
    ),
    Option(
        "archive",
        "evict_ahead",
        "size",
        64 << 20,
        "bytes a put that must make room evicts beyond its need (at most capacity / 8), so "
        "uploads and manifest rewrites are paid per batch, not per put",
    ),
    Option(
        "archive",
        "gc_window",
        "float",
        300.0,
        "seconds that bound one deletion pass over archive objects: it stops deleting after "
        "half of it, and other hosts wait at most this long for one a crash left unfinished",
        _AT_LEAST_0,
    ),
    Option(
        "archive",
        "memory_copies",
        "size",
        256 << 20,
        "bytes of archive-only pages held in memory to serve reads when the local tier has "
        "no room for them (its capacity held by pinned pages, open files or writes in flight), "
        "and archived pages whose local copy's disk fails",
    ),
    Option(
        "archive",
        "retention",
        "duration",
        0.0,
        "a session untouched this long is deleted from every tier, this host's and the "
        "archive's (seconds, or 30m, 12h, 7d); pinned sessions and sessions holding a pinned "
        "page are kept; 0: keep every session until it is deleted",
        _AT_LEAST_0,
    ),
    Option(
        "daemon",
        "control_socket",
        "str",
        "",
        "the control channel's Unix socket (empty: kvfs.sock beside the index, or a "
        "per-user runtime path when that is too long)",
    ),
    Option(
        "daemon",
        "metrics_port",
        "int",
        0,
        "serve Prometheus metrics on this TCP port (0: off)",
        (0, 65535),
    ),
    Option("daemon", "metrics_address", "str", "127.0.0.1", "address the metrics port binds"),
    Option(
        "daemon",
        "metrics_sessions",
        "int",
        20,
        "per-session metrics for at most this many sessions (largest first; the rest "
        'summed as session="_other")',
        _AT_LEAST_0,
    ),
    Option("daemon", "log_level", "str", "info", "debug, info, warning or error"),
    Option("daemon", "log_target", "str", "stderr", "stderr or journald"),
)

_BY_NAME = {o.name: o for o in OPTIONS}
#: archive options -> their ``StoreConfig.extra["archive"]`` names (kvfs._archive.ArchiveConfig)
ARCHIVE_FIELDS = {
    o.name: {"spill_interval": "interval", "archive_concurrency": "concurrency"}.get(o.name, o.name)
    for o in OPTIONS
    if o.section == "archive" and o.name != "archive_url"
}
_TRUE = {"1", "true", "yes", "on"}
#: (not ""): a ``KVFS_DURABLE=`` left empty, by a unit file's unset ``${VAR}`` say, turned
#: the fsyncs off without a word
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """The effective settings and where each value came from."""

    values: dict[str, object]
    sources: dict[str, str] = field(default_factory=dict)
    config_file: Path | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def store_config(self) -> StoreConfig:
        """The :class:`StoreConfig` these settings describe. Raises ValueError when invalid."""
        from ._archive import ArchiveConfig

        v = self.values
        cfg = StoreConfig(
            data_dirs=tuple(Path(d) for d in v["data_dirs"]),  # type: ignore[attr-defined]
            capacity=DISK_CAPACITY if v["capacity"] == DISK else int(str(v["capacity"])),
            stripe_unit=int(v["stripe_unit"]),  # type: ignore[call-overload]
            index_dir=Path(str(v["index_dir"])) if v["index_dir"] else None,
            direct_io=bool(v["direct_io"]),
            durable=bool(v["durable"]),
            io_threads=int(v["io_threads"]),  # type: ignore[call-overload]
            archive_url=self.archive_url(),
            extra={
                "archive": {field: v[name] for name, field in ARCHIVE_FIELDS.items()},
                "daemon": {
                    k: v[k]
                    for k in (
                        "control_socket",
                        "metrics_port",
                        "metrics_address",
                        "metrics_sessions",
                        "log_level",
                        "log_target",
                    )
                },
            },
        )
        ArchiveConfig.from_extra(cfg.extra)  # the archive settings' combination (watermarks)
        if cfg.archive_url:
            from objectstore import parse_url

            parse_url(cfg.archive_url)  # a bad one is told before a daemon detaches
        if v["retention"] and not cfg.archive_url:
            raise ValueError(
                "archive.retention deletes sessions from the archive tier, and none is "
                "configured (archive.archive_url is empty): set one, or leave retention at 0"
            )
        return cfg

    def archive_url(self) -> str:
        """The archive URL with ``auto`` resolved and a relative ``file://`` made absolute."""
        url = str(self.values["archive_url"])
        if url == "auto":
            url = "file://kvfs-archive" if self.sources["data_dirs"] == "default" else ""
        return _absolute_file_url(url)

    def socket_path(self) -> Path:
        """The control socket of the daemon that owns this data directory."""
        return control_socket_path(self.store_config(), str(self.values["control_socket"]))


def _absolute_file_url(url: str) -> str:
    if url.startswith("file://") and not url.startswith("file:///"):
        rest = url[len("file://") :]
        host, slash, path = rest.partition("/")
        if slash and host.lower() == "localhost":
            # RFC 8089's file://localhost/DIR is file:///DIR, as the archive opens it (it was
            # made the relative localhost/DIR under the working directory here)
            return "file:///" + path
        return "file://" + os.path.abspath(rest)
    return url


def _convert(opt: Option, raw: object, where: str) -> object:
    if opt.name == "capacity" and isinstance(raw, str) and raw.strip().lower() == DISK:
        return DISK  # (kept as the word: kvfs config shows it as given)
    value = _convert_kind(opt, raw, where)
    if opt.limits is not None and isinstance(value, (int, float)):
        lo, hi = opt.limits
        if not lo <= value <= hi:
            need = f"at least {lo:g}" if hi == math.inf else f"from {lo:g} to {hi:g}"
            raise ValueError(f"{where}: bad value {raw!r} for {opt.key}: {need} is needed")
    if opt.name == "capacity" and 0 < value < MIN_CAPACITY:  # type: ignore[operator]
        raise ValueError(
            f"{where}: bad value {raw!r} for {opt.key}: 0 (the one kept with the store), "
            f"{DISK} (what the disks hold) or at least 1MiB is needed"
        )
    return value


#: the smallest capacity cap a setting may give (a smaller one holds no useful KV page)
MIN_CAPACITY = 1 << 20
#: the capacity setting meaning what the disks hold, the cap kept with the store forgotten
DISK = "disk"


def _convert_kind(opt: Option, raw: object, where: str) -> object:
    try:
        if opt.kind == "paths":
            # (an empty one, KVFS_DATA_DIRS="" say, was taken and refused later without
            # a word of where it came from)
            if isinstance(raw, str) and raw.replace(",", "").strip():
                return [p.strip() for p in raw.split(",") if p.strip()]
            if isinstance(raw, list) and all(isinstance(p, str) for p in raw) and raw:
                return list(raw)
            raise ValueError("a list of directories is needed")
        if opt.kind == "size":
            return parse_size(raw if isinstance(raw, (int, str)) else str(raw))
        if opt.kind == "duration":
            if isinstance(raw, bool):
                raise ValueError("a duration is needed")
            seconds = parse_duration(raw)  # type: ignore[arg-type]
            if math.isnan(seconds):  # (TOML's nan: a comparison with it is always false)
                raise ValueError("a duration is needed")
            return seconds
        if opt.kind == "int":
            # (int() truncated a TOML float: io_threads = 2.5 was 2, metrics_port = 80.9 was 80)
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("an integer is needed")
            try:
                return int(raw)  # type: ignore[call-overload]
            except ValueError:  # (not "invalid literal for int() with base 10")
                raise ValueError("an integer is needed") from None
        if opt.kind == "float":
            try:
                number = math.nan if isinstance(raw, bool) else float(raw)  # type: ignore[arg-type]
            except ValueError:  # (not "could not convert string to float")
                number = math.nan
            if math.isnan(number):  # "nan" made the background spiller's sleep raise
                raise ValueError("a number is needed")
            return number
        if opt.kind == "bool":
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in _TRUE or s in _FALSE:
                return s in _TRUE
            raise ValueError("true or false is needed")
        if not isinstance(raw, str):
            raise ValueError("a string is needed")
        if opt.name == "log_level" and raw.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("one of debug, info, warning, error is needed")
        if opt.name == "codec":
            from ._codec import CODECS  # here: zstandard stays out of every command's start

            if raw not in ("auto", *CODECS):
                raise ValueError(f"one of auto, {', '.join(CODECS)} is needed")
        if opt.name == "log_target" and raw not in ("stderr", "journald"):
            raise ValueError("stderr or journald is needed")
        return raw
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: bad value {raw!r} for {opt.key}: {e}") from None


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> Settings:
    """Merge defaults, the TOML file, ``KVFS_*`` variables and ``flags`` (None = not given).

    The file is ``config_file``, else ``$KVFS_CONFIG``, else none. Raises ValueError for an
    unknown option or section, a value of the wrong kind, TOML that does not parse, or a
    named file that does not exist.
    """
    env = os.environ if env is None else env
    values: dict[str, object] = {o.name: o.default for o in OPTIONS}
    sources = {o.name: "default" for o in OPTIONS}
    path = config_file or env.get("KVFS_CONFIG") or None
    cfg_path = Path(path) if path else None
    if cfg_path is not None:
        try:
            text = cfg_path.read_text()
        except FileNotFoundError:
            via = "" if config_file else " ($KVFS_CONFIG)"
            raise ValueError(f"configuration file {cfg_path}{via} does not exist") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{cfg_path}: {e}") from None
        for section, table in doc.items():
            if not isinstance(table, dict) and section in _BY_NAME:
                # (it was "unknown section [capacity]": an option above every [section])
                raise ValueError(
                    f"{cfg_path}: option {section} outside its section "
                    f"(under [{_BY_NAME[section].section}])"
                )
            if not isinstance(table, dict) or section not in {o.section for o in OPTIONS}:
                raise ValueError(
                    f"{cfg_path}: unknown section [{section}] (sections: store, archive, daemon)"
                )
            for name, raw in table.items():
                opt = _BY_NAME.get(name)
                if opt is None or opt.section != section:
                    # the one meant: an option of another section, or a misspelling
                    meant = opt or _BY_NAME.get(closest(name, _BY_NAME) or "")
                    hint = f" ({meant.key}?)" if meant else ""
                    raise ValueError(f"{cfg_path}: unknown option {section}.{name}{hint}")
                values[name] = _convert(opt, raw, str(cfg_path))
                sources[name] = str(cfg_path)
    given = {k for k, v in (flags or {}).items() if v is not None}
    for opt in OPTIONS:
        # (a variable a flag overrides is not read: an empty KVFS_DATA_DIRS, refused, made
        # `--data d kvfs ...` and a command on a mount fail, though it was not used)
        if opt.env in env and opt.name not in given:
            values[opt.name] = _convert(opt, env[opt.env], f"${opt.env}")
            sources[opt.name] = f"${opt.env}"
    for name, raw in (flags or {}).items():
        if raw is None:
            continue
        opt = _BY_NAME.get(name)
        if opt is None:
            raise ValueError(f"unknown option {name}")
        values[name] = _convert(opt, raw, "command line")
        sources[name] = "flag"
    return Settings(values, sources, cfg_path)


#: ``KVFS_*`` variables that are not options: read elsewhere (the test suite's knob too),
#: never misspelt settings
_OTHER_ENV = {"KVFS_CONFIG", "KVFS_READY_FD", "KVFS_LOG_FD", "KVFS_CHAOS_SECONDS"}


def unknown_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``KVFS_*`` variable that is no setting (a typo is ignored, as an
    unknown TOML option is not), naming the one meant where it is close."""
    env = os.environ if env is None else env
    known = {o.env for o in OPTIONS} | _OTHER_ENV
    out = []
    for name in sorted(k for k in env if k.startswith("KVFS_") and k not in known):
        near = closest(name, known)
        out.append(f"${name} is no kvfs setting: ignored" + (f" (${near}?)" if near else ""))
    return out


def closest(name: str, known: Iterable[str]) -> str | None:
    """The name of ``known`` that ``name`` is most likely a misspelling of, if any is close."""
    near = difflib.get_close_matches(name, sorted(known), n=1)
    return near[0] if near else None


_SECRET = re.compile(r"secret|password|token|credential", re.I)
_URL_CREDS = re.compile(r"(?P<scheme>[a-z0-9+]+://)(?P<creds>[^/@]+)@", re.I)


def masked(name: str, value: object) -> object:
    """``value`` with secrets replaced by ``***``: secret-named options, credentials in URLs
    (``s3://KEY:SECRET@bucket``) and secret query parameters."""
    if _SECRET.search(name) and value:
        return "***"
    if isinstance(value, str):
        value = _URL_CREDS.sub(lambda m: f"{m['scheme']}***@", value)
        value = re.sub(
            r"((?:secret|password|token|credential)[a-z_]*=)[^&]*", r"\1***", value, flags=re.I
        )
    return value


def config_socket_path(config: StoreConfig) -> Path:
    """The control socket of a daemon serving ``config`` (its ``extra['daemon']
    ['control_socket']``, else :func:`control_socket_path`'s default)."""
    daemon = config.extra.get("daemon") or {}
    explicit = str(daemon.get("control_socket") or "") if isinstance(daemon, dict) else ""
    return control_socket_path(config, explicit)


def control_socket_path(config: StoreConfig, explicit: str = "") -> Path:
    """The control socket for ``config``'s data: ``explicit`` if given, else ``kvfs.sock``
    beside the lock file, or, when that path is too long for a Unix socket, a per-user
    runtime path named by a hash of the lock file's path."""
    if explicit:
        return Path(explicit)
    beside = config.lock_path.parent.absolute() / "kvfs.sock"
    if len(os.fsencode(beside)) < 100:
        return beside
    digest = hashlib.sha1(os.fsencode(config.lock_path.absolute())).hexdigest()[:16]
    return runtime_dir() / f"ctl-{digest}.sock"


def runtime_dir() -> Path:
    """The directory of daemon state files (``mount-<hash>.json``) and fallback control
    sockets: ``/run/kvfs`` for root, ``/tmp/kvfs-<uid>`` for other users. It is the same for
    every process of a user whatever its environment (a daemon started by systemd and a
    shell's ``kvfs umount`` find each other). Made mode 0700 if missing.

    Raises PermissionError where it is no directory of this user's or others may write it:
    another local user who made it first could plant a state file (``kvfs umount`` would
    signal the pid in it) or a socket posing as the daemon.
    """
    uid = os.getuid()
    path = Path("/run/kvfs") if uid == 0 and os.path.isdir("/run") else Path(f"/tmp/kvfs-{uid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return private_dir(path)


def private_dir(path: Path) -> Path:
    """``path`` if it is a directory (not a link) owned by this user that no other user
    may write; raises PermissionError naming what is wrong otherwise."""
    st = os.lstat(path)
    why = (
        "is no directory"
        if not stat.S_ISDIR(st.st_mode)
        else f"belongs to uid {st.st_uid}"
        if st.st_uid != os.getuid()
        else f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
        if st.st_mode & 0o022
        else ""
    )
    if why:
        raise PermissionError(
            errno.EACCES, f"kvfs runtime directory {path} {why}: not used (remove it)"
        )
    return path


def as_toml(settings: Settings) -> str:
    """The effective settings as a TOML document (secrets masked)."""
    lines: list[str] = []
    for section in ("store", "archive", "daemon"):
        lines.append(f"[{section}]")
        for o in OPTIONS:
            if o.section == section:
                # (a source is a file's path too: a line break in it ended the comment)
                source = json.dumps(str(settings.sources[o.name]), ensure_ascii=False)[1:-1]
                lines.append(
                    f"{o.name} = {_toml_value(masked(o.name, settings[o.name]))}  # {source}"
                )
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    # TOML's basic strings take JSON's escapes: a control character (a line break in a
    # path) made the document unreadable
    return json.dumps(str(v), ensure_ascii=False)
