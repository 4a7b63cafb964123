"""The numerics stage's tensor-parallel cells (configs with `parallel.mode = "distributed"`): one process per GPU
through harness.parallel, for each TP size of the config that this host has GPUs for.

    all_reduce   every rank-order transport (`ordered`, and `peer` on CUDA) over the config's batches at the hidden
                 and latent widths: the oracle's bits on every rank (k3_decode.reference.allreduce), inputs intact
    epilogues    (CUDA) the peer kernel's fused latent RMSNorm and AttnRes give the unfused composition's bits
    stack        one decode step of a real-shape TP stack (k3-mini on the CPU) after a short prefill, per transport:
                 the teacher-forced oracle over every rank's shard within the layer tolerances, exact cross-rank
                 replication of every replicated value, and the per-rank write-set audit; the ordered and the
                 fused peer stacks agree bit for bit

Each cell becomes checks whose values are what the ranks measured (failures listed in the detail), so a bad
transport, a rank that diverges or a stack that skips an all-reduce fails the stage. A TP size without enough GPUs
is NOT_RUN with the number needed, never passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.parallel import RankFailure, run_ranks
from harness.verdicts import Check
from k3_decode.config import load_dims
from k3_decode.distributed.allreduce import build
from k3_decode.distributed.group import TpGroup
from k3_decode.distributed.tp_stack import TpStackSpec, oracle_reduce, replication_errors, start_rank, trace_tensors
from k3_decode.reference.allreduce import TwoShotMismatch, bf16_bits, verify_two_shot

STACKS = {"cuda": "k3-kda-mla", "cpu": "k3-mini-kda3-mla"}
RANK_TIMEOUT_S = 900.0


def _partial(rank: int, rows: int, width: int, seed: int) -> torch.Tensor:
    """Normal values over six decades, with a -0.0 column: sums whose rounding and order matter."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    scale = torch.logspace(-3, 3, width)[torch.randperm(width, generator=gen)]
    x = torch.randn(rows, width, generator=gen) * scale
    x[:, 0] = -0.0
    return x.bfloat16()


def all_reduce_rank(
    rank: int, world: int, address: str, port: int, kind: str, batches: list[int], widths: list[int]
) -> dict[str, str]:
    group = TpGroup.join(rank, world, address, port, kind)
    out = {}
    transports = ["ordered", "peer"] if kind == "cuda" else ["ordered"]
    for name in transports:
        ar = build(name, group, max_rows=max(batches), max_width=max(widths))
        for width in widths:
            for batch in batches:
                x = _partial(rank, batch, width, seed=batch).to(group.device)
                before = x.clone()
                got = ar(x)
                try:
                    verify_two_shot(group.gather_tensors(got), group.gather_tensors(x))
                    verdict = "ok"
                except TwoShotMismatch as exc:
                    verdict = str(exc)
                if not torch.equal(bf16_bits(x), bf16_bits(before)):
                    verdict = "the transport wrote its input"
                out[f"{name} B{batch} width {width}"] = verdict
    group.barrier()
    return out


def stack_rank(
    rank: int, world: int, address: str, port: int, kind: str, stack: str, variants: list[tuple[str, bool]]
) -> dict[str, Any]:
    from k3_decode.executor import StepRequest, audit_step, random_input
    from k3_decode.executor.layer_check import layer_failures, snapshot
    from k3_decode.executor.oracle import teacher_forced

    group = TpGroup.join(rank, world, address, port, kind)
    out: dict[str, Any] = {}
    weights = None
    outputs = {}
    for transport, fused in variants:
        spec = TpStackSpec(stack, transport, fused)
        ex = start_rank(group, spec, weights=weights, log=lambda line: None)
        weights = ex.weights
        first = ex.config.layers[0]

        def requests(ids: Sequence[int], seed: int, ex=ex, first=first) -> list[StepRequest]:
            entry = random_input(ex.dims, first, len(ids), seed, ex.device)
            return [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(ids)]

        ex.prefill({r: random_input(ex.dims, first, n, 50 + r, ex.device) for r, n in {0: 3, 1: 5, 3: 2}.items()})
        reqs = requests([3, 0, 2, 1], seed=7)
        before = snapshot(ex, reqs)
        result = ex.step(reqs, trace=True)
        assert result.trace is not None
        ref = teacher_forced(ex.dims, world, ex.weights, result.trace, before, reduce=oracle_reduce(group))
        tensors = trace_tensors(result.trace) | {f"output {r}": t for r, t in result.outputs.items()}
        audited = audit_step(ex, requests([0, 2], seed=8), method="digest")
        outputs[spec.label] = {r: bf16_bits(t).cpu() for r, t in result.outputs.items()}
        out[spec.label] = {
            "oracle": layer_failures(result.trace, ref),
            "replication": replication_errors(group, tensors),
            "audit": [] if audited.passed else [audited.summary()],
        }
        del ex
    if "ordered" in outputs and "peer+fused" in outputs:
        same = all(torch.equal(outputs["ordered"][r], outputs["peer+fused"][r]) for r in outputs["ordered"])
        out["fused equals unfused"] = [] if same else ["the fused peer stack's outputs differ from the ordered one's"]
    group.barrier()
    return out


@dataclass(frozen=True)
class TpNumerics:
    """The TP cells of one config: its TP sizes, batches and the device kind the ranks run on."""

    model: str
    tps: tuple[int, ...]
    batches: tuple[int, ...]
    kind: str  # "cuda" or "cpu"

    @classmethod
    def from_config(cls, config: Any) -> TpNumerics | None:
        data = config.data
        parallel = data.get("parallel", {})
        if parallel.get("mode") != "distributed":
            return None
        kind = "cuda" if data["hardware"]["gpu"] != "none" else "cpu"
        tps = tuple(t for t in parallel.get("tp", [1]) if t > 1)
        batches = tuple(sorted({b for b in data.get("workload", {}).get("batches", [1]) if b <= 64}))
        return cls(data.get("model", "k3"), tps, batches, kind)

    def available(self, tp: int) -> str | None:
        """Why TP `tp` cannot run here, or None."""
        if self.kind == "cpu":
            return None
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return None if have >= tp else f"TP{tp} needs {tp} GPUs on one host, this host has {have}"

    def run(self) -> tuple[list[Check], list[str], dict[str, Any]]:
        """(checks, not-run reasons, metrics) of every TP size."""
        checks: list[Check] = []
        not_run: list[str] = []
        metrics: dict[str, Any] = {}
        dims = load_dims("k3" if self.kind == "cuda" else "k3-mini")
        widths = [dims.hidden_size, dims.moe.latent_size]
        for tp in self.tps:
            if why := self.available(tp):
                not_run.append(why)
                continue
            try:
                bits = run_ranks(all_reduce_rank, tp, self.kind, (list(self.batches), widths), timeout_s=RANK_TIMEOUT_S)
                variants = [("ordered", False), ("peer", True)] if self.kind == "cuda" else [("ordered", False)]
                stacks = run_ranks(stack_rank, tp, self.kind, (STACKS[self.kind], variants), timeout_s=RANK_TIMEOUT_S)
            except RankFailure as exc:
                checks.append(Check(f"TP{tp} ranks ran to the end", str(exc), "==", "completed"))
                continue
            checks += checks_for(tp, bits, stacks)
            metrics[f"tp{tp}"] = {"ranks": tp, "device": self.kind, "all_reduce_cells": len(bits[0])}
        return checks, not_run, metrics


def checks_for(tp: int, bits: Sequence[dict[str, str]], stacks: Sequence[dict[str, Any]]) -> list[Check]:
    """The checks of one TP size from what its ranks returned (all_reduce_rank, stack_rank), rank by rank."""
    checks = []
    for rank, cells in enumerate(bits):
        wrong = {cell: v for cell, v in cells.items() if v != "ok"}
        checks.append(
            Check(
                f"TP{tp} rank {rank}: all-reduce cells with the oracle's bits",
                len(cells) - len(wrong),
                "==",
                len(cells),
                "; ".join(f"{c}: {v}" for c, v in list(wrong.items())[:5]),
            )
        )
    for rank, result in enumerate(stacks):
        for variant, problems in result.items():
            items = problems.items() if isinstance(problems, dict) else [("", problems)]
            for what, found in items:
                name = f"TP{tp} rank {rank} stack {variant} {what}".rstrip()
                checks.append(Check(name, len(found), "==", 0, "; ".join(found[:5])))
    return checks
