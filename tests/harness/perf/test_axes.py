from __future__ import annotations

import pytest

from harness.perf.axes import axis_metrics
from tests.harness.perf.fakes import cell


def test_decode_metrics_by_axis():
    m = axis_metrics(cell(batch=8, tp=4), step_s=0.02)
    assert m.itl_s == pytest.approx(0.02) and m.tok_s_per_user == pytest.approx(50.0)
    assert m.output_tok_s == pytest.approx(400.0) and m.output_tok_s_per_gpu == pytest.approx(100.0)
    assert m.input_tok_s_per_gpu is None and m.ttft_s is None


def test_verify_steps_count_accepted_tokens_and_mixed_steps_keep_prefill_apart():
    q4 = cell(batch=2, q=4)  # acceptance 0.5: 1 + 0.5 + 0.25 + 0.125 tokens per step
    m = axis_metrics(q4, step_s=0.03)
    assert m.itl_s == pytest.approx(0.03 / 1.875) and m.output_tok_s == pytest.approx(2 * 1.875 / 0.03)
    mixed = axis_metrics(cell(batch=2, workload="mixed", tp=2), step_s=0.05)  # 4 prefill tokens per step
    assert mixed.output_tok_s_per_gpu == pytest.approx(2 / 0.05 / 2) and mixed.input_tok_s_per_gpu == pytest.approx(
        4 / 0.05 / 2
    )


def test_a_step_time_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="positive"):
        axis_metrics(cell(), 0.0)
