"""Run only by test_gpu_pinning.py, in a pytest subprocess with xdist: each worker records the GPU it was given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.mark.parametrize("n", range(4))
def test_record_the_pinned_gpu(n: int, worker_id: str) -> None:
    out = Path(os.environ["K3GATE_PINNING_PROBE_OUT"])
    (out / f"{worker_id}-{n}").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
