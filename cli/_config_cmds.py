"""``kvfs config``: the effective configuration (defaults < file < environment < flags).

Secrets are masked; each value says where it came from. ``--check`` tries it instead
(cli/_check.py): the directories written to, FUSE, the daemon, the archive's round trip.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import kvfs
from kvfs._settings import OPTIONS, as_toml, masked

from ._target import add_store_flags, settings_from_args
from ._util import print_json, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="show the configuration the files, environment and flags give (secrets masked); "
        "a running daemon's own settings and mount flags show in kvfs stats",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="try it instead of showing it: write to each data directory as the store does "
        "(O_DIRECT), look for FUSE and fusermount3, and store, read back and delete one "
        "object in the archive; exit 1 if anything would fail (2, with nothing tried: the "
        "configuration is not valid)",
    )
    add_store_flags(p, modes=False)
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    try:
        cfg = s.store_config()  # validates the combination
    except ValueError as e:
        if args.check:
            # Nothing to try: one line and exit 2, as for a bad file or variable (it was the
            # configuration's dump, which --json's readers took for the checks' list).
            raise
        # Shown all the same (masked): it is what the user has to fix. Then exit 2.
        problem: ValueError | None = e
        index = socket = "(none: the configuration is not valid)"
        archive: str | None = index
    else:
        problem, index, socket = None, str(cfg.index_path.absolute()), str(s.socket_path())
        # what archive_url comes to: "auto" and a relative file:// said neither whether
        # there is an archive tier nor where (the table shows the value as given)
        archive = str(masked("archive_url", cfg.archive_url)) or None
        if args.check:
            return _check(cfg, s.socket_path(), args.json)
    if args.json:
        print_json(
            {
                "config_file": str(s.config_file) if s.config_file else None,
                "index": index,
                "control_socket": socket,
                "archive": archive,
                "options": {
                    o.key: {"value": masked(o.name, s[o.name]), "source": s.sources[o.name]}
                    for o in OPTIONS
                },
                "error": str(problem) if problem else None,
            }
        )
    else:
        print(f"# configuration file: {s.config_file or 'none'}")
        print(f"# index: {index}")
        print(f"# control socket: {socket}")
        print(f"# archive: {archive or 'none'}")
        print(as_toml(s), end="")
    if problem is not None:
        print(f"kvfs config: {problem}", file=sys.stderr)
        return 2
    return 0


def _check(cfg: kvfs.StoreConfig, socket: Path, as_json: bool) -> int:
    from ._check import run_checks

    found = run_checks(cfg, socket)
    if as_json:
        print_json([dataclasses.asdict(c) for c in found])
    else:
        print_table(
            ["CHECK", "STATUS", "DETAIL"], [[c.check, c.status.upper(), c.detail] for c in found]
        )
    return 1 if any(c.status == "fail" for c in found) else 0
