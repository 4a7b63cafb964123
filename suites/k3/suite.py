"""The K3 numerics suite: grid cells from suites/grids/<subject>.toml narrowed by the config, and the
implementations under test (the stock path of k3_decode until specialized kernels register)."""

from __future__ import annotations

import itertools
import math
import random
import tomllib
from collections.abc import Sequence
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
from suites.k3 import attn_res, kda, mla, moe, projections, specialized
from suites.k3.stock import StockAdapters

AXIS_FROM_CONFIG = {
    "batches": ("workload", "batches"),
    "tp": ("parallel", "tp"),
    "tokens_per_request": ("workload", "tokens_per_request"),
}
ORACLES = (kda, attn_res, mla, moe, projections)


def _evenly(cells: list[Any], n: int) -> list[Any]:
    """n cells spread over the list, first and last included (the extremes are where kernels break)."""
    if n >= len(cells):
        return cells
    if n == 1:
        return [cells[0]]
    return [cells[round(i * (len(cells) - 1) / (n - 1))] for i in range(n)]


def covering(combos: list[tuple], n: int) -> list[tuple]:
    """n of the combos (in their order) such that every value of every axis appears once before any combo is
    chosen for spread alone; then the rest spread evenly. Deterministic."""
    if n >= len(combos):
        return combos
    chosen: list[int] = []
    missing = {(i, v) for c in combos for i, v in enumerate(c)}
    while missing and len(chosen) < n:
        # The combo covering most missing values; ties to the one farthest from those already chosen.
        def gain(j: int, missing: set = missing) -> tuple[int, int]:
            new = sum((i, v) in missing for i, v in enumerate(combos[j]))
            return new, min((abs(j - c) for c in chosen), default=len(combos))

        best = max((j for j in range(len(combos)) if j not in chosen), key=gain)
        chosen.append(best)
        missing -= set(enumerate(combos[best]))
    rest = [j for j in range(len(combos)) if j not in chosen]
    chosen += _evenly(rest, n - len(chosen)) if n > len(chosen) else []
    return [combos[j] for j in sorted(chosen)]


def shares(sizes: Sequence[int], cap: int) -> list[int]:
    """Cells per op under a cap: equal shares, what an op cannot use passed on to the others (water-filling)."""
    out = [0] * len(sizes)
    left, open_ops = cap, [i for i, s in enumerate(sizes) if s > 0]
    while left > 0 and open_ops:
        each = max(1, left // len(open_ops))
        for i in list(open_ops):
            take = min(each, sizes[i] - out[i], left)
            out[i] += take
            left -= take
            if out[i] == sizes[i]:
                open_ops.remove(i)
            if left == 0:
                break
    return out


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

    # -- axes -------------------------------------------------------------------------------------------------

    def _axis(self, config: Any, name: str, op: str | None = None) -> list[Any]:
        if op is not None and name in self.grid["ops"][op]:
            return list(self.grid["ops"][op][name])  # an op's own axis
        if name == "contexts":
            wl = config.data["workload"]
            return sorted({1, *wl["contexts"], wl.get("max_context", max(wl["contexts"]))})
        table, key = AXIS_FROM_CONFIG[name]
        allowed = set(self.grid["axes"][name])
        return [v for v in config.data[table][key] if v in allowed]

    def _combos(self, config: Any, op: str) -> list[dict[str, Any]]:
        names = self.grid["ops"][op]["axes"]
        combos = [
            dict(zip(names, c, strict=True)) for c in itertools.product(*(self._axis(config, a, op) for a in names))
        ]
        if op == "kda_verify":
            combos = [c for c in combos if c["tokens_per_request"] > 1]
        if op == "mla_decode":
            limit = self.grid["ops"][op]["max_cached_tokens"]
            combos = [c for c in combos if c["batches"] * c["contexts"] <= limit]
        return combos

    # -- cells --------------------------------------------------------------------------------------------------

    def case(self, op: str, axes: dict[str, Any], scale: float = 1.0) -> Case:
        """The cell of `op` at these axis values (grid names: tp, batches, tokens_per_request, contexts, ...)."""
        d, tp, b = self.dims, axes.get("tp"), axes["batches"]
        if op in ("kda_decode", "kda_verify"):
            return kda.KdaCell(d, tp, b, axes.get("tokens_per_request", 1))
        if op == "attn_res":
            return attn_res.AttnResCell(d, b, axes["sites"], scale)
        if op == "kda_in_proj":
            return projections.InProjCell(d, tp, b)
        if op == "kda_o_proj":
            return projections.OProjCell(d, tp, b, axes["sites"])
        if op == "mla_decode":
            page = axes.get("page_size", self.grid["ops"][op]["page_size"])
            return mla.MlaCell(d, tp, b, axes["contexts"], axes["splits"], page, scale)
        if op == "moe_route":
            return moe.RouteCell(d, b, axes["routers"], scale)
        if op == "moe_latent_down":
            return moe.LatentDownCell(d, b, scale)
        if op == "moe_experts":
            return moe.ExpertsCell(d, tp, b, scale, axes.get("distinct_experts"))
        if op in ("moe_shared", "dense_mlp"):
            return moe.GatedCell(d, tp, b, "shared" if op == "moe_shared" else "dense", scale)
        if op == "moe_latent_tail":
            return moe.LatentTailCell(d, b, scale)
        if op == "moe":
            return moe.MoeCell(d, tp, b, scale)
        raise KeyError(f"suite {self.subject} has no cell builder for op {op!r}")

    def off_grid(self, config: Any, op: str, rng: random.Random) -> dict[str, Any]:
        """Axis values of one cell drawn inside the scope but off the published batch sizes."""
        grid_batches = set(self.grid["axes"]["batches"])
        spec = self.grid["ops"][op]
        axes: dict[str, Any] = {}
        for name in spec["axes"]:
            if name == "batches":
                off = [b for b in range(1, self.grid["random_cells"]["max_batch"] + 1) if b not in grid_batches]
                axes[name] = rng.choice(off)
            elif name == "tokens_per_request":
                axes[name] = rng.randint(2, max(self.grid["axes"]["tokens_per_request"]))
            elif name == "contexts":
                top = config.data["workload"].get("max_context", max(config.data["workload"]["contexts"]))
                axes[name] = max(1, round(math.exp(rng.uniform(0, math.log(top)))))  # log-uniform in [1, max]
            else:
                axes[name] = rng.choice(self._axis(config, name, op))
        if op == "mla_decode":
            axes["page_size"] = rng.choice(spec["off_grid_page_sizes"])
            axes["batches"] = min(axes["batches"], max(1, spec["max_cached_tokens"] // axes["contexts"]))
        return axes

    def cells(self, config: Any, rng: random.Random) -> list[Case]:
        tier = config.tier
        cap = config.data["tiers"][tier].get("max_cells")
        ops = list(self.grid["ops"])
        per_op = {op: self._combos(config, op) for op in ops}
        counts = shares([len(per_op[op]) for op in ops], cap) if cap else [len(per_op[op]) for op in ops]
        out: list[Case] = []
        for op, n in zip(ops, counts, strict=True):
            names = self.grid["ops"][op]["axes"]
            picked = covering([tuple(c[a] for a in names) for c in per_op[op]], n)
            out += [self.case(op, dict(zip(names, c, strict=True))) for c in picked]
            out += [self.case(op, self.off_grid(config, op, rng)) for _ in range(self.grid["random_cells"][tier])]
        return out

    # -- implementations ------------------------------------------------------------------------------------------

    def implementations(self, device: torch.device) -> list[Implementation]:
        backend = implementation_for(device)
        ops = {"kda_decode": self._stock_kda_decode, "kda_verify": self._stock_kda_verify}
        ops |= StockAdapters(self.dims, str(device)).ops()
        impls = [Implementation("stock", ops, backend)]
        adapters = specialized.SpecializedAdapters(self.dims)
        reason = specialized.not_run_reason() if device.type == "cuda" else "this run is on the CPU"
        not_run = None
        if reason is None:
            impls.append(
                Implementation(
                    specialized.NAME, adapters.ops(), specialized.BACKEND, partial=True, declines=adapters.declines
                )
            )
        else:
            ops_named = ", ".join(sorted(adapters.ops()))
            not_run = {"name": f"{specialized.NAME} implementation ({ops_named})", "reason": reason}
        self.__dict__["_specialized_not_run"] = not_run  # frozen: remembered for not_run(), like a cached property
        return impls

    def not_run(self) -> list[dict[str, str]]:
        """The specialized implementation where its kernels cannot run here (listed, never counted as tested)."""
        item = self.__dict__.get("_specialized_not_run")
        return [item] if item else []

    def forbidden(self) -> tuple:
        return tuple(f.__code__ for module in ORACLES for f in module.ORACLE_ENTRY_POINTS)

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
