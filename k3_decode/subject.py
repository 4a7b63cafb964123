"""The gate's view of the Kimi K3 subjects: their scope files and the config checks they imply."""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from harness.subjects import ConfigIssue
from k3_decode.config import ShardError, load_dims


def _ints(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class K3Subject:
    name: str
    scope_file: str
    default_model: str | None = None
    needs_vllm_section: bool = False

    @cached_property
    def scope_text(self) -> str:
        return resources.files("k3_decode.scope").joinpath(self.scope_file).read_text()

    @cached_property
    def scope(self) -> dict[str, Any]:
        return tomllib.loads(self.scope_text)

    def code_scope(self) -> dict[str, Any] | None:
        """The `[isolation]` table of the scope file (paths, globs, declared switches), or None if it has none.

        Its `coverage` table is the runtime half's (see `coverage_scope`), not a key of the static code scope."""
        section = self.scope.get("isolation")
        if section is None:
            return None
        return {key: value for key, value in section.items() if key != "coverage"}

    def coverage_scope(self) -> dict[str, Any] | None:
        """`[isolation.coverage]`: the specialized modules whose line coverage the isolation stage measures. Where
        the specialized kernels cannot run on this machine, every module glob is excluded with that reason: no
        suite can execute them here, so a floor would measure the machine, not the change (the check is NOT_RUN)."""
        table = self.scope.get("isolation", {}).get("coverage")
        if table is None or self.name != "k3-hopper":
            return table
        from k3_decode.kernels.providers import not_built_reason  # late: it imports torch

        if (reason := not_built_reason()) is None:
            return table
        why = f"the specialized kernels cannot run on this machine ({reason}), so no suite executes them here"
        return {**table, "exclude": {**table.get("exclude", {}), **dict.fromkeys(table["modules"], why)}}

    def isolation_suite(self, config: Any) -> Any:
        """The runtime isolation suite of the in-process subject (its executor under the write-set audit and proof
        of path); vLLM's subject proves its path through the vLLM plugin in the scope stage instead."""
        if self.name != "k3-hopper":
            return None
        from k3_decode.isolation_suite import K3IsolationSuite  # late: torch is needed only when the stage runs

        return K3IsolationSuite.from_config(self.name, config)

    def numerics_suite(self, config: Any) -> Any:
        """The numerics suite of the in-process subject; vLLM's subject is judged by its evals instead."""
        if self.name != "k3-hopper":
            return None
        from suites.k3.suite import K3Suite  # late: torch is needed only when the stage runs

        return K3Suite(self.name, config.data.get("model", self.default_model or "k3"))

    def distributed_numerics(self, config: Any) -> Any:
        """The numerics stage's tensor-parallel cells for a config with `parallel.mode = "distributed"` (one process
        per GPU), or None for a config that runs one rank's shard on one device."""
        if self.name != "k3-hopper":
            return None
        from suites.k3.tp import TpNumerics  # late: torch is needed only when the stage runs

        return TpNumerics.from_config(config)

    def kernel_builds(self) -> Any:
        """The specialized kernels `k3gate kernels build` compiles and checks; vLLM's subject builds none of ours."""
        if self.name != "k3-hopper":
            return None
        from k3_decode.kernels.builds import K3_KERNEL_BUILDS  # late: only the command needs it

        return K3_KERNEL_BUILDS

    def perf_suite(self, config: Any) -> Any:
        """The perf suite of the in-process subject; vLLM's subject is timed through vLLM, which is not built here."""
        if self.name != "k3-hopper":
            return None
        from k3_decode.perf import K3PerfSuite  # late: torch is needed only when the stage runs

        return K3PerfSuite.from_config(self.name, config)

    def describe(self) -> dict[str, Any]:
        return {
            "subject": self.name,
            "scope_file": f"k3_decode/scope/{self.scope_file}",
            "scope_sha256": hashlib.sha256(self.scope_text.encode()).hexdigest(),
            "models": self.scope["models"],
        }

    def config_issues(self, config: dict[str, Any]) -> list[ConfigIssue]:
        dep = self.scope["deployment"]
        issues: list[ConfigIssue] = []
        model = config.get("model", self.default_model)
        if model not in self.scope["models"]:
            issues.append(
                ConfigIssue(
                    "model",
                    f"{model!r} is not a model of subject {self.name}",
                    f"use one of {', '.join(self.scope['models'])}",
                )
            )
            return issues
        gpu = config["hardware"]["gpu"]
        if gpu == "none" and model not in self.scope["cpu_models"]:
            fix = (
                f"use model {self.scope['cpu_models'][0]!r} on the CPU or hardware.gpu = {dep['gpus'][0]!r}"
                if self.scope["cpu_models"]
                else f"set hardware.gpu = {dep['gpus'][0]!r}"
            )
            issues.append(ConfigIssue("hardware.gpu", f"{self.name} cannot run model {model} without a GPU", fix))
        elif gpu != "none" and gpu not in dep["gpus"]:
            issues.append(
                ConfigIssue(
                    "hardware.gpu",
                    f"{gpu} is outside the scope of {self.name}",
                    f"use one of {', '.join(dep['gpus'])}",
                )
            )
        if self.needs_vllm_section and "vllm" not in config:
            issues.append(
                ConfigIssue(
                    "vllm",
                    f"subject {self.name} drives a vLLM server but the config has no [vllm] table",
                    "add [vllm] with model and max_model_len",
                )
            )
        dims = load_dims(model)
        for tp in config["parallel"]["tp"]:
            if tp not in dep["tp"]:
                issues.append(
                    ConfigIssue(
                        "parallel.tp",
                        f"TP={tp} is outside the scope of {self.name}",
                        f"use one of {_ints(dep['tp'])}",
                    )
                )
                continue
            try:
                dims.shard(tp)
            except ShardError as exc:
                issues.append(
                    ConfigIssue(
                        "parallel.tp",
                        str(exc),
                        f"use a TP that divides the heads: {_ints(list(dims.parallel.tp_sizes))}",
                    )
                )
        allowed_dcp = set()
        for tp in config["parallel"]["tp"]:
            allowed_dcp |= {1 if d == "1" else tp for d in dep["dcp"]}
        for dcp in config["parallel"]["dcp"]:
            if dcp not in allowed_dcp:
                issues.append(
                    ConfigIssue(
                        "parallel.dcp",
                        f"DCP={dcp} is outside the scope (DCP must be 1 or TP)",
                        f"use one of {_ints(sorted(allowed_dcp))}",
                    )
                )
        wl = config["workload"]
        if big := [b for b in wl["batches"] if b > dep["max_batch"]]:
            issues.append(
                ConfigIssue(
                    "workload.batches",
                    f"batch {big[0]} is above the scope's maximum of {dep['max_batch']}",
                    f"keep batches at or below {dep['max_batch']}",
                )
            )
        if big := [q for q in wl["tokens_per_request"] if q > dep["max_tokens_per_request"]]:
            issues.append(
                ConfigIssue(
                    "workload.tokens_per_request",
                    f"{big[0]} tokens per request is above the scope's maximum of {dep['max_tokens_per_request']}",
                    f"keep tokens_per_request at or below {dep['max_tokens_per_request']}",
                )
            )
        max_ctx = wl.get("max_context", max(wl["contexts"]))
        if max_ctx > dep["max_context"]:
            issues.append(
                ConfigIssue(
                    "workload.max_context",
                    f"{max_ctx} is above the model's {dep['max_context']} positions",
                    f"use at most {dep['max_context']}",
                )
            )
        if long := [c for c in wl["contexts"] if c > max_ctx]:
            issues.append(
                ConfigIssue(
                    "workload.contexts",
                    f"context {long[0]} is above workload.max_context {max_ctx}",
                    "raise max_context or drop the context",
                )
            )
        return issues


K3_HOPPER = K3Subject("k3-hopper", "k3-hopper.toml")
VLLM_K3 = K3Subject("vllm-k3", "vllm-k3.toml", default_model="k3", needs_vllm_section=True)
