"""Attack 2: a GPU handed to a second container while the first still holds it open.

A live target holding ``/dev/nvidia<minor>`` open moves itself into a child cgroup of its
own (a container with a writable cgroupfs, or a delegated cgroup2 subtree, may). The
reconciler looked for the target in its container's exact cgroup, decided it had exited,
withdrew the grant from cgroups it called empty (they were not) and released the GPU, which
the next attach gave to another container. A container is its cgroup subtree: nothing is
released while any process below its cgroups lives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.agent_process import AgentProcess
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory

from .helpers import tcp

pytestmark = [*needs_root, pytest.mark.slow]


def test_target_moved_into_its_own_child_cgroup_keeps_its_gpu(
    tmp_path: Path, sandbox_factory: SandboxFactory
) -> None:
    agent = AgentProcess(tmp_path / "state", simulate=1, extra_args=["--reconcile-interval=0"])
    agent.start()
    first, second = sandbox_factory(), sandbox_factory()
    children: list[Path] = []
    try:
        answer = tcp(agent).post("/v1/attachments", {"count": 1, "target": {"pid": first.pid}})
        assert answer.status == 201, answer.body
        (attachment,) = answer.json()["attachments"]
        device = f"/dev/nvidia{attachment['minor']}"
        assert first.hold(device) == "ENXIO"  # open, and kept open
        for directory in first.sandbox.cgroups.dirs():
            child = directory / "moved"
            child.mkdir()
            children.append(child)
            (child / "cgroup.procs").write_text(str(first.pid))

        agent.kill9()
        agent.start()  # the start-up reconciliation looks at every target

        taken = tcp(agent).post("/v1/attachments", {"count": 1, "target": {"pid": second.pid}})
        assert taken.status == 409, f"the GPU went to a second container: {taken.body!r}"
        assert taken.json()["error"] == "insufficient_gpus"
        listed = tcp(agent).get(f"/v1/attachments?pid={first.pid}").json()["attachments"]
        assert [a["uuid"] for a in listed] == [attachment["uuid"]]
        assert first.open(device) == "ENXIO"
    finally:
        agent.kill9()
        for child in children:
            (child.parent / "cgroup.procs").write_text(str(first.pid))
            child.rmdir()
