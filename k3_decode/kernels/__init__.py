"""Specialized CuTe DSL kernels for Hopper (sm_90a), one module per fused kernel.

A kernel becomes a specialized provider (providers.py) only once its GPU test has passed against the oracle on an
H200; AttnRes before attention and the KDA input projection have. The runtime registers them at start-up where they
can run (CuTe DSL and an sm_90 GPU). Every kernel is also compiled and checked on the CPU by `k3gate kernels build
--arch sm_90a` (builds.toml lists what is built, expectations.toml what each build must look like).

- attn_res.py: AttnRes (prefix update, block save, mixing, RMSNorm) in one kernel; attn_res_plan.py: its kinds and
  launch plan without CuTe DSL; attn_res_op.py: the kernel on torch tensors (the provider and the GPU test).
- kda_in_proj.py: the KDA input projection x[B, 7168] @ W[R, 7168]^T as a weight stream for decode batches;
  kda_in_proj_plan.py: its launch plan; kda_in_proj_op.py: on torch tensors (the provider and the GPU test).
- kda_in_proj_mma.py: the same projection on tensor cores (mma.sync); kda_in_proj_mma_plan.py: its launch plan;
  kda_in_proj_choice.toml: which of the two builds serves a weight and batch.
- kda_o_proj.py: o_proj with the AttnRes after attention in one launch; kda_step.py: the fused KDA decode and
  verify step; each with its _plan.py and _op.py; kda_step_group.py: the step with two requests a cluster;
  kda_step_choice.toml: the step's register budget, L2 warming, requests per cluster and local
  decays by batch.
- primitives.py: the device helpers the kernels share (16-byte loads, warp sums, the resident PDL launch).
- providers.py: the four kernels as runtime providers (ops attn_res, in_proj, kda, o_proj of KDA layers) and when
  they register.
- cutedsl.py: compiling without a GPU (toolchain check, fake tensors, PTX/cubin/SASS); builds.py: the build set.
"""
