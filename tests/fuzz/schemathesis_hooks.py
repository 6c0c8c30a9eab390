"""Hooks the schemathesis runs load (``SCHEMATHESIS_HOOKS``): never a pid of someone else,
never a long wait.

On this shared host a pid schemathesis makes up could name another engineer's process, and
the agent, running as root and called with its token, would grant it a (simulated) GPU. So
every pid a request names — a body's ``target.pid``, the ``pid`` query parameter — is replaced
by the victim sandbox's (``GPU_HOTPLUG_FUZZ_VICTIM_PID``), unless it cannot name a process
(below 2, above ``pid_max``, not an integer): those are kept, to be refused.

And once the victim holds every GPU, a valid attach with ``wait_seconds`` waits in the agent's
queue for as long as it says (up to 600 s): a valid wait is shortened to ``_MAX_WAIT`` so that
the run stays bounded (an invalid one is kept, to be refused).

And an attach naming its GPUs must name ``count`` of them, a rule between two members that
JSON Schema cannot state (the documents say it in words): where ``count`` is a positive
integer as JSON Schema reads one (``72`` or ``72.0``, as the APIs do: ``json_integer``) and
``gpus`` an array, the array is cut or filled up (with UUIDs no node has) to
``count`` entries (or, for a count too large to name, left out), so that a request the
schema calls valid is one the APIs accept; ``count`` itself is never changed, so an invalid
one is still refused.

And ``DELETE /v1/attachments`` takes ``force`` or ``keep``, never both true (keep suspends the
processes force would end), another rule OpenAPI cannot state between two query parameters
(the document says it in words): where both are true, ``keep`` is left out, so the request the
schema calls valid is the plain forced detach (an invalid value of either is kept, to be
refused). The server extension's ``POST detach`` body has the same rule, and one more: ``keep``
only with ``"uuid": "all"`` (the whole kernel is suspended); there ``keep`` is left out of a
body that breaks either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import schemathesis

from jupyter_gpu_hotplug._structs import json_integer
from tests.fuzz.schemathesis_run import VICTIM_ENV

_PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
_MAX_WAIT = 0.2
_MAX_NAMED = 256
"""The most GPUs a fuzzed attach names (more than any node has)."""


def _victim() -> int | None:
    value = os.environ.get(VICTIM_ENV)
    return None if value is None else int(value)


def _safe(pid: Any, victim: int) -> Any:
    """``pid`` if it cannot name a process of this host, else the victim's pid."""
    if isinstance(pid, bool):
        return pid
    if isinstance(pid, str) and pid.isdigit() and 2 <= int(pid) <= _PID_MAX:
        return str(victim)
    if isinstance(pid, int | float) and 2 <= pid <= _PID_MAX:
        return victim
    return pid


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    victim = _victim()
    if victim is None:
        return
    if isinstance(case.query, dict) and "pid" in case.query:
        case.query["pid"] = _safe(case.query["pid"], victim)
    if isinstance(case.query, dict):
        _force_or_keep(case.query)
    body = case.body if isinstance(case.body, dict) else {}
    target = body.get("target")
    if isinstance(target, dict) and "pid" in target:
        target["pid"] = _safe(target["pid"], victim)
    _name_count_gpus(body)
    _detach_keep(body)
    wait = body.get("wait_seconds")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and _MAX_WAIT < wait <= 600:
        body["wait_seconds"] = _MAX_WAIT


def _name_count_gpus(body: dict[str, Any]) -> None:
    """``gpus`` cut or filled up to ``count`` entries (module docstring)."""
    # ``count`` read as the APIs read it: schemathesis spells an ``integer`` as ``72.0`` too, a
    # count the APIs take (and so must be named in full) though it is no Python ``int``.
    count, gpus = json_integer(body.get("count")), body.get("gpus")
    if not isinstance(gpus, list) or not gpus or count is None or count < 1:
        return
    if count > _MAX_NAMED:
        # So many UUIDs would not fit a body: the request asks for any GPUs instead (a
        # count no node has is refused all the same).
        del body["gpus"]
        return
    del gpus[count:]
    filler = (f"GPU-ffffffff-0000-4000-8000-{i:012x}" for i in range(2 * _MAX_NAMED))
    gpus.extend(uuid for uuid in filler if uuid not in gpus)
    del gpus[count:]


_TRUE = ("true", "1")


def _force_or_keep(query: dict[str, Any]) -> None:
    """``keep`` left out where ``force`` is true too (module docstring)."""
    if query.get("force") in _TRUE and query.get("keep") in _TRUE:
        del query["keep"]


def _detach_keep(body: dict[str, Any]) -> None:
    """The server's detach body: ``keep`` left out where ``force`` is true or ``uuid`` is not
    ``"all"`` (module docstring); a ``keep`` that is not a boolean is kept, to be refused."""
    if body.get("keep") is True and (body.get("force") is True or body.get("uuid") != "all"):
        del body["keep"]
