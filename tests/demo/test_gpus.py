"""Real or simulated GPUs: what NVML's answer means for the demo."""

from __future__ import annotations

import json

import pytest

from jupyter_gpu_hotplug.demo.errors import DemoUnavailable
from jupyter_gpu_hotplug.demo.gpus import (
    GpuProbe,
    choose_gpu_mode,
    parse_probe_output,
    probe_real_gpus,
)
from jupyter_gpu_hotplug.demo.options import DEFAULT_SIMULATED_GPUS

TWO_REAL = GpuProbe(names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"))
NO_DRIVER = GpuProbe(problem="NVMLError_LibraryNotFound: NVML Shared Library Not Found")


def test_simulate_n_simulates_n_without_asking_nvml() -> None:
    mode = choose_gpu_mode(3, None)
    assert (mode.simulate, mode.simulated) == (3, True)
    assert mode.reason == "--simulate 3 was given"


def test_simulate_n_wins_over_real_gpus() -> None:
    assert choose_gpu_mode(1, TWO_REAL).simulate == 1


def test_real_gpus_are_used_when_nvml_finds_some() -> None:
    mode = choose_gpu_mode(None, TWO_REAL)
    assert not mode.simulated
    assert "NVML found 2 NVIDIA GPU(s): NVIDIA A100-SXM4-80GB" in mode.reason


def test_without_real_gpus_the_default_number_is_simulated_and_the_reason_given() -> None:
    mode = choose_gpu_mode(None, NO_DRIVER)
    assert mode.simulate == DEFAULT_SIMULATED_GPUS
    assert mode.reason == f"no NVIDIA GPU was found ({NO_DRIVER.problem})"
    assert "NVML lists no GPU" in choose_gpu_mode(None, GpuProbe()).reason


def test_simulate_0_demands_real_gpus() -> None:
    assert choose_gpu_mode(0, TWO_REAL).simulate == 0
    with pytest.raises(DemoUnavailable) as caught:
        choose_gpu_mode(0, NO_DRIVER)
    assert "--simulate 0 asks for real GPUs, but there are none" in caught.value.reason
    assert "Leave --simulate out" in caught.value.hint


def test_a_probe_is_needed_unless_simulating() -> None:
    with pytest.raises(ValueError, match="needs a probe"):
        choose_gpu_mode(None, None)


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        (json.dumps({"names": ["A", "B"]}) + "\n", GpuProbe(names=("A", "B"))),
        (json.dumps({"names": [], "problem": "no driver"}), GpuProbe(problem="no driver")),
        ("noise\n" + json.dumps({"names": ["A"]}), GpuProbe(names=("A",))),
    ],
    ids=["gpus", "problem", "last-line-counts"],
)
def test_the_probes_answer_is_read(stdout: str, expected: GpuProbe) -> None:
    assert parse_probe_output(stdout, returncode=0) == expected


def test_a_crashed_probe_is_a_problem_not_an_exception() -> None:
    probe = parse_probe_output("", returncode=-11, stderr="trace\nSegmentation fault")
    assert probe.names == ()
    assert probe.problem == "the NVML probe failed (exit -11): Segmentation fault"


def test_this_machine_is_probed_without_a_traceback() -> None:
    probe = probe_real_gpus()
    # Whatever this machine has, the answer is data: names, or why there are none.
    assert probe.names or probe.problem
