"""How the head-ordered input projection (kda_head_stream.py) splits its work, without CuTe DSL.

The kernel is the first measurement of the one-kernel plan for the attention side (docs/kda-layer-h200.md, "What
each missed target needs"): it computes the same out[B, R] = x[B, K] @ W[R, K]^T as the served projection, but
streams W's rows in head order, so that the rows one head's KDA step needs are all done early, one head after the
other, while the rest of W still streams. Each finished row is published with a release add on its group's counter.

Stream order. Positions 0 .. R - 1 are W's rows in the order they stream: first the rows every head shares (f_a,
beta and the padding: rows 4 P .. R - 1, P = heads x head_dim), then head by head the head's rows of q, k, v and
the output gate (4 x head_dim rows, from the four sections of the packed rows). Group 0 is the shared rows, group
1 + h head h; a group's counter reaches its row count once per launch.

Work. A row's K columns are split into `split` slices of K / split, one warp each (a row group of `split`
consecutive warps of one CTA); the row group sums its slices through shared memory in a fixed order, so the result
is deterministic. Row group q of the grid's Q takes positions q, q + Q, q + 2 Q, ... (one per trip), so at trip t
the whole grid streams positions Q t .. Q (t + 1) - 1: the stream moves through the heads in order, every SM
taking part in every head. The plan picks the fewest CTAs of at least one per SM (at most two per SM, all resident)
whose row groups divide R: every trip is whole, and no SM idles in a last, partial trip.

Watching (`watch`, a variant). The plan's step workers wait for a head's counter to be full before they start.
With `watch`, each CTA has one more warp that does only that: its lane 0 waits for every group's counter in turn
with gpu-scope acquire loads and stamps when it sees it full. Counters are never reset, so the full count is the
launch's epoch + 1 times the group's rows; the epoch is a word the previous launch's last CTA advanced, read after
the dependency wait (the plan's epochs: a CUDA graph replays the launch unchanged). It measures what a waiter adds:
how long after a head's last row is published a waiter sees it, and whether 262 pollers slow the stream.

Loads in flight. Each lane loads one 16-byte vector (8 columns) of its warp's row per k step of 256 columns and keeps
a whole trip's vectors in registers (`steps_per_unit` of them: 14 at split 2, 7 at split 4); the next trip's
vectors are loaded as this trip's are used, so the stream crosses trips and heads without a bubble.

Copy-fed (`stages` > 0, a variant). Registers cap what a lane keeps in flight. With `stages`, each warp instead has
a ring of `stages` slices of its rows in shared memory, filled by the copy engine: one bulk copy of its slice of a
row a trip (3.5 KB at split 4), completing that stage's transaction barrier. The warp reads its slice back from the
ring and refills the stage with the trip `stages` ahead. At split 4 and 3 stages a CTA keeps 84 KB of W in flight
with no register holding any of it, against 28 KB from registers; two such CTAs still fit an SM at B1.
"""

from __future__ import annotations

from dataclasses import dataclass

VECTOR = 8  # BF16 elements in one 16-byte load
WARP = 32
WARPS = 8  # 256 threads a CTA, two CTAs an SM under a 128-register cap (as the served CUDA-core stream)
STEP = WARP * VECTOR  # columns one warp covers per k step
MAX_BATCH = 8  # one x chunk staged in shared memory (8 x 7168 x 2 B = 112 KiB): two CTAs an SM
MAX_CTAS_PER_SM = 2
SPLITS = (2, 4)  # K slices a row: warps a row group; 8 warps hold whole row groups
MAX_STAGES = 4
SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory
SMEM_RESERVED = 1024  # what the driver reserves per CTA
H200_SMS = 132


@dataclass(frozen=True)
class StageShape:
    """What the x staging (kda_in_proj.stage) reads of a plan: K and the threads that stage, the stream's."""

    k: int
    threads: int


@dataclass(frozen=True)
class HeadStreamPlan:
    rows: int  # R, the packed rows of the rank [q | k | v | g | f_a | beta | pad]
    k: int  # K, the hidden size
    batch: int
    heads: int  # KDA heads of the rank
    head_dim: int
    split: int  # K slices a row, one warp each
    sm_count: int
    ctas: int
    watch: bool = False  # one more warp a CTA waits on every group's counter (the module docstring)
    stages: int = 0  # copy-fed: trips of each warp's slice in a shared-memory ring (0: loads into registers)

    @classmethod
    def for_shape(
        cls,
        rows: int,
        k: int,
        batch: int,
        heads: int,
        head_dim: int,
        split: int = 2,
        sm_count: int = H200_SMS,
        watch: bool = False,
        stages: int = 0,
    ) -> HeadStreamPlan:
        """The plan for one rank's packed rows: the fewest CTAs, at least one an SM and at most two, whose row
        groups divide the rows; copy-fed with `stages` > 0, where the ring must leave every CTA of the grid room."""
        if split not in SPLITS:
            raise ValueError(f"the head stream splits K into {' or '.join(map(str, SPLITS))} slices, got {split}")
        if k <= 0 or k % (STEP * split):
            raise ValueError(f"the head stream needs K to be a positive multiple of {STEP * split}, got {k}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"the head stream takes batches 1..{MAX_BATCH} (one staged x chunk), got {batch}")
        if heads < 1 or head_dim < 1 or rows <= 4 * heads * head_dim:
            raise ValueError(
                f"{rows} packed rows cannot hold {heads} heads of 4 x {head_dim} rows and the shared rows after them"
            )
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        if not 0 <= stages <= MAX_STAGES:
            raise ValueError(f"the head stream's ring takes 0..{MAX_STAGES} stages (0: no ring), got {stages}")
        per_cta = WARPS // split
        for ctas in range(sm_count, MAX_CTAS_PER_SM * sm_count + 1):
            if rows % (ctas * per_cta) == 0:
                plan = cls(rows, k, batch, heads, head_dim, split, sm_count, ctas, watch, stages)
                if plan.ctas_per_sm * (plan.smem_bytes + SMEM_RESERVED) > SMEM_PER_SM:
                    raise ValueError(
                        f"{plan.ctas_per_sm} CTAs of {plan.smem_bytes} bytes of shared memory do not fit an SM "
                        f"({SMEM_PER_SM}); take fewer stages or a smaller batch"
                    )
                return plan
        raise ValueError(
            f"no grid of {sm_count}..{MAX_CTAS_PER_SM * sm_count} CTAs of {per_cta} row groups divides {rows} rows "
            "into whole trips; pad the packed rows"
        )

    # --- the grid ---------------------------------------------------------------------------------------------

    @property
    def threads(self) -> int:
        """The stream's 8 warps, and the watching warp."""
        return (WARPS + self.watch) * WARP

    @property
    def stream_threads(self) -> int:
        return WARPS * WARP

    @property
    def staging(self) -> StageShape:
        return StageShape(self.k, self.stream_threads)

    @property
    def groups_per_cta(self) -> int:
        """Row groups of a CTA: `split` consecutive warps each."""
        return WARPS // self.split

    @property
    def row_groups(self) -> int:
        """Q: the rows the grid streams at once, one per row group."""
        return self.ctas * self.groups_per_cta

    @property
    def trips(self) -> int:
        """Rows each row group takes, one a trip (whole by the plan's choice of the grid)."""
        return self.rows // self.row_groups

    @property
    def ctas_per_sm(self) -> int:
        return -(-self.ctas // self.sm_count)

    @property
    def steps(self) -> int:
        """k steps of a whole row."""
        return self.k // STEP

    @property
    def steps_per_unit(self) -> int:
        """k steps of one warp's slice of a row: its 16-byte loads a trip, all in flight at once."""
        return self.steps // self.split

    @property
    def slice_vectors(self) -> int:
        """16-byte vectors of one slice of a row."""
        return self.k // self.split // VECTOR

    # --- the stream order -------------------------------------------------------------------------------------

    @property
    def proj(self) -> int:
        """P: the rows of each of q, k, v and the output gate."""
        return self.heads * self.head_dim

    @property
    def shared_rows(self) -> int:
        """Rows every head needs (f_a, beta) and the padding, streamed first."""
        return self.rows - 4 * self.proj

    @property
    def head_rows(self) -> int:
        return 4 * self.head_dim

    @property
    def groups(self) -> int:
        """Counters: the shared rows' and one a head."""
        return 1 + self.heads

    def group_rows(self, group: int) -> int:
        return self.shared_rows if group == 0 else self.head_rows

    def group_of(self, position: int) -> int:
        """The counter the row at stream position `position` is published on."""
        if position < self.shared_rows:
            return 0
        return 1 + (position - self.shared_rows) // self.head_rows

    def row_at(self, position: int) -> int:
        """The packed row streamed at `position` (the kernel computes the same with the same integer steps)."""
        if position < self.shared_rows:
            return 4 * self.proj + position
        within = position - self.shared_rows
        head, j = divmod(within, self.head_rows)
        section, col = divmod(j, self.head_dim)
        return section * self.proj + head * self.head_dim + col

    def positions(self, group: int) -> range:
        """The stream positions of a group's rows."""
        if group == 0:
            return range(self.shared_rows)
        start = self.shared_rows + (group - 1) * self.head_rows
        return range(start, start + self.head_rows)

    def trip_of(self, position: int) -> int:
        return position // self.row_groups

    # --- memory -----------------------------------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.k * 2

    @property
    def x_bytes(self) -> int:
        return self.batch * self.k * 2

    @property
    def slice_bytes(self) -> int:
        """One warp's slice of one row: what a copy-fed stage holds."""
        return self.k // self.split * 2

    @property
    def ring_bytes(self) -> int:
        """The copy-fed ring: every warp's stages (0 without one)."""
        return WARPS * self.stages * self.slice_bytes

    @property
    def partial_words(self) -> int:
        """FP32 slice sums in shared memory: two trips (double-buffered) x warps x batch rows."""
        return 2 * WARPS * self.batch

    @property
    def slice_vector(self) -> int:
        """Words of one shared-memory move of a warp's slice sums: its batch rows' sums are consecutive and start at
        a multiple of the batch, so a vector of 4, 2 or 1 words, whichever divides the batch."""
        return next(v for v in (4, 2, 1) if self.batch % v == 0)

    @property
    def smem_bytes(self) -> int:
        """x, the slice sums, and with a ring its stages and their barriers (8 bytes each)."""
        return self.x_bytes + 4 * self.partial_words + self.ring_bytes + 8 * WARPS * self.stages

    @property
    def fill_loads(self) -> int:
        """Staging passes of x: one 16-byte vector per stream thread and pass."""
        return -(-self.batch * self.k // VECTOR // self.stream_threads)

    # --- the trace words (Int32, after the launch count) ------------------------------------------------------

    @property
    def counter_base(self) -> int:
        return 1

    @property
    def start_base(self) -> int:
        """Per CTA, the global timer's low word at its start."""
        return self.counter_base + self.groups

    @property
    def row_stamp_base(self) -> int:
        """Per packed row, the global timer's low word when its row group published it."""
        return self.start_base + self.ctas

    @property
    def epoch_word(self) -> int:
        """With `watch`: launches completed, advanced by each launch's last CTA."""
        return self.row_stamp_base + self.rows

    @property
    def done_word(self) -> int:
        """With `watch`: CTAs finished, over all launches (the last CTA of a launch advances the epoch)."""
        return self.epoch_word + 1

    @property
    def watch_base(self) -> int:
        """With `watch`: per CTA and group, the global timer's low word when its watcher saw the counter full."""
        return self.done_word + 1

    @property
    def trace_words(self) -> int:
        if self.watch:
            return self.watch_base + self.ctas * self.groups
        return self.row_stamp_base + self.rows
