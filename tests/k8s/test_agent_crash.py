"""The holder's writes, one crash window each: the agent is killed (``kill -9``) at every step
of an attach and of a detach, started again, and the holders, the kubelet, the container and
the agent's API must agree — every GPU usable in the container is held by exactly one holder
of its, every other GPU is free, and no device node the agent made is left behind.

An attach writes the holder twice: its create (``reserving``, whom it serves) and, once
PodResources named its GPU, one PATCH before the grant (the GPU, ``granted``, whether the grant
makes the device nodes). So a kill before that PATCH (``after_reserve``) leaves a holder that
knows no GPU, and the restarted agent deletes it: nothing was granted. A kill after it
(``after_intent``, before the grant; ``after_grant``; ``after_mark_granted``) leaves a holder
that says ``granted``, and the restarted agent finishes the attach — the GPU is granted again
where the grant had not happened. A detach writes ``releasing`` before its revoke, then deletes
the holder: a kill after either (``after_begin_release``, ``after_revoke``) is finished by the
restarted agent, never undone (a GPU someone gave up is not granted again).

The real node runs the attach's two rollback-or-finish cases against a real kubelet
(``tests/realnode/test_attach.py``); this tier runs every step, and counts the writes."""

from __future__ import annotations

import threading
from typing import Any, Final

import pytest

from jupyter_gpu_hotplug.agent.core.checkpoints import ATTACH_STEPS, DETACH_STEPS, marker_path
from jupyter_gpu_hotplug.agent.kubernetes.holders import ANNOTATION_STATE, ANNOTATION_UUID
from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from ..agent.api_harness import ApiClient
from ..fixtures.device_messages import ENXIO, EPERM
from .agent import WAIT, as_pod, devices_of, eventually, holders
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "crash"
COUNT = 2
"""GPUs per attach: two holders, whose writes run together."""

ATTACHED_AFTER_RESTART: Final = {
    "after_reserve": False,  # holders that know no GPU: deleted, nothing was granted
    "after_intent": True,  # the holders say granted, the grant had not happened: finished
    "after_grant": True,  # granted, the answer not given: finished
    "after_mark_granted": True,  # the attach was complete
    "after_begin_release": False,  # the holders say releasing: the detach is finished
    "after_revoke": False,  # revoked, the holders not yet deleted: finished
}
assert set(ATTACHED_AFTER_RESTART) == {*ATTACH_STEPS, *DETACH_STEPS}


def fresh_node_opens(kubelet: KubeletSimulator, minor: int) -> str:
    """What opening a device node of ``minor`` made anew in the notebook's container says:
    the device cgroup's permission alone (ENXIO: permitted, EPERM: refused)."""
    script = f"mknod /tmp/p{minor} c 195 {minor} 2>&1; cat /tmp/p{minor}; rm -f /tmp/p{minor}"
    result = kubelet.exec(NS, "nb", "notebook", ["sh", "-c", script])
    return result.stdout + result.stderr


def device_nodes(kubelet: KubeletSimulator) -> set[int]:
    """The minors of the ``/dev/nvidiaN`` nodes in the notebook's container."""
    listing = kubelet.exec(NS, "nb", "notebook", ["ls", "/dev"]).stdout.split()
    return {int(name[6:]) for name in listing if name.startswith("nvidia") and name[6:].isdigit()}


def attached(api: ApiClient) -> list[dict[str, Any]]:
    return list(api.get("/v1/attachments").json()["attachments"])


def _ignore_errors(call: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        call()
    except (ConnectionError, OSError):
        return


@pytest.mark.parametrize("step", ATTACHED_AFTER_RESTART)
def test_kill_9_at_each_step_then_holders_kubelet_and_container_agree(
    step: str, kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    gpus = {gpu.id: gpu.minor for gpu in kubelet.gpus}
    if step not in ATTACH_STEPS:
        answer = as_pod(k8s_agent, kube, NS, "nb").post("/v1/attachments", {"count": COUNT})
        assert answer.status == 201, answer.body
    k8s_agent.stop()
    k8s_agent.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": step})
    api = as_pod(k8s_agent, kube, NS, "nb")
    call = (
        (lambda: api.post("/v1/attachments", {"count": COUNT}))
        if step in ATTACH_STEPS
        else (lambda: api.delete("/v1/attachments"))
    )
    request = threading.Thread(target=lambda: _ignore_errors(call))
    request.start()
    marker = marker_path(k8s_agent.state_dir, step)
    eventually(marker.exists, f"the operation pauses {step}")
    paused = holders(kube, NS)
    assert len(paused) == COUNT
    annotations = [pod["metadata"]["annotations"] for pod in paused]
    if step == "after_reserve":
        assert not any(ANNOTATION_UUID in a for a in annotations), "no GPU recorded yet"
    if step == "after_intent":
        assert {a[ANNOTATION_STATE] for a in annotations} == {"granted"}, "the one PATCH landed"
        for uuid in (a[ANNOTATION_UUID] for a in annotations):
            assert EPERM in fresh_node_opens(kubelet, gpus[uuid]), "not granted yet"

    k8s_agent.kill9()
    request.join(timeout=WAIT)
    marker.unlink()
    k8s_agent.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": ""})
    api = as_pod(k8s_agent, kube, NS, "nb")

    expected = COUNT if ATTACHED_AFTER_RESTART[step] else 0
    eventually(lambda: len(holders(kube, NS)) == expected, f"{expected} holder(s) after {step}")
    eventually(lambda: len(devices_of(kubelet, NS)) == expected, "the kubelet agrees")
    held = devices_of(kubelet, NS)
    eventually(
        lambda: all(
            (ENXIO if uuid in held else EPERM) in fresh_node_opens(kubelet, minor)
            for uuid, minor in gpus.items()
        ),
        "exactly the held GPUs are usable in the container",
    )
    assert device_nodes(kubelet) == {gpus[uuid] for uuid in held}, "no node left behind"
    mine = attached(api)
    assert {a["uuid"] for a in mine} == held
    assert {a["holder"] for a in mine} == {
        f"{NS}/{p['metadata']['name']}" for p in holders(kube, NS)
    }

    # And the agent goes on: what is attached detaches, what is free attaches.
    if held:
        assert api.delete("/v1/attachments").status == 204
    else:
        again = api.post("/v1/attachments", {"count": COUNT})
        assert again.status == 201, again.body
        assert api.delete("/v1/attachments").status == 204
    eventually(lambda: holders(kube, NS) == [], "every holder is gone")
    assert device_nodes(kubelet) == set()


def test_one_attach_writes_its_holder_twice_and_one_detach_twice(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    """The writes a crash window needs, and no more (see the module docstring): an attach
    creates the holder and PATCHes it once; a detach PATCHes it once and deletes it. (Before:
    an attach PATCHed three times — the GPU, the nodes' intent, ``granted``.)"""
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")

    before = len(kube.requests)
    (attachment,) = api.post("/v1/attachments", {"count": 1}).json()["attachments"]
    attach_writes = kube.pod_writes(NS, since=before)
    before = len(kube.requests)
    assert api.delete(f"/v1/attachments/{attachment['uuid']}").status == 204
    detach_writes = kube.pod_writes(NS, since=before)

    assert attach_writes == ["POST", "PATCH"]
    assert detach_writes == ["PATCH", "DELETE"]
