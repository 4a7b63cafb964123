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


def device_counter(counters: dict[int, Tensor], device: torch.device, size: int = 1) -> Tensor:
    """The counter of `device` in `counters` (one kernel's table), created at zero on first use; word 0 is the
    count. Its address is fixed for the life of the process, so CUDA graphs that captured it keep counting into it,
    unless a traced kernel asks for more words (`size`, phase_trace.py) than it has: it is then made anew, larger,
    with the count carried over (trace before capturing graphs)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    counter = counters.get(index)
    if counter is None or counter.numel() < size:
        grown = torch.zeros(size, dtype=torch.int32, device=torch.device("cuda", index))
        if counter is not None:
            grown[0] = counter[0]
        counter = counters[index] = grown
    return counter


def leading(counter: Tensor, words: int) -> Tensor:
    """The first `words` words of `counter`, what a launch compiled for that length takes: the counter itself
    when it has exactly that many (every untraced launch in a process that never traced), so the common path makes
    no tensor view per launch."""
    return counter if counter.numel() == words else counter[:words]


def count(counters: dict[int, Tensor]) -> int:
    """The launches every device's counter in `counters` has seen (reads them: synchronizes)."""
    return sum(int(c[0].item()) for c in counters.values())
