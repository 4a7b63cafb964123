"""Which stock ops carry each runtime op (data: `ops.toml`), and the stock entries of the ledger's kernel catalog.

The runtime's plan names ops per layer part (k3_decode/runtime/ops.toml); the stock path's tables name the ops it
launches (k3_decode/stock/attention_ops.toml, moe_ops.toml). This module joins the two, so a dispatch record of
runtime op `kda` can be checked against the kernels the stock ops `kda_f_b` and `kda_decode` launch.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import torch

from k3_decode.config import ModelDims
from k3_decode.runtime.errors import DataFileError
from k3_decode.runtime.optable import PARTS, OpTable
from k3_decode.stock.dispatch import OpInfo, op_info
from k3_decode.stock.moe import moe_op_info

_ATTENTION_PARTS = ("kda", "mla")


def stock_op_info(part: str, op: str, device: torch.device | str) -> OpInfo:
    """The stock table row of `op` (attention table for kda/mla parts, MoE table for moe/dense)."""
    return op_info(op, device) if part in _ATTENTION_PARTS else moe_op_info(op, device)


@dataclass(frozen=True)
class StockOpMap:
    parts: dict[str, dict[str, tuple[str, ...]]]  # part -> runtime op -> stock ops in launch order
    # part -> runtime op -> stock ops on a verify step (q > 1), where they differ from `parts` (ops.toml [verify])
    verify: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def stock_ops(self, part: str, op: str, tokens_per_request: int = 1) -> tuple[str, ...]:
        """The stock ops `op` of `part` runs on a step of `tokens_per_request` tokens per request."""
        if tokens_per_request > 1 and op in self.verify.get(part, {}):
            return self.verify[part][op]
        return self.parts[part][op]

    def layer_ops(self, table: OpTable, dims: ModelDims, layer: int) -> list[tuple[str, str]]:
        """(runtime op, stock op) pairs of one layer in launch order."""
        out = []
        for part, op in table.layer_ops(dims, layer):
            out.extend((op, stock) for stock in self.parts[part.part][op])
        return out

    def stock_launches(self, verify: bool = False) -> dict[str, dict[str, int]]:
        """Runtime op -> {kernel name: launches per dispatch} on CUDA, for KernelCatalog.build(stock=...); with
        `verify`, only the ops whose stock ops differ on a verify step ([verify]), for its stock_verify.

        cuBLAS GEMMs have no fixed kernel name and are left out: the profiler check matches names it can know.
        """
        out: dict[str, Counter[str]] = {}
        for part, ops in (self.verify if verify else self.parts).items():
            for op, stock_ops in ops.items():
                kernels: Counter[str] = Counter()
                for stock in stock_ops:
                    kernels.update(stock_op_info(part, stock, "cuda").kernels)
                if op in out and out[op] != kernels:
                    raise DataFileError(
                        f"ops.toml: runtime op {op!r} launches different kernels in different parts "
                        f"({dict(out[op])} vs {dict(kernels)}); the ledger's catalog keys kernels by op name only"
                    )
                out[op] = kernels
        return {op: dict(k) for op, k in out.items()}

    def implementations(self, part: str, device: torch.device | str) -> tuple[str, ...]:
        """What the stock ops of a part run as on `device` ("triton", "cublas", ..., or "torch-cpu")."""
        names = {stock_op_info(part, s, device).implementation for ops in self.parts[part].values() for s in ops}
        return tuple(sorted(names))


def _stock_list(part: str, op: str, stock: object, where: str, table: str = "") -> tuple[str, ...]:
    table = table or part
    if not isinstance(stock, list) or not stock or not all(isinstance(s, str) for s in stock):
        raise DataFileError(f"{where}: [{table}].{op} must be a non-empty list of stock op names")
    for s in stock:
        try:
            stock_op_info(part, s, "cpu")
        except ValueError as exc:
            raise DataFileError(f"{where}: [{table}].{op}: {exc}") from exc
    return tuple(stock)


def parse_op_map(raw: dict, table: OpTable, where: str = "ops.toml") -> StockOpMap:
    raw = dict(raw)
    verify_raw = raw.pop("verify", {})
    if sorted(raw) != sorted(PARTS):
        raise DataFileError(f"{where}: needs exactly the tables {list(PARTS)} (and [verify]), got {sorted(raw)}")
    parts: dict[str, dict[str, tuple[str, ...]]] = {}
    for part in PARTS:
        ops = table.parts[part].ops
        got = raw[part]
        if sorted(got) != sorted(ops):
            raise DataFileError(f"{where}: [{part}] must map exactly the runtime ops {list(ops)}, got {sorted(got)}")
        parts[part] = {op: _stock_list(part, op, got[op], where) for op in ops}
    verify: dict[str, dict[str, tuple[str, ...]]] = {}
    if not isinstance(verify_raw, dict):
        raise DataFileError(f"{where}: [verify] must be a table of parts, e.g. [verify.kda]")
    for part, got in verify_raw.items():
        if part not in PARTS or not isinstance(got, dict):
            raise DataFileError(f"{where}: [verify.{part}] is not a part; use one of {list(PARTS)}")
        if unknown := sorted(set(got) - set(table.parts[part].ops)):
            raise DataFileError(f"{where}: [verify.{part}] maps {unknown}, which are not runtime ops of {part}")
        verify[part] = {op: _stock_list(part, op, stock, where, f"verify.{part}") for op, stock in got.items()}
    return StockOpMap(parts, verify)


@cache
def _shipped_raw() -> dict:
    return tomllib.loads(resources.files(__package__).joinpath("ops.toml").read_text())


def load_op_map(table: OpTable) -> StockOpMap:
    """The shipped map (ops.toml beside this module), checked against `table`."""
    return parse_op_map(_shipped_raw(), table)
