"""Copy bandwidth of a torch device, measured in the run it serves as the roofline's ceiling.

A copy of `nbytes` reads and writes each byte once, so it moves 2 * nbytes. The buffer must be larger than the
last-level cache, or the figure is the cache's bandwidth and every roofline fraction comes out too low.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from harness.perf.suite import Bandwidth


def copy_bandwidth(device: Any, nbytes: int, reps: int = 5, warmup: int = 2) -> Bandwidth:
    import torch

    device = torch.device(device)
    # Any content will do; filling touches every page, so the first timed copy does not pay for page faults.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0x5A)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    timer = "CUDA events" if device.type == "cuda" else "host clock"
    method = f"{device.type} copy of {nbytes} bytes, median of {reps} ({timer})"
    return Bandwidth(2 * nbytes / median, 2 * nbytes, median, method)
