"""The serving benchmark: token timing from streamed chunks, the metrics of each axis, and rounds against a fake
streaming server (no vLLM needed)."""

from __future__ import annotations

import math

import pytest

from harness.runners import bench
from tests.harness.perf import fake_openai


def _trace(sent: float, chunks: list[tuple[float, int]], kind: str = "decode") -> bench.Trace:
    return bench.Trace(kind, 8, sent, list(chunks), "length")


def test_itls_are_decode_only_and_split_a_multi_token_chunk_evenly():
    t = _trace(0.0, [(0.5, 1), (0.6, 1), (0.9, 3), (1.0, 1)])
    assert t.ttft == pytest.approx(0.5) and t.tokens == 6
    assert t.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])  # the first token (the prefill) is not an ITL
    assert t.decode_rate() == pytest.approx(5 / 0.5)


def test_tokens_riding_in_the_first_chunk_arrive_with_it():
    t = _trace(0.0, [(0.2, 2), (0.3, 1)])
    assert t.itls() == pytest.approx([0.0, 0.1]) and t.ttft == pytest.approx(0.2)


def test_a_short_or_failed_request_is_a_problem_never_a_speedup():
    load = bench.Load(2, 8, 4)
    ok = _trace(0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)])
    short = _trace(0.0, [(0.1, 1), (0.2, 1)])
    failed = bench.Trace("decode", 8, 0.0, [], None, "POST /v1/completions -> HTTP 500: boom")
    assert bench.BenchRun(load, 0.0, 1.0, (ok, ok)).problems() == []
    assert bench.BenchRun(load, 0.0, 1.0, (ok, short)).problems() == [
        "decode request 1: 2 tokens, not 4 (finish length)"
    ]
    assert "HTTP 500" in bench.BenchRun(load, 0.0, 1.0, (failed, ok)).problems()[0]
    assert math.isnan(bench.BenchRun(load, 0.0, 1.0, (failed,)).median_itl())  # no ITL: a broken round


def test_metrics_keep_each_axis_apart():
    load = bench.Load(2, 8, 3)
    fast = _trace(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)])  # 10 tok/s after its first token, TTFT 0.1
    slow = _trace(0.0, [(0.3, 1), (0.7, 1), (1.1, 1)])  # 2.5 tok/s, TTFT 0.3
    run = bench.BenchRun(load, 0.0, 1.2, (fast, slow))
    m = bench.metrics([run], gpus=2)
    assert m.itl_median_s == pytest.approx(0.25) and m.itl_p90_s == pytest.approx(0.4)
    assert m.tok_s_per_user_median == pytest.approx(6.25)
    assert m.tok_s_per_user_p90 == pytest.approx(2.5)  # the rate 90% of users got at least: the slow one
    assert m.ttft_median_s == pytest.approx(0.2) and m.ttft_p90_s == pytest.approx(0.3)
    assert m.decode_tok_s == pytest.approx(4 / 1.0)  # 4 decode tokens between the first first-token and the last
    assert m.output_tok_s == pytest.approx(6 / 1.2) and m.output_tok_s_per_gpu == pytest.approx(6 / 1.2 / 2)
    assert m.input_tok_s_per_gpu == pytest.approx(16 / 1.2 / 2)  # two 8-token prompts
    assert m.prefill_requests == 0 and m.prefill_ttft_median_s is None


@pytest.mark.parametrize(("values", "q", "want"), [([3, 1, 2], 0.5, 2), ([1, 2, 3, 4], 0.9, 4), ([5], 0.1, 5)])
def test_percentile_is_nearest_rank(values, q, want):
    assert bench.percentile(values, q) == want


def test_a_round_against_a_streaming_server(tmp_path):
    model = fake_openai.FakeModel(token_s=0.003, tokens_per_chunk=2)
    with fake_openai.serve({"candidate": model}, tmp_path) as running:
        client = running["candidate"].client
        pool = bench.token_pool(client)
        run = bench.run(client, bench.Load(3, 16, 9, seed=4), pool, round_=0)
        mixed = bench.run(client, bench.Load(2, 16, 12, prefill_tokens=4, seed=4), pool, round_=1)
    assert len(pool) >= bench.MIN_POOL
    assert run.problems() == [] and [t.tokens for t in run.decode] == [9, 9, 9]
    assert all(len(t.chunks) == 5 for t in run.decode)  # 2 tokens a chunk, counted from the usage stats
    assert 0.002 < run.median_itl() < 0.05
    assert mixed.problems() == [] and len(mixed.prefill) >= 2  # prefill requests kept coming while streams decoded
    assert all(t.tokens == 1 for t in mixed.prefill)


def test_prompts_are_distinct_per_request_and_repeatable():
    pool = list(range(100, 140))
    assert bench.prompt(pool, 32, 7) == bench.prompt(pool, 32, 7) != bench.prompt(pool, 32, 8)


def test_a_tokenizer_with_too_few_ids_is_a_one_line_error(tmp_path):
    class Tiny:
        def tokenize(self, text: str) -> list[int]:
            return [1, 2, 1]

    with pytest.raises(bench.BenchError, match="2 distinct ids, fewer than 8"):
        bench.token_pool(Tiny())  # type: ignore[arg-type]
