"""``zerostate``: explore real DeepSpeed or the model, check designs, compare them, replay and bisect; watch your job.

Exit status: 0 ok, 1 findings (or a failing replay), 2 bad input (one line on
stderr naming the problem), 130 interrupted (the report keeps what was found).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from zerostate import __version__

from zerostate.cli import (cmd_bisect, cmd_check, cmd_compare, cmd_diff, cmd_doctor, cmd_explore, cmd_replay,
                           cmd_watch)
from zerostate.cli.common import EXIT_INTERRUPTED, EXIT_USAGE, CliError
from zerostate.harness import forked
from zerostate.targets.interface import TargetError

COMMANDS = (cmd_explore, cmd_check, cmd_compare, cmd_replay, cmd_bisect, cmd_diff, cmd_watch, cmd_doctor)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        self.exit(EXIT_USAGE, f"zerostate: {message} (see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerostate", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--version", action="version", version=f"zerostate {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in COMMANDS:
        cmd.add_parser(sub)
    return p


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack to stderr and the run goes on: how to see where
    a run that seems stuck is (README, Troubleshooting).  Quietly skipped where stderr has no file
    descriptor (an embedding that replaced it) or the platform has no SIGUSR1."""
    stream = sys.__stderr__ or sys.stderr
    try:
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    dump_stacks_on_sigusr1()
    if getattr(args, "no_fork_server", False):
        with forked.disabled():
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except CliError as exc:
        print(f"zerostate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as exc:  # a target that fails once running (a rank pool that cannot start): one line
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        print(f"zerostate: {lines[0] if lines else type(exc).__name__}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("zerostate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
