"""``kvfs config``: the effective configuration (defaults < file < environment < flags).

Secrets are masked; each value says where it came from.
"""

from __future__ import annotations

import argparse

from kvfs._settings import OPTIONS, as_toml, masked

from ._target import add_store_flags, settings_from_args
from ._util import print_json

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="show the configuration the files, environment and flags give (secrets masked); "
        "a running daemon's own mount flags show in kvfs stats",
    )
    add_store_flags(p, modes=False)
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    cfg = s.store_config()  # validates the combination (ValueError: exit 2)
    if args.json:
        print_json(
            {
                "config_file": str(s.config_file) if s.config_file else None,
                "index": str(cfg.index_path),
                "control_socket": str(s.socket_path()),
                "options": {
                    o.key: {"value": masked(o.name, s[o.name]), "source": s.sources[o.name]}
                    for o in OPTIONS
                },
            }
        )
        return 0
    print(f"# configuration file: {s.config_file or 'none'}")
    print(f"# index: {cfg.index_path}")
    print(f"# control socket: {s.socket_path()}")
    print(as_toml(s), end="")
    return 0
