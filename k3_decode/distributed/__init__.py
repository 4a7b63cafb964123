"""Tensor parallelism across processes (one per GPU): the TP group and its start-up agreement, the all-reduce
transports (NCCL, the rank-order two-shot through collectives, and the same rule in one Triton launch over peer
memory with fused epilogues), the executor's row-parallel combines over them, and the TP stack driver."""
