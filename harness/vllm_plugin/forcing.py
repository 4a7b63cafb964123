"""A logits processor that forces a request along a given token sequence (teacher forcing on the decode path).

Start the server with `--logits-processors harness.vllm_plugin.forcing:ForcedTokens` and send
`vllm_xargs: {"k3gate_force": [id, id, ...]}`: at output position i only token i is admissible. vLLM computes
the raw logprobs it returns *before* logits processors run, so each step still reports the model's own
distribution while the sequence stays on the forced path. Requests without `k3gate_force` are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCE_KEY = "k3gate_force"


def _targets(params: SamplingParams) -> list[int] | None:
    raw = (params.extra_args or {}).get(FORCE_KEY)
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(t, int) and t >= 0 for t in raw):
        raise ValueError(f"{FORCE_KEY} must be a non-empty list of token ids")
    return list(raw)


class ForcedTokens(AdapterLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _targets(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, so it must run for greedy requests too

    def new_req_logits_processor(self, params: SamplingParams) -> Callable[[list[int], torch.Tensor], Any] | None:
        targets = _targets(params)
        if targets is None:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(targets):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[targets[step]] = 0.0
            return forced

        return force
