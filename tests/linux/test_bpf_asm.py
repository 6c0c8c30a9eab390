"""The pure eBPF assembler: encoding, golden disassembly, prefix round trips, semantics.

The semantic tests run programs in a tiny interpreter of the instructions device
programs use, and compare the verdict with the rule model (first match wins, a
request passes a rule when its access bits are a subset of the rule's). That
checks jump offsets and register use without a kernel; the kernel's own verdicts
are checked by the root tests in ``test_cgroup_v2.py``.

Set ``GOLDEN_UPDATE=1`` to rewrite the golden files after an intended change,
then review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux.bpf import interp
from jupyter_gpu_hotplug.linux.bpf.asm import (
    ALU,
    ALU64,
    INSN_SIZE,
    JMP,
    JMP32,
    LD,
    MODE_IMM,
    PREFIX_MAGIC,
    SIZE_DW,
    SRC_K,
    SRC_X,
    AluOp,
    Insn,
    JmpOp,
    add_prefix,
    alu32_imm,
    alu32_reg,
    alu64_imm,
    build_device_program,
    decode_program,
    disassemble,
    encode_program,
    exit_,
    ja,
    jmp_imm,
    jmp_reg,
    ldx_w,
    prefix_devices,
    strip_prefix,
    uses_hidden_register,
)
from jupyter_gpu_hotplug.linux.devrules import (
    ALL_ACCESS,
    CONTAINER_DEFAULTS,
    NVIDIACTL_MINOR,
    RW,
    Access,
    DeviceRule,
    DevType,
    char_device,
)

GOLDEN = Path(__file__).parent / "golden"

# ---- the product's interpreter of device programs (``bpf.interp``) ----------------------

_TYPE_CODES = {DevType.CHAR: 2, DevType.BLOCK: 1}
_ACCESS_CODES = ((Access.MKNOD, 1), (Access.READ, 2), (Access.WRITE, 4))


def run_program(code: bytes, dev_type: DevType, access: Access, major: int, minor: int) -> int:
    """The value the program returns for one request (1 allow, 0 deny); every program here is
    inside the interpreted subset."""
    verdict = interp.allows(code, dev_type, access, major, minor)
    assert verdict is not None, "the interpreter could not tell"
    return int(verdict)


def first_match(
    rules: Sequence[DeviceRule],
    default_allow: bool,
    dev_type: DevType,
    access: Access,
    major: int,
    minor: int,
) -> int:
    for rule in rules:
        if rule.covers(dev_type, major, minor) and access in rule.access:
            return int(rule.allow)
    return int(default_allow)


def systemd_program(allowed: Sequence[DeviceRule]) -> bytes:
    """A program laid out like systemd's (src/core/bpf-devices.c), built independently.

    Blocks end in ``goto PASS`` instead of an exit, and the tail is
    ``r0 = 0; goto +1; PASS: r0 = 1; exit`` — a shape our prefix must pass through.
    """
    insns: list[Insn | None] = [
        ldx_w(2, 1, 0),
        alu32_imm(AluOp.AND, 2, 0xFFFF),
        ldx_w(3, 1, 0),
        alu32_imm(AluOp.RSH, 3, 16),
        ldx_w(4, 1, 4),
        ldx_w(5, 1, 8),
    ]
    pass_jumps = []
    for rule in allowed:
        assert rule.major is not None and rule.minor is not None and rule.type is not DevType.ALL
        mask = sum(bit for flag, bit in _ACCESS_CODES if flag in rule.access)
        if rule.access != ALL_ACCESS:
            insns += [
                alu32_reg(AluOp.MOV, 1, 3),
                alu32_imm(AluOp.AND, 1, mask),
                jmp_reg(JmpOp.JNE, 1, 3, 4),
            ]
        insns += [
            jmp_imm(JmpOp.JNE, 2, _TYPE_CODES[rule.type], 3),
            jmp_imm(JmpOp.JNE, 4, rule.major, 2),
            jmp_imm(JmpOp.JNE, 5, rule.minor, 1),
        ]
        pass_jumps.append(len(insns))
        insns.append(None)
    insns += [alu64_imm(AluOp.MOV, 0, 0), ja(1)]
    pass_index = len(insns)
    for index in pass_jumps:
        insns[index] = ja(pass_index - index - 1)
    insns += [alu64_imm(AluOp.MOV, 0, 1), exit_()]
    assert all(insn is not None for insn in insns)
    return encode_program(insn for insn in insns if insn is not None)


SYSTEMD_SAMPLE = systemd_program(
    [char_device(1, 3, ALL_ACCESS), char_device(1, 9, RW), char_device(136, 0, Access.READ)]
)

# ---- strategies -----------------------------------------------------------------------------

majors = st.sampled_from([None, 1, 5, NVIDIA_MAJOR])
minors = st.sampled_from([None, 0, 3, 5, NVIDIACTL_MINOR])
accesses = st.sampled_from(
    [Access(bits) for bits in range(1, 8)]  # every non-empty subset of r, w, m
)
dev_types = st.sampled_from([DevType.CHAR, DevType.BLOCK])
rules_st = st.builds(
    DeviceRule,
    st.sampled_from(list(DevType)),
    majors,
    minors,
    accesses,
    st.booleans(),
)
grantable = st.builds(DeviceRule, st.sampled_from(list(DevType)), majors, minors, accesses).filter(
    lambda rule: rule != DeviceRule(DevType.ALL, None, None, ALL_ACCESS)
)
requests = st.tuples(
    dev_types,
    accesses,
    st.sampled_from([1, 5, NVIDIA_MAJOR, 7]),
    st.sampled_from([0, 3, 5, 255, 9]),
)
raw_insns = st.builds(
    Insn,
    st.integers(0, 255),
    st.integers(0, 15),
    st.integers(0, 15),
    st.integers(-(2**15), 2**15 - 1),
    st.integers(-(2**31), 2**31 - 1),
)


@st.composite
def originals(draw: st.DrawFn) -> bytes:
    """Programs a prefix may land on: runc-style, systemd-style or arbitrary instructions."""
    kind = draw(st.sampled_from(["runc", "systemd", "raw"]))
    if kind == "runc":
        return build_device_program(
            draw(st.lists(rules_st, max_size=6)), default_allow=draw(st.booleans())
        )
    if kind == "systemd":
        concrete = st.builds(
            char_device, st.sampled_from([1, 5, NVIDIA_MAJOR]), st.sampled_from([0, 3, 5]), accesses
        )
        return systemd_program(draw(st.lists(concrete, max_size=5)))
    code = encode_program(draw(st.lists(raw_insns, min_size=1, max_size=20)))
    assume(not prefix_devices(code))
    return code


# ---- encoding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("insn", "hex_bytes"),
    [
        pytest.param(ldx_w(2, 1, 0), "6112000000000000", id="ldx-u32"),
        pytest.param(ldx_w(5, 1, 8), "6115080000000000", id="ldx-u32-minor"),
        pytest.param(alu32_imm(AluOp.AND, 2, 0xFFFF), "54020000ffff0000", id="and32"),
        pytest.param(alu32_reg(AluOp.MOV, 1, 3), "bc31000000000000", id="mov32-reg"),
        pytest.param(alu64_imm(AluOp.MOV, 0, 1), "b700000001000000", id="mov64-imm"),
        pytest.param(jmp_imm(JmpOp.JNE, 2, 2, 5), "5502050002000000", id="jne-imm"),
        pytest.param(jmp_reg(JmpOp.JNE, 1, 3, 2), "5d31020000000000", id="jne-reg"),
        pytest.param(ja(-1), "0500ffff00000000", id="ja-back"),
        pytest.param(exit_(), "9500000000000000", id="exit"),
        pytest.param(alu32_imm(AluOp.MOV, 0, -1), "b4000000ffffffff", id="negative-imm"),
    ],
)
def test_known_encodings(insn: Insn, hex_bytes: str) -> None:
    assert insn.encode().hex() == hex_bytes
    assert Insn.decode(bytes.fromhex(hex_bytes)) == insn


@given(raw_insns)
def test_insn_round_trip(insn: Insn) -> None:
    assert Insn.decode(insn.encode()) == insn


@given(st.binary(min_size=8, max_size=8))
def test_any_eight_bytes_decode_and_encode_back(raw: bytes) -> None:
    assert Insn.decode(raw).encode() == raw


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"code": 256}, id="opcode"),
        pytest.param({"code": 0, "dst": 16}, id="dst"),
        pytest.param({"code": 0, "src": -1}, id="src"),
        pytest.param({"code": 0, "off": 2**15}, id="off"),
        pytest.param({"code": 0, "imm": 2**31}, id="imm"),
    ],
)
def test_insn_rejects_fields_out_of_range(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"range|fit"):
        Insn(**fields)


def test_decode_program_rejects_partial_instruction() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        decode_program(b"\x95" * 12)


# ---- golden disassembly -----------------------------------------------------------------

NVIDIA_GPU0 = char_device(NVIDIA_MAJOR, 0)
NVIDIA_GPU1 = char_device(NVIDIA_MAJOR, 1)
NVIDIACTL = char_device(NVIDIA_MAJOR, NVIDIACTL_MINOR, ALL_ACCESS)

GOLDEN_CASES: dict[str, bytes] = {
    "deny_all": build_device_program([]),
    "allow_all_by_default": build_device_program([], default_allow=True),
    "container_defaults": build_device_program(CONTAINER_DEFAULTS),
    "nvidia_gpu_and_ctl": build_device_program([NVIDIA_GPU0, NVIDIACTL]),
    "every_access_subset": build_device_program(
        [char_device(1, minor, Access(minor)) for minor in range(1, 8)]
    ),
    "deny_before_allow_default_allow": build_device_program(
        [char_device(NVIDIA_MAJOR, 3, RW, allow=False), DeviceRule(DevType.CHAR, 195, None, RW)],
        default_allow=True,
    ),
    "block_and_wildcards": build_device_program(
        [
            DeviceRule(DevType.BLOCK, 8, None, Access.READ),
            DeviceRule(DevType.CHAR, None, None, Access.MKNOD),
            DeviceRule(DevType.ALL, NVIDIA_MAJOR, None, RW),
        ]
    ),
    "match_everything_ends_program": build_device_program(
        [char_device(1, 3), DeviceRule(DevType.ALL, None, None, ALL_ACCESS), char_device(1, 5)]
    ),
    "prefix_one_gpu_on_container_defaults": add_prefix(
        [NVIDIA_GPU0], build_device_program(CONTAINER_DEFAULTS)
    ),
    "prefix_gpus_on_systemd_layout": add_prefix(
        [NVIDIA_GPU1, NVIDIACTL, NVIDIA_GPU0, DeviceRule(DevType.CHAR, 236, None, RW)],
        SYSTEMD_SAMPLE,
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_disassembly(name: str) -> None:
    text = disassemble(GOLDEN_CASES[name])
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("GOLDEN_UPDATE") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with GOLDEN_UPDATE=1"
    assert text == path.read_text()


def test_every_golden_file_has_a_case() -> None:
    assert {path.stem for path in GOLDEN.glob("*.txt")} == set(GOLDEN_CASES)


# ---- semantics of built programs ------------------------------------------------------------


@pytest.mark.parametrize("default_allow", [False, True], ids=["deny-mode", "allow-mode"])
@pytest.mark.parametrize(
    ("request_", "rules", "expected_match"),
    [
        pytest.param((DevType.CHAR, RW, 195, 0), [NVIDIA_GPU0], 1, id="exact-device"),
        pytest.param((DevType.CHAR, RW, 195, 1), [NVIDIA_GPU0], None, id="other-minor"),
        pytest.param((DevType.BLOCK, RW, 195, 0), [NVIDIA_GPU0], None, id="other-type"),
        pytest.param((DevType.CHAR, Access.MKNOD, 195, 0), [NVIDIA_GPU0], None, id="mknod-not-rw"),
        pytest.param((DevType.CHAR, Access.READ, 195, 0), [NVIDIA_GPU0], 1, id="subset-access"),
        pytest.param(
            (DevType.CHAR, RW, 195, 3),
            [char_device(195, 3, allow=False), DeviceRule(DevType.CHAR, 195, None, RW)],
            0,
            id="first-match-deny",
        ),
        pytest.param(
            (DevType.BLOCK, Access.MKNOD, 8, 1), list(CONTAINER_DEFAULTS), 1, id="defaults-mknod"
        ),
        pytest.param(
            (DevType.CHAR, RW, 136, 4), list(CONTAINER_DEFAULTS), 1, id="defaults-pts-wildcard"
        ),
    ],
)
def test_built_program_verdicts(
    request_: tuple[DevType, Access, int, int],
    rules: list[DeviceRule],
    expected_match: int | None,
    default_allow: bool,
) -> None:
    code = build_device_program(rules, default_allow=default_allow)
    expected = int(default_allow) if expected_match is None else expected_match
    assert run_program(code, *request_) == expected


@given(st.lists(rules_st, max_size=8), st.booleans(), requests)
def test_built_program_is_first_match(
    rules: list[DeviceRule], default_allow: bool, request_: tuple[DevType, Access, int, int]
) -> None:
    code = build_device_program(rules, default_allow=default_allow)
    assert run_program(code, *request_) == first_match(rules, default_allow, *request_)


def test_device_numbers_beyond_signed_immediates_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be matched"):
        build_device_program([char_device(2**31, 0)])


def test_systemd_sample_allows_what_it_lists() -> None:
    assert run_program(SYSTEMD_SAMPLE, DevType.CHAR, ALL_ACCESS, 1, 3) == 1
    assert run_program(SYSTEMD_SAMPLE, DevType.CHAR, Access.WRITE, 1, 9) == 1
    assert run_program(SYSTEMD_SAMPLE, DevType.CHAR, Access.WRITE, 136, 0) == 0
    assert run_program(SYSTEMD_SAMPLE, DevType.CHAR, RW, 195, 0) == 0


# ---- the prefix ------------------------------------------------------------------------------

ROUND_TRIP_PROGRAMS = {
    "deny_all": build_device_program([]),
    "container_defaults": build_device_program(CONTAINER_DEFAULTS),
    "allow_mode": build_device_program([char_device(195, 0, allow=False)], default_allow=True),
    "systemd_layout": SYSTEMD_SAMPLE,
    "systemd_empty": systemd_program([]),
    "single_exit": encode_program([alu64_imm(AluOp.MOV, 0, 1), exit_()]),
}


@pytest.mark.parametrize("devices", [[NVIDIA_GPU0], [NVIDIA_GPU0, NVIDIA_GPU1, NVIDIACTL]])
@pytest.mark.parametrize("name", sorted(ROUND_TRIP_PROGRAMS))
def test_prefix_round_trip(name: str, devices: list[DeviceRule]) -> None:
    original = ROUND_TRIP_PROGRAMS[name]
    patched = add_prefix(devices, original)
    assert patched.endswith(original)
    assert strip_prefix(patched) == original
    assert prefix_devices(patched) == frozenset(devices)
    assert prefix_devices(original) == frozenset()
    assert strip_prefix(original) == original


@given(st.lists(grantable, max_size=6), originals())
def test_strip_inverts_add(devices: list[DeviceRule], original: bytes) -> None:
    patched = add_prefix(devices, original)
    assert strip_prefix(patched) == original
    assert prefix_devices(patched) == frozenset(devices)
    # Re-rendering what we read back gives the same bytes: what a grant relies on.
    assert add_prefix(prefix_devices(patched), strip_prefix(patched)) == patched


@given(st.lists(grantable, min_size=1, max_size=6), originals())
def test_prefix_never_touches_r1_or_the_frame_pointer(
    devices: list[DeviceRule], original: bytes
) -> None:
    patched = add_prefix(devices, original)
    prefix = decode_program(patched[: len(patched) - len(original)])
    assert all(insn.dst not in (1, 10) for insn in prefix)


@given(st.lists(grantable, max_size=6), st.lists(rules_st, max_size=6), st.booleans(), requests)
def test_prefix_grants_and_otherwise_defers_to_the_original(
    devices: list[DeviceRule],
    rules: list[DeviceRule],
    default_allow: bool,
    request_: tuple[DevType, Access, int, int],
) -> None:
    original = build_device_program(rules, default_allow=default_allow)
    granted = first_match(devices, False, *request_)
    expected = 1 if granted else run_program(original, *request_)
    assert run_program(add_prefix(devices, original), *request_) == expected


def test_empty_prefix_is_the_original_itself() -> None:
    original = build_device_program(CONTAINER_DEFAULTS)
    assert add_prefix([], original) == original


def test_prefix_is_canonical() -> None:
    original = build_device_program([])
    one = add_prefix([NVIDIA_GPU1, NVIDIA_GPU0, NVIDIA_GPU1], original)
    assert one == add_prefix([NVIDIA_GPU0, NVIDIA_GPU1], original)


@pytest.mark.parametrize(
    ("devices", "original", "message"),
    [
        pytest.param([NVIDIA_GPU0], b"", "not a program", id="empty-original"),
        pytest.param([NVIDIA_GPU0], b"\x95" * 7, "not a program", id="ragged-original"),
        pytest.param(
            [char_device(195, 0, allow=False)], SYSTEMD_SAMPLE, "deny rule", id="deny-rule"
        ),
        pytest.param(
            [DeviceRule(DevType.ALL, None, None, ALL_ACCESS)],
            SYSTEMD_SAMPLE,
            "every device",
            id="grant-everything",
        ),
        pytest.param(
            [NVIDIA_GPU1], add_prefix([NVIDIA_GPU0], SYSTEMD_SAMPLE), "already", id="nested"
        ),
    ],
)
def test_add_prefix_refuses(devices: list[DeviceRule], original: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        add_prefix(devices, original)


def _marker(length: int) -> Insn:
    return alu64_imm(AluOp.MOV, 0, PREFIX_MAGIC | length)


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(encode_program([_marker(1), exit_()]), id="marker-without-prologue"),
        pytest.param(encode_program([_marker(200), exit_()]), id="marker-past-end"),
        pytest.param(
            encode_program([_marker(8), *decode_program(SYSTEMD_SAMPLE)]), id="marker-then-foreign"
        ),
        pytest.param(
            add_prefix([NVIDIA_GPU0], SYSTEMD_SAMPLE)[: 9 * INSN_SIZE], id="prefix-without-original"
        ),
        pytest.param(
            # Our layout, but a major that no prefix we render would hold.
            add_prefix([NVIDIA_GPU0], SYSTEMD_SAMPLE).replace(
                jmp_imm(JmpOp.JNE, 4, 195, 3).encode(), jmp_imm(JmpOp.JNE, 4, 195, 4).encode()
            ),
            id="tampered-offset",
        ),
    ],
)
def test_lookalike_markers_are_not_ours(code: bytes) -> None:
    assert strip_prefix(code) == code
    assert prefix_devices(code) == frozenset()


def test_hidden_register_is_detected() -> None:
    assert not uses_hidden_register(GOLDEN_CASES["container_defaults"])
    blinded = encode_program([Insn(ALU64 | AluOp.MOV | SRC_K, 11, 0, 0, 7), exit_()])
    assert uses_hidden_register(blinded)


# ---- disassembly of everything else -----------------------------------------------------


@pytest.mark.parametrize(
    ("insns", "text"),
    [
        pytest.param([Insn(0x7B, 10, 1, -8)], "0: *(u64 *)(r10 - 8) = r1", id="stx"),
        pytest.param([Insn(0x62, 10, 0, -4, 7)], "0: *(u32 *)(r10 - 4) = 7", id="st"),
        pytest.param([Insn(0x71, 2, 1, 3)], "0: r2 = *(u8 *)(r1 + 3)", id="ldx-u8"),
        pytest.param([Insn(ALU | AluOp.NEG, 3)], "0: w3 = -w3", id="neg32"),
        pytest.param([Insn(ALU64 | AluOp.ADD | SRC_X, 1, 2)], "0: r1 += r2", id="add64"),
        pytest.param([Insn(ALU64 | AluOp.ARSH | SRC_K, 1, imm=3)], "0: r1 s>>= 3", id="arsh"),
        pytest.param(
            [Insn(JMP32 | JmpOp.JGT | SRC_K, 2, off=1, imm=9)],
            "0: if w2 > 9 goto pc+1 <2>",
            id="jmp32",
        ),
        pytest.param(
            [Insn(JMP | JmpOp.JSET | SRC_K, 2, off=-1, imm=6)],
            "0: if r2 & 0x6 goto pc-1 <0>",
            id="jset-backwards",
        ),
        pytest.param([Insn(JMP | JmpOp.CALL, imm=14)], "0: call 14", id="call"),
        pytest.param(
            [Insn(LD | SIZE_DW | MODE_IMM, 1, imm=2), Insn(0, imm=1), exit_()],
            "0: r1 = 0x100000002 ll\n2: exit",
            id="lddw-takes-two-slots",
        ),
        pytest.param(
            [alu64_imm(AluOp.MOV, 0, -70000)], "0: r0 = -0x11170", id="large-negative-imm"
        ),
        pytest.param(
            [Insn(0xFF, 1, 2, 3, 4)], "0: .insn code=0xff dst=r1 src=r2 off=3 imm=4", id="unknown"
        ),
    ],
)
def test_disassemble_other_instructions(insns: list[Insn], text: str) -> None:
    assert disassemble(encode_program(insns)) == text + "\n"


def test_disassemble_empty_program() -> None:
    assert disassemble(b"") == ""


@pytest.mark.parametrize(
    "program",
    [
        [Insn(JMP | JmpOp.CALL, imm=1), alu64_imm(AluOp.MOV, 0, 1), exit_()],
        [alu64_imm(AluOp.MOV, 0, 1), ja(-2), exit_()],
        [exit_()],
        [ldx_w(2, 3, 0), alu64_imm(AluOp.MOV, 0, 1), exit_()],
        [alu64_imm(AluOp.MOV, 0, 1)],
    ],
    ids=["helper-call", "backward-jump", "r0-unset", "load-not-from-ctx", "no-exit"],
)
def test_the_interpreter_says_when_it_cannot_tell(program: list[Insn]) -> None:
    """Outside the subset device programs use, the answer is None, never a guess."""
    code = encode_program(program)
    assert interp.allows(code, DevType.CHAR, RW, NVIDIA_MAJOR, 0) is None
