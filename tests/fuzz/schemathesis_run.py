"""Running schemathesis (PyPI, 4.x) against one of our APIs, as CI runs the fuzz tier.

Why the CLI in a subprocess rather than the library inside pytest: the CLI runs every phase
(the document's examples, coverage of each rule's edges, fuzzing, stateful sequences built from
the responses) with every check (``--checks all``: 5xx, undocumented status or content type,
response schema, schema-valid requests refused, schema-invalid ones accepted, missing ``Allow``
on a 405, ignored authentication, ...), and a server under test in this process (the Jupyter
server) keeps serving while it runs. Bounded (``MAX_EXAMPLES`` per operation and phase) and
derandomized (a fixed seed and deterministic generation, which keeps no example database) so
that a CI failure reproduces exactly from the same commit; the hooks (``schemathesis_hooks``)
keep generated pids away from the host's processes and waits short. The report of a failure
is the CLI's own output.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

VICTIM_ENV = "GPU_HOTPLUG_FUZZ_VICTIM_PID"
"""Where the hooks learn the victim sandbox's pid."""
MAX_EXAMPLES = 40
SEED = 20261127
_HOOKS = "tests.fuzz.schemathesis_hooks"
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Outcome:
    returncode: int
    output: str


def command(
    document: str,
    *,
    headers: Mapping[str, str],
    base_url: str | None = None,
    exclude_paths: Sequence[str] = (),
) -> list[str]:
    """The CLI's command line for one document (a URL or a file)."""
    argv = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        document,
        "--checks",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        # Deterministic generation: no randomness and no example database.
        "--generation-deterministic",
        "--no-color",
        "--request-timeout",
        "30",
        "--workers",
        "1",
    ]
    for name, value in headers.items():
        argv += ["--header", f"{name}: {value}"]
    if base_url is not None:
        argv += ["--url", base_url]
    for path in exclude_paths:
        argv += ["--exclude-path", path]
    return argv


def _environment(victim_pid: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["SCHEMATHESIS_HOOKS"] = _HOOKS
    # The hooks module is imported from this checkout, whatever the working directory.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_ROOT), env.get("PYTHONPATH"))))
    if victim_pid is not None:
        env[VICTIM_ENV] = str(victim_pid)
    return env


async def run(argv: Sequence[str], *, victim_pid: int | None = None) -> Outcome:
    """Run the CLI to its end without blocking the event loop (a server of this process may be
    the one under test)."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=_ROOT,
        env=_environment(victim_pid),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode is not None
    return Outcome(process.returncode, output.decode(errors="replace"))
