"""The ``%gpu`` line magic: the notebook user's typed way to ask for GPUs.

It exists so a user can attach and release GPUs from code cells, next to the widget's buttons.
Like every frontend here it stays thin: it parses the line, calls ``AgentClient`` (the agent),
``GpuMonitor`` (what this kernel sees) and ``cuda`` (whether this kernel can still see a new
GPU), and prints.

Subcommands are values in ``SUBCOMMANDS`` — a name, a one-line help, how to declare arguments and
what to run — so adding one means adding one entry. Parsing uses argparse with ``add_help=False``
and an ``error()`` that raises ``UsageError``: argparse's default is to print and ``sys.exit``,
which must never happen inside a kernel.

What the user sees when something goes wrong:

- bad input: IPython's ``UsageError`` (one line, no traceback), saying what is expected;
- the agent refuses or cannot be reached: ``GpuCommandError`` carrying the client error's
  ``message`` (written for people); IPython shows exceptions that define ``_render_traceback_``
  as that text alone, and the cell counts as failed, so "Run all" stops before training on CPU.

Long waits: with ``--wait S`` an attach that finds no GPU free waits in the agent's queue (first
come, first served) for up to S seconds; without it, it fails at once. The blocking client call
then runs in a worker thread while the kernel's own thread keeps one
progress line up to date — in place in a notebook (a display updated by id), with ``\\r`` on a
terminal, as a single line when output is not a terminal. Output only ever comes from the
kernel's thread.

Bare ``%gpu`` shows the live monitor widget in a notebook and its text form elsewhere.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from .._structs import (
    MAX_IDLE_RELEASE_SECONDS,
    MAX_WAIT_SECONDS,
    MIG_PROFILE_RE,
    NVIDIA_MAJOR,
    SANDBOX_PID_ENV,
    GpuSelector,
    GpuUuid,
    WireFormatError,
    check_detach_flags,
    check_model,
    parse_memory_text,
)
from .._version import __version__
from ..client import (
    AgentClient,
    AgentClientError,
    Attachment,
    Busy,
    Gpu,
    InsufficientGpus,
    InvalidRequest,
    Suspension,
    is_index,
    normalise_selector,
    select_gpus,
)
from ..nvml.attribution import ProcessTree, attribute
from ..nvml.sim.load import DEFAULT_SECONDS as LOAD_SECONDS
from ..nvml.sim.load import gpu_nodes
from ..nvml.state import GpuMonitor, Snapshot
from . import render, reports
from .cuda import CudaState, advice, cuda_initialised
from .errors import GpuCommandError
from .holders import HolderNames
from .progress import (
    PROGRESS_AFTER,
    PROGRESS_TICK,
    DisplayProgress,
    Progress,
    QueuePlace,
    TerminalProgress,
    display_raw,
    wait_with_progress,
)
from .tables import Table

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "MAGIC_NAME",
    "PROG",
    "SUBCOMMANDS",
    "GPUMagics",
    "GpuCommandError",
    "MagicContext",
    "Progress",
    "Subcommand",
    "register",
    "run_line",
]

MAGIC_NAME: Final = "gpu"
PROG: Final = f"%{MAGIC_NAME}"

MIN_INTERVAL: Final = 0.1
MAX_INTERVAL: Final = 3600.0
_FULL_UUID: Final = re.compile(
    r"(?:GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
)
_DIGITS: Final = re.compile(r"[0-9]{1,6}")


@dataclass(frozen=True, kw_only=True)
class MagicContext:
    """What the subcommands work with; ``GPUMagics`` makes one per shell, tests their own."""

    shell: InteractiveShell | None = None
    client: Callable[[], AgentClient] = AgentClient.from_environment
    """Made per command, so a changed environment (agent URL, token path) applies at once."""
    monitor: Callable[[], GpuMonitor] = GpuMonitor
    """A fresh monitor per command, closed after use: holding NVML open between commands
    would freeze this kernel's own NVML device list (see ``nvml.state``)."""
    cuda: Callable[[], CudaState] = cuda_initialised
    holders: Callable[[], HolderNames] = HolderNames
    """Words holders the way the user knows them (the notebook), next to the process id."""
    progress: Callable[[], Progress] | None = None
    """``None``: a display in a notebook, the terminal otherwise."""
    progress_after: float = PROGRESS_AFTER
    progress_tick: float = PROGRESS_TICK
    dev: Path = Path("/dev")
    """Where this kernel's GPU nodes are (``load`` holds them); tests give a directory of
    their own."""
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    """This kernel's environment (whether it runs in a sandbox of its own)."""
    background: list[subprocess.Popen[str]] = field(default_factory=list)
    """The load helpers this context started: polled (reaped) at the next ``load``, so none
    stays a zombie for long."""

    @property
    def in_kernel(self) -> bool:
        """Whether this runs in a Jupyter kernel (which has a frontend) rather than a terminal."""
        return getattr(self.shell, "kernel", None) is not None

    def new_progress(self) -> Progress:
        if self.progress is not None:
            return self.progress()
        return DisplayProgress() if self.in_kernel else TerminalProgress()


@dataclass(frozen=True, kw_only=True)
class Subcommand:
    """One ``%gpu <name> ...`` subcommand."""

    name: str
    help: str
    """One line, shown in ``%gpu help``."""
    run: Callable[[argparse.Namespace, MagicContext], None]
    """Does the work and prints the result; the parsed arguments come in."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Declares the subcommand's own arguments on its sub-parser (none: no arguments)."""


class _MagicArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reports bad input as ``UsageError`` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(
            f"{self.prog}: {message}\n{self.format_usage().rstrip()}\n"
            f"Run '{PROG} help' for the list of subcommands."
        )


# --- argument types (argparse turns their ArgumentTypeError into a usage error) -------------


def positive_count(text: str) -> int:
    """``N`` of ``attach``: a positive whole number, in plain digits."""
    if _DIGITS.fullmatch(text) is None or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"N must be a positive whole number of GPUs (1, 2, ...), got {text!r}"
        )
    return int(text)


def _seconds(text: str, *, what: str, low: float, high: float, low_inclusive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    above_low = value >= low if low_inclusive else value > low
    if not (above_low and value <= high):  # also refuses nan and inf
        bound = f"at least {low:g}" if low_inclusive else f"more than {low:g}"
        raise argparse.ArgumentTypeError(
            f"{what} must be a number of seconds, {bound} and at most {high:g}, got {text!r}"
        )
    return value


def wait_seconds(text: str) -> float:
    """``--wait S`` of ``attach``: how long the attach may wait in the agent's queue for free
    GPUs (the agent's ``wait_seconds``)."""
    return _seconds(text, what="--wait", low=0.0, high=MAX_WAIT_SECONDS, low_inclusive=False)


def idle_seconds(text: str) -> float:
    """``--idle S`` of ``attach``: give the GPUs back after ``S`` seconds unused."""
    return _seconds(
        text, what="--idle", low=0.0, high=MAX_IDLE_RELEASE_SECONDS, low_inclusive=False
    )


def mig_profile(text: str) -> str:
    """``--mig P`` of ``attach``: a MIG profile such as ``1g.10gb``."""
    if MIG_PROFILE_RE.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"--mig takes a MIG profile such as 1g.10gb (<slices>g.<memory>gb), not {text!r}"
        )
    return text


def gpu_model(text: str) -> str:
    """``--model M`` of ``attach``: part of the GPU's product name (the wire's rule)."""
    try:
        return check_model(text)
    except WireFormatError as error:
        raise argparse.ArgumentTypeError(error.message.replace("model", "--model", 1)) from error


def memory_size(text: str) -> int:
    """``--min-memory SIZE`` of ``attach`` in bytes: ``80G`` (10**9), ``40Gi`` (2**30), ``512M``."""
    try:
        return parse_memory_text(text)
    except WireFormatError as error:
        raise argparse.ArgumentTypeError(
            error.message.replace("min_memory", "--min-memory", 1)
        ) from error


def refresh_interval(text: str) -> float:
    """``--interval S`` of ``monitor``: seconds between two refreshes."""
    return _seconds(
        text, what="--interval", low=MIN_INTERVAL, high=MAX_INTERVAL, low_inclusive=True
    )


def one_gpu(text: str) -> str:
    """``--gpu`` of ``attach``: one GPU of the node, by its index or its UUID (or the unique
    beginning of one)."""
    normalised = normalise_selector(text)
    if normalised is None:
        raise argparse.ArgumentTypeError(
            f"--gpu takes a GPU index on the node (0, 1, ... as '{PROG} list' shows), a GPU "
            f"UUID or the beginning of one, got {text!r}"
        )
    return normalised


def gpu_selector(text: str) -> str:
    """``detach``'s argument: ``all``, a GPU's index on the node, a GPU/MIG UUID, or the unique
    beginning of one."""
    if text.lower() == "all":
        return "all"
    normalised = normalise_selector(text)
    if normalised is None:
        raise argparse.ArgumentTypeError(
            "expected 'all', a GPU index on the node (0, 1, ... as "
            f"'{PROG} list' shows), a GPU UUID or the beginning of one, got {text!r}"
        )
    return normalised


# --- subcommands --------------------------------------------------------------------------


def _print_version(args: argparse.Namespace, context: MagicContext) -> None:
    print(f"jupyter-gpu-hotplug {__version__}")


def _print_help(args: argparse.Namespace, context: MagicContext) -> None:
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


def _plural(count: int, word: str = "GPU") -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _add_attach_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "count",
        nargs="?",
        type=positive_count,
        default=1,
        metavar="N",
        help="how many GPUs to attach (default 1)",
    )
    parser.add_argument(
        "--wait",
        type=wait_seconds,
        default=None,
        metavar="S",
        help=f"when no GPU is free, wait in the agent's queue (first come, first served) for "
        f"up to S seconds (at most {MAX_WAIT_SECONDS:g}); without --wait the attach fails at "
        "once",
    )
    parser.add_argument(
        "--mig",
        type=mig_profile,
        default=None,
        metavar="PROFILE",
        help="attach MIG slices of this profile (e.g. 1g.10gb) instead of whole GPUs",
    )
    parser.add_argument(
        "--idle",
        type=idle_seconds,
        default=None,
        metavar="S",
        help="let the agent take the GPUs back after S seconds unused (it never waits longer "
        "than its own idle policy)",
    )
    parser.add_argument(
        "--gpu",
        type=one_gpu,
        default=None,
        metavar="INDEX|UUID",
        help="attach this GPU of the node (its index as the GPU panel, '%%gpu list' and the "
        "host's nvidia-smi number it, or its UUID) rather than any free one; not where the "
        "cluster picks the GPU (Kubernetes)",
    )
    parser.add_argument(
        "--model",
        type=gpu_model,
        default=None,
        metavar="TEXT",
        help="attach only GPUs whose product name contains TEXT, in any case (e.g. H100 for "
        "'NVIDIA H100 80GB HBM3'); not with --gpu or --mig, not where the device plugin picks "
        "the GPU (Kubernetes)",
    )
    parser.add_argument(
        "--min-memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="attach only GPUs with at least SIZE of memory, as Kubernetes reads it: 80G "
        "(10**9 bytes, as cards are sold) or 40Gi (2**30); the same limits as --model",
    )


def _attach(args: argparse.Namespace, context: MagicContext) -> None:
    count: int = args.count
    client = context.client()
    limit = "" if args.wait is None else f" (waiting up to {args.wait:g} s)"
    what = _plural(count) if args.mig is None else _plural(count, f"MIG {args.mig} slice")
    named: list[GpuUuid] = []
    selector = GpuSelector(args.model, args.min_memory)
    if selector != GpuSelector():
        what += f" ({selector})"
    if args.gpu is not None:
        if count != 1:
            raise UsageError(f"{PROG} attach --gpu names one GPU: leave N out")
        gpu = _named_gpu(args.gpu, client)
        named, what = [gpu.uuid], f"GPU {gpu.index} ({gpu.uuid})"
    suspended = _kept_state(client)
    label = f"Attaching {what}{limit}"
    if suspended is not None:
        label = f"Resuming this kernel on {_plural(len(suspended.uuids), suspended.model + ' GPU')}"
    try:
        attachments = wait_with_progress(
            lambda: client.attach(
                count,
                wait_seconds=args.wait,
                mig=args.mig,
                idle_release_seconds=args.idle,
                gpus=named,
                model=selector.model,
                min_memory=selector.min_memory,
            ),
            label=label,
            detail=QueuePlace(client) if args.wait is not None else lambda: "",
            new_progress=context.new_progress,
            after=context.progress_after,
            tick=context.progress_tick,
        )
    except (InsufficientGpus, InvalidRequest) as error:
        if (
            named
            or selector != GpuSelector()
            or (isinstance(error, InvalidRequest) and error.field != "count")
        ):
            raise  # a named GPU's refusal names it, a selector's what the node has
        raise GpuCommandError(_too_many(count, client, error, mig=args.mig)) from error
    if suspended is not None:
        print(
            f"Resumed this kernel on {_plural(len(attachments))}: the agent restored its CUDA "
            f"state from host memory (it was {render.suspended_state(suspended)}; a resume "
            "takes GPUs of the suspended model, whatever the attach asked):"
        )
        print("\n".join(render.attachment_lines(attachments)))
        return
    print(f"Attached {_plural(len(attachments))} to this kernel:")
    print("\n".join(render.attachment_lines(attachments)))
    print(advice(context.cuda(), attached=len(attachments)))


def _kept_state(client: AgentClient) -> Suspension | None:
    """This kernel's CUDA state the agent keeps, which the attach about to be sent resumes;
    None when there is none, or when the agent cannot say (the attach then speaks for
    itself)."""
    try:
        return client.attachment_state().suspended
    except AgentClientError:
        return None


def _named_gpu(selector: str, client: AgentClient) -> Gpu:
    """The one GPU of the node ``selector`` names (``--gpu``), as the agent lists it. A GPU
    in MIG mode shares its index with its slices: the index names the GPU, a UUID a slice."""
    gpus = client.gpus()
    chosen = select_gpus(selector, gpus)
    if is_index(selector):
        chosen = [gpu for gpu in chosen if gpu.kind != "mig_slice"]
    if len(chosen) == 1:
        return chosen[0]
    listing = "\n".join(f"  {gpu.index}  {gpu.uuid}  {gpu.state}" for gpu in gpus)
    which = "none" if not chosen else f"{len(chosen)}"
    raise GpuCommandError(
        f"{PROG} attach --gpu {selector}: {which} of the node's GPUs match; name one by its "
        f"index or a longer UUID:\n{listing}"
    )


def _too_many(count: int, client: AgentClient, error: AgentClientError, *, mig: str | None) -> str:
    """The words for "not that many GPUs"; the node's counts (``render.too_many_gpus``) are
    of GPUs an attach of a count alone gets, so an attach of MIG slices keeps the agent's."""
    try:
        gpus: tuple[Gpu, ...] | None = None if mig else client.gpus()
    except AgentClientError:
        gpus = None
    hints = [
        render.wait_hint(count, gpus, error=error),
        f"'{PROG} list' shows the node's GPUs and who holds them.",
    ]
    return "\n".join([render.too_many_gpus(count, gpus, error=error), *filter(None, hints)])


def _add_detach_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "gpu",
        nargs="?",
        type=gpu_selector,
        default=None,
        metavar="INDEX|UUID|all",
        help="the GPU to release: its index on the node (as the GPU panel, '%%gpu list' and "
        "the host's nvidia-smi number it), its UUID or a unique beginning of it, or 'all'; "
        "may be left out when exactly one GPU is attached",
    )
    _add_release_flags(parser)


def _add_release_flags(parser: argparse.ArgumentParser) -> None:
    """``--force`` and ``--keep``, of ``detach`` and ``release`` alike."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="kill the processes of this kernel's container that use the GPU (this kernel "
        "too, if it does), then release it",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the kernel running with its CUDA state (the models and tensors on its "
        "GPUs): the agent suspends the kernel's CUDA processes into host memory with the CUDA "
        "driver's checkpoint API, then releases all of its GPUs; the next '%%gpu attach' "
        "resumes them, on free GPUs of the same type. Refused, with nothing changed, where the "
        "driver or a process cannot be checkpointed; all GPUs of the kernel; not with --force",
    )


def _release(args: argparse.Namespace, context: MagicContext) -> None:
    """``release``: give back every GPU of this kernel, as ``detach all`` does."""
    _detach(argparse.Namespace(**vars(args), gpu="all"), context)


def _choose(selector: str | None, attachments: Sequence[Attachment]) -> list[Attachment]:
    """The attachments ``selector`` names (``None``: the only one; ``all``: every one)."""
    if selector == "all":
        return list(attachments)
    if selector is None:
        if len(attachments) > 1:
            listing = "\n".join(render.attachment_lines(attachments))
            raise UsageError(
                f"{PROG} detach: {len(attachments)} GPUs are attached; name one (its index on the "
                f"node or UUID) or 'all':\n"
                f"{listing}"
            )
        return list(attachments)
    chosen = select_gpus(selector, attachments)
    if len(chosen) == 1:
        return chosen
    if _FULL_UUID.fullmatch(selector) is not None:
        # Not attached here as far as we know: let the agent answer (it has the last word).
        return []
    which = "none" if not chosen else f"{len(chosen)}"
    listing = "\n".join(render.attachment_lines(attachments)) or "  (no GPU is attached)"
    raise UsageError(
        f"{PROG} detach: {selector!r} matches {which} of the GPUs attached to this kernel:\n"
        f"{listing}"
    )


def holds_device(minor: int, *, fd_dir: str = "/proc/self/fd") -> bool:
    """Whether this process has ``/dev/nvidia<minor>`` (c 195:minor) open."""
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            info = os.stat(os.path.join(fd_dir, fd))
        except OSError:
            continue  # Closed since listing (the listing's own fd is one).
        if (
            stat.S_ISCHR(info.st_mode)
            and os.major(info.st_rdev) == NVIDIA_MAJOR
            and os.minor(info.st_rdev) == minor
        ):
            return True
    return False


def _force_notice(chosen: Sequence[Attachment]) -> str:
    names = render.gpu_names(chosen) or "the GPU"
    notice = (
        f"--force: processes of this kernel's container that use {names} will be stopped "
        "(SIGTERM, then SIGKILL) before the release."
    )
    if any(holds_device(a.minor) for a in chosen):
        notice += (
            " This kernel itself has the GPU open, so it will be killed too; "
            "the notebook then shows the kernel as dead or restarting."
        )
    return notice


def _check_keep(args: argparse.Namespace) -> None:
    """``--keep`` suspends the whole kernel (the agent keeps a kernel's CUDA state whole,
    never one GPU's), and never with ``--force``: a usage error, before the agent is asked."""
    command = f"{PROG} {args.subcommand}"
    try:
        check_detach_flags(force=args.force, keep=args.keep)
    except WireFormatError as error:
        raise UsageError(f"{command} --keep --force: {error.message}") from error
    if args.gpu not in (None, "all"):
        raise UsageError(
            f"{command} --keep keeps the whole kernel's CUDA state and gives back all of its "
            f"GPUs: leave the GPU out ('{PROG} detach all --keep' or '{PROG} release --keep')"
        )


def _detach(args: argparse.Namespace, context: MagicContext) -> None:
    if args.keep:
        _check_keep(args)
    client = context.client()
    selector: str | None = "all" if args.keep else args.gpu
    suspended: Suspension | None = None
    if args.keep:
        state = client.attachment_state()
        attachments, suspended = state.attachments, state.suspended
    else:
        attachments = client.attachments()
    chosen = _choose(selector, attachments)
    if selector is not None and selector != "all" and not chosen:
        uuids = [selector]  # a full UUID the agent did not list for us: it decides
    else:
        uuids = [a.uuid for a in chosen]
    if not uuids:
        already = "" if suspended is None else f" It is {render.suspended_state(suspended)}."
        print(f"No GPU is attached to this notebook; nothing to detach.{already}")
        return
    if args.force:
        print(_force_notice(chosen))
    try:
        if selector == "all":
            client.detach_all(force=args.force, keep=args.keep)
        else:
            for gpu_uuid in uuids:
                client.detach(gpu_uuid, force=args.force)
    except Busy as error:
        if args.keep:
            raise  # its words are the agent's: no --force advice for a kept state
        raise GpuCommandError(_busy_message(error, chosen, uuids, selector, args.force)) from error
    known: dict[str, Attachment] = {a.uuid: a for a in chosen}
    names = ", ".join(f"GPU {known[u].index}" if u in known else u for u in uuids)
    if args.keep:
        print(_kept(client, f"Released {names} ({_plural(len(uuids))}).", len(uuids)))
    else:
        print(f"Detached {names} ({_plural(len(uuids))}).")


def _kept(client: AgentClient, released: str, count: int) -> str:
    """What a release with ``--keep`` did, as the agent now shows the kernel: suspended, or
    nothing to keep (no process used the GPUs: the agent then detached them plainly)."""
    try:
        suspension = client.attachment_state().suspended
    except AgentClientError as error:
        return f"{released} Whether its CUDA state was kept could not be read: {error.message}"
    if suspension is None:
        it = "it" if count == 1 else "them"
        return f"{released} No process of this kernel used {it}: there was no CUDA state to keep."
    return f"{released} {render.suspended_line(suspension)}"


def _busy_message(
    error: Busy,
    chosen: Sequence[Attachment],
    uuids: Sequence[str],
    selector: str | None,
    force: bool,
) -> str:
    """A refused detach in the node's numbering ("GPU 0 is in use by process 42 (python)"):
    the agent's own words lead with the UUID."""
    if not error.processes:
        return error.message
    busy = error.uuid or (uuids[0] if len(uuids) == 1 else None)
    in_use = [a for a in chosen if busy is None or a.uuid == busy]
    subject = render.gpu_names(in_use) or (busy or "the GPU")
    listing = ", ".join(f"{p.pid} ({p.command})" for p in error.processes)
    verb = "are" if len(in_use) > 1 else "is"
    message = f"{subject} {verb} in use by process(es) {listing}."
    if not force:
        gpu = "all" if selector == "all" else (str(in_use[0].index) if in_use else busy)
        message += f"\nTo stop them and detach the GPU: {PROG} detach {gpu} --force"
    return message


def _cuda_line(state: CudaState) -> str:
    if state.initialised:
        return (
            f"CUDA: already initialised in this kernel ({'; '.join(state.evidence)}). GPUs "
            "attached from now on are seen by new processes only."
        )
    return "CUDA: not started in this kernel; GPUs you attach now are usable here."


def _show(table: Table, context: MagicContext) -> None:
    """A table as HTML with a text fallback in a notebook, as 80-column text elsewhere."""
    if context.in_kernel:
        display_raw({"text/plain": table.text(), "text/html": render.CSS + table.html()})
    else:
        print(table.text())


def _status_tables(context: MagicContext) -> list[Table]:
    """This notebook's GPUs and, when a process uses one, which notebook uses how much of
    each (one NVML read)."""
    client = context.client()
    attachments: Sequence[Attachment] | str
    suspended: Suspension | None = None
    try:
        state = client.attachment_state()
        attachments, suspended = state.attachments, state.suspended
        released = client.idle_releases()
    except AgentClientError as error:
        attachments, released = error.message, ()
    with context.monitor() as monitor:
        snapshot = monitor.snapshot()
    status = reports.status_table(
        attachments,
        released,
        snapshot,
        cuda_line=_cuda_line(context.cuda()),
        suspended=suspended,
    )
    by_notebook = _attribution_table(snapshot, context)
    return [status] if by_notebook is None else [status, by_notebook]


def _attribution_table(snapshot: Snapshot, context: MagicContext) -> Table | None:
    """Each GPU's processes by the notebook they belong to, as far as this kernel can tell:
    a process carries its notebook in its environment (inherited from its kernel), or runs
    below this kernel. In a sandbox NVML's pids are the host's, so nothing is named here."""
    names = context.holders()
    sandboxed = SANDBOX_PID_ENV in context.environ
    tree = None if sandboxed else ProcessTree()
    uses = [
        (gpu, attribute(gpu.processes, names.kernel_name, tree))
        for gpu in snapshot.gpus
        if gpu.processes and gpu.mig is None
    ]
    if not uses:
        return None
    return reports.attribution_table(uses, notes=(reports.SANDBOXED_NOTE,) if sandboxed else ())


def _status(args: argparse.Namespace, context: MagicContext) -> None:
    for table in _status_tables(context):
        _show(table, context)


def _list(args: argparse.Namespace, context: MagicContext) -> None:
    gpus = context.client().gpus()
    _show(reports.node_table(gpus, holder=context.holders().name), context)


def _queue(args: argparse.Namespace, context: MagicContext) -> None:
    _show(reports.queue_table(context.client().queued()), context)


def load_seconds(text: str) -> float:
    """``--seconds S`` of ``load``: how long the helper keeps the GPUs busy."""
    return _seconds(text, what="--seconds", low=0.0, high=MAX_INTERVAL, low_inclusive=False)


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seconds",
        type=load_seconds,
        default=LOAD_SECONDS,
        metavar="S",
        help=f"how long to keep them busy (default {LOAD_SECONDS:g}; at most {MAX_INTERVAL:g})",
    )


def _load(args: argparse.Namespace, context: MagicContext) -> None:
    """Start the simulation's load helper in the background, from the kernel.

    Why a subcommand: the documented ``!python -m ...load &`` cannot work in a notebook
    (ipykernel refuses background processes in ``!`` lines), and a helper run in the
    foreground blocks the kernel for its whole duration — so a newcomer's charts stayed flat.
    The helper is a child of this kernel, so it runs in the kernel's sandbox (container)
    and holds exactly this kernel's GPU nodes, as a training run would.
    """
    for process in list(context.background):
        if process.poll() is not None:
            context.background.remove(process)
    nodes = gpu_nodes(context.dev)
    if not nodes:
        raise GpuCommandError(
            f"This kernel has no GPU to keep busy; attach one first ('{PROG} attach')."
        )
    argv = [sys.executable, "-m", "jupyter_gpu_hotplug.nvml.sim.load"]
    argv += ["--seconds", f"{args.seconds:g}"]
    if context.dev != Path("/dev"):
        argv += ["--dev", str(context.dev)]
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    context.background.append(process)
    # Return only once the helper holds the nodes (it says so after opening them): a detach
    # right after this cell must already be refused, as the message below promises.
    assert process.stdout is not None
    with process.stdout:
        announced = process.stdout.readline()
    if not announced:
        raise GpuCommandError(
            f"The load helper ended before it used the GPU (exit status {process.wait()})."
        )
    used = ", ".join(str(node) for node in nodes)
    print(
        f"SIMULATED load: process {process.pid} uses {used} for {args.seconds:g} s in the "
        "background; the GPU panel's charts climb within a few seconds. A plain detach is "
        f"refused while it runs ('{PROG} detach --force' ends it, as it would a training run)."
    )
    print("(On real GPUs this does nothing useful: run real work there.)")


def _add_monitor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=refresh_interval,
        default=1.0,
        metavar="S",
        help=f"seconds between refreshes (default 1; {MIN_INTERVAL:g} to {MAX_INTERVAL:g})",
    )


def _monitor(args: argparse.Namespace, context: MagicContext) -> None:
    if not context.in_kernel:
        for table in _status_tables(context):
            print(table.text())
        print(f"(The live monitor needs a notebook; '{PROG}' there shows it.)")
        return
    from IPython.display import display

    from .widget import GpuMonitorWidget

    widget = GpuMonitorWidget(interval=args.interval, cuda_state=context.cuda)
    display(widget)  # type: ignore[no-untyped-call]


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        name="attach",
        help="attach N GPUs (default 1) to this kernel",
        run=_attach,
        add_arguments=_add_attach_arguments,
    ),
    Subcommand(
        name="detach",
        help="detach a GPU (node index or UUID), or all",
        run=_detach,
        add_arguments=_add_detach_arguments,
    ),
    Subcommand(
        name="release",
        help="release all GPUs; --keep keeps the kernel's CUDA state",
        run=_release,
        add_arguments=_add_release_flags,
    ),
    Subcommand(
        name="status",
        help="this kernel's GPUs, their load, and what CUDA can see",
        run=_status,
    ),
    Subcommand(name="list", help="every GPU of this node and who holds it", run=_list),
    Subcommand(
        name="queue",
        help="this notebook's places in the wait queue",
        run=_queue,
    ),
    Subcommand(
        name="load",
        help="simulated GPUs: keep this kernel's GPUs busy for a while",
        run=_load,
        add_arguments=_add_load_arguments,
    ),
    Subcommand(
        name="monitor",
        help="the live GPU monitor (what the magic alone shows)",
        run=_monitor,
        add_arguments=_add_monitor_arguments,
    ),
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
        description="Attach and release GPUs in this running notebook. "
        f"'{PROG}' alone shows the live monitor.",
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
        if command.add_arguments is not None:
            command.add_arguments(sub)
        by_name[command.name] = sub
    return parser, by_name


def parse_line(line: str) -> tuple[Subcommand, argparse.Namespace]:
    """The subcommand a ``%gpu`` line asks for, and its arguments; ``UsageError`` if bad."""
    try:
        words: Sequence[str] = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"{PROG}: cannot split {line!r} into words: {e}") from e
    parser, subparsers = _build_parsers()
    args = parser.parse_args(words)
    if args.version:
        name = "version"
    elif args.help:
        name = "help"
    elif args.subcommand is None:
        name = "monitor"
        args = subparsers[name].parse_args([], namespace=args)
    else:
        name = args.subcommand
    return {command.name: command for command in SUBCOMMANDS}[name], args


def run_line(line: str, context: MagicContext | None = None) -> None:
    """Parse and run one ``%gpu`` line; kept apart from the Magics class so it is easy to test.

    ``AgentClientError``s become ``GpuCommandError`` with the client's message for people.
    """
    command, args = parse_line(line)
    try:
        command.run(args, context or MagicContext())
    except AgentClientError as error:
        raise GpuCommandError(error.message) from error


@magics_class
class GPUMagics(Magics):
    """Holds the ``%gpu`` magic; IPython instantiates it once per shell.

    ``context`` replaces the collaborators (tests); by default the agent comes from the
    environment the spawner set (``GPU_HOTPLUG_AGENT_URL``, ``GPU_HOTPLUG_TOKEN_PATH``).
    """

    def __init__(
        self, shell: InteractiveShell | None = None, *, context: MagicContext | None = None
    ) -> None:
        super().__init__(shell)
        self.context = context or MagicContext(shell=shell)

    @line_magic
    def gpu(self, line: str) -> None:
        """Attach and release GPUs in this running notebook; ``%gpu help`` lists subcommands."""
        run_line(line, self.context)


def register(ipython: InteractiveShell) -> None:
    """Register ``%gpu`` with ``ipython`` (called by ``%load_ext jupyter_gpu_hotplug``)."""
    ipython.register_magics(GPUMagics(ipython))
