"""The two arms of a vLLM comparison, built from a config's [vllm] table.

Both arms get the same weights, seed, dtype, lengths, CUDA-graph settings and extra arguments; they differ only
in `additional_config.decode_backend` (baseline `auto`, candidate e.g. `latency_specialized`). Tests may add
environment (a red-team perturbation) to one arm; that never comes from a config.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.runners import interpreter, tiny_model
from harness.runners.server import ServerSpec
from harness.vllm_plugin import PATH_DIR_ENV

FORCING_PROCESSOR = "harness.vllm_plugin.forcing:ForcedTokens"
BASELINE, CANDIDATE = "baseline", "candidate"


@dataclass(frozen=True)
class Deployment:
    tp: int
    dcp: int

    def label(self) -> str:
        return f"tp{self.tp}-dcp{self.dcp}"


@dataclass(frozen=True)
class ArmOverrides:
    """Extra environment per arm, for red-team runs only (e.g. {"candidate": {"K3GATE_PERTURB": "wrong_sampler"}})."""

    env: dict[str, dict[str, str]] = field(default_factory=dict)


def deployments(config: dict[str, Any]) -> list[Deployment]:
    par = config["parallel"]
    return [Deployment(tp, dcp) for tp, dcp in itertools.product(par["tp"], par["dcp"]) if dcp in (1, tp)]


def resolve_model(model: str, python: str) -> str:
    if model.startswith(tiny_model.GENERATED_PREFIX):
        return str(tiny_model.ensure(model.removeprefix(tiny_model.GENERATED_PREFIX), python))
    return model


def backends(vllm: dict[str, Any]) -> dict[str, str]:
    return {
        BASELINE: vllm.get("baseline_backend", "auto"),
        CANDIDATE: vllm.get("candidate_backend", "latency_specialized"),
    }


def arm_spec(
    vllm: dict[str, Any],
    arm: str,
    deployment: Deployment,
    python: str,
    model_path: str,
    path_dir: Path,
    overrides: ArmOverrides | None = None,
) -> ServerSpec:
    extra = list(vllm.get("extra_args", []))
    if deployment.dcp > 1:
        extra += ["--decode-context-parallel-size", str(deployment.dcp)]
    env = {PATH_DIR_ENV: str(path_dir.resolve())}
    if overrides is not None:
        env.update(overrides.env.get(arm, {}))
    return ServerSpec(
        python=python,
        model=model_path,
        served_model_name=vllm.get("served_model_name", "model"),
        decode_backend=backends(vllm)[arm],
        max_model_len=vllm["max_model_len"],
        tensor_parallel_size=deployment.tp,
        dtype=vllm.get("dtype", "auto"),
        seed=vllm.get("seed", 0),
        enforce_eager=vllm.get("enforce_eager", False),
        cudagraph_mode=vllm.get("cudagraph_mode"),
        gpu_memory_utilization=vllm.get("gpu_memory_utilization"),
        kv_cache_memory_bytes=vllm.get("kv_cache_memory_bytes"),
        logits_processors=(FORCING_PROCESSOR,) if vllm.get("teacher_forcing", True) else (),
        structured_outputs_config=_json_or_none(vllm.get("structured_outputs_config")),
        extra_args=tuple(extra),
        env=tuple(sorted(env.items())),
        startup_timeout_s=vllm.get("startup_timeout_s", 900),
    )


def _json_or_none(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def locate(vllm: dict[str, Any]) -> tuple[interpreter.VllmPython, str]:
    """(the vLLM interpreter, the model path); raises interpreter.VllmUnavailable when vLLM is not installed."""
    python = interpreter.find()
    return python, resolve_model(vllm["model"], python.path)
