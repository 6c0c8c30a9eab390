"""The ``%gpu`` line magic: the notebook user's typed way to ask for GPUs.

It exists so a user can attach and release GPUs from code cells, next to the toolbar. Like every
frontend here it stays thin: it parses the line, calls into the library and prints; bad input
raises IPython's ``UsageError``, which the notebook shows as one line without a traceback.

Subcommands are values in ``SUBCOMMANDS`` — a name, a one-line help, how to declare arguments and
what to run — so adding ``attach``, ``detach``, ``status`` or ``list`` means adding one entry.
Parsing uses argparse with ``add_help=False`` and an ``error()`` that raises ``UsageError``:
argparse's default is to print and ``sys.exit``, which must never happen inside a kernel.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from .._version import __version__

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

MAGIC_NAME = "gpu"
PROG = f"%{MAGIC_NAME}"


class _MagicArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reports bad input as ``UsageError`` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(
            f"{self.prog}: {message}\n{self.format_usage().rstrip()}\n"
            f"Run '{PROG} help' for the list of subcommands."
        )


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """For subcommands that take no arguments: argparse then rejects any extra word."""


@dataclass(frozen=True, kw_only=True)
class Subcommand:
    """One ``%gpu <name> ...`` subcommand."""

    name: str
    help: str
    """One line, shown in ``%gpu help``."""
    run: Callable[[argparse.Namespace], None]
    """Does the work and prints the result; the parsed arguments come in."""
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    """Declares the subcommand's own arguments on its sub-parser."""


def _print_version(args: argparse.Namespace) -> None:
    print(f"jupyter-gpu-hotplug {__version__}")


def _print_help(args: argparse.Namespace) -> None:
    parser, subparsers = _build_parsers()
    topic = vars(args).get("topic")
    print((parser if topic is None else subparsers[topic]).format_help().rstrip())


def _add_help_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "topic",
        nargs="?",
        choices=[command.name for command in SUBCOMMANDS],
        metavar="SUBCOMMAND",
        help="show the help of this subcommand",
    )


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(name="version", help="print the jupyter-gpu-hotplug version", run=_print_version),
    Subcommand(
        name="help",
        help="print this help, or the help of one subcommand",
        run=_print_help,
        add_arguments=_add_help_arguments,
    ),
)
"""Every ``%gpu`` subcommand, in the order ``%gpu help`` lists them."""


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``%gpu`` parser and, by name, each subcommand's sub-parser (for its own help).

    Built afresh for every line: it is cheap, and nothing is then shared between calls.
    """
    parser = _MagicArgumentParser(
        prog=PROG,
        description="Attach and release GPUs in this running notebook.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="store_true", help="print this help (as 'help')")
    parser.add_argument("--version", action="store_true", help="print the version (as 'version')")
    subparsers = parser.add_subparsers(dest="subcommand", title="subcommands", metavar="SUBCOMMAND")
    by_name: dict[str, argparse.ArgumentParser] = {}
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(
            command.name, help=command.help, description=command.help, add_help=False
        )
        command.add_arguments(sub)
        by_name[command.name] = sub
    return parser, by_name


def run_line(line: str) -> None:
    """Parse and run one ``%gpu`` line; kept apart from the Magics class so it is easy to test."""
    try:
        words: Sequence[str] = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"{PROG}: cannot split {line!r} into words: {e}") from e
    parser, _ = _build_parsers()
    args = parser.parse_args(words)
    if args.version:
        name = "version"
    elif args.help or args.subcommand is None:
        name = "help"
    else:
        name = args.subcommand
    {command.name: command for command in SUBCOMMANDS}[name].run(args)


@magics_class
class GPUMagics(Magics):
    """Holds the ``%gpu`` magic; IPython instantiates it once per shell."""

    @line_magic
    def gpu(self, line: str) -> None:
        """Attach and release GPUs in this running notebook; ``%gpu help`` lists subcommands."""
        run_line(line)


def register(ipython: InteractiveShell) -> None:
    """Register ``%gpu`` with ``ipython`` (called by ``%load_ext jupyter_gpu_hotplug``)."""
    ipython.register_magics(GPUMagics)
