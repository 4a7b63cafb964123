"""A cell's metrics, one axis each, never folded into one number that mixes axes.

- ITL: median step time / tokens a request gains per step (1, or the expected accepted tokens of a verify step).
- interactivity: tokens per second per user = 1 / ITL.
- output tokens per second: decode tokens all requests gain per second; per GPU: divided by the GPUs of the TP
  group (decode context parallelism shares those GPUs, it adds none).
- input tokens per second per GPU: the prefill chunk of a mixed step, kept apart from the output tokens.
- TTFT: only where the suite measures it (an in-process suite has no request arrival); otherwise absent, with why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.perf.plan import Cell


@dataclass(frozen=True)
class AxisMetrics:
    step_s: float
    itl_s: float
    tok_s_per_user: float
    output_tok_s: float
    output_tok_s_per_gpu: float
    input_tok_s_per_gpu: float | None  # mixed steps only
    ttft_s: float | None  # None: not measured by this suite

    def to_json(self) -> dict[str, float | None]:
        return asdict(self)


def axis_metrics(cell: Cell, step_s: float, ttft_s: float | None = None) -> AxisMetrics:
    if not step_s > 0:
        raise ValueError(f"a step time must be positive to derive metrics, got {step_s}")
    tokens = cell.tokens_per_step
    itl = step_s / tokens
    output = cell.batch * tokens / step_s
    gpus = cell.tp
    return AxisMetrics(
        step_s=step_s,
        itl_s=itl,
        tok_s_per_user=1.0 / itl,
        output_tok_s=output,
        output_tok_s_per_gpu=output / gpus,
        input_tok_s_per_gpu=None if cell.prefill_tokens is None else cell.prefill_tokens / step_s / gpus,
        ttft_s=ttft_s,
    )
