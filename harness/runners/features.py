"""Feature-preservation cells: each drives one serving feature through a running server and judges it.

Cells return checks (and, when they cannot judge, reasons instead of checks); they never return a verdict. The
parameters and decision rules come from evals/features.toml.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jsonschema

from harness.runners import stats
from harness.runners.client import OpenAIClient, RequestFailed, token_id
from harness.runners.eval_tasks import evals_root
from harness.verdicts import Check

FORCE_KEY = "k3gate_force"


@cache
def feature_params() -> dict[str, Any]:
    return tomllib.loads((evals_root() / "features.toml").read_text())


@dataclass
class CellResult:
    name: str
    checks: list[Check] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CellContext:
    client: OpenAIClient
    params: dict[str, Any]
    max_model_len: int
    forcing: bool  # whether the server loaded the teacher-forcing logits processor


def _choice(resp: dict[str, Any]) -> dict[str, Any]:
    return resp["choices"][0]


def greedy_tokens(ctx: CellContext, prompt: str | list[int], max_tokens: int) -> list[int]:
    resp = ctx.client.completion(prompt=prompt, max_tokens=max_tokens, temperature=0.0, return_token_ids=True)
    return list(_choice(resp)["token_ids"] or [])


def greedy_determinism(ctx: CellContext) -> CellResult:
    p = ctx.params["greedy"]
    res = CellResult("greedy determinism")
    mismatched, shortest = [], math.inf
    for prompt in p["prompts"]:
        runs = [tuple(greedy_tokens(ctx, prompt, p["max_tokens"])) for _ in range(p["repeats"])]
        shortest = min(shortest, *(len(r) for r in runs))
        if len(set(runs)) > 1:
            mismatched.append(prompt)
        res.evidence[prompt] = [list(r) for r in runs]
    res.checks += [
        Check("greedy: prompts whose repeats differ", len(mismatched), "==", 0, "; ".join(mismatched)),
        Check(
            "greedy: shortest output (tokens)", int(shortest), ">=", 1, "a server that returns nothing proves nothing"
        ),
    ]
    return res


def seeded_reproducibility(ctx: CellContext) -> CellResult:
    p = ctx.params["seeded"]
    res = CellResult("seeded reproducibility")

    def draw(seed: int) -> list[int]:
        body = {"prompt": p["prompt"], "max_tokens": p["max_tokens"], "temperature": p["temperature"]}
        return list(_choice(ctx.client.completion(**body, seed=seed, return_token_ids=True))["token_ids"] or [])

    first, again, other = draw(p["seed"]), draw(p["seed"]), draw(p["seed"] + 1)
    res.evidence = {"seed": first, "same seed": again, "other seed": other}
    res.checks += [
        Check("seeded: same seed gives the same tokens", first == again, "==", True),
        Check(
            "seeded: another seed gives other tokens",
            first != other,
            "==",
            True,
            "equal outputs for different seeds mean the sampler ignored its randomness",
        ),
    ]
    return res


def _raw_at_free_position(ctx: CellContext, prompt: str, prefix: list[int]) -> dict[int, float]:
    resp = ctx.client.completion(
        prompt=prompt,
        max_tokens=len(prefix) + 1,
        temperature=0.0,
        logprobs=20,
        return_tokens_as_token_ids=True,
        vllm_xargs={FORCE_KEY: prefix},
    )
    top = _choice(resp)["logprobs"]["top_logprobs"][-1]
    return {token_id(k): float(v) for k, v in top.items()}


def _power(raw: dict[int, float], s: dict[str, Any]) -> float:
    """Distance from the expected distribution to the nearest wrong-sampler alternative."""
    want = stats.sampling_distribution(raw, s["temperature"], s["top_k"], s["top_p"])
    alternatives = []
    if s["temperature"] != 1.0:
        alternatives.append(stats.sampling_distribution(raw, 1.0, s["top_k"], s["top_p"]))
    if s["top_p"] < 1.0:
        alternatives.append(stats.sampling_distribution(raw, s["temperature"], s["top_k"], 1.0))
    if s["top_k"] < len(raw):
        alternatives.append(stats.sampling_distribution(raw, s["temperature"], len(raw), s["top_p"]))
    return min((stats.total_variation(want, alt) for alt in alternatives), default=0.0)


def sampling(ctx: CellContext) -> CellResult:
    p = ctx.params["sampling"]
    res = CellResult("sampling")
    if not ctx.forcing:
        res.not_run.append(
            "sampling: drawing on a decode step needs the teacher-forcing logits processor (vllm.teacher_forcing)"
        )
        return res
    candidates = []
    for prompt in p["candidate_prompts"]:
        prefix = greedy_tokens(ctx, prompt, p["forced_prefix"])
        if len(prefix) == p["forced_prefix"]:
            candidates.append((prompt, prefix, _raw_at_free_position(ctx, prompt, prefix)))
    if not candidates:
        res.checks.append(Check("sampling: prompts that produced a forced prefix", 0, ">=", 1))
        return res
    for s in p["settings"]:
        if not 0 < s["top_k"] <= 20:
            raise ValueError(f"features.toml sampling setting {s['name']!r}: top_k must be 1..20 (max_logprobs)")
        prompt, prefix, raw = max(candidates, key=lambda c: _power(c[2], s))
        # Parentheses, not brackets: reasons are printed through rich, which reads [..] as markup.
        label = f"sampling ({s['name']})"
        if (power := _power(raw, s)) < p["min_power_tvd"]:
            res.not_run.append(
                f"{label}: no candidate prompt gives a testable distribution (best power {power:.3f} < "
                f"{p['min_power_tvd']}), so a wrong sampler could not be told from a right one"
            )
            continue
        expected = stats.sampling_distribution(raw, s["temperature"], s["top_k"], s["top_p"])
        counts: Counter[int] = Counter()
        drift = 0.0
        requests = math.ceil(p["draws"] / p["per_request"])
        for i in range(requests):
            resp = ctx.client.completion(
                prompt=prompt,
                n=p["per_request"],
                seed=1000 * (i + 1),
                max_tokens=len(prefix) + 1,
                temperature=s["temperature"],
                top_k=s["top_k"],
                top_p=s["top_p"],
                logprobs=20,
                return_tokens_as_token_ids=True,
                return_token_ids=True,
                vllm_xargs={FORCE_KEY: prefix},
            )
            for choice in resp["choices"]:
                counts[choice["token_ids"][-1]] += 1
                top = {token_id(k): float(v) for k, v in choice["logprobs"]["top_logprobs"][-1].items()}
                drift = max(drift, max((abs(top.get(t, -math.inf) - v) for t, v in raw.items()), default=0.0))
        fit = stats.goodness_of_fit(counts, expected, p["min_expected_per_bin"])
        detail = f"prompt {prompt!r}, {sum(counts.values())} draws, chi2 {fit.chi2:.2f} on {fit.df} df"
        res.checks += [
            Check(f"{label}: draws outside the top-k/top-p support", fit.outside_support, "==", 0, detail),
            Check(f"{label}: chi-square p-value against the arm's own logprobs", fit.p_value, ">=", p["alpha"], detail),
        ]
        res.evidence[s["name"]] = {
            "prompt": prompt,
            "forced_prefix": prefix,
            "raw_logprobs": {str(k): v for k, v in raw.items()},
            "expected": {str(k): v for k, v in expected.items()},
            "counts": {str(k): v for k, v in counts.items()},
            "power_tvd": _power(raw, s),
            "max_raw_logprob_drift_across_draws": drift,
            "chi2": fit.chi2,
            "df": fit.df,
            "p_value": fit.p_value,
        }
    return res


def _structured(ctx: CellContext, kind: str, constraint: dict[str, Any], valid: Callable[[str], bool]) -> CellResult:
    p = ctx.params["structured"]
    res = CellResult(f"structured output ({kind})")
    resp = ctx.client.completion(
        prompt=p["prompt"],
        n=p["samples"],
        seed=11,
        temperature=p["temperature"],
        max_tokens=p["max_tokens"],
        structured_outputs=constraint,
    )
    outputs = [(c["text"], c["finish_reason"]) for c in resp["choices"]]
    bad = [text for text, finish in outputs if finish != "stop" or not valid(text)]
    res.evidence = {"outputs": outputs}
    res.checks.append(
        Check(
            f"structured {kind}: outputs invalid or truncated",
            len(bad),
            "==",
            0,
            f"{len(bad)}/{len(outputs)} bad, e.g. {bad[0][:80]!r}" if bad else f"{len(outputs)} outputs valid",
        )
    )
    return res


def structured_json(ctx: CellContext) -> CellResult:
    schema = ctx.params["structured"]["json_schema"]

    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return _structured(ctx, "JSON schema", {"json": schema}, valid)


def structured_regex(ctx: CellContext) -> CellResult:
    pattern = ctx.params["structured"]["regex"]
    return _structured(ctx, "regex", {"regex": pattern}, lambda t: re.fullmatch(pattern, t) is not None)


def structured_choice(ctx: CellContext) -> CellResult:
    choices = ctx.params["structured"]["choices"]
    return _structured(ctx, "choice", {"choice": choices}, lambda t: t in choices)


def full_context(ctx: CellContext) -> CellResult:
    p = ctx.params["full_context"]
    res = CellResult("full max_model_len")
    unit = ctx.client.tokenize(p["filler"])
    prompt_len = ctx.max_model_len - p["generate"]
    ids = (unit * (prompt_len // max(1, len(unit)) + 1))[:prompt_len]
    resp = ctx.client.completion(prompt=ids, max_tokens=p["generate"], temperature=0.0, ignore_eos=True)
    usage = resp.get("usage", {})
    total = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    over = (unit * (ctx.max_model_len // max(1, len(unit)) + 2))[: ctx.max_model_len + 1]
    try:
        ctx.client.completion(prompt=over, max_tokens=1, temperature=0.0)
        refused = 200
    except RequestFailed as exc:
        refused = exc.status or 0
    res.evidence = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
    res.checks += [
        Check("full context: prompt + generated tokens", total, "==", ctx.max_model_len),
        Check("full context: a prompt one token over max_model_len is refused (HTTP status)", refused, "==", 400),
    ]
    return res


def stop_strings(ctx: CellContext) -> CellResult:
    p = ctx.params["stop"]
    res = CellResult("stop strings")
    free = _choice(ctx.client.completion(prompt=p["prompt"], max_tokens=p["max_tokens"], temperature=0.0))["text"]
    stop = free[p["stop_at_char"] : p["stop_at_char"] + p["stop_len"]]
    if len(stop) < p["stop_len"] or not stop.strip():
        res.not_run.append(f"stop strings: the free output {free[:40]!r} is too short to cut a stop string from")
        return res
    got = _choice(ctx.client.completion(prompt=p["prompt"], max_tokens=p["max_tokens"], temperature=0.0, stop=[stop]))
    want = free[: free.index(stop)]
    res.evidence = {"free": free, "stop": stop, "stopped": got["text"]}
    res.checks += [
        Check("stop: output ends right before the stop string", got["text"] == want, "==", True, f"stop {stop!r}"),
        Check("stop: finish reason", got["finish_reason"], "==", "stop"),
        Check("stop: stop reason names the string", got.get("stop_reason"), "==", stop),
    ]
    return res


def n_best(ctx: CellContext) -> CellResult:
    p = ctx.params["n"]
    res = CellResult("n > 1")
    resp = ctx.client.completion(
        prompt=p["prompt"],
        n=p["n"],
        seed=p["seed"],
        temperature=p["temperature"],
        max_tokens=p["max_tokens"],
        return_token_ids=True,
    )
    choices = resp["choices"]
    outs = [tuple(c["token_ids"] or []) for c in choices]
    res.evidence = {"outputs": [list(o) for o in outs]}
    res.checks += [
        Check("n: choice indices", sorted(c["index"] for c in choices), "==", list(range(p["n"]))),
        Check("n: empty choices", sum(1 for o in outs if not o), "==", 0),
        Check("n: distinct sampled choices", len(set(outs)), ">", 1, "n identical samples mean one draw was copied"),
    ]
    return res


def logprobs(ctx: CellContext) -> CellResult:
    p = ctx.params["logprobs"]
    res = CellResult("logprobs")
    lp = _choice(
        ctx.client.completion(
            prompt=p["prompt"],
            max_tokens=p["max_tokens"],
            temperature=0.0,
            logprobs=p["top"],
            return_tokens_as_token_ids=True,
        )
    )["logprobs"]
    problems = []
    for i, (tok, tok_lp, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        best = max(top.values())
        if len(top) < p["top"]:
            problems.append(f"step {i}: {len(top)} top logprobs")
        if tok_lp < best - 1e-4:
            problems.append(f"step {i}: greedy token is not the most likely ({tok_lp:.4f} < {best:.4f})")
        if tok in top and abs(top[tok] - tok_lp) > 1e-4:
            problems.append(f"step {i}: token logprob {tok_lp:.4f} differs from its top entry {top[tok]:.4f}")
        if best > 1e-6 or sum(math.exp(v) for v in top.values()) > 1 + 1e-3:
            problems.append(f"step {i}: top logprobs are not a distribution")
    res.evidence = {"steps": len(lp["tokens"]), "problems": problems}
    res.checks += [
        Check("logprobs: steps with inconsistent logprobs", len(problems), "==", 0, "; ".join(problems[:3])),
        Check("logprobs: steps returned", len(lp["tokens"]), ">=", 1),
    ]
    return res


def streaming(ctx: CellContext) -> CellResult:
    p = ctx.params["streaming"]
    res = CellResult("streaming")
    whole = _choice(ctx.client.completion(prompt=p["prompt"], max_tokens=p["max_tokens"], temperature=0.0))
    chunks = list(ctx.client.stream_completion(prompt=p["prompt"], max_tokens=p["max_tokens"], temperature=0.0))
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    finish = next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices")), None)
    res.evidence = {"chunks": len(chunks), "text": text, "non_streamed": whole["text"]}
    res.checks += [
        Check("streaming: streamed text equals the non-streamed text", text == whole["text"], "==", True),
        Check("streaming: chunks", len(chunks), ">=", 2),
        Check("streaming: finish reason matches", finish, "==", whole["finish_reason"]),
    ]
    return res


CELLS: tuple[Callable[[CellContext], CellResult], ...] = (
    greedy_determinism,
    seeded_reproducibility,
    sampling,
    structured_json,
    structured_regex,
    structured_choice,
    full_context,
    stop_strings,
    n_best,
    logprobs,
    streaming,
)
