"""Triton kernels of the stock MoE path: routing, MXFP4 (W4A16) fused-MoE experts, RMSNorm and SiTU-and-mul.

They stand in for the CUDA kernels vLLM 0.33.0 runs on an H200 that no public package gives us (its `grouped_topk`
routing, `moe_align_block_size`, the Marlin/Humming MXFP4 MoE GEMMs, `moe_sum`, `situ_and_mul`, the latent RMSNorm).
Every kernel is plain Triton, so it also runs under TRITON_INTERPRET=1 on the CPU at small shapes; the expert GEMMs
decode MXFP4 with a block of inline PTX on the GPU and with a plain-Triton twin of the same values when interpreted.
"""
