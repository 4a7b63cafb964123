"""The op table: the ops of each layer part and the path each takes on a specialized step (data: `ops.toml`)."""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from k3_decode.config import ModelDims
from k3_decode.runtime.errors import DataFileError

if TYPE_CHECKING:  # backend.py imports this module
    from k3_decode.runtime.backend import RowLimit

DispatchPath = Literal["specialized", "stock"]
PATHS: tuple[DispatchPath, ...] = ("specialized", "stock")
PARTS = ("kda", "mla", "dense", "moe")


@dataclass(frozen=True)
class PartOps:
    """One layer part (an attention kind or an MLP kind) and the ops it launches, in order."""

    part: str
    ops: tuple[str, ...]
    specialized: frozenset[str]
    stock_reason: str

    def path_on_specialized_step(
        self,
        op: str,
        rows: int | None = None,
        limits: Mapping[str, RowLimit] | None = None,
        kept: Collection[str] = (),
    ) -> DispatchPath:
        """The op's path on a step the plan routes specialized: the op table's word, and, given the step's rows
        and the providers' row limits (op -> the rows served, backend.RowLimit), stock at a row count its provider
        does not serve; stock for the ops `kept` stock at this deployment (backend.ProviderRegistry.kept_stock).
        Tests and perf cells declare their expectations with this, from the data, not from the planner's code."""
        if op not in self.specialized or op in kept:
            return "stock"
        limit = (limits or {}).get(op)
        return "stock" if rows is not None and limit is not None and not limit.serves(rows) else "specialized"


@dataclass(frozen=True)
class OpTable:
    parts: dict[str, PartOps]

    def expected_paths(
        self,
        dims: ModelDims,
        layers: Iterable[int],
        rows: int,
        limits: Mapping[str, RowLimit],
        kept: Collection[str] = (),
        layer_limits: Mapping[tuple[str, int], RowLimit] | None = None,
    ) -> dict[tuple[int, str], DispatchPath]:
        """(layer, op) -> the path of each op of `layers` on a specialized step of `rows` rows (see
        PartOps.path_on_specialized_step); `layer_limits` ((op, layer) -> limit) replace `limits` at their layer."""
        paths: dict[tuple[int, str], DispatchPath] = {}
        for layer in layers:
            here = dict(limits)
            here.update({op: limit for (op, at), limit in (layer_limits or {}).items() if at == layer})
            for part, op in self.layer_ops(dims, layer):
                paths[(layer, op)] = part.path_on_specialized_step(op, rows, here, kept)
        return paths

    def layer_ops(self, dims: ModelDims, layer: int) -> tuple[tuple[PartOps, str], ...]:
        """(part, op) pairs of a 0-indexed layer in launch order: its attention part, then its MLP part."""
        if not 0 <= layer < dims.num_layers:
            raise ValueError(f"layer {layer} is outside {dims.name}'s layers 0..{dims.num_layers - 1}")
        out: list[tuple[PartOps, str]] = []
        for kind in (dims.layer_kind(layer), dims.mlp_kind(layer)):
            part = self.parts[kind]
            out.extend((part, op) for op in part.ops)
        return tuple(out)

    def specialized_ops(self) -> frozenset[str]:
        """Every op some part routes to the specialized path: each needs a registered provider."""
        return frozenset().union(*(p.specialized for p in self.parts.values()))


def _part(name: str, raw: Any, where: str) -> PartOps:
    if not isinstance(raw, dict):
        raise DataFileError(f"{where}: [{name}] must be a table with ops and specialized")
    unknown = set(raw) - {"ops", "specialized", "stock_reason"}
    if unknown:
        raise DataFileError(f"{where}: [{name}] has unknown keys {sorted(unknown)}; use ops, specialized, stock_reason")
    ops, special = raw.get("ops"), raw.get("specialized")
    if not isinstance(ops, list) or not ops or not all(isinstance(o, str) and o for o in ops):
        raise DataFileError(f"{where}: [{name}].ops must be a non-empty list of op names")
    if len(set(ops)) != len(ops):
        raise DataFileError(f"{where}: [{name}].ops lists an op twice; list each op once")
    if not isinstance(special, list) or not all(isinstance(o, str) for o in special):
        raise DataFileError(f"{where}: [{name}].specialized must be a list of op names (may be empty)")
    if stray := sorted(set(special) - set(ops)):
        raise DataFileError(f"{where}: [{name}].specialized names {stray}, which are not in its ops {ops}")
    reason = raw.get("stock_reason", "")
    if set(special) != set(ops) and not (isinstance(reason, str) and reason):
        raise DataFileError(f"{where}: [{name}] keeps ops on stock but has no stock_reason; add one for the ledger")
    return PartOps(name, tuple(ops), frozenset(special), reason)


def parse_op_table(raw: dict[str, Any], where: str = "op table") -> OpTable:
    missing = [p for p in PARTS if p not in raw]
    unknown = sorted(set(raw) - set(PARTS))
    if missing or unknown:
        raise DataFileError(f"{where}: needs exactly the tables {list(PARTS)}; missing {missing}, unknown {unknown}")
    return OpTable({name: _part(name, raw[name], where) for name in PARTS})


def load_op_table(path: str | Path | None = None) -> OpTable:
    """The shipped table (`ops.toml` beside this module), or another file with the same layout."""
    if path is None:
        return parse_op_table(tomllib.loads(resources.files(__package__).joinpath("ops.toml").read_text()), "ops.toml")
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"op table {path} does not exist; pass an existing TOML file or None for the shipped one")
    return parse_op_table(tomllib.loads(path.read_text()), str(path))
