"""One iteration through the stack's layers on the stock ops, on fixed step buffers (eager or captured).

An iteration is B decode rows, or a verify iteration of B requests x q tokens: B * q rows in request-major order,
which every op takes as independent rows (AttnRes, the projections, MLA with one decode row per token, the MLPs)
except the KDA core, which takes them as [B, q] (`kda_verify`: the recurrence runs along each request's q tokens).

Every buffer a step touches besides the request state is in a `StepBuffers`: the entry state (what enters the
first layer), the working AttnRes state the AttnRes kernels update in place, and the slot tables. A captured graph
reads and writes only its own buffers, so replaying it after copying a new step's inputs and tables into them is
the step; eager steps use buffers of max_requests rows through row views.

Each stock call sits in a profiler range named `k3.L<layer>.<stock ops joined by +>`, so a profile can attribute
kernels to stock ops (k3_decode.executor.attribution) without the stock package knowing about profiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.executor.inputs import DTYPE, StackInput, entry_blocks
from k3_decode.executor.state import RequestState, StepTables
from k3_decode.reference.decoder import LayerTrace
from k3_decode.stock import AttnResBuffers, PagedLatentCache, StockAttentionOps
from k3_decode.stock.attention_ops import MLA_DECODE_OPS
from k3_decode.stock.moe import StockMoeOps
from k3_decode.weights import DenseMlpWeights, KdaWeights, LayerWeights, MlaWeights, MoeWeights, ResidualWeights

RANGE_PREFIX = "k3.L"
MLA_ATTENTION_OPS = ("mla_qkv_a_g", *MLA_DECODE_OPS, "mla_o_proj")


def range_name(layer: int, ops: Sequence[str]) -> str:
    return f"{RANGE_PREFIX}{layer}.{'+'.join(ops)}"


def parse_range_name(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, stock ops) of a range this module names, None for any other name."""
    if not name.startswith(RANGE_PREFIX):
        return None
    layer, _, ops = name[len(RANGE_PREFIX) :].partition(".")
    if not layer.isdigit() or not ops:
        return None
    return int(layer), tuple(ops.split("+"))


@dataclass
class StepBuffers:
    """The fixed tensors one step runs on: `rows` rows of entry state, AttnRes state and slot tables."""

    name: str
    rows: int
    first_layer: int
    entry_prefix: Tensor  # [rows, hidden]
    entry_blocks: Tensor  # [rows, nb, hidden]
    entry_delta: Tensor | None  # [rows, hidden]; None when the stack starts at layer 0
    work: AttnResBuffers  # prefix [rows, hidden], bank [rows, capacity, hidden]
    kda_slots: Tensor  # [rows] int32
    block_table: Tensor  # [rows, pages] int32
    seq_lens: Tensor  # [rows] int32
    slot_mapping: Tensor  # [rows] int64
    num_accepted: Tensor | None = None  # [rows] int32, the first B used by a verify iteration; None: decode only

    @classmethod
    def allocate(
        cls,
        name: str,
        dims: ModelDims,
        layers: Sequence[int],
        rows: int,
        pages: int,
        device: torch.device,
        verify: bool = False,
    ) -> StepBuffers:
        """`rows`: the most rows an iteration on these buffers runs (B * q for verify); `verify`: keep a table of
        accepted counts (a stack without speculative tokens has none, so its buffers are what they were)."""
        h, first = dims.hidden_size, layers[0]
        nb, capacity = entry_blocks(dims, first), dims.blocks_before(layers[-1])

        def zeros(*shape: int, dtype: torch.dtype = DTYPE) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            name=name,
            rows=rows,
            first_layer=first,
            entry_prefix=zeros(rows, h),
            entry_blocks=zeros(rows, nb, h),
            entry_delta=None if first == 0 else zeros(rows, h),
            work=AttnResBuffers(zeros(rows, h), zeros(rows, capacity, h)),
            kda_slots=zeros(rows, dtype=torch.int32),
            block_table=zeros(rows, pages, dtype=torch.int32),
            seq_lens=zeros(rows, dtype=torch.int32),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
            num_accepted=zeros(rows, dtype=torch.int32) if verify else None,
        )

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of these buffers by field name (the audit registers them as scratch)."""
        out = {
            "entry_prefix": self.entry_prefix,
            "entry_blocks": self.entry_blocks,
            "work_prefix": self.work.prefix,
            "work_blocks": self.work.blocks,
            "kda_slots": self.kda_slots,
            "block_table": self.block_table,
            "seq_lens": self.seq_lens,
            "slot_mapping": self.slot_mapping,
        }
        if self.entry_delta is not None:
            out["entry_delta"] = self.entry_delta
        if self.num_accepted is not None:
            out["num_accepted"] = self.num_accepted
        return out

    def load(self, inputs: StackInput | None, tables: StepTables) -> None:
        """Copy a step's inputs and tables into the first rows; rows past them become NULL padding."""
        n = tables.rows
        if n > self.rows:
            raise ValueError(f"{n} rows do not fit step buffers {self.name} of {self.rows} rows")
        q = tables.tokens_per_request
        live = len(tables.requests) * q
        if inputs is not None:
            if inputs.tokens != live:
                raise ValueError(
                    f"{inputs.tokens} input rows for {len(tables.requests)} live requests of {q} token(s) each; give "
                    f"{q} row(s) per request"
                )
            self.entry_prefix[:live].copy_(inputs.prefix)
            self.entry_blocks[:live].copy_(inputs.blocks)
            if self.entry_delta is not None and inputs.delta is not None:
                self.entry_delta[:live].copy_(inputs.delta)
        for dst, src in (
            (self.kda_slots, tables.kda_slots),
            (self.block_table, tables.block_table),
            (self.seq_lens, tables.seq_lens),
            (self.slot_mapping, tables.slot_mapping),
        ):
            dst[:n].copy_(src)
        self.kda_slots[n:].fill_(0)
        self.seq_lens[n:].fill_(0)
        self.slot_mapping[n:].fill_(-1)
        if tables.num_accepted is not None:
            if self.num_accepted is None:
                raise ValueError(f"step buffers {self.name} hold no accepted counts; allocate them with verify=True")
            self.num_accepted[: tables.num_accepted.shape[0]].copy_(tables.num_accepted)


class RowParallel(Protocol):
    """Where a layer's row-parallel partials become replicated values: after o_proj (feeding the AttnRes after
    attention), in the MoE tail (the latent and shared-expert sums) and after the dense MLP. One rank holding its
    shard alone elides the all-reduces (`ELIDED`); k3_decode.distributed runs them across processes."""

    def attention_out(
        self, ops: StockAttentionOps, work: AttnResBuffers, layer: int, partial: Tensor, residual: ResidualWeights
    ) -> Tensor:
        """The MLP input: AttnRes after attention on the all-reduce of the o_proj `partial`."""
        ...

    def moe_tail(self, moe: StockMoeOps, routed: Tensor, shared: Tensor, weights: MoeWeights) -> Tensor:
        """The MoE output from this rank's routed-latent and shared-expert partials."""
        ...

    def reduce(self, partial: Tensor) -> Tensor:
        """The all-reduce alone (the dense MLP output; per-layer traces of the attention output)."""
        ...


class ElidedRowParallel:
    """One rank's shard on its own: every all-reduce is the identity (the executor's default)."""

    def attention_out(
        self, ops: StockAttentionOps, work: AttnResBuffers, layer: int, partial: Tensor, residual: ResidualWeights
    ) -> Tensor:
        return ops.attn_res_after(work, layer, partial, residual)

    def moe_tail(self, moe: StockMoeOps, routed: Tensor, shared: Tensor, weights: MoeWeights) -> Tensor:
        return moe.latent_tail(routed, shared, weights)

    def reduce(self, partial: Tensor) -> Tensor:
        return partial


ELIDED = ElidedRowParallel()


class LayerRunner:
    """Runs layers of the stack on the stock ops, over the rows of a StepBuffers."""

    def __init__(
        self,
        dims: ModelDims,
        weights: dict[int, LayerWeights],
        state: RequestState,
        attention: StockAttentionOps,
        moe: StockMoeOps,
        k_scale: float,
        q_scale: float,
    ) -> None:
        self.dims, self.weights, self.state = dims, weights, state
        self.attention, self.moe = attention, moe
        self.k_scale, self.q_scale = k_scale, q_scale
        self.ranges = False  # profiler ranges around each stock call (benchmarks turn them on)
        self.on_layer: Callable[[int], None] | None = None  # told which layer runs next (the op log uses it)
        self.row_parallel: RowParallel = ELIDED  # the TP executor (k3_decode.distributed) sets its all-reduces
        self._q = 1  # tokens per request of the iteration running now (forward sets it)

    @contextlib.contextmanager
    def _range(self, layer: int, ops: Sequence[str]) -> Iterator[None]:
        if not self.ranges:
            yield
            return
        with torch.profiler.record_function(range_name(layer, ops)):
            yield

    def forward(
        self,
        buffers: StepBuffers,
        rows: int,
        layers: Sequence[int],
        num_splits: int,
        trace: list | None = None,
        tokens_per_request: int = 1,
    ) -> Tensor:
        """One iteration over `rows` rows: reset the AttnRes state from the entry state, run `layers` in order and
        return the last layer's MLP output [rows, hidden] (BF16). `tokens_per_request` q > 1: a verify iteration of
        rows // q requests, its KDA layers through `kda_verify` with the buffers' accepted counts."""
        if rows % tokens_per_request:
            raise ValueError(f"a verify iteration of {tokens_per_request} tokens per request cannot have {rows} rows")
        first = layers[0]
        nb = entry_blocks(self.dims, first)
        work = AttnResBuffers(buffers.work.prefix[:rows], buffers.work.blocks[:rows], nb)
        work.prefix.copy_(buffers.entry_prefix[:rows])
        if nb:
            work.blocks[:, :nb].copy_(buffers.entry_blocks[:rows])
        delta = None if first == 0 or buffers.entry_delta is None else buffers.entry_delta[:rows]
        self._q = tokens_per_request
        try:
            for layer in layers:
                delta = self.layer(layer, work, delta, buffers, rows, num_splits, trace)
        finally:
            self._q = 1  # a caller driving `layer` directly (a benchmark) runs decode rows
        assert delta is not None  # a stack has at least one layer (StackConfig checks)
        return delta

    def layer(
        self,
        layer: int,
        work: AttnResBuffers,
        delta: Tensor | None,
        buffers: StepBuffers,
        rows: int,
        num_splits: int,
        trace: list | None,
    ) -> Tensor:
        if self.on_layer is not None:
            self.on_layer(layer)
        w = self.weights[layer]
        with self._range(layer, ("attn_res",)):
            x = self.attention.attn_res_before(work, layer, delta, w.residual)
        if isinstance(w.attention, KdaWeights):
            a = self._kda(layer, x, w.attention, buffers, rows)
        else:
            a = self._mla(layer, x, w.attention, buffers, rows, num_splits)
        # A trace records the replicated attention output (the identity on one rank); all ranks trace alike.
        a_full = None if trace is None else self.row_parallel.reduce(a)
        with self._range(layer, ("attn_res",)):
            y = self.row_parallel.attention_out(self.attention, work, layer, a, w.residual)
        ids = None
        if isinstance(w.mlp, MoeWeights):
            out, ids = self._moe(layer, y, w.mlp)
        else:
            assert isinstance(w.mlp, DenseMlpWeights)
            with self._range(layer, ("dense",)):
                out = self.row_parallel.reduce(self.moe.dense(y, w.mlp))
        if trace is not None:
            assert a_full is not None
            trace.append(
                LayerTrace(
                    layer=layer,
                    kind=w.kind,
                    mlp_kind=w.mlp_kind,
                    attn_input=x.detach().clone().unsqueeze(1),
                    attn_output=a_full.detach().clone().unsqueeze(1),
                    mlp_input=y.detach().clone().unsqueeze(1),
                    mlp_output=out.detach().clone().unsqueeze(1),
                    expert_ids=None if ids is None else ids.detach().clone().long().unsqueeze(1),
                )
            )
        return out

    def _kda(self, layer: int, x: Tensor, w: KdaWeights, buffers: StepBuffers, rows: int) -> Tensor:
        cache = self.state.kda[layer]
        with self._range(layer, ("kda_in_proj",)):
            packed = self.attention.kda_in_proj(x, w)
        q = self._q
        if q == 1:
            with self._range(layer, ("kda_f_b", "kda_decode")):
                o = self.attention.kda_decode(packed, w, cache, buffers.kda_slots[:rows])
        else:
            # Views, no copies: row b * q + t of the iteration is token t of request b, so [B * q, ...] is [B, q, ...].
            batch = rows // q
            assert buffers.num_accepted is not None  # StepBuffers.load refuses verify tables without them
            slots = buffers.kda_slots[:rows].view(batch, q)
            with self._range(layer, ("kda_f_b", "kda_verify")):
                o = self.attention.kda_verify(
                    packed.view(batch, q, -1), w, cache, slots, buffers.num_accepted[:batch]
                ).reshape(rows, -1)
        with self._range(layer, ("kda_o_proj",)):
            return self.attention.kda_o_proj(o, w)

    def _mla(self, layer: int, x: Tensor, w: MlaWeights, buffers: StepBuffers, rows: int, num_splits: int) -> Tensor:
        paged = PagedLatentCache(
            cache=self.state.mla[layer],
            block_table=buffers.block_table[:rows],
            seq_lens=buffers.seq_lens[:rows],
            slot_mapping=buffers.slot_mapping[:rows],
            k_scale=self.k_scale,
            q_scale=self.q_scale,
        )
        with self._range(layer, MLA_ATTENTION_OPS):
            return self.attention.mla_attention(x, w, paged, num_splits)

    def _moe(self, layer: int, y: Tensor, w: MoeWeights) -> tuple[Tensor, Tensor]:
        moe = self.moe
        with self._range(layer, ("route",)):
            routing = moe.route(y, w)
        with self._range(layer, ("latent_down",)):
            latent = moe.latent_down(y, w)
        with self._range(layer, ("experts",)):
            routed = moe.experts(latent, routing, w)
        with self._range(layer, ("shared",)):
            shared = moe.shared(y, w)
        with self._range(layer, ("latent_tail",)):
            out = self.row_parallel.moe_tail(moe, routed, shared, w)
        return out, routing.ids
