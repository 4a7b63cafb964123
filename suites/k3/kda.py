"""Cells for the KDA decode and verify steps (the part between the packed in_proj and o_proj)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.numerics.cells import OpCall, OpSpec
from k3_decode.config import ModelDims
from k3_decode.reference import kda as ref
from suites.k3 import weights as layer_weights

DECODE = OpSpec("kda_decode", "bfloat16", outputs=("out",), inplace=("conv_state", "recurrent_state"), steps=3)
VERIFY = OpSpec("kda_verify", "bfloat16", outputs=("out",), inplace=("conv_state", "recurrent_state"), steps=2)
WEIGHT_NAMES = ("f_b", "conv", "a_log", "dt_bias", "o_norm")


def _weights(dims: ModelDims, tp: int, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    w = layer_weights.kda(dims, tp, device)
    return w.in_proj, {name: getattr(w, name) for name in WEIGHT_NAMES}


def slot_table(batch: int, q: int) -> torch.Tensor:
    """Distinct slots per request and token; one padding request (all NULL) once the batch has three.

    Odd slots are used, even ones belong to no request: they are canaries the step must not touch.
    """
    slots = (torch.arange(batch * q).reshape(batch, q) * 2 + 1).to(torch.int64)
    if batch >= 3:
        slots[batch // 2] = 0
    return slots


@dataclass
class KdaCell:
    dims: ModelDims
    tp: int
    batch: int
    q: int = 1
    spec: OpSpec = field(default=DECODE)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.spec = DECODE if self.q == 1 else VERIFY
        self.kspec = ref.KdaSpec.for_rank(self.dims, self.tp)
        self.id = f"{self.spec.op}/tp{self.tp}/b{self.batch}" + (f"/q{self.q}" if self.q > 1 else "")
        self.axes = {"tp": self.tp, "batch": self.batch, "q": self.q}

    @property
    def num_slots(self) -> int:
        return 2 * self.batch * self.q + 2

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        s = self.kspec
        in_proj, weights = _weights(self.dims, self.tp, str(device))
        hidden = torch.randn(self.batch * self.q, self.dims.hidden_size, generator=g).to(device, torch.bfloat16)
        packed = torch.nn.functional.linear(hidden, in_proj)  # a realistic projection, as the layer computes it
        if self.q > 1:
            packed = packed.reshape(self.batch, self.q, -1)
        taps = s.conv_width - 1 + (self.q - 1 if self.q > 1 else 0)
        conv = (torch.randn(self.num_slots, s.conv_channels, taps, generator=g) * 0.5).to(s.conv_state_dtype)
        recurrent = (torch.randn(self.num_slots, s.heads, s.head_dim, s.head_dim, generator=g) * 0.05).to(
            s.recurrent_state_dtype
        )
        tensors = {
            "packed": packed.contiguous(),
            **{k: v.clone() for k, v in weights.items()},
            "conv_state": conv.to(device),
            "recurrent_state": recurrent.to(device),
            "slots": (slot_table(self.batch, self.q) if self.q > 1 else slot_table(self.batch, 1)[:, 0]).to(device),
        }
        if self.q > 1:
            accepted = torch.randint(1, self.q + 1, (self.batch,), generator=g)
            tensors["num_accepted"] = accepted.to(device)
        return OpCall(tensors, {"tp": self.tp})

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        t = call.tensors
        weights = ref.KdaWeights(**{k: t[k] for k in WEIGHT_NAMES})
        cache = ref.KdaCache(conv=t["conv_state"].clone(), recurrent=t["recurrent_state"].clone())
        if self.q == 1:
            out = ref.kda_decode_step(self.kspec, weights, t["packed"], cache, t["slots"])
        else:
            out = ref.kda_verify_step(self.kspec, weights, t["packed"], cache, t["slots"], t["num_accepted"])
        return {"out": out, "conv_state": cache.conv, "recurrent_state": cache.recurrent}

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        slots = call.tensors["slots"]
        writes = ref.decode_write_set(slots) if self.q == 1 else ref.verify_write_set(slots)
        masks = {
            "conv_state": torch.zeros_like(call.tensors["conv_state"], dtype=torch.bool),
            "recurrent_state": torch.zeros_like(call.tensors["recurrent_state"], dtype=torch.bool),
        }
        for w in writes:
            masks["conv_state" if w.tensor == "conv" else "recurrent_state"][w.slot] = True
        return masks


ORACLE_ENTRY_POINTS = (ref.kda_decode_step, ref.kda_verify_step, ref.run_tokens, ref.token_features)
