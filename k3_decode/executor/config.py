"""What the stack executor builds: N consecutive decoder layers of a model at one TP size's per-rank shapes.

One GPU holds one rank's shard of the layers (rank 0 by default); the TP all-reduces of a real deployment are the
identity here, so every row-parallel output (o_proj, shared experts, latent sum) is this rank's partial as it is.
Named stacks are data (`stacks.toml` beside this module).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from typing import Any

from k3_decode.config import ModelDims, load_dims
from k3_decode.runtime.scopefile import load_scope

_KEYS = {"model", "layers", "max_requests", "max_context", "page_size", "graph_batches"}


class StackConfigError(ValueError):
    """A stack the executor cannot build; the message names the field and the fix."""


@dataclass(frozen=True)
class StackConfig:
    model: str  # "k3", "k3-mini" or a dims TOML path (k3_decode.config.load_dims)
    tp: int
    layers: tuple[int, ...]  # consecutive 0-indexed layers, in order
    max_requests: int  # requests with their own KDA state slot and MLA pages
    max_context: int  # tokens per request the MLA pages hold
    page_size: int = 16
    graph_batches: tuple[int, ...] = (1, 8, 64)  # one CUDA graph per batch size
    rank: int = 0
    seed: int = 0  # SyntheticWeights seed
    k_scale: float = 1.0  # per-tensor FP8 scale of the MLA cache (vLLM's default when uncalibrated)
    q_scale: float = 1.0  # per-tensor FP8 scale of the MLA query
    # Draft tokens each verify step checks: a stack with k > 0 runs verify steps of q = 1 + k tokens per request
    # (executor.py says how) and gives every request q KDA state slots; 0 runs decode steps of one token.
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        dims = self.dims
        dims.shard(self.tp)  # ShardError (a ValueError) names the supported TP sizes
        if not self.layers:
            raise StackConfigError("stack has no layers; list at least one layer index")
        first, last = self.layers[0], self.layers[-1]
        if list(self.layers) != list(range(first, last + 1)):
            raise StackConfigError(f"stack layers {list(self.layers)} are not consecutive; list them as a..b in order")
        if first < 0 or last >= dims.num_layers:
            raise StackConfigError(f"stack layers {first}..{last} are outside {dims.name}'s 0..{dims.num_layers - 1}")
        if not 0 <= self.rank < self.tp:
            raise StackConfigError(f"rank {self.rank} is outside 0..{self.tp - 1} for TP={self.tp}")
        for name in ("max_requests", "max_context", "page_size"):
            if getattr(self, name) < 1:
                raise StackConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.graph_batches or min(self.graph_batches) < 1:
            raise StackConfigError(f"graph_batches must list batch sizes >= 1, got {list(self.graph_batches)}")
        if max(self.graph_batches) > self.max_requests:
            raise StackConfigError(
                f"graph batch {max(self.graph_batches)} exceeds max_requests {self.max_requests}; "
                "raise max_requests or drop the batch"
            )
        top = _max_tokens_per_request()
        if not 0 <= self.num_speculative_tokens <= top - 1:
            raise StackConfigError(
                f"num_speculative_tokens {self.num_speculative_tokens} outside 0..{top - 1}: the scope's "
                f"max_tokens_per_request is {top} (q = 1 + speculative tokens); use at most {top - 1}"
            )
        if not (self.k_scale > 0 and self.q_scale > 0):
            raise StackConfigError(f"FP8 scales must be positive, got k_scale {self.k_scale}, q_scale {self.q_scale}")

    @cached_property
    def dims(self) -> ModelDims:
        return load_dims(self.model)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.layers if self.dims.layer_kind(i) == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.layers if self.dims.layer_kind(i) == "mla")

    @property
    def tokens_per_request(self) -> int:
        """q: the tokens of one request in this stack's decode (1) or verify (1 + speculative tokens) steps."""
        return 1 + self.num_speculative_tokens

    @property
    def pages_per_request(self) -> int:
        return -(-self.max_context // self.page_size)

    def describe(self) -> str:
        kinds = ", ".join(f"{i} {self.dims.layer_kind(i)}+{self.dims.mlp_kind(i)}" for i in self.layers)
        return f"{self.dims.name} TP{self.tp} rank {self.rank}, layers {kinds}"


@cache
def _max_tokens_per_request() -> int:
    """The most tokens per request the subject's scope allows (k3_decode/scope/k3-hopper.toml [deployment]): the
    verify kernels, stock and specialized, take at most that many, so a stack is not built for more."""
    return load_scope("k3-hopper").max_tokens_per_request


def _stacks() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("stacks.toml").read_text())


def stack_names() -> tuple[str, ...]:
    return tuple(_stacks())


def load_stack(name: str, tp: int, **overrides: Any) -> StackConfig:
    """The named stack of stacks.toml at `tp`; keyword overrides replace its fields (e.g. max_context=...)."""
    table = _stacks()
    if name not in table:
        raise StackConfigError(f"unknown stack {name!r}; use one of {sorted(table)} (k3_decode/executor/stacks.toml)")
    raw = table[name]
    if missing := sorted(_KEYS - set(raw)):
        raise StackConfigError(f"stack {name!r} in stacks.toml lacks {missing}; add them")
    if unknown := sorted(set(raw) - _KEYS):
        raise StackConfigError(f"stack {name!r} in stacks.toml has unknown keys {unknown}; use {sorted(_KEYS)}")
    fields = {
        "model": raw["model"],
        "tp": tp,
        "layers": tuple(raw["layers"]),
        "max_requests": raw["max_requests"],
        "max_context": raw["max_context"],
        "page_size": raw["page_size"],
        "graph_batches": tuple(raw["graph_batches"]),
    }
    for key, value in overrides.items():
        if key not in StackConfig.__dataclass_fields__:
            raise StackConfigError(
                f"unknown stack field {key!r}; use one of {sorted(StackConfig.__dataclass_fields__)}"
            )
        fields[key] = tuple(value) if isinstance(value, list) else value
    return StackConfig(**fields)
