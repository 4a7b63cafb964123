"""The k3-hopper decode runtime: what runs where, and the evidence of it.

- `backend`: `decode_backend` from an additional_config-like mapping, and the registry of specialized op providers
  whose emptiness means "the specialized kernels are not built".
- `optable` (data: `ops.toml`): the ops of each layer part and which of them the specialized path covers.
- `scope`: start-up deployment checks read from the subject's scope file, and agreement of verdicts across ranks.
- `startup`: the three above composed into the one call an executor makes before it builds anything.
- `plan`: the per-step, per-layer, per-op routing between the specialized and the stock path.
- `ledger` (schema: `ledger.schema.json`): every routing decision as a record, joined with CUDA-graph replays,
  device-side launch counters and profiler kernel names.
- `writeset` and `audit`: what a step declares it may write, and the comparison of tensors before and after it.
"""
