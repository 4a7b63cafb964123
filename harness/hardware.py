"""What accelerators this machine has, without importing torch when nvidia-smi can tell."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cache

# GPU product names as nvidia-smi prints them, mapped to the hardware kinds configs name.
_KINDS = (("GB300", "gb300"), ("B300", "gb300"), ("H200", "h200"))


@dataclass(frozen=True)
class Hardware:
    kind: str  # "none", a config kind ("h200", "gb300"), or "other"
    count: int
    names: tuple[str, ...] = ()
    compute_capability: str = ""
    driver: str = ""
    detail: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if self.count == 0:
            return "no CUDA GPU"
        cc = f", sm_{self.compute_capability.replace('.', '')}" if self.compute_capability else ""
        return f"{self.count}x {self.names[0]}{cc}"

    def satisfies(self, gpu: str, count: int) -> str | None:
        """None when this machine can run a config needing `count` GPUs of `gpu`, else why not."""
        if gpu == "none":
            return None
        if self.kind != gpu:
            return f"needs {count}x {gpu.upper()}, this machine has {self.describe()}"
        if self.count < count:
            return f"needs {count}x {gpu.upper()}, this machine has only {self.count}"
        return None


def kind_of(name: str) -> str:
    upper = name.upper()
    return next((kind for marker, kind in _KINDS if marker in upper), "other")


def _nvidia_smi() -> list[dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    fields = "name,compute_cap,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit"
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = fields.split(",")
    return [
        dict(zip(keys, (v.strip() for v in line.split(",")), strict=False)) for line in out.splitlines() if line.strip()
    ]


@cache
def detect() -> Hardware:
    gpus = _nvidia_smi()
    if not gpus:
        return Hardware(kind="none", count=0)
    names = tuple(g.get("name", "?") for g in gpus)
    return Hardware(
        kind=kind_of(names[0]),
        count=len(gpus),
        names=names,
        compute_capability=gpus[0].get("compute_cap", ""),
        driver=gpus[0].get("driver_version", ""),
        detail=gpus[0],
    )
