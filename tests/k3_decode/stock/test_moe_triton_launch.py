"""Runs test_moe_triton.py in a fresh Python with TRITON_INTERPRET=1 (Triton reads it once, at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve()
EXPECTED_PASSED = 19  # test_moe_triton.py's tests, parametrized cases counted: a silently skipped one fails this
ROOT = HERE.parents[3]


@pytest.mark.slow
def test_stock_moe_triton_kernels_under_the_cpu_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this run already interprets Triton: test_moe_triton.py runs in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE.with_name("test_moe_triton.py"))]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert f"{EXPECTED_PASSED} passed" in run.stdout and "skipped" not in run.stdout, tail
