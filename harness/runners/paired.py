"""The paired decision for one eval task: the same items on both arms, non-inferiority with a margin from data."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.runners import stats
from harness.runners.eval_tasks import TaskSpec
from harness.runners.lmeval import Item
from harness.verdicts import Check


@dataclass(frozen=True)
class PairedResult:
    task: str
    n: int
    baseline_mean: float
    candidate_mean: float
    diff: float
    low: float
    high: float
    margin: float
    mcnemar_p: float | None  # 0/1 metrics only
    baseline_only: int  # items right on baseline only (binary) / worse on candidate (continuous)
    candidate_only: int
    prompts_differ: int
    missing: int  # items scored on one arm only
    same_response: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare(spec: TaskSpec, base: dict[int, Item], cand: dict[int, Item], decision: dict[str, Any]) -> PairedResult:
    shared = sorted(set(base) & set(cand))
    missing = len(set(base) ^ set(cand))
    if not shared:
        raise ValueError(f"{spec.name}: no item was scored on both arms")
    diffs = [cand[i].score - base[i].score for i in shared]
    interval = stats.paired_bootstrap(
        diffs, decision["bootstrap_resamples"], decision["alpha"], decision["bootstrap_seed"]
    )
    worse = sum(1 for d in diffs if d < 0)
    better = sum(1 for d in diffs if d > 0)
    return PairedResult(
        task=spec.name,
        n=len(shared),
        baseline_mean=sum(base[i].score for i in shared) / len(shared),
        candidate_mean=sum(cand[i].score for i in shared) / len(shared),
        diff=interval.mean,
        low=interval.low,
        high=interval.high,
        margin=spec.margin,
        mcnemar_p=stats.mcnemar_exact(worse, better) if spec.binary else None,
        baseline_only=worse,
        candidate_only=better,
        prompts_differ=sum(1 for i in shared if base[i].prompt_hash != cand[i].prompt_hash),
        missing=missing,
        same_response=sum(1 for i in shared if base[i].response == cand[i].response),
    )


def checks(result: PairedResult, label: str, expected_items: int) -> list[Check]:
    detail = (
        f"baseline {result.baseline_mean:.4f}, candidate {result.candidate_mean:.4f}, n {result.n}, "
        f"{result.baseline_only} worse / {result.candidate_only} better"
        + (f", McNemar p {result.mcnemar_p:.3g}" if result.mcnemar_p is not None else "")
    )
    return [
        Check(f"{label}: items scored on both arms", result.n, ">=", expected_items),
        Check(f"{label}: items scored on one arm only", result.missing, "==", 0),
        Check(f"{label}: items whose prompt differs between arms", result.prompts_differ, "==", 0),
        Check(
            f"{label}: lower bound of candidate - baseline (paired bootstrap)",
            round(result.low, 6),
            ">=",
            -result.margin,
            detail,
        ),
    ]
