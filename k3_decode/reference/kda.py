"""Reference oracle for one Kimi Delta Attention (KDA) decode step at per-rank shapes.

Pure torch, device-agnostic, computed in float64 by default (float32 on request). It covers the part of a
KDA layer between the packed input projection and o_proj (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/kda.py
`KimiK3DeltaAttention`; the fused decode kernels vllm/models/kimi_k3/nvidia/specialized_decode/kda/kernel.py
`KdaSplit` and the stock `ops.fused_kda_decode` compute the same thing in one launch).

Per token, with H heads of width D on this rank and P = H * D:

1. The packed projection row is split into [q | k | v | g_out | f_a | b | pad]
   (`k3_decode.config.RankShapes.in_proj_sections`). Head h owns the channels [h*D, (h+1)*D) of every
   P-wide section.
2. q, k and v (3P channels, in that order) go through a depthwise causal conv of width W (no bias) and
   SiLU. Tap W-1 of the conv weight multiplies the newest input, tap 0 the oldest.
3. q and k are L2-normalized per head with eps inside the square root, x / sqrt(sum(x^2) + eps), so a zero
   vector stays zero instead of turning into NaN; q is then scaled by D^-0.5.
4. beta = sigmoid(b), one per head.
5. The log-decay per channel is g = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a) + dt_bias)), which
   lies in [lower_bound, 0]; f_b is a plain linear map from the f_a rows back to P channels.
6. The per-head state is indexed S[v, k]. The decay acts along k: S <- S diag(exp g); then the delta rule
   u = beta (v - S k), S <- S + u k^T; the readout is o = S q.
7. The output is the per-head RMSNorm of o, times the shared `o_norm` weight [D], times sigmoid(g_out)
   (vLLM 0.33.0 `FusedRMSNormGated` with the sigmoid activation, eps = rms_norm_eps).

State (vLLM 0.33.0, vllm/model_executor/layers/mamba/mamba_utils.py `kda_state_shape`/`kda_state_dtype`):

- conv state [num_slots, 3P, taps] in BF16, with taps = W-1 without speculative decoding and
  W-1+num_spec with it. Shapes here are logical; vLLM's "SD" storage is a transposed view of the same
  tensor and works unchanged, because the oracle reads and writes through indexing only.
- recurrent state [num_slots, H, D (v), D (k)] in FP32.

Numerics: everything is computed in `compute_dtype` from the given values; a state is rounded to its
tensor's dtype whenever it is stored. The recurrent state carried from one token to the next inside a
verify step is rounded the same way, because the kernels carry it in FP32 registers; that also gives a
verify step the same arithmetic as the equivalent chain of decode steps. The readout o = S q uses the
rounded state. The new conv inputs are used as given within the step and rounded only when stored; the
packed projection is BF16 in the model, so that rounding is exact there (tests that chain steps feed
BF16-representable inputs for the same reason).

Slot semantics (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/specialized_decode/runtime/decode.py and
vllm/models/kimi_k3/nvidia/specialized_decode/kda/kernel.py): a slot <= 0 is the NULL block. FULL CUDA
graphs pad whole requests with NULL rows; such a row produces zero output and writes nothing, not even
to slot 0.

Decode (q = 1), slots [B]: conv taps are the first W-1 columns of the row (extra speculative columns
are neither read nor written); the row's first W-1 columns become the last W-2 taps followed by the new
input; the recurrent state is read from and written back to the same slot.

Verify (q <= 8 tokens per request, the range `KdaSplit` handles), slots [B, q], num_accepted [B] (the
count the previous step accepted, 1 <= a <= q; vLLM 0.33.0 "the state is read from slot[b, accepted-1];
token t's state goes to slot[b,t] if > 0; the conv row is rewritten to [c_acc, c_acc+1, x_0...x_{q-1}]").
The request is NULL when slot[b, 0] <= 0. Otherwise:

- recurrent state: read from slot[b, a-1] (which must be > 0); the state after token t is written to
  slot[b, t] when that slot is > 0 and skipped otherwise (token t's output is still computed).
- conv state: the row lives in slot[b, 0]. Call c_0 ... c_{L-1} its columns, L = W-2+q. The previous step
  left its inputs there so that, after accepting a tokens, the W-1 inputs preceding the next token are
  c_{a-1} ... c_{a+W-3}. Those are the taps of x_0. Writing the step's whole input sequence as
  s = [c_{a-1} ... c_{a+W-3}, x_0 ... x_{q-1}] (W-1+q entries), the row's first L columns become s[1:],
  i.e. [c_a ... c_{a+W-3}, x_0 ... x_{q-1}]: for W = 4 exactly vLLM's [c_acc, c_acc+1, x_0...x_{q-1}].
  When the next step reports a' accepted tokens, its taps c'_{a'-1} ... c'_{a'+W-3} = s[a' : a'+W-1]
  are again the W-1 inputs ending with x_{a'-1}, which closes the induction. Columns at or past L are
  left alone.

With q = 1 and a = 1 both rules reduce to the decode rules (L = W-1, read and write slot[b, 0]), so a
decode step equals a one-token verify step that accepted one token; a decode step that follows a verify
step therefore sees the state as if a = 1 had been accepted.

Every step validates its slot tables and raises ValueError when two writes would land on the same
(tensor, slot): kernels run requests in parallel, so such a table has no defined result. Each request only
reads slots inside its own write set, so distinct writes also rule out one request reading what another
writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from k3_decode.config import ModelDims, RankShapes

StateTensor = Literal["conv", "recurrent"]


@dataclass(frozen=True)
class KdaSpec:
    """Everything the oracle needs to know about one KDA layer on one rank."""

    shapes: RankShapes
    head_dim: int
    conv_width: int
    gate_lower_bound: float
    l2_eps: float
    norm_eps: float
    conv_state_dtype: torch.dtype
    recurrent_state_dtype: torch.dtype

    @classmethod
    def for_rank(cls, dims: ModelDims, tp: int) -> KdaSpec:
        kda = dims.kda
        return cls(
            shapes=dims.shard(tp),
            head_dim=kda.head_dim,
            conv_width=kda.conv_width,
            gate_lower_bound=kda.gate_lower_bound,
            l2_eps=kda.l2_eps,
            norm_eps=dims.rms_norm_eps,
            conv_state_dtype=getattr(torch, kda.conv_state_dtype),
            recurrent_state_dtype=getattr(torch, kda.recurrent_state_dtype),
        )

    @property
    def heads(self) -> int:
        return self.shapes.kda_heads

    @property
    def proj(self) -> int:
        return self.shapes.kda_proj

    @property
    def gate_rank(self) -> int:
        return self.shapes.kda_gate_rank

    @property
    def in_proj_rows(self) -> int:
        return self.shapes.kda_in_proj_rows

    @property
    def conv_channels(self) -> int:
        return 3 * self.proj

    @property
    def sections(self) -> dict[str, slice]:
        return self.shapes.in_proj_sections()

    def conv_taps(self, q: int) -> int:
        """Conv state columns a step with q tokens per request reads and rewrites (W-2+q)."""
        return self.conv_width - 2 + q


@dataclass(frozen=True)
class KdaWeights:
    """The per-rank KDA parameters that act between in_proj and o_proj."""

    f_b: Tensor  # [P, gate_rank]
    conv: Tensor  # [3P, W], channels [q | k | v]
    a_log: Tensor  # [H]
    dt_bias: Tensor  # [P]
    o_norm: Tensor  # [D]

    def check(self, spec: KdaSpec) -> None:
        check_weight_shapes(spec, self)


def check_weight_shapes(spec: KdaSpec, weights: object) -> None:
    """Raise naming the first KDA weight (f_b, conv, a_log, dt_bias, o_norm) of `weights` with a wrong shape."""
    expected = {
        "f_b": (spec.proj, spec.gate_rank),
        "conv": (spec.conv_channels, spec.conv_width),
        "a_log": (spec.heads,),
        "dt_bias": (spec.proj,),
        "o_norm": (spec.head_dim,),
    }
    for name, shape in expected.items():
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            raise ValueError(f"KDA weight {name}: shape {got}, expected {shape}")


@dataclass
class KdaCache:
    """The stock KDA state tensors of one layer, mutated in place by the step functions."""

    conv: Tensor  # [num_slots, 3P, taps]
    recurrent: Tensor  # [num_slots, H, D (v), D (k)]

    @classmethod
    def zeros(
        cls, spec: KdaSpec, num_slots: int, num_spec: int = 0, device: torch.device | str | None = None
    ) -> KdaCache:
        return cls(
            conv=torch.zeros(
                num_slots,
                spec.conv_channels,
                spec.conv_width - 1 + num_spec,
                dtype=spec.conv_state_dtype,
                device=device,
            ),
            recurrent=torch.zeros(
                num_slots,
                spec.heads,
                spec.head_dim,
                spec.head_dim,
                dtype=spec.recurrent_state_dtype,
                device=device,
            ),
        )

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    def check(self, spec: KdaSpec, taps: int) -> None:
        if self.conv.dim() != 3 or tuple(self.conv.shape[1:2]) != (spec.conv_channels,):
            raise ValueError(
                f"conv state: shape {tuple(self.conv.shape)}, expected [slots, {spec.conv_channels}, taps]"
            )
        if self.conv.shape[2] < taps:
            raise ValueError(f"conv state has {self.conv.shape[2]} columns; this step needs {taps}")
        want = (self.num_slots, spec.heads, spec.head_dim, spec.head_dim)
        if tuple(self.recurrent.shape) != want:
            raise ValueError(f"recurrent state: shape {tuple(self.recurrent.shape)}, expected {want}")


class StateWrite(NamedTuple):
    """One slot of one state tensor that a step overwrites (fully or, for conv, its first taps)."""

    tensor: StateTensor
    slot: int


# ---------------------------------------------------------------------------------------------------------
# Per-token math. All functions are pure and work on any leading batch dims.


def causal_conv(history: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv of new inputs continuing a tap history.

    history [N, C, W-1] (oldest first), x [N, T, C], weight [C, W]. Returns the pre-activation output
    [N, T, C] and the whole input sequence [N, C, W-1+T] (history then inputs), from which the caller
    takes the taps it stores.
    """
    width = weight.shape[-1]
    seq = torch.cat([history, x.transpose(-1, -2)], dim=-1)
    windows = seq.unfold(-1, width, 1)  # [N, C, T, W]
    return torch.einsum("nctw,cw->ntc", windows, weight), seq


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim; eps inside the root keeps zero vectors at zero."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def decay_log_gate(f_a: Tensor, f_b: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """Per-channel log-decay g in [lower_bound, 0].

    f_a [..., R], f_b [P, R], a_log [H], dt_bias [P]; returns [..., P]. Channel c belongs to head
    c // (P / H), so each head's A = exp(A_log[h]) scales a contiguous block of channels.
    """
    per_head = f_b.shape[0] // a_log.shape[0]
    logit = f_a @ f_b.transpose(0, 1) + dt_bias
    return lower_bound * torch.sigmoid(torch.exp(a_log).repeat_interleave(per_head) * logit)


def delta_rule_update(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One gated delta-rule update of S[v, k]: decay along k, then S + beta (v - S k) k^T.

    state [..., V, K], k [..., K], v [..., V], g [..., K] (log-decay), beta [...].
    """
    decayed = state * torch.exp(g).unsqueeze(-2)
    predicted = (decayed @ k.unsqueeze(-1)).squeeze(-1)  # S k, [..., V]
    u = beta.unsqueeze(-1) * (v - predicted)
    return decayed + u.unsqueeze(-1) * k.unsqueeze(-2)


def state_readout(state: Tensor, q: Tensor) -> Tensor:
    """o = S q for S[..., V, K] and q [..., K]."""
    return (state @ q.unsqueeze(-1)).squeeze(-1)


def gated_rms_norm(o: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (one head), times weight, times sigmoid(gate)."""
    return o * torch.rsqrt(o.square().mean(dim=-1, keepdim=True) + eps) * weight * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------------------
# A run of tokens for a set of live requests.


@dataclass(frozen=True)
class TokenFeatures:
    """What the recurrence consumes, per request and token: [N, T, H, D] (beta: [N, T, H])."""

    q: Tensor  # normalized and scaled by D^-0.5
    k: Tensor  # normalized
    v: Tensor
    g: Tensor  # log-decay along k
    beta: Tensor
    out_gate: Tensor  # logits of the output gate


def token_features(
    spec: KdaSpec,
    weights: KdaWeights,
    packed: Tensor,
    history: Tensor,
) -> tuple[TokenFeatures, Tensor]:
    """Everything before the recurrence for packed rows [N, T, rows] after conv taps history [N, 3P, W-1].

    Returns the features and the conv input sequence [N, 3P, W-1+T]. Runs in packed's dtype.
    """
    n, t = packed.shape[:2]
    sec, dt = spec.sections, packed.dtype
    heads, dim = spec.heads, spec.head_dim

    def per_head(x: Tensor) -> Tensor:
        return x.reshape(n, t, heads, dim)

    qkv = torch.cat([packed[..., sec["q"]], packed[..., sec["k"]], packed[..., sec["v"]]], dim=-1)
    mixed, seq = causal_conv(history, qkv, weights.conv.to(dt))
    q, k, v = (per_head(x) for x in F.silu(mixed).split(spec.proj, dim=-1))
    g = decay_log_gate(
        packed[..., sec["f_a"]],
        weights.f_b.to(dt),
        weights.a_log.to(dt),
        weights.dt_bias.to(dt),
        spec.gate_lower_bound,
    )
    features = TokenFeatures(
        q=l2_normalize(q, spec.l2_eps) * spec.head_dim**-0.5,
        k=l2_normalize(k, spec.l2_eps),
        v=v,
        g=per_head(g),
        beta=torch.sigmoid(packed[..., sec["beta"]]),
        out_gate=per_head(packed[..., sec["g"]]),
    )
    return features, seq


def _round_to(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).to(x.dtype)


def run_tokens(
    spec: KdaSpec,
    weights: KdaWeights,
    features: TokenFeatures,
    state: Tensor,
    state_dtype: torch.dtype,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (output [N, P], state after the token [N, H, D, D]) for each token in turn.

    `state` [N, H, D, D] is the state before the first token; after every update the state is rounded to
    `state_dtype`, the dtype it is stored in, and the readout uses the rounded state.
    """
    n, t = features.q.shape[:2]
    norm_weight = weights.o_norm.to(state.dtype)
    for i in range(t):
        k, v, g, beta = features.k[:, i], features.v[:, i], features.g[:, i], features.beta[:, i]
        state = delta_rule_update(state, k, v, g, beta)
        state = _round_to(state, state_dtype)
        o = state_readout(state, features.q[:, i])
        out = gated_rms_norm(o, norm_weight, features.out_gate[:, i], spec.norm_eps)
        yield out.reshape(n, spec.proj), state


# ---------------------------------------------------------------------------------------------------------
# Slot tables and write sets.


def _int_rows(table: Tensor, dims: int, what: str = "slot table") -> list:
    integer = not (table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool)
    if table.dim() != dims or not integer:
        raise ValueError(f"{what}: expected a {dims}-d integer tensor, got {table.dim()}-d {table.dtype}")
    return table.tolist()


def _distinct(writes: list[StateWrite]) -> frozenset[StateWrite]:
    dup = sorted(w for w, n in Counter(writes).items() if n > 1)
    if dup:
        raise ValueError(f"slot table writes the same state twice: {dup}")
    return frozenset(writes)


def decode_write_set(slots: Tensor) -> frozenset[StateWrite]:
    """(tensor, slot) pairs a decode step with slot table [B] writes; raises on a duplicate."""
    rows = _int_rows(slots, 1)
    return _distinct([StateWrite(name, s) for s in rows if s > 0 for name in ("conv", "recurrent")])


def verify_write_set(slots: Tensor) -> frozenset[StateWrite]:
    """(tensor, slot) pairs a verify step with slot table [B, q] writes; raises on a duplicate.

    It does not depend on the accepted counts: a live request rewrites its conv row in slot[b, 0] and
    stores every token's state whose slot is real.
    """
    writes: list[StateWrite] = []
    for row in _int_rows(slots, 2):
        if row[0] > 0:
            writes.append(StateWrite("conv", row[0]))
            writes.extend(StateWrite("recurrent", s) for s in row if s > 0)
    return _distinct(writes)


def _check_range(rows: list[int], cache: KdaCache) -> None:
    high = [s for s in rows if s >= cache.num_slots]
    if high:
        raise ValueError(f"slots {high} out of range for a cache of {cache.num_slots} slots")


def _check_packed(spec: KdaSpec, packed: Tensor, lead: tuple[int, ...]) -> None:
    want = (*lead, spec.in_proj_rows)
    if tuple(packed.shape) != want:
        raise ValueError(f"packed projection: shape {tuple(packed.shape)}, expected {want}")


# ---------------------------------------------------------------------------------------------------------
# The two steps.


def kda_decode_step(
    spec: KdaSpec,
    weights: KdaWeights,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """One q = 1 decode step: packed [B, rows], slots [B]. Returns the pre-o_proj output [B, P].

    Mutates `cache` in place at exactly `decode_write_set(slots)`; NULL rows (slot <= 0) output zeros.
    """
    weights.check(spec)
    rows = _int_rows(slots, 1)
    _check_packed(spec, packed, (len(rows),))
    cache.check(spec, spec.conv_taps(1))
    _check_range(rows, cache)
    decode_write_set(slots)

    out = torch.zeros(len(rows), spec.proj, dtype=compute_dtype, device=packed.device)
    live = [b for b, s in enumerate(rows) if s > 0]
    if not live:
        return out
    taps = spec.conv_taps(1)
    idx = torch.tensor([rows[b] for b in live], device=cache.conv.device)
    history = cache.conv[idx, :, :taps].to(device=packed.device, dtype=compute_dtype)
    state = cache.recurrent[idx].to(device=packed.device, dtype=compute_dtype)

    features, seq = token_features(spec, weights, packed[live].to(compute_dtype).unsqueeze(1), history)
    ((o, state),) = run_tokens(spec, weights, features, state, cache.recurrent.dtype)
    out[live] = o
    cache.recurrent[idx] = state.to(cache.recurrent)
    cache.conv[idx, :, :taps] = seq[..., 1:].to(cache.conv)
    return out


def kda_verify_step(
    spec: KdaSpec,
    weights: KdaWeights,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    num_accepted: Tensor,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> Tensor:
    """One speculative verify step: packed [B, q, rows], slots [B, q], num_accepted [B] (from the previous
    step, 1..q). Returns the pre-o_proj output [B, q, P].

    Mutates `cache` in place at exactly `verify_write_set(slots)`; see the module docstring for the
    conv row and state slot rules. NULL requests (slot[b, 0] <= 0) output zeros.
    """
    weights.check(spec)
    rows = _int_rows(slots, 2)
    batch, q = slots.shape
    if not 1 <= q <= 8:
        raise ValueError(f"verify takes 1..8 tokens per request, got {q}")
    _check_packed(spec, packed, (batch, q))
    accepted = _int_rows(num_accepted, 1, "num_accepted")
    if len(accepted) != batch:
        raise ValueError(f"num_accepted has {len(accepted)} entries for {batch} requests")
    taps = spec.conv_taps(q)
    cache.check(spec, taps)
    _check_range([s for row in rows for s in row], cache)
    verify_write_set(slots)

    out = torch.zeros(batch, q, spec.proj, dtype=compute_dtype, device=packed.device)
    live = [b for b in range(batch) if rows[b][0] > 0]
    if not live:
        return out
    for b in live:
        a = accepted[b]
        if not 1 <= a <= q:
            raise ValueError(f"request {b}: num_accepted {a} outside 1..{q}")
        if rows[b][a - 1] <= 0:
            raise ValueError(f"request {b}: accepted state slot[{b}, {a - 1}] = {rows[b][a - 1]} is NULL")

    window = spec.conv_width - 1
    conv_idx = torch.tensor([rows[b][0] for b in live], device=cache.conv.device)
    read_idx = torch.tensor([rows[b][accepted[b] - 1] for b in live], device=cache.recurrent.device)
    # Gather everything before the first store: token t may overwrite the slot this request read from.
    windows = [cache.conv[rows[b][0], :, accepted[b] - 1 : accepted[b] - 1 + window] for b in live]
    history = torch.stack(windows).to(device=packed.device, dtype=compute_dtype)
    state = cache.recurrent[read_idx].to(device=packed.device, dtype=compute_dtype)

    features, seq = token_features(spec, weights, packed[live].to(compute_dtype), history)
    for t, (o, state_t) in enumerate(run_tokens(spec, weights, features, state, cache.recurrent.dtype)):
        out[live, t] = o
        stored = [i for i, b in enumerate(live) if rows[b][t] > 0]
        if stored:
            dst = torch.tensor([rows[live[i]][t] for i in stored], device=cache.recurrent.device)
            cache.recurrent[dst] = state_t[stored].to(cache.recurrent)
    cache.conv[conv_idx, :, :taps] = seq[..., 1:].to(cache.conv)
    return out
