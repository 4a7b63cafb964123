"""Phase traces: where the time goes inside the attention side's kernels, CTA by CTA.

A profiler's timeline shows when each kernel starts and ends; it cannot show why the KDA step ends 7 us after the
projection when it takes 3.5 us alone. A traced build answers that: thread 0 of every CTA stamps the GPU's
nanosecond timer (`%globaltimer_lo`) and its SM's cycle counter (`%clock`) at the phases `phase_trace.toml` names,
into the words after the kernel's launch counter. The timer is common to all SMs, so stamps of different kernels
line up; the cycle counter is per SM and kept for phase lengths within a CTA.

Layout of a traced kernel's counter: word 0 is the launch count (as in every build); CTA c owns words 1 + 32 c ..
1 + 32 c + 31: the timer at phase k in word k (k < 15), the SM's id in word 15, the cycle counter at phase k in
word 16 + k. A zero timer word means the CTA did not stamp that phase.

Tracing is off unless `enable()` was called before the first launch of a kernel: the kernels are then compiled
with the stamps, and their counters are grown to hold them. An untraced build contains no stamp at all (the
stamps are behind a compile-time flag; tests/k3_decode/kernels/test_phase_trace.py checks the PTX of both), so
the shipped kernels and their PTX/SASS checks are unchanged. The stamps cost a few global stores per CTA and the
two CTA barriers named in the toml; timings of a traced run are diagnostic, not the benchmark's figures.
"""

from __future__ import annotations

import statistics
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

WORDS = 32  # counter words per CTA
TIMER_PHASES = 15  # timer words 0 .. 14; word 15 is the SM id
SM_WORD = 15
CLOCK_BASE = 16
MAX_CTAS = 2048  # CTAs a traced grid may have (the step's largest grid at B64 is 768)
_TABLE = Path(__file__).with_name("phase_trace.toml")
_enabled = False


def enable(on: bool = True) -> None:
    """Trace every kernel compiled from now on (call before the executors start: a CUDA graph keeps the counter
    address it captured)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def counter_size() -> int:
    """The words a kernel's launch counter needs: 1, or the launch count and MAX_CTAS CTAs of stamps."""
    return 1 + MAX_CTAS * WORDS if _enabled else 1


def words_for(ctas: int, traced: bool) -> int:
    """The counter words a launch of `ctas` CTAs reads (the compile signature's length of the counter)."""
    if not traced:
        return 1
    if ctas > MAX_CTAS:
        raise ValueError(f"a traced kernel may have at most {MAX_CTAS} CTAs, this grid has {ctas}; trace fewer rows")
    return 1 + ctas * WORDS


@cache
def phases(kernel: str) -> tuple[str, ...]:
    table = tomllib.loads(_TABLE.read_text())
    if kernel not in table:
        raise KeyError(f"no phases for kernel {kernel!r} in {_TABLE.name}; known: {', '.join(sorted(table))}")
    names = tuple(table[kernel]["phases"])
    if not 1 <= len(names) <= TIMER_PHASES:
        raise ValueError(f"{_TABLE.name} [{kernel}]: 1 to {TIMER_PHASES} phases, got {len(names)}")
    return names


@dataclass(frozen=True)
class CtaTrace:
    cta: int
    sm: int
    timer: tuple[int | None, ...]  # ns (low 32 bits of the global timer) per phase; None: not stamped
    clock: tuple[int | None, ...]  # SM cycles per phase


def decode(words: Sequence[int], kernel: str) -> list[CtaTrace]:
    """The CTAs that stamped their start, from a traced counter's words (word 0, the launch count, included)."""
    n = len(phases(kernel))
    body = list(words[1:])
    if len(body) % WORDS:
        raise ValueError(f"a traced counter has 1 + {WORDS} x CTAs words, got {len(words)}")
    out = []
    for c in range(len(body) // WORDS):
        row = body[c * WORDS : (c + 1) * WORDS]
        if row[0] == 0:
            continue
        timer = tuple(row[k] if row[k] else None for k in range(n))
        clock = tuple(row[CLOCK_BASE + k] if timer[k] is not None else None for k in range(n))
        out.append(CtaTrace(c, row[SM_WORD], timer, clock))
    return out


def _since(value: int, reference: int) -> int:
    """value - reference in ns for two 32-bit timer readings less than 2^31 ns apart (the low word wraps every
    4.3 s; the counter words are signed Int32)."""
    d = (value - reference) & 0xFFFFFFFF
    return d - (1 << 32) if d >= 1 << 31 else d


STRAGGLERS = 8  # the slowest CTAs a summary names, per kernel


def summarize(traces: Mapping[str, Sequence[CtaTrace]], stragglers: int = STRAGGLERS) -> dict[str, Any]:
    """Per kernel and phase, the min, median and max over its CTAs of the time (us) since the earliest start of
    any traced CTA, and how many CTAs stamped it. Kernels in `traces` order (launch order). Per kernel also its
    slowest CTAs and its CTAs grouped by how many of them shared an SM (`_stragglers`), at its last phase that
    every CTA stamped: what the next kernel, or the grid's own waiting clusters, wait for."""
    starts = [t.timer[0] for ts in traces.values() for t in ts if t.timer[0] is not None]
    if not starts:
        raise ValueError("no traced CTA stamped its start: were the kernels compiled with tracing enabled?")
    ref = min(starts, key=lambda s: _since(s, starts[0]))

    def us(value: int | None) -> float | None:
        return None if value is None else _since(value, ref) / 1e3

    out: dict[str, Any] = {"reference": "the earliest start of a traced CTA", "kernels": []}
    for i, (kernel, ts) in enumerate(traces.items()):
        rows = []
        for k, name in enumerate(phases(kernel)):
            vals = sorted(us(t.timer[k]) for t in ts if t.timer[k] is not None)
            row: dict[str, Any] = {"phase": name, "ctas": len(vals)}
            if vals:
                row.update(min_us=vals[0], median_us=statistics.median(vals), max_us=vals[-1])
            rows.append(row)
        entry = {"kernel": kernel, "ctas": len(ts), "sms": len({t.sm for t in ts}), "phases": rows}
        entry.update(_stragglers(kernel, ts, dict(list(traces.items())[:i]), us, stragglers))
        out["kernels"].append(entry)
    return out


def _last_end(t: CtaTrace) -> int | None:
    return next((v for v in reversed(t.timer) if v is not None), None)


def _stragglers(
    kernel: str,
    ts: Sequence[CtaTrace],
    earlier: Mapping[str, Sequence[CtaTrace]],
    us: Callable[[int | None], float | None],
    count: int,
) -> dict[str, Any]:
    """At the kernel's last phase every CTA stamped: its `count` slowest CTAs, each with its phases, how many CTAs
    of this kernel its SM held, and per earlier kernel how many of its CTAs ran on that SM and when the last of
    them ended; and the phase's median and max over the CTAs of SMs holding 1, 2, ... of this kernel's CTAs. A
    straggler on a crowded SM, or on an SM an earlier kernel held late, says which."""
    full = [k for k in range(len(phases(kernel))) if ts and all(t.timer[k] is not None for t in ts)]
    if not full:
        return {}
    k = full[-1]
    per_sm = Counter(t.sm for t in ts)
    slowest = sorted(ts, key=lambda t: us(t.timer[k]), reverse=True)[:count]
    named = []
    for t in slowest:
        before = {}
        for other, others in earlier.items():
            there = [o for o in others if o.sm == t.sm and _last_end(o) is not None]
            if there:
                before[other] = {"ctas": len(there), "last_end_us": max(us(_last_end(o)) for o in there)}
        named.append(
            {"cta": t.cta, "sm": t.sm, "us": [us(v) for v in t.timer], "same_sm": per_sm[t.sm], "before": before}
        )
    groups = []
    for load in sorted(set(per_sm.values())):
        vals = sorted(us(t.timer[k]) for t in ts if per_sm[t.sm] == load)
        sms = sum(1 for n in per_sm.values() if n == load)
        groups.append({"per_sm": load, "sms": sms, "median_us": statistics.median(vals), "max_us": vals[-1]})
    return {"straggler_phase": phases(kernel)[k], "stragglers": named, "by_sm_load": groups}


def lines(summary: Mapping[str, Any]) -> list[str]:
    """One line per kernel and phase: `median (min-max)` us since the reference."""
    out = []
    for k in summary["kernels"]:
        out.append(f"  {k['kernel']} ({k['ctas']} CTAs on {k['sms']} SMs):")
        for p in k["phases"]:
            span = f"{p['median_us']:.2f} ({p['min_us']:.2f}-{p['max_us']:.2f})" if p["ctas"] else "not reached"
            out.append(f"    {span:>22}  {p['phase']} [{p['ctas']} CTAs]")
        if k.get("by_sm_load"):
            out.append(f"    at '{k['straggler_phase']}', by this kernel's CTAs per SM:")
            for g in k["by_sm_load"]:
                out.append(
                    f"      {g['per_sm']} a SM ({g['sms']} SMs): median {g['median_us']:.2f}, max {g['max_us']:.2f}"
                )
            out.append(
                "    slowest CTAs there (phases in order; earlier kernels' CTAs on the same SM, their last end):"
            )
            for s in k["stragglers"]:
                stamps = " ".join("-" if v is None else f"{v:.2f}" for v in s["us"])
                before = "; ".join(f"{n} {b['ctas']}, {b['last_end_us']:.2f}" for n, b in s["before"].items())
                out.append(f"      CTA {s['cta']} SM {s['sm']} ({s['same_sm']} here): {stamps} | {before or 'none'}")
    return out
