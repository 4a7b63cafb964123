"""`decode_backend` selection and the registry of specialized op providers.

vLLM 0.33.0 reads `additional_config["decode_backend"]` (vllm/models/kimi_k3/nvidia/model.py): "auto" means the
stock path, "latency_specialized" runs the scope checks, anything else raises. We read it the same way, with a
missing key meaning "auto".

Whether the specialized kernels are built is a query, not a flag: each specialized op is served by a provider that
the kernels package registers when its kernels can run on this machine (k3_decode/kernels/providers.py: CuTe DSL
and an sm_90 GPU); the runtime asks it at start-up. Selecting `latency_specialized` while any
op the op table routes to the specialized path lacks a provider fails at start-up, so the stock path never runs
under the specialized name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal, Protocol, get_args

from k3_decode.runtime.errors import BackendError
from k3_decode.runtime.optable import OpTable

DecodeBackend = Literal["auto", "latency_specialized"]
BACKENDS: tuple[DecodeBackend, ...] = get_args(DecodeBackend)
CONFIG_KEY = "decode_backend"


@dataclass(frozen=True)
class RowLimit:
    """The row counts (requests x tokens per request) a provider serves at one deployment, and why no others: the
    plan keeps its op stock at any row count outside `ranges`, with `why` in the ledger.

    `ranges` are inclusive (first, last) pairs, sorted and disjoint. Most providers serve 1..N (`up_to`); ranges let
    one serve where its kernel saved time with gaps between (the KDA projection at TP8: 1-8, 16 and 33-64, where a
    single limit would also take the sizes between, which lose to the stock op)."""

    ranges: tuple[tuple[int, int], ...]
    why: str  # "rows <provider> serves at TP<n> (<what was measured>)": the ledger's words after the row counts

    def __post_init__(self) -> None:
        # Checked here as well as in the providers' data files: a provider written in Python hands one over too,
        # and a range list the plan misreads would run a kernel where nobody measured it winning.
        pairs = tuple(tuple(r) for r in self.ranges if isinstance(r, (tuple, list)))
        ok = len(pairs) == len(self.ranges) > 0 and all(
            len(r) == 2 and all(isinstance(b, int) and not isinstance(b, bool) for b in r) for r in pairs
        )
        if not ok or any(not 1 <= r[0] <= r[1] for r in pairs):
            raise ValueError(f"a row limit is (first, last) ranges with 1 <= first <= last, got {self.ranges!r}")
        if any(b[0] <= a[1] for a, b in pairwise(pairs)):
            raise ValueError(f"a row limit's ranges must be sorted and disjoint, got {self.ranges!r}")
        object.__setattr__(self, "ranges", pairs)

    @classmethod
    def up_to(cls, rows: int, why: str) -> RowLimit:
        return cls(((1, int(rows)),), why)

    @classmethod
    def of(cls, limit: RowLimit | tuple[int, str]) -> RowLimit:
        """A provider's answer as a RowLimit: one already, or (most rows, why), the older form, for 1..most."""
        if isinstance(limit, RowLimit):
            return limit
        rows, why = limit
        return cls.up_to(rows, why)

    @property
    def most(self) -> int:
        return self.ranges[-1][1]

    def serves(self, rows: int) -> bool:
        return any(first <= rows <= last for first, last in self.ranges)

    def describe(self) -> str:
        """((1, 8), (16, 16), (33, 64)) -> "1-8, 16, 33-64"."""
        return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in self.ranges)

    def stock_reason(self, rows: int) -> str:
        """The ledger's reason for keeping the op stock at `rows`, which this limit does not serve. A 1..N limit says
        "above", as it always has (tests and readers of old ledgers match those words); ranges say "outside"."""
        if self.ranges[0][0] == 1 and len(self.ranges) == 1:
            return f"{rows} rows above the {self.most} {self.why}"
        return f"{rows} rows outside the {self.describe()} {self.why}"


class KernelProvider(Protocol):
    """A built specialized implementation of one op.

    `launches` maps each kernel name, as device-side counters and the profiler report it, to the number of launches
    one dispatch of the op makes; the ledger joins dispatch records with those counts.
    """

    @property
    def op(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def launches(self) -> Mapping[str, int]: ...


class ProviderRegistry:
    """Specialized op providers by op name. The kernels package registers into `PROVIDERS` on import."""

    def __init__(self) -> None:
        self._by_op: dict[str, KernelProvider] = {}

    def register(self, provider: KernelProvider) -> None:
        if provider.op in self._by_op:
            raise ValueError(
                f"op {provider.op!r} already has provider {self._by_op[provider.op].name!r}; "
                f"register one provider per op (got {provider.name!r} too)"
            )
        bad = {k: n for k, n in provider.launches.items() if not (isinstance(n, int) and n >= 1)}
        if not provider.launches or bad:
            raise ValueError(
                f"provider {provider.name!r} must declare each kernel it launches with a count >= 1, got "
                f"{dict(provider.launches)}; the ledger checks device counters against these counts"
            )
        self._by_op[provider.op] = provider

    def get(self, op: str) -> KernelProvider | None:
        return self._by_op.get(op)

    def ops(self) -> frozenset[str]:
        return frozenset(self._by_op)

    def __iter__(self) -> Iterator[KernelProvider]:
        return iter(self._by_op.values())

    def row_limits(self, tp: int) -> dict[str, RowLimit]:
        """Op -> the rows its provider serves at `tp` and why, for providers that name a limit: `served_rows(tp)`
        (a RowLimit) where the provider has it, else `max_rows(tp)` ((most rows, why): 1..most). An op without an
        entry is served at every prepared size."""
        limits: dict[str, RowLimit] = {}
        for provider in self._by_op.values():
            ask = getattr(provider, "served_rows", None) or getattr(provider, "max_rows", None)
            limit = ask(tp) if ask is not None else None
            if limit is not None:
                limits[provider.op] = RowLimit.of(limit)
        return limits

    def layer_row_limits(self, tp: int, dims: Any, layers: Iterable[int]) -> dict[tuple[str, int], RowLimit]:
        """(op, layer) -> the rows its provider serves at that layer and why, for providers whose limit depends on
        the layer (`layer_served_rows(tp, dims, layer)`, else `layer_max_rows`, that returns one); where given, it
        replaces the op's row_limits entry at that layer."""
        limits: dict[tuple[str, int], RowLimit] = {}
        for provider in self._by_op.values():
            ask = getattr(provider, "layer_served_rows", None) or getattr(provider, "layer_max_rows", None)
            for layer in layers if ask is not None else ():
                limit = ask(tp, dims, layer)
                if limit is not None:
                    limits[(provider.op, layer)] = RowLimit.of(limit)
        return limits

    def kept_stock(self, tp_all_reduce: bool) -> dict[str, str]:
        """Op -> why its provider cannot serve a deployment with (or without) the TP all-reduces, for providers
        with a `refuses(tp_all_reduce)` that names a reason; the plan keeps those ops stock, with the reason."""
        kept: dict[str, str] = {}
        for provider in self._by_op.values():
            refuses = getattr(provider, "refuses", None)
            reason = refuses(tp_all_reduce) if refuses is not None else None
            if reason is not None:
                kept[provider.op] = reason
        return kept

    def missing(self, table: OpTable) -> list[str]:
        """Ops the table routes to the specialized path that no provider serves, sorted."""
        return sorted(table.specialized_ops() - self.ops())


# Filled at start-up by k3_decode.kernels.providers.register_built where the kernels can run (runtime/startup.py).
PROVIDERS = ProviderRegistry()


def read_decode_backend(additional_config: Mapping[str, Any] | None) -> DecodeBackend:
    """The backend an additional_config-like mapping selects; a missing key (or no mapping) is "auto"."""
    if additional_config is None:
        return "auto"
    if not isinstance(additional_config, Mapping):
        raise BackendError(
            f"additional_config must be a mapping, got {type(additional_config).__name__}; "
            f'pass e.g. {{"{CONFIG_KEY}": "auto"}}'
        )
    value = additional_config.get(CONFIG_KEY, "auto")
    if value not in BACKENDS:
        raise BackendError(
            f"{CONFIG_KEY} {value!r} is not a decode backend; set additional_config[{CONFIG_KEY!r}] to one of "
            + ", ".join(repr(b) for b in BACKENDS)
        )
    return value


def select_backend(
    additional_config: Mapping[str, Any] | None,
    table: OpTable,
    registry: ProviderRegistry = PROVIDERS,
    *,
    not_built: str | None = None,
) -> DecodeBackend:
    """Read the backend and refuse `latency_specialized` when this build cannot run it; `not_built` says why the
    kernels package registered nothing here, for the message."""
    backend = read_decode_backend(additional_config)
    if backend == "latency_specialized":
        if not table.specialized_ops():
            raise BackendError(
                f"{CONFIG_KEY} 'latency_specialized' selected but the op table routes no op to the specialized "
                f"path, so every step would run stock under that name; use {CONFIG_KEY} 'auto'"
            )
        if missing := registry.missing(table):
            raise BackendError(
                f"{CONFIG_KEY} 'latency_specialized' selected but the specialized kernels are not built "
                f"(no provider for {', '.join(missing)}{': ' + not_built if not_built else ''}); use {CONFIG_KEY} "
                "'auto' for the stock path"
            )
    return backend
