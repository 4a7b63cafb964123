"""GPU clocks, temperature and power before and after a measurement, from nvidia-smi when it is present.

A cell timed while the GPU throttled is slower for a reason that is not the code; the readings around every cell
let a reviewer see that. Without nvidia-smi the snapshot says so instead of inventing numbers.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

CORE_FIELDS = ("index", "clocks.sm", "clocks.mem", "clocks.max.sm", "temperature.gpu", "power.draw")
# Named differently across drivers (the older name is deprecated); asked separately so one missing name costs only it.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _query(exe: str, fields: tuple[str, ...]) -> list[dict[str, str]] | None:
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return [dict(zip(fields, (v.strip() for v in row), strict=False)) for row in rows]


def snapshot(exe: str | None = None) -> dict[str, Any]:
    """Per-GPU readings now, or {"available": False, "reason": ...}."""
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False, "reason": "nvidia-smi not found: no GPU clocks to record"}
    gpus = _query(exe, CORE_FIELDS)
    if gpus is None:
        return {"available": False, "reason": f"{exe} --query-gpu failed: no GPU clocks to record"}
    for fields in ((f,) for f in REASON_FIELDS):
        reasons = _query(exe, fields)
        if reasons is not None and len(reasons) == len(gpus):
            for gpu, row in zip(gpus, reasons, strict=True):
                gpu["clock_event_reasons"] = row[fields[0]]
            break
    return {"available": True, "gpus": gpus}
