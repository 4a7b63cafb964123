"""Builders and the layer check shared by the stack executor tests (CPU and GPU)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3_decode.executor import StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.layer_check import layer_failures, snapshot
from k3_decode.executor.oracle import teacher_forced
from k3_decode.isolation_redteam import RedTeamKdaProvider
from k3_decode.weights import LayerWeights, SyntheticWeights

__all__ = [
    "LIMITED_LAYER",
    "LayerLimitedKda",
    "build",
    "decode_requests",
    "layer_failures",
    "oracle_failures",
    "prefill",
    "snapshot",
    "stack_weights",
]


@functools.cache
def stack_weights(stack: str, tp: int, device: str = "cpu") -> dict[int, LayerWeights]:
    """One generation of a stack's weights per process: tests share them and never write them."""
    config = load_stack(stack, tp)
    gen = SyntheticWeights(config.dims, tp, config.rank, seed=config.seed, device=device)
    return {i: gen.layer(i) for i in config.layers}


def build(stack: str = "k3-mini-kda3-mla", tp: int = 1, device: str = "cpu", **kwargs: Any) -> StackExecutor:
    """An executor started through the runtime (decode_backend auto) on shared weights; the memory plan it prints
    goes to `log` (default: dropped)."""
    config = load_stack(stack, tp)
    kwargs.setdefault("log", lambda line: None)
    return StackExecutor.start(config, device=device, weights=stack_weights(stack, tp, device), **kwargs)


def decode_requests(ex: StackExecutor, requests: Sequence[int], seed: int) -> list[StepRequest]:
    """One decode token per request, with seeded unit-normal entry states."""
    first = ex.config.layers[0]
    entry = random_input(ex.dims, first, len(requests), seed, ex.device)
    return [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(requests)]


def prefill(ex: StackExecutor, lengths: dict[int, int], seed: int = 0) -> None:
    first = ex.config.layers[0]
    ex.prefill({r: random_input(ex.dims, first, n, seed + r, ex.device) for r, n in lengths.items()})


def oracle_failures(
    ex: StackExecutor, requests: Sequence[StepRequest], dtype: torch.dtype = torch.float64
) -> list[str]:
    """Run one traced eager step and compare it layer by layer with the teacher-forced oracle."""
    before = snapshot(ex, requests)
    result = ex.step(requests, trace=True)
    assert result.trace is not None
    ref = teacher_forced(ex.dims, ex.config.tp, ex.weights, result.trace, before, dtype)
    return layer_failures(result.trace, ref)


LIMITED_LAYER = 5  # a KDA layer of the k3-mini stacks (4, 5, 6 KDA; 7 MLA)


@dataclass(frozen=True)
class LayerLimitedKda(RedTeamKdaProvider):
    """The honest KDA test double with one row at most at LIMITED_LAYER and no limit elsewhere (a provider's
    per-layer row limit, as the fused o_proj's by bank size)."""

    def layer_max_rows(self, tp: int, dims: Any, layer: int) -> tuple[int, str] | None:
        return (1, f"rows the test provider serves at layer {layer}") if layer == LIMITED_LAYER else None
