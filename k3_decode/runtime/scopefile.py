"""The runtime's view of a subject's scope file (`k3_decode/scope/<subject>.toml`): [deployment] and [runtime]."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from k3_decode.runtime.errors import DataFileError

# Every check name a scope file may list; scope.py maps each to its rule.
CHECK_NAMES = (
    "model",
    "cpu_model",
    "device",
    "tp",
    "dcp",
    "batch",
    "tokens_per_request",
    "spec_method",
    "kda_state_dtypes",
    "mla_cache_dtype",
    "cudagraph_mode",
)
STEP_MODES = ("graph", "eager")
_KIND_NAMES = {int: "an integer", str: "a string"}


@dataclass(frozen=True)
class RuntimeScope:
    subject: str
    models: tuple[str, ...]
    cpu_models: tuple[str, ...]
    tp: tuple[int, ...]
    dcp: tuple[str, ...]  # "1" or "tp"
    max_batch: int  # requests per step on the specialized path; also its most rows per step
    prepared_batches: tuple[int, ...]  # rows the specialized path always prepares
    max_tokens_per_request: int
    specialized_sm_families: tuple[int, ...]
    mla_cache_dtype: str
    kda_conv_state_dtype: str
    kda_recurrent_state_dtype: str
    specialized_cudagraph_modes: tuple[str, ...]
    spec_methods: tuple[str, ...]
    specialized_step_modes: tuple[str, ...]
    specialized_checks: tuple[str, ...]
    stock_checks: tuple[str, ...]

    def allowed_dcp(self, tp: int) -> tuple[int, ...]:
        return tuple(sorted({1 if d == "1" else tp for d in self.dcp}))


def _get(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise DataFileError(f"{where}: missing key {key!r}; add it (see k3_decode/scope/k3-hopper.toml)")
    value = table[key]
    if kind is list:
        if not isinstance(value, list) or not value:
            raise DataFileError(f"{where}: {key} must be a non-empty list")
        return tuple(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataFileError(f"{where}: {key} must be {_KIND_NAMES[kind]}, got {value!r}")
    return value


def _checks(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    names = _get(table, key, list, where)
    if unknown := [n for n in names if n not in CHECK_NAMES]:
        raise DataFileError(f"{where}: {key} names unknown checks {unknown}; use names from {list(CHECK_NAMES)}")
    if len(set(names)) != len(names):
        raise DataFileError(f"{where}: {key} lists a check twice; list each once")
    return names


def parse_scope(raw: dict[str, Any], where: str) -> RuntimeScope:
    dep, run = raw.get("deployment"), raw.get("runtime")
    if not isinstance(dep, dict) or not isinstance(run, dict):
        raise DataFileError(f"{where}: needs [deployment] and [runtime] tables; add them (see k3-hopper.toml)")
    w_dep, w_run = f"{where} [deployment]", f"{where} [runtime]"
    scope = RuntimeScope(
        subject=_get(raw, "subject", str, where),
        models=_get(raw, "models", list, where),
        cpu_models=tuple(raw.get("cpu_models", ())),
        tp=_get(dep, "tp", list, w_dep),
        dcp=_get(dep, "dcp", list, w_dep),
        max_batch=_get(dep, "max_batch", int, w_dep),
        prepared_batches=_get(dep, "prepared_batches", list, w_dep),
        max_tokens_per_request=_get(dep, "max_tokens_per_request", int, w_dep),
        specialized_sm_families=_get(run, "specialized_sm_families", list, w_run),
        mla_cache_dtype=_get(run, "mla_cache_dtype", str, w_run),
        kda_conv_state_dtype=_get(run, "kda_conv_state_dtype", str, w_run),
        kda_recurrent_state_dtype=_get(run, "kda_recurrent_state_dtype", str, w_run),
        specialized_cudagraph_modes=_get(run, "specialized_cudagraph_modes", list, w_run),
        spec_methods=_get(run, "spec_methods", list, w_run),
        specialized_step_modes=_get(run, "specialized_step_modes", list, w_run),
        specialized_checks=_checks(run, "specialized_checks", w_run),
        stock_checks=_checks(run, "stock_checks", w_run),
    )
    if bad := [b for b in scope.prepared_batches if not (isinstance(b, int) and 1 <= b <= scope.max_batch)]:
        raise DataFileError(f"{w_dep}: prepared_batches {bad} outside 1..max_batch ({scope.max_batch})")
    if bad := [d for d in scope.dcp if d not in ("1", "tp")]:
        raise DataFileError(f'{w_dep}: dcp entries {bad} are not "1" or "tp"')
    if bad := [m for m in scope.specialized_step_modes if m not in STEP_MODES]:
        raise DataFileError(f"{w_run}: specialized_step_modes {bad} are not among {list(STEP_MODES)}")
    return scope


def load_scope(subject_or_path: str | Path = "k3-hopper") -> RuntimeScope:
    """A shipped subject's scope (by name) or a TOML file with the same tables."""
    name = str(subject_or_path)
    if isinstance(subject_or_path, str) and name.replace("-", "").isalnum():
        shipped = resources.files("k3_decode.scope").joinpath(f"{name}.toml")
        if shipped.is_file():
            return parse_scope(tomllib.loads(shipped.read_text()), f"{name}.toml")
    path = Path(subject_or_path)
    if not path.is_file():
        raise DataFileError(f"unknown scope {name!r}: use a subject name such as 'k3-hopper' or a TOML file path")
    return parse_scope(tomllib.loads(path.read_text()), str(path))
