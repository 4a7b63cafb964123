"""The sanitizer's red team: a Triton kernel that reads far outside its input, which memcheck must flag.

A clean memcheck run proves something only if the same setup catches a known out-of-bounds access: this kernel
is run under the same options (and allocator settings) as the stock kernels, and the run fails unless memcheck
attributes errors to it. Without a sanitizer the read faults or returns garbage; never run it outside one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NAME = "k3san_oob_kernel"
# Elements past the end of the input the kernel starts reading at: 1 GiB of FP32 beyond a 400-byte tensor, far
# from any allocation of the small process that runs it (and still inside int32 offset arithmetic).
OFFSET = 1 << 28


@triton.jit
def k3san_oob_kernel(x_ptr, out_ptr, n, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    # The bug on purpose: no mask, and the index starts OFFSET elements past the end of x.
    v = tl.load(x_ptr + n + OFFSET + offs)
    tl.store(out_ptr + offs, v, mask=offs < n)


def run(device: torch.device) -> None:
    x = torch.ones(100, dtype=torch.float32, device=device)
    out = torch.zeros_like(x)
    k3san_oob_kernel[(1,)](x, out, x.numel(), OFFSET=OFFSET, BLOCK=128)
