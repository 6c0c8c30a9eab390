"""The wire contract's GPU selector (``model``, ``min_memory``; issue 37, the user's side):
what matches, what a person may type for memory, and which bodies carry one. Pure: both APIs
and the magic use these very functions, so a table here pins all of them."""

from __future__ import annotations

import pytest

from jupyter_gpu_hotplug._structs import (
    GpuSelector,
    WireFormatError,
    check_selector,
    parse_memory_text,
)

H100 = ("NVIDIA H100 80GB HBM3 (simulated)", 85520809984)
A100 = ("NVIDIA A100-SXM4-40GB", 40 * 2**30)


@pytest.mark.parametrize(
    ("selector", "gpu", "matches"),
    [
        (GpuSelector(model="H100"), H100, True),
        (GpuSelector(model="h100"), H100, True),
        (GpuSelector(model="hbm3"), H100, True),
        (GpuSelector(model="A100"), H100, False),
        (GpuSelector(model="H100 "), H100, True),
        (GpuSelector(model="H100X"), H100, False),
        # An "80GB" H100 has 79.6 GiB (NVML's total): 80G (decimal, how cards are sold)
        # matches it, 80Gi (binary) does not.
        (GpuSelector(min_memory=parse_memory_text("80G")), H100, True),
        (GpuSelector(min_memory=parse_memory_text("80Gi")), H100, False),
        (GpuSelector(min_memory=80 * 2**30), H100, False),
        (GpuSelector(min_memory=79 * 2**30), H100, True),
        (GpuSelector(min_memory=85520809984), H100, True),
        (GpuSelector(min_memory=85520809985), H100, False),
        (GpuSelector(min_memory=80 * 2**30), A100, False),
        (GpuSelector(model="A100", min_memory=40 * 2**30), A100, True),
        (GpuSelector(model="A100", min_memory=41 * 2**30), A100, False),
        (GpuSelector(), A100, True),
    ],
)
def test_matching(selector: GpuSelector, gpu: tuple[str, int], matches: bool) -> None:
    assert selector.matches(*gpu) is matches


def test_queue_keys_equal_for_equal_selectors_only() -> None:
    assert GpuSelector("H100").key == GpuSelector("h100").key
    keys = {
        GpuSelector("H100").key,
        GpuSelector("H100", 1).key,
        GpuSelector(min_memory=1).key,
        GpuSelector("A100").key,
    }
    assert len(keys) == 4
    # Never a MIG profile's kind nor a named GPU's (a UUID list).
    assert not any(key.startswith(("GPU-", "MIG-")) or "g." in key[:3] for key in keys)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80G", 80 * 10**9),
        ("80GB", 80 * 10**9),
        ("40Gi", 40 * 2**30),
        ("40GiB", 40 * 2**30),
        ("40gib", 40 * 2**30),
        ("40 Gi", 40 * 2**30),
        ("512M", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1T", 10**12),
        ("1Ti", 2**40),
        ("64K", 64 * 10**3),
        ("64Ki", 64 * 2**10),
        ("1024", 1024),
        ("1024B", 1024),
        (" 8G ", 8 * 10**9),
    ],
)
def test_memory_text(text: str, size: int) -> None:
    assert parse_memory_text(text) == size


@pytest.mark.parametrize(
    "text", ["", "G", "0G", "-1G", "1.5G", "40X", "40 GiBs", "4e9", "40iB", "40Bi"]
)
def test_memory_text_refused(text: str) -> None:
    with pytest.raises(WireFormatError) as caught:
        parse_memory_text(text)
    assert caught.value.field == "min_memory"
    assert "80G (10**9 bytes), 40Gi (2**30) or 512M" in caught.value.message


@pytest.mark.parametrize(
    ("body", "named", "mig", "expected"),
    [
        ({"count": 1}, False, False, None),
        ({"model": "H100"}, False, False, GpuSelector("H100")),
        ({"min_memory": 5}, False, False, GpuSelector(min_memory=5)),
        ({"model": "H100", "min_memory": 5}, False, False, GpuSelector("H100", 5)),
        ({"count": 1}, True, True, None),
    ],
)
def test_selector_of_a_body(
    body: dict[str, object], named: bool, mig: bool, expected: GpuSelector | None
) -> None:
    assert check_selector(body, named=named, mig=mig) == expected


@pytest.mark.parametrize(
    ("body", "named", "mig", "field", "words"),
    [
        ({"model": "H100"}, True, False, "model", "cannot be given with gpus"),
        ({"min_memory": 5}, True, False, "min_memory", "a named GPU is exact already"),
        ({"model": "H100", "min_memory": 5}, False, True, "model", "cannot be given with mig"),
        ({"model": "\t"}, False, False, "model", "printable"),
        ({"min_memory": -1}, False, False, "min_memory", "greater than 0"),
    ],
)
def test_selector_refused(
    body: dict[str, object], named: bool, mig: bool, field: str, words: str
) -> None:
    with pytest.raises(WireFormatError) as caught:
        check_selector(body, named=named, mig=mig)
    assert caught.value.field == field
    assert words in caught.value.message


def test_described_for_people() -> None:
    assert str(GpuSelector("A100", 40 * 2**30)) == "model 'A100' and at least 40 GiB of memory"
    assert str(GpuSelector(min_memory=512 * 2**20)) == "at least 512 MiB of memory"
