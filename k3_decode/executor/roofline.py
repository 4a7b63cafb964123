"""Bytes each stock op of a decode step must move through HBM, for the roofline figure of performance honesty.

The count is the least traffic the op's job needs: every weight it uses read once, the states it updates read and
written once, the MLA cache rows it attends to read once, its activations read and written once. An op's roofline
time is these bytes over the copy bandwidth measured in the same run; its roofline fraction is that time over the
measured time. Weights are BF16 except the MXFP4 routed experts (only the experts the batch routes to are read)
and the FP32 KDA gate parameters and router bias, as k3_decode.weights stores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3_decode.config import ModelDims
from k3_decode.reference.attn_res import bank_blocks, blocks_before_attention, blocks_before_mlp, is_block_write
from k3_decode.weights import expert_bytes

BF16, FP32, FP8 = 2, 4, 1


@dataclass(frozen=True)
class StepShape:
    """What the bytes of one layer's ops depend on besides the weights."""

    batch: int  # live rows (padding rows of a graph read no state and no cache)
    seq_lens: tuple[int, ...]  # per live request, the context the MLA core attends to (the new token included)
    num_splits: int = 1  # MLA split-KV partials written and merged
    unique_experts: int | None = None  # distinct routed experts the batch reads in this layer (None: no MoE)

    def __post_init__(self) -> None:
        if self.batch < 1 or len(self.seq_lens) != self.batch:
            raise ValueError(
                f"StepShape needs batch >= 1 and one seq_len per row, got {self.batch} and {self.seq_lens}"
            )


def _gemm(rows: int, cols: int, batch: int) -> int:
    """y [B, rows] = x [B, cols] @ W^T: the BF16 weight once, the input and output once."""
    return BF16 * (rows * cols + batch * (rows + cols))


def _attn_res(dims: ModelDims, batch: int, sources: int, saves: bool, delta: bool) -> int:
    h = dims.hidden_size
    rows = sources + 1 + 1 + int(delta) + int(saves)  # bank + prefix reads, prefix write, delta read, block save
    return BF16 * (batch * h * (rows + 1) + 3 * h)  # + the output row; weights: norm, proj, out norm


def op_bytes(dims: ModelDims, tp: int, layer: int, op: str, shape: StepShape) -> int:
    """Bytes the stock op `op` (a name of attention_ops.toml or moe_ops.toml) moves in `layer` for `shape`."""
    s, h, b = dims.shard(tp), dims.hidden_size, shape.batch
    block = dims.attn_res_block_size
    kda, mla, moe = dims.kda, dims.mla, dims.moe
    if op == "attn_res_before":
        return _attn_res(dims, b, blocks_before_attention(layer, block), is_block_write(layer, block), layer > 0)
    if op == "attn_res_after":
        return _attn_res(dims, b, blocks_before_mlp(layer, block), False, True)
    if op == "attn_res_final":
        return _attn_res(dims, b, bank_blocks(dims.num_layers - 1, block), False, True)
    if op == "kda_in_proj":
        return _gemm(s.kda_in_proj_rows, h, b)
    if op == "kda_f_b":
        return _gemm(s.kda_proj, s.kda_gate_rank, b)
    if op == "kda_decode":
        rec = s.kda_recurrent_state[0] * s.kda_recurrent_state[1] * s.kda_recurrent_state[2] * FP32
        conv = s.kda_conv_state[0] * s.kda_conv_state[1] * BF16
        weights = 3 * s.kda_proj * kda.conv_width * BF16 + (s.kda_heads + s.kda_proj) * FP32 + kda.head_dim * BF16
        acts = b * (s.kda_in_proj_rows + 2 * s.kda_proj) * BF16  # packed row and f_b output in, output out
        return 2 * b * (rec + conv) + weights + acts
    if op == "kda_o_proj":
        return _gemm(h, s.kda_proj, b)
    heads = s.mla_heads
    if op == "mla_qkv_a_g":
        return _gemm(s.mla_qkv_a_g_rows, h, b)
    if op == "mla_qkv_norm":
        return BF16 * (2 * b * (mla.q_lora_rank + mla.kv_lora_rank) + mla.q_lora_rank + mla.kv_lora_rank)
    if op == "mla_q_b":
        return _gemm(heads * mla.qk_head_dim, mla.q_lora_rank, b)
    if op == "mla_w_uk":
        return BF16 * (
            heads * mla.qk_nope_head_dim * mla.kv_lora_rank + b * heads * (mla.qk_nope_head_dim + mla.kv_lora_rank)
        )
    if op == "mla_query_insert":
        reads = b * (heads * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank + mla.qk_rope_head_dim)
        return BF16 * reads + FP8 * b * (heads + 1) * mla.cache_row + 8 * b
    if op == "mla_attention":
        cache = sum(shape.seq_lens) * mla.cache_row * FP8
        partials = b * shape.num_splits * heads * (mla.kv_lora_rank + 1) * FP32
        return cache + b * heads * mla.cache_row * FP8 + 2 * partials + b * heads * mla.kv_lora_rank * BF16
    if op == "mla_w_uv":
        return BF16 * (heads * mla.kv_lora_rank * mla.v_head_dim + b * heads * (mla.kv_lora_rank + mla.v_head_dim))
    if op == "mla_gate":
        return BF16 * 3 * b * heads * mla.v_head_dim
    if op == "mla_o_proj":
        return _gemm(h, heads * mla.v_head_dim, b)
    if op == "route":
        return (
            BF16 * (moe.num_experts * h + b * h)
            + FP32 * (moe.num_experts + 2 * b * moe.num_experts)
            + 8 * b * moe.top_k
        )
    if op == "latent_down":
        return _gemm(moe.latent_size, h, b)
    if op == "experts":
        if shape.unique_experts is None:
            raise ValueError(f"layer {layer}: the experts' bytes need the number of distinct routed experts")
        acts = b * moe.latent_size * BF16 * 2 + b * moe.top_k * (
            2 * s.routed_intermediate * BF16 + moe.latent_size * FP32
        )
        return shape.unique_experts * expert_bytes(s) + acts
    if op == "shared":
        i = s.shared_intermediate
        return BF16 * (3 * i * h + b * (h + 2 * i + i + i + h))
    if op == "latent_tail":
        return BF16 * (h * moe.latent_size + moe.latent_size + b * (moe.latent_size + 2 * h))
    if op == "dense":
        i = s.dense_intermediate
        return BF16 * (3 * i * h + b * (h + 4 * i + h))
    raise ValueError(f"no byte count for stock op {op!r}")


def layer_ops(dims: ModelDims, layer: int) -> tuple[str, ...]:
    """The stock ops of one decode layer in launch order, the two AttnRes applications told apart."""
    if dims.layer_kind(layer) == "kda":
        attention = ("kda_in_proj", "kda_f_b", "kda_decode", "kda_o_proj")
    else:
        attention = (
            "mla_qkv_a_g",
            "mla_qkv_norm",
            "mla_q_b",
            "mla_w_uk",
            "mla_query_insert",
            "mla_attention",
            "mla_w_uv",
            "mla_gate",
            "mla_o_proj",
        )
    mlp = (
        ("dense",) if dims.mlp_kind(layer) == "dense" else ("route", "latent_down", "experts", "shared", "latent_tail")
    )
    return ("attn_res_before", *attention, "attn_res_after", *mlp)


def layer_bytes(dims: ModelDims, tp: int, layer: int, shape: StepShape) -> dict[str, int]:
    """Bytes of every stock op of `layer`, by op name, in launch order."""
    return {op: op_bytes(dims, tp, layer, op, shape) for op in layer_ops(dims, layer)}


def roofline_seconds(nbytes: int, bandwidth: float) -> float:
    """The time `nbytes` take at `bandwidth` bytes per second (the measured copy bandwidth)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return nbytes / bandwidth


def fractions(times: Sequence[float], nbytes: Sequence[int], bandwidth: float) -> list[float]:
    """Roofline fraction of each (time, bytes) pair: roofline time over measured time."""
    return [roofline_seconds(n, bandwidth) / t if t > 0 else float("nan") for t, n in zip(times, nbytes, strict=True)]
