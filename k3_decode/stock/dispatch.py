"""Which implementation of a stock op runs, and the per-op facts the dispatch ledger and launch counts use.

On CUDA the attention-side ops run Triton kernels (ours, or fla-core's for the verify recurrence) and cuBLAS
GEMMs; on the CPU they run the same math as torch ops ("torch-cpu"), because Triton kernels do not run there.
The per-op table (implementation per device, launches, kernel names, the vLLM counterpart and why it is a fair
stand-in) is data: attention_ops.toml beside this file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

import torch

Implementation = Literal["triton", "torch-cpu"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("triton", "torch-cpu")


def implementation_for(device: torch.device | str) -> Implementation:
    """Triton kernels on CUDA, torch on anything else."""
    return "triton" if torch.device(device).type == "cuda" else "torch-cpu"


def check_implementation(implementation: str, device: torch.device | str) -> Implementation:
    """Reject an implementation that cannot run on `device` with a message that names the fix."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown stock implementation {implementation!r}; use one of {list(IMPLEMENTATIONS)}")
    if implementation == "triton" and torch.device(device).type != "cuda":
        raise ValueError("the triton stock implementation needs CUDA tensors; use 'torch-cpu' on the CPU")
    return implementation  # type: ignore[return-value]


@dataclass(frozen=True)
class OpInfo:
    """Static facts about one stock op on one kind of device."""

    op: str
    implementation: str  # what the ledger records: "triton", "cublas", "fla-core+triton" or "torch-cpu"
    launches: int  # kernel launches on CUDA (0 on the CPU)
    kernels: tuple[str, ...]  # kernel names (or name prefixes) the profiler shows on CUDA
    vllm: str  # what vLLM 0.33.0's stock decode runs there on an H200
    fair_because: str


@dataclass(frozen=True)
class OpRecord:
    """One dispatch of a stock op, as the runtime's ledger records it."""

    op: str
    implementation: str
    launches: int
    batch: int
    tokens_per_request: int


@cache
def _table(name: str = "attention_ops.toml") -> dict[str, dict]:
    return tomllib.loads(resources.files("k3_decode.stock").joinpath(name).read_text())["ops"]


def op_names() -> tuple[str, ...]:
    return tuple(_table())


def table_info(op: str, device: torch.device | str, name: str = "attention_ops.toml") -> OpInfo:
    """The row of `op` in the op table `name` for `device` (on the CPU: "torch-cpu", no launches, no kernels);
    raises naming the known ops when `op` is unknown."""
    table = _table(name)
    if op not in table:
        raise ValueError(f"unknown stock op {op!r} in {name}; known ops: {sorted(table)}")
    row = table[op]
    on_cuda = torch.device(device).type == "cuda"
    return OpInfo(
        op=op,
        implementation=row["cuda"] if on_cuda else "torch-cpu",
        launches=row["launches"] if on_cuda else 0,
        kernels=tuple(row["kernels"]) if on_cuda else (),
        vllm=row["vllm"],
        fair_because=row["fair_because"],
    )


def op_info(op: str, device: torch.device | str) -> OpInfo:
    """The attention_ops.toml row of `op` for `device`."""
    return table_info(op, device)
