"""A CPU stand-in for vLLM 0.33.0's V2 model runner around FULL CUDA graphs, for the plugin's graph following.

It keeps the names, signatures and control flow the plugin depends on (paths and lines in the vllm 0.33.0 wheel):
- vllm/v1/worker/gpu/cudagraph_utils.py: `BatchExecutionDescriptor` 70-85, `_is_compatible` 111-138,
  `CudaGraphManager.__init__` (`graphs` 180), `_init_candidates` 256-394 (FULL_AND_PIECEWISE and FULL, no LoRA,
  no DBO), `release_graphs` 401-411, `capture` 424-515 (the graph stored at 512), `dispatch` 523-553,
  `run_fullgraph` 555-568; `ModelCudaGraphManager.capture` 613-788 (`forward_fn` 754-786), `run_fullgraph` 790-800.
- vllm/forward_context.py: `set_forward_context` 278-359 (a token count becomes the batch descriptor at 332;
  the override entered at 359, which the plugin's install() wraps with hooks.observe_step).
- vllm/v1/worker/gpu/model_runner.py: `load_model` 385-436 (the loader call 403, the drafter 421, the model state
  435), `initialize_kv_cache` (the manager, 766), `capture_model` 1086, `execute_model` 1764-2098 (max_query_len
  None with a prompt row 1811, dispatch 1832, FULL replay 2051-2059, eager and PIECEWISE 2060-2098);
  vllm/v1/worker/gpu/dp_utils.py `dispatch_cg_and_sync_dp` 211 (dp_size 1); vllm/v1/worker/utils.py
  `get_uniform_decode_token_count` 967; vllm/model_executor/model_loader/__init__.py `get_model` 131-143.
- vllm/v1/worker/gpu/spec_decode/: a drafter loaded through `get_model(..., model_config=draft_model_config)`
  (dspark/utils.py:120-121) whose eager steps run under a forward context of its own (dflash/speculator.py:324).
torch.cuda.graph is `World.capturing` set around the capture pass; a FakeCUDAGraph's replay() runs no Python of
the model, as a real replay runs only the recorded kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from types import SimpleNamespace
from typing import Any

import torch

from harness.vllm_plugin import hooks


class CUDAGraphMode(StrEnum):  # a str: the K3 stand-in compares the runtime mode with "PIECEWISE"
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def separate_routine(self) -> bool:
        return self is CUDAGraphMode.FULL_AND_PIECEWISE

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode.FULL if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode.PIECEWISE if self.separate_routine() else self


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0


@dataclass
class Metadata:
    """One layer's attention metadata: what the K3 stand-in's plan() and the plugin's step_info read."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    num_prefills: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_spec_decodes: int = 0
    num_spec_decode_tokens: int = 0
    spec_state_indices_tensor: Any = None


@dataclass
class ForwardContext:
    attn_metadata: Any
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None
    slot_mapping: dict[str, Any] = field(default_factory=dict)


@dataclass
class World:
    """What torch and vLLM's globals would hold: the capture flag and the current forward context."""

    capturing: bool = False
    context: ForwardContext | None = None


@contextlib.contextmanager
def override_forward_context(ctx: ForwardContext | None, world: Any) -> Iterator[None]:
    """forward_context.override_forward_context as the plugin's install() leaves it."""
    previous = world.context
    with hooks.observe_step(ctx):
        world.context = ctx
        try:
            yield
        finally:
            world.context = previous


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any,
    world: Any,
    num_tokens: int | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[None]:
    if num_tokens is not None:
        batch_descriptor = batch_descriptor or BatchDescriptor(num_tokens=num_tokens)
    with override_forward_context(ForwardContext(attn_metadata, cudagraph_runtime_mode, batch_descriptor), world):
        yield


def batch_metadata(layers: list[str], query_lens: list[int], prefill: bool) -> dict[str, Metadata]:
    """Per-layer metadata of a batch: one prompt row first when `prefill`, decode rows after it."""
    num_tokens = sum(query_lens)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()])
    prefills = 1 if prefill else 0
    md = Metadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        query_start_loc=starts,
        num_prefills=prefills,
        num_decodes=len(query_lens) - prefills,
        num_decode_tokens=num_tokens - (query_lens[0] if prefill else 0),
    )
    return {name: md for name in layers}


class FakeCUDAGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@contextlib.contextmanager
def cuda_graph(graph: FakeCUDAGraph, world: Any) -> Iterator[None]:
    """torch.cuda.graph: the stream is capturing while the pass runs."""
    world.capturing = True
    try:
        yield
    finally:
        world.capturing = False


def _is_compatible(
    desc: BatchExecutionDescriptor,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    num_active_loras: int,
    max_query_len: int | None,
    num_ubatches: int,
) -> bool:
    return (
        (desc.uniform_token_count is None or desc.uniform_token_count == uniform_token_count)
        and (desc.max_query_len is None or (max_query_len is not None and desc.max_query_len >= max_query_len))
        and (desc.num_reqs is None or desc.num_reqs >= num_reqs)
        and desc.num_tokens >= num_tokens
        and desc.num_active_loras == num_active_loras
        and desc.num_ubatches == num_ubatches
    )


class CudaGraphManager:
    def __init__(
        self,
        world: Any,
        cudagraph_mode: CUDAGraphMode,
        capture_sizes: list[int],
        max_num_reqs: int,
        decode_query_len: int,
    ) -> None:
        self.world = world
        self.cudagraph_mode = cudagraph_mode
        self.max_num_reqs = max_num_reqs
        self.decode_query_len = decode_query_len
        self.graphs: dict[BatchExecutionDescriptor, FakeCUDAGraph] = {}
        self._graphs_captured = False
        self._candidates: dict[tuple[int, int], list[BatchExecutionDescriptor]] = {}
        self._capture_descs: dict[CUDAGraphMode, list[BatchExecutionDescriptor]] = {}
        self._init_candidates(sorted(capture_sizes))

    def _init_candidates(self, capture_sizes: list[int]) -> None:
        decode_mode, mixed_mode = self.cudagraph_mode.decode_mode(), self.cudagraph_mode.mixed_mode()
        by_mode: dict[CUDAGraphMode, list[BatchExecutionDescriptor]] = {}
        q = self.decode_query_len
        for n in capture_sizes:
            if self.cudagraph_mode.separate_routine():
                tokens = -(-n // q) * q
                if tokens <= self.max_num_reqs * q and tokens <= capture_sizes[-1]:
                    desc = BatchExecutionDescriptor(decode_mode, tokens, tokens // q, uniform_token_count=q)
                    if desc not in by_mode.setdefault(decode_mode, []):
                        by_mode[decode_mode].append(desc)
            reqs = min(n, self.max_num_reqs) if mixed_mode == CUDAGraphMode.FULL else None
            by_mode.setdefault(mixed_mode, []).append(BatchExecutionDescriptor(mixed_mode, n, reqs))
        for mode, descs in by_mode.items():
            descs.sort(key=lambda d: d.num_tokens, reverse=True)
            self._capture_descs[mode] = descs
        for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            start = 0
            for desc in sorted(by_mode.get(mode, []), key=lambda d: d.num_tokens):
                for i in range(start, desc.num_tokens + 1):
                    self._candidates.setdefault((i, 0), []).append(desc)
                start = desc.num_tokens + 1

    def release_graphs(self) -> None:
        self.graphs.clear()
        self._graphs_captured = False

    def capture(
        self, create_forward_fn: Callable[[BatchExecutionDescriptor, bool], Callable[[CUDAGraphMode], None]]
    ) -> None:
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            for desc in self._capture_descs.get(mode, []):
                forward_fn = create_forward_fn(desc, True)
                forward_fn(CUDAGraphMode.NONE)  # warmup
                if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                    forward_fn(CUDAGraphMode.PIECEWISE)
                    continue
                forward_fn = create_forward_fn(desc, False)
                assert desc not in self.graphs, f"Graph already captured for {desc}"
                graph = FakeCUDAGraph()
                with cuda_graph(graph, self.world):
                    forward_fn(CUDAGraphMode.NONE)
                self.graphs[desc] = graph
        self._graphs_captured = True

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> BatchExecutionDescriptor:
        key = (num_tokens, num_active_loras)
        if self._graphs_captured and num_tokens > 0 and key in self._candidates:
            for desc in self._candidates[key]:
                if _is_compatible(
                    desc, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches
                ):
                    return desc
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs, num_active_loras=num_active_loras)

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> None:
        assert desc.cg_mode == CUDAGraphMode.FULL, f"Expected FULL mode, got {desc.cg_mode}"
        assert desc in self.graphs, f"No cudagraph for {desc}"
        self.graphs[desc].replay()


class ModelCudaGraphManager(CudaGraphManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hidden_states: dict[BatchExecutionDescriptor, Any] = {}

    def capture(self, model: Any, layers: list[str]) -> None:  # type: ignore[override]
        def create_forward_fn(desc: BatchExecutionDescriptor, warmup: bool) -> Callable[[CUDAGraphMode], None]:
            num_tokens = desc.num_tokens
            num_reqs = desc.num_reqs or min(num_tokens, self.max_num_reqs)
            per_req = desc.uniform_token_count or 1
            metadata = batch_metadata(layers, [per_req] * num_reqs, prefill=False)
            positions = torch.zeros(num_tokens, dtype=torch.long)

            def forward_fn(cg_mode: CUDAGraphMode) -> None:
                batch_descriptor = (
                    BatchDescriptor(num_tokens=num_tokens) if cg_mode == CUDAGraphMode.PIECEWISE else None
                )
                with set_forward_context(
                    metadata, self.world, num_tokens, cudagraph_runtime_mode=cg_mode, batch_descriptor=batch_descriptor
                ):
                    output = model(input_ids=None, positions=positions, intermediate_tensors=None, inputs_embeds=None)
                if cg_mode != CUDAGraphMode.PIECEWISE:
                    self.hidden_states[desc] = output  # what the recorded kernels write on every replay

            return forward_fn

        super().capture(create_forward_fn)

    def run_fullgraph(self, desc: BatchExecutionDescriptor) -> Any:
        super().run_fullgraph(desc)
        return self.hidden_states[desc]


class DefaultModelLoader:
    """A loader building models by config; tests hook it as the plugin hooks BaseModelLoader.load_model."""

    def __init__(self, build: Callable[[Any, Any], Any]) -> None:
        self.build = build

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        return self.build(vllm_config, model_config)


class HookedLoader(DefaultModelLoader):
    load_model = hooks.wrap_loader(DefaultModelLoader.load_model)


def get_model(*, loader: DefaultModelLoader, vllm_config: Any, model_config: Any = None, prefix: str = "") -> Any:
    if model_config is None:
        model_config = vllm_config.model_config
    return loader.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)


class Speculator:
    """A drafter with a forward context of its own per eager step and its own graph manager."""

    def __init__(self, vllm_config: Any, loader: DefaultModelLoader, world: Any) -> None:
        self.vllm_config, self.loader, self.world = vllm_config, loader, world
        self.model: Any = None
        self.cudagraph_manager: CudaGraphManager | None = None

    def load_model(self, target_model: Any) -> None:
        # The drafter's vllm_config is a copy (dspark/utils.py builds one with dataclasses.replace).
        draft_config = SimpleNamespace(**vars(self.vllm_config))
        self.model = get_model(
            loader=self.loader,
            vllm_config=draft_config,
            model_config=self.vllm_config.speculative_config.draft_model_config,
        )

    def propose(self, num_tokens: int) -> Any:
        metadata = batch_metadata(["drafter.layers.0.attn"], [1] * num_tokens, prefill=False)
        with set_forward_context(metadata, self.world, num_tokens):
            return self.model(input_ids=None, positions=torch.zeros(num_tokens, dtype=torch.long))


class GPUModelRunner:
    def __init__(
        self,
        vllm_config: Any,
        loader: DefaultModelLoader,
        world: Any,
        *,
        cudagraph_mode: CUDAGraphMode,
        capture_sizes: list[int],
        attn_layers: list[str],
        init_model_state: Callable[[Any, Any], Any] = lambda config, model: None,
        max_num_reqs: int = 8,
        decode_query_len: int = 1,
    ) -> None:
        self.vllm_config, self.loader, self.world = vllm_config, loader, world
        self.cudagraph_mode, self.capture_sizes, self.attn_layers = cudagraph_mode, capture_sizes, attn_layers
        self.init_model_state = init_model_state
        self.max_num_reqs, self.decode_query_len = max_num_reqs, decode_query_len
        self.model: Any = None
        self.model_state: Any = None
        self.cudagraph_manager: ModelCudaGraphManager | None = None
        spec = getattr(vllm_config, "speculative_config", None)
        self.speculator = Speculator(vllm_config, loader, world) if spec is not None else None

    def load_model(self, load_dummy_weights: bool = False, *args: Any, model: Any = None, **kwargs: Any) -> None:
        model_loader = self.loader
        self.model = model or model_loader.load_model(
            vllm_config=self.vllm_config, model_config=self.vllm_config.model_config
        )
        if self.speculator is not None:
            self.speculator.load_model(self.model)
        self.model_state = self.init_model_state(self.vllm_config, self.model)

    def initialize_kv_cache(self) -> None:
        self.cudagraph_manager = ModelCudaGraphManager(
            self.world, self.cudagraph_mode, self.capture_sizes, self.max_num_reqs, self.decode_query_len
        )

    def capture_model(self, *, profile_only: bool = False) -> int:
        assert self.cudagraph_manager is not None
        self.cudagraph_manager.capture(self.model, self.attn_layers)
        return 0

    def execute_model(self, query_lens: list[int], prefill: bool = False) -> Any:
        """One step: the first row is a prompt when `prefill`, every other row decodes query_lens[i] tokens."""
        num_reqs, num_toks = len(query_lens), sum(query_lens)
        max_query_len: int | None = max(query_lens)
        uniform = max_query_len if not prefill and num_toks == num_reqs * max_query_len else None
        if prefill:
            max_query_len = None  # model_runner.py:1811
        assert self.cudagraph_manager is not None
        batch_desc = self.cudagraph_manager.dispatch(num_reqs, num_toks, uniform, 0, max_query_len=max_query_len)
        if batch_desc.cg_mode == CUDAGraphMode.FULL:
            return self.cudagraph_manager.run_fullgraph(batch_desc)
        padded = max(num_toks, batch_desc.num_tokens)
        metadata = batch_metadata(self.attn_layers, query_lens, prefill)
        with set_forward_context(
            metadata,
            self.world,
            padded,
            cudagraph_runtime_mode=batch_desc.cg_mode,
            batch_descriptor=BatchDescriptor(num_tokens=padded),
        ):
            positions = torch.zeros(padded, dtype=torch.long)
            return self.model(input_ids=None, positions=positions, intermediate_tensors=None, inputs_embeds=None)

    def propose(self, num_tokens: int) -> Any:
        assert self.speculator is not None
        return self.speculator.propose(num_tokens)
