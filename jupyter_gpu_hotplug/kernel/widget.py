"""The live GPU monitor: an ipywidget showing what the GPUs of this kernel are doing, with buttons.

Boundary: ipywidgets models and one asyncio task on the kernel's event loop. Readings come from
``nvml.state.GpuMonitor`` (what this kernel's container can see), actions go through
``AsyncAgentClient``, wording and units from ``render``. Nothing here talks HTTP or NVML itself.

Why an asyncio task and no thread: ipykernel runs its shell on an asyncio loop, and since
ipykernel 7 widget messages sent from other threads are not delivered reliably. A task started
with ``asyncio.get_running_loop()`` from a cell runs whenever the kernel is idle and sends its
updates like any cell would. While a cell runs, the loop is busy and the monitor simply waits.

Why the NVML read runs inline on the loop, not in an executor: it is cheap. One refresh of 8
GPUs (snapshot, rendering, model updates) blocks the loop for a median 0.36 ms, and a snapshot
alone costs about 0.35 ms (``benchmarks/bench_gpu_snapshot.py``) — less than a round trip to a
worker thread would save, and a thread would need its own care on every path. Measured in a
real kernel at 1 Hz with 8 simulated GPUs (``benchmarks/bench_widget_overhead.py``), the live
widget costs about 0.13 % of one core while readings stay still and 0.56 % while every reading
changes every second.

Life cycle: the refresh task starts when the widget is made inside a running loop (a kernel
cell) and stops for good on ``close()``, which also cancels running button actions, closes
every child model and releases NVML. While the frontend reports that no view shows the widget
(ipywidgets' ``_view_count`` went back to 0), refreshing pauses; it resumes with the next view.
Rows are keyed by GPU UUID and updated in place: a newly attached GPU adds a row without
re-creating the widget, a released one removes its row.

Forced detach kills processes, so its button asks twice: the first click arms it (the button
turns red and says what will happen, a Cancel button appears), the second click acts.

The node's view comes from the agent every few refreshes (``NODE_EVERY``; at once after an
action): how many GPUs are free — Attach is disabled, with the reason beside it, when none is —
and each GPU's index on the node, so the rows say ``GPU 1 (cuda:0)`` like every other view
rather than the kernel's own ``[0]``. With it comes whether the agent keeps this kernel's CUDA
state without GPUs (``%gpu release --keep``): the header then says "suspended (state kept, …)",
in the words of ``%gpu status``. A message about an action goes as soon as the GPUs change
after it, so it never describes a state that is gone.
"""

from __future__ import annotations

import asyncio
import html
import itertools
from collections.abc import Callable, Coroutine
from typing import Any, Final

import ipywidgets as widgets  # type: ignore[import-untyped]
from traitlets import Float, TraitError, observe, validate

from .._structs import GpuUuid, PidRef
from ..client import (
    AgentClientError,
    AsyncAgentClient,
    Busy,
    Gpu,
    InsufficientGpus,
    InvalidRequest,
    Suspension,
    plain_free,
    plain_total,
)
from ..nvml.state import GpuMonitor, GpuState, Snapshot
from . import render
from .cuda import CudaState, advice, cuda_initialised
from .holders import HolderNames

__all__ = ["DEFAULT_INTERVAL", "MIN_INTERVAL", "GpuMonitorWidget", "GpuRow"]

DEFAULT_INTERVAL: Final = 1.0
MIN_INTERVAL: Final = 0.1
TASK_PREFIX: Final = "gpu-hotplug-monitor"
"""Every task the widget starts is named with this prefix (tests look for leftovers by it)."""
NODE_EVERY: Final = 5
"""Refreshes between two readings of the node's GPUs from the agent (free count, indexes)."""
HISTORY: Final = 60
"""Readings of utilisation each row's sparkline keeps."""
_PROGRESS_TICK: Final = 0.5
_SPINNER: Final = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def _close_tree(widget: Any) -> None:
    """Close ``widget``, its children and its layout/style models.

    ipywidgets keeps every open model in a registry until it is closed; a monitor that adds and
    drops rows for hours must not leave their models behind.
    """
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    for part in ("layout", "style"):
        model = getattr(widget, part, None)
        if isinstance(model, widgets.Widget):
            model.close()
    widget.close()


def _html(text: str) -> str:
    return f'<div class="gpuhp-root">{text}</div>'


class GpuRow(widgets.VBox):  # type: ignore[misc]
    """One GPU: its readings as one HTML model (``render.gpu_row_html``) and its buttons.

    Why one HTML model with HTML bars rather than ``FloatProgress`` widgets: each changed model
    is one message from the kernel, and on a busy GPU every reading changes every second. One
    model per GPU keeps the 1 Hz monitor at one message per GPU per tick
    (``benchmarks/bench_widget_overhead.py`` has the figures).
    """

    def __init__(self, *, on_detach: Callable[[GpuUuid, bool], None]) -> None:
        self._on_detach = on_detach
        self.state: GpuState | None = None
        """The readings shown now."""
        self.node_index: int | None = None
        """The GPU's index on the node, once the agent has said it."""
        self.history: tuple[int | None, ...] = ()
        """Recent utilisation readings, oldest first (the sparkline)."""
        self.armed = False
        """The force-detach button was clicked once and waits for the confirming click."""
        self.info = widgets.HTML()
        self.detach_button = widgets.Button(
            description="Detach", icon="eject", tooltip="Release this GPU from this kernel"
        )
        self.force_button = widgets.Button(
            description="Force-detach…",
            tooltip="Kill the processes that use this GPU, then release it (asks to confirm)",
            layout=widgets.Layout(width="auto"),  # the armed text is longer than a button
        )
        self.cancel_button = widgets.Button(
            description="Cancel", layout=widgets.Layout(display="none")
        )
        self.detach_button.on_click(lambda _: self._detach(force=False))
        self.force_button.on_click(lambda _: self._force_clicked())
        self.cancel_button.on_click(lambda _: self.disarm())
        buttons = widgets.HBox([self.detach_button, self.force_button, self.cancel_button])
        super().__init__([self.info, buttons])
        self.add_class("gpuhp-row")

    @property
    def uuid(self) -> GpuUuid | None:
        return None if self.state is None else self.state.uuid

    def show(self, gpu: GpuState, *, busy: bool, node_index: int | None) -> None:
        """Show ``gpu``'s readings; nothing is rendered or sent when they did not change."""
        # Unchanged readings send nothing: the sparkline is redrawn when a reading changes
        # (until then it lags by the readings that repeated the last value).
        changed = gpu != self.state or node_index != self.node_index
        self.history = (*self.history, gpu.utilization_gpu)[-HISTORY:]
        if changed:
            self.state, self.node_index = gpu, node_index
            self.info.value = _html(
                render.gpu_row_html(gpu, node_index=node_index, history=self.history, slots=HISTORY)
            )
        self.set_busy(busy)

    def set_busy(self, busy: bool) -> None:
        """Buttons are disabled while an action runs, and without a UUID to act on."""
        disabled = busy or self.uuid is None
        self.detach_button.disabled = disabled
        self.force_button.disabled = disabled
        if busy:
            self.disarm()

    def disarm(self) -> None:
        self.armed = False
        self.force_button.description = "Force-detach…"
        self.force_button.button_style = ""
        self.cancel_button.layout.display = "none"

    def _force_clicked(self) -> None:
        if not self.armed:
            self.armed = True
            self.force_button.description = "Confirm: kill processes and detach"
            self.force_button.button_style = "danger"
            self.cancel_button.layout.display = None
            return
        self.disarm()
        self._detach(force=True)

    def _detach(self, *, force: bool) -> None:
        if self.uuid is not None:
            self._on_detach(self.uuid, force)


class GpuMonitorWidget(widgets.VBox):  # type: ignore[misc]
    """The monitor: a header, attach controls, one ``GpuRow`` per GPU, and a status line.

    ``monitor``: where readings come from (default: a new ``GpuMonitor``, owned and closed by
    this widget). ``client_factory``: the agent client for the buttons (made per action).
    ``cuda_state``: asked after an attach, for the advice shown. ``autostart``: start refreshing
    now when an event loop is running (a kernel cell); otherwise call ``start()`` from one.
    ``holders``: names this kernel by its notebook in the header.
    """

    interval = Float(DEFAULT_INTERVAL, help="Seconds between two refreshes while shown.")

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL,
        monitor: GpuMonitor | None = None,
        client_factory: Callable[[], AsyncAgentClient] = AsyncAgentClient.from_environment,
        cuda_state: Callable[[], CudaState] = cuda_initialised,
        autostart: bool = True,
        max_attach: int = 8,
        holders: HolderNames | None = None,
    ) -> None:
        self._holders = holders or HolderNames()
        self._owns_monitor = monitor is None
        self._monitor = monitor or GpuMonitor()
        self._client_factory = client_factory
        self._cuda_state = cuda_state
        self._rows: dict[str, GpuRow] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresh_task: asyncio.Task[None] | None = None
        self._shown = asyncio.Event()
        self._shown.set()
        self._ever_viewed = False
        self._busy = False
        self._closed = False
        self._refreshes = 0
        self._last: Snapshot | None = None
        self._node: tuple[Gpu, ...] | None = None
        """The node's GPUs as the agent last listed them (``None``: not asked, or no answer)."""
        self._suspended: Suspension | None = None
        """This kernel's CUDA state kept by the agent without its GPUs, as last read."""
        self._node_due = True
        self._said_for: frozenset[str] | None = None
        """The GPUs shown when the status line last spoke of an action."""
        self.header = widgets.HTML()
        self.count = widgets.BoundedIntText(
            value=1,
            min=1,
            max=max_attach,
            description="GPUs",
            layout=widgets.Layout(width="120px"),
            style={"description_width": "40px"},
        )
        self.attach_button = widgets.Button(
            description="Attach",
            icon="plus",
            button_style="primary",
            tooltip="Attach this many GPUs to this kernel",
        )
        self.attach_button.on_click(lambda _: self._spawn(self._attach(self.count.value)))
        self.attach_reason = widgets.HTML()
        """Why Attach is disabled (no free GPU), beside it."""
        self.rows_box = widgets.VBox()
        self.status = widgets.HTML()
        controls = widgets.HBox(
            [self.count, self.attach_button, self.attach_reason],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
        )
        super().__init__([self.header, controls, self.rows_box, self.status])
        self.interval = interval
        self._view_count = 0  # asks the frontend to count views (see _views_changed)
        self.refresh()
        if autostart and _running_loop() is not None:
            self.start()

    # --- state for callers and tests --------------------------------------------------------

    @property
    def rows(self) -> dict[str, GpuRow]:
        """The rows by GPU UUID (``index-N`` for a GPU lost before its UUID was read); a copy."""
        return dict(self._rows)

    @property
    def refreshes(self) -> int:
        """How many snapshots were applied so far."""
        return self._refreshes

    @property
    def running(self) -> bool:
        return self._refresh_task is not None and not self._refresh_task.done()

    @property
    def paused(self) -> bool:
        """No view shows the widget any more, so it does not refresh."""
        return not self._shown.is_set()

    @property
    def tasks(self) -> frozenset[asyncio.Task[None]]:
        """The widget's unfinished tasks (the refresh loop and running actions)."""
        return frozenset(self._tasks)

    # --- refreshing ---------------------------------------------------------------------------

    @validate("interval")
    def _valid_interval(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not value >= MIN_INTERVAL:
            raise TraitError(f"interval must be at least {MIN_INTERVAL} s, got {value}")
        return value

    @observe("_view_count")
    def _views_changed(self, change: dict[str, Any]) -> None:
        views = change["new"]
        if views is None:
            return
        if views > 0:
            self._ever_viewed = True
            self._shown.set()
        elif self._ever_viewed:
            # Only a frontend that once reported a view can report that none is left; one
            # that never counts (or has not yet) must not freeze the monitor.
            self._shown.clear()

    def start(self) -> None:
        """Refresh every ``interval`` seconds on the running loop (call from a coroutine or a
        kernel cell). Idempotent. ``RuntimeError`` without a running loop or after close."""
        if self._closed:
            raise RuntimeError("the GPU monitor is closed; make a new one")
        if self.running:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(), name=f"{TASK_PREFIX}-refresh")
        self._refresh_task = self._track(task)

    def stop(self) -> None:
        """Stop refreshing (``start`` again to resume); running actions go on."""
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            self._refresh_task = None

    def refresh(self) -> Snapshot:
        """Take one snapshot and show it now."""
        snapshot = self._monitor.snapshot()
        self._apply(snapshot)
        return snapshot

    async def _run(self) -> None:
        while True:
            await self._shown.wait()
            if self._node_due or self._refreshes % NODE_EVERY == 0:
                await self._read_node()
            self.refresh()
            await asyncio.sleep(self.interval)

    async def _read_node(self) -> None:
        """Ask the agent for the node's GPUs; without an answer the widget goes on with
        what NVML here says (Attach stays enabled: the agent will say why it cannot)."""
        self._node_due = False
        client = self._client_factory()
        try:
            self._node = await client.gpus()
        except AgentClientError:
            self._node = None
        try:
            self._suspended = (await client.attachment_state()).suspended
        except AgentClientError:
            self._suspended = None
        self._show_free()

    def _show_free(self) -> None:
        node = self._node
        # The button is an attach of a count alone: only a GPU such an attach may get counts.
        none_free = node is not None and plain_free(node) == 0
        self.attach_button.disabled = self._busy or none_free
        self.attach_button.tooltip = (
            "No GPU is free on this node" if none_free else "Attach this many GPUs to this kernel"
        )
        reason = render.no_free_gpu_html(plain_total(node or ())) if none_free else ""
        if self.attach_reason.value != reason:
            self.attach_reason.value = reason

    def _apply(self, snapshot: Snapshot) -> None:
        self._last = snapshot
        self._refreshes += 1
        simulated = snapshot.simulated or any(gpu.simulated for gpu in snapshot.gpus)
        details = [snapshot.message]
        if snapshot.driver_version:
            details.append(f"driver {snapshot.driver_version}")
        if snapshot.cuda_driver_version:
            details.append(f"CUDA {snapshot.cuda_driver_version}")
        own = self._holders.describe(PidRef(self._holders.own_pid))
        self.header.value = render.CSS + _html(
            "<b>GPUs of this notebook</b>"
            + (render.badge_html("SIMULATED") if simulated else "")
            + f' <span class="gpuhp-muted">· held by {html.escape(own)}</span>'
            + f' <span class="gpuhp-muted">· {html.escape(" · ".join(details))}</span>'
            + self._suspended_html()
        )
        node_indexes = {gpu.uuid: gpu.index for gpu in self._node or ()}
        rows = []
        for gpu in snapshot.gpus:
            key = gpu.uuid or f"index-{gpu.index}"
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = GpuRow(on_detach=self._detach_clicked)
                self._node_due = True  # a GPU new here: learn its index on the node
            row.show(gpu, busy=self._busy, node_index=node_indexes.get(GpuUuid(key)))
            rows.append(row)
        shown = {id(row) for row in rows}
        for key, row in list(self._rows.items()):
            if id(row) not in shown:
                del self._rows[key]
                _close_tree(row)
        if tuple(rows) != tuple(self.rows_box.children):
            self.rows_box.children = tuple(rows)
        shown_now = frozenset(self._rows)
        if self._said_for is not None and shown_now != self._said_for:
            self._said_for = None  # the GPUs changed since: that message is stale
            self.status.value = ""

    def _suspended_html(self) -> str:
        """The header's word on a kept CUDA state (nothing while the kernel has none)."""
        if self._suspended is None:
            return ""
        line = html.escape(render.suspended_line(self._suspended))
        return f'<br><span class="gpuhp-warn">{line}</span>'

    # --- actions ------------------------------------------------------------------------------

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            # A bug, not an agent answer (those are handled in the actions): show it rather
            # than let asyncio log "exception was never retrieved" where nobody looks.
            self._say("error", f"The GPU monitor hit an unexpected error: {error!r}")

    def _spawn(self, action: Coroutine[Any, Any, None]) -> None:
        loop = _running_loop()
        if loop is None or self._closed:
            action.close()
            self._say("error", "The GPU monitor's buttons need a running Jupyter kernel.")
            return
        self._track(loop.create_task(action, name=f"{TASK_PREFIX}-action"))

    def _detach_clicked(self, uuid: GpuUuid, force: bool) -> None:
        self._spawn(self._detach(uuid, force=force))

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._show_free()
        for row in self._rows.values():
            row.set_busy(busy)
        if not busy:
            self._node_due = True  # the action changed the node: read it at the next tick

    def _say(self, kind: str, text: str) -> None:
        """Show ``text`` in the status line; ``kind`` is ok, warn, error or busy. The message
        stays until the GPUs shown change (then it would describe a state that is gone)."""
        css = {"ok": "gpuhp-ok", "warn": "gpuhp-warn", "error": "gpuhp-error"}.get(
            kind, "gpuhp-muted"
        )
        self.status.value = _html(f'<span class="{css}">{html.escape(text)}</span>')
        self._said_for = None if kind == "busy" else frozenset(self._rows)

    async def _attach(self, count: int) -> None:
        self._set_busy(True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        frames = itertools.cycle(_SPINNER)
        label = f"Attaching {count} GPU{'' if count == 1 else 's'}"
        call: asyncio.Future[Any] | None = None
        try:
            self._say("busy", f"{label}…")
            call = asyncio.ensure_future(self._client_factory().attach(count))
            while not call.done():
                await asyncio.wait({call}, timeout=_PROGRESS_TICK)
                self._say("busy", f"{next(frames)} {label}… {loop.time() - started:.0f} s")
            attachments = call.result()
        except (InsufficientGpus, InvalidRequest) as error:
            if isinstance(error, InvalidRequest) and error.field != "count":
                self._say("error", error.message)
            else:
                self._say("error", await self._too_many(count, error))
        except AgentClientError as error:
            self._say("error", error.message)
        else:
            state = self._cuda_state()
            names = ", ".join(f"GPU {a.index} ({a.device})" for a in attachments)
            self.refresh()
            self._say(
                "warn" if state.initialised else "ok",
                f"Attached {names}.\n{advice(state, attached=len(attachments))}",
            )
        finally:
            if call is not None and not call.done():
                call.cancel()
            self._set_busy(False)

    async def _too_many(self, count: int, error: AgentClientError) -> str:
        """The same words as ``%gpu attach`` for "not that many GPUs"."""
        try:
            gpus: tuple[Gpu, ...] | None = await self._client_factory().gpus()
        except AgentClientError:
            gpus = None
        hint = render.wait_hint(count, gpus, error=error)
        message = render.too_many_gpus(count, gpus, error=error)
        return message if hint is None else f"{message}\n{hint}"

    async def _detach(self, uuid: GpuUuid, *, force: bool) -> None:
        self._set_busy(True)
        try:
            self._say("busy", f"{'Force-detaching' if force else 'Detaching'} {uuid[:12]}…")
            await self._client_factory().detach(uuid, force=force)
        except Busy as error:
            hint = ""
            if error.processes and not force:
                hint = "\nUse 'Force-detach…' to stop them (it kills those processes)."
            self._say("error", error.message + hint)
        except AgentClientError as error:
            self._say("error", error.message)
        else:
            self.refresh()
            self._say("ok", f"Detached {uuid[:12]}.")
        finally:
            self._set_busy(False)

    # --- closing and text form ----------------------------------------------------------------

    def close(self) -> None:
        """Stop refreshing and every running action, close all models, release NVML."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        for task in list(self._tasks):
            task.cancel()
        for child in self.children:
            _close_tree(child)
        self._rows.clear()
        if self._owns_monitor:
            self._monitor.close()
        layout = getattr(self, "layout", None)
        if isinstance(layout, widgets.Widget):
            layout.close()
        super().close()

    async def wait_closed(self) -> None:
        """After ``close()``: wait until the cancelled tasks have finished."""
        pending = [task for task in self._tasks if not task.done()]
        if pending:
            await asyncio.wait(pending)

    def text(self) -> str:
        """The latest readings as text (for frontends that cannot show widgets)."""
        snapshot = self._last or self._monitor.snapshot()
        lines = render.snapshot_lines(snapshot)
        if self._suspended is not None:
            lines.append(render.suspended_line(self._suspended))
        return "\n".join(lines)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        bundle: dict[str, Any] | None = super()._repr_mimebundle_(**kwargs)
        if bundle is not None:
            bundle["text/plain"] = self.text()
        return bundle


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
