"""A kernel's cost read from its machine code (no GPU): cuobjdump's SASS listing and resource
usage, and ptxas's report (``--ptxas-options=-v``).

How the main loop is counted (:func:`count_main_loop`): the main loop of a kernel is the loop
(a backward branch and the instructions from its target to it) that holds the most instructions
among the loops holding no other loop; in the specialized step kernels that is the per-iteration
loop, one octet (8 elements) per thread. Every instruction of its body counts once -- *static* --
and *hot* leaves out the blocks a thread enters only on a slow path: a conditional forward branch
over a block that calls a subroutine (``CALL``: IEEE division and square-root special cases, an
octet holding an infinity), whose moves and call never run for ordinary values; the branch itself
and the convergence instructions around it stay counted. Per element is the count divided by the
8 elements of an iteration. The loop must not hold local-memory (``LDL``/``STL``), barrier
(``BAR``) or atomic (``ATOM``/``ATOMS``/``RED``) instructions.
"""
from __future__ import annotations

import dataclasses
import re

__all__ = ["Instr", "parse_sass", "main_loop", "LoopCount", "count_main_loop", "parse_ptxas", "parse_resource_usage"]

_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
# a branch: an optional guard predicate, BRA, an optional predicate operand ("@P0 BRA P1, 0x..."
# branches where both hold), the target
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(!?U?P\w+,\s*)?(0x[0-9a-f]+)")
FORBIDDEN = {"local": ("LDL", "STL"), "barrier": ("BAR",), "atomic": ("ATOM", "ATOMS", "RED")}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One SASS instruction: its address and text (predicate, opcode and operands)."""
    addr: int
    text: str

    @property
    def opcode(self) -> str:
        """The opcode without predicate or modifiers, e.g. ``FFMA`` for ``@P0 FFMA.FTZ``."""
        words = self.text.split()
        word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return word.split(".")[0]


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """``cuobjdump -sass`` output -> {function name: its instructions in address order}."""
    out: dict[str, list[Instr]] = {}
    marks = list(_FUNCTION.finditer(text))
    for k, m in enumerate(marks):
        body = text[m.end():marks[k + 1].start() if k + 1 < len(marks) else len(text)]
        out[m.group(1)] = [Instr(int(a, 16), t) for a, t in _INSTR.findall(body)]
    return out


def _loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every loop: a branch back to an earlier address."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    loops = []
    for i, ins in enumerate(instrs):
        m = _BRANCH.match(ins.text)
        if m and int(m.group(3), 16) <= ins.addr and int(m.group(3), 16) in index:
            loops.append((index[int(m.group(3), 16)], i))
    return loops


def main_loop(instrs: list[Instr]) -> list[Instr]:
    """The body of the kernel's main loop (see the module docstring); [] if it has no loop."""
    loops = _loops(instrs)
    inner = [(s, e) for s, e in loops
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    if not inner:
        return []
    s, e = max(inner, key=lambda r: r[1] - r[0])
    return instrs[s:e + 1]


def _cold(body: list[Instr]) -> set[int]:
    """Indices of the slow-path blocks of a loop body: skipped by a conditional forward branch and
    holding a subroutine call."""
    cold: set[int] = set()
    for i, ins in enumerate(body):
        m = _BRANCH.match(ins.text)
        if not m or not (m.group(1) or m.group(2)) or int(m.group(3), 16) <= ins.addr:
            continue  # not a conditional forward branch
        target = int(m.group(3), 16)
        block = [j for j in range(i + 1, len(body)) if body[j].addr < target]
        if any(body[j].opcode == "CALL" for j in block):
            cold.update(block)
    return cold


@dataclasses.dataclass(frozen=True)
class LoopCount:
    """A main loop's instruction counts (see the module docstring) per iteration and per element,
    and its forbidden instructions by kind."""
    static: int
    hot: int
    elements: int
    forbidden: dict[str, int]

    @property
    def static_per_element(self) -> float:
        return self.static / self.elements

    @property
    def hot_per_element(self) -> float:
        return self.hot / self.elements


def count_main_loop(instrs: list[Instr], elements: int = 8) -> LoopCount:
    """The counts of the main loop of a kernel's instructions, for `elements` per iteration."""
    body = main_loop(instrs)
    cold = _cold(body)
    forbidden = {kind: sum(ins.opcode in ops for ins in body) for kind, ops in FORBIDDEN.items()}
    return LoopCount(len(body), len(body) - len(cold), elements, forbidden)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'.*?Function properties for \1\s*\n"
                          r".*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s*\n"
                          r".*?Used (\d+) registers", re.S)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """ptxas's ``-v`` report -> {entry function: registers, stack, spill_stores, spill_loads}."""
    return {m.group(1): {"registers": int(m.group(5)), "stack": int(m.group(2)), "spill_stores": int(m.group(3)),
                         "spill_loads": int(m.group(4))}
            for m in _PTXAS_ENTRY.finditer(log)}


_RESOURCES = re.compile(r"Function (\w+):\s*\n?\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` -> {function: registers, stack, shared, local}."""
    return {m.group(1): {"registers": int(m.group(2)), "stack": int(m.group(3)), "shared": int(m.group(4)),
                         "local": int(m.group(5))}
            for m in _RESOURCES.finditer(text)}
