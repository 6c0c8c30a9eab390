"""Issue 33 on the real node in CDI mode: a CPU notebook — Debian, glibc, Python, pynvml; plain
runc, no RuntimeClass, no NVIDIA variable — gets with its hot-attached GPU what a GPU container
gets from NVIDIA's toolkit (the driver's libraries, ``nvidia-smi``, the ldcache), from the spec
``nvidia-ctk cdi generate`` wrote; a new process in it loads ``libcuda.so.1`` and sees exactly
its GPU, and the detach takes all of it back.

The notebook image is the agent's (Debian + Python + nvidia-ml-py; it is on the node already).
The simulated driver reads the node's description from a file, as the real one reads the
kernel's: the notebook pod is given that file (a read-only hostPath, hence a ``privileged``
PodSecurity namespace) and the variable naming it — nothing of the driver's libraries.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from jupyter_gpu_hotplug.agent.core.checkpoints import marker_path
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV

from ..fixtures.requirements import needs_root
from .agent import AgentAccount, NodeAgent, install_agent_account, running_node_agent
from .agent_image import agent_image
from .cluster import WAIT, Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

PROBE: Final = r"""
import ctypes, json, shutil
out = {}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int(-1)
    out["cuInit"] = cuda.cuInit(0)
    cuda.cuDeviceGetCount(ctypes.byref(count))
    out["cuda_devices"] = count.value
except OSError as error:
    out["cuda_error"] = str(error)
try:
    import pynvml
    pynvml.nvmlInit()
    uuids = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    out["nvml"] = uuids
except Exception as error:
    out["nvml_error"] = repr(error)
out["nvidia_smi"] = shutil.which("nvidia-smi")
print(json.dumps(out))
"""
"""What a new process in the notebook can load and see (the kernel's view after an attach)."""


@pytest.fixture(scope="module")
def account(cdi_cluster: Cluster) -> AgentAccount:
    cdi_cluster.node.import_image(agent_image().archive)
    return install_agent_account(cdi_cluster)


@pytest.fixture
def agent(cdi_cluster: Cluster, account: AgentAccount) -> Iterator[NodeAgent]:
    with running_node_agent(cdi_cluster, account, extra=cdi_args(cdi_cluster)) as running:
        yield running


def cdi_args(cluster: Cluster, mode: str = "cdi") -> tuple[str, ...]:
    return (f"--driver-files={mode}", f"--cdi-spec-dir={cluster.node.cdi_spec_dir}")


def notebook(
    cluster: Cluster, ns: str, name: str, *, read_only_root: bool = False, **extra: Any
) -> None:
    """A CPU notebook of the agent's (Debian) image, with the simulated driver's node file."""
    config = cluster.node.nvml_config_path
    assert config is not None
    cluster.run_notebook_pod(
        ns,
        name,
        image=agent_image().name,
        env={CONFIG_ENV: str(config), DEVICE_FILTER_ENV: "/dev"},
        host_files={str(config): str(config), **extra.pop("host_files", {})},
        read_only_root=read_only_root,
        **extra,
    )


def probe(cluster: Cluster, ns: str, pod: str) -> dict[str, Any]:
    result = cluster.exec(ns, pod, ["python3", "-c", PROBE], timeout=60)
    assert result.exit_code == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def spec_files(cluster: Cluster) -> dict[str, str]:
    """What the node's CDI spec mounts from the driver root: host path → path in the
    container (not the toolkit's ``/dev/null`` marker of its "void" device)."""
    spec = cluster.node.cdi_spec
    assert spec is not None
    root = str(cluster.node.driver_root)
    mounts = spec.common_edits.get("mounts", [])
    return {m["hostPath"]: m["containerPath"] for m in mounts if m["hostPath"].startswith(root)}


def runtime_files(cluster: Cluster) -> dict[str, str]:
    """What a runtime mounts into a GPU container from the driver root: the spec's files and
    the libraries' SONAME names beside them (host path → path in the container)."""
    files = spec_files(cluster)
    for host, inside in list(files.items()):
        for link in Path(host).parent.glob("*.so.1"):
            if link.is_symlink() and link.resolve() == Path(host).resolve():
                files[str(link)] = str(Path(inside).parent / link.name)
    return files


def driver_mounts(cluster: Cluster, ns: str, pod: str) -> list[str]:
    """The notebook's mount points where a GPU container has the driver's files."""
    paths = set(runtime_files(cluster).values())
    result = cluster.exec(ns, pod, ["cat", "/proc/self/mountinfo"])
    assert result.exit_code == 0, result.stderr
    return [line.split()[4] for line in result.stdout.splitlines() if line.split()[4] in paths]


def has_no_driver(cluster: Cluster, ns: str, pod: str) -> bool:
    seen = probe(cluster, ns, pod)
    return (
        "cuda_error" in seen and seen["nvidia_smi"] is None and not driver_mounts(cluster, ns, pod)
    )


def test_a_cpu_notebook_gets_the_driver_with_its_gpu_and_loses_it_with_the_detach(
    cdi_cluster: Cluster, agent: NodeAgent
) -> None:
    ns = cdi_cluster.namespace(pod_security="privileged")
    notebook(cdi_cluster, ns, "nb")
    notebook(cdi_cluster, ns, "other")
    before = probe(cdi_cluster, ns, "nb")
    assert "cuda_error" in before and before["nvidia_smi"] is None, before

    created = agent.as_pod(ns, "nb").post("/v1/attachments", {"count": 1})

    assert created.status == 201, created.body
    (attachment,) = created.json()["attachments"]
    after = probe(cdi_cluster, ns, "nb")
    assert after["cuInit"] == 0 and after["cuda_devices"] == 1, after
    assert after["nvml"] == [attachment["uuid"]], after
    assert after["nvidia_smi"] == "/usr/bin/nvidia-smi"
    listed = cdi_cluster.exec(ns, "nb", ["nvidia-smi", "-L"], timeout=60)
    assert listed.exit_code == 0, listed.stderr
    assert attachment["uuid"] in listed.stdout and "SIMULATED" in listed.stdout
    cache = cdi_cluster.exec(ns, "nb", ["grep", "-c", "libcuda.so.1", "/etc/ld.so.cache"])
    assert cache.stdout.strip() != "0", cache  # the container's own loader cache names it
    assert has_no_driver(cdi_cluster, ns, "other")  # the neighbour never saw any of it

    assert agent.as_pod(ns, "nb").delete("/v1/attachments").status == 204

    assert has_no_driver(cdi_cluster, ns, "nb")
    eventually(lambda: cdi_cluster.holders(ns) == [], "the holder is gone")


def test_a_notebook_that_cannot_be_given_the_driver_is_refused_with_its_reason(
    cdi_cluster: Cluster, agent: NodeAgent
) -> None:
    """A read-only root filesystem has no room for the library's mount point: 422, and
    nothing is left attached or reserved."""
    ns = cdi_cluster.namespace(pod_security="privileged")
    notebook(cdi_cluster, ns, "ro", read_only_root=True)

    answer = agent.as_pod(ns, "ro").post("/v1/attachments", {"count": 1})

    assert (answer.status, answer.error) == (422, "target_not_ready"), answer.body
    assert "read-only" in answer.json()["message"]
    assert agent.as_pod(ns, "ro").get("/v1/attachments").json()["attachments"] == []
    eventually(lambda: cdi_cluster.holders(ns) == [], "no holder is left")
    assert has_no_driver(cdi_cluster, ns, "ro")


def test_check_mode_refuses_a_notebook_without_the_driver_and_leaves_the_runtimes_alone(
    cdi_cluster: Cluster, account: AgentAccount
) -> None:
    """``--driver-files=check`` (NVIDIA's legacy mode: the runtime mounts the driver at start,
    stood in for here by the same files mounted read-only, as libnvidia-container mounts them —
    it is not built here): a notebook without them gets 422 naming the fix; one with them sees a
    driver and no GPU, then exactly its attached GPU (CUDA and NVML), then none again, and its
    detach leaves the files — they are the runtime's."""
    ns = cdi_cluster.namespace(pod_security="privileged")
    runtime_given = runtime_files(cdi_cluster)
    notebook(cdi_cluster, ns, "bare")
    notebook(cdi_cluster, ns, "legacy", host_files=runtime_given)
    with running_node_agent(cdi_cluster, account, extra=cdi_args(cdi_cluster, "check")) as agent:
        refused = agent.as_pod(ns, "bare").post("/v1/attachments", {"count": 1})
        assert (refused.status, refused.error) == (422, "target_not_ready"), refused.body
        assert "NVIDIA_VISIBLE_DEVICES=none" in refused.json()["message"]

        before = probe(cdi_cluster, ns, "legacy")
        assert before["cuInit"] == 100 and before["nvml"] == [], before  # a driver, no GPU
        created = agent.as_pod(ns, "legacy").post("/v1/attachments", {"count": 1})
        assert created.status == 201, created.body
        (attachment,) = created.json()["attachments"]
        after = probe(cdi_cluster, ns, "legacy")
        assert after["cuInit"] == 0 and after["cuda_devices"] == 1, after
        assert after["nvml"] == [attachment["uuid"]], after
        assert agent.as_pod(ns, "legacy").delete("/v1/attachments").status == 204
        gone = probe(cdi_cluster, ns, "legacy")
        assert gone["cuInit"] == 100 and gone["nvml"] == [], gone
    assert sorted(driver_mounts(cdi_cluster, ns, "legacy")) == sorted(runtime_given.values())


@pytest.mark.parametrize("step", ["after_grant", "after_begin_release"])
def test_kill_9_mid_attach_or_mid_detach_leaves_no_mount_or_node_behind(
    step: str, cdi_cluster: Cluster, account: AgentAccount
) -> None:
    ns = cdi_cluster.namespace(pod_security="privileged")
    notebook(cdi_cluster, ns, "nb")
    with running_node_agent(cdi_cluster, account, extra=cdi_args(cdi_cluster)) as agent:
        if step == "after_begin_release":
            attached = agent.as_pod(ns, "nb").post("/v1/attachments", {"count": 1})
            assert attached.status == 201, attached.body
        agent.process.stop()
        agent.process.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": step})
        api = agent.as_pod(ns, "nb")
        call = (
            (lambda: api.post("/v1/attachments", {"count": 1}))
            if step == "after_grant"
            else (lambda: api.delete("/v1/attachments"))
        )
        request = threading.Thread(target=lambda: _ignore_errors(call))
        request.start()
        marker = marker_path(agent.process.state_dir, step)
        eventually(marker.exists, f"the operation pauses {step}")

        agent.process.kill9()
        request.join(timeout=WAIT)
        marker.unlink()
        agent.process.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": ""})

        if step == "after_grant":
            # The holder says granted (its one PATCH came before the grant): the restart
            # finishes the attach; the detach then takes everything back.
            eventually(
                lambda: (
                    len(agent.as_pod(ns, "nb").get("/v1/attachments").json()["attachments"]) == 1
                ),
                "the interrupted attach is finished",
            )
            assert agent.as_pod(ns, "nb").delete("/v1/attachments").status == 204
        eventually(lambda: cdi_cluster.holders(ns) == [], "the interrupted operation ends")
        eventually(
            lambda: has_no_driver(cdi_cluster, ns, "nb"), "the driver's files are taken back"
        )
        minors = cdi_cluster.exec(ns, "nb", ["ls", "/dev"]).stdout.split()
        assert not [m for m in minors if m.startswith("nvidia") and m[6:].isdigit()]


def _ignore_errors(call: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        call()
    except (ConnectionError, OSError):
        return


def test_holders_run_under_cdi_cri_with_the_toolkits_hooks_in_a_restricted_namespace(
    cdi_cluster: Cluster, agent: NodeAgent
) -> None:
    """Under ``cdi-cri`` containerd gives the holder its GPU's CDI edits and runs the toolkit's
    hooks in it (``update-ldcache`` and ``create-symlinks`` write into its root): the holder's
    read-only root filesystem does not stop them (toolkit >= 1.17.5, NVIDIA/nvidia-container-
    toolkit#2028), PodSecurity ``restricted`` admits it, and it keeps running. The notebook is
    busybox-static: the driver's files land in it all the same, its loader is not our concern."""
    ns = cdi_cluster.namespace("strict", pod_security="restricted")
    cdi_cluster.run_notebook_pod(ns, "nb", restricted=True)

    created = agent.as_pod(ns, "nb").post("/v1/attachments", {"count": 1})

    assert created.status == 201, created.body
    (holder,) = cdi_cluster.holders(ns)
    (container,) = holder["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (status,) = holder["status"]["containerStatuses"]
    assert holder["status"]["phase"] == "Running" and status["restartCount"] == 0, status
    held = cdi_cluster.exec(ns, holder["metadata"]["name"], ["ls", "/usr/lib/x86_64-linux-gnu"],
                            container=container["name"])  # fmt: skip
    assert "libcuda.so.1" in held.stdout.split()  # containerd applied the spec to it
    assert sorted(driver_mounts(cdi_cluster, ns, "nb")) == sorted(spec_files(cdi_cluster).values())
    assert agent.as_pod(ns, "nb").delete("/v1/attachments").status == 204
    assert driver_mounts(cdi_cluster, ns, "nb") == []


def test_a_notebook_container_restarted_by_the_kubelet_gets_its_gpu_and_driver_again(
    cdi_cluster: Cluster, agent: NodeAgent
) -> None:
    """The kubelet replaces a crashed container (a fresh root filesystem, none of the files):
    the reconciler re-injects the GPU and gives the new container the driver's files too."""
    ns = cdi_cluster.namespace(pod_security="privileged")
    notebook(cdi_cluster, ns, "nb")
    api = agent.as_pod(ns, "nb")
    (attachment,) = api.post("/v1/attachments", {"count": 1}).json()["attachments"]

    cdi_cluster.restart_container(ns, "nb")

    def usable() -> bool:
        seen = probe(cdi_cluster, ns, "nb")
        return seen.get("cuda_devices") == 1 and seen.get("nvml") == [attachment["uuid"]]

    eventually(usable, "the new container loads libcuda.so.1 and sees its GPU")
    assert api.delete("/v1/attachments").status == 204
    assert has_no_driver(cdi_cluster, ns, "nb")
