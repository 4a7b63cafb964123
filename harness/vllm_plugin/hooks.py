"""Where the plugin attaches to vLLM: the per-step forward context, the model loader, and (V2 runner) the graphs."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from harness.vllm_plugin import PATH_DIR_ENV, PERTURB_ENV, graphs, models, perturb, probes
from harness.vllm_plugin.recorder import PathRecorder, StepInfo

log = logging.getLogger("k3gate.vllm_plugin")
_recorder: PathRecorder | None = None
_other_models: list[str] = []  # models loaded before the target, named once its recorder exists
_perturbed = False


def recorder() -> PathRecorder | None:
    return _recorder


def install() -> None:
    from vllm import forward_context
    from vllm.model_executor.model_loader import base_loader

    if os.environ.get(PATH_DIR_ENV):
        original_override = forward_context.override_forward_context

        @contextlib.contextmanager
        def recording_override(ctx: Any) -> Iterator[None]:
            with observe_step(ctx), original_override(ctx):
                yield

        forward_context.override_forward_context = recording_override

    base_loader.BaseModelLoader.load_model = wrap_loader(base_loader.BaseModelLoader.load_model)


@contextlib.contextmanager
def observe_step(ctx: Any) -> Iterator[None]:
    """One forward pass as one step. set_forward_context enters vLLM's override_forward_context around every
    forward pass (forward_context.py:359 in 0.33.0), eager, PIECEWISE, V1 FULL replay and V2 capture pass alike,
    so the decisions a probe reports in between belong to it."""
    rec = _recorder
    if rec is None or ctx is None:
        yield
        return
    rec.begin_step(step_info(ctx))
    try:
        yield
    finally:
        rec.end_step()


def wrap_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    """BaseModelLoader.load_model, followed by on_model_loaded with the frame that asked for the model."""

    @functools.wraps(original)
    def load_and_observe(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, vllm_config, model_config, *args, **kwargs)
        on_model_loaded(model, vllm_config, model_config, caller=sys._getframe(1))
        return model

    return load_and_observe


def on_model_loaded(model: Any, vllm_config: Any, model_config: Any = None, caller: FrameType | None = None) -> None:
    """Runs in the worker that owns the model, once per model it loads (the target, then any drafter)."""
    architecture = type(model).__name__
    if path_dir := os.environ.get(PATH_DIR_ENV):
        if models.is_target(vllm_config, model_config, have_target=_recorder is not None):
            _observe_target(model, vllm_config, architecture, Path(path_dir), caller)
        else:
            _observe_other(model, architecture)
    global _perturbed
    if (mode := os.environ.get(PERTURB_ENV)) and not _perturbed:
        # The perturbations patch shared vLLM classes: once per process, or a drafter's load would apply them twice.
        _perturbed = True
        perturb.apply(mode)
        if _recorder is not None:
            _recorder.note_perturbation(mode)


def _observe_target(model: Any, vllm_config: Any, architecture: str, path_dir: Path, caller: FrameType | None) -> None:
    global _recorder
    fresh = _recorder is None
    if _recorder is None:
        additional = dict(getattr(vllm_config, "additional_config", None) or {})
        _recorder = PathRecorder(path_dir, architecture=architecture, additional_config=additional)
        for other in _other_models:
            _recorder.note_other_model(other)
    rec = _recorder
    target = probes.find(architecture)
    if target is None:
        rec.set_probe(None, f"no proof-of-path probe is registered for {architecture}")
    else:
        try:
            probes.load(target)(model, rec.decide)
            rec.set_probe(target, "")
        except Exception as exc:  # a broken probe must show up as missing proof, not crash the server
            rec.set_probe(None, f"probe {target} failed to install: {type(exc).__name__}: {exc}")
    runner = graphs.find_runner(caller)
    if runner is None:
        rec.set_replays(graphs.NOT_V2)
    else:
        try:
            graphs.attach(runner, rec)
            rec.set_replays(graphs.FOLLOWED)
        except graphs.GraphsUnavailable as exc:
            rec.set_replays(f"V2 model runner not followed: {exc}; its FULL-graph replays are not counted")
    if fresh:
        rec.start()


def _observe_other(model: Any, architecture: str) -> None:
    if _recorder is None:
        _other_models.append(architecture)
    else:
        _recorder.note_other_model(architecture)
    models.mark_steps(model, architecture, _other_ran)


def _other_ran(architecture: str) -> None:
    if (rec := _recorder) is not None:
        rec.other_ran(architecture)


def step_info(ctx: Any) -> StepInfo:
    """Model-agnostic facts about one forward pass, read from vLLM's forward context."""
    mode = getattr(getattr(ctx, "cudagraph_runtime_mode", None), "name", "NONE")
    desc = ctx.batch_descriptor
    descriptor = None
    if desc is not None:
        descriptor = f"tokens={desc.num_tokens},reqs={desc.num_reqs},uniform={bool(desc.uniform)}"
    meta = ctx.attn_metadata
    if isinstance(meta, list):  # dual-batch overlap: one dict per micro-batch
        meta = meta[0] if meta else None
    first = next(iter(meta.values()), None) if isinstance(meta, dict) and meta else None
    if first is None:
        return StepInfo(mode=mode, descriptor=descriptor, shape="no_metadata", tokens=None, reqs=None)
    tokens = getattr(first, "num_actual_tokens", None)
    max_q = getattr(first, "max_query_len", None)
    qsl = getattr(first, "query_start_loc", None)
    reqs = int(qsl.shape[0]) - 1 if qsl is not None and hasattr(qsl, "shape") else None
    if max_q is None:
        shape = "unknown"
    elif max_q == 1 or (desc is not None and desc.uniform):
        # q = 1 decode, or a uniform batch (vLLM's term for a decode batch, speculative verify included)
        shape = "decode"
    else:
        shape = "prefill_or_mixed"
    return StepInfo(mode=mode, descriptor=descriptor, shape=shape, tokens=tokens, reqs=reqs)
