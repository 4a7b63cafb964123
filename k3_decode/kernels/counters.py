"""Device-side execution counters: one Int32 per kernel and device that every launch increments on the device.

They prove a kernel ran where host-side bookkeeping cannot: inside CUDA-graph replays, where the host launches the
graph and not the kernel. Each kernel adds one with a relaxed atomic from a single thread after its dependency wait
(one atomic per launch, off every critical path), so the counters are in every build rather than in a separate
audit build, and a count is available in any run. The ledger compares them with the launches it claims
(k3_decode/runtime/ledger.py `check_execution`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def device_counter(counters: dict[int, Tensor], device: torch.device) -> Tensor:
    """The counter of `device` in `counters` (one kernel's table), created at zero on first use. Its address is
    fixed for the life of the process, so CUDA graphs that captured it keep counting into it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    counter = counters.get(index)
    if counter is None:
        counter = counters[index] = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
    return counter
