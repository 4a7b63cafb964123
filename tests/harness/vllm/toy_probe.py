"""A proof-of-path probe for the tiny Llama, for tests only: it stands in for a model's own planning hook.

Llama has no specialized decode. This probe reports what a model with one would: pure decode batches planned
as "specialized", anything else "stock". TOY_PROBE_MODE=always_stock makes it report a fallback on every step,
the red-team case for the coverage check (a path that silently took the standard route).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def install(model: Any, decide: Callable[[str, str], None]) -> None:
    original = model.forward
    always_stock = os.environ.get("TOY_PROBE_MODE") == "always_stock"

    def forward(*args: Any, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        first = next(iter(meta.values()), None) if isinstance(meta, dict) else None
        decode = first is not None and getattr(first, "max_query_len", 0) == 1
        if always_stock:
            decide("stock", "toy probe: every step falls back")
        elif decode:
            decide("specialized", "")
        else:
            decide("stock", "prefill or mixed batch")
        return original(*args, **kwargs)

    model.forward = forward
