"""Stock KDA attention core: the decode step (q = 1) and the speculative verify step (q = 1..8).

Semantics, argument types and slot rules are those of the oracle (k3_decode.reference.kda: KdaSpec, KdaCache,
slot tables, NULL slots <= 0 never written and zero output, verify reading slot[b, a-1] and rewriting the conv
row in slot[b, 0]). The weights are k3_decode.weights.KdaWeights (any object with f_b, conv, a_log, dt_bias and
o_norm works). Outputs are BF16, the pre-o_proj activation.

Launches on CUDA:
- decode: the f_b GEMM (cuBLAS, on the f_a columns of the packed rows) + one fused Triton kernel
  (triton_kernels.kda_decode), as vLLM 0.33.0 runs f_b_proj + the native fused_kda_decode on an H200.
- verify: the f_b GEMM + conv update (Triton) + fla-core 0.6.0's fused recurrent KDA kernel + a state scatter
  + the gated o-norm (triton_kernels.kda_verify, which says why the scatter exists).
On the CPU ("torch-cpu") the same steps run as torch ops with the same BF16 rounding points: none inside the
decode kernel; the conv output (q, k, v) and the recurrence output o are BF16 in the verify pipeline.

State dtypes: BF16 conv state and FP32 recurrent state (vLLM's defaults, and what the specialized path requires);
anything else raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3_decode.reference.kda import KdaCache, KdaSpec, check_weight_shapes, decode_write_set, verify_write_set
from k3_decode.stock import gemm
from k3_decode.stock.dispatch import Implementation, implementation_for
from k3_decode.weights import KdaWeights

OUT_DTYPE = torch.bfloat16
MAX_VERIFY_TOKENS = 8


# ---------------------------------------------------------------------------------------------------------
# Checks. Shapes and dtypes are host metadata and always checked; slot contents need a device sync, so they are
# checked only when `validate` is on and no CUDA graph is being captured.


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_common(spec: KdaSpec, weights: KdaWeights, cache: KdaCache, taps: int) -> None:
    check_weight_shapes(spec, weights)
    cache.check(spec, taps)
    if cache.conv.dtype != torch.bfloat16 or cache.recurrent.dtype != torch.float32:
        raise ValueError(
            f"stock KDA needs a BF16 conv state and an FP32 recurrent state, got {cache.conv.dtype} / "
            f"{cache.recurrent.dtype}; allocate the cache with KdaCache.zeros for a K3 KdaSpec"
        )
    if spec.head_dim & (spec.head_dim - 1):
        raise ValueError(f"stock KDA kernels need a power-of-two head_dim, got {spec.head_dim}")


def _check_packed(spec: KdaSpec, weights: KdaWeights, packed: Tensor, lead: tuple[int, ...]) -> None:
    want = (*lead, spec.in_proj_rows)
    if tuple(packed.shape) != want:
        raise ValueError(f"packed projection: shape {tuple(packed.shape)}, expected {want}")
    if packed.dtype != weights.f_b.dtype:
        raise ValueError(f"packed projection is {packed.dtype} but f_b is {weights.f_b.dtype}; use the in_proj output")
    if packed.stride(-1) != 1:
        raise ValueError("packed projection must have a unit last stride (a row slice of the in_proj output)")


def _check_slot_range(slots: Tensor, cache: KdaCache) -> None:
    high = int(slots.max()) if slots.numel() else -1
    if high >= cache.num_slots:
        raise ValueError(f"slot {high} out of range for a cache of {cache.num_slots} slots")


def _should_validate(validate: bool) -> bool:
    return validate and not _capturing()


# ---------------------------------------------------------------------------------------------------------
# Decode (q = 1).


def kda_decode_step(
    spec: KdaSpec,
    weights: KdaWeights,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    *,
    implementation: Implementation | None = None,
    validate: bool = True,
) -> Tensor:
    """packed [B, rows] (the in_proj output), slots [B]. Returns BF16 [B, P]; mutates `cache` at the live slots."""
    if slots.dim() != 1:
        raise ValueError(f"decode slots must be [B], got {tuple(slots.shape)}; use kda_verify_step for [B, q]")
    _check_common(spec, weights, cache, spec.conv_taps(1))
    _check_packed(spec, weights, packed, (slots.shape[0],))
    if _should_validate(validate):
        decode_write_set(slots.cpu())  # raises on a 2-d, float or duplicate table
        _check_slot_range(slots, cache)
    fb_out = gemm.linear(packed[:, spec.sections["f_a"]], weights.f_b)
    impl = implementation or implementation_for(packed.device)
    if impl == "triton":
        return _decode_triton(spec, weights, packed, fb_out, cache, slots)
    return _decode_torch(spec, weights, packed, fb_out, cache, slots)


def _decode_triton(
    spec: KdaSpec, weights: KdaWeights, packed: Tensor, fb_out: Tensor, cache: KdaCache, slots: Tensor
) -> Tensor:
    from k3_decode.stock.triton_kernels.kda_decode import launch_kda_decode

    out = torch.empty(packed.shape[0], spec.proj, dtype=OUT_DTYPE, device=packed.device)
    launch_kda_decode(
        packed,
        fb_out,
        cache.conv,
        weights.conv.contiguous(),
        weights.a_log,
        weights.dt_bias,
        weights.o_norm,
        cache.recurrent,
        slots,
        out,
        heads=spec.heads,
        head_dim=spec.head_dim,
        beta_offset=spec.sections["beta"].start,
        lower_bound=spec.gate_lower_bound,
        l2_eps=spec.l2_eps,
        norm_eps=spec.norm_eps,
    )
    return out


def _l2(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _decay(spec: KdaSpec, weights: KdaWeights, fb_out: Tensor) -> Tensor:
    """Per-channel log-decay [..., H, D] from the f_b GEMM output [..., P]."""
    a = torch.exp(weights.a_log.float()).repeat_interleave(spec.head_dim)
    g = spec.gate_lower_bound * torch.sigmoid(a * (fb_out.float() + weights.dt_bias.float()))
    return g.unflatten(-1, (spec.heads, spec.head_dim))


def _gated_norm(spec: KdaSpec, weights: KdaWeights, o: Tensor, gate: Tensor) -> Tensor:
    o = o.float()
    gate = gate.float().unflatten(-1, (spec.heads, spec.head_dim))
    y = o * torch.rsqrt(o.square().mean(dim=-1, keepdim=True) + spec.norm_eps)
    return (y * weights.o_norm.float() * torch.sigmoid(gate)).flatten(-2)


def _decode_torch(
    spec: KdaSpec, weights: KdaWeights, packed: Tensor, fb_out: Tensor, cache: KdaCache, slots: Tensor
) -> Tensor:
    out = torch.zeros(packed.shape[0], spec.proj, dtype=OUT_DTYPE, device=packed.device)
    live = slots > 0
    if not bool(live.any()):
        return out
    idx = slots[live].long()
    sec, taps = spec.sections, spec.conv_taps(1)
    x = packed[live].float()
    new_in = x[:, : spec.conv_channels]
    history = cache.conv[idx, :, :taps].float()
    w = weights.conv.float()
    act = F.silu((history * w[:, :taps]).sum(dim=-1) + w[:, taps] * new_in)
    q, k, v = (t.unflatten(-1, (spec.heads, spec.head_dim)) for t in act.split(spec.proj, dim=-1))
    q = _l2(q, spec.l2_eps) * spec.head_dim**-0.5
    k = _l2(k, spec.l2_eps)
    beta = torch.sigmoid(x[:, sec["beta"]])
    g = _decay(spec, weights, fb_out[live])

    state = cache.recurrent[idx].float() * torch.exp(g).unsqueeze(-2)
    u = beta.unsqueeze(-1) * (v - (state @ k.unsqueeze(-1)).squeeze(-1))
    state = state + u.unsqueeze(-1) * k.unsqueeze(-2)
    o = (state @ q.unsqueeze(-1)).squeeze(-1)
    out[live] = _gated_norm(spec, weights, o, x[:, sec["g"]]).to(OUT_DTYPE)
    cache.recurrent[idx] = state.to(cache.recurrent.dtype)
    cache.conv[idx, :, :taps] = torch.cat([history[..., 1:], new_in.unsqueeze(-1)], dim=-1).to(cache.conv.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# Verify (q = 1..8 tokens per request).


def _validate_verify(slots: Tensor, num_accepted: Tensor, cache: KdaCache) -> None:
    verify_write_set(slots.cpu())  # raises on a malformed or duplicate table
    _check_slot_range(slots, cache)
    rows, accepted = slots.cpu().tolist(), num_accepted.cpu().tolist()
    q = slots.shape[1]
    for b, (row, a) in enumerate(zip(rows, accepted, strict=True)):
        if row[0] <= 0:
            continue
        if not 1 <= a <= q:
            raise ValueError(f"request {b}: num_accepted {a} outside 1..{q}")
        if row[a - 1] <= 0:
            raise ValueError(f"request {b}: accepted state slot[{b}, {a - 1}] = {row[a - 1]} is NULL")


def kda_verify_step(
    spec: KdaSpec,
    weights: KdaWeights,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    num_accepted: Tensor,
    *,
    implementation: Implementation | None = None,
    validate: bool = True,
) -> Tensor:
    """packed [B, q, rows], slots [B, q], num_accepted [B] (1..q). Returns BF16 [B, q, P]; mutates `cache`."""
    if slots.dim() != 2 or not 1 <= slots.shape[1] <= MAX_VERIFY_TOKENS:
        raise ValueError(f"verify slots must be [B, q] with q in 1..{MAX_VERIFY_TOKENS}, got {tuple(slots.shape)}")
    batch, q = slots.shape
    if tuple(num_accepted.shape) != (batch,):
        raise ValueError(f"num_accepted has shape {tuple(num_accepted.shape)}, expected ({batch},)")
    _check_common(spec, weights, cache, spec.conv_taps(q))
    _check_packed(spec, weights, packed, (batch, q))
    if packed.stride(0) != q * packed.stride(1):
        raise ValueError("packed projection [B, q, rows] must have its tokens evenly strided (a view of [B*q, rows])")
    if _should_validate(validate):
        _validate_verify(slots, num_accepted, cache)
    tokens = packed.view(batch * q, packed.shape[2]) if packed.is_contiguous() else packed.flatten(0, 1)
    fb_out = gemm.linear(tokens[:, spec.sections["f_a"]], weights.f_b)
    impl = implementation or implementation_for(packed.device)
    if impl == "triton":
        out = _verify_triton(spec, weights, tokens, fb_out, cache, slots, num_accepted)
    else:
        out = _verify_torch(spec, weights, tokens, fb_out, cache, slots, num_accepted)
    return out.view(batch, q, spec.proj)


def _verify_triton(
    spec: KdaSpec,
    weights: KdaWeights,
    tokens: Tensor,
    fb_out: Tensor,
    cache: KdaCache,
    slots: Tensor,
    num_accepted: Tensor,
) -> Tensor:
    from k3_decode.stock.triton_kernels import kda_verify as kv

    if spec.l2_eps != 1e-6:
        raise ValueError(f"fla-core's recurrent KDA hard-codes the L2 eps 1e-6; this spec has {spec.l2_eps}")
    batch, q = slots.shape
    n, dev = batch * q, tokens.device
    qkv = torch.empty(3, n, spec.proj, dtype=OUT_DTYPE, device=dev)
    beta = torch.empty(n, spec.heads, dtype=tokens.dtype, device=dev)
    safe_slots = torch.empty(batch, q, dtype=torch.int32, device=dev)
    safe_accepted = torch.empty(batch, dtype=torch.int32, device=dev)
    kv.launch_verify_conv(
        tokens,
        cache.conv,
        weights.conv.contiguous(),
        slots,
        num_accepted,
        qkv,
        beta,
        safe_slots,
        safe_accepted,
        heads=spec.heads,
        proj=spec.proj,
        beta_offset=spec.sections["beta"].start,
    )
    scratch = torch.empty(n, spec.heads, spec.head_dim, spec.head_dim, dtype=torch.float32, device=dev)
    o = torch.empty(n, spec.heads, spec.head_dim, dtype=OUT_DTYPE, device=dev)
    kv.launch_fla_recurrent(
        qkv,
        fb_out,
        beta,
        weights.a_log,
        weights.dt_bias,
        cache.recurrent,
        scratch,
        safe_slots,
        safe_accepted,
        o,
        heads=spec.heads,
        head_dim=spec.head_dim,
        lower_bound=spec.gate_lower_bound,
    )
    kv.launch_state_scatter(scratch, cache.recurrent, slots)
    out = torch.empty(n, spec.proj, dtype=OUT_DTYPE, device=dev)
    kv.launch_gated_norm(
        o,
        tokens,
        slots,
        weights.o_norm,
        out,
        heads=spec.heads,
        head_dim=spec.head_dim,
        gate_offset=spec.sections["g"].start,
        eps=spec.norm_eps,
    )
    return out


def _verify_torch(
    spec: KdaSpec,
    weights: KdaWeights,
    tokens: Tensor,
    fb_out: Tensor,
    cache: KdaCache,
    slots: Tensor,
    num_accepted: Tensor,
) -> Tensor:
    batch, q = slots.shape
    out = torch.zeros(batch, q, spec.proj, dtype=OUT_DTYPE, device=tokens.device)
    live = slots[:, 0] > 0
    if not bool(live.any()):
        return out.flatten(0, 1)
    sec, width = spec.sections, spec.conv_width
    x = tokens.view(batch, q, -1)[live].float()
    slot_rows = slots[live].long()
    a = num_accepted[live].long().clamp(1, q)
    n = slot_rows.shape[0]

    # Conv over [taps (row columns a-1 .. a+W-3), x_0 .. x_{q-1}]; output rounded to BF16 as the kernel stores it.
    rows = cache.conv[slot_rows[:, 0]]
    cols = (a - 1).unsqueeze(-1) + torch.arange(width - 1, device=a.device)
    taps = rows.gather(2, cols.unsqueeze(1).expand(n, spec.conv_channels, width - 1)).float()
    seq = torch.cat([taps, x[..., : spec.conv_channels].transpose(1, 2)], dim=-1)
    conv = torch.einsum("nctw,cw->ntc", seq.unfold(-1, width, 1), weights.conv.float())
    act = F.silu(conv).to(OUT_DTYPE).float()
    q_, k_, v_ = (t.unflatten(-1, (spec.heads, spec.head_dim)) for t in act.split(spec.proj, dim=-1))
    q_ = _l2(q_, spec.l2_eps) * spec.head_dim**-0.5
    k_ = _l2(k_, spec.l2_eps)
    beta = torch.sigmoid(x[..., sec["beta"]])
    g = _decay(spec, weights, fb_out.view(batch, q, -1)[live])

    state = cache.recurrent[slot_rows.gather(1, (a - 1).unsqueeze(-1)).squeeze(-1)].float()
    for t in range(q):
        state = state * torch.exp(g[:, t]).unsqueeze(-2)
        u = beta[:, t].unsqueeze(-1) * (v_[:, t] - (state @ k_[:, t].unsqueeze(-1)).squeeze(-1))
        state = state + u.unsqueeze(-1) * k_[:, t].unsqueeze(-2)
        o = (state @ q_[:, t].unsqueeze(-1)).squeeze(-1).to(OUT_DTYPE)  # fla writes o in BF16
        y = _gated_norm(spec, weights, o, x[:, t, sec["g"]])
        out[live.nonzero().squeeze(-1), t] = y.to(OUT_DTYPE)
        real = slot_rows[:, t] > 0
        cache.recurrent[slot_rows[real, t]] = state[real].to(cache.recurrent.dtype)
    keep = spec.conv_taps(q)
    cache.conv[slot_rows[:, 0], :, :keep] = seq[..., 1:].to(cache.conv.dtype)
    return out.flatten(0, 1)
