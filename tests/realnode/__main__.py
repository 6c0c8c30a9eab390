"""``python -m tests.realnode up|down|status`` from the repository root, as root: the real node
by hand (a test session brings up its own); ``up --cdi`` brings it up in ``cdi`` mode (the
GPU Operator >= 25.10's setup, ``node.NodeMode``); ``up --hub`` brings up a ``cdi`` node with
the agent's DaemonSet and a JupyterHub (``hub.py``) and prints the hub's URL and the users'
logins. ``up`` builds no component: run ``tests/realnode/build.sh`` first (``--hub`` builds the
three images, cached); ``up --vm-node`` also joins the production node (``vm_node.py``: cgroup
v2, systemd, the kubelet's ``systemd`` driver) and prints one line per node (kubelet,
containerd, cgroup version, driver), as ``status`` does. ``up`` prints the admin kubeconfig to
use with ``kubectl``;
the node keeps running after the command returns (a detached owner process holds it) until
``down``. ``down`` also removes a node whose owner was killed (a test session or ``up``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from types import FrameType

from .components import MissingComponents
from .node import (
    STATE_FILE,
    NodeBusy,
    NodeError,
    NodeMode,
    RealNode,
    new_node,
    node_is_running,
    take_down_recorded,
)
from .vm_node import describe_host, running_vm_node

READY_KEY = "ready"
"""Written into the state file by the owner: ``true`` once the node is Ready, else the error."""


def _hub(node: RealNode, stack: contextlib.ExitStack) -> dict[str, object]:
    """The agent's DaemonSet and the hub on the started node, until ``stack`` closes; what the
    state file records of them."""
    from .agent import install_agent_account
    from .cluster import Cluster
    from .deployment import deployed_agent
    from .hub import USERS, running_hub

    cluster = stack.enter_context(contextlib.closing(Cluster(node)))
    install_agent_account(cluster)
    agent_ip = stack.enter_context(deployed_agent(cluster, "cdi"))
    hub = stack.enter_context(running_hub(cluster, agent_ip))
    return {"hub": hub.url, "users": ", ".join(USERS), "password": hub.password}


def _vm_node(node: RealNode, stack: contextlib.ExitStack) -> dict[str, object]:
    """The production node joined to ``node``'s cluster until ``stack`` closes; what the state
    file records of it."""
    vm = stack.enter_context(running_vm_node(node))
    return {"vm_node": vm.name, "vm_timings": vm.timings, "nodes": vm.describe_nodes()}


def _up(gpus: int, mode: NodeMode, with_hub: bool, with_vm: bool) -> int:
    if node_is_running():
        print(f"a node is already up ({STATE_FILE}); `python -m tests.realnode down` first")
        return 1
    try:
        node = new_node(gpus, mode=mode)
    except (MissingComponents, NodeError) as error:
        print(error, file=sys.stderr)
        return 1
    node.by_hand = True
    take_down_recorded()  # a stale node (its owner was killed): nothing of it may stay
    child = os.fork()
    if child:  # the parent reports; the child owns the node until `down`
        while True:
            with_ready = _state().get(READY_KEY)
            if with_ready is not None:
                break
            if os.waitpid(child, os.WNOHANG) != (0, 0):
                print("the node's owner process ended before the node was up", file=sys.stderr)
                return 1
            time.sleep(0.5)
        state = _state()
        if state[READY_KEY] is not True:
            print(f"the node did not come up: {state[READY_KEY]}", file=sys.stderr)
            return 1
        print(f"node {state['node']} Ready ({mode}); seconds to each milestone: {state['timings']}")
        _print_nodes(state)
        print(f"export KUBECONFIG={state['kubeconfig']}")
        if with_hub:
            print(f"JupyterHub: {state['hub']}/hub/login  users {state['users']}, "
                  f"password {state['password']}")  # fmt: skip
        return 0
    os.setsid()
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.ExitStack() as stack:
        try:
            node.start()
            extra = _vm_node(node, stack) if with_vm else {"nodes": [describe_host(node)]}
            extra |= _hub(node, stack) if with_hub else {}
        except Exception as error:  # reported through the state file, then the owner ends
            STATE_FILE.write_text(json.dumps({READY_KEY: str(error)}))
            stack.close()
            node.stop()
            os._exit(1)
        state = {**_state(), **extra, READY_KEY: True, "timings": node.timings}
        STATE_FILE.write_text(json.dumps(state))
        while not stopping and all(p.poll() is None for p in node.processes.values()):
            time.sleep(1)
    left = node.stop()
    os._exit(1 if left else 0)


def _print_nodes(state: dict[str, object]) -> None:
    """The one line per node that ``up --vm-node`` recorded."""
    lines = state.get("nodes")
    for line in lines if isinstance(lines, list) else []:
        print(line)


def _state() -> dict[str, object]:
    try:
        loaded = json.loads(STATE_FILE.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.realnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the node and wait until it is Ready")
    up.add_argument("--gpus", type=int, default=4, help="simulated GPUs (default 4)")
    up.add_argument(
        "--cdi",
        action="store_const",
        const="cdi",
        default="plain",
        dest="mode",
        help="CDI mode, as the GPU Operator >= 25.10 sets a node up (default: plain)",
    )
    up.add_argument(
        "--hub",
        action="store_true",
        help="a CDI node with the agent's DaemonSet and a JupyterHub (builds the images)",
    )
    up.add_argument(
        "--vm-node",
        action="store_true",
        help="also the production node: a cgroup v2 + systemd worker in a qemu VM, joined",
    )
    sub.add_parser("down", help="stop the node (or a stale one) and remove everything it made")
    sub.add_parser("status", help="say whether a node is up")
    args = parser.parse_args()
    if args.command == "up":
        return _up(args.gpus, "cdi" if args.hub else args.mode, args.hub, args.vm_node)
    if args.command == "down":
        try:
            left = take_down_recorded(stop_live_owner=True)
        except NodeBusy as error:
            print(error, file=sys.stderr)
            return 1
        print("node down" + (f"; removed what its owner left: {left}" if left else ""))
        return 0
    if node_is_running():
        state = _state()
        _print_nodes(state)
        print(json.dumps(state, indent=1))
        return 0
    print("no node is up" + (" (a stale one is recorded: `down` removes it)" if _state() else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
