"""Following vLLM's V2 model runner through its FULL CUDA graphs, where no forward context is entered.

The V2 runner (vllm/v1/worker/gpu/, vLLM 0.32.0 and 0.33.0) captures a FULL graph per BatchExecutionDescriptor
and replays it without running any model Python or entering a forward context (0.33.0 line numbers):
- cudagraph_utils.py:754-777 `forward_fn`: the capture pass runs the model inside `torch.cuda.graph` under a forward
  context with runtime mode NONE and only a token count as batch descriptor (forward_context.py:332 fills one in),
  so the recorder cannot tell which graph a decision made there belongs to;
- cudagraph_utils.py:512: right after that pass, the graph is stored as `self.graphs[desc] = graph`;
- model_runner.py:1832 `dispatch_cg_and_sync_dp` calls the manager's `dispatch(num_reqs, num_tokens,
  uniform_token_count, num_active_loras, max_query_len=None, num_ubatches=1)` (cudagraph_utils.py:523) with the
  batch's own shape; model_runner.py:1811 passes max_query_len=None for any batch with a prompt row;
- model_runner.py:2059: a FULL step is `self.cudagraph_manager.run_fullgraph(batch_desc)` (cudagraph_utils.py:555,
  790), nothing else.

So the plugin follows three things on the manager instance the runner owns: `graphs` (each stored graph takes the
decision of the forward pass that was just captured into it), `dispatch` (the real batch behind the next replay),
and `run_fullgraph` (one counted step per replay, joined with its graph's capture-time decision). The manager
exists only once the KV cache is allocated (model_runner.py:766), after the model is loaded, so the plugin wraps
the runner's own `capture_model` (model_runner.py:1086) to reach the manager that is about to capture; a manager
created again later (profiling, elastic EP) is followed when it captures. vLLM hands a plugin the loaded model,
never the runner: the loader hook (hooks.py) finds the runner among the loader's callers (`find_runner`), and where
it finds none the snapshot says so (`NOT_V2`).

Why an instrument may do this although the isolation rules forbid patching in model code: these are attributes of
one runner's own instances, assigned by the judge, not by the model under review. No class, module or shared
object changes: another runner or manager in the process (a drafter's own graph manager, say) is untouched, the
wrapped methods call the originals with the same arguments and return their results unchanged, and the stored
graphs are the same objects in a dict that only also reports what is stored. The isolation AST rules
(harness/isolation/hygiene.py) flag stores into imported names; the tests run them over this file.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

MARK = "k3gate_observed"
RUNNER_HOOKS = ("capture_model", "execute_model")
MANAGER_HOOKS = ("dispatch", "run_fullgraph", "graphs")
FOLLOWED = "V2 model runner: every run_fullgraph replay is counted with the decision made when its graph was captured"
NOT_V2 = (
    "no V2 model runner among the model loader's callers: FULL-graph replays are counted where vLLM enters a "
    "forward context (the V1 model runner)"
)
# How far up from the loader to look for the runner: the V2 runner calls the loader directly (model_runner.py:403);
# a loader subclass that overrides load_model and calls super() adds a frame or two.
SEARCH_DEPTH = 8


class GraphsUnavailable(TypeError):
    """The runner or its graph manager lacks what the plugin follows; the recorder states it and replays go
    uncounted (a coverage failure, never a pass)."""


class Sink(Protocol):
    """What the plugin reports to (the path recorder)."""

    def graph_stored(self, key: str) -> None: ...

    def graphs_dropped(self, keys: list[str]) -> None: ...

    def replay(self, key: str, shape: str, tokens: int | None, reqs: int | None) -> None: ...

    def set_replays(self, note: str) -> None: ...


@dataclass(frozen=True)
class BatchFacts:
    """One dispatch: the batch's own shape and the descriptor chosen for it."""

    num_reqs: int | None
    num_tokens: int | None
    uniform_token_count: int | None
    max_query_len: int | None
    desc: Any


def execution_key(desc: Any) -> str:
    """A stable text for a BatchExecutionDescriptor (cudagraph_utils.py:70-85): every field that selects a graph."""
    fields = (
        ("tokens", "num_tokens"),
        ("reqs", "num_reqs"),
        ("uniform_token_count", "uniform_token_count"),
        ("max_query_len", "max_query_len"),
        ("loras", "num_active_loras"),
        ("ubatches", "num_ubatches"),
    )
    return ",".join(f"{label}={getattr(desc, attr, None)}" for label, attr in fields)


def replay_shape(desc: Any, facts: BatchFacts | None) -> str:
    """decode, prefill_or_mixed or unknown for one replay, in the recorder's shape vocabulary.

    The batch's own dispatch arguments decide when they are known: a uniform token count is set only for a batch
    eligible for a decode graph, and max_query_len is None for any batch with a prompt row (model_runner.py:1811).
    Without them, a uniform or varlen decode graph can only have been dispatched to a decode batch
    (`_is_compatible`, cudagraph_utils.py:111-138), while a mixed FULL graph (cudagraph_mode FULL) serves both.
    """
    if facts is not None:
        decode = facts.uniform_token_count is not None or facts.max_query_len is not None
        return "decode" if decode else "prefill_or_mixed"
    if getattr(desc, "uniform_token_count", None) is not None or getattr(desc, "max_query_len", None) is not None:
        return "decode"
    return "unknown"


def find_runner(frame: FrameType | None, depth: int = SEARCH_DEPTH) -> Any | None:
    """The V2 model runner whose load_model asked for the model, found among the loader's callers.

    vLLM hands a plugin the loaded model, never the runner. The runner is the `self` of the nearest `load_model`
    frame that has a `cudagraph_manager` (set to None in the V2 runner's __init__, model_runner.py:347; the V1
    runner has none). Only reads frames.
    """
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "load_model" else None
        if owner is not None and hasattr(owner, "cudagraph_manager"):
            return owner
        frame = frame.f_back
    return None


class ObservedGraphs(dict):  # type: ignore[type-arg]
    """The manager's `graphs` dict, reporting every graph stored into it and every one dropped."""

    def __init__(self, initial: dict[Any, Any], sink: Sink) -> None:
        super().__init__(initial)
        self._sink = sink

    def __setitem__(self, desc: Any, graph: Any) -> None:
        super().__setitem__(desc, graph)
        self._sink.graph_stored(execution_key(desc))

    def __delitem__(self, desc: Any) -> None:
        super().__delitem__(desc)
        self._sink.graphs_dropped([execution_key(desc)])

    def pop(self, desc: Any, *default: Any) -> Any:
        had = desc in self
        out = super().pop(desc, *default)
        if had:
            self._sink.graphs_dropped([execution_key(desc)])
        return out

    def clear(self) -> None:  # release_graphs (cudagraph_utils.py:401-411)
        keys = _keys(self)
        super().clear()
        self._sink.graphs_dropped(keys)


def _keys(descs: Iterable[Any]) -> list[str]:
    return [execution_key(d) for d in descs]


class _LastDispatch:
    """The most recent dispatch on one manager, consumed by the replay that follows it."""

    def __init__(self) -> None:
        self.facts: BatchFacts | None = None


def observe_manager(manager: Any, sink: Sink) -> None:
    """Follow one graph manager: stored graphs, dispatches and FULL replays. Idempotent per manager."""
    missing = [name for name in MANAGER_HOOKS if not hasattr(manager, name)]
    if missing:
        raise GraphsUnavailable(
            f"{type(manager).__name__} has no {', '.join(missing)}: not vLLM's V2 CUDA-graph manager as 0.32/0.33 "
            "build it; update harness/vllm_plugin/graphs.py for this vLLM"
        )
    if getattr(manager.run_fullgraph, MARK, False):
        return
    last = _LastDispatch()
    dispatch = manager.dispatch
    signature = inspect.signature(dispatch)
    run_fullgraph = manager.run_fullgraph

    def observed_dispatch(*args: Any, **kwargs: Any) -> Any:
        desc = dispatch(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        last.facts = BatchFacts(
            given.get("num_reqs"),
            given.get("num_tokens"),
            given.get("uniform_token_count"),
            given.get("max_query_len"),
            desc,
        )
        return desc

    def observed_run_fullgraph(desc: Any) -> Any:
        out = run_fullgraph(desc)
        facts, last.facts = last.facts, None
        if facts is not None and facts.desc != desc:
            facts = None  # a dispatch for another batch: its shape says nothing about this replay
        tokens = facts.num_tokens if facts is not None else getattr(desc, "num_tokens", None)
        reqs = facts.num_reqs if facts is not None else getattr(desc, "num_reqs", None)
        sink.replay(execution_key(desc), replay_shape(desc, facts), tokens, reqs)
        return out

    observed_run_fullgraph.k3gate_observed = True  # type: ignore[attr-defined]
    manager.graphs = ObservedGraphs(manager.graphs, sink)
    manager.dispatch = observed_dispatch
    manager.run_fullgraph = observed_run_fullgraph


def attach(runner: Any, sink: Sink) -> None:
    """Follow a V2 model runner's FULL graphs: now if it has a graph manager, else when it captures."""
    missing = [name for name in RUNNER_HOOKS if not callable(getattr(runner, name, None))]
    if missing:
        raise GraphsUnavailable(
            f"{type(runner).__name__} has a cudagraph_manager but no {', '.join(missing)}: not vLLM's V2 model "
            "runner as 0.32/0.33 build it; update harness/vllm_plugin/graphs.py for this vLLM"
        )
    if getattr(runner.capture_model, MARK, False):
        return
    capture_model = runner.capture_model

    def observed_capture_model(*args: Any, **kwargs: Any) -> Any:
        manager = runner.cudagraph_manager
        if manager is not None:
            try:
                observe_manager(manager, sink)
            except GraphsUnavailable as exc:
                # Raising would stop the server's start-up; uncounted replays fail coverage instead.
                sink.set_replays(f"V2 model runner not followed: {exc}; its FULL-graph replays are not counted")
        return capture_model(*args, **kwargs)

    observed_capture_model.k3gate_observed = True  # type: ignore[attr-defined]
    runner.capture_model = observed_capture_model
    if runner.cudagraph_manager is not None:
        observe_manager(runner.cudagraph_manager, sink)
