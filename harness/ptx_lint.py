"""Dataflow lints over PTX that regular-expression counts cannot express.

Contracted butterfly steps. A warp reduction by butterfly shuffles (`shfl.sync.bfly`) leaves every lane with the
same bits only while each step is symmetric: lane i computes x_i + x_j and lane j computes x_j + x_i, equal by
commutativity. When the compiler contracts the product before a reduction into the first step's add, lane i
computes fma(a_i, a_i, fl(a_j * a_j)) and lane j fma(a_j, a_j, fl(a_i * a_i)): one lane's product is rounded and
the other's is not, so the lanes' sums differ in their last bits. Codegen that then lets several lanes store
"the" warp's partial to one shared-memory word (Triton does, for cross-warp reductions and layout conversions
over replicated lanes) writes different values to the same address in one instruction: a real write-after-write
race whose winner the PTX memory model leaves undefined, which compute-sanitizer racecheck reports (Triton issues
7264 and 11614 describe both halves). Contraction happens per kernel and is turned off with Triton's
`enable_fp_fusion=False` launch option (the default from Triton 3.10 on).

The check is exact on the dataflow it looks at: an `fma` with an operand register that a `shfl.sync.bfly` wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+([^;]*);")
_LOC = re.compile(r"^\s*\.loc\s+\d+\s+(\d+)\s+\d+.*?(?://\s*(\S+))?\s*$")
_REGISTER = re.compile(r"%[\w]+")


@dataclass(frozen=True)
class ContractedButterfly:
    """One butterfly step contracted into an FMA: where it is and the instruction."""

    ptx_line: int  # 1-based line in the PTX text
    source: str  # the `.loc` comment in force there ("file.py:line:col"), or "" without line info
    instruction: str

    def describe(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"PTX line {self.ptx_line}{where}: {self.instruction}"


def contracted_butterflies(ptx: str) -> list[ContractedButterfly]:
    """Every FMA that takes a register written by a butterfly shuffle, in PTX order."""
    shuffled: set[str] = set()
    source = ""
    found: list[ContractedButterfly] = []
    for number, line in enumerate(ptx.splitlines(), start=1):
        loc = _LOC.match(line)
        if loc:
            source = loc.group(2) or ""
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        opcode, operands = match.groups()
        registers = _REGISTER.findall(operands)
        if not registers:
            continue
        destination, sources = registers[0], registers[1:]
        if opcode.startswith("fma") and shuffled.intersection(sources):
            found.append(ContractedButterfly(number, source, f"{opcode} {operands.strip()}"))
        # A register is "shuffled" from the shuffle that writes it until anything else writes it again.
        if opcode.startswith("shfl.sync.bfly"):
            shuffled.add(destination)
        else:
            shuffled.discard(destination)
    return found
