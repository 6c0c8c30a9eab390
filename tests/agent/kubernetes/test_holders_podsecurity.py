"""Issue 21: holder pods pass PodSecurity ``restricted`` as the API server's admission plugin
judges it (the real ``k8s.io/pod-security-admission`` library, ``tests/fixtures/podsecurity.py``),
with every option the agent offers; the holder spec before issue 21 did not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod
from tests.fixtures.podsecurity import PodSecurityUnavailable, evaluate, evaluator

pytestmark = pytest.mark.slow

NOTEBOOK: Any = {
    "metadata": {"namespace": "team-a", "name": "jupyter-alice", "uid": "u-1"},
    "spec": {"priorityClassName": "notebooks", "containers": [{"name": "notebook"}]},
}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    try:
        evaluator()
    except PodSecurityUnavailable as e:
        pytest.skip(str(e))


def holder(spec: HolderSpec) -> dict[str, Any]:
    return holder_pod(
        NOTEBOOK,
        container="notebook",
        container_id="containerd://" + "ab" * 32,
        request_id=None,
        index=0,
        spec=spec,
    )


@pytest.mark.parametrize(
    "spec",
    [
        HolderSpec(node_name="gpu-1"),
        HolderSpec(
            node_name="gpu-1",
            resource_name="nvidia.com/mig-1g.10gb",
            priority_class="",
            pull_policy="Always",
            pull_secrets=("mirror",),
            cpu="20m",
            memory="32Mi",
        ),
    ],
    ids=["defaults", "every-option"],
)
def test_a_holder_is_restricted_compliant(spec: HolderSpec) -> None:
    verdict = evaluate(holder(spec), "restricted")
    assert verdict == {"allowed": True, "reasons": "", "details": ""}


def test_the_check_bites_the_holder_of_before_issue_21() -> None:
    """Without seccomp RuntimeDefault (the holders of c934cfa) a restricted namespace refuses
    it: the evaluator is not one that allows everything."""
    pod = copy.deepcopy(holder(HolderSpec(node_name="gpu-1")))
    del pod["spec"]["securityContext"]["seccompProfile"]
    verdict = evaluate(pod, "restricted")
    assert verdict["allowed"] is False and verdict["reasons"] == "seccompProfile"
