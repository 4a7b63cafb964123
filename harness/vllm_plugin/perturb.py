"""Deliberate bugs for the red team. Each models a real way a decode optimization goes wrong, and each must make
a gate stage FAIL: if a perturbed arm passes, the check that should have caught it is broken.

- nudge_logits[:s]  logits drift by a fixed, token-dependent offset of size ~s (a numerics bug in a fused kernel);
                    caught by the teacher-forced comparison (and by paired evals when large).
- break_structured  the grammar bitmask is never applied (a fast path that skips structured-output masking);
                    caught by the structured-output cells.
- wrong_sampler     temperature is ignored when sampling (a sampler shortcut); caught by the sampling test
                    against the arm's own logprobs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

MODES = ("nudge_logits", "break_structured", "wrong_sampler")


def parse(mode: str) -> tuple[str, float]:
    name, _, arg = mode.partition(":")
    if name not in MODES:
        raise ValueError(f"K3GATE_PERTURB={mode!r}: unknown mode — use one of {', '.join(MODES)}")
    return name, float(arg) if arg else 0.5


def apply(modes: str) -> None:
    """Apply one mode or several separated by commas (each bug is aimed at a different check)."""
    table = {"nudge_logits": _nudge_logits, "break_structured": _break_structured, "wrong_sampler": _wrong_sampler}
    for mode in filter(None, (m.strip() for m in modes.split(","))):
        name, strength = parse(mode)
        table[name](strength)


def _nudge_logits(strength: float) -> None:
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    original = LogitsProcessor.forward
    cache: dict[tuple[int, Any, Any], torch.Tensor] = {}

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        logits = original(self, *args, **kwargs)
        if logits is None:
            return logits
        key = (logits.shape[-1], logits.device, logits.dtype)
        if key not in cache:
            ids = torch.arange(logits.shape[-1], dtype=torch.float64)
            # cos of a golden-angle sequence: a fixed, zero-mean offset that differs token to token
            cache[key] = (strength * math.sqrt(2) * torch.cos(ids * 2.399963)).to(logits.device, logits.dtype)
        return logits + cache[key]

    LogitsProcessor.forward = forward


def _break_structured(_: float) -> None:
    from vllm.v1.worker import gpu_model_runner

    gpu_model_runner.apply_grammar_bitmask = lambda *args, **kwargs: None
    try:
        from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker
    except ImportError:
        return
    StructuredOutputsWorker.apply_grammar_bitmask = lambda self, *args, **kwargs: None


def _wrong_sampler(_: float) -> None:
    from vllm.v1.sample.sampler import Sampler

    # Returns the logits untouched: every temperature behaves like 1.0.
    Sampler.apply_temperature = staticmethod(lambda logits, temp, all_random: logits)
