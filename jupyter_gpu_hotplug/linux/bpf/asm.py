"""A pure assembler for cgroup v2 device programs: encode, build, prefix, disassemble.

Boundary: bytes and values in, bytes and text out; no system calls. The raw
``bpf(2)`` layer lives in :mod:`.syscall` and the policy in
:mod:`jupyter_gpu_hotplug.linux.devrules`; this module only renders that policy
as ``BPF_PROG_TYPE_CGROUP_DEVICE`` instructions and reads our own marks back.

Why it exists separately: the instruction layout is where subtle bugs hide
(jump offsets, 32-bit loads from the context, the value returned at exit), and
pure code can be pinned down by golden disassembly and property tests without
root, like opencontainers/cgroups keeps ``devicefilter.go`` apart from
``ebpf_linux.go``.

Two kinds of program come out of here:

* :func:`build_device_program` renders a rule list the way runc and crun do:
  a prologue loads the context into R2..R5, one block per rule (first match
  wins), then the default verdict.
* :func:`add_prefix` puts a block of allow rules *in front of* a program we did
  not write (systemd's, runc's, crun's), which is how a device is granted on
  cgroup v2: every program attached to a cgroup and its ancestors must allow an
  access, so a separate "allow" program would grant nothing. The prefix starts
  with a marker instruction so that :func:`strip_prefix` can remove exactly what
  we added and :func:`prefix_devices` can tell which devices we granted.

Instructions use the host's byte order with ``dst_reg`` in the low nibble,
which is the layout on both supported architectures (x86-64 and aarch64, both
little-endian).
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from jupyter_gpu_hotplug.linux.devrules import ALL_ACCESS, Access, DeviceRule, DevType

INSN_SIZE = 8
"""Bytes per ``struct bpf_insn``."""

_INSN = struct.Struct("<BBhi")

# Instruction classes, sizes, modes and sources (include/uapi/linux/bpf_common.h, bpf.h).
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
SIZE_W, SIZE_H, SIZE_B, SIZE_DW = 0x00, 0x08, 0x10, 0x18
MODE_IMM, MODE_MEM = 0x00, 0x60
SRC_K, SRC_X = 0x00, 0x08

# Registers: R0 return value, R1 context on entry, R10 read-only frame pointer.
R0, R1, R2, R3, R4, R5 = range(6)


class AluOp(enum.IntEnum):
    """The operation nibble of ``BPF_ALU``/``BPF_ALU64`` instructions."""

    ADD = 0x00
    SUB = 0x10
    MUL = 0x20
    DIV = 0x30
    OR = 0x40
    AND = 0x50
    LSH = 0x60
    RSH = 0x70
    NEG = 0x80
    MOD = 0x90
    XOR = 0xA0
    MOV = 0xB0
    ARSH = 0xC0
    END = 0xD0


class JmpOp(enum.IntEnum):
    """The operation nibble of ``BPF_JMP``/``BPF_JMP32`` instructions."""

    JA = 0x00
    JEQ = 0x10
    JGT = 0x20
    JGE = 0x30
    JSET = 0x40
    JNE = 0x50
    JSGT = 0x60
    JSGE = 0x70
    CALL = 0x80
    EXIT = 0x90
    JLT = 0xA0
    JLE = 0xB0
    JSLT = 0xC0
    JSLE = 0xD0


# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; } with
# access_type = (access << 16) | type (include/uapi/linux/bpf.h).
CTX_ACCESS_TYPE_OFF, CTX_MAJOR_OFF, CTX_MINOR_OFF = 0, 4, 8
DEVCG_ACC_MKNOD, DEVCG_ACC_READ, DEVCG_ACC_WRITE = 1, 2, 4
DEVCG_DEV_BLOCK, DEVCG_DEV_CHAR = 1, 2

_DEV_TYPE_CODE = {DevType.CHAR: DEVCG_DEV_CHAR, DevType.BLOCK: DEVCG_DEV_BLOCK}
_CODE_DEV_TYPE = {code: dev_type for dev_type, code in _DEV_TYPE_CODE.items()}
_ACCESS_BITS = (
    (Access.MKNOD, DEVCG_ACC_MKNOD),
    (Access.READ, DEVCG_ACC_READ),
    (Access.WRITE, DEVCG_ACC_WRITE),
)

PREFIX_MAGIC = 0x4750_0000
"""High half of the marker's immediate ("GP"); the low half is the prefix length.

The marker is ``r0 = PREFIX_MAGIC | n``: a dead store (every path sets R0 again
before ``exit``) that the verifier keeps because it is reachable, so it survives
the round trip through ``xlated_prog_insns``."""

_MAX_PREFIX_INSNS = 0xFFFF


@dataclass(frozen=True, slots=True)
class Insn:
    """One ``struct bpf_insn``: opcode, registers, signed 16-bit offset, signed 32-bit imm."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.code <= 0xFF:
            raise ValueError(f"opcode {self.code} out of range")
        if not (0 <= self.dst <= 0xF and 0 <= self.src <= 0xF):
            raise ValueError(f"register out of range in {self!r}")
        if not -(2**15) <= self.off < 2**15:
            raise ValueError(f"jump/memory offset {self.off} does not fit in 16 bits")
        if not -(2**31) <= self.imm < 2**31:
            raise ValueError(f"immediate {self.imm} does not fit in a signed 32-bit field")

    def encode(self) -> bytes:
        return _INSN.pack(self.code, (self.src << 4) | self.dst, self.off, self.imm)

    @classmethod
    def decode(cls, raw: bytes) -> Insn:
        code, regs, off, imm = _INSN.unpack(raw)
        return cls(code, regs & 0xF, regs >> 4, off, imm)

    @property
    def insn_class(self) -> int:
        return self.code & 0x07


def encode_program(insns: Iterable[Insn]) -> bytes:
    return b"".join(insn.encode() for insn in insns)


@functools.lru_cache(maxsize=256)
def decode_program(code: bytes) -> tuple[Insn, ...]:
    """The instructions of ``code``, remembered by its bytes: a grant or a revoke reads the
    container's device program back several times and decodes it at each (to check it is one
    it can read, to split our prefix off, to verify the program it loaded), which was a fifth
    of the engine's CPU. The result is immutable (a tuple of frozen ``Insn``) and a function of
    the bytes alone; a refusal (``ValueError``) is never remembered."""
    if len(code) % INSN_SIZE:
        raise ValueError(f"program length {len(code)} is not a multiple of {INSN_SIZE}")
    return tuple(Insn.decode(code[i : i + INSN_SIZE]) for i in range(0, len(code), INSN_SIZE))


# ---- instruction constructors (the subset device programs use) -------------------------


def ldx_w(dst: int, src: int, off: int) -> Insn:
    """``dst = *(u32 *)(src + off)``; the device context only allows 32-bit loads."""
    return Insn(LDX | SIZE_W | MODE_MEM, dst, src, off)


def alu32_imm(op: AluOp, dst: int, imm: int) -> Insn:
    return Insn(ALU | op | SRC_K, dst, 0, 0, imm)


def alu32_reg(op: AluOp, dst: int, src: int) -> Insn:
    return Insn(ALU | op | SRC_X, dst, src)


def alu64_imm(op: AluOp, dst: int, imm: int) -> Insn:
    return Insn(ALU64 | op | SRC_K, dst, 0, 0, imm)


def jmp_imm(op: JmpOp, dst: int, imm: int, off: int) -> Insn:
    """``if dst <op> imm goto pc+off`` (64-bit compare; imm is sign-extended)."""
    return Insn(JMP | op | SRC_K, dst, 0, off, imm)


def jmp_reg(op: JmpOp, dst: int, src: int, off: int) -> Insn:
    return Insn(JMP | op | SRC_X, dst, src, off)


def ja(off: int) -> Insn:
    return Insn(JMP | JmpOp.JA, off=off)


def exit_() -> Insn:
    return Insn(JMP | JmpOp.EXIT)


# ---- rendering the device policy ----------------------------------------------------


def _prologue() -> list[Insn]:
    """R2 = type, R3 = access, R4 = major, R5 = minor — the runc/crun/systemd prologue.

    The kernel rejects narrower loads of the context (``cgroup_dev_is_valid_access``
    only accepts ``u32`` reads of whole fields), so the type and access halves of
    ``access_type`` are split with ``&`` and ``>>``.
    """
    return [
        ldx_w(R2, R1, CTX_ACCESS_TYPE_OFF),
        alu32_imm(AluOp.AND, R2, 0xFFFF),
        ldx_w(R3, R1, CTX_ACCESS_TYPE_OFF),
        alu32_imm(AluOp.RSH, R3, 16),
        ldx_w(R4, R1, CTX_MAJOR_OFF),
        ldx_w(R5, R1, CTX_MINOR_OFF),
    ]


def _access_mask(access: Access) -> int:
    return sum(bit for flag, bit in _ACCESS_BITS if flag in access)


def _device_number(rule: DeviceRule, name: str, value: int | None) -> int | None:
    # Comparisons are 64-bit with a sign-extended immediate while the context value is
    # a zero-extended u32, so 2**31 and above could never match. No Linux device has
    # such a number (majors have 12 bits, minors 20), so refuse instead of mis-encoding.
    if value is not None and value >= 2**31:
        raise ValueError(f"{rule.render_v1()!r}: {name} {value} cannot be matched by eBPF")
    return value


def _verdict(allow: bool) -> list[Insn]:
    return [alu32_imm(AluOp.MOV, R0, int(allow)), exit_()]


def _is_conditional_jump(insn: Insn) -> bool:
    return insn.insn_class in (JMP, JMP32) and insn.code & 0xF0 not in (
        JmpOp.JA,
        JmpOp.CALL,
        JmpOp.EXIT,
    )


def _rule_block(rule: DeviceRule, *, scratch: int) -> list[Insn]:
    """One rule: checks that jump past the block on mismatch, then the verdict.

    Same layout as runc's ``devicefilter.go``: the access check passes when the
    requested bits are a subset of the rule's (``req & mask == req``); an ``rwm``
    rule, ``a`` type or ``*`` number omits its check. ``scratch`` is the register
    clobbered by the access check.
    """
    body: list[Insn] = []
    if rule.type is not DevType.ALL:
        body.append(jmp_imm(JmpOp.JNE, R2, _DEV_TYPE_CODE[rule.type], 0))
    if rule.access != ALL_ACCESS:
        body += [
            alu32_reg(AluOp.MOV, scratch, R3),
            alu32_imm(AluOp.AND, scratch, _access_mask(rule.access)),
            jmp_reg(JmpOp.JNE, scratch, R3, 0),
        ]
    major = _device_number(rule, "major", rule.major)
    if major is not None:
        body.append(jmp_imm(JmpOp.JNE, R4, major, 0))
    minor = _device_number(rule, "minor", rule.minor)
    if minor is not None:
        body.append(jmp_imm(JmpOp.JNE, R5, minor, 0))
    block = body + _verdict(rule.allow)
    # Every conditional jump skips to the first instruction after this block.
    return [
        replace(insn, off=len(block) - index - 1) if _is_conditional_jump(insn) else insn
        for index, insn in enumerate(block)
    ]


def _matches_everything(rule: DeviceRule) -> bool:
    """A rule without a single check: ``a *:* rwm``."""
    return (rule.type, rule.major, rule.minor, rule.access) == (DevType.ALL, None, None, ALL_ACCESS)


def build_device_program(rules: Sequence[DeviceRule], *, default_allow: bool = False) -> bytes:
    """A complete device program: the first matching rule decides, else ``default_allow``.

    Rendered like runc/crun (scratch register R1, which the prologue no longer
    needs). A rule that matches every access ends the program: the verifier
    rejects unreachable instructions, so nothing after it is emitted.
    """
    insns = _prologue()
    for rule in rules:
        insns += _rule_block(rule, scratch=R1)
        if _matches_everything(rule):
            return encode_program(insns)
    return encode_program(insns + _verdict(default_allow))


# ---- our prefix in front of someone else's program ------------------------------------


def _canonical(devices: Iterable[DeviceRule]) -> list[DeviceRule]:
    """Deduplicated and sorted, so a device set always renders to the same bytes."""

    def key(rule: DeviceRule) -> tuple[str, int, int, int]:
        major = -1 if rule.major is None else rule.major
        minor = -1 if rule.minor is None else rule.minor
        return rule.type.value, major, minor, rule.access.value

    return sorted(set(devices), key=key)


def _render_prefix(devices: Sequence[DeviceRule]) -> list[Insn]:
    body = _prologue()
    for device in devices:
        if not device.allow:
            raise ValueError(f"a prefix only grants; {device.render_v1()!r} is a deny rule")
        if _matches_everything(device):
            raise ValueError("granting every device is not a prefix: the original would be dead")
        # R1 still holds the context the original program reads, so R0 is the scratch
        # register here (the original sets R0 itself before it exits).
        body += _rule_block(device, scratch=R0)
    length = len(body) + 1
    if length > _MAX_PREFIX_INSNS:
        raise ValueError(f"prefix of {length} instructions does not fit the marker")
    return [alu64_imm(AluOp.MOV, R0, PREFIX_MAGIC | length), *body]


def _marker_length(insn: Insn) -> int | None:
    is_marker = (
        insn.code == ALU64 | AluOp.MOV | SRC_K
        and (insn.dst, insn.src, insn.off) == (R0, 0, 0)
        and insn.imm & ~_MAX_PREFIX_INSNS == PREFIX_MAGIC
    )
    return insn.imm & _MAX_PREFIX_INSNS if is_marker else None


def _decode_block_rules(insns: Sequence[Insn]) -> list[DeviceRule] | None:
    """Read the allow blocks of a prefix body back into rules (``None``: not our layout).

    Deliberately lenient — each block runs up to its ``exit`` and only the compared
    values are picked up — because :func:`_split` re-renders the result and
    compares bytes, which rejects anything :func:`_render_prefix` did not produce.
    """
    rules: list[DeviceRule] = []
    dev_type, access = DevType.ALL, ALL_ACCESS
    major: int | None = None
    minor: int | None = None
    for insn in insns:
        if insn.code == JMP | JmpOp.EXIT:
            try:
                rules.append(DeviceRule(dev_type, major, minor, access))
            except ValueError:
                return None
            dev_type, access, major, minor = DevType.ALL, ALL_ACCESS, None, None
        elif insn.code == JMP | JmpOp.JNE | SRC_K and insn.dst == R2:
            if insn.imm not in _CODE_DEV_TYPE:
                return None
            dev_type = _CODE_DEV_TYPE[insn.imm]
        elif insn.code == JMP | JmpOp.JNE | SRC_K and insn.dst == R4:
            major = insn.imm
        elif insn.code == JMP | JmpOp.JNE | SRC_K and insn.dst == R5:
            minor = insn.imm
        elif insn.code == ALU | AluOp.AND | SRC_K and insn.dst == R0:
            access = Access.NONE
            for flag, bit in _ACCESS_BITS:
                if insn.imm & bit:
                    access |= flag
    return rules


@functools.lru_cache(maxsize=256)
def _split(code: bytes) -> tuple[frozenset[DeviceRule], bytes]:
    """(devices our prefix grants, the program without it); unmarked → (empty, code).

    Remembered by the bytes, as :func:`decode_program` is (and for its reason: a grant or a
    revoke splits the same program several times, and the re-rendering that proves the
    prefix ours costs more than the decoding); the result is immutable."""
    if len(code) < INSN_SIZE or len(code) % INSN_SIZE:
        return frozenset(), code
    length = _marker_length(Insn.decode(code[:INSN_SIZE]))
    prologue_end = 1 + len(_prologue())
    if length is None or not prologue_end <= length < len(code) // INSN_SIZE:
        return frozenset(), code
    prefix = decode_program(code[: length * INSN_SIZE])
    rules = _decode_block_rules(prefix[prologue_end:])
    if rules is None or not rules:
        return frozenset(), code
    try:
        rendered = encode_program(_render_prefix(_canonical(rules)))
    except ValueError:
        return frozenset(), code
    if rendered != code[: length * INSN_SIZE]:
        return frozenset(), code
    return frozenset(rules), code[length * INSN_SIZE :]


def add_prefix(devices: Collection[DeviceRule], original: bytes) -> bytes:
    """``original`` with an allow block for each device in front of it.

    The prefix keeps R1 (the context) intact and falls through into ``original``
    unchanged — its jumps are relative, so they stay valid. An empty device set
    returns ``original`` itself, byte for byte, which is how a last revocation
    restores the program we found.
    """
    if not original or len(original) % INSN_SIZE:
        raise ValueError(f"not a program: {len(original)} bytes")
    if _split(original)[0]:
        raise ValueError("the program already carries a prefix; strip it first")
    if not devices:
        return original
    return encode_program(_render_prefix(_canonical(devices))) + original


def strip_prefix(code: bytes) -> bytes:
    """The program without our prefix; a program without one is returned as is."""
    return _split(code)[1]


def prefix_devices(code: bytes) -> frozenset[DeviceRule]:
    """The devices our prefix in ``code`` grants (empty when there is none)."""
    return _split(code)[0]


_REG_AX = 11
"""``BPF_REG_AX``: the kernel's hidden scratch register, never valid in a loaded program."""


def uses_hidden_register(code: bytes) -> bool:
    """Whether ``code`` is kernel-rewritten (constant blinding) and so cannot be loaded again.

    With ``net.core.bpf_jit_harden`` the JIT blinds immediates through R11 and
    the translated instructions read back show that rewrite, not the original.
    """
    return any(_REG_AX in (insn.dst, insn.src) for insn in decode_program(code))


# ---- disassembly ------------------------------------------------------------------------

_ALU_SYMBOLS = {
    AluOp.ADD: "+=",
    AluOp.SUB: "-=",
    AluOp.MUL: "*=",
    AluOp.DIV: "/=",
    AluOp.OR: "|=",
    AluOp.AND: "&=",
    AluOp.LSH: "<<=",
    AluOp.RSH: ">>=",
    AluOp.MOD: "%=",
    AluOp.XOR: "^=",
    AluOp.MOV: "=",
    AluOp.ARSH: "s>>=",
}
_JMP_SYMBOLS = {
    JmpOp.JEQ: "==",
    JmpOp.JGT: ">",
    JmpOp.JGE: ">=",
    JmpOp.JSET: "&",
    JmpOp.JNE: "!=",
    JmpOp.JSGT: "s>",
    JmpOp.JSGE: "s>=",
    JmpOp.JLT: "<",
    JmpOp.JLE: "<=",
    JmpOp.JSLT: "s<",
    JmpOp.JSLE: "s<=",
}
_BITWISE_ALU = {AluOp.AND, AluOp.OR, AluOp.XOR}
_SIZE_NAMES = {SIZE_W: "u32", SIZE_H: "u16", SIZE_B: "u8", SIZE_DW: "u64"}


def _imm_text(value: int, *, hexadecimal: bool) -> str:
    if hexadecimal or abs(value) > 0xFFFF:
        return f"-{-value:#x}" if value < 0 else f"{value:#x}"
    return str(value)


def _mem_text(insn: Insn, base: int) -> str:
    sign = "-" if insn.off < 0 else "+"
    return f"*({_SIZE_NAMES[insn.code & 0x18]} *)(r{base} {sign} {abs(insn.off)})"


def _raw_text(insn: Insn) -> str:
    return (
        f".insn code={insn.code:#04x} dst=r{insn.dst} src=r{insn.src} off={insn.off} imm={insn.imm}"
    )


def _alu_text(insn: Insn) -> str:
    reg = "w" if insn.insn_class == ALU else "r"
    op = insn.code & 0xF0
    if op == AluOp.NEG:
        return f"{reg}{insn.dst} = -{reg}{insn.dst}"
    if op not in _ALU_SYMBOLS:
        return _raw_text(insn)
    operand = (
        f"{reg}{insn.src}"
        if insn.code & SRC_X
        else _imm_text(insn.imm, hexadecimal=op in _BITWISE_ALU)
    )
    return f"{reg}{insn.dst} {_ALU_SYMBOLS[AluOp(op)]} {operand}"


def _jmp_text(insn: Insn, index: int) -> str:
    op = insn.code & 0xF0
    if op == JmpOp.EXIT and insn.code == JMP | JmpOp.EXIT:
        return "exit"
    if op == JmpOp.CALL and insn.code == JMP | JmpOp.CALL:
        return f"call {insn.imm}"
    if op == JmpOp.JA and insn.code == JMP | JmpOp.JA:
        return f"goto pc{insn.off:+d} <{index + insn.off + 1}>"
    if op not in _JMP_SYMBOLS:
        return _raw_text(insn)
    reg = "w" if insn.insn_class == JMP32 else "r"
    operand = (
        f"{reg}{insn.src}"
        if insn.code & SRC_X
        else _imm_text(insn.imm, hexadecimal=op == JmpOp.JSET)
    )
    target = index + insn.off + 1
    return f"if {reg}{insn.dst} {_JMP_SYMBOLS[JmpOp(op)]} {operand} goto pc{insn.off:+d} <{target}>"


def _insn_text(insn: Insn, index: int) -> str:
    cls = insn.insn_class
    if cls in (ALU, ALU64):
        return _alu_text(insn)
    if cls in (JMP, JMP32):
        return _jmp_text(insn, index)
    if insn.code & 0xE0 == MODE_MEM:
        if cls == LDX:
            return f"r{insn.dst} = {_mem_text(insn, insn.src)}"
        if cls == STX:
            return f"{_mem_text(insn, insn.dst)} = r{insn.src}"
        if cls == ST:
            return f"{_mem_text(insn, insn.dst)} = {_imm_text(insn.imm, hexadecimal=False)}"
    return _raw_text(insn)


def disassemble(code: bytes) -> str:
    """One line per instruction, ``index: text``, in the kernel verifier's notation.

    Jumps show their absolute target as ``<n>``; a 16-byte ``lddw`` takes two
    slots; our prefix marker is annotated. Meant for golden tests and for error
    messages, so every opcode prints something, unknown ones as raw fields.
    """
    insns = decode_program(code)
    marked = bool(_split(code)[0])
    lines: list[str] = []
    index = 0
    while index < len(insns):
        insn = insns[index]
        if insn.code == LD | SIZE_DW | MODE_IMM and index + 1 < len(insns):
            value = (insns[index + 1].imm << 32) | (insn.imm & 0xFFFF_FFFF)
            lines.append(f"{index}: r{insn.dst} = {value & (2**64 - 1):#x} ll")
            index += 2
            continue
        text = _insn_text(insn, index)
        if index == 0 and marked:
            text += f"  ; gpu-hotplug prefix marker, {_marker_length(insn)} insns"
        lines.append(f"{index}: {text}")
        index += 1
    return "\n".join(lines) + "\n" if lines else ""
