"""The user's path through a real JupyterHub on the real node, timed as a user lives it.

Run as root, after ``bash tests/realnode/build.sh`` (the hub's images build on first use)::

    .venv/bin/python benchmarks/bench_hub_path.py [--rounds 10] [--spawns 2]
        [--screenshots docs/images]

It brings up a ``cdi`` node, the agent's DaemonSet and the hub (``tests/realnode/hub.py``, as
``python -m tests.realnode up --hub`` does) and prints:

- the node's milestones and **hub up**: the agent's DaemonSet Ready, then the hub and its
  proxy Ready (images imported into the node, their builds cached);
- per spawn (``--spawns``, alice's server started and stopped each time, in Chromium): **login
  → spawn form**, **click Start → the Lab's URL**, **→ Lab ready** (the notebook open, its
  kernel up, the GPU toolbar item showing the free count), and **click Stop on the control
  panel → the pod gone**;
- per round (``--rounds``): **click Attach 1 GPU → the toolbar shows it**, **→ the cell sees
  the GPU** (the probe cell run right after, its output naming the device node), **click
  Detach (confirmed) → the UI shows none**, **→ free on the node** (no holder pod left).

Every step is what the tier's browser tests do (``tests/realnode/hub_browser.py``); the
figures are printed, never asserted. ``--screenshots DIR`` also saves the spawn form, the
toolbar's menu in the hub's Lab and the Lab with the GPU attached (``hub-*.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _agent import summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.browser.gpu_lab import LOAD_TIMEOUT_MS, SETTLE_MS, GpuLab
from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS
from tests.realnode.agent import install_agent_account
from tests.realnode.cluster import Cluster, eventually
from tests.realnode.deployment import deployed_agent
from tests.realnode.hub import NAMESPACE, Hub, running_hub
from tests.realnode.hub_browser import SPAWN_TIMEOUT_MS, log_in, open_notebook, spawn
from tests.realnode.node import new_node

USER = "alice"


def since(start: float) -> float:
    return time.perf_counter() - start


def timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return since(start)


def until_free(hub: Hub, timeout: float = 120.0) -> None:
    """Poll the node every 50 ms (``eventually``'s 200 ms is too coarse to time a detach)
    until no holder pod is left."""
    deadline = time.monotonic() + timeout
    while hub.cluster.holders(NAMESPACE):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a holder is still there after {timeout:.0f} s")
        time.sleep(0.05)


def attach_round(lab: GpuLab, hub: Hub, shots: Path | None) -> tuple[float, float, float, float]:
    """Click Attach → toolbar, → cell; click Detach → UI, → node. Seconds."""
    lab.button.click()
    expect(lab.menu).to_be_visible()
    if shots is not None:
        lab.page.screenshot(path=shots / "hub-toolbar-menu.png")
    start = time.perf_counter()
    lab.menu_item("Attach 1 GPU").click()
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    toolbar = since(start)
    [gpu] = lab.attached()
    seen = lab.run_probe()
    cell = since(start)
    assert seen == f"['{gpu['device']}']", seen
    if shots is not None:  # with the magic's status and NVML's answer in the cells too
        lab.run_all()
        expect(lab.cell_output(2)).to_contain_text(gpu["uuid"])
        lab.page.screenshot(path=shots / "hub-lab-attached.png")
    lab.choose(f"Detach GPU {gpu['index']}")
    dialog = lab.page.locator(".jp-Dialog")
    expect(dialog).to_be_visible(timeout=SETTLE_MS)
    start = time.perf_counter()
    dialog.locator("button", has_text="Detach").click()
    expect(lab.summary).to_have_text(re.compile(r"^0 attached"), timeout=SETTLE_MS)
    ui = since(start)
    until_free(hub)
    return toolbar, cell, ui, since(start)


def spawn_round(
    chromium: Browser, hub: Hub, rounds: int, shots: Path | None
) -> tuple[list[float], list[list[float]]]:
    """One login, spawn, ``rounds`` attach rounds, stop. The spawn's and the rounds' figures."""
    start = time.perf_counter()
    page, log = log_in(chromium, hub, USER)
    login = since(start)
    if shots is not None:
        page.screenshot(path=shots / "hub-spawn-form.png")
    start = time.perf_counter()
    spawn(page, USER)
    url = since(start)
    lab, _ = open_notebook(page, log, hub, USER)
    ready = since(start)
    figures: list[list[float]] = []
    try:
        for i in range(rounds):
            figures.append(list(attach_round(lab, hub, shots if i == 0 else None)))
            print(f"  round {i + 1}: " + "  ".join(f"{s * 1000:7.0f} ms" for s in figures[-1]))
        stop = timed(lambda: stop_from_control_panel(page, hub))
        # Untimed: the next login must find the spawn form, not a stop still pending.
        eventually(lambda: hub.server_stopped(USER), "the hub is done stopping it")
    finally:
        lab.close()
    return [login, url, ready, stop], figures


def stop_from_control_panel(page: Page, hub: Hub) -> None:
    page.goto(f"{hub.url}/hub/home", timeout=LOAD_TIMEOUT_MS)
    page.locator("#stop").click()
    expect(page.locator("#start")).to_be_visible(timeout=SPAWN_TIMEOUT_MS)
    eventually(lambda: hub.server_pod(USER) is None, "the notebook pod is gone", 300)


def print_column(name: str, samples: list[float]) -> None:
    print(f"  {name:<34} {summary(samples)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="attach rounds per spawn")
    parser.add_argument("--spawns", type=int, default=2)
    parser.add_argument("--screenshots", type=Path, help="save hub-*.png here (first spawn)")
    args = parser.parse_args()

    node = new_node(mode="cdi")
    with contextlib.ExitStack() as stack:
        node.start()
        stack.callback(node.stop)
        print(f"node Ready; seconds to each milestone: {node.timings}")
        cluster = stack.enter_context(contextlib.closing(Cluster(node)))
        install_agent_account(cluster)
        start = time.perf_counter()
        agent_ip = stack.enter_context(deployed_agent(cluster, "cdi"))
        agent = since(start)
        hub = stack.enter_context(running_hub(cluster, agent_ip))
        print(f"agent DaemonSet Ready {agent:6.1f} s; hub and proxy Ready {since(start):6.1f} s")
        playwright = stack.enter_context(sync_playwright())
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS), headless=True
        )
        spawns: list[list[float]] = []
        rounds: list[list[float]] = []
        for i in range(args.spawns):
            spawned, figures = spawn_round(chromium, hub, args.rounds, args.screenshots)
            print(f"spawn {i + 1}: " + "  ".join(f"{s:6.1f} s" for s in spawned))
            spawns.append(spawned)
            rounds.extend(figures)
            args.screenshots = None
        chromium.close()
    print(f"\nspawns (n={len(spawns)}, alice's server, default profile):")
    for column, name in enumerate(
        ("login -> spawn form", "click Start -> Lab URL", "click Start -> Lab ready",
         "click Stop -> pod gone")
    ):  # fmt: skip
        print_column(name, [s[column] for s in spawns])
    print(f"\nattach rounds (n={len(rounds)}):")
    for column, name in enumerate(
        ("click Attach -> toolbar shows it", "click Attach -> cell sees the GPU",
         "click Detach -> UI shows none", "click Detach -> free on the node")
    ):  # fmt: skip
        print_column(name, [r[column] for r in rounds])
    return 0


if __name__ == "__main__":
    sys.exit(main())
