"""Where the plugin attaches to vLLM: the per-step forward context and the model loader."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.vllm_plugin import PATH_DIR_ENV, PERTURB_ENV, perturb, probes
from harness.vllm_plugin.recorder import PathRecorder, StepInfo

log = logging.getLogger("k3gate.vllm_plugin")
_recorder: PathRecorder | None = None


def recorder() -> PathRecorder | None:
    return _recorder


def install() -> None:
    from vllm import forward_context
    from vllm.model_executor.model_loader import base_loader

    if os.environ.get(PATH_DIR_ENV):
        original_override = forward_context.override_forward_context

        @contextlib.contextmanager
        def recording_override(ctx: Any) -> Iterator[None]:
            # set_forward_context enters this around every forward pass, eager or CUDA-graph replay alike,
            # so one enter/exit pair is one step and decisions the probe reports in between belong to it.
            rec = _recorder
            if rec is None or ctx is None:
                with original_override(ctx):
                    yield
                return
            rec.begin_step(step_info(ctx))
            try:
                with original_override(ctx):
                    yield
            finally:
                rec.end_step()

        forward_context.override_forward_context = recording_override

    original_load = base_loader.BaseModelLoader.load_model

    @functools.wraps(original_load)
    def load_and_observe(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = original_load(self, vllm_config, model_config, *args, **kwargs)
        on_model_loaded(model, vllm_config)
        return model

    base_loader.BaseModelLoader.load_model = load_and_observe


def on_model_loaded(model: Any, vllm_config: Any) -> None:
    """Runs in the worker that owns the model: start recording, install the model's probe, apply perturbations."""
    global _recorder
    architecture = type(model).__name__
    additional = dict(getattr(vllm_config, "additional_config", None) or {})
    if path_dir := os.environ.get(PATH_DIR_ENV):
        _recorder = PathRecorder(Path(path_dir), architecture=architecture, additional_config=additional)
        target = probes.find(architecture)
        if target is None:
            _recorder.set_probe(None, f"no proof-of-path probe is registered for {architecture}")
        else:
            try:
                probes.load(target)(model, _recorder.decide)
                _recorder.set_probe(target, "")
            except Exception as exc:  # a broken probe must show up as missing proof, not crash the server
                _recorder.set_probe(None, f"probe {target} failed to install: {type(exc).__name__}: {exc}")
        _recorder.start()
    if mode := os.environ.get(PERTURB_ENV):
        perturb.apply(mode)
        if _recorder is not None:
            _recorder.note_perturbation(mode)


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
