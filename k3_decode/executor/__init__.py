"""The stack executor: N consecutive real-shape Kimi K3 layers on one rank's shard, decoding many requests.

- `config` (data: `stacks.toml`): which layers, TP size, requests, context, graph batches.
- `memory` (data: `memory.toml`): the memory plan printed at start; a stack that does not fit is refused.
- `state`: KDA state slots and paged FP8 MLA caches of every request, and each step's slot tables.
- `inputs`: the AttnRes state a token carries into the stack.
- `forward`: one decode iteration through the layers on the stock ops, on fixed step buffers.
- `opmap` (data: `ops.toml`): which stock ops carry each runtime op, for the ledger's kernel catalog.
- `executor`: steps through the runtime's Planner into the dispatch ledger, eagerly or as CUDA-graph replays.
- `audit`: one step with every owned tensor checked outside the step's declared write set.
- `oracle`: the reference decoder's layers, teacher-forced with the executor's layer inputs.
- `attribution`, `roofline`: profiler kernels per stock op, and the bytes each op must move (benchmarks).
"""

from k3_decode.executor.audit import AuditedStep, audit_step
from k3_decode.executor.config import StackConfig, StackConfigError, load_stack, stack_names
from k3_decode.executor.executor import StackExecutor, StepRequest, StepResult, StepRoutingError
from k3_decode.executor.inputs import StackInput, random_input
from k3_decode.executor.memory import DeviceBudget, MemoryPlan, MemoryPlanError, plan_memory

__all__ = [
    "AuditedStep",
    "DeviceBudget",
    "MemoryPlan",
    "MemoryPlanError",
    "StackConfig",
    "StackConfigError",
    "StackExecutor",
    "StackInput",
    "StepRequest",
    "StepResult",
    "StepRoutingError",
    "audit_step",
    "load_stack",
    "plan_memory",
    "random_input",
    "stack_names",
]
