"""The environment stage: capture what a reviewer needs to reproduce the run."""

from __future__ import annotations

import json
from dataclasses import dataclass

from harness import environment
from harness.stages.base import StageContext
from harness.verdicts import Check, StageRecords


@dataclass(frozen=True)
class EnvironmentStage:
    name: str = "environment"
    description: str = "OS, Python, packages, GPU and driver, allow-listed variables, git state"
    needs_hardware: bool = False

    def run(self, ctx: StageContext) -> StageRecords:
        ctx.progress("capturing the environment", None)
        env = environment.capture()
        root = ctx.bundle_dir / "env"
        root.mkdir(parents=True, exist_ok=True)
        (root / "environment.json").write_text(json.dumps(env.summary, indent=2, sort_keys=True) + "\n")
        (root / "packages.txt").write_text("\n".join(env.packages) + "\n")
        if env.nvidia_smi is not None:
            (root / "nvidia-smi.txt").write_text(env.nvidia_smi)
        git = env.summary["k3gate"]["git"]
        source_known = git["commit"] is not None or not env.summary["k3gate"]["version"].startswith("unknown")
        leaked = [k for k in env.summary["env"] if environment.SECRET_PATTERN.search(k)]
        # The GPU the config needs must be the GPU recorded, or the GPU stages must not claim to have run.
        checks = [
            Check("packages recorded", env.summary["packages_count"], ">=", 1),
            Check("k3gate source identified (git commit or installed version)", source_known, "==", True),
            Check("no credential-like variables recorded", len(leaked), "==", 0, ", ".join(leaked)),
        ]
        metrics = {
            "gpu": env.summary["gpu"]["kind"],
            "gpu_count": env.summary["gpu"]["count"],
            "torch": env.summary["torch"].get("version"),
            "git_commit": git["commit"],
            "git_dirty": git["dirty"],
        }
        return StageRecords(stage=self.name, checks=checks, metrics=metrics)
