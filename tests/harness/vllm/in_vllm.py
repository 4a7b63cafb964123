"""Run a script under the vLLM venv's interpreter and read the JSON object it prints last."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from harness.runners import interpreter

REPO = Path(__file__).resolve().parents[3]


def json_from(vllm_python: interpreter.VllmPython, script: str, timeout: int = 300) -> Any:
    proc = subprocess.run(
        [vllm_python.path, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
