"""What the real-GPU tier saw, written as ``real-gpu.md`` for people and kept for the record.

Why a report of its own and not only pytest's verdicts: a GPU machine is lent for minutes, bare,
now and then. What it showed — the driver, the outputs of ``nvidia-smi`` inside the sandbox, what
PyTorch said in a process started before the attach, the latencies — is the product of the run,
and must come back whole even when a step fails. Each step records its commands, their outputs and
its figures here as it goes; the verdict of each test is added by the conftest's hook, and the
file is written at the end of the session (and after every step, so a run cut short by its time
limit still leaves what it had).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["OUTPUT_LIMIT", "Figure", "Report", "Step", "percentile"]

OUTPUT_LIMIT: Final = 6000
"""Characters of one command's output kept in the report (the raw log keeps everything)."""
REPORT_NAME: Final = "real-gpu.md"
RAW_NAME: Final = "real-gpu-raw.jsonl"


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile by the nearest-rank method (p50, p99 of few samples)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * fraction // 1))
    return ordered[int(rank) - 1]


def _cell(text: str) -> str:
    """A verdict as one table cell: its first line, shortened, pipes escaped."""
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 140 else first[:140] + "…"
    return first.replace("|", "\\|")


@dataclass
class Figure:
    """One measured quantity: its samples and unit; rendered as median, p99, min and max."""

    name: str
    unit: str
    samples: list[float]

    def render(self) -> str:
        if len(self.samples) == 1:
            return f"{self.name}: {self.samples[0]:.1f} {self.unit}"
        return (
            f"{self.name}: median {statistics.median(self.samples):.1f} {self.unit}, "
            f"p99 {percentile(self.samples, 0.99):.1f}, min {min(self.samples):.1f}, "
            f"max {max(self.samples):.1f} (n={len(self.samples)})"
        )


@dataclass
class Step:
    """One test's part of the report."""

    title: str
    commands: list[tuple[str, str]] = field(default_factory=list)
    """(command, its output) in the order run."""
    notes: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    verdict: str = "not run"

    def run(self, command: str, output: str) -> None:
        self.commands.append((command, output))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def figure(self, name: str, unit: str, samples: Sequence[float]) -> Figure:
        figure = Figure(name, unit, list(samples))
        self.figures.append(figure)
        return figure


@dataclass
class Report:
    """The session's steps, written to ``directory`` (``$OUT`` on the GPU machine)."""

    directory: Path
    header: list[str] = field(default_factory=list)
    steps: dict[str, Step] = field(default_factory=dict)

    def step(self, key: str, title: str) -> Step:
        """The step of test ``key`` (created on first use)."""
        if key not in self.steps:
            self.steps[key] = Step(title)
        return self.steps[key]

    def render(self) -> str:
        lines = ["# The real-GPU tier: what the run saw", "", *self.header, ""]
        lines += ["| step | verdict |", "|---|---|"]
        lines += [f"| {step.title} | {_cell(step.verdict)} |" for step in self.steps.values()]
        for step in self.steps.values():
            lines += ["", f"## {step.title}", "", f"Verdict: **{step.verdict}**", ""]
            lines += [f"- {note}" for note in step.notes]
            if step.figures:
                lines += ["", "Figures:", ""]
                lines += [f"- {figure.render()}" for figure in step.figures]
            for command, output in step.commands:
                shown = output if len(output) <= OUTPUT_LIMIT else output[:OUTPUT_LIMIT] + "\n…"
                lines += ["", f"`{command}`", "", "```", shown.rstrip(), "```"]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        """Write the report and the raw record (every output whole) into ``directory``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / REPORT_NAME).write_text(self.render())
        with (self.directory / RAW_NAME).open("w") as raw:
            for key, step in self.steps.items():
                record = {
                    "test": key,
                    "title": step.title,
                    "verdict": step.verdict,
                    "notes": step.notes,
                    "figures": {
                        f.name: {"unit": f.unit, "samples": f.samples} for f in step.figures
                    },
                    "commands": [{"command": c, "output": o} for c, o in step.commands],
                }
                raw.write(json.dumps(record) + "\n")
