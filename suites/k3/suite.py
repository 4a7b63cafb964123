"""The K3 numerics suite: grid cells from suites/grids/<subject>.toml narrowed by the config, and the
implementations under test (the stock path of k3_decode until specialized kernels register)."""

from __future__ import annotations

import itertools
import random
import tomllib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

import torch

from harness.numerics.cells import Case, Implementation, OpCall
from k3_decode.config import ModelDims, load_dims
from k3_decode.reference import kda as ref_kda
from k3_decode.stock import kda as stock_kda
from k3_decode.stock.dispatch import implementation_for
from suites.k3 import kda

AXIS_FROM_CONFIG = {
    "batches": ("workload", "batches"),
    "tp": ("parallel", "tp"),
    "tokens_per_request": ("workload", "tokens_per_request"),
}


def _evenly(cells: list[Any], n: int) -> list[Any]:
    """n cells spread over the list, first and last included (the extremes are where kernels break)."""
    if n >= len(cells):
        return cells
    if n == 1:
        return [cells[0]]
    return [cells[round(i * (len(cells) - 1) / (n - 1))] for i in range(n)]


@dataclass(frozen=True)
class K3Suite:
    subject: str
    model: str

    @cached_property
    def dims(self) -> ModelDims:
        return load_dims(self.model)

    @cached_property
    def grid(self) -> dict[str, Any]:
        return tomllib.loads(resources.files("suites.grids").joinpath(f"{self.subject}.toml").read_text())

    def _axis(self, config: Any, name: str) -> list[int]:
        table, key = AXIS_FROM_CONFIG[name]
        allowed = set(self.grid["axes"][name])
        return [v for v in config.data[table][key] if v in allowed]

    def _case(self, op: str, tp: int, batch: int, q: int = 1) -> Case:
        if op in ("kda_decode", "kda_verify"):
            return kda.KdaCell(self.dims, tp, batch, q)
        raise KeyError(f"suite {self.subject} has no cell builder for op {op!r}")

    def cells(self, config: Any, rng: random.Random) -> list[Case]:
        tier = config.tier
        cap = config.data["tiers"][tier].get("max_cells")
        out: list[Case] = []
        ops = self.grid["ops"]
        for op, spec in ops.items():
            axes = [self._axis(config, a) for a in spec["axes"]]
            combos = [c for c in itertools.product(*axes) if op != "kda_verify" or c[2] > 1]
            if cap:
                combos = _evenly(combos, max(1, cap // len(ops)))
            out += [self._case(op, *c) for c in combos]
            grid_batches = set(self.grid["axes"]["batches"])
            off_grid = [b for b in range(1, self.grid["random_cells"]["max_batch"] + 1) if b not in grid_batches]
            tps = self._axis(config, "tp")
            for _ in range(self.grid["random_cells"][tier]):
                tp, batch = rng.choice(tps), rng.choice(off_grid)
                q = rng.randint(2, 8) if op == "kda_verify" else 1
                out.append(self._case(op, tp, batch, q))
        return out

    def implementations(self, device: torch.device) -> list[Implementation]:
        backend = implementation_for(device)
        return [
            Implementation(
                "stock", {"kda_decode": self._stock_kda_decode, "kda_verify": self._stock_kda_verify}, backend
            )
        ]

    def forbidden(self) -> tuple:
        return tuple(f.__code__ for f in kda.ORACLE_ENTRY_POINTS)

    @staticmethod
    def _kda_args(call: OpCall) -> tuple:
        t = call.tensors
        weights = ref_kda.KdaWeights(**{k: t[k] for k in kda.WEIGHT_NAMES})
        cache = ref_kda.KdaCache(conv=t["conv_state"], recurrent=t["recurrent_state"])  # updated in place
        return weights, cache

    def _spec(self, call: OpCall) -> ref_kda.KdaSpec:
        return ref_kda.KdaSpec.for_rank(self.dims, call.args["tp"])

    def _stock_kda_decode(self, call: OpCall) -> dict[str, torch.Tensor]:
        weights, cache = self._kda_args(call)
        t = call.tensors
        return {"out": stock_kda.kda_decode_step(self._spec(call), weights, t["packed"], cache, t["slots"])}

    def _stock_kda_verify(self, call: OpCall) -> dict[str, torch.Tensor]:
        weights, cache = self._kda_args(call)
        t = call.tensors
        out = stock_kda.kda_verify_step(self._spec(call), weights, t["packed"], cache, t["slots"], t["num_accepted"])
        return {"out": out}
