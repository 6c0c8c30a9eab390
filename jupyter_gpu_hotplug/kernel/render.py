"""How GPUs look to a person: plain text for ``%gpu`` and terminals, HTML bits for the widget.

Boundary: pure functions from values (``nvml.state.Snapshot``, the client's ``Attachment`` and
``Gpu``) to strings. No I/O, no IPython, no ipywidgets — so both frontends in the kernel share
one wording and one set of units, and it is tested without a kernel.

Everything that reaches HTML goes through ``html.escape``: process names come from
``/proc/<pid>/comm``, which any process may set to anything, markup included.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from ..client import (
    AgentClientError,
    Attachment,
    Gpu,
    InsufficientGpus,
    Suspension,
    plain_free,
    plain_total,
)
from ..nvml.sim import SIMULATED_SUFFIX
from ..nvml.state import GpuProcess, GpuState, Snapshot

__all__ = [
    "CSS",
    "attachment_lines",
    "badge_html",
    "bar_html",
    "gpu_label",
    "gpu_row_html",
    "gpu_summary",
    "human_bytes",
    "memory_level",
    "model_name",
    "no_free_gpu_html",
    "percent",
    "process_table_html",
    "snapshot_lines",
    "sparkline_html",
    "too_many_gpus",
    "usage_ratio",
    "wait_hint",
]

_UNITS: Final = ("B", "KiB", "MiB", "GiB", "TiB")
_MEMORY_WARNING: Final = 75.0
_MEMORY_DANGER: Final = 90.0
_MISSING: Final = "n/a"

CSS: Final = """
<style>
.gpuhp-root { color: var(--jp-ui-font-color1, inherit); font-family: var(--jp-ui-font-family,
  inherit); font-size: var(--jp-ui-font-size1, 13px); }
.gpuhp-badge { display: inline-block; padding: 0 6px; margin-left: 6px; border-radius: 8px;
  font-size: var(--jp-ui-font-size0, 11px); font-weight: 600; line-height: 18px;
  color: var(--jp-ui-inverse-font-color1, #fff); background: var(--jp-warn-color1, #f57c00); }
.gpuhp-muted { color: var(--jp-ui-font-color2, #757575); }
.gpuhp-error { color: var(--jp-error-color1, #d32f2f); white-space: pre-wrap; }
.gpuhp-ok { color: var(--jp-success-color1, #388e3c); white-space: pre-wrap; }
.gpuhp-warn { color: var(--jp-warn-color0, #e65100); white-space: pre-wrap; }
.gpuhp-table { border-collapse: collapse; margin: 2px 0 6px 0;
  font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 12px); }
.gpuhp-root .gpuhp-table th { text-align: left; font-weight: 600;
  color: var(--jp-ui-font-color2, #757575);
  border-bottom: 1px solid var(--jp-border-color2, #e0e0e0);
  padding: 1px 12px 1px 0; white-space: nowrap; }
.gpuhp-root .gpuhp-table td { text-align: left; padding: 1px 12px 1px 0; white-space: nowrap;
  vertical-align: top; color: var(--jp-content-font-color1, inherit); }
.gpuhp-row { border: 1px solid var(--jp-border-color2, #e0e0e0); border-radius: 4px;
  padding: 4px 8px; margin: 4px 0; background: var(--jp-layout-color1, transparent);
  min-width: 0; max-width: 100%; box-sizing: border-box; }
.gpuhp-row .widget-hbox { flex-wrap: wrap; }
.gpuhp-title { display: flex; flex-wrap: wrap; gap: 0 8px; align-items: baseline; }
.gpuhp-metrics { display: grid; grid-template-columns: max-content minmax(40px, 1fr) max-content;
  gap: 2px 8px; align-items: center; margin: 4px 0; max-width: 420px; }
.gpuhp-spark { display: block; width: 100%; height: 18px; }
.gpuhp-spark polyline { fill: none; stroke: var(--jp-brand-color1, #1976d2); stroke-width: 1.5;
  vector-effect: non-scaling-stroke; }
.gpuhp-uuid summary { cursor: pointer; }
.gpuhp-uuid code { font-size: var(--jp-ui-font-size0, 11px); }
.gpuhp-bar { display: block; height: 10px; border-radius: 3px; overflow: hidden;
  background: var(--jp-layout-color3, #bdbdbd); }
.gpuhp-fill { display: block; height: 100%; background: var(--jp-brand-color1, #1976d2); }
.gpuhp-fill.gpuhp-warning { background: var(--jp-warn-color1, #f57c00); }
.gpuhp-fill.gpuhp-danger { background: var(--jp-error-color1, #d32f2f); }
</style>
"""
"""Class rules for every HTML piece below. Colours are JupyterLab's theme variables (with
fallbacks for other frontends), so the widget reads well in light and dark themes alike."""


def human_bytes(value: int | None) -> str:
    """``1073741824`` → ``"1.0 GiB"``, 79.6 GiB → ``"80 GiB"``; ``None`` → ``"n/a"``. One
    decimal below 10, whole numbers above: the JupyterLab extension rounds the same way
    (``format.ts``), so a GPU's memory reads the same in the panel and in ``%gpu``."""
    if value is None:
        return _MISSING
    amount = float(value)
    unit = 0
    while amount >= 1024 and unit < len(_UNITS) - 1:
        amount /= 1024
        unit += 1
    if unit == 0:
        return f"{value} B"
    return f"{amount:.1f} {_UNITS[unit]}" if amount < 10 else f"{amount:.0f} {_UNITS[unit]}"


def usage_ratio(used: int | None, total: int | None) -> float | None:
    """Memory in use as a percentage, or ``None`` when NVML does not say."""
    if used is None or not total:
        return None
    return 100.0 * used / total


def percent(value: int | None) -> str:
    return _MISSING if value is None else f"{value} %"


def _number(value: float | None, unit: str, *, digits: int = 0) -> str:
    return _MISSING if value is None else f"{value:.{digits}f} {unit}"


def _power(gpu: GpuState) -> str:
    if gpu.power_draw is None:
        return _MISSING
    limit = "" if gpu.power_limit is None else f" / {gpu.power_limit:.0f} W"
    return f"{gpu.power_draw:.0f} W{limit}"


def gpu_summary(gpu: GpuState) -> str:
    """One line per GPU: index, name, utilisation, memory, temperature and power. A MIG slice
    is shown as a slice of its GPU (NVML gives it memory, not the GPU's other metrics)."""
    if gpu.lost:
        return f"[{gpu.index}] {gpu.name or 'GPU'}  {gpu.uuid or ''}  LOST (stopped answering)"
    memory = f"{human_bytes(gpu.memory_used)} / {human_bytes(gpu.memory_total)}"
    if gpu.mig is not None:
        return (
            f"[{gpu.index}] └ MIG slice {gpu.mig.profile or ''}  GPU instance "
            f"{gpu.mig.gpu_instance_id}, compute instance {gpu.mig.compute_instance_id}  "
            f"memory {memory}"
        )
    return (
        f"[{gpu.index}] {gpu.name or 'GPU'}  util {_number(gpu.utilization_gpu, '%')}  "
        f"memory {memory}  temp {_number(gpu.temperature, '°C')}  power {_power(gpu)}"
    )


def _process_line(process: GpuProcess) -> str:
    name = process.name or "(not visible here)"
    return f"{process.pid} {name} ({human_bytes(process.used_memory)})"


def snapshot_lines(snapshot: Snapshot) -> list[str]:
    """What this process sees through NVML, as text lines (first line: the summary)."""
    simulated = ", SIMULATED" if snapshot.simulated else ""
    lines = [f"This kernel sees (NVML): {snapshot.message}{simulated}"]
    for gpu in snapshot.gpus:
        lines.append(f"  {gpu_summary(gpu)}")
        if gpu.uuid is not None:
            lines.append(f"      {gpu.uuid}")
        if gpu.processes:
            lines.append("      processes: " + ", ".join(map(_process_line, gpu.processes)))
    return lines


def _local_time(moment: datetime) -> str:
    return moment.astimezone().strftime("%H:%M:%S")


def gpu_names(attachments: Sequence[Attachment]) -> str:
    """ "GPU 0, GPU 1": GPUs as every view numbers them (the node's index; issue 36: the
    magic's messages led with UUIDs that nobody reads)."""
    return ", ".join(f"GPU {a.index}" for a in attachments)


def attachment_lines(attachments: Sequence[Attachment]) -> list[str]:
    """One line per hot-attached GPU, led by its number on the node, its UUID last (for
    copying); a warning under one the agent will release."""
    lines = []
    for a in attachments:
        lines.append(
            f"  GPU {a.index}  {a.name}  {a.device}  attached at {_local_time(a.attached_at)}  "
            f"{a.uuid}"
        )
        if a.idle_release is not None:
            why = "unused" if a.idle_release.reason == "idle" else "its lease ends"
            lines.append(
                f"      ! the agent releases it at {_local_time(a.idle_release.release_at)} "
                f"({why}) unless a process uses it"
            )
    return lines


def suspended_state(suspension: Suspension) -> str:
    """A kernel's kept CUDA state in a few words, the same in ``%gpu status``, the widget and
    after ``%gpu release --keep``: "suspended (state kept, 3.0 GiB in host memory)"; the size
    only where the agent could tell it (the driver's or NVML's figure)."""
    if suspension.state == "suspending":
        return "suspending (its CUDA state is being moved to host memory)"
    size = "" if suspension.host_memory is None else f", {human_bytes(suspension.host_memory)}"
    return f"suspended (state kept{size} in host memory)"


def resume_hint(suspension: Suspension) -> str:
    """What brings a suspended kernel back, and onto which GPUs."""
    count = len(suspension.uuids)
    gpus = f"{count} free {suspension.model} GPU{'' if count == 1 else 's'}"
    return (
        f"'%gpu attach' resumes it on {gpus} (the same one{'' if count == 1 else 's'} when free)."
    )


def suspended_line(suspension: Suspension) -> str:
    """The sentence every view gives a suspended kernel: its state and what resumes it."""
    return f"This kernel is {suspended_state(suspension)}; {resume_hint(suspension)}"


def model_name(name: str) -> str:
    """A GPU's model without the simulation's ``(simulated)`` suffix: tables say SIMULATED
    once, in their title, instead of on every row."""
    return name.removesuffix(SIMULATED_SUFFIX)


def too_many_gpus(count: int, gpus: Sequence[Gpu] | None, *, error: AgentClientError) -> str:
    """One sentence for every "not that many GPUs" refusal of an attach of ``count`` — fewer
    free than asked, more asked than the node has (``gpus``; ``None`` when unknown), more than
    one request may take — in a notebook user's words (counting, like ``wait_hint``, only
    the GPUs an attach of a count alone may get: ``plain_total``, ``plain_free``): the
    agent's refusal of a count points at its API description, no help in a notebook."""
    if gpus is None:
        return error.message
    total = plain_total(gpus)
    free = plain_free(gpus)
    if count > total:
        reason = f"this node has {total} GPU{'' if total == 1 else 's'} in all ({free} free now)"
    elif isinstance(error, InsufficientGpus):
        return error.message
    else:
        reason = "that is more than one request may ask for; attach them a few at a time"
    return f"Cannot attach {count} GPU{'' if count == 1 else 's'}: {reason}."


def wait_hint(count: int, gpus: Sequence[Gpu] | None, *, error: AgentClientError) -> str | None:
    """How to wait for GPUs after a "none free" refusal (``None`` when waiting cannot help:
    another refusal, or more GPUs asked than the node has)."""
    if not isinstance(error, InsufficientGpus) or (gpus is not None and count > plain_total(gpus)):
        return None
    return (
        f"To wait for one in the queue (first come, first served): %gpu attach {count} --wait 120"
    )


# --- HTML pieces for the widget -------------------------------------------------------------


def badge_html(text: str) -> str:
    return f'<span class="gpuhp-badge">{html.escape(text)}</span>'


def memory_level(ratio: float | None) -> str:
    """The memory bar's colour: ``""`` (the theme's), then ``warning`` and ``danger``."""
    if ratio is not None and ratio >= _MEMORY_DANGER:
        return "danger"
    if ratio is not None and ratio >= _MEMORY_WARNING:
        return "warning"
    return ""


def bar_html(percent: float | None, *, label: str, level: str = "") -> str:
    """A horizontal bar filled to ``percent`` (0 when unknown), for screen readers too."""
    filled = min(100.0, max(0.0, percent or 0.0))
    extra = f" gpuhp-{level}" if level else ""
    now = "" if percent is None else f' aria-valuenow="{filled:.0f}"'
    return (
        f'<span class="gpuhp-bar" role="progressbar" aria-label="{html.escape(label)}" '
        f'aria-valuemin="0" aria-valuemax="100"{now}>'
        f'<span class="gpuhp-fill{extra}" style="width: {filled:.1f}%"></span></span>'
    )


def gpu_label(gpu: GpuState, node_index: int | None) -> str:
    """``GPU 1 (cuda:0)``: the node's index where the agent said it, with this kernel's own
    index beside it when they differ; ``cuda:0`` alone while the node's is not known."""
    if node_index is None:
        return f"cuda:{gpu.index}"
    if node_index == gpu.index:
        return f"GPU {node_index}"
    return f"GPU {node_index} (cuda:{gpu.index})"


def sparkline_html(values: Sequence[int | None], *, slots: int, label: str) -> str:
    """A small line of the last ``slots`` readings (0 to 100; ``None`` skipped), newest right."""
    step = 100 / max(1, slots - 1)
    offset = slots - len(values)
    points = " ".join(
        f"{(offset + i) * step:.1f},{20 - value / 5:.1f}"
        for i, value in enumerate(values)
        if value is not None
    )
    return (
        f'<svg class="gpuhp-spark" viewBox="0 0 100 20" preserveAspectRatio="none" '
        f'role="img" aria-label="{html.escape(label)}"><polyline points="{points}"/></svg>'
    )


def gpu_row_html(
    gpu: GpuState,
    *,
    node_index: int | None = None,
    history: Sequence[int | None] = (),
    slots: int = 60,
) -> str:
    """Everything one GPU shows, as one HTML piece (one model, one message per change):
    title (the node's numbering, the model, a short UUID whose full form is its tooltip),
    utilisation and memory bars with a sparkline of recent utilisation, temperature and
    power, and its processes."""
    uuid = gpu.uuid or ""
    short = uuid[:12] if len(uuid) > 12 else uuid
    title = (
        f'<div class="gpuhp-title"><b>{html.escape(gpu_label(gpu, node_index))} · '
        f"{html.escape(model_name(gpu.name or 'GPU'))}</b> "
        f'<span class="gpuhp-muted" title="{html.escape(uuid)}">{html.escape(short)}</span>'
        "</div>"
    )
    if gpu.lost:
        return title + '<div class="gpuhp-error">lost: the GPU stopped answering</div>'
    ratio = usage_ratio(gpu.memory_used, gpu.memory_total)
    memory = f"{human_bytes(gpu.memory_used)} / {human_bytes(gpu.memory_total)}"
    if gpu.mig is not None:
        # A slice: its memory and processes are its own; utilisation and sensors are the GPU's.
        where = (
            f"MIG slice {gpu.mig.profile or ''} of GPU {gpu.index} · GPU instance "
            f"{gpu.mig.gpu_instance_id}, compute instance {gpu.mig.compute_instance_id}"
        )
        return (
            title
            + f'<div class="gpuhp-muted">{html.escape(where)}</div>'
            + '<div class="gpuhp-metrics"><span class="gpuhp-muted">memory</span>'
            + bar_html(ratio, label="slice memory in use", level=memory_level(ratio))
            + f"<span>{html.escape(memory)}</span></div>"
            + process_table_html(gpu.processes)
        )
    sensors = f"{_number(gpu.temperature, '°C')} · power {_power(gpu)}"
    metrics = (
        '<div class="gpuhp-metrics">'
        '<span class="gpuhp-muted">GPU</span>'
        + bar_html(gpu.utilization_gpu, label="GPU utilisation")
        + f"<span>{html.escape(percent(gpu.utilization_gpu))}</span>"
        '<span class="gpuhp-muted">memory</span>'
        + bar_html(ratio, label="GPU memory in use", level=memory_level(ratio))
        + f"<span>{html.escape(memory)}</span>"
        '<span class="gpuhp-muted">history</span>'
        + sparkline_html(history, slots=slots, label="GPU utilisation, recent readings")
        + "<span></span>"
        '<span class="gpuhp-muted">sensors</span>'
        f'<span style="grid-column: span 2">{html.escape(sensors)}</span>'
        "</div>"
    )
    return title + metrics + process_table_html(gpu.processes)


def no_free_gpu_html(total: int) -> str:
    """Why Attach is disabled: every GPU of the node is taken, and how to wait for one."""
    return (
        f'<span class="gpuhp-muted">No GPU free (all {total} taken). '
        "<code>%gpu attach --wait 120</code> waits for one.</span>"
    )


def process_table_html(processes: tuple[GpuProcess, ...] | None) -> str:
    """The processes on one GPU as a small table (pid, name, memory)."""
    if processes is None:
        return '<span class="gpuhp-muted">processes: not available</span>'
    if not processes:
        return '<span class="gpuhp-muted">no processes</span>'
    rows = "".join(
        f"<tr><td>{process.pid}</td><td>{html.escape(process.name or '(not visible here)')}</td>"
        f"<td>{html.escape(human_bytes(process.used_memory))}</td></tr>"
        for process in processes
    )
    return (
        '<table class="gpuhp-table"><tr><th>PID</th><th>PROCESS</th><th>GPU MEMORY</th></tr>'
        f"{rows}</table>"
    )
