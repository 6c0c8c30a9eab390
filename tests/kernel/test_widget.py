"""The GPU monitor widget, driven without a frontend: its asyncio task, its models, its buttons.

Readings come from the fake NVML loaded into this process (``fake_nvml``); rewriting the fake's
config is the "hardware" changing. Buttons talk to a fake ``AsyncAgentClient``. Waiting is
always for a condition, with a deadline; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import ipywidgets  # type: ignore[import-untyped]
import pytest
from traitlets import TraitError

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.client import (
    AgentUnavailable,
    AsyncAgentClient,
    Attachment,
    AttachmentState,
    Busy,
    Gpu,
    InvalidRequest,
    Suspension,
)
from jupyter_gpu_hotplug.kernel import render
from jupyter_gpu_hotplug.kernel.cuda import CudaState
from jupyter_gpu_hotplug.kernel.holders import SESSION_ENV, HolderNames
from jupyter_gpu_hotplug.kernel.widget import TASK_PREFIX, GpuMonitorWidget
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess, default_gpus, with_mig_devices
from jupyter_gpu_hotplug.nvml.state import GpuMonitor, GpuProcess
from tests.fixtures.nvml import FakeNvml, add_gpu_node
from tests.fixtures.requirements import needs_root
from tests.fixtures.waiting import eventually

from .samples import STARTED, attachment, node_gpu

INTERVAL = 0.1


class FakeAgent:
    """Stands in for ``AsyncAgentClient``: records calls, answers as told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.attach_result: tuple[Attachment, ...] = ()
        self.error: Exception | None = None
        self.release = asyncio.Event()
        """Cleared: calls block until it is set (or they are cancelled)."""
        self.release.set()
        self.cancelled = False

    async def _answer(self) -> None:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error

    async def attach(self, count: int = 1, **kwargs: Any) -> tuple[Attachment, ...]:
        self.calls.append(("attach", count))
        await self._answer()
        return self.attach_result

    async def detach(self, uuid: str, *, force: bool = False) -> None:
        self.calls.append(("detach", uuid, force))
        await self._answer()

    async def gpus(self) -> tuple[Gpu, ...]:
        self.calls.append(("gpus",))
        return self.node

    async def attachment_state(self, target: Any = None) -> AttachmentState:
        return AttachmentState((), self.suspended)

    node: tuple[Gpu, ...] = ()
    suspended: Suspension | None = None


@pytest.fixture
def monitor(fake_nvml: FakeNvml, dev: Path) -> Iterator[GpuMonitor]:
    with GpuMonitor(dev_dir=dev) as gpu_monitor:
        yield gpu_monitor


@pytest.fixture
def agent() -> FakeAgent:
    return FakeAgent()


def _widget_tasks() -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() if task.get_name().startswith(TASK_PREFIX)}


@pytest.fixture
async def make_widget(
    monitor: GpuMonitor, agent: FakeAgent, cuda: list[CudaState]
) -> AsyncIterator[Callable[..., GpuMonitorWidget]]:
    made: list[GpuMonitorWidget] = []

    def make(**kwargs: Any) -> GpuMonitorWidget:
        options: dict[str, Any] = {
            "interval": INTERVAL,
            "monitor": monitor,
            "client_factory": lambda: cast(AsyncAgentClient, agent),
            "cuda_state": lambda: cuda[-1],
        }
        widget = GpuMonitorWidget(**{**options, **kwargs})
        made.append(widget)
        return widget

    yield make
    for widget in made:
        widget.close()
        await widget.wait_closed()
    assert not _widget_tasks(), "the widget left tasks running"


# --- refreshing -----------------------------------------------------------------------------


async def test_first_snapshot_is_shown_at_once(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    widget = make_widget(autostart=False)

    assert list(widget.rows) == [gpu.uuid for gpu in fake_nvml.gpus]
    assert widget.refreshes == 1
    assert not widget.running


def _utilisation(widget: GpuMonitorWidget, uuid: str) -> int | None:
    state = widget.rows[uuid].state
    return None if state is None else state.utilization_gpu


async def test_models_follow_the_gpus_readings(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    first, second = fake_nvml.gpus
    widget = make_widget()
    assert widget.running

    fake_nvml.update_gpu(
        first.uuid,
        utilization_gpu=77,
        memory_used=first.memory_total // 2,
        temperature=66,
        power_usage=350_000,
        processes=(SimulatedProcess(os.getpid(), 3 * 2**30),),
    )
    await eventually(lambda: _utilisation(widget, first.uuid) == 77, "util is 77")

    shown = widget.rows[first.uuid].info.value
    assert '<span class="gpuhp-fill" style="width: 77.0%"></span>' in shown
    assert "<span>77 %</span>" in shown
    assert 'aria-label="GPU memory in use" aria-valuemin="0" aria-valuemax="100" ' in shown
    assert 'style="width: 50.0%"' in shown
    assert "40 GiB / 80 GiB" in shown
    assert "66 °C · power 350 W / 700 W" in shown
    assert f"<td>{os.getpid()}</td>" in shown
    assert "3.0 GiB" in shown
    assert _utilisation(widget, second.uuid) == 0

    fake_nvml.update_gpu(first.uuid, utilization_gpu=5)
    await eventually(lambda: _utilisation(widget, first.uuid) == 5, "util is 5")
    assert 'style="width: 5.0%"' in widget.rows[first.uuid].info.value


_MEMORY_FILL = re.compile(r'aria-label="GPU memory in use"[^>]*><span class="gpuhp-fill ?([\w-]*)"')


async def test_memory_bar_colour_warns_as_memory_runs_out(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    first, _ = fake_nvml.gpus
    widget = make_widget(autostart=False)
    levels = []
    for used in (0.1, 0.8, 0.95):
        fake_nvml.update_gpu(first.uuid, memory_used=int(first.memory_total * used))
        widget.refresh()
        found = _MEMORY_FILL.search(widget.rows[first.uuid].info.value)
        assert found is not None
        levels.append(found.group(1))

    assert levels == ["", "gpuhp-warning", "gpuhp-danger"]


async def test_unchanged_readings_send_nothing(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    widget = make_widget(autostart=False)
    row = widget.rows[fake_nvml.gpus[0].uuid]
    sent: list[Any] = []
    row.info.observe(sent.append, names="value")

    widget.refresh()
    widget.refresh()
    fake_nvml.update_gpu(fake_nvml.gpus[0].uuid, temperature=71)
    widget.refresh()

    assert len(sent) == 1


async def test_new_gpu_gets_a_row_without_recreating_the_widget(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    widget = make_widget()
    before = widget.rows
    children_box = widget.rows_box
    second = fake_nvml.gpus[1]

    fake_nvml.write(default_gpus(3))  # a third GPU joins this container's view
    await eventually(lambda: len(widget.rows) == 3, "three rows are shown")

    third = fake_nvml.gpus[2]
    assert widget.rows_box is children_box
    assert list(widget.rows_box.children) == list(widget.rows.values())
    for uuid, row in before.items():
        assert widget.rows[uuid] is row, "existing rows are updated in place"
    assert third.uuid in widget.rows

    fake_nvml.write(default_gpus(1))
    await eventually(lambda: len(widget.rows) == 1, "released GPUs' rows are gone")
    assert second.uuid not in widget.rows
    assert before[second.uuid].comm is None, "a removed row's models are closed"


@needs_root
async def test_hot_attached_device_node_adds_a_row(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml, dev: Path
) -> None:
    fake_nvml.set_device_filter(dev)  # like NVML in a container: a GPU needs its /dev node
    widget = make_widget()
    assert widget.rows == {}
    gpu = fake_nvml.gpus[1]

    node = add_gpu_node(dev, gpu.minor)
    await eventually(lambda: list(widget.rows) == [gpu.uuid], "the attached GPU is shown")
    node.unlink()
    await eventually(lambda: widget.rows == {}, "the detached GPU is gone")


async def test_rows_use_the_node_numbering_and_attach_says_why_it_cannot(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    first, second = fake_nvml.gpus[0], fake_nvml.gpus[1]
    # On the node these are GPUs 3 and 0; both are taken.
    agent.node = (
        node_gpu(first.uuid, 3, state="attached", pid=4242),
        node_gpu(second.uuid, 0, state="attached", pid=4242),
    )
    widget = make_widget()

    row = widget.rows[first.uuid]
    await eventually(lambda: "GPU 3 (cuda:0)" in row.info.value, "the node's index is shown")
    assert "GPU 0 (cuda:1)" in widget.rows[second.uuid].info.value
    assert f'title="{first.uuid}">{first.uuid[:12]}<' in row.info.value  # collapsed UUID
    assert 'class="gpuhp-spark"' in row.info.value
    assert widget.attach_button.disabled
    assert "No GPU free (all 2 taken)" in widget.attach_reason.value
    assert "--wait" in widget.attach_reason.value

    agent.node = (
        node_gpu(first.uuid, 3, state="attached", pid=4242),
        node_gpu(second.uuid, 0, state="free"),
    )
    await eventually(lambda: not widget.attach_button.disabled, "a GPU freed up")
    assert widget.attach_reason.value == ""


async def test_a_suspended_kernel_is_said_in_the_header_and_the_text_until_it_resumes(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent
) -> None:
    agent.suspended = Suspension(
        state="suspended",
        model="NVIDIA H100 80GB HBM3",
        uuids=(GpuUuid("GPU-a4bd620b-df27-5b18-a4aa-19cb70a40624"),),
        pids=(4242,),
        host_memory=3 * 2**30,
    )
    widget = make_widget()
    said = (
        "This kernel is suspended (state kept, 3.0 GiB in host memory); '%gpu attach' resumes "
        "it on 1 free NVIDIA H100 80GB HBM3 GPU (the same one when free)."
    )

    await eventually(lambda: html.escape(said) in widget.header.value, "the header says it")
    assert widget.text().splitlines()[-1] == said

    agent.suspended = None
    widget.attach_button.click()  # an action reads the node (and the kernel's state) again
    await eventually(lambda: "suspended" not in widget.header.value, "resumed: not said")
    assert "suspended" not in widget.text()


async def test_a_message_goes_when_the_gpus_change_after_it(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    widget = make_widget()
    uuid = fake_nvml.gpus[0].uuid
    widget.rows[uuid].detach_button.click()
    await eventually(lambda: "Detached" in widget.status.value, "the detach finished")

    fake_nvml.write(default_gpus(1))  # the other GPU goes: the message is stale
    await eventually(lambda: widget.status.value == "", "the stale message is gone")


async def test_header_badge_and_text_form(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    widget = make_widget(autostart=False)

    assert "SIMULATED" in widget.header.value
    assert "2 GPUs" in widget.header.value
    assert "var(--jp-ui-font-color1" in widget.header.value
    bundle = widget._repr_mimebundle_()
    assert bundle is not None
    assert bundle["text/plain"].startswith("This kernel sees (NVML): 2 GPUs, SIMULATED")
    assert "application/vnd.jupyter.widget-view+json" in bundle


async def test_interval_must_be_sensible(make_widget: Callable[..., GpuMonitorWidget]) -> None:
    with pytest.raises(TraitError, match=r"at least 0\.1"):
        make_widget(interval=0.01)


# --- pausing and closing ------------------------------------------------------------------


async def test_pauses_while_no_view_shows_it(
    make_widget: Callable[..., GpuMonitorWidget],
) -> None:
    widget = make_widget()
    widget._view_count = 1  # what the frontend sends when a view appears...
    widget._view_count = 0  # ...and when the last one goes
    assert widget.paused
    await asyncio.sleep(0)  # let the task reach its wait
    paused_at = widget.refreshes

    await asyncio.sleep(5 * INTERVAL)
    assert widget.refreshes == paused_at, "no refresh while hidden"

    widget._view_count = 2
    await eventually(lambda: widget.refreshes > paused_at, "refreshing resumes")
    assert not widget.paused


async def test_a_frontend_that_never_counts_views_does_not_pause_it(
    make_widget: Callable[..., GpuMonitorWidget],
) -> None:
    widget = make_widget()
    widget._view_count = 0

    start = widget.refreshes
    await eventually(lambda: widget.refreshes > start + 1, "refreshes continue")


async def test_close_stops_the_task_and_closes_every_model(
    make_widget: Callable[..., GpuMonitorWidget], fake_nvml: FakeNvml
) -> None:
    widget = make_widget()
    await eventually(lambda: widget.refreshes > 1, "the task refreshed")
    models = {model.model_id for model in _all_models(widget)}
    assert _widget_tasks()

    widget.close()
    await widget.wait_closed()
    closed_at = widget.refreshes
    fake_nvml.update_gpu(fake_nvml.gpus[0].uuid, utilization_gpu=99)
    await asyncio.sleep(5 * INTERVAL)

    assert widget.refreshes == closed_at, "no update after close"
    assert not widget.running
    assert not _widget_tasks()
    assert not models & set(ipywidgets.widgets.widget._instances), "models left open"
    with pytest.raises(RuntimeError, match="closed"):
        widget.start()


async def test_close_cancels_a_running_action(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent
) -> None:
    agent.release.clear()  # the agent never answers
    widget = make_widget()
    widget.attach_button.click()
    await eventually(lambda: ("attach", 1) in agent.calls, "the attach was sent")
    assert len(_widget_tasks()) == 2

    widget.close()
    await widget.wait_closed()

    assert agent.cancelled
    assert not _widget_tasks()


def _all_models(widget: Any) -> list[Any]:
    found = [widget]
    for part in ("layout", "style"):
        model = getattr(widget, part, None)
        if isinstance(model, ipywidgets.Widget):
            found.append(model)
    for child in getattr(widget, "children", ()):
        found.extend(_all_models(child))
    return found


# --- buttons ------------------------------------------------------------------------------


async def test_attach_button_attaches_and_says_gpu_ready(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    gpu = fake_nvml.gpus[0]
    agent.attach_result = (attachment(gpu.uuid, gpu.minor),)
    widget = make_widget(autostart=False)
    widget.count.value = 2

    widget.attach_button.click()
    await eventually(lambda: "GPU ready" in widget.status.value, "the attach finished")

    assert agent.calls == [("attach", 2)]
    assert f"Attached GPU {gpu.minor} (/dev/nvidia{gpu.minor})" in widget.status.value
    assert not widget.attach_button.disabled


async def test_attach_with_cuda_started_warns(
    make_widget: Callable[..., GpuMonitorWidget],
    agent: FakeAgent,
    fake_nvml: FakeNvml,
    cuda: list[CudaState],
) -> None:
    gpu = fake_nvml.gpus[0]
    agent.attach_result = (attachment(gpu.uuid, gpu.minor),)
    cuda.append(STARTED)
    widget = make_widget(autostart=False)

    widget.attach_button.click()
    await eventually(lambda: "already initialised" in widget.status.value, "the warning")

    assert "gpuhp-warn" in widget.status.value
    assert "!python train.py" in widget.status.value


async def test_buttons_are_disabled_while_an_action_runs(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent
) -> None:
    agent.release.clear()
    widget = make_widget(autostart=False)

    widget.attach_button.click()
    await eventually(lambda: agent.calls != [], "the attach was sent")
    disabled = [widget.attach_button.disabled] + [
        row.detach_button.disabled for row in widget.rows.values()
    ]
    agent.release.set()
    await eventually(lambda: not widget.attach_button.disabled, "the attach finished")

    assert all(disabled)
    assert not any(row.detach_button.disabled for row in widget.rows.values())


async def test_the_header_names_the_notebook_that_holds_the_gpus(
    make_widget: Callable[..., GpuMonitorWidget],
) -> None:
    holders = HolderNames(environ={SESSION_ENV: "/work/train.ipynb"})
    widget = make_widget(autostart=False, holders=holders)

    assert f"held by this notebook (train.ipynb, process {os.getpid()})" in widget.header.value


async def test_more_gpus_than_the_node_has_is_said_as_the_magic_says_it(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent
) -> None:
    agent.node = tuple(
        Gpu.from_wire(
            {
                "uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000",
                "index": i,
                "minor": i,
                "name": "GPU",
                "memory_total": 1,
                "state": "free",
                "target": None,
                "simulated": True,
            }
        )
        for i in range(2)
    )
    agent.error = InvalidRequest(
        "count must be an integer from 1 to 8 (the number of GPUs to attach), got 3; "
        "the request format is described in /v1/openapi.json",
        status=400,
        code="invalid_request",
        extra={"field": "count"},
    )
    widget = make_widget(autostart=False)
    widget.count.value = 3

    widget.attach_button.click()
    await eventually(lambda: "Cannot attach" in widget.status.value, "the refusal")

    assert "Cannot attach 3 GPUs: this node has 2 GPUs in all (2 free now)." in widget.status.value
    assert "openapi" not in widget.status.value


async def test_agent_errors_are_shown_in_the_status_line(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent
) -> None:
    agent.error = AgentUnavailable(agent_url="unix:/nowhere.sock", reason="No such file")
    widget = make_widget(autostart=False)

    widget.attach_button.click()
    await eventually(lambda: "No GPU agent on this node" in widget.status.value, "the error")

    assert "gpuhp-error" in widget.status.value


async def test_detach_button(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    uuid = fake_nvml.gpus[0].uuid
    widget = make_widget(autostart=False)

    widget.rows[uuid].detach_button.click()
    await eventually(lambda: f"Detached {uuid[:12]}" in widget.status.value, "the detach finished")

    assert agent.calls == [("detach", uuid, False)]


async def test_force_detach_asks_for_a_second_click(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    uuid = fake_nvml.gpus[0].uuid
    widget = make_widget(autostart=False)
    row = widget.rows[uuid]

    row.force_button.click()
    armed = (row.armed, row.force_button.description, row.cancel_button.layout.display)
    row.cancel_button.click()
    cancelled = (row.armed, row.cancel_button.layout.display)
    await asyncio.sleep(0)
    assert agent.calls == [], "neither the first click nor cancel detaches"

    row.force_button.click()
    row.force_button.click()
    await eventually(lambda: agent.calls != [], "the forced detach was sent")

    assert armed == (True, "Confirm: kill processes and detach", None)
    assert cancelled == (False, "none")
    assert agent.calls == [("detach", uuid, True)]
    assert row.force_button.button_style == ""


async def test_busy_gpu_suggests_force(
    make_widget: Callable[..., GpuMonitorWidget], agent: FakeAgent, fake_nvml: FakeNvml
) -> None:
    uuid = fake_nvml.gpus[0].uuid
    agent.error = Busy(
        f"GPU {uuid} is in use by process(es) 42 (python); stop them",
        status=409,
        code="busy",
        extra={"processes": [{"pid": 42, "command": "python"}], "uuid": uuid},
    )
    widget = make_widget(autostart=False)

    widget.rows[uuid].detach_button.click()
    await eventually(lambda: "in use" in widget.status.value, "the refusal is shown")

    assert "Force-detach" in widget.status.value


# --- rendering ----------------------------------------------------------------------------


def test_process_names_are_escaped() -> None:
    table = render.process_table_html((GpuProcess(7, "<img src=x onerror=alert(1)>", 2**20),))

    assert "<img" not in table
    assert "&lt;img src=x onerror=alert(1)&gt;" in table
    assert "1.0 MiB" in table


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "n/a"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (80 * 2**30, "80 GiB"),
        (int(79.6 * 2**30), "80 GiB"),
        (3 * 2**30, "3.0 GiB"),
    ],
)
def test_human_bytes(value: int | None, text: str) -> None:
    assert render.human_bytes(value) == text


def test_lost_gpu_is_shown_as_lost(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    first = fake_nvml.gpus[0]
    fake_nvml.write(dataclasses.replace(gpu, lost=gpu.uuid == first.uuid) for gpu in fake_nvml.gpus)
    snapshot = monitor.snapshot()

    lost = next(gpu for gpu in snapshot.gpus if gpu.lost)
    assert "LOST" in render.gpu_summary(lost)
    assert "lost: the GPU stopped answering" in render.gpu_row_html(lost)


@pytest.mark.parametrize(
    ("percent", "width", "now"),
    [(None, "0.0", None), (-3, "0.0", "0"), (42.04, "42.0", "42"), (250, "100.0", "100")],
)
def test_bar_is_clamped(percent: float | None, width: str, now: str | None) -> None:
    bar = render.bar_html(percent, label="x")

    assert f'style="width: {width}%"' in bar
    if now is None:
        assert "aria-valuenow" not in bar
    else:
        assert f'aria-valuenow="{now}"' in bar


def test_mig_slice_is_shown_as_a_slice_of_its_gpu(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    whole, other = fake_nvml.gpus
    fake_nvml.write([with_mig_devices(whole, ["2g.20gb"]), other])

    gpu, mig_slice, _ = monitor.snapshot().gpus

    assert render.gpu_summary(mig_slice).startswith(
        "[0] └ MIG slice 2g.20gb  GPU instance 1, compute instance 0  memory 0 B / 19 GiB"
    )
    assert "util" in render.gpu_summary(gpu)
    row = render.gpu_row_html(mig_slice)
    assert "MIG slice 2g.20gb of GPU 0 · GPU instance 1, compute instance 0" in row
    assert "slice memory in use" in row and "GPU utilisation" not in row
