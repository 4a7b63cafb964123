"""Specialized CuTe DSL kernels for Hopper (sm_90a), one module per fused kernel.

Importing this package registers nothing: no kernel here is a specialized provider yet
(k3_decode/runtime/backend.py PROVIDERS stays empty). A kernel becomes selectable only once its GPU test has passed
against the oracle. Until then it is compiled and checked on the CPU by `k3gate kernels build --arch sm_90a`
(builds.toml lists what is built, expectations.toml what each build must look like).

- attn_res.py: AttnRes (prefix update, block save, mixing, RMSNorm) in one kernel; attn_res_plan.py: its kinds and
  launch plan without CuTe DSL; attn_res_op.py: the kernel on torch tensors, for the GPU test.
- kda_in_proj.py: the KDA input projection x[B, 7168] @ W[R, 7168]^T as a weight stream for decode batches;
  kda_in_proj_plan.py: its launch plan; kda_in_proj_op.py: on torch tensors, for the GPU test.
- cutedsl.py: compiling without a GPU (toolchain check, fake tensors, PTX/cubin/SASS); builds.py: the build set.
"""
