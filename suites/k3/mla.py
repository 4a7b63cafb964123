"""Cells for the MLA decode step (q = 1) over the paged FP8 E4M3 latent cache, with split-KV.

One cell: a batch whose first request has the cell's context length, a second one of length 1, a padded request
at the end (seq_len 0, slot -1, as FULL CUDA graphs pad a batch) and the others of lengths drawn inside the
context, so most are not multiples of the page size. Pages are shuffled across requests; every request owns the
pages its length needs plus nothing else, and a spare page (the padded request's table row) belongs to no one.
The shapes depend only on the cell, never on the seed, so the same buffers can be refilled with new values.

Needles: random cache rows give every position about the same score, so over a long context the output would be
the mean of thousands of random rows, near zero, and a kernel skipping a page or a split would go unseen. Each
request with history gets up to three rows at random earlier positions aligned with its own query heads, scored
ln(length) + 4 above the rest: they carry most of the attention, wherever they sit (any page, any split).

The oracle is k3_decode.reference.mla.mla_decode in FP64 with the FP8 query (q_scale) and the BF16 cache row
(kv_row_dtype) of the stock path; it attends without splits, so a split count only reorders the kernel's sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.numerics.cells import Judged, OpCall, OpSpec
from k3_decode.config import ModelDims
from k3_decode.reference import mla as rm
from k3_decode.stock import mla as sm
from suites.k3 import weights

SPEC = OpSpec(
    "mla_decode",
    "bfloat16",
    outputs=("out",),
    inplace=("cache",),
    judged=(Judged("cache", dtype="float8_e4m3fn"),),
)
WEIGHT_NAMES = ("q_a_norm", "kv_a_norm", "q_b", "w_uk", "w_uv")
SPLIT_POLICIES = ("auto", "max")  # the executor's own choice for (batch, context), or the most the kernel takes
K_SCALE = 0.5  # per-tensor FP8 scales as a calibrated checkpoint carries them; values ~1 land mid-range in E4M3
Q_SCALE = 0.25
NEEDLES = 3  # aligned rows per request (fewer when its history is shorter)
NEEDLE_GAP = 4.0  # their score above ln(length): e^4 = 55x the weight of all the other rows together
NEEDLE_PEAK = 4.0  # largest element of a needle row: a normed row's largest, far below E4M3's range


def seq_lens(batch: int, context: int) -> list[int]:
    """Lengths of the cell's requests (the new token included): fixed by (batch, context), not by the seed."""
    g = torch.Generator().manual_seed(batch * 1_000_003 + context)
    lens = torch.randint(1, context + 1, (batch,), generator=g).tolist()
    lens[0] = context
    if batch >= 2:
        lens[1] = 1
    if batch >= 3:
        lens[-1] = 0  # a padded request
    return lens


def num_splits(policy: str, batch: int, heads: int, context: int) -> int:
    if policy == "auto":
        return sm.choose_num_splits(batch, heads, context)
    if policy == "max":
        return sm.MAX_SPLITS  # short requests leave most splits empty: the merge must ignore them
    raise ValueError(f"unknown split policy {policy!r}; use one of {', '.join(SPLIT_POLICIES)}")


@dataclass
class MlaCell:
    dims: ModelDims
    tp: int
    batch: int
    context: int
    splits: str = "auto"
    page_size: int = 64
    scale: float = 1.0  # multiplies the hidden state the projection is taken from
    spec: OpSpec = field(default=SPEC)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.context < 1 or self.page_size < 1:
            raise ValueError(f"MLA cell: context {self.context} and page size {self.page_size} must be >= 1")
        self.heads = self.dims.shard(self.tp).mla_heads
        self.lens = seq_lens(self.batch, self.context)
        self.pages_per = [max(1, math.ceil(n / self.page_size)) for n in self.lens]
        self.num_splits = num_splits(self.splits, self.batch, self.heads, self.context)
        suffix = "" if self.scale == 1.0 else f"/x{self.scale:g}"
        self.id = f"mla_decode/tp{self.tp}/b{self.batch}/ctx{self.context}/p{self.page_size}/s{self.num_splits}{suffix}"
        self.axes = {
            "tp": self.tp,
            "batch": self.batch,
            "context": self.context,
            "page_size": self.page_size,
            "splits": self.splits,
            "num_splits": self.num_splits,
            "scale": self.scale,
        }

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        w = weights.mla(self.dims, self.tp, str(device))
        total = sum(self.pages_per) + 1
        row = self.dims.mla.cache_row
        # Cache rows are generated on the device: at real contexts they are gigabytes.
        dev_gen = torch.Generator(device=device).manual_seed(seed)
        rows = torch.randn(total, self.page_size, row, generator=dev_gen, device=device)
        cache = rm.quantize_e4m3(rows, K_SCALE).view(torch.float8_e4m3fn)
        del rows
        order = torch.randperm(total, generator=g)
        table = torch.full((self.batch, max(self.pages_per)), int(order[-1]), dtype=torch.int32)
        at = 0
        for b, n in enumerate(self.pages_per):
            table[b, :n] = order[at : at + n]
            at += n
        lens = torch.tensor(self.lens, dtype=torch.int32)
        slots = rm.decode_slot_mapping(table, lens, self.page_size)
        hidden = (torch.randn(self.batch, self.dims.hidden_size, generator=g) * self.scale).to(torch.bfloat16)
        projected = torch.nn.functional.linear(hidden.to(device), w.qkv_a_g)  # as the layer computes it
        self._plant_needles(cache, table, projected, w, g)
        tensors = {
            "projected": projected.contiguous(),
            **{k: getattr(w, k).clone() for k in WEIGHT_NAMES},
            "cache": cache,
            "block_table": table.to(device),
            "seq_lens": lens.to(device),
            "slot_mapping": slots.to(device),
        }
        args = {"tp": self.tp, "k_scale": K_SCALE, "q_scale": Q_SCALE, "num_splits": self.num_splits}
        return OpCall(tensors, args)

    def _plant_needles(
        self, cache: torch.Tensor, table: torch.Tensor, projected: torch.Tensor, w: Any, g: torch.Generator
    ) -> None:
        mla_dims = self.dims.mla
        parts = rm.split_qkv_a_g(projected, mla_dims, self.heads)
        ref_w = rm.MlaWeights(**{k: getattr(w, k) for k in WEIGHT_NAMES})
        query = rm.absorbed_query(parts.q_a, ref_w, mla_dims, self.dims.rms_norm_eps).cpu()  # [B, H, row]
        scale = rm.softmax_scale(mla_dims)
        rows = cache.view(torch.uint8).view(-1, mla_dims.cache_row)
        for b, n in enumerate(self.lens):
            if n < 2:
                continue
            direction = query[b].sum(dim=0)
            direction = direction / direction.norm().clamp_min(1e-12)
            weakest = float((query[b] @ direction).min())
            if weakest <= 0:
                continue  # a head pointing away from the others: no row can favour every head; keep it plain
            # Heads that barely agree would ask for a huge row; capped, such a needle just draws less attention.
            size = min((math.log(n) + NEEDLE_GAP) / (scale * weakest), NEEDLE_PEAK / float(direction.abs().max()))
            needle = direction * size
            for pos in torch.randperm(n - 1, generator=g)[: min(NEEDLES, n - 1)].tolist():
                slot = int(table[b, pos // self.page_size]) * self.page_size + pos % self.page_size
                rows[slot] = rm.quantize_e4m3(needle, K_SCALE).to(rows.device)

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        t = call.tensors
        cache = t["cache"].clone()
        out = rm.mla_decode(
            t["projected"],
            rm.MlaWeights(**{k: t[k] for k in WEIGHT_NAMES}),
            self.dims.mla,
            cache,
            t["block_table"],
            t["seq_lens"],
            t["slot_mapping"],
            call.args["k_scale"],
            self.dims.rms_norm_eps,
            q_scale=call.args["q_scale"],
            kv_row_dtype=torch.bfloat16,
            dtype=torch.float64,
        )
        return {"out": out, "cache": cache}

    def unit_size(self, name: str, unit: str) -> int | None:
        """A "head" of the output [B, H * v_head_dim] is one request's v row of one head (the tolerance entry's
        matched_unit: a query byte rounded one E4M3 step apart moves that head's whole row); the cache has none."""
        return self.dims.mla.v_head_dim if (name, unit) == ("out", "head") else None

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        cache = call.tensors["cache"]
        mask = torch.zeros(cache.shape, dtype=torch.bool, device=cache.device)
        slots = call.tensors["slot_mapping"].long()
        mask.view(-1, cache.shape[-1])[slots[slots >= 0]] = True
        return {"cache": mask}


ORACLE_ENTRY_POINTS = (rm.mla_decode, rm.attend, rm.attend_partial, rm.absorbed_query, rm.merge_partials)
