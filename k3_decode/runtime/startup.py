"""Start-up: the backend, the scope verdict (agreed across ranks) and what the plan needs, in one call.

The order is fixed: read `decode_backend` and refuse `latency_specialized` when its kernels are not built (no
deployment could run it), then the scope checks. A rank computes its scope verdict without raising, so that every
rank reaches the agreement step; only the agreed verdict raises. A rank that raised alone would leave the others
waiting in their first collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3_decode.config import ModelDims
from k3_decode.runtime.backend import PROVIDERS, DecodeBackend, ProviderRegistry, RowLimit, select_backend
from k3_decode.runtime.ledger import KernelCatalog
from k3_decode.runtime.optable import OpTable, load_op_table
from k3_decode.runtime.plan import Planner, PreparedSizes
from k3_decode.runtime.scope import Deployment, ScopeVerdict, agreed_verdict, scope_verdict
from k3_decode.runtime.scopefile import RuntimeScope, load_scope

# Gathers every TP rank's verdict, in rank order (the multi-GPU executor wraps torch.distributed.all_gather_object).
GatherVerdicts = Callable[[ScopeVerdict], Sequence[ScopeVerdict]]


@dataclass(frozen=True)
class Runtime:
    backend: DecodeBackend
    deployment: Deployment
    verdict: ScopeVerdict
    scope: RuntimeScope
    table: OpTable
    prepared: PreparedSizes
    registry: ProviderRegistry

    def planner(self, dims: ModelDims, layers: Sequence[int]) -> Planner:
        return Planner(
            backend=self.backend,
            table=self.table,
            prepared=self.prepared,
            specialized_modes=self.scope.specialized_step_modes,
            dims=dims,
            layers=tuple(layers),
            op_rows=self.op_rows(),
            layer_rows=self.registry.layer_row_limits(self.deployment.tp, dims, layers),
            op_stock=self.registry.kept_stock(self.deployment.tp_all_reduce),
        )

    def op_rows(self) -> dict[str, RowLimit]:
        """The row limits of the registered providers at this deployment's TP size."""
        return self.registry.row_limits(self.deployment.tp)

    def kernel_catalog(self, stock: Mapping[str, Mapping[str, int]] | None = None) -> KernelCatalog:
        return KernelCatalog.build(self.registry, stock)


def register_providers(registry: ProviderRegistry) -> str | None:
    """Let the kernels package register its providers into the shipped registry where they can run (a private
    registry is the caller's own); returns why nothing was registered here, for the refusal's message."""
    if registry is not PROVIDERS:
        return None
    from k3_decode.kernels.providers import register_built

    return register_built(PROVIDERS)


def start(
    additional_config: Mapping[str, Any] | None,
    deployment: Deployment,
    *,
    scope: RuntimeScope | None = None,
    table: OpTable | None = None,
    registry: ProviderRegistry = PROVIDERS,
    gather: GatherVerdicts | None = None,
) -> Runtime:
    """Everything an executor checks before it builds anything; raises a one-line StartupError otherwise."""
    scope = scope or load_scope("k3-hopper")
    table = table or load_op_table()
    backend = select_backend(additional_config, table, registry, not_built=register_providers(registry))
    verdict = scope_verdict(deployment, scope, backend)
    if gather is not None:
        verdict = agreed_verdict(gather(verdict), deployment.tp)
    verdict.raise_if_rejected()
    prepared = PreparedSizes.build(scope, deployment.tokens_per_request, deployment.capture_sizes)
    return Runtime(backend, deployment, verdict, scope, table, prepared, registry)
