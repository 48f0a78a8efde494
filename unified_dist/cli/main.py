"""Argument parsing for ``unified-dist``; each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, NoReturn, Optional, Tuple

from . import env_report, launch, parity, plan, selftest
from .errors import UsageError

PROG = "unified-dist"

SUBCOMMANDS = (
    ("env", env_report, "report versions, working backends, Horovod's build, devices, and what would run here"),
    ("launch", launch, "run a script under torchrun, accelerate launch or horovodrun with the right flags"),
    ("plan", plan, "run a script as one simulated rank of a large world and print what that rank holds and sends"),
    ("test", selftest, "self-test every collective and a training step under each installed launcher"),
    ("parity", parity, "run one training script under several launchers and compare their metrics step by step"),
)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="One command line for torch.distributed, Accelerate and Horovod.")
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{" + ",".join(name for name, _, _ in SUBCOMMANDS) + "}")
    for name, module, summary in SUBCOMMANDS:
        sub = commands.add_parser(name, help=summary, description=summary)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.main)
    return parser


def _split_script_args(argv: List[str]) -> Tuple[List[str], Optional[List[str]]]:
    """(what argparse reads, the words after the first ``--``) for a subcommand whose module sets
    ``SCRIPT_ARGS_AFTER_DASHES``: they belong to its script, however much they look like options."""
    modules = {name: module for name, module, _ in SUBCOMMANDS}
    if not argv or not getattr(modules.get(argv[0]), "SCRIPT_ARGS_AFTER_DASHES", False):
        return argv, None
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``unified-dist`` console script; returns the exit status."""
    argv, script_args = _split_script_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if script_args is not None:
        args.script_args = script_args
    try:
        return args.handler(args)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `unified-dist env | head`: the reader left, not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
