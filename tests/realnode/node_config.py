"""The configuration files of one node's containerd, CNI and kubelet, for both kinds of node the
tier runs: the host's (cgroup v1, the ``cgroupfs`` driver) and the production node in the VM
(cgroup v2, the ``systemd`` driver, ``vm_node.py``).

Why one module for both: what a cgroup v2 + systemd node does differently must be visible as
the few parameters of ``NodeRuntime`` and nothing else — the same containerd layout, the same
kubelet settings, the same paths (a DaemonSet's ``hostPath`` volumes name one path for every
node, so each node keeps its sockets at the same place).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ..k8s.image import PAUSE_IMAGE
from .components import Components

CgroupDriver = Literal["cgroupfs", "systemd"]
BRIDGE: Final = "jghnode0"
"""Each node's pod bridge (the host's and the VM's are on different machines)."""
TAP: Final = "jghvm0"
"""The host's end of its link to the VM node (``vm_node.py``)."""


@dataclass(frozen=True)
class NodeRuntime:
    """How one node runs its pods."""

    directory: Path
    """The node's directory: the same path on every node of the tier."""
    components: Components
    """The binaries, at the same paths on every node (the VM mounts the cache where it is)."""
    cgroup_driver: CgroupDriver
    snapshotter: Literal["native", "overlayfs"]
    """``native`` on the host, whose ``/tmp`` may itself be an overlay; ``overlayfs`` (the
    production default) in the VM."""
    pod_subnet: str

    @property
    def containerd_dir(self) -> Path:
        return self.directory / "ctd"

    @property
    def cri_endpoint(self) -> str:
        return f"unix://{self.containerd_dir / 'containerd.sock'}"

    @property
    def systemd_cgroup(self) -> str:
        """runc's ``SystemdCgroup`` in containerd's TOML."""
        return "true" if self.cgroup_driver == "systemd" else "false"


def containerd_config(
    node: NodeRuntime, *, cdi_spec_dir: Path | None = None, runtimes: str = ""
) -> str:
    """containerd 2's configuration (version 3): CRI with the default ``runc`` handler;
    ``cdi_spec_dir`` turns on CDI specs from there; ``runtimes`` adds handlers."""
    d = node.containerd_dir
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  # What `ctr images import` (the transfer service) unpacks into: the snapshotter CRI uses.
  platform = "linux/amd64"
  snapshotter = "{node.snapshotter}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "{node.snapshotter}"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[{runtime}]
  restrict_oom_score_adj = true
  disable_apparmor = true
  {f'cdi_spec_dirs = ["{cdi_spec_dir}"]' if cdi_spec_dir is not None else ""}
  [{runtime}.cni]
    bin_dirs = ["{node.components.cni_bin_dir}"]
    conf_dir = "{d}/net.d"
  [{runtime}.containerd]
    default_runtime_name = "runc"
{runtime_handler(node, "runc", node.components.runc)}{runtimes}"""


def runtime_handler(node: NodeRuntime, name: str, binary: Path) -> str:
    """One runc-compatible handler of the CRI plugin (the same cgroup driver for all)."""
    handler = f"plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{name}"
    return f"""  [{handler}]
    runtime_type = "io.containerd.runc.v2"
    snapshotter = "{node.snapshotter}"
  [{handler}.options]
    BinaryName = "{binary}"
    Root = "{node.containerd_dir}/runc"
    SystemdCgroup = {node.systemd_cgroup}
"""


def cni_config(node: NodeRuntime) -> str:
    """The bridge plugin on the node's own subnet; pods reach Services through its gateway."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "jgh-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "isDefaultGateway": True,  # pods reach Services (ClusterIPs) through it
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": node.pod_subnet}]],
                        "dataDir": str(node.containerd_dir / "ipam"),
                    },
                }
            ],
        }
    )


def kubelet_config(
    node: NodeRuntime,
    *,
    ca: Path,
    address: str,
    port: int,
    healthz_port: int,
    cgroup_root: str | None = None,
) -> str:
    """The kubelet's ``KubeletConfiguration``. ``cgroup_root`` (the host's node only): the
    pods' own root in every v1 hierarchy, and ``failCgroupV1: false`` — without it the
    kubelet >= 1.35 refuses a cgroup v1 host. The systemd node leaves ``failCgroupV1`` at its
    default (true) and its cgroups to systemd (``kubepods.slice``)."""
    v1_only = f"cgroupRoot: {cgroup_root}\nfailCgroupV1: false\n" if cgroup_root is not None else ""
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {address}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: "{ca}"}}
authorization: {{mode: Webhook}}
containerRuntimeEndpoint: "{node.cri_endpoint}"
cgroupDriver: {node.cgroup_driver}
{v1_only}failSwapOn: false
podLogsDir: "{node.directory / "pod-logs"}"
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}}
syncFrequency: 5s
nodeStatusUpdateFrequency: 4s
serializeImagePulls: false
"""  # noqa: E501
