"""The memory plan of a stack: weights, caches, states and scratch per layer, checked against one device.

Weights come from k3_decode.weights.memory_bytes (shapes only, no tensors made), the KDA states and MLA pages from
the stack's request counts, and the activations of the largest captured batch from the op output shapes (an upper
bound: every intermediate counted as live). The device capacity and the runtime reserve are data (memory.toml).
The executor prints the plan before it allocates anything and refuses a stack that does not fit.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

import torch

from k3_decode.config import ModelDims
from k3_decode.executor.config import StackConfig
from k3_decode.stock.mla import MAX_SPLITS
from k3_decode.weights import memory_bytes

_BF16, _FP32 = 2, 4


class MemoryPlanError(ValueError):
    """The stack does not fit the device; the message says by how much and what to shrink."""


@dataclass(frozen=True)
class DeviceBudget:
    name: str
    capacity: int  # bytes the device has
    reserve: int  # bytes set aside for what no tensor accounts for (memory.toml [reserve])

    @classmethod
    def h200(cls) -> DeviceBudget:
        raw = _memory_data()
        return cls(raw["device"]["name"], int(raw["device"]["bytes"]), int(raw["reserve"]["runtime_bytes"]))

    @classmethod
    def current_cuda(cls, device: torch.device) -> DeviceBudget:
        """The CUDA device as it is now: its free memory is the capacity (other tensors already hold the rest)."""
        free, _total = torch.cuda.mem_get_info(device)
        name = f"{torch.cuda.get_device_name(device)} (free now)"
        return cls(name, int(free), int(_memory_data()["reserve"]["runtime_bytes"]))


@cache
def _memory_data() -> dict:
    return tomllib.loads(resources.files(__package__).joinpath("memory.toml").read_text())


@dataclass(frozen=True)
class MemoryLine:
    part: str  # weights, experts, kda_state, mla_cache, scratch, activations, reserve
    layer: int | None
    bytes: int
    note: str


@dataclass(frozen=True)
class MemoryPlan:
    config: StackConfig
    lines: tuple[MemoryLine, ...]
    budget: DeviceBudget

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    def by_part(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self.lines:
            out[line.part] = out.get(line.part, 0) + line.bytes
        return out

    @property
    def fits(self) -> bool:
        return self.total <= self.budget.capacity

    def check(self) -> None:
        """Raise a one-line MemoryPlanError when the stack does not fit the device."""
        if self.fits:
            return
        parts = ", ".join(f"{p} {_gb(b)}" for p, b in sorted(self.by_part().items(), key=lambda kv: -kv[1]))
        raise MemoryPlanError(
            f"{self.config.describe()} needs {_gb(self.total)} ({parts}) but one {self.budget.name} has "
            f"{_gb(self.budget.capacity)}; use fewer layers, a larger TP, fewer requests or a shorter max_context"
        )

    def render(self) -> str:
        """The plan as a text table, one line per layer part, then the totals against the device."""
        rows = [f"memory plan: {self.config.describe()}"]
        rows.append(f"  {'part':<12} {'layer':>5} {'bytes':>12}  note")
        for line in self.lines:
            layer = "-" if line.layer is None else str(line.layer)
            rows.append(f"  {line.part:<12} {layer:>5} {_gb(line.bytes):>12}  {line.note}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        rows.append(f"  total {_gb(self.total)} of {_gb(self.budget.capacity)} ({self.budget.name}): {verdict}")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return {
            "stack": self.config.describe(),
            "lines": [line.__dict__ for line in self.lines],
            "by_part": self.by_part(),
            "total": self.total,
            "device": self.budget.name,
            "capacity": self.budget.capacity,
            "fits": self.fits,
        }


def _gb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def kda_state_bytes(dims: ModelDims, config: StackConfig) -> int:
    """One KDA layer's conv and recurrent states for every slot (slot 0 is the NULL slot): q slots per request, and
    a conv row of W - 2 + q columns, on a speculative stack (state.py)."""
    s = dims.shard(config.tp)
    columns = s.kda_conv_state[1] + config.num_speculative_tokens
    conv = s.kda_conv_state[0] * columns * torch.empty(0, dtype=_dtype(dims.kda.conv_state_dtype)).itemsize
    rec = s.kda_recurrent_state[0] * s.kda_recurrent_state[1] * s.kda_recurrent_state[2]
    rec *= torch.empty(0, dtype=_dtype(dims.kda.recurrent_state_dtype)).itemsize
    return (1 + config.max_requests * config.tokens_per_request) * (conv + rec)


def mla_cache_bytes(dims: ModelDims, config: StackConfig) -> int:
    """One MLA layer's paged FP8 cache: one byte per element of a cache row, every page of every request."""
    return config.max_requests * config.pages_per_request * config.page_size * dims.mla.cache_row


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def activation_bytes_per_token(dims: ModelDims, tp: int, layer: int) -> int:
    """Every intermediate one token's pass through `layer` allocates on the stock path (BF16 unless FP32)."""
    s, h, moe = dims.shard(tp), dims.hidden_size, dims.moe
    total = 2 * h * _BF16  # the two AttnRes outputs
    if dims.layer_kind(layer) == "kda":
        total += (s.kda_in_proj_rows + 2 * s.kda_proj + h) * _BF16  # packed, f_b out, decode out, o_proj out
    else:
        mla = dims.mla
        heads = s.mla_heads
        total += (s.mla_qkv_a_g_rows + mla.q_lora_rank + mla.kv_lora_rank + heads * mla.qk_head_dim) * _BF16
        total += heads * (2 * mla.kv_lora_rank + 2 * mla.v_head_dim) * _BF16  # ql_nope, merged, W_UV out, gated
        total += heads * mla.cache_row  # the FP8 query
        total += MAX_SPLITS * heads * (mla.kv_lora_rank + 1) * _FP32  # split-KV partials and their LSE
        total += h * _BF16
    if dims.mlp_kind(layer) == "dense":
        total += 3 * s.dense_intermediate * _BF16 + h * _BF16
    else:
        total += moe.num_experts * _FP32 + moe.top_k * 2 * _FP32  # logits, ids and weights
        total += 2 * moe.latent_size * _BF16  # latent, routed
        total += moe.top_k * (2 * s.routed_intermediate * _BF16 + moe.latent_size * _FP32)  # FC1 out, FC2 per slot
        total += 3 * s.shared_intermediate * _BF16 + 2 * h * _BF16  # shared gate_up, act; shared and layer out
        total += moe.latent_size * _BF16  # the normed latent
    return total


def plan_memory(config: StackConfig, budget: DeviceBudget | None = None) -> MemoryPlan:
    dims = config.dims
    budget = budget or DeviceBudget.h200()
    lines: list[MemoryLine] = []
    for layer in config.layers:
        kind, mlp = dims.layer_kind(layer), dims.mlp_kind(layer)
        w = memory_bytes(dims, config.tp, kind, mlp)
        lines.append(MemoryLine("weights", layer, w.residual + w.attention + w.mlp, f"{kind} attention + {mlp}"))
        if w.experts:
            lines.append(MemoryLine("experts", layer, w.experts, f"{dims.moe.num_experts} routed experts, MXFP4"))
        if kind == "kda":
            n = kda_state_bytes(dims, config)
            lines.append(
                MemoryLine(
                    "kda_state",
                    layer,
                    n,
                    f"{1 + config.max_requests * config.tokens_per_request} slots (conv + recurrent)",
                )
            )
        else:
            n = mla_cache_bytes(dims, config)
            pages = config.max_requests * config.pages_per_request
            lines.append(MemoryLine("mla_cache", layer, n, f"{pages} FP8 pages of {config.page_size} tokens"))
    h = dims.hidden_size
    capacity = dims.blocks_before(config.layers[-1])
    # The eager scratch plus each graph's static buffers, q rows per request on a speculative stack (verify graphs).
    rows = (config.max_requests + sum(config.graph_batches)) * config.tokens_per_request
    scratch = rows * 2 * (2 * h + capacity * h) * _BF16 + rows * (config.pages_per_request + 4) * 8
    lines.append(MemoryLine("scratch", None, scratch, "AttnRes state, step inputs and slot tables"))
    act = max(config.max_requests, max(config.graph_batches)) * config.tokens_per_request
    act_bytes = act * sum(activation_bytes_per_token(dims, config.tp, i) for i in config.layers)
    lines.append(MemoryLine("activations", None, act_bytes, f"upper bound for a step of {act} rows"))
    lines.append(MemoryLine("reserve", None, budget.reserve, "CUDA context, library workspaces, allocator slack"))
    return MemoryPlan(config, tuple(lines), budget)
