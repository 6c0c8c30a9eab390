"""``admission.decide``, table-tested like ``seams.TRANSITIONS``: every row is a demand, the
node as one decision sees it, and what must happen — the order of the rules is the contract
(``core/admission.py``): too many for the node (409, not retryable), then a limit (403, never
queued), then enough free beyond the head's hold is served, else wait or 409."""

from __future__ import annotations

import pytest

from jupyter_gpu_hotplug.agent.core.admission import (
    Availability,
    Decision,
    Demand,
    Limit,
    Queue,
    Refuse,
    Serve,
    decide,
)
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, InsufficientGpus

AT_ONCE = Demand(1, may_wait=False)
MAY_WAIT = Demand(1, may_wait=True)
WAITING = Demand(1, may_wait=True, waiting=True)
TWO = Demand(2, may_wait=True)
FULL = Limit(count=1, held=1, source="its max-gpus annotation is '1'")
ROOM = Limit(count=2, held=1)

Expected = type[Serve] | type[Queue] | tuple[type[Refuse], str, bool]
"""The decision's kind; a refusal as (Refuse, error code, retryable)."""

TABLE: list[tuple[str, Demand, Availability, Expected]] = [
    ("free, at once", AT_ONCE, Availability(total=4, free=1), Serve),
    ("free, may wait", MAY_WAIT, Availability(total=4, free=1), Serve),
    (
        "none free, at once",
        AT_ONCE,
        Availability(total=4, free=0),
        (Refuse, "insufficient_gpus", True),
    ),
    ("none free, may wait", MAY_WAIT, Availability(total=4, free=0), Queue),
    (
        "the free one held by the head, at once",
        AT_ONCE,
        Availability(total=4, free=1, held=1),
        (Refuse, "insufficient_gpus", True),
    ),
    (
        "the free one held by the head, may wait",
        MAY_WAIT,
        Availability(total=4, free=1, held=1),
        Queue,
    ),
    (
        "more than the node has, may wait",
        TWO,
        Availability(total=1, free=1),
        (Refuse, "insufficient_gpus", False),
    ),
    (
        "at its limit, may wait",
        MAY_WAIT,
        Availability(total=4, free=0, limits=(ROOM, FULL)),
        (Refuse, "forbidden", False),
    ),
    (
        "at its limit, free GPUs",
        AT_ONCE,
        Availability(total=4, free=4, limits=(FULL,)),
        (Refuse, "forbidden", False),
    ),
    ("under every limit", AT_ONCE, Availability(total=4, free=1, limits=(ROOM,)), Serve),
    (
        "the node first, then the limit",
        TWO,
        Availability(total=1, free=0, limits=(FULL,)),
        (Refuse, "insufficient_gpus", False),
    ),
    (
        "waiting: its limit was checked when it joined",
        WAITING,
        Availability(total=4, free=1, limits=(FULL,)),
        Serve,
    ),
    ("waiting, nothing free: waits on", WAITING, Availability(total=4, free=0), Queue),
    (
        "waiting, the node lost GPUs under its count",
        Demand(2, may_wait=True, waiting=True),
        Availability(total=1, free=1),
        (Refuse, "insufficient_gpus", False),
    ),
    ("named GPUs: no total", AT_ONCE, Availability(total=0, free=1), Serve),
]


@pytest.mark.parametrize(
    ("demand", "availability", "expected"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_every_row_of_the_table(
    demand: Demand, availability: Availability, expected: Expected
) -> None:
    decision: Decision = decide(demand, availability)
    if isinstance(expected, tuple):
        kind, code, retryable = expected
        assert isinstance(decision, kind)
        assert (decision.error.code, decision.error.retryable) == (code, retryable)
    else:
        assert type(decision) is expected


def test_a_refusal_says_what_the_head_holds_and_what_limit_binds() -> None:
    held = decide(AT_ONCE, Availability(total=4, free=1, held=1))
    assert isinstance(held, Refuse) and isinstance(held.error, InsufficientGpus)
    assert "held for the request first in the queue" in held.error.message
    limited = decide(AT_ONCE, Availability(total=4, free=4, limits=(ROOM, FULL)))
    assert isinstance(limited, Refuse) and isinstance(limited.error, Forbidden)
    assert "max-gpus" in str(limited.error)
