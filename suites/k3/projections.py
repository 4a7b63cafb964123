"""Cells for the KDA layer's two projections: the packed input projection, and o_proj with the AttnRes after
attention that consumes its output.

The specialized path replaces both with CuTe DSL kernels (k3_decode/kernels/kda_in_proj.py, kda_o_proj.py), so
the numerics suite judges them as it judges every replaced op: against an FP64 oracle, with the hygiene probes.
- `kda_in_proj`: packed [B, rows] = x [B, hidden] @ W^T, one rank's in_proj shard, BF16 out.
- `kda_o_proj`: attn_out [B, hidden] = o [B, P] @ W_o^T (this rank's partial, BF16), then the AttnRes after the
  attention of a block-write layer (the prefix restarts at attn_out) or of the plain layer after it (the prefix
  adds it), returning attn_out and the MLP input and updating the prefix in place. The fused kernel computes both
  in one launch; the stock path is cuBLAS, then the AttnRes kernel. The oracle rounds its exact product to BF16
  before the AttnRes (the op's contract: attn_out is BF16, and the AttnRes reads that BF16 tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.numerics.cells import Judged, OpCall, OpSpec
from k3_decode.config import ModelDims
from suites.k3 import attn_res, weights

IN_PROJ = OpSpec("kda_in_proj", "bfloat16", outputs=("packed",))
O_PROJ = OpSpec(
    "kda_o_proj",
    "bfloat16",
    outputs=("attn_out", "out"),
    inplace=("prefix", "blocks"),
    judged=(Judged("attn_out", tolerance="kda_o_proj.attn_out"),),
)
# The AttnRes sites o_proj feeds: after the attention of the last block-write layer (a restart) and of the plain
# layer after it (an add); suites/k3/attn_res.py says which layers those are.
O_PROJ_SITES = ("after-write", "after-plain")


def _bf16_rows(g: torch.Generator, rows: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.randn(rows, width, generator=g).to(device, torch.bfloat16)


def _exact_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a.double() @ w.double().t()


@dataclass
class InProjCell:
    dims: ModelDims
    tp: int
    batch: int
    spec: OpSpec = field(default=IN_PROJ)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = f"kda_in_proj/tp{self.tp}/b{self.batch}"
        self.axes = {"tp": self.tp, "batch": self.batch}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        x = _bf16_rows(g, self.batch, self.dims.hidden_size, device)  # an AttnRes output: RMS-normed, O(1)
        return OpCall(
            {"x": x, "in_proj": weights.kda(self.dims, self.tp, str(device)).in_proj.clone()}, {"tp": self.tp}
        )

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        return {"packed": _exact_product(call.tensors["x"], call.tensors["in_proj"])}

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        return {}


@dataclass
class OProjCell:
    dims: ModelDims
    tp: int
    batch: int
    site: str
    spec: OpSpec = field(default=O_PROJ)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.site not in O_PROJ_SITES:
            raise ValueError(f"o_proj feeds the AttnRes after attention; use a site of {', '.join(O_PROJ_SITES)}")
        self.attn = attn_res.AttnResCell(self.dims, self.batch, self.site)  # the AttnRes half: state and weights
        self.id = f"kda_o_proj/tp{self.tp}/b{self.batch}/{self.site}"
        self.axes = {"tp": self.tp, "batch": self.batch, "site": self.site, "layer": self.attn.layer}

    def make(self, seed: int, device: torch.device) -> OpCall:
        call = self.attn.make(seed, device)
        del call.tensors["delta"]  # o_proj computes it
        g = torch.Generator().manual_seed(seed + 1)
        w = weights.kda(self.dims, self.tp, str(device)).o_proj
        call.tensors |= {"o": _bf16_rows(g, self.batch, w.shape[1], device), "o_proj": w.clone()}
        call.args["tp"] = self.tp
        return call

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        attn_out = _exact_product(call.tensors["o"], call.tensors["o_proj"])
        tensors = {k: v for k, v in call.tensors.items() if k not in ("o", "o_proj")}
        mixed = self.attn.reference(OpCall({**tensors, "delta": attn_out.to(torch.bfloat16)}, call.args))
        return {"attn_out": attn_out, **mixed}

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        return self.attn.allowed_writes(call)


ORACLE_ENTRY_POINTS = (_exact_product,)
