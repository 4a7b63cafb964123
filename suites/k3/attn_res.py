"""Cells for AttnRes, the replacement of the residual stream: before attention, after attention and final, at
block-write layers and plain ones.

Each cell is one application on per-token state buffers (the running BF16 prefix and the bank of saved blocks),
as the decode step runs it: the oracle (k3_decode.reference.attn_res) returns the sublayer input and the new state,
the implementation updates the buffers in place. Bank slots past the blocks saved so far hold NaN: a kernel that
reads a block it should not mixes a NaN into every output of the token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.numerics.cells import OpCall, OpSpec
from k3_decode.config import ModelDims
from k3_decode.reference import attn_res as ra
from k3_decode.stock.attn_res import AttnResSite
from suites.k3 import weights

SPEC = OpSpec("attn_res", "bfloat16", outputs=("out",), inplace=("prefix", "blocks"))

# The sites of a decode step. "-write" is the last block-write layer (it saves the prefix as a new block, and
# after its attention the prefix restarts), "-plain" the layer after it (the deepest bank a mixing reads);
# "final" mixes every block with no output norm (stock's pre-norm hidden state), "final-norm" with the model's
# final norm fused in (what the specialized decode writes).
SITES = ("before-first", "before-write", "before-plain", "after-write", "after-plain", "final", "final-norm")


def site_layer(dims: ModelDims, site: str) -> int:
    """The layer a site runs at (the layer count for the final mixing)."""
    bs = dims.attn_res_block_size
    last_write = (dims.num_layers - 1) // bs * bs
    if last_write == 0 or last_write + 1 >= dims.num_layers:
        raise ValueError(f"{dims.name}: needs a block-write layer after layer 0 with a plain layer after it")
    return {
        "before-first": 0,
        "before-write": last_write,
        "before-plain": last_write + 1,
        "after-write": last_write,
        "after-plain": last_write + 1,
        "final": dims.num_layers,
        "final-norm": dims.num_layers,
    }[site]


def site_of(dims: ModelDims, site: str) -> AttnResSite:
    """What the site does (delta mode, saved block, blocks read, bank size before it), from the oracle's rules."""
    bs, layer = dims.attn_res_block_size, site_layer(dims, site)
    if site.startswith("before"):
        return AttnResSite.before_attention(layer, bs)
    if site.startswith("after"):
        return AttnResSite.after_attention(layer, bs)
    return AttnResSite.final(dims.num_layers, bs)


@dataclass
class AttnResCell:
    dims: ModelDims
    batch: int  # tokens
    site: str
    scale: float = 1.0  # multiplies every activation (prefix, bank, delta): large and tiny magnitudes
    spec: OpSpec = field(default=SPEC)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise ValueError(f"unknown AttnRes site {self.site!r}; use one of {', '.join(SITES)}")
        self.layer = site_layer(self.dims, self.site)
        self.rule = site_of(self.dims, self.site)
        suffix = "" if self.scale == 1.0 else f"/x{self.scale:g}"
        self.id = f"attn_res/{self.site}/b{self.batch}{suffix}"
        self.axes = {"site": self.site, "layer": self.layer, "batch": self.batch, "scale": self.scale}

    def _mix_weights(self, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.site.startswith("final"):
            final_res, final_norm = weights.final_residual(self.dims, device)
            return final_res.norm, final_res.proj, (final_norm if self.site == "final-norm" else None)
        res = weights.residual(self.dims, self.layer, device)
        if self.site.startswith("before"):
            return res.attn_res.norm, res.attn_res.proj, res.input_norm
        return res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        t, h, cap = self.batch, self.dims.hidden_size, self.dims.num_attn_res_blocks
        bank = self.rule.bank_before

        def rows(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * self.scale).to(torch.bfloat16)

        blocks = torch.full((t, cap, h), float("nan"), dtype=torch.bfloat16)
        # Saved blocks of different sizes (the embedding, then sums of growing depth), so their logits differ.
        spread = 0.5 + 1.5 * torch.rand(bank, generator=g)
        blocks[:, :bank] = (rows(t, bank, h).float() * spread[None, :, None]).to(torch.bfloat16)
        norm, proj, out_norm = self._mix_weights(str(device))
        tensors = {"prefix": rows(t, h), "blocks": blocks}
        if self.rule.delta != "none":
            tensors["delta"] = rows(t, h)
        tensors = {k: v.to(device) for k, v in tensors.items()}
        tensors |= {"res_norm": norm.clone(), "res_proj": proj.clone()}
        if out_norm is not None:
            tensors["out_norm"] = out_norm.clone()
        return OpCall(tensors, {"site": self.site, "layer": self.layer, "bank_blocks": bank})

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        t = call.tensors
        bs, eps = self.dims.attn_res_block_size, self.dims.rms_norm_eps
        bank = self.rule.bank_before
        state = ra.AttnResState(t["prefix"], t["blocks"][:, :bank])
        mix = ra.MixWeights(t["res_norm"], t["res_proj"], t.get("out_norm"))
        delta = t.get("delta")
        if self.site.startswith("before"):
            out, new = ra.before_attention(state, self.layer, delta, mix, bs, eps, torch.float64)
        elif self.site.startswith("after"):
            out, new = ra.after_attention(state, self.layer, delta, mix, bs, eps, torch.float64)
        else:
            assert delta is not None
            out = ra.final(state, delta, self.dims.num_layers, mix, bs, eps, torch.float64)
            new = ra.AttnResState(ra.add_to_prefix(t["prefix"], delta), state.blocks)
        blocks = t["blocks"].clone()
        blocks[:, : new.num_blocks] = new.blocks
        return {"out": out, "prefix": new.prefix, "blocks": blocks}

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        prefix = torch.full_like(call.tensors["prefix"], self.rule.delta != "none", dtype=torch.bool)
        blocks = torch.zeros_like(call.tensors["blocks"], dtype=torch.bool)
        if self.rule.save_index is not None:
            blocks[:, self.rule.save_index] = True
        return {"prefix": prefix, "blocks": blocks}


ORACLE_ENTRY_POINTS = (ra.before_attention, ra.after_attention, ra.final, ra.mix, ra.mix_state)
