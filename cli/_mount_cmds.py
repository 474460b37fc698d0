"""``kvfs mount`` and ``kvfs umount``.

Flags become a :class:`~kvfs.StoreConfig` and :class:`~kvfs._mount.MountOptions` in one place
each (:func:`build_config`, :func:`build_options`); :func:`child_argv` rebuilds the command
line the detached daemon runs. Extend those three together when adding a flag.
"""

from __future__ import annotations

import argparse
import sys

import kvfs
from kvfs._daemon import MountBusy, stop_daemon
from kvfs._daemon import main as daemon_main
from kvfs._mount import MountOptions

from ._util import EXIT, exit_code_for, print_json

__all__ = ["build_config", "build_options", "child_argv", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mount", help="mount a store as a file system (see docs/mount.md)")
    add_mount_arguments(p)
    p.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount: stop the daemon cleanly and wait for it")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--timeout", type=_seconds, default=60.0, help="seconds to wait (default 60)")
    u.add_argument(
        "--force",
        action="store_true",
        help="unmount even while in use (open files, a working directory in it): "
        "those processes then get ENOTCONN",
    )
    u.add_argument("--json", action="store_true", help="print the result as JSON")
    u.set_defaults(func=cmd_umount)


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--data",
        metavar="DIR[,DIR...]",
        help="data directories, one per NVMe device, comma-separated "
        "(default: the configuration, see kvfs config)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML configuration file ($KVFS_CONFIG)")
    p.add_argument("--archive", metavar="URL", help="archive URL (file://DIR, s3://BUCKET/PREFIX)")
    p.add_argument("--socket", metavar="PATH", help="control socket (default: beside the index)")
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (default: off)",
    )
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="daemon log level (default info)",
    )
    p.add_argument(
        "--capacity",
        metavar="SIZE",
        help="cap on bytes held locally (e.g. 500GiB), kept with the store; disk: what the "
        "disks hold, the kept cap forgotten",
    )
    p.add_argument("--stripe-unit", metavar="SIZE", help="stripe unit (default 4MiB)")
    p.add_argument(
        "--foreground",
        action="store_true",
        help="stay in the foreground (systemd, tests); default: detach once mounted",
    )
    p.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users use the mount (file modes still apply)",
    )
    p.add_argument(
        "--direct-io",
        action="store_true",
        help="bypass the page cache (disables mmap: safetensors/numpy.memmap need it)",
    )
    p.add_argument(
        "--log",
        metavar="FILE",
        help="daemon log when detached (default: kvfs-daemon.log beside the index: in "
        "index_dir if set, else in the first data dir); not with --foreground (stderr)",
    )


def build_config(args: argparse.Namespace) -> kvfs.StoreConfig:
    """Defaults < configuration file < $KVFS_* < flags (kvfs._settings)."""
    from kvfs._settings import load_settings

    from ._target import warn_unknown_environment

    flags = {
        "data_dirs": args.data,
        "capacity": args.capacity,
        "stripe_unit": args.stripe_unit,
        "archive_url": args.archive,
        "control_socket": args.socket,
        "metrics_port": args.metrics_port,
        "log_level": args.log_level,
    }
    warn_unknown_environment()
    return load_settings(args.config, flags=flags).store_config()


def build_options(args: argparse.Namespace) -> MountOptions:
    return MountOptions(allow_other=args.allow_other, direct_io=args.direct_io)


def child_argv(args: argparse.Namespace) -> list[str]:
    """The foreground command the detached daemon runs: the same flags plus --foreground."""
    argv = [sys.executable, "-m", "cli"]
    if getattr(args, "debug", False):
        argv.append("--debug")
    argv += ["mount", "--foreground"]
    for flag, value in (
        ("--data", args.data),
        ("--capacity", args.capacity),
        ("--stripe-unit", args.stripe_unit),
        ("--config", args.config),
        ("--archive", args.archive),
        ("--socket", args.socket),
        ("--metrics-port", args.metrics_port),
        ("--log-level", args.log_level),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (("--allow-other", args.allow_other), ("--direct-io", args.direct_io)):
        if on:
            argv.append(flag)
    return [*argv, "--", args.mountpoint]


def cmd_mount(args: argparse.Namespace) -> int:
    from ._target import daemon_services

    if args.foreground and args.log:  # (it was ignored without a word)
        raise ValueError(
            "--log is the detached daemon's log; in the foreground the log goes to stderr "
            "(redirect it, or set daemon.log_target = journald)"
        )
    config = build_config(args)
    daemon = config.extra.get("daemon")
    if not args.foreground and isinstance(daemon, dict) and daemon.get("log_target") == "journald":
        from kvfs._metrics import JournaldHandler

        JournaldHandler().close()  # journald there? told here, not by the detached daemon
    return daemon_main(
        config,
        args.mountpoint,
        build_options(args),
        foreground=args.foreground,
        child_argv=child_argv(args),
        log_file=args.log,
        services=daemon_services(config, setup_logs=args.foreground),
        exit_code=exit_code_for,
    )


def cmd_umount(args: argparse.Namespace) -> int:
    try:
        result = stop_daemon(args.mountpoint, timeout=args.timeout, force=args.force)
    except FileNotFoundError as e:
        print(f"kvfs umount: {e}", file=sys.stderr)
        return EXIT["no_daemon"]
    except MountBusy as e:
        print(f"kvfs umount: {e.strerror}", file=sys.stderr)
        return EXIT["refused"]
    if args.json:
        print_json(result)
    return 0


def _seconds(text: str) -> float:
    """An argparse ``type``: a wait in seconds, more than 0 (0 or less reported a failure
    after the unmount it had already done)."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not n > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return n
