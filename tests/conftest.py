"""Shared fixtures: an isolated k3gate config folder so tests never touch the user's signing key; and, under
pytest-xdist on a machine with GPUs, one GPU per worker.

GPU pinning: `pytest -n <gpus> -m gpu` runs one worker per GPU. The controller lists the GPUs this process may
use (CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`) and hands worker gwN the N-th of them (round robin when
there are more workers than GPUs, which the report header says); the worker sets CUDA_VISIBLE_DEVICES to that one
GPU before anything initializes CUDA, so every test in it sees exactly one device, `cuda:0`. Without GPUs, or
without xdist, nothing changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

# CuTe DSL reads its target arch when cutlass is first imported and writes SASS only for that arch, silently: a
# test compiling in this process for sm_90a must find it set before any test module imports cutlass.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

WORKER_GPU_KEY = "k3gate_gpu"  # the workerinput entry carrying a worker's GPU
_GPUS = pytest.StashKey[list]()  # the controller's GPU list, for the report header


@pytest.fixture(autouse=True)
def _isolated_key_folder(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))


def pytest_collection_modifyitems(config, items):
    """GPU tests run on the accelerator machine; elsewhere they are skipped with that reason, never passed."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the accelerator machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- one GPU per xdist worker -------------------------------------------------------------------------------------


def _nvidia_smi_list() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        return subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def visible_gpus(environ: dict[str, str] | None = None, list_gpus: Callable[[], str] = _nvidia_smi_list) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs), in order.

    A CUDA_VISIBLE_DEVICES that is set wins (empty or -1: no GPU); otherwise every GPU `nvidia-smi -L` lists.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        entries = [e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual way to hide every GPU.
        return entries[: next((i for i, e in enumerate(entries) if e.startswith("-")), len(entries))]
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", list_gpus(), flags=re.MULTILINE)]


def gpu_for_worker(worker_id: str, gpus: list[str]) -> str | None:
    """The GPU of xdist worker `gwN`: the N-th visible GPU, round robin; None without GPUs or for a non-worker."""
    m = re.fullmatch(r"gw(\d+)", worker_id)
    if not gpus or m is None:
        return None
    return gpus[int(m.group(1)) % len(gpus)]


class GpuPinning:
    """Controller-side xdist plugin: tells each worker its GPU through workerinput."""

    def __init__(self, gpus: list[str]):
        self.gpus = gpus

    def pytest_configure_node(self, node) -> None:
        node.workerinput[WORKER_GPU_KEY] = gpu_for_worker(node.workerinput["workerid"], self.gpus)


def pin_this_worker(config, environ: dict[str, str] | None = None) -> str | None:
    """Worker side: restrict this process to its GPU (before CUDA starts); returns it, or None if not pinned."""
    env = os.environ if environ is None else environ
    gpu = getattr(config, "workerinput", {}).get(WORKER_GPU_KEY)
    if gpu is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise pytest.UsageError(
            "CUDA started before the GPU pinning could set CUDA_VISIBLE_DEVICES; do not touch CUDA at import time"
        )
    env["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):
        pin_this_worker(config)
    elif config.pluginmanager.hasplugin("xdist"):
        gpus = visible_gpus()
        config.stash[_GPUS] = gpus
        if gpus:
            config.pluginmanager.register(GpuPinning(gpus), "k3gate-gpu-pinning")


def pytest_report_header(config) -> str | None:
    gpus = config.stash.get(_GPUS, [])
    workers = getattr(config.option, "numprocesses", None)
    if not gpus or not workers:
        return None
    line = f"xdist GPU pinning: worker gwN gets GPU N of [{', '.join(gpus)}] (CUDA_VISIBLE_DEVICES)"
    if isinstance(workers, int) and workers > len(gpus):
        line += f"; {workers} workers share {len(gpus)} GPUs: use -n {len(gpus)} for one worker per GPU"
    return line
