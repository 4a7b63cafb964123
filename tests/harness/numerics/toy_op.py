"""A small stateful op with the shape of a decode kernel: per-request state slots, NULL slots, a bf16 output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.numerics.cells import OpCall, OpSpec
from harness.numerics.compare import ToleranceTable

TABLE = ToleranceTable(
    {
        "toy": {
            "bfloat16": {
                "atol": 1e-2,
                "rtol": 1e-2,
                "matched_fraction": 1.0,
                "max_abs": 5e-2,
                "nontrivial_margin": 10.0,
                "reason": "one bf16 rounding of an fp32 result",
            },
            "state": {
                "bfloat16": {
                    "atol": 1e-5,
                    "rtol": 1e-5,
                    "matched_fraction": 1.0,
                    "max_abs": 1e-4,
                    "nontrivial_margin": 10.0,
                    "reason": "fp32 state, one add",
                }
            },
        },
    },
    "test",
)


def reference(call: OpCall) -> dict[str, torch.Tensor]:
    x, w = call.tensors["x"].double(), call.tensors["w"].double()
    state, slots = call.tensors["state"].double().clone(), call.tensors["slots"]
    out = torch.zeros_like(x)
    for b, slot in enumerate(slots.tolist()):
        if slot > 0:
            out[b] = (state[slot] + x[b]) * w
            state[slot] += x[b]
    return {"y": out, "state": state}


def correct(call: OpCall) -> dict[str, torch.Tensor]:
    x, w, state, slots = (call.tensors[k] for k in ("x", "w", "state", "slots"))
    live = slots > 0
    rows = slots[live]
    new = state[rows] + x[live].float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    y[live] = new * w.float()
    state[rows] = new
    return {"y": y.to(torch.bfloat16)}


TOY_SPEC = OpSpec("toy", "bfloat16", outputs=("y",), inplace=("state",), steps=3)


@dataclass
class ToyCase:
    batch: int
    width: int = 64
    num_slots: int = 16
    id: str = ""
    axes: dict = field(default_factory=dict)
    spec: OpSpec = field(default_factory=lambda: TOY_SPEC)

    def __post_init__(self):
        self.id = f"toy/b{self.batch}"
        self.axes = {"batch": self.batch}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        slots = torch.arange(1, self.batch + 1) * 2 - 1  # distinct odd slots; even ones belong to nobody
        if self.batch > 2:
            slots[1] = 0  # a padding row
        return OpCall(
            {
                "x": torch.randn(self.batch, self.width, generator=g).to(torch.bfloat16).to(device),
                "w": (torch.rand(self.width, generator=g) + 0.5).to(torch.bfloat16).to(device),
                "state": torch.randn(self.num_slots * 2, self.width, generator=g).to(device),
                "slots": slots.to(device),
            }
        )

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        return reference(call)

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        mask = torch.zeros_like(call.tensors["state"], dtype=torch.bool)
        for slot in call.tensors["slots"].tolist():
            if slot > 0:
                mask[slot] = True
        return {"state": mask}
