"""Builders shared by the runtime tests: an in-scope deployment and fake specialized providers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.optable import OpTable, load_op_table
from k3_decode.runtime.scope import Deployment

SPECIALIZED = {"decode_backend": "latency_specialized"}
# vLLM's default capture sizes up to 64 rows.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def deployment(**overrides: Any) -> Deployment:
    """A TP8 H200 deployment inside the k3-hopper scope for the specialized path."""
    base = Deployment(
        model="k3",
        device="cuda",
        capability=(9, 0),
        tp=8,
        dcp=1,
        max_batch=64,
        num_speculative_tokens=0,
        spec_method=None,
        mla_cache_dtype="float8_e4m3fn",
        kda_conv_state_dtype="bfloat16",
        kda_recurrent_state_dtype="float32",
        cudagraph_mode="full_and_piecewise",
        capture_sizes=CAPTURE_SIZES,
        tp_all_reduce=True,
    )
    return dataclasses.replace(base, **overrides)


@dataclass(frozen=True)
class FakeProvider:
    op: str
    name: str
    launches: Mapping[str, int] = field(default_factory=dict)


def kernel_name(op: str) -> str:
    return f"K3{op.title().replace('_', '')}Kernel"


def built_registry(table: OpTable | None = None) -> ProviderRegistry:
    """A registry with one provider (one kernel, one launch) for every op the table routes to specialized."""
    table = table or load_op_table()
    reg = ProviderRegistry()
    for op in sorted(table.specialized_ops()):
        reg.register(FakeProvider(op, f"fake-{op}", {kernel_name(op): 1}))
    return reg
