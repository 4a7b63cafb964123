"""Proof of path for vLLM 0.33.0's Kimi K3 decode (`additional_config = {"decode_backend": "latency_specialized"}`).

The gate's vLLM plugin finds this probe through the `k3gate.path_probes` entry points, named by the class vLLM
instantiates (KimiK3ForConditionalGeneration for the published checkpoint, KimiLinearForCausalLM for a text-only
one), and calls `install(model, decide)` in every worker right after the weights load. From then on each decode
decision the model makes is reported as `decide("specialized" | "stock", reason)`.

Where K3 decides (vLLM 0.33.0; paths under vllm/models/kimi_k3/nvidia/):
- model.py:1437 — `KimiLinearForCausalLM.__init__` sets `specialized_decode_config` (None for decode_backend
  "auto"; an out-of-scope deployment raises ValueError here, during start-up) and `specialized_decode = None`.
- model_state.py:14-20 — `KimiK3ModelState.__init__`, which the V2 model runner builds after loading the model,
  calls `build_specialized_decode()` on the text model. So when this probe is installed the decode does not exist.
- model.py:1473-1492 — `forward()` asks `decode.plan(positions, intermediate_tensors)`: a Step runs the specialized
  layer loop, None runs the stock forward.
- specialized_decode/runtime/decode.py:193-227 — `SpecializedDecode.plan()`: the fallback predicates, in order.

Hence the probe wraps three bound methods, each on an instance the K3 model owns: the text model's
`build_specialized_decode` (to reach the decode once it is built) and `forward` (to report the stock path when
there is no decode), and the built decode's `plan` (every decision, with the reason). The decision itself is
plan()'s return value; the reason is re-derived from the same predicates in the same order, and a None that no
predicate explains says so instead of guessing.

Why an instrument may do this although the isolation rules forbid patching in model code: the probe is the
judge's instrument, not part of the model under review, and it changes no shared object. It assigns attributes
of the model's own instances only (never a class, a module or another model's object), so every other instance
and every other model in the process is untouched, and the wrapped methods call the originals with the same
arguments and return their results unchanged. The isolation AST rules flag stores into imported names
(`SpecializedDecode.plan = ...`, `vllm.x.y = ...`); stores through a parameter are the object's own state and
are not flagged, and the tests run those rules over this file to keep it that way.

CUDA graphs: plan() returns a Step only while a FULL graph is captured. The V2 runner captures with
`cudagraph_runtime_mode` NONE and no batch descriptor inside `torch.cuda.graph` (v1/worker/gpu/cudagraph_utils.py,
`forward_fn`), and replays with `CudaGraphManager.run_fullgraph(batch_desc)` (v1/worker/gpu/model_runner.py:2059),
which runs no model Python and enters no forward context. Every replay of a BatchExecutionDescriptor (FULL,
num_tokens, num_reqs, uniform_token_count) repeats the decision made when that graph was captured, so the decision
states the captured token count and q; crediting replays to it is the plugin's job. The V2 runner leaves the
forward context's batch descriptor empty, so harness/vllm_plugin/graphs.py joins each decision with its graph at
the graph manager (the graph store at capture, run_fullgraph at replay); a replay it could not follow counts as no
decode step, so coverage fails rather than passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

Decide = Callable[[str, str], None]
SPECIALIZED, STOCK = "specialized", "stock"

# What the probe needs on the text model and on the built decode (the names vLLM 0.33.0 uses).
MODEL_HOOKS = ("specialized_decode_config", "specialized_decode", "build_specialized_decode", "forward")
DECODE_HOOKS = ("plan", "batches", "q")
# The ROCm build (models/kimi_k3/amd/) has the same hook names but plans with other predicates (eager steps run
# its kernels too): reasons modelled on the NVIDIA plan() would be wrong there.
ROCM_MODULE_MARK = ".kimi_k3.amd."

NO_DECODE = "no specialized decode: decode_backend is not latency_specialized, the stock forward serves every step"
NOT_BUILT = "the specialized decode is configured but not built yet (the model state builds it after loading)"
PIPELINE = "pipeline-parallel stage input"
NOT_CAPTURING = "outside a CUDA-graph capture (eager step, profiling, or the warmup before a capture)"
NO_CONTEXT = "no forward context"
PIECEWISE = "PIECEWISE CUDA-graph step"
NO_METADATA = "the step has no attention metadata"
PROMPT_ROWS = "the step has prompt rows (prefill or chunked prefill)"
UNEXPLAINED = (
    "plan() returned None for a reason this probe does not model (a newer vLLM? update k3_decode/vllm_probe.py)"
)

log = logging.getLogger("k3gate.vllm_probe")


class ProbeUnavailable(TypeError):
    """The model lacks what this probe wraps. The plugin records the message and coverage is not judged."""


@dataclass(frozen=True)
class StepView:
    """What plan() consults besides its arguments, as seen at the moment it returned."""

    capturing: bool  # the current CUDA stream is capturing a graph
    context: Any | None  # vLLM's forward context, None outside one
    piecewise: bool  # the forward context's CUDA-graph runtime mode is PIECEWISE


class Runtime(Protocol):
    def view(self) -> StepView: ...


class VllmRuntime:
    """The real StepView, from torch and vLLM (imported on first use: this module loads without vLLM)."""

    def __init__(self) -> None:
        self._parts: tuple[Any, ...] | None = None

    def view(self) -> StepView:
        if self._parts is None:
            import torch
            from vllm.config import CUDAGraphMode
            from vllm.forward_context import get_forward_context, is_forward_context_available

            self._parts = (torch, CUDAGraphMode.PIECEWISE, get_forward_context, is_forward_context_available)
        torch, piecewise_mode, get_context, has_context = self._parts
        capturing = bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        context = get_context() if has_context() else None
        piecewise = context is not None and context.cudagraph_runtime_mode == piecewise_mode
        return StepView(capturing=capturing, context=context, piecewise=piecewise)


def text_model(model: Any) -> Any:
    """The object that plans: the text model of a multimodal K3 (as model_state.py:17-18 finds it), else the model."""
    text = model.get_language_model() if hasattr(model, "get_language_model") else model
    missing = [name for name in MODEL_HOOKS if not hasattr(text, name)]
    if missing:
        raise ProbeUnavailable(
            f"{type(text).__name__} has no {', '.join(missing)}: not vLLM 0.33.0's Kimi K3 model with a specialized "
            "decode; extend k3_decode/vllm_probe.py for this vLLM"
        )
    if ROCM_MODULE_MARK in type(text).__module__:
        raise ProbeUnavailable(
            f"{type(text).__module__}.{type(text).__name__} is vLLM's ROCm Kimi K3, whose plan() has other "
            "predicates; this probe mirrors the NVIDIA decode (add a ROCm probe to k3_decode/)"
        )
    return text


def _sizes(batches: Iterable[int]) -> str:
    return ", ".join(str(b) for b in sorted(batches))


def _metadata_rows(context: Any) -> list[Any]:
    by_layer = getattr(context, "attn_metadata", None)
    return list(by_layer.values()) if isinstance(by_layer, dict) else []


def fallback_reason(decode: Any, positions: Any, intermediate_tensors: Any, view: StepView) -> str:
    """Why plan() returned None, tested in plan()'s own order (decode.py:193-227).

    Reasons are counted per distinct text, so none carries a free-running number: a token count appears only
    for the few sizes up to the largest prepared batch.
    """
    tokens = int(positions.shape[0])
    if intermediate_tensors is not None:
        return PIPELINE
    if tokens not in decode.batches:
        top = max(decode.batches)
        if tokens > top:
            return f"more than {top} tokens (the largest prepared batch)"
        return f"{tokens} tokens is not a prepared batch size ({_sizes(decode.batches)})"
    if not view.capturing:
        return NOT_CAPTURING
    if view.context is None:
        return NO_CONTEXT
    if view.piecewise:
        return PIECEWISE
    rows = _metadata_rows(view.context)
    q = decode.q if any(getattr(md, "num_spec_decodes", 0) for md in rows) else 1
    if tokens % q:
        return f"{tokens} tokens is not a whole number of {q}-token verify requests"
    if not rows:
        return NO_METADATA
    if any(getattr(md, "num_prefills", 0) for md in rows):
        return PROMPT_ROWS
    if q > 1:
        return f"a speculative step whose requests do not all verify {q} tokens"
    return UNEXPLAINED


def watch_plan(decode: Any, decide: Decide, runtime: Runtime) -> bool:
    """Wrap the built decode's own plan(); False (and a warning in the server log) when it cannot be observed."""
    missing = [name for name in DECODE_HOOKS if not hasattr(decode, name)]
    if missing:
        # Raising here would crash the server's start-up from inside the model state; unobserved steps are
        # recorded as "unrecorded", which never counts as specialized.
        log.warning(
            "k3gate probe: %s has no %s, so its decode decisions cannot be observed; update k3_decode/vllm_probe.py",
            type(decode).__name__,
            ", ".join(missing),
        )
        return False
    plan = decode.plan

    def probed_plan(positions: Any, intermediate_tensors: Any) -> Any:
        step = plan(positions, intermediate_tensors)
        if step is None:
            decide(STOCK, fallback_reason(decode, positions, intermediate_tensors, runtime.view()))
        else:
            decide(SPECIALIZED, f"planned {int(positions.shape[0])} tokens, q={step.q}")
        return step

    decode.plan = probed_plan
    return True


def install(model: Any, decide: Decide, runtime: Runtime | None = None) -> None:
    """The `k3gate.path_probes` entry point. Raises ProbeUnavailable for a model without the K3 hooks."""
    text = text_model(model)
    if getattr(text.forward, "k3gate_probe", False):
        return  # installed already: a second wrapper would report every decision twice
    rt = runtime if runtime is not None else VllmRuntime()
    build = text.build_specialized_decode
    forward = text.forward

    def probed_build() -> None:
        build()
        watch_plan(text.specialized_decode, decide, rt)

    def probed_forward(*args: Any, **kwargs: Any) -> Any:
        if text.specialized_decode is None:
            decide(STOCK, NO_DECODE if text.specialized_decode_config is None else NOT_BUILT)
        return forward(*args, **kwargs)

    probed_forward.k3gate_probe = True  # type: ignore[attr-defined]
    text.build_specialized_decode = probed_build
    text.forward = probed_forward
    if text.specialized_decode is not None:  # built before the probe arrived (a custom loader)
        watch_plan(text.specialized_decode, decide, rt)
