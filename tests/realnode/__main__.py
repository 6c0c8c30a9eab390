"""``python -m tests.realnode up|down|status`` from the repository root, as root: the real node
by hand (the tests bring up their own). ``up`` builds nothing: run ``tests/realnode/build.sh``
first. ``up`` prints the admin kubeconfig to use with ``kubectl``; the node keeps running after
the command returns, until ``down``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .components import MissingComponents
from .node import STATE_FILE, NodeError, new_node, recorded_is_alive, take_down_recorded


def _up(gpus: int) -> int:
    if STATE_FILE.exists():
        if recorded_is_alive():
            print(f"a node is already up ({STATE_FILE}); `python -m tests.realnode down` first")
            return 1
        take_down_recorded()
    try:
        node = new_node(gpus)
    except (MissingComponents, NodeError) as error:
        print(error, file=sys.stderr)
        return 1
    child = os.fork()
    if child:  # the parent reports; the child stays as the components' owner until `down`
        while not STATE_FILE.exists() or "ready" not in json.loads(STATE_FILE.read_text()):
            if os.waitpid(child, os.WNOHANG) != (0, 0):
                print("the node's owner process ended before the node was up", file=sys.stderr)
                return 1
            time.sleep(0.5)
        state = json.loads(STATE_FILE.read_text())
        if state["ready"] is not True:
            print(f"the node did not come up: {state['ready']}", file=sys.stderr)
            return 1
        print(f"node {state['node']} Ready; timings {state['timings']}")
        print(f"export KUBECONFIG={state['kubeconfig']}")
        return 0
    os.setsid()
    try:
        node.start()
    except Exception as error:  # reported through the state file, then the child ends
        STATE_FILE.write_text(json.dumps({"ready": str(error)}))
        os._exit(1)
    state = json.loads(STATE_FILE.read_text())
    STATE_FILE.write_text(json.dumps({**state, "ready": True, "timings": node.timings}))
    while all(p.poll() is None for p in node.processes.values()):
        time.sleep(2)
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.realnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the node and wait until it is Ready")
    up.add_argument("--gpus", type=int, default=4, help="simulated GPUs (default 4)")
    sub.add_parser("down", help="stop the node and remove everything it made")
    sub.add_parser("status", help="say whether a node is up")
    args = parser.parse_args()
    if args.command == "up":
        return _up(args.gpus)
    if args.command == "down":
        left = take_down_recorded()
        print("node down" + (f"; removed {left}" if left else ""))
        return 0
    if STATE_FILE.exists() and recorded_is_alive():
        print(STATE_FILE.read_text())
        return 0
    print("no node is up")
    return 1


if __name__ == "__main__":
    sys.exit(main())
