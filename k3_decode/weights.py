"""Seeded synthetic Kimi K3 weights, produced one decoder layer and one tensor-parallel rank at a time.

Why synthetic: the real checkpoint is well over a terabyte; kernels, oracles and the gate need weights with the
real per-rank shapes (k3_decode.config.RankShapes) and realistic magnitudes, and any single layer must be
producible alone so a few real-size layers fit on one GPU.

Seeding scheme (counter-based, no torch RNG state)
    Every logical tensor - the full TP=1 weight, viewed as 2-D [rows, cols] - has a 64-bit stream key
    K = blake2b("{seed}|{layer}|{name}|{expert}"). Element (i, j) is a pure function of (K, i, j):
        r_i = mix32(mix32(i + K_lo) ^ K_hi)        one hash per row
        h   = mix32(r_i + j * 0x9E3779B1)            one hash per element (all arithmetic mod 2^32)
    where mix32 is an xorshift-multiply finalizer. Three 10-bit fields of h are summed (Irwin-Hall, a bounded
    near-normal with range +-3 sigma) for normal draws; the top 24 bits give uniform draws.
    A rank never generates the logical tensor: it maps each of its local rows and columns to a logical coordinate
    (or to padding, which is zero) and evaluates only those elements. So a rank-r shard equals the slice of the
    TP=1 tensor by construction, at every TP size, and a real-size K3 TP8 layer costs only its own elements.
    The rank is deliberately not part of the key (that would break the TP=1 consistency); it only selects
    coordinates, so replicated tensors are identical on every rank and sharded ones differ.
    Routed experts are keyed per expert. Their MXFP4 blocks run along the input dim, which the w2 shard splits:
    a rank quantizes the whole 32-wide logical blocks that overlap its columns and keeps its own codes with the
    logical block's scale, exactly what a loader slicing a TP=1 MXFP4 checkpoint would hold.
    Only integer ops plus one float32 multiply (and add, for a mean) per element are used, with constants
    pre-rounded to float32, so CPU (a numpy path) and any torch device (an int64 torch path) give bit-identical
    weights; checked on an H200 against the CPU for k3-mini layers and real-size K3 TP8 attention and experts.

Magnitudes: projections ~ N(0, 1/fan_in) with fan_in the logical (TP=1) input width, so unit-RMS inputs give
unit-RMS outputs layer after layer; norm weights ~ 1 +- 0.1; the KDA decay parameters spread the log-decay
g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) over (lower_bound, 0); router bias ~ 0.01.
Weights the model stores in BF16 are rounded to BF16 and then held in `dtype`, so a float32 copy carries the same
numbers. The router correction bias is FP32 in the model (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/model.py);
A_log and dt_bias are held in FP32 too, the precision the KDA gate math runs in.

Layouts (rows x cols as stored, per rank)
    KDA in_proj  [q | k | v | g | f_a (replicated) | beta | zero pad], RankShapes.in_proj_sections()
    KDA conv     [q | k | v channels, conv_width], the channel order of the KDA conv state
    MLA qkv_a_g  [q_a | kv_a (both replicated) | gate (sharded)]
    MLA w_uk     [H, nope, kv_lora] and w_uv [H, kv_lora, v], the absorbed halves of one logical kv_b
                 [H * (nope + v), kv_lora] (per head: nope rows, then v rows)
    gate_up, w13 [gate | up], each half this rank's slice, zero-padded to the per-rank intermediate
    w13 / w2     MXFP4 (k3_decode.reference.mxfp): w13 [E, 2I, latent], w2 [E, latent, I], blocks along the last
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
import torch

from k3_decode.config import LayerKind, MlpKind, ModelDims, RankShapes
from k3_decode.reference.mxfp import BLOCK, MxTensor, pack_fp4, quantize_mxfp4, unpack_fp4

# --- counter-based draws ------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
# Multipliers below 2^31 keep x * C under 2^63 for 32-bit x, so the int64 torch path never overflows.
_C1 = 0x7FEB352D
_C2 = 0x31848BAB
_GOLDEN = 0x9E3779B1
_FIELD = 1023  # three 10-bit fields per hash
_IH_SPAN = 3 * _FIELD  # 2 * S - _IH_SPAN is centred, odd, in [-3069, 3069]
_IH_SD = math.sqrt((_FIELD + 1) ** 2 - 1)  # sd of 2 * S for S the sum of three uniform 10-bit fields


@dataclass(frozen=True)
class Normal:
    """Irwin-Hall(3) draw with this mean and standard deviation (bounded at +-3 sd)."""

    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class Uniform:
    lo: float
    hi: float


Init = Normal | Uniform


def stream_key(seed: int, layer: int, name: str, expert: int = -1) -> tuple[int, int]:
    """The (lo, hi) 32-bit halves of a logical tensor's 64-bit key."""
    digest = hashlib.blake2b(f"{seed}|{layer}|{name}|{expert}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _f32(x: float) -> float:
    # Constants pre-rounded to float32 make every backend's multiply a single float32 rounding.
    return float(np.float32(x))


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """mix32 on int64 values in [0, 2^32), in place."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x


def _mix32_numpy(x: np.ndarray) -> np.ndarray:
    """mix32 on uint32 (multiplication wraps mod 2^32 by definition), in place."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_C1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_C2)
    x ^= x >> np.uint32(16)
    return x


def _row_hash(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """r_i for int64 keys [R, 2] and logical rows [R] (>= 0), as int64 in [0, 2^32)."""
    r = (rows + keys[:, 0]).bitwise_and_(_M32)
    _mix32_torch(r).bitwise_xor_(keys[:, 1])
    return _mix32_torch(r)


def _values_torch(h: torch.Tensor, init: Init) -> torch.Tensor:
    _mix32_torch(h)
    if isinstance(init, Uniform):
        u = (h >> 8).to(torch.float32).mul_(2.0**-24)
        return u.mul_(_f32(init.hi - init.lo)).add_(_f32(init.lo))
    s = h & _FIELD
    s += (h >> 10) & _FIELD
    s += (h >> 20) & _FIELD
    v = s.mul_(2).sub_(_IH_SPAN).to(torch.float32).mul_(_f32(init.std / _IH_SD))
    return v.add_(_f32(init.mean)) if init.mean else v


def _values_numpy(h: np.ndarray, init: Init) -> np.ndarray:
    _mix32_numpy(h)
    if isinstance(init, Uniform):
        u = (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
        return u * np.float32(init.hi - init.lo) + np.float32(init.lo)
    f = np.uint32(_FIELD)
    s = (h & f) + ((h >> np.uint32(10)) & f) + ((h >> np.uint32(20)) & f)
    v = (s.astype(np.int32) * 2 - _IH_SPAN).astype(np.float32) * np.float32(init.std / _IH_SD)
    return v + np.float32(init.mean) if init.mean else v


def draw(
    keys: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    init: Init,
    device: torch.device | str = "cpu",
    backend: Literal["auto", "numpy", "torch"] = "auto",
    chunk: int | None = None,
) -> torch.Tensor:
    """Float32 [R, C] of the elements at logical (rows[i], cols[j]); a negative index is padding (zero).

    keys: int64 [R, 2], the stream key of each row (rows of several experts can share one call).
    backend: "numpy" (CPU only, the fast path there), "torch" (any device) or "auto".
    """
    device = torch.device(device)
    if backend == "auto":
        backend = "numpy" if device.type == "cpu" else "torch"
    if backend not in ("numpy", "torch"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'numpy' or 'torch'")
    if backend == "numpy" and device.type != "cpu":
        raise ValueError("the numpy backend draws on the CPU only")
    keys, rows, cols = (t.to(torch.int64) for t in (keys, rows, cols))
    row_ok, col_ok = rows >= 0, cols >= 0
    row_h = _row_hash(keys.cpu(), rows.clamp(min=0).cpu())
    col_t = (cols.clamp(min=0).cpu() * _GOLDEN).bitwise_and_(_M32)
    n_rows, n_cols = len(rows), len(cols)
    if chunk is None:
        chunk = 1 << 20 if device.type == "cpu" else 1 << 26
    step = max(1, chunk // max(1, n_cols))
    out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=device)
    if backend == "numpy":
        row_np, col_np = row_h.numpy().astype(np.uint32), col_t.numpy().astype(np.uint32)
        for r0 in range(0, n_rows, step):
            h = row_np[r0 : r0 + step, None] + col_np[None, :]
            out[r0 : r0 + step] = torch.from_numpy(_values_numpy(h, init))
    else:
        row_d, col_d = row_h.to(device), col_t.to(device)
        for r0 in range(0, n_rows, step):
            h = (row_d[r0 : r0 + step, None] + col_d[None, :]).bitwise_and_(_M32)
            out[r0 : r0 + step] = _values_torch(h, init)
    if not bool(row_ok.all()):
        out[~row_ok.to(device)] = 0.0
    if not bool(col_ok.all()):
        out[:, ~col_ok.to(device)] = 0.0
    return out


# --- weight containers --------------------------------------------------------------------------------------------


@dataclass
class AttnResWeights:
    """AttnRes mixing: per-source logit = s . (norm * proj) / rms(s)."""

    norm: torch.Tensor  # [hidden]
    proj: torch.Tensor  # [1, hidden]


@dataclass
class ResidualWeights:
    attn_res: AttnResWeights
    mlp_res: AttnResWeights
    input_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]


@dataclass
class KdaWeights:
    in_proj: torch.Tensor  # [kda_in_proj_rows, hidden]
    f_b: torch.Tensor  # [proj, gate_rank]
    conv: torch.Tensor  # [3 * proj, conv_width]
    a_log: torch.Tensor  # [heads] FP32
    dt_bias: torch.Tensor  # [proj] FP32
    o_norm: torch.Tensor  # [head_dim]
    o_proj: torch.Tensor  # [hidden, proj]


@dataclass
class MlaWeights:
    qkv_a_g: torch.Tensor  # [q_lora + cache_row + heads * v, hidden]
    q_a_norm: torch.Tensor  # [q_lora]
    kv_a_norm: torch.Tensor  # [kv_lora]
    q_b: torch.Tensor  # [heads * qk_head, q_lora]
    w_uk: torch.Tensor  # [heads, nope, kv_lora]
    w_uv: torch.Tensor  # [heads, kv_lora, v]
    o_proj: torch.Tensor  # [hidden, heads * v]


@dataclass
class DenseMlpWeights:
    gate_up: torch.Tensor  # [2 * inter, hidden]
    down: torch.Tensor  # [hidden, inter]


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden]
    router_bias: torch.Tensor  # [experts] FP32 e_score_correction_bias
    latent_down: torch.Tensor  # [latent, hidden]
    latent_norm: torch.Tensor  # [latent]
    latent_up: torch.Tensor  # [hidden, latent]
    w13: MxTensor  # MXFP4 [n, 2 * inter, latent]
    w2: MxTensor  # MXFP4 [n, latent, inter]
    shared: DenseMlpWeights
    expert_ids: tuple[int, ...]  # which experts w13 / w2 hold, in order


@dataclass
class LayerWeights:
    layer: int
    kind: LayerKind
    mlp_kind: MlpKind
    residual: ResidualWeights
    attention: KdaWeights | MlaWeights
    mlp: DenseMlpWeights | MoeWeights

    def tensors(self) -> dict[str, torch.Tensor]:
        return named_tensors(self)


@dataclass
class ModelWeights:
    embedding: torch.Tensor  # [vocab / tp, hidden]
    final_res: AttnResWeights
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab / tp, hidden]

    def tensors(self) -> dict[str, torch.Tensor]:
        return named_tensors(self)


def named_tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a weight container, by dotted name (MXFP4 tensors as .data and .scales)."""
    return dict(_walk(obj, prefix))


def _walk(obj: object, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, MxTensor):
        yield f"{prefix}.data", obj.data
        yield f"{prefix}.scales", obj.scales
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)


# --- generation ---------------------------------------------------------------------------------------------------


def _ar(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def _pad(n: int) -> torch.Tensor:
    return torch.full((n,), -1, dtype=torch.int64)


def _std(fan_in: int) -> Normal:
    return Normal(1.0 / math.sqrt(fan_in))


NORM = Normal(0.1, 1.0)
ROUTER_BIAS = Normal(0.01)
# exp(A_log) in [0.5, 2] and dt_bias in [-2, 1] put the sigmoid argument for unit-normal f_b outputs over roughly
# (-6, 6), so the log-decay covers most of (lower_bound, 0) instead of clustering at one end.
A_LOG = Uniform(math.log(0.5), math.log(2.0))
DT_BIAS = Uniform(-2.0, 1.0)
EMBED = Normal(1.0)


@dataclass(frozen=True)
class SyntheticWeights:
    """Weights of one TP rank of a model with `dims`; every method is deterministic in (seed, layer, name)."""

    dims: ModelDims
    tp: int
    rank: int
    seed: int = 0
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    expert_batch_elems: int | None = None  # bounds the float32 staging of routed experts (None: by device)

    def __post_init__(self) -> None:
        self.dims.shard(self.tp)  # raises ShardError for an unsupported TP size
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is outside 0..{self.tp - 1} for TP={self.tp}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {self.dtype}")

    @cached_property
    def shapes(self) -> RankShapes:
        return self.dims.shard(self.tp)

    @cached_property
    def logical(self) -> RankShapes:
        """Shapes of the full (TP=1) tensors that every shard is a slice of."""
        return self.dims.shard(1)

    # -- one tensor -----------------------------------------------------------------------------------------------

    def _draw(
        self, layer: int, name: str, rows: torch.Tensor, cols: torch.Tensor, init: Init, fp32: bool = False
    ) -> torch.Tensor:
        key = torch.tensor(stream_key(self.seed, layer, name), dtype=torch.int64).expand(len(rows), 2)
        values = draw(key, rows, cols, init, self.device)
        return values if fp32 else values.to(torch.bfloat16).to(self.dtype)

    def _vector(self, layer: int, name: str, rows: torch.Tensor, init: Init, fp32: bool = False) -> torch.Tensor:
        return self._draw(layer, name, rows, _ar(0, 1), init, fp32)[:, 0].contiguous()

    def _sharded(self, start: int, local: int) -> torch.Tensor:
        """Logical indices of this rank's `local`-long slice of a section that starts at `start`."""
        return _ar(start + self.rank * local, local)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.dims.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.dims.num_layers - 1} of {self.dims.name}")

    # -- residual stream ------------------------------------------------------------------------------------------

    def _attn_res(self, layer: int, name: str) -> AttnResWeights:
        h = self.dims.hidden_size
        return AttnResWeights(
            norm=self._vector(layer, f"{name}.norm", _ar(0, h), NORM),
            proj=self._draw(layer, f"{name}.proj", _ar(0, 1), _ar(0, h), _std(h)),
        )

    def residual(self, layer: int) -> ResidualWeights:
        self._check_layer(layer)
        h = self.dims.hidden_size
        return ResidualWeights(
            attn_res=self._attn_res(layer, "attn_res"),
            mlp_res=self._attn_res(layer, "mlp_res"),
            input_norm=self._vector(layer, "input_norm", _ar(0, h), NORM),
            post_attn_norm=self._vector(layer, "post_attn_norm", _ar(0, h), NORM),
        )

    # -- attention ------------------------------------------------------------------------------------------------

    def attention(self, layer: int) -> KdaWeights | MlaWeights:
        self._check_layer(layer)
        return self._kda(layer) if self.dims.layer_kind(layer) == "kda" else self._mla(layer)

    def kda_in_proj_rows(self) -> torch.Tensor:
        """Logical in_proj row of every local in_proj row (-1 for the zero pad)."""
        s, full = self.shapes, self.logical.in_proj_sections()
        parts = [self._sharded(full[n].start, s.kda_proj) for n in ("q", "k", "v", "g")]
        parts.append(_ar(full["f_a"].start, s.kda_gate_rank))  # f_a is replicated
        parts.append(self._sharded(full["beta"].start, s.kda_heads))
        local = s.in_proj_sections()["pad"]
        parts.append(_pad(local.stop - local.start))
        return torch.cat(parts)

    def _kda(self, layer: int) -> KdaWeights:
        s, kda, h = self.shapes, self.dims.kda, self.dims.hidden_size
        full_proj = kda.proj_size
        channels = torch.cat([self._sharded(c * full_proj, s.kda_proj) for c in range(3)])
        return KdaWeights(
            in_proj=self._draw(layer, "kda.in_proj", self.kda_in_proj_rows(), _ar(0, h), _std(h)),
            f_b=self._draw(layer, "kda.f_b", self._sharded(0, s.kda_proj), _ar(0, kda.gate_rank), _std(kda.gate_rank)),
            conv=self._draw(layer, "kda.conv", channels, _ar(0, kda.conv_width), _std(kda.conv_width)),
            a_log=self._vector(layer, "kda.a_log", self._sharded(0, s.kda_heads), A_LOG, fp32=True),
            dt_bias=self._vector(layer, "kda.dt_bias", self._sharded(0, s.kda_proj), DT_BIAS, fp32=True),
            o_norm=self._vector(layer, "kda.o_norm", _ar(0, kda.head_dim), NORM),
            o_proj=self._draw(layer, "kda.o_proj", _ar(0, h), self._sharded(0, s.kda_proj), _std(full_proj)),
        )

    def _mla(self, layer: int) -> MlaWeights:
        s, mla, h = self.shapes, self.dims.mla, self.dims.hidden_size
        heads, width = s.mla_heads, s.mla_heads * mla.v_head_dim
        replicated = mla.q_lora_rank + mla.cache_row
        qkv_rows = torch.cat([_ar(0, replicated), self._sharded(replicated, width)])
        local_heads = self._sharded(0, heads)
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        uk_rows = (local_heads[:, None] * per_head + _ar(0, mla.qk_nope_head_dim)).flatten()
        uv_rows = (local_heads[:, None] * per_head + _ar(mla.qk_nope_head_dim, mla.v_head_dim)).flatten()
        kv = _ar(0, mla.kv_lora_rank)
        kv_b = _std(mla.kv_lora_rank)
        uv = self._draw(layer, "mla.kv_b", uv_rows, kv, kv_b).view(heads, mla.v_head_dim, mla.kv_lora_rank)
        q_b_rows = self._sharded(0, heads * mla.qk_head_dim)
        return MlaWeights(
            qkv_a_g=self._draw(layer, "mla.qkv_a_g", qkv_rows, _ar(0, h), _std(h)),
            q_a_norm=self._vector(layer, "mla.q_a_norm", _ar(0, mla.q_lora_rank), NORM),
            kv_a_norm=self._vector(layer, "mla.kv_a_norm", kv, NORM),
            q_b=self._draw(layer, "mla.q_b", q_b_rows, _ar(0, mla.q_lora_rank), _std(mla.q_lora_rank)),
            w_uk=self._draw(layer, "mla.kv_b", uk_rows, kv, kv_b).view(heads, mla.qk_nope_head_dim, -1),
            w_uv=uv.transpose(1, 2).contiguous(),
            o_proj=self._draw(
                layer, "mla.o_proj", _ar(0, h), self._sharded(0, width), _std(mla.num_heads * mla.v_head_dim)
            ),
        )

    # -- feed-forward ---------------------------------------------------------------------------------------------

    def mlp(self, layer: int, experts: Sequence[int] | None = None) -> DenseMlpWeights | MoeWeights:
        """The layer's MLP; `experts` picks a subset of routed experts (default all), e.g. to test at real size."""
        self._check_layer(layer)
        if self.dims.mlp_kind(layer) == "dense":
            full = self.dims.moe.dense_intermediate
            return self._gated(layer, "dense", full, self.shapes.dense_intermediate)
        return self._moe(layer, experts)

    def _gated(self, layer: int, name: str, full: int, local: int) -> DenseMlpWeights:
        """A SiTU-gated MLP, column-parallel gate/up halves and row-parallel down."""
        h = self.dims.hidden_size
        rows = torch.cat([self._sharded(0, local), self._sharded(full, local)])
        return DenseMlpWeights(
            gate_up=self._draw(layer, f"{name}.gate_up", rows, _ar(0, h), _std(h)),
            down=self._draw(layer, f"{name}.down", _ar(0, h), self._sharded(0, local), _std(full)),
        )

    def _moe(self, layer: int, experts: Sequence[int] | None) -> MoeWeights:
        moe, h, lat = self.dims.moe, self.dims.hidden_size, self.dims.moe.latent_size
        ids = self._expert_ids(experts)
        w13, w2 = self.experts(layer, ids)
        return MoeWeights(
            router=self._draw(layer, "moe.router", _ar(0, moe.num_experts), _ar(0, h), _std(h)),
            router_bias=self._vector(layer, "moe.router_bias", _ar(0, moe.num_experts), ROUTER_BIAS, fp32=True),
            latent_down=self._draw(layer, "moe.latent_down", _ar(0, lat), _ar(0, h), _std(h)),
            latent_norm=self._vector(layer, "moe.latent_norm", _ar(0, lat), NORM),
            latent_up=self._draw(layer, "moe.latent_up", _ar(0, h), _ar(0, lat), _std(lat)),
            w13=w13,
            w2=w2,
            shared=self._gated(layer, "moe.shared", moe.shared_intermediate, self.shapes.shared_intermediate),
            expert_ids=ids,
        )

    def _expert_ids(self, experts: Sequence[int] | None) -> tuple[int, ...]:
        n = self.dims.moe.num_experts
        ids = tuple(range(n)) if experts is None else tuple(int(e) for e in experts)
        bad = [e for e in ids if not 0 <= e < n]
        if bad:
            raise ValueError(f"expert ids {bad} are outside 0..{n - 1}")
        return ids

    def experts(self, layer: int, experts: Sequence[int] | None = None) -> tuple[MxTensor, MxTensor]:
        """Only the routed experts (w13, w2) of a MoE layer, all or the listed ids in that order."""
        self._check_layer(layer)
        if self.dims.mlp_kind(layer) != "moe":
            raise ValueError(f"layer {layer} of {self.dims.name} has a dense MLP, not routed experts")
        ids = self._expert_ids(experts)
        s, moe = self.shapes, self.dims.moe
        real, padded, full, lat = (
            s.routed_intermediate_unpadded,
            s.routed_intermediate,
            moe.routed_intermediate,
            moe.latent_size,
        )
        for what, n in (("latent size", lat), ("per-rank expert intermediate", padded), ("expert intermediate", full)):
            if n % BLOCK:
                raise ValueError(f"{self.dims.name}: MXFP4 experts need the {what} ({n}) to be a multiple of {BLOCK}")
        w13_rows = torch.cat(
            [self._sharded(0, real), _pad(padded - real), self._sharded(full, real), _pad(padded - real)]
        )
        plan = _W2Plan.for_rank(self.rank * real, real, padded, self.dims.name)
        n, dev = len(ids), self.device
        w13 = MxTensor(
            "mxfp4",
            torch.empty(n, 2 * padded, lat // 2, dtype=torch.uint8, device=dev),
            torch.empty(n, 2 * padded, lat // BLOCK, dtype=torch.uint8, device=dev),
        )
        w2 = MxTensor(
            "mxfp4",
            torch.empty(n, lat, padded // 2, dtype=torch.uint8, device=dev),
            torch.empty(n, lat, padded // BLOCK, dtype=torch.uint8, device=dev),
        )
        budget = self.expert_batch_elems or (1 << 22 if torch.device(dev).type == "cpu" else 1 << 26)
        per_batch = max(1, budget // (2 * padded * lat))
        for b0 in range(0, n, per_batch):
            batch = ids[b0 : b0 + per_batch]
            out = slice(b0, b0 + len(batch))
            q13 = self._quantized(layer, "moe.experts.w13", batch, w13_rows, _ar(0, lat), _std(lat))
            w13.data[out], w13.scales[out] = q13.data, q13.scales
            q2 = self._quantized(layer, "moe.experts.w2", batch, _ar(0, lat), plan.logical_cols, _std(full))
            w2.data[out], w2.scales[out] = plan.localize(q2)
        return w13, w2

    def _quantized(
        self, layer: int, name: str, ids: Sequence[int], rows: torch.Tensor, cols: torch.Tensor, init: Init
    ) -> MxTensor:
        """MXFP4 of the BF16-rounded [len(ids), rows, cols] expert weights, keyed per expert."""
        keys = torch.tensor([stream_key(self.seed, layer, name, e) for e in ids], dtype=torch.int64)
        values = draw(keys.repeat_interleave(len(rows), 0), rows.repeat(len(ids)), cols, init, self.device)
        return quantize_mxfp4(values.to(torch.bfloat16).view(len(ids), len(rows), len(cols)))

    # -- whole layer and model ------------------------------------------------------------------------------------

    def layer(self, layer: int, experts: Sequence[int] | None = None) -> LayerWeights:
        return LayerWeights(
            layer=layer,
            kind=self.dims.layer_kind(layer),
            mlp_kind=self.dims.mlp_kind(layer),
            residual=self.residual(layer),
            attention=self.attention(layer),
            mlp=self.mlp(layer, experts),
        )

    def model(self) -> ModelWeights:
        """Embedding, final AttnRes, final norm and lm_head (vocab-parallel rows), keyed as layer -1."""
        h, vocab = self.dims.hidden_size, self.shapes.lm_head_rows
        return ModelWeights(
            embedding=self._draw(-1, "embedding", self._sharded(0, vocab), _ar(0, h), EMBED),
            final_res=self._attn_res(-1, "final_res"),
            final_norm=self._vector(-1, "final_norm", _ar(0, h), NORM),
            lm_head=self._draw(-1, "lm_head", self._sharded(0, vocab), _ar(0, h), _std(h)),
        )


@dataclass(frozen=True)
class _W2Plan:
    """Where a rank's w2 input columns [start, start + real) sit in the logical MXFP4 block grid."""

    first_block: int
    n_blocks: int
    start: int
    real: int
    padded: int
    scale_map: tuple[int, ...]  # logical block (relative to first_block) of each local block, -1 = all padding

    @classmethod
    def for_rank(cls, start: int, real: int, padded: int, model: str) -> _W2Plan:
        first, end = start // BLOCK, -(-(start + real) // BLOCK)
        scale_map = []
        for j in range(padded // BLOCK):
            lo, hi = j * BLOCK, min((j + 1) * BLOCK, real) - 1
            if lo >= real:
                scale_map.append(-1)
                continue
            a, b = (start + lo) // BLOCK, (start + hi) // BLOCK
            if a != b:
                raise ValueError(f"{model}: a w2 shard block would mix two MXFP4 scale blocks of the TP=1 weight")
            scale_map.append(a - first)
        return cls(first, end - first, start, real, padded, tuple(scale_map))

    @property
    def logical_cols(self) -> torch.Tensor:
        return _ar(self.first_block * BLOCK, self.n_blocks * BLOCK)

    def localize(self, q: MxTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut the rank's codes out of whole logical blocks, zero-pad them, and give each block its scale."""
        codes = unpack_fp4(q.data)
        offset = self.start - self.first_block * BLOCK
        local = torch.zeros(*codes.shape[:-1], self.padded, dtype=torch.uint8, device=codes.device)
        local[..., : self.real] = codes[..., offset : offset + self.real]
        index = torch.tensor(self.scale_map, dtype=torch.int64, device=codes.device)
        scales = q.scales[..., index.clamp(min=0)]
        scales = torch.where(index >= 0, scales, torch.zeros_like(scales))
        return pack_fp4(local), scales


# --- memory accounting --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightBytes:
    """Bytes one rank holds for one layer, by part."""

    residual: int  # AttnRes weights and the two layer norms
    attention: int
    mlp: int  # dense MLP, or MoE router, latent projections and shared experts
    experts: int  # routed experts (MXFP4 data + scales); 0 for a dense layer

    @property
    def total(self) -> int:
        return self.residual + self.attention + self.mlp + self.experts


def expert_bytes(shapes: RankShapes) -> int:
    """One routed expert on one rank: MXFP4 w13 and w2, half a byte per element plus a byte per 32."""
    elems = shapes.expert_w13[0] * shapes.expert_w13[1] + shapes.expert_w2[0] * shapes.expert_w2[1]
    return elems // 2 + elems // BLOCK


def memory_bytes(
    dims: ModelDims,
    tp: int,
    layer_kind: LayerKind,
    mlp_kind: MlpKind = "moe",
    dtype: torch.dtype = torch.bfloat16,
) -> WeightBytes:
    """Weight bytes per rank of one layer, computed from the shapes alone (no tensors are made).

    `dtype` is what the BF16 weights are held in (SyntheticWeights.dtype); FP32 parameters stay 4 bytes.
    """
    s, h = dims.shard(tp), dims.hidden_size
    w, f32 = torch.empty(0, dtype=dtype).element_size(), 4
    residual = 6 * h * w  # attn/mlp AttnRes norm + proj, input and post-attention norms
    if layer_kind == "kda":
        kda = dims.kda
        attention = (
            w * (s.kda_in_proj_rows * h + _prod(s.kda_f_b) + 3 * s.kda_proj * kda.conv_width)
            + w * (kda.head_dim + _prod(s.kda_o_proj))
            + f32 * (s.kda_heads + s.kda_proj)
        )
    elif layer_kind == "mla":
        mla = dims.mla
        attention = w * (
            s.mla_qkv_a_g_rows * h
            + mla.q_lora_rank
            + mla.kv_lora_rank
            + _prod(s.mla_q_b)
            + _prod(s.mla_w_uk)
            + _prod(s.mla_w_uv)
            + _prod(s.mla_o_proj)
        )
    else:
        raise ValueError(f"unknown layer kind {layer_kind!r}")
    if mlp_kind == "dense":
        return WeightBytes(residual, attention, w * 3 * s.dense_intermediate * h, 0)
    if mlp_kind != "moe":
        raise ValueError(f"unknown MLP kind {mlp_kind!r}")
    moe = dims.moe
    non_expert = (
        w * (_prod(s.router) + _prod(s.latent_down) + moe.latent_size + _prod(s.latent_up))
        + f32 * moe.num_experts
        + w * 3 * s.shared_intermediate * h
    )
    return WeightBytes(residual, attention, non_expert, moe.num_experts * expert_bytes(s))


def model_memory_bytes(dims: ModelDims, tp: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes per rank of the model-level weights: embedding and lm_head shards, final AttnRes and norm."""
    s, h = dims.shard(tp), dims.hidden_size
    w = torch.empty(0, dtype=dtype).element_size()
    return w * (2 * s.lm_head_rows * h + 3 * h)


def _prod(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
