"""``jupyter gpu-hotplug``: the terminal's entry point, dispatching to subcommands.

Installed as the ``jupyter-gpu-hotplug`` console script, which is how ``jupyter gpu-hotplug ...``
finds it. This module only parses and dispatches: each subcommand is a ``Command`` value listed
in ``COMMANDS``, and later ones (``agent``, ``attach``, ``detach``, ``status``, ``demo``) live in
their own modules and keep heavy imports inside their ``run`` so that ``--help`` stays instant.

Exit codes: 0 success, 2 usage error (argparse's convention); a command returns its own code.
``main`` returns the code instead of exiting, so tests and other Python code can call it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from . import cli_agent
from ._version import __version__
from .demo import command as demo_command

PROG = "jupyter gpu-hotplug"
EXIT_OK = 0
EXIT_USAGE = 2


class _ParserExit(Exception):
    """argparse wants to end the program (after ``--help``, ``--version`` or a usage error)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _ArgumentParser(argparse.ArgumentParser):
    """Ends parsing by raising, so ``main`` returns the exit code instead of ``sys.exit``."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        # argparse routes --help, --version and error() through here, messages already formatted.
        if message:
            self._print_message(message, sys.stderr)
        raise _ParserExit(status)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """For commands that take no arguments: argparse then rejects any extra word."""


@dataclass(frozen=True, kw_only=True)
class Command:
    """One ``jupyter gpu-hotplug <name> ...`` subcommand."""

    name: str
    help: str
    """One line, shown in ``jupyter gpu-hotplug --help``."""
    run: Callable[[argparse.Namespace], int]
    """Does the work with the parsed arguments and returns the exit code."""
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    """Declares the command's own arguments on its sub-parser."""
    passthrough: bool = False
    """The command parses its own options (a traitlets application): everything after its
    name reaches ``run`` untouched as ``args.argv``, ``--help`` included."""


def _run_version(args: argparse.Namespace) -> int:
    print(f"jupyter-gpu-hotplug {__version__}")
    return EXIT_OK


COMMANDS: tuple[Command, ...] = (
    Command(name="version", help="print the jupyter-gpu-hotplug version", run=_run_version),
    Command(name="agent", help=cli_agent.AGENT_HELP, run=cli_agent.run_agent, passthrough=True),
    Command(
        name="attach",
        help=cli_agent.ATTACH_HELP,
        run=cli_agent.run_attach,
        add_arguments=cli_agent.add_attach_arguments,
    ),
    Command(
        name="detach",
        help=cli_agent.DETACH_HELP,
        run=cli_agent.run_detach,
        add_arguments=cli_agent.add_detach_arguments,
    ),
    Command(
        name="status",
        help=cli_agent.STATUS_HELP,
        run=cli_agent.run_status,
        add_arguments=cli_agent.add_status_arguments,
    ),
    Command(
        name="demo",
        help=demo_command.HELP,
        run=demo_command.run,
        add_arguments=demo_command.add_arguments,
    ),
)
"""Every subcommand, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser, one sub-parser per entry of ``COMMANDS``."""
    parser = _ArgumentParser(
        prog=PROG,
        description="Attach and release GPUs in running Jupyter notebook containers.",
    )
    parser.add_argument("--version", action="version", version=f"jupyter-gpu-hotplug {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", title="commands", metavar="COMMAND", required=True
    )
    for command in COMMANDS:
        if command.passthrough:
            # NUL never occurs in argv, so no word is taken for an option of this sub-parser.
            sub = subparsers.add_parser(
                command.name, help=command.help, add_help=False, prefix_chars="\0"
            )
            sub.add_argument("argv", nargs=argparse.REMAINDER)
        else:
            sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
            command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except _ParserExit as e:
        return e.status
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
