"""``python -m tests.realnode up|down|status`` from the repository root, as root: the real node
by hand (a test session brings up its own); ``up --cdi`` brings it up in ``cdi`` mode (the
GPU Operator >= 25.10's setup, ``node.NodeMode``). ``up`` builds nothing: run
``tests/realnode/build.sh`` first. ``up`` prints the admin kubeconfig to use with ``kubectl``;
the node keeps running after the command returns (a detached owner process holds it) until
``down``. ``down`` also removes a node whose owner was killed (a test session or ``up``).
"""

from __future__ import annotations

import argparse
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
    new_node,
    node_is_running,
    take_down_recorded,
)

READY_KEY = "ready"
"""Written into the state file by the owner: ``true`` once the node is Ready, else the error."""


def _up(gpus: int, mode: NodeMode) -> int:
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
        print(f"export KUBECONFIG={state['kubeconfig']}")
        return 0
    os.setsid()
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        node.start()
    except Exception as error:  # reported through the state file, then the owner ends
        STATE_FILE.write_text(json.dumps({READY_KEY: str(error)}))
        os._exit(1)
    STATE_FILE.write_text(json.dumps({**_state(), READY_KEY: True, "timings": node.timings}))
    while not stopping and all(p.poll() is None for p in node.processes.values()):
        time.sleep(1)
    left = node.stop()
    os._exit(1 if left else 0)


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
    sub.add_parser("down", help="stop the node (or a stale one) and remove everything it made")
    sub.add_parser("status", help="say whether a node is up")
    args = parser.parse_args()
    if args.command == "up":
        return _up(args.gpus, args.mode)
    if args.command == "down":
        try:
            left = take_down_recorded(stop_live_owner=True)
        except NodeBusy as error:
            print(error, file=sys.stderr)
            return 1
        print("node down" + (f"; removed what its owner left: {left}" if left else ""))
        return 0
    if node_is_running():
        print(json.dumps(_state(), indent=1))
        return 0
    print("no node is up" + (" (a stale one is recorded: `down` removes it)" if _state() else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
