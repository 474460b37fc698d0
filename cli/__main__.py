"""The ``kvfs`` command. Each command group lives in its own module with a ``register``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

import trio

import kvfs
from kvfs._errors import leaf_errors

from ._util import exit_code_for

# Modules that each add subcommands with ``register(subparsers)``. A module listed here
# that does not exist yet is an error, not a silent skip.
COMMAND_MODULES = [
    "cli._bench",
    "cli._demo",
    "cli._mount_cmds",
    "cli._store_cmds",
    "cli._config_cmds",
    "cli._size",
]


class CommandParser(argparse.ArgumentParser):
    """A command's parser, which takes its positionals wherever they stand among its flags
    (``kvfs get PATH --json FILE``, ``kvfs rm A --json B``): argparse's own took the
    positionals it found together, so one after a flag was an "unrecognized argument"."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # argparse's intermixed parse calls this method twice itself (flags first, then
        # the positionals left), cannot take a parser that has subcommands (bench), and
        # drops a "--" (`kvfs get -- -odd-name` lost its PATH): those parse as before.
        nested = any(
            a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._get_positional_actions()
        )
        if self._intermixing or nested or "--" in (args or ()):
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfs",
        description="kvfs: a store for LLM KV-cache pages (striped NVMe, FUSE mount, S3 archive).",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--version", action="version", version=f"kvfs {kvfs.__version__}")
    sub = p.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


#: libraries whose debug logs print request headers: the session token (``X-Amz-Security-
#: Token``) and signatures among them. kvfs logs its own S3 retries under ``objectstore``.
_CHATTY = ("botocore", "boto3", "s3transfer", "urllib3")


def quiet_third_party_loggers() -> None:
    """Keep the S3 libraries at INFO or above even with ``--debug``: credentials are never
    logged."""
    for name in _CHATTY:
        lg = logging.getLogger(name)
        lg.setLevel(max(lg.getEffectiveLevel(), logging.INFO))


class _CommandFormatter(logging.Formatter):
    """``kvfs ls: warning: ...``: a command's log lines, as its error lines read."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        line = f"kvfs {self.command}: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:  # (a bug's traceback is one flag away, not lost)
            line += " (kvfs --debug shows its traceback)"
        return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # told by the command's own parser: its usage, not the top level's
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    handler = logging.StreamHandler()
    if args.command != "mount" and not args.debug:
        # The daemon's log (and --debug) is a record, with times and sources; a command
        # warns as it reports its errors, in one line naming itself (a timestamped
        # "WARNING kvfs.engine:" line read as a crash report)
        handler.setFormatter(_CommandFormatter(args.command))
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[handler],
    )
    quiet_third_party_loggers()
    events = logging.getLogger("kvfs.events")
    events_level = events.level
    if args.command != "mount" and not args.debug:
        # The event log is the daemon's record; a command says what went wrong in its own
        # one line (an offline read of a corrupt page logged it twice, timestamped first).
        events.setLevel(logging.CRITICAL)
    try:
        rc = args.func(args)
        return int(rc or 0)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one clear line, or the traceback with --debug
        return _failed(args, e)
    finally:
        events.setLevel(events_level)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _failed(args: argparse.Namespace, e: BaseException) -> int:
    """Say what went wrong in one line on stderr (the traceback first, with --debug, then
    the same line and exit code as without). Inside a trio nursery errors come grouped:
    the line and the code are those of the error in it, Ctrl-C's included."""
    real = [x for x in leaf_errors(e) if not isinstance(x, trio.Cancelled)] or [e]
    if any(isinstance(x, KeyboardInterrupt) for x in real):
        print("kvfs: interrupted", file=sys.stderr)
        return 130
    if isinstance(real[0], BrokenPipeError):
        # The reader went away (`kvfs ls | head`): quiet, as for any tool killed by SIGPIPE.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if args.debug:
        traceback.print_exception(e)
    print(f"kvfs {args.command}: {_said(real[0])}", file=sys.stderr)
    return exit_code_for(real[0])


def _said(e: BaseException) -> str:
    """The error's words: a file the command could not open as ``FILE: why`` (as cp and cat
    say it), not Python's ``[Errno 2] No such file or directory: 'FILE'``."""
    if (
        type(e).__module__ == "builtins"  # (kvfs's own errors word themselves)
        and isinstance(e, OSError)
        and e.strerror
        and e.filename is not None
    ):
        also = f" -> {os.fsdecode(e.filename2)}" if e.filename2 is not None else ""
        return f"{os.fsdecode(e.filename)}{also}: {e.strerror}"
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
