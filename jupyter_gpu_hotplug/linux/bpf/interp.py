"""What a cgroup v2 device program answers for one access: a pure interpreter of the subset of
eBPF that device programs are written in.

Why it exists: on cgroup v2 the device policy of a container *is* the programs attached to its
cgroups (runc's, crun's, systemd's), and nothing in the kernel tells which devices they allow
short of running them. The agent must know whether a container can open a GPU that nobody gave
it (the stray-GPU sweep), whoever wrote the program. Device programs are straight-line code
with forward jumps: loads of the 32-bit context fields, ALU on registers and constants, compare
and jump, exit. Anything beyond that subset is answered with ``None`` ("cannot tell"), never
guessed.

Boundary: bytes in, a verdict out; no system calls (reading the programs is
``cgroup_v2.attached_program_code``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from ..devrules import Access, DevType
from .asm import (
    ALU,
    ALU64,
    CTX_ACCESS_TYPE_OFF,
    CTX_MINOR_OFF,
    JMP,
    JMP32,
    LDX,
    MODE_MEM,
    SIZE_W,
    SRC_X,
    AluOp,
    JmpOp,
    decode_program,
)

__all__ = ["allows"]

_MASK32: Final = 2**32 - 1
_MASK64: Final = 2**64 - 1
_TYPE_CODES: Final = {DevType.CHAR: 2, DevType.BLOCK: 1}
_ACCESS_CODES: Final = ((Access.MKNOD, 1), (Access.READ, 2), (Access.WRITE, 4))
_LDX_W: Final = LDX | MODE_MEM | SIZE_W

_ALU: Final[dict[int, Callable[[int, int], int]]] = {
    AluOp.ADD: lambda a, b: a + b,
    AluOp.SUB: lambda a, b: a - b,
    AluOp.OR: lambda a, b: a | b,
    AluOp.AND: lambda a, b: a & b,
    AluOp.LSH: lambda a, b: a << (b & 63),
    AluOp.RSH: lambda a, b: a >> (b & 63),
    AluOp.XOR: lambda a, b: a ^ b,
    AluOp.MOV: lambda a, b: b,
}
_JMP: Final[dict[int, Callable[[int, int], bool]]] = {
    JmpOp.JEQ: lambda a, b: a == b,
    JmpOp.JNE: lambda a, b: a != b,
    JmpOp.JGT: lambda a, b: a > b,
    JmpOp.JGE: lambda a, b: a >= b,
    JmpOp.JLT: lambda a, b: a < b,
    JmpOp.JLE: lambda a, b: a <= b,
    JmpOp.JSET: lambda a, b: bool(a & b),
}


class _Unknown(Exception):
    """The program does something outside the interpreted subset."""


def allows(code: bytes, dev_type: DevType, access: Access, major: int, minor: int) -> bool | None:
    """Whether the device program ``code`` (``xlated_prog_insns``) allows the access; None
    when it cannot be told (an instruction outside the subset, a read of an unset register)."""
    bits = sum(bit for flag, bit in _ACCESS_CODES if flag in access)
    ctx = struct.pack("<III", bits << 16 | _TYPE_CODES[dev_type], major, minor)
    try:
        return _run(code, ctx) != 0
    except (_Unknown, ValueError, IndexError):
        return None


def _run(code: bytes, ctx: bytes) -> int:
    insns = decode_program(code)
    regs: list[int | None] = [None] * 11
    ctx_reg: set[int] = {1}  # R1 points at the context on entry
    pc = 0
    for _ in range(len(insns) + 1):  # forward jumps only: each instruction runs at most once
        insn = insns[pc]
        pc += 1
        cls, op = insn.insn_class, insn.code & 0xF0
        if insn.code == JMP | JmpOp.EXIT:
            return _value(regs, 0)
        if insn.code == _LDX_W:
            if insn.src not in ctx_reg or not CTX_ACCESS_TYPE_OFF <= insn.off <= CTX_MINOR_OFF:
                raise _Unknown(f"load from r{insn.src}{insn.off:+d}")
            regs[insn.dst] = struct.unpack_from("<I", ctx, insn.off)[0]
            ctx_reg.discard(insn.dst)
        elif cls in (ALU, ALU64) and op in _ALU:
            mask = _MASK32 if cls == ALU else _MASK64
            src = _value(regs, insn.src) if insn.code & SRC_X else insn.imm & mask
            dst = 0 if op == AluOp.MOV else _value(regs, insn.dst)
            regs[insn.dst] = _ALU[op](dst & mask, src & mask) & mask
            ctx_reg.discard(insn.dst)
        elif insn.code == JMP | JmpOp.JA:
            pc = _forward(pc, insn.off)
        elif cls in (JMP, JMP32) and op in _JMP:
            mask = _MASK32 if cls == JMP32 else _MASK64
            left = _value(regs, insn.dst) & mask
            right = (_value(regs, insn.src) if insn.code & SRC_X else insn.imm) & mask
            if _JMP[op](left, right):
                pc = _forward(pc, insn.off)
        else:
            raise _Unknown(f"instruction {insn}")
    raise _Unknown("the program does not exit")


def _value(regs: list[int | None], index: int) -> int:
    value = regs[index]
    if value is None:
        raise _Unknown(f"r{index} read before it is set")
    return value


def _forward(pc: int, off: int) -> int:
    if off < 0:
        raise _Unknown("a backward jump")
    return pc + off
