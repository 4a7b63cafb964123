"""Kernels around fla-core's recurrent KDA for a speculative verify step (q = 1..8 tokens per request).

vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/kda.py) verifies off SM100 with a causal-conv update, the Triton
`fused_recurrent_kda` with spec-decoding state indices, and the gated o-norm: three launches after the GEMMs.
Here fla-core 0.6.0's `fused_recurrent_kda_fwd_kernel` is that middle launch. Its continuous-batching mode has
no guard for NULL slots (vLLM's own copy skips negative indices), so it is run with a sanitized read table and
with every token's state going to a per-token scratch; `state_scatter_kernel` then copies each state to its slot
when the slot is real. That copy is the one launch (and the scratch traffic) this baseline adds to vLLM's.

- `verify_conv_kernel`, grid (B, channel blocks): the conv over [taps (from column a-1 of the row in slot[b,0]),
  x_0 .. x_{q-1}], SiLU, q / k / v written BF16 and contiguous ([3, B*q, P], the layout fla reads); then the
  row's first W-2+q columns become the sequence shifted by one. Program (b, 0) also writes the contiguous beta
  logits [B*q, H] and the sanitized tables fla reads (slots clamped at 0, accepted counts clamped to 1..q).
- `state_scatter_kernel`, grid (B*q, heads, chunks): scratch[b*q+t] -> state[slot[b,t]] where slot[b,0] > 0 and
  slot[b,t] > 0.
- `gated_norm_kernel`, grid (B*q, heads): out = RMSNorm(o) * w * sigmoid(g_out), zero for NULL requests.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from k3_decode.stock.triton_kernels import LANE_SYMMETRIC

CONV_BLOCK = 256
SCATTER_BLOCK = 4096


@triton.jit
def _sequence_entry(conv_row, stride_chan, stride_tap, packed_ptr, stride_tok, tok0, chan, cmask, tap_mask, a, idx, W):
    """Entry idx of s = [row columns a-1 .. a+W-3, x_0 .. x_{q-1}] for channels `chan` (idx is static).

    conv_row / stride_*: the request's conv row (read under tap_mask, empty for a NULL request);
    packed_ptr / stride_tok / tok0: its tokens; a: its accepted count.
    """
    if idx < W - 1:
        x = tl.load(conv_row + chan * stride_chan + (a - 1 + idx) * stride_tap, mask=tap_mask, other=0.0)
    else:
        x = tl.load(packed_ptr + (tok0 + idx - (W - 1)) * stride_tok + chan, mask=cmask, other=0.0)
    return x


@triton.jit
def verify_conv_kernel(
    packed_ptr,
    stride_tok,
    conv_ptr,
    stride_conv_slot,
    stride_cc,
    stride_ct,
    conv_w_ptr,
    slots_ptr,
    stride_slots_b,
    stride_slots_t,
    accepted_ptr,
    qkv_ptr,
    beta_ptr,
    safe_slots_ptr,
    safe_accepted_ptr,
    batch,
    proj,
    heads,
    beta_offset,
    Q: tl.constexpr,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    chan = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chan < 3 * proj
    slot0 = tl.load(slots_ptr + b * stride_slots_b).to(tl.int64)
    live = slot0 > 0
    # A [BLOCK_C] mask rather than cmask & live: Triton's CPU interpreter mistypes a broadcast scalar bool.
    tap_mask = cmask & (tl.zeros([BLOCK_C], dtype=tl.int64) + slot0 > 0)
    a = tl.minimum(tl.maximum(tl.load(accepted_ptr + b).to(tl.int64), 1), Q)
    conv_row = conv_ptr + tl.maximum(slot0, 0) * stride_conv_slot
    tok0 = b * Q
    section = chan // proj
    within = chan % proj
    tokens = batch * Q

    for t in tl.static_range(Q):
        y = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(W):
            x = _sequence_entry(
                conv_row, stride_cc, stride_ct, packed_ptr, stride_tok, tok0, chan, cmask, tap_mask, a, t + j, W
            )
            y += tl.load(conv_w_ptr + chan * W + j, mask=cmask, other=0.0).to(tl.float32) * x.to(tl.float32)
        y = tl.where(live, y * tl.sigmoid(y), 0.0)
        dst = qkv_ptr + section * (tokens * proj) + (tok0 + t) * proj + within
        tl.store(dst, y.to(qkv_ptr.dtype.element_ty), mask=cmask)

    # All conv reads of this program are done before its row is rewritten.
    tl.debug_barrier()
    if live:
        for i in tl.static_range(W - 2 + Q):
            x = _sequence_entry(
                conv_row, stride_cc, stride_ct, packed_ptr, stride_tok, tok0, chan, cmask, tap_mask, a, i + 1, W
            )
            tl.store(conv_row + chan * stride_cc + i * stride_ct, x.to(conv_ptr.dtype.element_ty), mask=cmask)

    if cb == 0:
        hh = tl.arange(0, BLOCK_HEADS)
        hmask = hh < heads
        for t in tl.static_range(Q):
            logit = tl.load(packed_ptr + (tok0 + t) * stride_tok + beta_offset + hh, mask=hmask, other=0.0)
            tl.store(beta_ptr + (tok0 + t) * heads + hh, logit.to(beta_ptr.dtype.element_ty), mask=hmask)
            slot = tl.load(slots_ptr + b * stride_slots_b + t * stride_slots_t).to(tl.int64)
            safe = tl.where(live, tl.maximum(slot, 0), 0)
            tl.store(safe_slots_ptr + b * Q + t, safe.to(safe_slots_ptr.dtype.element_ty))
        tl.store(safe_accepted_ptr + b, a.to(safe_accepted_ptr.dtype.element_ty))


@triton.jit
def state_scatter_kernel(
    scratch_ptr,
    stride_scratch_tok,
    stride_scratch_head,
    state_ptr,
    stride_state_slot,
    stride_state_head,
    slots_ptr,
    stride_slots_b,
    stride_slots_t,
    head_elems,
    Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    chunk = tl.program_id(2)
    b = bt // Q
    t = bt % Q
    slot0 = tl.load(slots_ptr + b * stride_slots_b)
    dst = tl.load(slots_ptr + b * stride_slots_b + t * stride_slots_t).to(tl.int64)
    if (slot0 > 0) & (dst > 0):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < head_elems
        x = tl.load(scratch_ptr + bt * stride_scratch_tok + h * stride_scratch_head + offs, mask=mask)
        tl.store(state_ptr + dst * stride_state_slot + h * stride_state_head + offs, x, mask=mask)


@triton.jit
def gated_norm_kernel(
    o_ptr,
    packed_ptr,
    stride_tok,
    slots_ptr,
    stride_slots_b,
    o_norm_ptr,
    out_ptr,
    stride_out,
    gate_offset,
    eps,
    Q: tl.constexpr,
    D: tl.constexpr,
):
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    d = tl.arange(0, D)
    live = tl.load(slots_ptr + (bt // Q) * stride_slots_b) > 0
    o = tl.load(o_ptr + (bt * heads + h) * D + d).to(tl.float32)
    gate = tl.load(packed_ptr + bt * stride_tok + gate_offset + h * D + d).to(tl.float32)
    weight = tl.load(o_norm_ptr + d).to(tl.float32)
    y = o / tl.sqrt(tl.sum(o * o, axis=0) / D + eps) * weight * tl.sigmoid(gate)
    tl.store(out_ptr + bt * stride_out + h * D + d, tl.where(live, y, 0.0).to(out_ptr.dtype.element_ty))


def launch_verify_conv(
    packed: Tensor,
    conv_state: Tensor,
    conv_weight: Tensor,
    slots: Tensor,
    accepted: Tensor,
    qkv: Tensor,
    beta: Tensor,
    safe_slots: Tensor,
    safe_accepted: Tensor,
    *,
    heads: int,
    proj: int,
    beta_offset: int,
) -> None:
    """packed is [B*q, rows] (row stride given), qkv [3, B*q, P], beta [B*q, H], safe_slots [B, q]."""
    batch, q = slots.shape
    grid = (batch, triton.cdiv(3 * proj, CONV_BLOCK))
    verify_conv_kernel[grid](
        packed,
        packed.stride(0),
        conv_state,
        *conv_state.stride(),
        conv_weight,
        slots,
        *slots.stride(),
        accepted,
        qkv,
        beta,
        safe_slots,
        safe_accepted,
        batch,
        proj,
        heads,
        beta_offset,
        Q=q,
        W=conv_weight.shape[1],
        BLOCK_C=CONV_BLOCK,
        BLOCK_HEADS=max(2, triton.next_power_of_2(heads)),
        num_warps=4,
    )


def launch_state_scatter(scratch: Tensor, state: Tensor, slots: Tensor) -> None:
    """scratch [B*q, H, D, D] (each head contiguous) -> state[slot] for real slots of live requests."""
    batch, q = slots.shape
    heads = state.shape[1]
    head_elems = state.shape[2] * state.shape[3]
    grid = (batch * q, heads, triton.cdiv(head_elems, SCATTER_BLOCK))
    state_scatter_kernel[grid](
        scratch,
        scratch.stride(0),
        scratch.stride(1),
        state,
        state.stride(0),
        state.stride(1),
        slots,
        *slots.stride(),
        head_elems,
        Q=q,
        BLOCK=SCATTER_BLOCK,
        num_warps=4,
    )


def launch_gated_norm(
    o: Tensor,
    packed: Tensor,
    slots: Tensor,
    o_norm: Tensor,
    out: Tensor,
    *,
    heads: int,
    head_dim: int,
    gate_offset: int,
    eps: float,
) -> None:
    """o [B*q, H, D] contiguous, packed [B*q, rows], out [B*q, H*D]."""
    batch, q = slots.shape
    gated_norm_kernel[(batch * q, heads)](
        o,
        packed,
        packed.stride(0),
        slots,
        slots.stride(0),
        o_norm,
        out,
        out.stride(0),
        gate_offset,
        eps,
        Q=q,
        D=head_dim,
        num_warps=4,
        **LANE_SYMMETRIC,
    )


FLA_VERSION = "0.6.0"


def launch_fla_recurrent(
    qkv: Tensor,
    fb_out: Tensor,
    beta: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    scratch: Tensor,
    safe_slots: Tensor,
    safe_accepted: Tensor,
    o: Tensor,
    *,
    heads: int,
    head_dim: int,
    lower_bound: float,
) -> None:
    """fla-core's recurrent KDA kernel in continuous-batching spec mode, reading state[safe_slots[b, a-1]] and
    writing the state after token t of request b to scratch[b*q + t] (not in place; see the module docstring).

    fla applies the L2 norms (eps 1e-6 inside the root), sigmoid(beta), and the lower-bounded decay gate
    lower * sigmoid(exp(A_log) * (f_b_out + dt_bias)) itself; the state is read and written [V, K]
    (STATE_V_FIRST), the oracle's S[v, k].
    """
    import fla
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

    if fla.__version__ != FLA_VERSION:
        raise RuntimeError(
            f"the stock KDA verify calls fla-core {FLA_VERSION}'s kernel directly, found fla-core {fla.__version__}; "
            f"install fla-core=={FLA_VERSION}"
        )
    batch, q = safe_slots.shape
    block_v = min(32, head_dim)
    fused_recurrent_kda_fwd_kernel[(triton.cdiv(head_dim, block_v) * batch * heads,)](
        q=qkv[0],
        k=qkv[1],
        v=qkv[2],
        g=fb_out,
        beta=beta,
        A_log=a_log,
        dt_bias=dt_bias,
        o=o,
        h0=state,
        ht=scratch,
        cu_seqlens=None,
        ssm_state_indices=safe_slots,
        num_accepted_tokens=safe_accepted,
        lower_bound=lower_bound,
        scale=head_dim**-0.5,
        N=batch,
        T=q,
        H=heads,
        HV=heads,
        K=head_dim,
        V=head_dim,
        BK=triton.next_power_of_2(head_dim),
        BV=block_v,
        stride_init_state_token=state.stride(0),
        stride_final_state_token=scratch.stride(0),
        stride_indices_seq=q,
        stride_indices_tok=1,
        IS_BETA_HEADWISE=False,
        USE_QK_L2NORM_IN_KERNEL=True,
        INPLACE_FINAL_STATE=False,
        USE_GATE_IN_KERNEL=True,
        APPLY_BETA_SIGMOID=True,
        ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=True,
        num_warps=4,
        num_stages=2,
    )
