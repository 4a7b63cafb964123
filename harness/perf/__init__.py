"""Principle 4, performance with a verdict: the parts of the perf stage that know no model.

- `plan`: the `[perf]` table of a config (sweep cells, regression budgets by region, timing settings), validated.
- `stats`: confidence intervals of a time ratio over paired rounds, stratified by which arm went first (a bootstrap
  of the median log ratio, or Welch's t on the mean).
- `timing`: baseline and candidate timed interleaved (ABBA) in one process until the ratio's interval is narrow;
  each sample is as many back-to-back steps as a calibrated minimum duration needs, after an untimed lead-in.
- `clocks`: GPU clocks before and after, from nvidia-smi when it is present.
- `suite`: what a subject's perf suite provides (arms, profiles, the bytes a step must move).
- `measure`: one cell measured end to end; `axes`: its metrics, one axis each (ITL, tok/s, tok/s/user, ...).
- `checks`: the verdict's checks (regression budget, roofline ceiling, Amdahl consistency, dispatch path).
- `pareto`, `plot`: the interactivity vs throughput-per-GPU frontier, and its figure.
- `serving`, `serving_records` (+ `serving.toml`): the same sweep for subjects served by vLLM, as serving benchmark
  rounds (harness/runners/bench.py) against both arms' servers, with metrics by axis and proof of path.
- `redteam` (+ `redteam.toml`): candidates whose numbers lie, each of which the verdict must fail.
"""
