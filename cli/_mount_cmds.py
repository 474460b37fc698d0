"""``kvfs mount`` and ``kvfs umount``.

Flags become a :class:`~kvfs.StoreConfig` and :class:`~kvfs._mount.MountOptions` in one place
each (:func:`build_config`, :func:`build_options`); :func:`child_argv` rebuilds the command
line the detached daemon runs. Extend those three together when adding a flag.
"""

from __future__ import annotations

import argparse
import sys

import kvfs
from kvfs._daemon import main as daemon_main
from kvfs._daemon import stop_daemon
from kvfs._mount import MountOptions

from ._util import EXIT, print_json

__all__ = ["build_config", "build_options", "child_argv", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mount", help="mount a store as a file system (see docs/mount.md)")
    add_mount_arguments(p)
    p.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount: stop the daemon cleanly and wait for it")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    u.add_argument("--json", action="store_true", help="print the result as JSON")
    u.set_defaults(func=cmd_umount)


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--data", required=True, metavar="DIR[,DIR...]",
                   help="data directories, one per NVMe device, comma-separated")
    p.add_argument("--capacity", metavar="SIZE", help="cap on bytes held locally (e.g. 500GiB)")
    p.add_argument("--stripe-unit", metavar="SIZE", help="stripe unit (default 4MiB)")
    p.add_argument("--foreground", action="store_true",
                   help="stay in the foreground (systemd, tests); default: detach once mounted")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (file modes still apply)")
    p.add_argument("--direct-io", action="store_true",
                   help="bypass the page cache (disables mmap: safetensors/numpy.memmap need it)")
    p.add_argument("--log", metavar="FILE", help="daemon log when detached "
                   "(default: kvfs-daemon.log in the first data dir)")


def build_config(args: argparse.Namespace) -> kvfs.StoreConfig:
    kw: dict[str, object] = {"data_dirs": tuple(d for d in args.data.split(",") if d)}
    if args.capacity:
        kw["capacity"] = kvfs.parse_size(args.capacity)
    if args.stripe_unit:
        kw["stripe_unit"] = kvfs.parse_size(args.stripe_unit)
    return kvfs.StoreConfig(**kw)  # type: ignore[arg-type]


def build_options(args: argparse.Namespace) -> MountOptions:
    return MountOptions(allow_other=args.allow_other, direct_io=args.direct_io)


def child_argv(args: argparse.Namespace) -> list[str]:
    """The foreground command the detached daemon runs: the same flags plus --foreground."""
    argv = [sys.executable, "-m", "cli"]
    if getattr(args, "debug", False):
        argv.append("--debug")
    argv += ["mount", "--foreground", "--data", args.data]
    for flag, value in (("--capacity", args.capacity), ("--stripe-unit", args.stripe_unit)):
        if value:
            argv += [flag, value]
    for flag, on in (("--allow-other", args.allow_other), ("--direct-io", args.direct_io)):
        if on:
            argv.append(flag)
    return [*argv, "--", args.mountpoint]


def cmd_mount(args: argparse.Namespace) -> int:
    config = build_config(args)
    return daemon_main(config, args.mountpoint, build_options(args), foreground=args.foreground,
                       child_argv=child_argv(args), log_file=args.log)


def cmd_umount(args: argparse.Namespace) -> int:
    try:
        result = stop_daemon(args.mountpoint, timeout=args.timeout)
    except FileNotFoundError as e:
        print(f"kvfs umount: {e}", file=sys.stderr)
        return EXIT["no_daemon"]
    if args.json:
        print_json(result)
    return 0
