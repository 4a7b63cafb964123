"""Reading the head-ordered projection's trace words (kda_head_stream_trace.py), on words built here the way the
kernel writes them: no GPU."""

from __future__ import annotations

import pytest

from k3_decode.config import K3
from k3_decode.kernels.kda_head_stream_plan import HeadStreamPlan
from k3_decode.kernels.kda_head_stream_trace import WRAP, HeadStreamTimeline


def plan16(watch: bool = False) -> HeadStreamPlan:
    s = K3.shard(16)
    return HeadStreamPlan.for_shape(s.kda_in_proj_rows, s.hidden, 1, s.kda_heads, K3.kda.head_dim, split=4, watch=watch)


def words_of(plan: HeadStreamPlan, launches: int = 3, base: int = 5_000, trip_ns: int = 1_000) -> list[int]:
    """A launch as the kernel stamps it: CTAs start within 300 ns of `base`, and the row at stream position p is
    published at the end of its trip (trip_ns each) plus a jitter under a trip; stored as signed Int32 words."""
    words = [0] * plan.trace_words
    words[0] = launches
    for g in range(plan.groups):
        words[plan.counter_base + g] = launches * plan.group_rows(g)
    for c in range(plan.ctas):
        words[plan.start_base + c] = base + (c * 7) % 300
    for p in range(plan.rows):
        stamp = base + 500 + (plan.trip_of(p) + 1) * trip_ns + (p * 13) % (trip_ns // 2)
        words[plan.row_stamp_base + plan.row_at(p)] = stamp
    if plan.watch:  # each watcher sees a group full 100-400 ns after its last row
        words[plan.epoch_word], words[plan.done_word] = launches, launches * plan.ctas
        for g in range(plan.groups):
            done = max(words[plan.row_stamp_base + plan.row_at(p)] for p in plan.positions(g))
            for c in range(plan.ctas):
                words[plan.watch_base + c * plan.groups + g] = done + 100 + (c * 11) % 301
    return [((w + (1 << 31)) % WRAP) - (1 << 31) for w in words]  # as torch's int32 holds them


def test_a_launch_reads_as_its_group_times_in_stream_order():
    plan = plan16()
    t = HeadStreamTimeline.from_words(plan, words_of(plan))
    assert t.launches == 3 and t.counters == tuple(3 * plan.group_rows(g) for g in range(plan.groups))
    assert t.start_spread_us == pytest.approx(max(c * 7 % 300 for c in range(plan.ctas)) / 1e3)
    assert list(t.trip_median_us) == sorted(t.trip_median_us) and len(t.trip_median_us) == plan.trips == 12
    assert list(t.group_done_us) == sorted(t.group_done_us)  # head by head
    assert all(f <= d for f, d in zip(t.group_first_us, t.group_done_us, strict=True))
    assert t.end_us == pytest.approx(max(t.group_done_us)) and 12.5 < t.end_us < 13.5  # 12 trips of 1 us + 0.5
    assert t.stream_rate(plan) == pytest.approx(plan.weight_bytes / (t.end_us * 1e-6))


def test_a_launch_across_the_timer_wrap_reads_the_same():
    plan = plan16()
    plain = HeadStreamTimeline.from_words(plan, words_of(plan))
    wrapped = HeadStreamTimeline.from_words(plan, words_of(plan, base=WRAP - 4_000))  # the timer wraps mid-launch
    assert wrapped == plain


def test_words_that_are_not_a_whole_launch_are_refused():
    plan = plan16()
    words = words_of(plan)
    with pytest.raises(ValueError, match="words, the plan has"):
        HeadStreamTimeline.from_words(plan, words[:-1])
    lost = list(words)
    lost[plan.counter_base + 3] -= 1  # one row of head 2 never published
    with pytest.raises(ValueError, match="rows per group, not"):
        HeadStreamTimeline.from_words(plan, lost)
    unstamped = list(words)
    unstamped[plan.row_stamp_base + plan.row_at(100)] = 0
    with pytest.raises(ValueError, match="0 CTAs and 1 rows never stamped"):
        HeadStreamTimeline.from_words(plan, unstamped)
    never = [0] * plan.trace_words
    with pytest.raises(ValueError, match="0 launches"):
        HeadStreamTimeline.from_words(plan, never)


def test_a_watched_launch_reads_when_each_watcher_saw_each_group():
    plan = plan16(watch=True)
    t = HeadStreamTimeline.from_words(plan, words_of(plan))
    assert len(t.seen_first_us) == len(t.seen_median_us) == len(t.seen_last_us) == plan.groups
    for g in range(plan.groups):
        assert t.seen_first_us[g] == pytest.approx(t.group_done_us[g] + 0.1)
        assert t.seen_last_us[g] == pytest.approx(t.group_done_us[g] + 0.4)
        assert t.seen_first_us[g] <= t.seen_median_us[g] <= t.seen_last_us[g]
    assert HeadStreamTimeline.from_words(plan16(), words_of(plan16())).seen_median_us == ()  # no watcher, no field


def test_a_watcher_that_waited_for_the_wrong_count_is_refused():
    plan = plan16(watch=True)
    words = words_of(plan)
    early = list(words)  # CTA 5's watcher saw head 3 full before any of its rows was published
    early[plan.watch_base + 5 * plan.groups + 4] = words[plan.start_base]
    with pytest.raises(ValueError, match=r"groups \[4\] seen full before any of their rows"):
        HeadStreamTimeline.from_words(plan, early)
    stale = list(words)
    stale[plan.epoch_word] -= 1  # a launch whose last CTA did not advance the epoch
    with pytest.raises(ValueError, match="epoch 2 and"):
        HeadStreamTimeline.from_words(plan, stale)
    blind = list(words)
    blind[plan.watch_base + 7 * plan.groups] = 0
    with pytest.raises(ValueError, match="CTA 7's watcher never saw group 0 full"):
        HeadStreamTimeline.from_words(plan, blind)
