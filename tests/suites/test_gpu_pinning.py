"""One xdist worker per GPU: the assignment logic, the controller plugin, the worker side, and an end-to-end run of
pytest -n 2 against a stand-in nvidia-smi listing two GPUs (so it runs on a machine without any)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import WORKER_GPU_KEY, GpuPinning, gpu_for_worker, pin_this_worker, visible_gpus

TWO_GPUS = "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbbb)\n"


def test_each_worker_gets_its_own_gpu_round_robin():
    gpus = ["0", "1", "2", "3"]
    assert [gpu_for_worker(f"gw{i}", gpus) for i in range(4)] == gpus
    assert gpu_for_worker("gw5", gpus) == "1"  # more workers than GPUs: shared, round robin
    assert gpu_for_worker("gw0", []) is None  # no GPU: no pinning
    assert gpu_for_worker("master", gpus) is None


def test_visible_gpus_honours_cuda_visible_devices_before_nvidia_smi():
    def listing() -> str:
        return TWO_GPUS

    assert visible_gpus({}, listing) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, 7"}, listing) == ["4", "5", "7"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, listing) == ["GPU-bbbb"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, listing) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, listing) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, listing) == ["2"]  # CUDA stops at an invalid entry
    assert visible_gpus({}, lambda: "") == []  # no nvidia-smi


def test_controller_plugin_writes_the_gpu_into_workerinput():
    plugin = GpuPinning(["6", "7"])
    nodes = [SimpleNamespace(workerinput={"workerid": f"gw{i}"}) for i in range(3)]
    for node in nodes:
        plugin.pytest_configure_node(node)
    assert [n.workerinput[WORKER_GPU_KEY] for n in nodes] == ["6", "7", "6"]


def test_worker_sets_cuda_visible_devices_only_when_given_a_gpu():
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert pin_this_worker(SimpleNamespace(workerinput={"workerid": "gw1", WORKER_GPU_KEY: "1"}), env) == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    untouched = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert pin_this_worker(SimpleNamespace(workerinput={"workerid": "gw0", WORKER_GPU_KEY: None}), untouched) is None
    assert pin_this_worker(SimpleNamespace(), untouched) is None  # not an xdist worker
    assert untouched == {"CUDA_VISIBLE_DEVICES": "0,1"}


def _run_probe(tmp_path: Path, extra_env: dict[str, str]) -> dict[str, str]:
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{TWO_GPUS.replace(chr(10), chr(92) + 'n')}'\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"PATH": f"{fake}{os.pathsep}{env.get('PATH', '')}", "K3GATE_PINNING_PROBE_OUT": str(out), **extra_env}
    probe = Path(__file__).with_name("_pinning_probe.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", str(probe)],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "xdist GPU pinning" in proc.stdout
    return {p.name: p.read_text() for p in out.iterdir()}


@pytest.mark.slow
def test_pytest_n2_pins_each_worker_to_one_gpu(tmp_path):
    seen = _run_probe(tmp_path, {})
    by_worker = {name.split("-")[0]: gpu for name, gpu in seen.items()}
    assert len(seen) == 4 and by_worker == {"gw0": "0", "gw1": "1"}


@pytest.mark.slow
def test_pytest_n2_pins_within_the_gpus_cuda_visible_devices_allows(tmp_path):
    seen = _run_probe(tmp_path, {"CUDA_VISIBLE_DEVICES": "3,5"})
    assert {name.split("-")[0]: gpu for name, gpu in seen.items()} == {"gw0": "3", "gw1": "5"}


@pytest.mark.gpu
def test_this_worker_sees_exactly_one_gpu(worker_id):
    """On the GPU machine under `pytest -n <gpus> -m gpu`: each worker's process sees one device."""
    import torch

    if worker_id == "master":
        pytest.skip("run under xdist (-n <gpus>) to check the pinning")
    assert torch.cuda.device_count() == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["CUDA_VISIBLE_DEVICES"].strip()
