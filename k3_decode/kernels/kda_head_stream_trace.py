"""What the head-ordered projection's trace words say about one launch (pure Python: the words are read back from
the device by the caller).

The words (HeadStreamPlan's layout): the launch count, one counter per group (shared rows, then each head), each
CTA's start stamp and each packed row's publish stamp, stamps being the GPU's nanosecond timer's low 32 bits; with
the watching warp also the epoch, the done count and, per CTA and group, when its watcher saw the counter full. The
counters add up over launches; the stamps are the last launch's. Times are taken from the earliest CTA start,
modulo 2^32 ns (a launch lasts microseconds, the timer's low word wraps every 4.3 s).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from k3_decode.kernels.kda_head_stream_plan import HeadStreamPlan

WRAP = 1 << 32


@dataclass(frozen=True)
class HeadStreamTimeline:
    launches: int
    counters: tuple[int, ...]  # per group, summed over launches
    start_spread_us: float  # the last CTA's start after the first's
    group_first_us: tuple[float, ...]  # per group: its first row published, after the first CTA's start
    group_done_us: tuple[float, ...]  # per group: its last row published (its counter full)
    trip_median_us: tuple[float, ...]  # per trip: the median publish time of the trip's rows
    end_us: float  # the last row published
    # With the watching warp: per group, over the CTAs' watchers, when they saw its counter full (after the first
    # CTA's start): the earliest, the median and the latest. Empty without it.
    seen_first_us: tuple[float, ...] = ()
    seen_median_us: tuple[float, ...] = ()
    seen_last_us: tuple[float, ...] = ()

    @classmethod
    def from_words(cls, plan: HeadStreamPlan, words: Sequence[int]) -> HeadStreamTimeline:
        """Raises ValueError where the words are not a complete launch of this plan: a length other than the
        plan's, counters that are not the launch count times the group's rows, or a CTA or row never stamped; with
        the watching warp also an epoch or a done count that is not the launches', or a group a watcher saw full
        before any of its rows was published (it waited for the wrong count)."""
        if len(words) != plan.trace_words:
            raise ValueError(f"head stream trace: {len(words)} words, the plan has {plan.trace_words}")
        launches = words[0]
        counters = tuple(words[plan.counter_base + g] for g in range(plan.groups))
        want = tuple(launches * plan.group_rows(g) for g in range(plan.groups))
        if launches < 1 or counters != want:
            raise ValueError(f"head stream trace: {launches} launches published {counters} rows per group, not {want}")
        starts = [w % WRAP for w in words[plan.start_base : plan.start_base + plan.ctas]]
        rows = [w % WRAP for w in words[plan.row_stamp_base : plan.row_stamp_base + plan.rows]]
        if 0 in starts or 0 in rows:
            missing = starts.count(0), rows.count(0)
            raise ValueError(f"head stream trace: {missing[0]} CTAs and {missing[1]} rows never stamped")
        t0 = min(starts, key=lambda s: (s - starts[0] + WRAP // 2) % WRAP)  # the earliest, across a wrap

        def us(stamp: int) -> float:
            return ((stamp - t0) % WRAP) / 1e3

        published = [us(rows[plan.row_at(p)]) for p in range(plan.rows)]  # by stream position
        by_group = [[published[p] for p in plan.positions(g)] for g in range(plan.groups)]
        q = plan.row_groups
        first = tuple(min(g) for g in by_group)
        seen: list[list[float]] = [[] for _ in range(plan.groups)]
        if plan.watch:
            epoch, done = words[plan.epoch_word], words[plan.done_word]
            if (epoch, done) != (launches, launches * plan.ctas):
                raise ValueError(
                    f"head stream trace: epoch {epoch} and {done} CTAs done, not {launches} and {launches * plan.ctas}"
                )
            for c in range(plan.ctas):
                for g in range(plan.groups):
                    stamp = words[plan.watch_base + c * plan.groups + g] % WRAP
                    if stamp == 0:
                        raise ValueError(f"head stream trace: CTA {c}'s watcher never saw group {g} full")
                    seen[g].append(us(stamp))
            early = [g for g in range(plan.groups) if min(seen[g]) < first[g]]
            if early:
                raise ValueError(f"head stream trace: groups {early} seen full before any of their rows was published")
        return cls(
            launches=launches,
            counters=counters,
            start_spread_us=max(us(s) for s in starts),
            group_first_us=first,
            group_done_us=tuple(max(g) for g in by_group),
            trip_median_us=tuple(statistics.median(published[t * q : (t + 1) * q]) for t in range(plan.trips)),
            end_us=max(published),
            seen_first_us=tuple(min(v) for v in seen if v),
            seen_median_us=tuple(statistics.median(v) for v in seen if v),
            seen_last_us=tuple(max(v) for v in seen if v),
        )

    def stream_rate(self, plan: HeadStreamPlan) -> float:
        """Bytes per second of W from the first CTA's start to the last row's publish."""
        return plan.weight_bytes / (self.end_us * 1e-6)
