"""Kimi K3 model dimensions (loaded from data files) and the per-rank shard math for tensor parallelism."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Literal

LayerKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class KdaDims:
    num_heads: int
    head_dim: int
    conv_width: int
    gate_lower_bound: float
    gate_rank: int
    l2_eps: float
    conv_state_dtype: str
    recurrent_state_dtype: str

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MlaDims:
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: str
    cache_dtype: str

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row(self) -> int:
        """Width of one latent cache row: the compressed kv plus the stored (unrotated) rope part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeDims:
    num_experts: int
    top_k: int
    num_expert_group: int
    topk_group: int
    router_activation: str
    routed_scaling_factor: float
    routing_denominator_eps: float
    latent_size: int
    latent_norm: bool
    routed_intermediate: int
    num_shared_experts: int
    shared_intermediate: int
    dense_intermediate: int
    situ_beta: float
    situ_linear_beta: float
    expert_weight_format: str
    min_intermediate_per_partition: int


@dataclass(frozen=True)
class ParallelLimits:
    tp_sizes: tuple[int, ...]
    packed_row_alignment: int


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    first_k_dense: int
    full_attn_layers: tuple[int, ...]  # 1-indexed, as in the checkpoint config
    attn_res_block_size: int
    kda: KdaDims
    mla: MlaDims
    moe: MoeDims
    parallel: ParallelLimits

    def __post_init__(self) -> None:
        bad = [i for i in self.full_attn_layers if not 1 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"{self.name}: full_attn_layers {bad} outside 1..{self.num_layers}")
        if self.kda.num_heads * self.kda.head_dim != self.mla.num_heads * self.mla.v_head_dim:
            raise ValueError(f"{self.name}: KDA and MLA must share the attention width (attention.local)")

    def layer_kind(self, layer: int) -> LayerKind:
        """Attention type of the 0-indexed layer."""
        return "mla" if (layer + 1) in self.full_attn_layers else "kda"

    def mlp_kind(self, layer: int) -> MlpKind:
        return "dense" if layer < self.first_k_dense else "moe"

    @cached_property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    @property
    def num_attn_res_blocks(self) -> int:
        """Blocks in the bank after the last layer: ceil(num_layers / block_size)."""
        return -(-self.num_layers // self.attn_res_block_size)

    def is_block_write(self, layer: int) -> bool:
        return layer % self.attn_res_block_size == 0

    def blocks_before(self, layer: int) -> int:
        """Blocks in the bank once `layer` has saved its block: what its pre-MLP mixing reads.

        The pre-attention mixing reads one fewer at a block-write layer (the block just saved equals the prefix).
        """
        return -(-(layer + 1) // self.attn_res_block_size) if layer >= 0 else 0

    def with_layers(self, num_layers: int) -> ModelDims:
        """The same structure with a different depth; MLA keeps every 4th layer and the last one."""
        full = sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})
        return dataclasses.replace(self, num_layers=num_layers, full_attn_layers=tuple(full))

    def shard(self, tp: int) -> RankShapes:
        return RankShapes.for_tp(self, tp)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class ShardError(ValueError):
    """A tensor-parallel size the model cannot be split into."""


@dataclass(frozen=True)
class RankShapes:
    """Weight and state shapes held by one rank at tensor-parallel size `tp` (rows x cols, as stored)."""

    tp: int
    hidden: int
    # KDA
    kda_heads: int
    kda_proj: int  # q, k, v and the output gate each have this many rows per rank
    kda_in_proj_rows: int  # [q | k | v | g | f_a | beta | pad]
    kda_in_proj_unpadded: int
    kda_gate_rank: int
    kda_f_b: tuple[int, int]
    kda_o_proj: tuple[int, int]
    kda_conv_state: tuple[int, int]  # [3 * proj (q, k, v channels), conv_width - 1 taps]
    kda_recurrent_state: tuple[int, int, int]  # [heads, v, k]
    # MLA
    mla_heads: int
    mla_qkv_a_g_rows: int  # [q_a | kv_a (both replicated) | gate (sharded)]
    mla_q_b: tuple[int, int]
    mla_w_uk: tuple[int, int, int]  # [H, nope, kv_lora]
    mla_w_uv: tuple[int, int, int]  # [H, kv_lora, v]
    mla_o_proj: tuple[int, int]
    mla_cache_row: int
    # MoE / MLP
    routed_intermediate: int  # per rank, after the minimum-partition padding
    routed_intermediate_unpadded: int
    expert_w13: tuple[int, int]  # [2 * inter, latent]
    expert_w2: tuple[int, int]  # [latent, inter]
    shared_intermediate: int
    dense_intermediate: int
    router: tuple[int, int]
    latent_down: tuple[int, int]
    latent_up: tuple[int, int]
    lm_head_rows: int

    @classmethod
    def for_tp(cls, dims: ModelDims, tp: int) -> RankShapes:
        if tp not in dims.parallel.tp_sizes:
            raise ShardError(f"{dims.name}: TP={tp} is not supported; choose one of {list(dims.parallel.tp_sizes)}")
        for what, n in (
            ("KDA heads", dims.kda.num_heads),
            ("MLA heads", dims.mla.num_heads),
            ("routed intermediate", dims.moe.routed_intermediate),
            ("shared intermediate", dims.moe.shared_intermediate),
            ("dense intermediate", dims.moe.dense_intermediate),
            ("vocab", dims.vocab_size),
        ):
            if n % tp:
                raise ShardError(f"{dims.name}: TP={tp} does not divide the {n} {what}")
        kda, mla, moe = dims.kda, dims.mla, dims.moe
        heads = kda.num_heads // tp
        proj = kda.proj_size // tp
        unpadded = 4 * proj + kda.gate_rank + heads
        inter_raw = moe.routed_intermediate // tp
        inter = max(inter_raw, moe.min_intermediate_per_partition)
        mla_h = mla.num_heads // tp
        return cls(
            tp=tp,
            hidden=dims.hidden_size,
            kda_heads=heads,
            kda_proj=proj,
            kda_in_proj_rows=_round_up(unpadded, dims.parallel.packed_row_alignment),
            kda_in_proj_unpadded=unpadded,
            kda_gate_rank=kda.gate_rank,
            kda_f_b=(proj, kda.gate_rank),
            kda_o_proj=(dims.hidden_size, proj),
            kda_conv_state=(3 * proj, kda.conv_width - 1),
            kda_recurrent_state=(heads, kda.head_dim, kda.head_dim),
            mla_heads=mla_h,
            mla_qkv_a_g_rows=mla.q_lora_rank + mla.cache_row + mla_h * mla.v_head_dim,
            mla_q_b=(mla_h * mla.qk_head_dim, mla.q_lora_rank),
            mla_w_uk=(mla_h, mla.qk_nope_head_dim, mla.kv_lora_rank),
            mla_w_uv=(mla_h, mla.kv_lora_rank, mla.v_head_dim),
            mla_o_proj=(dims.hidden_size, mla_h * mla.v_head_dim),
            mla_cache_row=mla.cache_row,
            routed_intermediate=inter,
            routed_intermediate_unpadded=inter_raw,
            expert_w13=(2 * inter, moe.latent_size),
            expert_w2=(moe.latent_size, inter),
            shared_intermediate=moe.shared_intermediate // tp,
            dense_intermediate=moe.dense_intermediate // tp,
            router=(moe.num_experts, dims.hidden_size),
            latent_down=(moe.latent_size, dims.hidden_size),
            latent_up=(dims.hidden_size, moe.latent_size),
            lm_head_rows=dims.vocab_size // tp,
        )

    def in_proj_sections(self) -> dict[str, slice]:
        """Row ranges of the packed KDA input projection."""
        p, off = self.kda_proj, 0
        out: dict[str, slice] = {}
        for name, n in (
            ("q", p),
            ("k", p),
            ("v", p),
            ("g", p),
            ("f_a", self.kda_gate_rank),
            ("beta", self.kda_heads),
        ):
            out[name] = slice(off, off + n)
            off += n
        out["pad"] = slice(off, self.kda_in_proj_rows)
        return out


def _from_table(raw: dict) -> ModelDims:
    try:
        return ModelDims(
            name=raw["name"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_layers"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw["rms_norm_eps"],
            first_k_dense=raw["first_k_dense"],
            full_attn_layers=tuple(raw["full_attn_layers"]),
            attn_res_block_size=raw["attn_res_block_size"],
            kda=KdaDims(**raw["kda"]),
            mla=MlaDims(**raw["mla"]),
            moe=MoeDims(**raw["moe"]),
            parallel=ParallelLimits(
                tp_sizes=tuple(raw["parallel"]["tp_sizes"]),
                packed_row_alignment=raw["parallel"]["packed_row_alignment"],
            ),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"model dims file {raw.get('name', '?')}: missing or unknown key: {exc}") from exc


MODEL_NAMES = ("k3", "k3-mini")


def load_dims(name_or_path: str | Path = "k3") -> ModelDims:
    """Load `k3`, `k3-mini`, or a TOML file with the same keys."""
    if str(name_or_path) in MODEL_NAMES:
        text = resources.files("k3_decode.data").joinpath(f"{name_or_path}.toml").read_text()
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown model {name_or_path!r}: use one of {list(MODEL_NAMES)} or a TOML file path")
        text = path.read_text()
    return _from_table(tomllib.loads(text))


K3 = load_dims("k3")
K3_MINI = load_dims("k3-mini")
