"""Stack equivalence: the long-generation check of Principle 3 (issue #8).

Two started executors of one stack over the same weights and the same request state, the reference (the stock path)
and the candidate (the specialized path), decode the same requests for many steps, teacher-forced: every step both
get the same entry state (`random_input` of the stack's first layer, seeded per step), while each keeps its own KDA
states and MLA cache. An error in a state update therefore stays in the candidate's state and shows, and adds up, in
every later step, which a one-step comparison against the oracle cannot see.

Per step, on the device (rows of one device tensor, read once at the end: the check reads nothing back per step;
the executors' steps still copy their slot tables from the host as they always do):
- the stack outputs B x hidden (the last layer's MLP output): rms(C - R) / rms(R) over the batch, max|C - R| /
  rms(R), and the median over requests of each request's own rms(C_b - R_b) / rms(R_b);
- the same for "logits": the outputs times a fixed seeded FP32 projection hidden -> `logit_columns` (a stand-in for
  the LM head), and each request's cosine similarity of its two logit rows (the worst of them kept per step).
At the end: the KDA recurrent states of the step's requests (rms relative to the reference's, per layer and
request), and every piece of state the steps must not touch (KDA slots of other requests and the NULL slot, MLA
rows outside the steps' new tokens), which must be bit-identical in the two executors.

The verdict is a list of `harness.verdicts.Check`; the limits are data (`equivalence.toml`, per model, each number
with its reason). Why the per-step bounds are caps and the level is a median: a top-k router decides near-ties, so
two correct implementations whose inputs differ by an ulp route a request to a different expert now and then, and
that request's MoE output moves by a fraction of itself in that step (most of it with k3-mini's 4 of 16 experts, a
quarter or so with K3's 16 of 896). Every step must stay under the caps, which admit such a step; the typical level
and the growth are measured on the median request of each step, which one or two flipped requests do not move.
"""

from __future__ import annotations

import functools
import math
import statistics
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import Tensor

from harness.verdicts import Check
from k3_decode.executor.executor import StackExecutor, StepRequest
from k3_decode.executor.inputs import random_input
from k3_decode.runtime.ledger import Mode

# Per-step metrics, the columns of the device tensor the steps fill.
METRICS = (
    "out_rms_rel",  # rms(C - R) / rms(R) over the batch's stack outputs
    "out_peak_rel",  # max|C - R| / rms(R)
    "out_median_rms_rel",  # median over requests of rms(C_b - R_b) / rms(R_b) (the lower median for even counts)
    "logit_rms_rel",  # as out_*, on the projected logits
    "logit_peak_rel",
    "logit_median_rms_rel",
    "logit_cos_min",  # the lowest cosine similarity of a request's candidate and reference logit rows
)
_TOLERANCE_KEYS = (
    "step_rms_rel",
    "step_peak_rel",
    "cosine_floor",
    "typical_rms_rel",
    "growth",
    "growth_floor",
    "state_rms_rel",
    "first_state_rms_rel",
    "typical_cosine",
)
_RUN_KEYS = ("steps", "min_steps", "window", "logit_columns")


class EquivalenceError(ValueError):
    """The two executors cannot be compared as given; the message names the difference and the fix."""


# -- data --------------------------------------------------------------------------------------------------------


@functools.cache
def _data() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("equivalence.toml").read_text())


def _section(name: str, keys: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """A table of equivalence.toml with exactly `keys` and a [<name>.why] entry for each."""
    data = _data()
    if name not in data:
        models = sorted(k for k in data if k != "run")
        raise EquivalenceError(f"equivalence.toml has no [{name}]; add its tolerances or use one of {models}")
    table = dict(data[name])
    why = table.pop("why", {})
    if sorted(table) != sorted(keys) or sorted(why) != sorted(keys):
        raise EquivalenceError(
            f"equivalence.toml [{name}] must give exactly {sorted(keys)} and a reason for each in [{name}.why]; "
            f"it gives {sorted(table)} with reasons for {sorted(why)}"
        )
    return table, why


@dataclass(frozen=True)
class RunSettings:
    steps: int  # decode steps of the long-generation check
    min_steps: int  # fewest steps a check may run (each window two steps or more, the two windows apart)
    window: float  # fraction of the steps in the first and in the last window of the growth check
    logit_columns: int  # columns of the projection standing in for logits
    why: Mapping[str, str]

    def window_steps(self, steps: int) -> int:
        return max(1, round(self.window * steps))


def run_settings() -> RunSettings:
    table, why = _section("run", _RUN_KEYS)
    return RunSettings(
        int(table["steps"]), int(table["min_steps"]), float(table["window"]), int(table["logit_columns"]), why
    )


@dataclass(frozen=True)
class Tolerances:
    """The limits of one model's check (equivalence.toml [<model>]); `why` gives the reason of each."""

    model: str
    step_rms_rel: float  # every step: outputs and logits rms_rel over the batch
    step_peak_rel: float  # every step: max abs difference / the reference's rms, outputs and logits
    cosine_floor: float  # every step: the worst request's logit cosine similarity
    typical_rms_rel: float  # median over the steps of the median request's rms_rel, outputs and logits
    growth: float  # last window's median / the first window's (at least growth_floor), median request's rms_rel
    growth_floor: float  # the first window's level below which divergence is rounding noise, not a baseline
    state_rms_rel: float  # KDA recurrent states of the step's requests at the end, per layer and request
    first_state_rms_rel: float  # the same for the stack's first KDA layer, whose input no upstream routing changes
    typical_cosine: float  # the worst request's median over the steps of its own logit cosine similarity
    why: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("model", *_TOLERANCE_KEYS)} | {"why": dict(self.why)}


def tolerances(model: str) -> Tolerances:
    table, why = _section(model, _TOLERANCE_KEYS)
    return Tolerances(model, **{k: float(table[k]) for k in _TOLERANCE_KEYS}, why=why)


# -- per-step metrics --------------------------------------------------------------------------------------------


def projection(hidden: int, columns: int, seed: int, device: torch.device | str) -> Tensor:
    """The fixed FP32 projection hidden -> columns standing in for the LM head (unit gain: entries N(0, 1/hidden))."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, columns, generator=gen, dtype=torch.float32) / math.sqrt(hidden)).to(device)


def _divergence(ref: Tensor, diff: Tensor) -> list[Tensor]:
    """rms_rel, peak_rel and the median request's rms_rel of `diff` against `ref` ([B, n] FP32), 0-dim tensors."""
    rms = ref.square().mean().sqrt()
    rows = diff.square().mean(dim=1).sqrt() / ref.square().mean(dim=1).sqrt()
    return [diff.square().mean().sqrt() / rms, diff.abs().amax() / rms, rows.median()]


def step_metrics(reference: Tensor, candidate: Tensor, proj: Tensor) -> Tensor:
    """The per-step metrics (METRICS, in order) of one step's stack outputs [B, hidden], as one FP32 device tensor.

    NaN or Inf anywhere in the candidate makes the metrics non-finite (amax, median and min propagate NaN)."""
    return step_metrics_and_cosines(reference, candidate, proj)[0]


def step_metrics_and_cosines(reference: Tensor, candidate: Tensor, proj: Tensor) -> tuple[Tensor, Tensor]:
    """step_metrics, and each request's logit cosine similarity [B] (their minimum is the metrics' last column)."""
    r, c = reference.float(), candidate.float()
    lr, lc = r @ proj, c @ proj
    cos = torch.nn.functional.cosine_similarity(lc, lr, dim=1)
    return torch.stack([*_divergence(r, c - r), *_divergence(lr, lc - lr), cos.min()]), cos


# -- start and end state -----------------------------------------------------------------------------------------


def _same_start(reference: StackExecutor, candidate: StackExecutor) -> str | None:
    """Why the two executors do not start from the same stack, weights and request state (None when they do)."""
    for what, a, b in (
        ("model", reference.dims.name, candidate.dims.name),
        ("layers", reference.config.layers, candidate.config.layers),
        ("TP", (reference.config.tp, reference.config.rank), (candidate.config.tp, candidate.config.rank)),
        ("max_requests", reference.config.max_requests, candidate.config.max_requests),
        ("max_context", reference.config.max_context, candidate.config.max_context),
        ("device", reference.device, candidate.device),
        (
            "FP8 scales",
            (reference.config.k_scale, reference.config.q_scale),
            (candidate.config.k_scale, candidate.config.q_scale),
        ),
    ):
        if a != b:
            return f"different {what}: reference {a}, candidate {b}"
    for layer in reference.config.layers:
        mine, theirs = reference.weights[layer].tensors(), candidate.weights[layer].tensors()
        for name, t in mine.items():
            if theirs.get(name) is not t and not torch.equal(t, theirs[name]):
                return f"different weights: layer {layer} {name}"
    if reference.state.context_lens != candidate.state.context_lens:
        return "different context lengths (prefill or fill both the same way)"
    for layer, cache in reference.state.kda.items():
        other = candidate.state.kda[layer]
        if not (torch.equal(cache.conv, other.conv) and torch.equal(cache.recurrent, other.recurrent)):
            return f"different KDA states in layer {layer}"
    for layer, cache in reference.state.mla.items():
        if not torch.equal(cache, candidate.state.mla[layer]):
            return f"different MLA cache in layer {layer}"
    return None


def _rms_rel(got: Tensor, ref: Tensor) -> Tensor:
    got, ref = got.double(), ref.double()
    return (got - ref).square().mean().sqrt() / ref.square().mean().sqrt()


def _untouched_rows(ex: StackExecutor, requests: Sequence[int], start: Mapping[int, int], steps: int) -> Tensor:
    """[pages, page_size] bool on the device: the MLA cache rows the steps must not write (all but the new tokens')."""
    cfg = ex.config
    keep = torch.ones(cfg.max_requests * cfg.pages_per_request, cfg.page_size, dtype=torch.bool)
    for r in requests:
        for pos in range(start[r], start[r] + steps):
            keep[int(ex.state.block_table_host[r, pos // cfg.page_size]), pos % cfg.page_size] = False
    return keep.to(ex.device)


def _end_state(
    reference: StackExecutor,
    candidate: StackExecutor,
    requests: Sequence[int],
    start: Mapping[int, int],
    steps: int,
) -> tuple[dict[int, dict[int, float]], list[str]]:
    """Per KDA layer and request, the recurrent state's rms_rel; and what differs outside the steps' write set."""
    slots = {r: reference.state.kda_slot(r) for r in requests}
    rel: dict[tuple[int, int], Tensor] = {}
    outside: dict[str, Tensor] = {}
    for layer, cache in reference.state.kda.items():
        other = candidate.state.kda[layer]
        for r, s in slots.items():
            rel[(layer, r)] = _rms_rel(other.recurrent[s], cache.recurrent[s])
        keep = torch.ones(cache.num_slots, dtype=torch.bool)
        keep[list(slots.values())] = False
        idx = keep.nonzero().flatten().to(cache.recurrent.device)
        for part in ("conv", "recurrent"):
            a, b = getattr(cache, part)[idx], getattr(other, part)[idx]
            outside[f"layer {layer} KDA {part} state of the slots outside the steps"] = (a != b).sum()
    for layer, cache in reference.state.mla.items():
        keep = _untouched_rows(reference, requests, start, steps)
        differs = (cache != candidate.state.mla[layer]).any(dim=-1) & keep
        outside[f"layer {layer} MLA cache rows other than the steps' new tokens"] = differs.sum()
    values = torch.stack([*rel.values(), *(t.double() for t in outside.values())]).cpu().tolist()  # one read
    states: dict[int, dict[int, float]] = {}
    for (layer, r), v in zip(rel, values[: len(rel)], strict=True):
        states.setdefault(layer, {})[r] = v
    counts = zip(outside, values[len(rel) :], strict=True)
    return states, [f"{where}: {int(n)} values differ" for where, n in counts if n]


# -- the check ---------------------------------------------------------------------------------------------------


def _seed(seed: int, step: int) -> int:
    """The generator seed of one step's entry state (step -1: the projection). torch's CPU generator keeps the low
    32 bits of a seed, so the run seed and the step are mixed into those."""
    return (seed * 1_000_003 + step + 1) % 2**32


def _median(xs: Sequence[float]) -> float:
    return math.nan if any(math.isnan(x) for x in xs) else statistics.median(xs)


def _worst(xs: Sequence[float], highest: bool = True) -> tuple[float, int]:
    """The largest (or smallest) value and its step; NaN (at its first step) when any value is NaN."""
    for i, x in enumerate(xs):
        if math.isnan(x):
            return x, i
    i = max(range(len(xs)), key=xs.__getitem__) if highest else min(range(len(xs)), key=xs.__getitem__)
    return xs[i], i


def _ratio(last: float, first: float) -> float:
    if math.isnan(last) or math.isnan(first):
        return math.nan
    if first == 0:
        return 0.0 if last == 0 else math.inf
    return last / first


@dataclass(frozen=True)
class Equivalence:
    """What `compare_stacks` found: per-step series, summaries, end states and the checks."""

    model: str
    layers: tuple[int, ...]
    tp: int
    mode: Mode
    requests: tuple[int, ...]
    steps: int
    seed: int
    window: int  # steps in each of the growth check's two windows
    series: dict[str, list[float]]  # METRICS -> one value per step
    summary: dict[str, dict[str, float]]
    request_cosines: dict[int, float]  # request -> median over the steps of its logit cosine similarity
    states: dict[int, dict[int, float]]  # KDA layer -> request -> recurrent state rms_rel at the end
    touched: list[str]  # state outside the steps' write set that differs between the two executors
    checks: list[Check]
    tolerances: Tolerances

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_json(self, digits: int = 4) -> dict[str, Any]:
        """JSON-ready, the series rounded to `digits` significant digits; NaN and Inf as the strings "nan", "inf"."""

        def num(x: float) -> float | str:
            if isinstance(x, int):
                return x
            return float(f"{x:.{digits}g}") if math.isfinite(x) else str(x)

        return {
            "model": self.model,
            "layers": list(self.layers),
            "tp": self.tp,
            "mode": self.mode,
            "requests": list(self.requests),
            "steps": self.steps,
            "seed": self.seed,
            "window": self.window,
            "passed": self.passed,
            "checks": [c.to_record() | {"value": num(c.value)} for c in self.checks],
            "summary": {m: {k: num(v) for k, v in s.items()} for m, s in self.summary.items()},
            "request_cosine_medians": {str(r): num(v) for r, v in self.request_cosines.items()},
            "kda_states": {str(layer): {str(r): num(v) for r, v in by.items()} for layer, by in self.states.items()},
            "touched": list(self.touched),
            "tolerances": self.tolerances.to_json(),
            "series": {m: [num(x) for x in xs] for m, xs in self.series.items()},
        }


def _summary(series: Mapping[str, list[float]], window: int) -> dict[str, dict[str, float]]:
    """Per metric: the worst value (the highest; for the cosine the lowest) and its step, max, min, the median over
    all steps, over the first and over the last window, and the plain ratio of the two windows' medians (the growth
    check puts a floor under the first; see _checks)."""
    out = {}
    for name, xs in series.items():
        highest = name != "logit_cos_min"
        worst, at = _worst(xs, highest)
        first, last = _median(xs[:window]), _median(xs[-window:])
        row = {"worst": worst, "worst_step": float(at), "max": _worst(xs)[0], "min": _worst(xs, False)[0]}
        row |= {"median": _median(xs), "first_median": first, "last_median": last}
        if highest:
            row["growth"] = _ratio(last, first)
        out[name] = row
    return out


def _checks(
    summary: Mapping[str, Mapping[str, float]],
    request_cosines: Mapping[int, float],
    states: Mapping[int, Mapping[int, float]],
    touched: Sequence[str],
    nonfinite: int,
    tol: Tolerances,
    window: int,
) -> list[Check]:
    def worst(metric: str, limit: float, name: str, op: str = "<=") -> Check:
        row = summary[metric]
        return Check(name, row["worst"], op, limit, f"worst at step {int(row['worst_step'])}")

    checks = [Check("finite", nonfinite, "==", 0, "NaN or Inf values among the per-step metrics and end states")]
    for part, prefix in (("outputs", "out"), ("logits", "logit")):
        typical = summary[f"{prefix}_median_rms_rel"]
        first = typical["first_median"]
        base = first if math.isnan(first) else max(first, tol.growth_floor)
        checks += [
            worst(f"{prefix}_rms_rel", tol.step_rms_rel, f"{part}.step_rms_rel"),
            worst(f"{prefix}_peak_rel", tol.step_peak_rel, f"{part}.step_peak_rel"),
            Check(
                f"{part}.typical_rms_rel",
                typical["median"],
                "<=",
                tol.typical_rms_rel,
                "median over the steps of each step's median request's rms_rel",
            ),
            Check(
                f"{part}.growth",
                _ratio(typical["last_median"], base),
                "<=",
                tol.growth,
                f"the median request's rms_rel: median over the last {window} steps {typical['last_median']:.3g} / "
                f"over the first {window} {first:.3g} (at least the floor {tol.growth_floor:.3g})",
            ),
        ]
    checks.append(worst("logit_cos_min", tol.cosine_floor, "logits.cosine", ">="))
    # Per request, then the worst: the median over the steps of the worst request of each step would fall with
    # the batch (more requests, more steps where one of them has a routing flip), not with the candidate.
    value, r = next(
        ((v, r) for r, v in request_cosines.items() if math.isnan(v)),
        min((v, r) for r, v in request_cosines.items()),
    )
    checks.append(
        Check(
            "logits.typical_cosine",
            value,
            ">=",
            tol.typical_cosine,
            f"the worst request's median over the steps of its logit cosine similarity (request {r}; median over "
            f"the steps of each step's worst request: {summary['logit_cos_min']['median']:.3g})",
        )
    )

    def state_check(name: str, layers: Sequence[int], limit: float, what: str) -> None:
        flat = [(v, layer, r) for layer in layers for r, v in states[layer].items()]
        if flat:
            value, layer, r = next((f for f in flat if math.isnan(f[0])), max(flat))
            where = f"worst: layer {layer} request {r}, the recurrent state after the last step ({what})"
            checks.append(Check(name, value, "<=", limit, where))

    if states:
        first = min(states)
        state_check("kda_state.first_layer.rms_rel", [first], tol.first_state_rms_rel, "the stack's first KDA layer")
        state_check("kda_state.rms_rel", sorted(states), tol.state_rms_rel, "every KDA layer")
    checks.append(Check("untouched_state", len(touched), "==", 0, "; ".join(touched) or "bit-identical"))
    return checks


def compare_stacks(
    reference: StackExecutor,
    candidate: StackExecutor,
    requests: Sequence[int],
    steps: int,
    seed: int = 0,
    *,
    mode: Mode | None = None,
    tol: Tolerances | None = None,
    progress: Callable[[int], None] | None = None,
) -> Equivalence:
    """Decode `requests` for `steps` teacher-forced steps on both executors and judge the candidate against the
    reference. Both must start from the same stack, weights and request state (EquivalenceError otherwise).

    `mode`: "graph" (one CUDA graph of the batch captured on each executor, every step a replay; the default on
    CUDA) or "eager" (the default on the CPU). `tol`: the model's tolerances of equivalence.toml by default.
    `progress(step)`: called after each step is queued (it must not read the device either)."""
    run = run_settings()
    ids = tuple(requests)
    if not ids or len(set(ids)) != len(ids):
        raise EquivalenceError(f"requests {list(ids)}: give one or more requests, each once")
    if steps < run.min_steps:
        raise EquivalenceError(f"{steps} steps are too few for the growth check; run at least {run.min_steps}")
    if why := _same_start(reference, candidate):
        raise EquivalenceError(f"the executors do not start from the same stack and state: {why}")
    cfg, dims, device = reference.config, reference.dims, reference.device
    mode = mode or ("graph" if device.type == "cuda" else "eager")
    if mode not in ("graph", "eager"):
        raise EquivalenceError(f"mode {mode!r}: use 'graph' (CUDA) or 'eager'")
    if mode == "graph" and device.type != "cuda":
        raise EquivalenceError(f"graph mode needs CUDA; these executors run on {device}: use mode='eager'")
    start = {r: reference.state.context_lens[r] for r in ids}
    full = [r for r in ids if start[r] + steps > cfg.max_context]
    if full:
        raise EquivalenceError(
            f"requests {full} would pass max_context {cfg.max_context} within {steps} steps; build the stack with a "
            "larger max_context or give them less context"
        )
    tol = tol or tolerances(dims.name)
    if mode == "graph":
        for ex in (reference, candidate):
            ex.capture(len(ids))
    proj = projection(dims.hidden_size, run.logit_columns, _seed(seed, -1), device)
    metrics = torch.full((steps, len(METRICS)), math.nan, dtype=torch.float32, device=device)  # NaN: not run
    cosines = torch.full((steps, len(ids)), math.nan, dtype=torch.float32, device=device)
    ran, error = 0, ""
    for step in range(steps):
        entry = random_input(dims, cfg.layers[0], len(ids), _seed(seed, step), device)
        reqs = [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(ids)]
        want = reference.step(reqs, mode=mode)
        try:
            got = candidate.step(reqs, mode=mode)
        except (ValueError, RuntimeError) as exc:
            # The candidate's step refused to go on (e.g. the stock router below it got NaN): that step and the
            # rest are failures of the candidate, not of the check. The reference's errors propagate.
            text = str(exc).strip().splitlines()
            error = f"step {step} raised {type(exc).__name__}: {text[0] if text else ''}"
            break
        r_out = torch.cat([want.outputs[r] for r in ids])
        c_out = torch.cat([got.outputs[r] for r in ids])
        metrics[step], cosines[step] = step_metrics_and_cosines(r_out, c_out, proj)
        ran = step + 1
        if progress is not None:
            progress(step)
    columns = metrics.double().cpu().T.tolist()  # the one read of the per-step metrics
    series = dict(zip(METRICS, columns, strict=True))
    # Steps the candidate did not run stay NaN and so make its requests' medians NaN: never a pass.
    per_request = cosines.double().cpu().T.tolist()
    request_cosines = {r: _median(xs) for r, xs in zip(ids, per_request, strict=True)}
    states, touched = _end_state(reference, candidate, ids, start, steps)
    window = run.window_steps(steps)
    summary = _summary(series, window)
    values = [x for xs in columns for x in xs] + [v for by in states.values() for v in by.values()]
    nonfinite = sum(not math.isfinite(x) for x in values)
    return Equivalence(
        model=dims.name,
        layers=cfg.layers,
        tp=cfg.tp,
        mode=mode,
        requests=ids,
        steps=steps,
        seed=seed,
        window=window,
        series=series,
        summary=summary,
        request_cosines=request_cosines,
        states=states,
        touched=touched,
        checks=[
            Check("candidate_steps", ran, "==", steps, error or "the candidate ran every step"),
            *_checks(summary, request_cosines, states, touched, nonfinite, tol, window),
        ],
        tolerances=tol,
    )


def specialized_dispatches(ex: StackExecutor) -> dict[str, int]:
    """`L<layer>.<op>` -> dispatches the executor ran on the specialized path (graph records times their replays),
    from its ledger: what ran specialized, for a report and to refuse a comparison of stock with stock."""
    out: dict[str, int] = {}
    for rec in ex.ledger.records():
        n = ex.ledger.executions(rec)
        if rec.path == "specialized" and n:
            key = f"L{rec.layer}.{rec.op}"
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))
