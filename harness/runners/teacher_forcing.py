"""Teacher-forced decode comparison: both arms walk the same token sequence; compare every step's distribution.

The baseline samples a continuation per prompt; then each arm is forced along it (the ForcedTokens logits
processor admits only the next target token) and returns its raw top-k logprobs at every step. Forcing keeps the
two arms on identical inputs for long generations, so a difference is the decode path's, not a divergence of
sampled text; prompt logprobs would only exercise prefill.

Every limit comes with its reason from evals/evals.toml [teacher_forcing.why] (today each says it is a
CPU-calibrated placeholder), and the reason travels with the check into the report: a PASS near a limit must be
read with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.runners import stats
from harness.runners.client import OpenAIClient, token_id
from harness.verdicts import Check

FORCE_KEY = "k3gate_force"
# The limits a comparison is judged against, each with a reason in [teacher_forcing.why].
LIMIT_KEYS = ("max_mean_kl", "max_p99_kl", "min_mean_top5_overlap", "max_abs_target_logprob_diff")


def limit_reasons(limits: dict[str, Any]) -> dict[str, str]:
    """Each limit's reason; a limit without one is an error in the data file, not something to judge with."""
    why = limits.get("why") or {}
    missing = [key for key in LIMIT_KEYS if not str(why.get(key, "")).strip()]
    if missing:
        raise ValueError(
            f"evals/evals.toml [teacher_forcing.why] gives no reason for {', '.join(missing)}: add one line per "
            "limit saying where its number comes from"
        )
    return {key: str(why[key]) for key in LIMIT_KEYS}


def limits_record(limits: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The limits with their reasons, for a stage's metrics."""
    reasons = limit_reasons(limits)
    return {key: {"limit": limits[key], "why": reasons[key]} for key in LIMIT_KEYS}


@dataclass(frozen=True)
class Forced:
    prompt: int
    targets: list[int]
    followed: list[int]  # the tokens the arm actually emitted (must equal targets)
    top: list[dict[int, float]]  # raw top-k logprobs per step
    target_logprobs: list[float]

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "targets": self.targets,
            "followed": self.followed,
            "target_logprobs": self.target_logprobs,
            "top": [{str(k): v for k, v in step.items()} for step in self.top],
        }


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def sample_targets(
    client: OpenAIClient, prompts: list[str], tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    out = []
    for i, prompt in enumerate(prompts):
        resp = client.chat(
            messages=_messages(prompt),
            max_tokens=tokens,
            temperature=temperature,
            seed=seed + i,
            ignore_eos=True,  # every prompt reaches the full length: long generations are the point
            return_token_ids=True,
        )
        out.append(list(resp["choices"][0]["token_ids"] or []))
    return out


def force(client: OpenAIClient, index: int, prompt: str, targets: list[int], top_k: int) -> Forced:
    resp = client.chat(
        messages=_messages(prompt),
        max_tokens=len(targets),
        temperature=0.0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=top_k,
        return_tokens_as_token_ids=True,
        vllm_xargs={FORCE_KEY: targets},
    )
    content = resp["choices"][0]["logprobs"]["content"]
    return Forced(
        prompt=index,
        targets=targets,
        followed=[token_id(step["token"]) for step in content],
        top=[{token_id(t["token"]): float(t["logprob"]) for t in step["top_logprobs"]} for step in content],
        target_logprobs=[float(step["logprob"]) for step in content],
    )


@dataclass(frozen=True)
class Comparison:
    steps: int
    unfollowed: int  # steps where an arm did not emit the forced token (forcing broken: nothing is comparable)
    # None when nothing was compared: a missing value never passes a check (and NaN is not JSON)
    mean_kl: float | None
    p99_kl: float | None
    max_kl: float | None
    mean_top5_overlap: float | None
    max_target_diff: float | None
    worst_step: tuple[int, int]  # (prompt, step) of the largest KL

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def compare(base: list[Forced], cand: list[Forced]) -> Comparison:
    kls, overlaps, target_diffs = [], [], []
    unfollowed, worst, worst_kl = 0, (0, 0), -1.0
    for b, c in zip(base, cand, strict=True):
        unfollowed += sum(1 for t, f in zip(b.targets, b.followed, strict=False) if t != f)
        unfollowed += sum(1 for t, f in zip(c.targets, c.followed, strict=False) if t != f)
        unfollowed += abs(len(b.followed) - len(b.targets)) + abs(len(c.followed) - len(c.targets))
        for step, (pb, pc) in enumerate(zip(b.top, c.top, strict=False)):
            kl = stats.kl_topk(pb, pc)
            kls.append(kl)
            overlaps.append(stats.topk_overlap(pb, pc, 5))
            if kl > worst_kl:
                worst_kl, worst = kl, (b.prompt, step)
        target_diffs += [abs(x - y) for x, y in zip(b.target_logprobs, c.target_logprobs, strict=False)]
    if not kls:
        return Comparison(0, unfollowed, None, None, None, None, None, worst)
    return Comparison(
        steps=len(kls),
        unfollowed=unfollowed,
        mean_kl=sum(kls) / len(kls),
        p99_kl=stats.quantile(kls, 0.99),
        max_kl=max(kls),
        mean_top5_overlap=sum(overlaps) / len(overlaps),
        max_target_diff=max(target_diffs) if target_diffs else None,
        worst_step=worst,
    )


def checks(result: Comparison, label: str, limits: dict[str, Any]) -> list[Check]:
    why = limit_reasons(limits)
    where = f"worst step {result.worst_step[1]} of prompt {result.worst_step[0]}, KL {result.max_kl}; "
    return [
        Check(f"{label}: forced steps compared", result.steps, ">=", 1),
        Check(f"{label}: steps that left the forced sequence", result.unfollowed, "==", 0),
        Check(
            f"{label}: mean KL(baseline || candidate) per step (nats)",
            result.mean_kl,
            "<=",
            limits["max_mean_kl"],
            f"{where}limit: {why['max_mean_kl']}",
        ),
        Check(
            f"{label}: p99 KL per step (nats)",
            result.p99_kl,
            "<=",
            limits["max_p99_kl"],
            f"{where}limit: {why['max_p99_kl']}",
        ),
        Check(
            f"{label}: mean top-5 overlap",
            result.mean_top5_overlap,
            ">=",
            limits["min_mean_top5_overlap"],
            f"limit: {why['min_mean_top5_overlap']}",
        ),
        Check(
            f"{label}: worst |forced-token logprob difference| (nats)",
            result.max_target_diff,
            "<=",
            limits["max_abs_target_logprob_diff"],
            f"limit: {why['max_abs_target_logprob_diff']}",
        ),
    ]
