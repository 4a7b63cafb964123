"""Triton kernels of the stock path's attention side; imported only when a stock op runs on CUDA (or by tests
under Triton's CPU interpreter)."""

# Launch options of every stock kernel with a reduction over registers: no FP contraction. Contracting a product
# into a butterfly shuffle's first add makes the lanes' sums differ in their last bits, and Triton then stores
# several lanes' "identical" partials to one shared-memory word: a write-after-write race with different values
# (racecheck found it in kda_decode_kernel on the H200). harness/ptx_lint.py finds such steps in PTX; the compile
# tests hold every stock kernel to zero. Triton turns contraction off by default from 3.10.
LANE_SYMMETRIC = {"enable_fp_fusion": False}
