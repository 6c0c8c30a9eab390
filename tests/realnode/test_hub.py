"""The user's path through a real JupyterHub on the real node (``hub.py``): KubeSpawner spawns
a CPU-only notebook from the notebook image; the notebook's server extension attaches a GPU
through its node's agent (the DaemonSet, ``--driver-files=cdi``) with the pod's own token; the
kernel's side of the container then has the GPU's node and the driver's NVML; stopping the
server from the hub gives the GPU back.

The node runs in ``cdi`` mode (the GPU Operator >= 25.10's setup), so the notebook starts with
no driver library at all and gets ``libnvidia-ml.so.1`` from the agent with its GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from ..browser.gpu_lab import LOAD_TIMEOUT_MS
from ..demo.jupyter_api import Response
from ..fixtures.requirements import needs_root
from ..image.agent_image import BUILD_TIMEOUT
from .agent import install_agent_account
from .cluster import Cluster, eventually
from .deployment import deployed_agent
from .hub import (
    IDLE_PROFILE,
    IDLE_SECONDS,
    MAX_GPUS,
    NAMESPACE,
    Hub,
    running_hub,
    wait_ready,
)
from .hub_browser import NVML_PROBE, SPAWN_TIMEOUT_MS, log_in_and_start

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]


@pytest.fixture(scope="module")
def hub(cdi_cluster: Cluster) -> Iterator[Hub]:
    install_agent_account(cdi_cluster)
    with deployed_agent(cdi_cluster, "cdi") as agent_ip, running_hub(cdi_cluster, agent_ip) as hub:
        yield hub


def start_server(hub: Hub, user: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start ``user``'s server from the hub (its default profile unless ``options``); the
    notebook pod once the hub says the server is ready."""
    answer = hub.rest.request("POST", f"hub/api/users/{user}/server", options or {})
    assert answer.status in (201, 202), answer

    def ready() -> bool:
        answer = hub.rest.request("GET", f"hub/api/users/{user}")
        assert answer.status == 200, answer
        server = answer.body["servers"].get("")
        return bool(server and server["ready"])

    eventually(ready, f"{user}'s server is ready", 600)
    pod = hub.server_pod(user)
    assert pod is not None
    return pod


def stop_server(hub: Hub, user: str) -> None:
    answer = hub.rest.request("DELETE", f"hub/api/users/{user}/server")
    assert answer.status in (202, 204), answer
    eventually(lambda: hub.server_pod(user) is None, f"{user}'s notebook pod is gone", 300)
    eventually(lambda: hub.server_stopped(user), f"the hub is done stopping {user}'s server")


def nvml_in(hub: Hub, pod: dict[str, Any]) -> Any:
    """What NVML says in the notebook container (a new process, as a kernel started now)."""
    seen = hub.cluster.exec(
        NAMESPACE, pod["metadata"]["name"], ["python3", "-c", NVML_PROBE], timeout=60
    )
    assert seen.exit_code == 0, seen.stderr
    return json.loads(seen.stdout)


def extension(hub: Hub, user: str, method: str, path: str, body: Any = None) -> Response:
    """The notebook server's own GPU API (``/user/<user>/gpu-hotplug/api/<path>``)."""
    return hub.user_server(user).server.request(method, f"gpu-hotplug/api/{path}", body)


def restart_hub(hub: Hub) -> None:
    """Delete the hub's pod; return once its Deployment's new pod answers through the proxy."""
    (old,) = hub.cluster.pods(NAMESPACE, "component=hub")
    hub.cluster.delete_pod(NAMESPACE, old["metadata"]["name"])
    eventually(
        lambda: (
            [p["metadata"]["uid"] for p in hub.cluster.pods(NAMESPACE, "component=hub")]
            not in ([], [old["metadata"]["uid"]])
        ),
        "the hub's Deployment made a new hub pod",
    )
    wait_ready(hub.cluster, "hub")

    def answers() -> bool:
        try:
            return hub.rest.request("GET", "hub/api/users/alice", timeout=10).status == 200
        except OSError:  # the proxy's connection to the old pod's address hangs, then fails
            return False

    # Through the proxy, once the Service leads to the new pod.
    eventually(answers, "the new hub answers through the proxy")


# The module's fixture builds three images on a cold cache before the hub's own waits. One
# spawn for the whole story: spawns are the tier's dearest step on 2 cores.
@pytest.mark.timeout(3 * BUILD_TIMEOUT + 1800)
def test_hub_cpu_notebook_kernel_attaches_a_gpu_survives_hub_restart_and_stop_server_frees_it(
    hub: Hub,
) -> None:
    pod = start_server(hub, "alice")
    spec = pod["spec"]
    (notebook,) = spec["containers"]
    # What configure_kubespawner and the values' snippet give, once each (both ran).
    assert [v["name"] for v in spec["volumes"]].count("gpu-hotplug-token") == 1
    assert spec.get("runtimeClassName") is None
    env = {e["name"]: e.get("value") for e in notebook.get("env", [])}
    assert env["GPU_HOTPLUG_AGENT_URL"] == "http://gpu-hotplug-agent.gpu-hotplug.svc:8477"
    assert not any(name.startswith("NVIDIA_") for name in env), env
    server = hub.user_server("alice").server
    try:
        kernel_id = server.start_kernel()
        with server.connect(kernel_id) as kernel:
            # A CPU notebook: no GPU, no driver library.
            assert "NVML Shared Library Not Found" in kernel.run(NVML_PROBE).json()
            attached = extension(hub, "alice", "POST", "attach", {"count": 1})
            assert attached.status == 201, attached
            (attachment,) = attached.body["attachments"]
            assert attachment["target"]["pod"]["name"] == pod["metadata"]["name"]
            # The kernel that asked before sees it now, without a restart.
            assert kernel.run(NVML_PROBE).json() == [attachment["uuid"]]
            kernel.run("state = 42")
        (holder,) = hub.cluster.holders(NAMESPACE)
        assert holder["spec"]["nodeName"] == hub.cluster.node_name

        # The hub restarts (its pod deleted): the server, its kernel and its GPU stay.
        restart_hub(hub)
        answer = hub.rest.request("GET", "hub/api/users/alice")
        assert answer.body["servers"][""]["ready"], answer
        same = hub.server_pod("alice")
        assert same is not None and same["metadata"]["uid"] == pod["metadata"]["uid"]
        with server.connect(kernel_id) as kernel:
            assert kernel.run("print(state)").stdout.strip() == "42"
            assert kernel.run(NVML_PROBE).json() == [attachment["uuid"]]
        assert len(hub.cluster.holders(NAMESPACE)) == 1

        detached = extension(hub, "alice", "POST", "detach", {"uuid": "all"})
        assert detached.status == 204, detached
        eventually(lambda: hub.cluster.holders(NAMESPACE) == [], "the detach frees the GPU")
        assert "NVML Shared Library Not Found" in nvml_in(hub, pod)

        # Attached again, then the server stopped from the hub: its holder goes with it.
        attached = extension(hub, "alice", "POST", "attach", {"count": 1})
        assert attached.status == 201, attached
        assert len(hub.cluster.holders(NAMESPACE)) == 1
    finally:
        stop_server(hub, "alice")
    # The holder's owner (the notebook pod) is gone: the garbage collector takes the holder.
    eventually(lambda: hub.cluster.holders(NAMESPACE) == [], "the holder is garbage-collected")


@pytest.mark.timeout(1500)
def test_hub_browser_attach_from_the_toolbar_the_kernel_sees_the_gpu_and_stop_server_frees_it(
    hub: Hub, chromium: Browser
) -> None:
    lab, _ = log_in_and_start(chromium, hub, "alice")
    try:
        assert lab.run_probe() == "[]"
        lab.choose("Attach 1 GPU")
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"))
        [gpu] = lab.attached()
        lab.run_all()
        assert lab.run_probe() == f"['{gpu['device']}']"
        expect(lab.cell_output(1)).to_contain_text("This notebook: 1 GPU attached")
        expect(lab.cell_output(1)).to_contain_text(gpu["device"])
        expect(lab.cell_output(2)).to_contain_text(gpu["uuid"])
        expect(lab.summary).to_have_text(re.compile(r"^1 GPU"))
        (holder,) = hub.cluster.holders(NAMESPACE)
        assert holder["spec"]["nodeName"] == hub.cluster.node_name

        lab.choose(f"Detach GPU {gpu['index']}")
        lab.confirm("Detach")
        expect(lab.summary).to_have_text(re.compile(r"^0 attached"))
        eventually(lambda: hub.cluster.holders(NAMESPACE) == [], "the detach frees the GPU")

        # Attached again, then the server stopped from the hub's control panel.
        lab.choose("Attach 1 GPU")
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"))
        assert len(hub.cluster.holders(NAMESPACE)) == 1
        lab.page.goto(f"{hub.url}/hub/home", timeout=LOAD_TIMEOUT_MS)
        lab.page.locator("#stop").click()
        expect(lab.page.locator("#start")).to_be_visible(timeout=SPAWN_TIMEOUT_MS)
        eventually(lambda: hub.server_pod("alice") is None, "alice's notebook pod is gone", 300)
        eventually(lambda: hub.server_stopped("alice"), "the hub is done stopping it")
        eventually(lambda: hub.cluster.holders(NAMESPACE) == [], "the holder is garbage-collected")
        assert lab.log.errors_mentioning("gpu") == []
    finally:
        lab.close()
        if hub.server_pod("alice") is not None:
            stop_server(hub, "alice")


@pytest.mark.timeout(1800)
def test_hub_two_users_b_cannot_see_or_detach_as_gpu_waits_for_it_and_idle_release_is_announced(
    hub: Hub, chromium: Browser
) -> None:
    alice, alice_host = log_in_and_start(chromium, hub, "alice")
    # Bob's profile releases GPUs unused for IDLE_SECONDS (its pod's annotation).
    bob, bob_host = log_in_and_start(chromium, hub, "bob", IDLE_PROFILE)
    alice_pod = hub.server_pod("alice")
    assert alice_pod is not None
    try:
        # Every whole GPU of the node (the MIG GPU's slices are another resource).
        taken = extension(hub, "alice", "POST", "attach", {"count": MAX_GPUS})
        assert taken.status == 201, taken
        mine = taken.body["attachments"]
        expect(bob.button).to_have_attribute(
            "aria-label", "GPUs: none attached to this notebook, 0 free"
        )
        # B cannot see A's GPUs: not in B's kernel, not named in B's listings.
        assert bob.run_probe() == "[]"
        for path in ("gpus", "attribution"):
            seen = bob_host.server.request("GET", f"gpu-hotplug/api/{path}")
            assert seen.status == 200, seen
            assert alice_pod["metadata"]["name"] not in json.dumps(seen.body), (path, seen)
        # B cannot detach A's GPU: its server asks the agent for B's pod, which holds none.
        refused = bob_host.server.request(
            "POST", "gpu-hotplug/api/detach", {"uuid": mine[0]["uuid"]}
        )
        assert refused.status in (403, 404, 409), refused
        assert len(hub.cluster.holders(NAMESPACE)) == MAX_GPUS

        bob.choose("Wait for a free GPU and attach it")
        # His place in the agent's queue, which his server reads for his pod.
        expect(bob.button).to_have_text("queued #1")
        expect(bob.button).to_have_attribute(
            "aria-label", "GPUs: waiting for a free GPU… position 1 of 1"
        )
        freed = mine[0]
        answer = alice_host.server.request(
            "POST", "gpu-hotplug/api/detach", {"uuid": freed["uuid"]}
        )
        assert answer.status == 204, answer
        expect(bob.toast(f"({freed['device']}) to gpu.ipynb.")).to_be_visible()
        assert [gpu["uuid"] for gpu in bob.attached()] == [freed["uuid"]]
        assert bob.run_probe() == f"['{freed['device']}']"

        # Unused for IDLE_SECONDS, the GPU goes back, and B's notebook says why.
        expect(bob.toast("released from gpu.ipynb: it sat unused")).to_be_visible(
            timeout=(IDLE_SECONDS + 120) * 1000
        )
        assert bob.attached() == []
        assert bob.run_probe() == "[]"
        assert len(hub.cluster.holders(NAMESPACE)) == MAX_GPUS - 1  # alice's other three
    finally:
        for lab, user in ((alice, "alice"), (bob, "bob")):
            lab.close()
            stop_server(hub, user)
