"""Principle 4, performance with a verdict: the parts of the perf stage that know no model.

- `plan`: the `[perf]` table of a config (sweep cells, regression budgets by region, timing settings), validated.
- `stats`: confidence intervals of a time ratio (paired t on log ratios, paired bootstrap of the median ratio).
- `timing`: baseline and candidate timed interleaved in one process until the ratio's interval is narrow.
- `clocks`: GPU clocks before and after, from nvidia-smi when it is present.
- `suite`: what a subject's perf suite provides (arms, profiles, the bytes a step must move).
- `measure`: one cell measured end to end; `axes`: its metrics, one axis each (ITL, tok/s, tok/s/user, ...).
- `checks`: the verdict's checks (regression budget, roofline ceiling, Amdahl consistency, dispatch path).
- `pareto`, `plot`: the interactivity vs throughput-per-GPU frontier, and its figure.
"""
