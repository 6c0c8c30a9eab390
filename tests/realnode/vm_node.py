"""The production node: a worker in the systemd VM, joined to the host's cluster.

Every distribution a platform team runs today boots pure cgroup v2 with systemd as PID 1, and
runs containerd with ``SystemdCgroup = true``; the kubelet >= 1.35 refuses cgroup v1 unless told
otherwise (KEP-5573). The host's node (``node.py``) is the opposite on every count, so the tier
adds this one: the VM tier's image recipe (``tests/vm``) for Debian 13 (systemd 257, kernel
6.12) booted under qemu, running the *same* cached builds as the host's node — containerd 2,
runc, the kubelet, kube-proxy, the CNI plugins and NVIDIA's device plugin, shared into the VM
read-only at the path they have on the host (so ``Components`` names them there too; nothing
is built in the VM) — with the kubelet's ``cgroupDriver: systemd``, ``failCgroupV1`` at its
default, containerd's ``SystemdCgroup = true`` and the overlayfs snapshotter, each daemon a
systemd unit. It registers with the host's API server as ``system:node:jgh-vm-node`` (its own
client certificate; ``NodeRestriction`` is in force) and serves two simulated GPUs of its own
(UUIDs derived from its name, distinct from the host's).

The network is a tap device on the host (``TAP``, a /30 link), nothing routed off the machine:
the VM reaches the API server at the host's address through it, the API server reaches the VM's
kubelet at the VM's link address (every kubelet is reached by its ``InternalIP``), and each
side routes the other's pod subnet over the link. ssh stays on qemu's user networking.

The node keeps the host node's directory path (``RealNode.directory``): a DaemonSet's
``hostPath`` volumes name one path for every node, so the kubelet's PodResources socket,
containerd's socket and the simulated NVML are where the agent's pod template says on both
nodes. The VM's run directory is under that directory, so a killed session's qemu is found and
stopped by the host node's teardown (``teardown_host``), which also removes the tap.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from jupyter_gpu_hotplug.nvml.sim import FakeNvmlConfig, default_gpus, write_config

from ..k8s.image import write_oci_archive
from ..vm.image import ensure_image
from ..vm.machine import Machine, Share, boot
from .components import cache_root
from .node import GPU_RESOURCE, IMPORT_TIMEOUT, POD_SUBNET, READY_TIMEOUT, NodeError, RealNode
from .node_config import (
    TAP,
    NodeRuntime,
    cni_config,
    containerd_config,
    kubelet_config,
)
from .pki import Identity, sign_node, write_kubeconfig

VM_NODE_NAME: Final = "jgh-vm-node"
SUITE: Final = "trixie"
"""Debian 13: systemd 257, kernel 6.12 — what a node installed today runs (the VM tier keeps
Debian 12's systemd 252, whose ``daemon-reload`` behaves differently)."""
VM_GPUS: Final = 2
VM_POD_SUBNET: Final = "10.244.78.0/24"
LINK_HOST: Final = "10.244.79.1"
LINK_VM: Final = "10.244.79.2"
LINK_PREFIX: Final = 30
LINK_MAC: Final = "52:54:00:4a:47:48"
"""The VM's end of the link, found by this address in the guest (interface names vary)."""
VCPUS: Final = 1
"""One vCPU: with two, Debian 13's kernel 6.12 under qemu's multi-threaded emulation died of
an ``int3`` oops in ``update_cfs_group`` (a static key's code patched while the other vCPU ran
it) at the first ``systemctl set-property CPUWeight=`` — an emulator's race, not the node's;
the daemons used about one host core anyway."""
KUBELET_PORT: Final = 10250
KUBELET_HEALTHZ_PORT: Final = 10248
UNITS: Final = ("jgh-nvidia-device-plugin", "jgh-kube-proxy", "jgh-kubelet", "jgh-containerd")
"""The node's daemons as systemd units, in the order they are stopped."""


def describe(host: RealNode, name: str, cgroup_fs: str) -> str:
    """The tier's one line for node ``name`` of ``host``'s cluster: what its kubelet and
    runtime report, its cgroup version (``cgroup_fs``: ``stat -fc %T /sys/fs/cgroup`` on that
    node) and the cgroup driver its kubelet runs with (``configz``)."""
    info = host.kubectl_json("get", "node", name)["status"]["nodeInfo"]
    raw = host.kubectl("get", "--raw", f"/api/v1/nodes/{name}/proxy/configz")
    driver = json.loads(raw)["kubeletconfig"]["cgroupDriver"]
    runtime = info["containerRuntimeVersion"].removeprefix("containerd://")
    cgroup = "v2" if cgroup_fs == "cgroup2fs" else "v1"
    return (
        f"node {name}: kubelet {info['kubeletVersion']}, containerd {runtime}, "
        f"cgroup {cgroup}, driver {driver}"
    )


def describe_host(host: RealNode) -> str:
    """``describe`` of the host's own node."""
    host_fs = subprocess.run(
        ["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return describe(host, host.node_name, host_fs)


@dataclass
class VmNode:
    """The running worker; ``running_vm_node`` makes one."""

    host: RealNode
    machine: Machine
    nvml_config: FakeNvmlConfig
    kubelet_identity: Identity
    """The VM kubelet's client certificate (``system:node:<name>``), kept on the host too."""
    started: float
    name: str = VM_NODE_NAME
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds from the start to each milestone (for the benchmark and the docs)."""

    def mark(self, milestone: str) -> None:
        self.timings[milestone] = round(time.monotonic() - self.started, 1)

    @property
    def runtime(self) -> NodeRuntime:
        return NodeRuntime(
            self.host.directory, self.host.components, "systemd", "overlayfs", VM_POD_SUBNET
        )

    def run(self, command: str, *, check: bool = True, timeout: float = 300) -> str:
        """A shell command in the VM as root; its standard output."""
        return self.machine.run(command, check=check, timeout=timeout).stdout

    def journal(self, unit: str, lines: int = 80) -> str:
        return self.run(f"journalctl -u {unit} --no-pager -n {lines}", check=False)

    def ctr(self, *args: str, timeout: float = 300) -> str:
        """containerd's own client in the VM (namespace ``k8s.io``, the CRI plugin's)."""
        c, socket = self.host.components, self.runtime.containerd_dir / "containerd.sock"
        argv = [str(c.containerd.parent / "ctr"), "--address", str(socket), "-n", "k8s.io", *args]
        return self.run(shlex.join(argv), timeout=timeout)

    @property
    def inbox(self) -> Path:
        """A host directory the VM sees at the same path (virtio-9p, read-only): files for
        it are linked there, not streamed over ssh (the VM's ssh is emulated, encryption
        and all)."""
        return self.machine.run_dir / "inbox"

    def import_image(self, archive: Path) -> None:
        """Import an OCI archive into the VM's containerd, through the inbox."""
        staged = self.inbox / archive.name
        try:
            os.link(archive, staged)
        except OSError:  # another filesystem
            shutil.copyfile(archive, staged)
        try:
            self.ctr("images", "import", "--platform=linux/amd64", str(staged),
                     timeout=IMPORT_TIMEOUT)  # fmt: skip
        finally:
            staged.unlink()

    def kubelet_kubeconfig_here(self) -> Path:
        """A kubeconfig on the host with the VM kubelet's identity (to test what it may do)."""
        path = self.machine.run_dir / "as-vm-kubelet.kubeconfig"
        assert self.host.pki is not None
        return write_kubeconfig(
            path, self.host.apiserver_url, self.host.pki.ca.cert, self.kubelet_identity
        )

    def cgroup_fs(self) -> str:
        return self.run("stat -fc %T /sys/fs/cgroup").strip()

    def describe_nodes(self) -> list[str]:
        """``describe`` of both nodes of the cluster, the host's first."""
        return [describe_host(self.host), describe(self.host, self.name, self.cgroup_fs())]

    def configz(self) -> dict[str, Any]:
        """The kubelet's running configuration, through the API server's node proxy."""
        raw = self.host.kubectl("get", "--raw", f"/api/v1/nodes/{self.name}/proxy/configz")
        config: dict[str, Any] = json.loads(raw)["kubeletconfig"]
        return config


def host_link_up() -> None:
    """The host's end of the link: a tap for qemu, the VM's pod subnet routed over it."""
    subprocess.run(["ip", "tuntap", "add", "dev", TAP, "mode", "tap"], check=True)
    for argv in (
        ["ip", "addr", "add", f"{LINK_HOST}/{LINK_PREFIX}", "dev", TAP],
        ["ip", "link", "set", TAP, "up"],
        ["ip", "route", "add", VM_POD_SUBNET, "via", LINK_VM, "dev", TAP],
    ):
        subprocess.run(argv, check=True, capture_output=True)


def host_link_down() -> bool:
    """Remove the tap (its address and route go with it); whether it was there."""
    return (
        subprocess.run(["ip", "link", "delete", TAP], capture_output=True, check=False).returncode
        == 0
    )


def _stage(host: RealNode, vm: NodeRuntime, nvml: FakeNvmlConfig, node_id: Identity) -> bytes:
    """Every file the VM's node needs, as a tar to unpack at ``/``: its certificates (the CA's
    certificate, never its key), kubeconfigs, the daemons' configurations, the simulated NVML
    (the host's build, at the host's path) with the VM's own GPUs."""
    assert host.pki is not None and host.nvml_library_dir is not None
    assert host.nvml_config_path is not None
    pki = host.directory / "pki"
    files: dict[str, bytes | Path] = {
        str(pki / "ca.crt"): host.pki.ca.cert,
        str(pki / "vm-node.crt"): node_id.cert,
        str(pki / "vm-node.key"): node_id.key,
        str(pki / "proxy.crt"): host.pki.proxy.cert,
        str(pki / "proxy.key"): host.pki.proxy.key,
        str(vm.containerd_dir / "config.toml"): containerd_config(vm).encode(),
        str(vm.containerd_dir / "net.d" / "10-jgh-node.conflist"): cni_config(vm).encode(),
        str(host.directory / "kubelet.yaml"): kubelet_config(
            vm,
            ca=pki / "ca.crt",
            address=LINK_VM,
            port=KUBELET_PORT,
            healthz_port=KUBELET_HEALTHZ_PORT,
        ).encode(),
    }
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(_scratch(node_id.cert.parent)))
        for name, identity in (("kubelet", node_id), ("proxy", host.pki.proxy)):
            guest_identity = Identity(pki / identity.cert.name, pki / identity.key.name)
            written = write_kubeconfig(
                scratch / f"{name}.kubeconfig", host.apiserver_url, pki / "ca.crt", guest_identity
            )
            files[str(host.directory / f"vm-{name}.kubeconfig")] = written.read_bytes()
        write_config(scratch / "nvml.conf", nvml)
        files[str(host.nvml_config_path)] = (scratch / "nvml.conf").read_bytes()
        for library in sorted(host.nvml_library_dir.iterdir()):
            files[str(library)] = library
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name, content in files.items():
                data = content.read_bytes() if isinstance(content, Path) else content
                info = tarfile.TarInfo(name.lstrip("/"))
                info.size, info.mode = len(data), 0o600 if name.endswith(".key") else 0o644
                archive.addfile(info, io.BytesIO(data))
        return buffer.getvalue()


@contextlib.contextmanager
def _scratch(parent: Path) -> Iterator[Path]:
    directory = parent / "scratch"
    directory.mkdir()
    try:
        yield directory
    finally:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


def _unit(name: str, argv: list[str], env: dict[str, str], *, delegate: bool = False) -> str:
    """``systemd-run`` of one daemon as a transient service (restarted as a node's service
    manager restarts it); ``delegate``: the daemon manages cgroups below its own (containerd's
    shims)."""
    properties = ["Restart=on-failure", "RestartSec=1"]
    if delegate:
        properties += ["Delegate=yes", "KillMode=process"]
    return shlex.join(
        [
            "systemd-run",
            f"--unit={name}",
            *(f"--property={p}" for p in properties),
            *(f"--setenv={k}={v}" for k, v in env.items()),
            *argv,
        ]
    )


def _guest_network(host: RealNode) -> str:
    """The VM's end of the link, the routes to the API server and the host's pods, and what
    the kubelet, the bridge plugin and kube-proxy need of the kernel."""
    return (
        f'dev=$(ip -o link | awk -v mac={LINK_MAC} \'$0 ~ mac {{sub(":", "", $2); print $2}}\')'
        f" && ip addr add {LINK_VM}/{LINK_PREFIX} dev $dev && ip link set $dev up"
        f" && ip route add {host.node_ip}/32 via {LINK_HOST}"
        f" && ip route add {POD_SUBNET} via {LINK_HOST}"
        " && modprobe br_netfilter && modprobe overlay && modprobe nf_conntrack"
        " && sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1"
        # The image's own runtimes (the VM tier's) are not this node's: off, as on a worker.
        " && systemctl stop containerd.service podman.socket"
    )


def _start_daemons(vm: VmNode) -> None:
    host, runtime = vm.host, vm.runtime
    c = host.components
    path = ":".join([*c.path_dirs, str(c.cni_bin_dir), "/usr/sbin:/usr/bin:/sbin:/bin"])
    d = host.directory
    vm.run(
        _unit(
            "jgh-containerd",
            [str(c.containerd), "--config", str(runtime.containerd_dir / "config.toml")],
            {"PATH": path},
            delegate=True,
        )
    )
    _poll_guest(
        vm, f"test -S {runtime.containerd_dir / 'containerd.sock'}", "containerd's socket", 120
    )
    test_images = vm.machine.run_dir / "test-images.oci.tar"
    write_oci_archive(test_images)
    vm.import_image(test_images)
    test_images.unlink()
    vm.mark("containerd ready, images imported")
    vm.run(
        _unit(
            "jgh-kubelet",
            [
                str(c.kubelet),
                f"--config={d / 'kubelet.yaml'}",
                f"--kubeconfig={d / 'vm-kubelet.kubeconfig'}",
                f"--root-dir={host.kubelet_dir}",
                f"--cert-dir={host.kubelet_dir / 'pki'}",
                f"--hostname-override={VM_NODE_NAME}",
                f"--node-ip={LINK_VM}",
                "--v=2",
            ],
            {"PATH": path},
        )
    )
    vm.run(
        _unit(
            "jgh-kube-proxy",
            [
                str(c.kube_proxy),
                f"--kubeconfig={d / 'vm-proxy.kubeconfig'}",
                f"--hostname-override={VM_NODE_NAME}",
                f"--cluster-cidr={VM_POD_SUBNET}",
                "--proxy-mode=iptables",
                "--conntrack-max-per-core=0",
            ],
            {"PATH": path},
        )
    )
    _poll_guest(
        vm,
        "test -S /var/lib/kubelet/device-plugins/kubelet.sock",
        "the kubelet's registration socket",
        180,
    )
    assert host.nvml_library_dir is not None and host.nvml_config_path is not None
    vm.run(
        _unit(
            "jgh-nvidia-device-plugin",
            [str(c.device_plugin), "--fail-on-init-error=true", "--mig-strategy=mixed",
             "--device-id-strategy=uuid", "--device-list-strategy=envvar",
             "--pass-device-specs=false"],
            {**host.nvml_environ(), "LD_LIBRARY_PATH": str(host.nvml_library_dir),
             "DP_DISABLE_HEALTHCHECKS": "all"},
        )
    )  # fmt: skip


def _poll_guest(vm: VmNode, test: str, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while vm.machine.run(test, check=False, timeout=60).returncode != 0:
        if time.monotonic() > deadline:
            raise NodeError(f"VM node: no {what} within {timeout:.0f} s")
        time.sleep(1)  # poll interval, not a wait for state


def _wait_ready(vm: VmNode) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        found = vm.host.kubectl("get", "node", vm.name, "-o", "json", check=False)
        with contextlib.suppress(ValueError):
            node = json.loads(found)
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in node["status"].get("conditions", [])
            )
            if ready and node["status"].get("allocatable", {}).get(GPU_RESOURCE) == str(VM_GPUS):
                return
        if time.monotonic() > deadline:
            raise NodeError(
                f"VM node {vm.name} not Ready with {VM_GPUS} GPUs within {READY_TIMEOUT:.0f} s\n"
                + "\n".join(vm.journal(unit, 30) for unit in UNITS)
            )
        time.sleep(1)  # poll interval, not a wait for state


@contextlib.contextmanager
def running_vm_node(host: RealNode) -> Iterator[VmNode]:
    """The VM joined to ``host``'s cluster, Ready with its GPUs, until exit; then its Node
    object is deleted, the VM stopped and the link removed."""
    image = ensure_image(suite=SUITE)
    started = time.monotonic()
    run_dir = host.directory / "vm"
    (run_dir / "inbox").mkdir(parents=True)
    bin_dir = cache_root() / "bin"
    nvml = FakeNvmlConfig(gpus=default_gpus(VM_GPUS, node=VM_NODE_NAME))
    host_link_up()
    try:
        with boot(
            image,
            run_dir,
            tree=None,
            shares=[
                Share("nodebin", bin_dir, str(bin_dir)),
                Share("inbox", run_dir / "inbox", str(run_dir / "inbox")),
            ],
            nics=[f"tap,ifname={TAP},script=no,downscript=no,model=virtio-net-pci,mac={LINK_MAC}"],
            vcpus=VCPUS,
            nice=0,  # the production node's tests are the real-node lane's longest path
        ) as machine:
            assert host.pki is not None
            node_id = sign_node(run_dir, "vm-node", VM_NODE_NAME, LINK_VM, host.pki.ca)
            vm = VmNode(host, machine, nvml, node_id, started)
            vm.mark("booted (ssh answers)")
            try:
                vm.run(_guest_network(host))
                machine.put(_stage(host, vm.runtime, nvml, node_id), "tar -xf - -C /")
                _start_daemons(vm)
                _wait_ready(vm)
                vm.mark("Ready with its GPUs")
                yield vm
            finally:
                host.kubectl("delete", "node", VM_NODE_NAME, "--ignore-not-found", check=False)
    finally:
        host_link_down()
