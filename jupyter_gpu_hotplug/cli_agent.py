"""``jupyter gpu-hotplug agent|attach|detach|status``: the node agent and its terminal clients.

``agent`` runs the node agent (``agent/app.py``); its options are traitlets flags
(``--listen``, ``--simulate``...; ``jupyter gpu-hotplug agent --help-all`` lists them), handed
over untouched. ``attach``, ``detach`` and ``status`` talk to a running agent through the shared
``AgentClient`` — over the unix socket (default ``unix:/run/gpu-hotplug/agent.sock``: a process
acts on its own container without a token) or over TCP with the agent's token — and print for
people, or JSON with ``--json``.

Where the agent is: ``--agent-url``, else ``$GPU_HOTPLUG_AGENT_URL``, else the default socket.
The token: ``--token-file``, else ``$GPU_HOTPLUG_TOKEN_PATH``, else the local agent's
``/var/lib/gpu-hotplug/token`` when this user can read it, else none.

This module is imported for ``--help``, so everything heavy is imported inside the commands.
Exit codes: 0 done, 1 the agent refused or could not be reached (the message says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ._structs import PidRef, TargetRef
    from .client import AgentClient, Attachment, Gpu, Suspension

__all__ = [
    "AGENT_HELP",
    "ATTACH_HELP",
    "DETACH_HELP",
    "STATUS_HELP",
    "add_attach_arguments",
    "add_detach_arguments",
    "add_status_arguments",
    "holder_name",
    "run_agent",
    "run_attach",
    "run_detach",
    "run_status",
]

AGENT_HELP: Final = "run the node agent (as root; --help-all lists its options)"
ATTACH_HELP: Final = "attach GPUs to this container (or to --pid)"
DETACH_HELP: Final = "detach one GPU by UUID, or all of them"
STATUS_HELP: Final = "show the node's GPUs and this container's attachments"

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
LOCAL_TOKEN: Final = Path("/var/lib/gpu-hotplug/token")
_CUDA_NOTE: Final = (
    "note: processes that initialised CUDA before the attach keep their old device list; "
    "start a new process (or restart the kernel) to use the GPU"
)


# --- agent -------------------------------------------------------------------------------------


def run_agent(args: argparse.Namespace) -> int:
    from .agent.app import main

    argv: list[str] = args.argv
    return main(argv)


# --- arguments of the clients ------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--agent-url",
        metavar="URL",
        help="the agent: unix:/path or http://host:port (default: $GPU_HOTPLUG_AGENT_URL, "
        "else unix:/run/gpu-hotplug/agent.sock)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        type=Path,
        help="file with the agent's bearer token (default: $GPU_HOTPLUG_TOKEN_PATH, else "
        f"{LOCAL_TOKEN} if readable); needed over TCP and to act on other containers",
    )
    parser.add_argument(
        "--pid",
        type=int,
        help="act on this process's container instead of your own (needs the token)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def add_attach_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("count", nargs="?", type=int, default=1, help="how many GPUs (default: 1)")
    parser.add_argument(
        "--request-id", help="makes a retried attach idempotent (default: a fresh id)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        metavar="S",
        help="wait up to S seconds in the agent's queue when no GPU is free",
    )
    parser.add_argument(
        "--mig", metavar="PROFILE", help="attach MIG slices of this profile (e.g. 1g.10gb)"
    )
    parser.add_argument(
        "--idle",
        type=float,
        metavar="S",
        help="let the agent take the GPUs back after S seconds unused",
    )
    parser.add_argument(
        "--gpu",
        metavar="INDEX|UUID",
        help="attach this GPU of the node (its index as 'status' and the host's nvidia-smi "
        "show it, or its UUID) rather than any free one; not in Kubernetes mode",
    )
    parser.add_argument(
        "--model",
        metavar="TEXT",
        help="attach only GPUs whose product name contains TEXT, in any case (e.g. H100); "
        "not with --gpu or --mig, not in Kubernetes mode with the device plugin",
    )
    parser.add_argument(
        "--min-memory",
        metavar="SIZE",
        help="attach only GPUs with at least SIZE of memory, as Kubernetes reads it: 80G "
        "(10**9 bytes) or 40Gi (2**30); the same limits as --model",
    )
    _common(parser)


def add_detach_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "what",
        nargs="?",
        default="all",
        metavar="INDEX|UUID|all",
        help="a GPU's index on the node (as 'status' and the host's nvidia-smi show it), its "
        "UUID or the unique beginning of one, or all",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="kill the processes that hold the GPU open instead of refusing",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the CUDA state: suspend the processes that use the GPUs into host memory "
        "(the CUDA driver's checkpoint API), then detach all of them; the next attach "
        "resumes them (only with all, never with --force; local mode)",
    )
    _common(parser)


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)


# --- the clients -------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> AgentClient:
    from .client import AGENT_URL_ENV, DEFAULT_AGENT_URL, TOKEN_PATH_ENV, AgentClient

    url = args.agent_url or os.environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL
    token_path: Path | None = args.token_file
    if token_path is None and os.environ.get(TOKEN_PATH_ENV):
        token_path = Path(os.environ[TOKEN_PATH_ENV])
    if token_path is None and os.access(LOCAL_TOKEN, os.R_OK):
        token_path = LOCAL_TOKEN
    return AgentClient(url, token_path=token_path)


def _target(args: argparse.Namespace) -> PidRef | None:
    from ._structs import PidRef

    return None if args.pid is None else PidRef(args.pid)


def _fail(args: argparse.Namespace, error: Exception) -> int:
    from .client import AgentError

    message = getattr(error, "message", str(error))
    if args.json:
        body: dict[str, object] = {"error": getattr(error, "code", "") or "client_error"}
        body["message"] = message
        if isinstance(error, AgentError):
            body.update(error.extra)
        print(json.dumps(body), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_FAILED


def _attachment_line(attachment: Attachment) -> str:
    """The node's number first, the UUID last (for copying), as every view gives them."""
    return (
        f"GPU {attachment.index}  {attachment.device:<14} {attachment.name}  "
        f"(to {attachment.target})  {attachment.uuid}"
    )


def run_attach(args: argparse.Namespace) -> int:
    from .client import AgentClientError, InsufficientGpus, normalise_selector

    if args.count < 1:
        print("error: the count must be at least 1", file=sys.stderr)
        return 2
    if args.gpu is not None and (args.count != 1 or normalise_selector(args.gpu) is None):
        print(
            "error: --gpu names one GPU, by its index (0, 1, ...) or UUID: leave the count out",
            file=sys.stderr,
        )
        return 2
    client = _client(args)
    try:
        named = [] if args.gpu is None else [_resolve(client, args.gpu)[0]]
        attached = client.attach(
            args.count,
            target=_target(args),
            request_id=args.request_id,
            wait_seconds=args.wait,
            mig=args.mig,
            idle_release_seconds=args.idle,
            gpus=named,
            model=args.model,
            min_memory=args.min_memory,
        )
    except ValueError as error:
        return _fail(args, error)
    except AgentClientError as error:
        if (
            isinstance(error, InsufficientGpus)
            and error.retryable
            and args.wait is None
            and not args.json
        ):
            print(f"error: {error.message}", file=sys.stderr)
            print("to wait for one in the queue: add --wait SECONDS", file=sys.stderr)
            return EXIT_FAILED
        return _fail(args, error)
    if args.json:
        print(json.dumps({"attachments": [a.raw for a in attached]}, indent=2))
        return EXIT_OK
    print(f"attached {len(attached)} GPU{'s' if len(attached) != 1 else ''}:")
    for attachment in attached:
        print(f"  {_attachment_line(attachment)}")
    print(_CUDA_NOTE)
    return EXIT_OK


def _resolve(client: AgentClient, what: str) -> tuple[str, int | None]:
    """The UUID that ``what`` (a node index or a UUID beginning) names on this node, and its
    index there (``None``: a full UUID the node does not list); raises ``ValueError`` with
    what to type instead when it names none or several."""
    from .client import normalise_selector, select_gpus

    selector = normalise_selector(what)
    if selector is None:
        raise ValueError(f"expected all, a GPU index (0, 1, ...) or a GPU UUID, got {what!r}")
    gpus = client.gpus()
    chosen = select_gpus(selector, gpus)
    if len(chosen) == 1:
        return chosen[0].uuid, chosen[0].index
    if not chosen and len(selector) == 40:  # a full UUID the node does not list: the agent says
        return selector, None
    listing = "; ".join(f"{gpu.index} = {gpu.uuid}" for gpu in gpus) or "no GPU"
    which = "no GPU" if not chosen else f"{len(chosen)} GPUs"
    raise ValueError(f"{what!r} names {which} of this node ({listing})")


def run_detach(args: argparse.Namespace) -> int:
    from .client import AgentClientError

    client = _client(args)
    index: int | None = None
    if args.keep and args.what != "all":
        return _fail(args, ValueError("--keep detaches all GPUs (the CUDA state is kept whole)"))
    try:
        if args.what == "all":
            client.detach_all(target=_target(args), force=args.force, keep=args.keep)
        else:
            args.what, index = _resolve(client, args.what)
            client.detach(args.what, force=args.force)
    except (AgentClientError, ValueError) as error:
        return _fail(args, error)
    if args.keep:
        return _kept(args, client)
    if args.json:
        print(json.dumps({"detached": args.what}))
    elif args.what == "all":
        print("detached all GPUs")
    else:
        # The node's number first, as nvidia-smi and every other view give it (issue 36).
        print(f"detached {args.what}" if index is None else f"detached GPU {index} ({args.what})")
    return EXIT_OK


def _kept(args: argparse.Namespace, client: AgentClient) -> int:
    """After ``detach all --keep``: what the agent kept, read back from it (nothing, when no
    process used the GPUs: the agent then detached them plainly)."""
    from .client import AgentClientError

    try:
        suspended = client.attachment_state(_target(args)).suspended
    except AgentClientError as error:
        return _fail(args, error)
    if args.json:
        print(json.dumps({"detached": "all", "suspended": _suspended_wire(suspended)}))
    elif suspended is None:
        print("detached all GPUs; no process used them: no CUDA state to keep")
    else:
        print(f"detached all GPUs; {_suspended_line(suspended)}")
    return EXIT_OK


def _suspended_wire(suspended: Suspension | None) -> object:
    return None if suspended is None else dataclasses.asdict(suspended)


def _suspended_line(suspended: Suspension) -> str:
    from .kernel.render import suspended_state

    return (
        f"{suspended_state(suspended)}: the next attach resumes it on "
        f"{len(suspended.uuids)} free {suspended.model} GPU(s)"
    )


def holder_name(target: TargetRef) -> str:
    """Who holds a GPU in words a person knows: a kernel's notebook (jupyter_server puts its
    path in the kernel's environment), else the agent's name for it (process, pod)."""
    from ._structs import PidRef as Pid
    from .kernel.holders import session_in_tree

    notebook = session_in_tree(target.pid) if isinstance(target, Pid) else None
    return f"{notebook} ({target})" if notebook else str(target)


def _gpu_line(gpu: Gpu) -> str:
    owner = "" if gpu.target is None else f" -> {holder_name(gpu.target)}"
    simulated = " [simulated]" if gpu.simulated and "simulated" not in gpu.name else ""
    memory = f"{gpu.memory_total / 2**30:.0f} GiB"
    return (
        f"{gpu.index:>2}  {gpu.device:<14} {gpu.uuid}  {gpu.name}{simulated}  {memory:>8}  "
        f"{gpu.state}{owner}"
    )


def run_status(args: argparse.Namespace) -> int:
    from .client import AgentClientError, Forbidden, InvalidRequest, NotFound

    client = _client(args)
    try:
        gpus = client.gpus()
    except AgentClientError as error:
        return _fail(args, error)
    attachments: Sequence[Attachment] | None
    suspended: Suspension | None = None
    try:
        state = client.attachment_state(_target(args))
        attachments, suspended = state.attachments, state.suspended
    except (Forbidden, InvalidRequest, NotFound):
        # e.g. over TCP without --pid, or from the host rather than a container
        attachments = None
    except AgentClientError as error:
        return _fail(args, error)
    if args.json:
        print(
            json.dumps(
                {
                    "gpus": [gpu.raw for gpu in gpus],
                    "attachments": None if attachments is None else [a.raw for a in attachments],
                    "suspended": _suspended_wire(suspended),
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(f"GPUs of this node ({len(gpus)}):" if gpus else "this node has no GPUs")
    for gpu in gpus:
        print(f"  {_gpu_line(gpu)}")
    if attachments is None:
        # The usual case on the host (the demo's banner): this shell is in no container.
        print("this shell: no GPUs of its own (--pid N shows those of a process)")
    elif not attachments:
        print("attached here: none")
    else:
        print(f"attached here ({len(attachments)}):")
        for attachment in attachments:
            print(f"  {_attachment_line(attachment)}")
    if suspended is not None:
        print(f"suspended here: {_suspended_line(suspended)}")
    return EXIT_OK
