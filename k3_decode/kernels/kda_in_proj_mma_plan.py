"""How the tensor-core KDA input projection (k3_decode/kernels/kda_in_proj_mma.py) splits its work, without CuTe DSL.

The kernel computes out[B, R] = x[B, K] @ W[R, K]^T with `mma.sync` m16n8k16 (BF16 in, FP32 accumulate): W is the
A operand (16 rows a tile), x the B operand (8 batch rows a tile). CTA c owns the rows [c * rows_per_cta, ...)
and one CTA runs per SM, so the grid is one wave. Its warps are `m_tiles` x `k_splits`: warp (m, s) owns 16-row
tile m of the CTA's rows over the s-th of `k_splits` equal slices of K, and the CTA sums the slices' partials in
shared memory, in a fixed order. A k step is 64 columns: per step a lane loads two 16-byte vectors of each of its
two rows (rows g and g + 8 of the tile, g = lane / 4) and of each 8-row batch tile, and issues four MMAs per batch
tile. Every number here is fixed at compile time, so listing builds needs neither CuTe DSL nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass

VECTOR = 8  # BF16 elements in one 16-byte load
WARP = 32
TILE_M = 16  # W rows of one MMA
TILE_N = 8  # batch rows of one MMA
STEP = 64  # columns of one k step: 4 lanes x 16 columns, 4 MMAs of k = 16
# Warps per CTA: 12 keep 96 KB of W in flight per SM under a 168-register cap. The same for every batch, so the K
# split, and with it the summation order, never depends on the batch: the kernel is batch-invariant.
TARGET_WARPS = 12
MAX_THREADS = 512
W_LOADS_IN_FLIGHT = 16  # 16-byte weight loads a lane keeps outstanding: 4 per step, so 4 steps ahead
# Batch tiles one pass holds in registers to 16 rows, beside 16 W loads in flight. Halving the warps to hold more
# would change the K split with the batch, and a row's bits with it, so wide passes trade W loads instead:
MAX_N_TILES = 2
# above 16 rows a pass holds 32 (four batch tiles) where the CTA's warps leave registers for them, with (W loads per
# lane, x steps ahead in registers, x stages in shared memory) by warps per CTA, for one pass (to 32 rows) and for
# several. The builds spilled with more: TP8 (12 warps, 168 registers) at 16 loads; TP16 (14 warps, 128) at 8 loads
# and one x step in registers (40-56 bytes of frame). Other warp counts keep 16 rows a pass. On the H200 at 1c73f22
# one 32-row pass took TP8 B32 28.1 us (two 16-row passes: 48) and TP16 B32 20.1 (26.3). At TP16 x then waited on
# L2 (benchmarks/results/l2-traffic-h200.json), so one pass stages it in a cp.async ring of 4 k steps shared by the
# warps of a K slice (x out of registers, which then hold 8 W loads): 18.6 us in the layer graph at b59fc02 against
# 20.2 (kda-layer-variants-h200/ring-*.json). Two passes with the ring spilled 8-16 bytes, so they keep x in
# registers.
WIDE_N_TILES = 4
WIDE_PASS_BY_WARPS = {12: (8, 2, 0), 14: (8, 1, 4)}
WIDE_PASSES_BY_WARPS = {12: (8, 2, 0), 14: (4, 1, 0)}
H200_SMS = 132


@dataclass(frozen=True)
class MmaStream:
    """The tensor-core weight stream of one CTA: `m_tiles` x `k_splits` warps over `rows_per_cta` rows of W, for
    `batch` rows of x. kda_in_proj_mma.py runs it for the input projection; kda_o_proj.py for o_proj (one m-tile of
    16 rows per CTA, K split over the cluster CTA's warps)."""

    rows: int  # R, W's rows (the outputs)
    k: int  # K
    batch: int
    rows_per_cta: int
    m_tiles: int
    k_splits: int
    w_loads_in_flight: int = W_LOADS_IN_FLIGHT  # 16-byte W loads a lane keeps outstanding (4 per k step)
    x_steps_ahead: int = 2  # k steps of x a lane holds at most
    max_n_tiles: int = MAX_N_TILES  # batch tiles of 8 rows one pass holds
    x_stages: int = 0  # 0: x in registers, x_depth steps ahead; else a cp.async ring of this many k steps per slice
    # W bulk-copied whole into shared memory before griddepcontrol.wait (one cp.async.bulk per row, no register held
    # for it), the slots then filled from there: o_proj's w_smem_batches and benchmarks/mma_stream_shapes.toml; not
    # served anywhere yet
    w_smem: bool = False
    # W through a ring in shared memory (0: off): each warp keeps this many k steps of its 16 rows and K slice in
    # flight as bulk copies (one a row and step, 128 bytes, by lanes 0-15), each stage on its own transaction
    # barrier, refilled with the step `w_ring` ahead as soon as the warp's MMAs have consumed it; the register slots
    # (`depth` steps) are filled from the ring in the same order, so the same bits. Why: every register tiling of
    # benchmarks/mma_stream_shapes.toml held one k step of W in flight a lane (32 KB an SM) and streamed at 1.85
    # TB/s against cuBLAS's 2.67; the ring holds `w_ring` steps without holding registers. x in registers; with
    # several passes the ring streams on across them (each pass reads the slice again).
    w_ring: int = 0

    @property
    def steps(self) -> int:
        return self.k // STEP

    @property
    def warps(self) -> int:
        return self.m_tiles * self.k_splits

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def split_steps(self) -> int:
        """k steps of one warp's slice."""
        return self.steps // self.k_splits

    @property
    def depth(self) -> int:
        """k steps of weights a lane has in flight (its register slots): the smallest divisor of the slice's steps
        that keeps `w_loads_in_flight` loads outstanding, so every group of the rolled loop is whole."""
        want = -(-self.w_loads_in_flight // 4)
        s = self.split_steps
        return next(d for d in range(1, s + 1) if s % d == 0 and d >= min(want, s))

    @property
    def groups(self) -> int:
        return self.split_steps // self.depth

    @property
    def n_tiles(self) -> int:
        """Batch tiles of 8 rows per pass over W."""
        return n_tiles(self.batch, self.max_n_tiles)

    @property
    def passes(self) -> tuple[int, ...]:
        """Batch rows of each pass over W, in order (one pass up to 16 rows)."""
        per = self.n_tiles * TILE_N
        full, rest = divmod(self.batch, per)
        return (per,) * full + ((rest,) if rest else ())

    @property
    def x_depth(self) -> int:
        """k steps of x a lane holds ahead (x comes from L2 or L1, nearer than W): x slot j % x_depth serves step j
        of a group, so it must divide `depth`."""
        return min(self.x_steps_ahead, 2 if self.depth % 2 == 0 else 1)

    @property
    def partial_floats(self) -> int:
        """FP32 accumulators per lane: 4 per batch tile (an m16n8 tile over 32 lanes)."""
        return 4 * self.n_tiles

    @property
    def x_ring_vectors(self) -> int:
        """16-byte vectors of the x ring (kda_in_proj_mma.allocate_x_ring): per K slice, stage and batch tile, two a
        lane."""
        return self.k_splits * self.x_stages * self.n_tiles * 2 * WARP

    @property
    def w_row_stride(self) -> int:
        """Elements from one W row to the next in shared memory (w_smem): 16 bytes past K, so the 8 rows a warp's
        lanes read at one column fall in 8 different 16-byte bank groups."""
        return self.k + VECTOR

    @property
    def w_smem_bytes(self) -> int:
        """The CTA's rows of W in shared memory (w_smem), else nothing: the rows, and 128 bytes for their transaction
        barrier and the padding to the rows' 128-byte alignment after it (the launch asks for smem_bytes, so this
        must not fall short of what the kernel allocates)."""
        return self.rows_per_cta * self.w_row_stride * 2 + 128 if self.w_smem else 0

    @property
    def w_ring_stage_bytes(self) -> int:
        """One stage of a warp's ring: its m-tile's 16 rows of one k step, each padded by 16 bytes (a load instruction
        reads 8 rows at one column, which then fall in 8 bank groups)."""
        return TILE_M * (STEP + VECTOR) * 2

    @property
    def w_ring_bytes(self) -> int:
        """Every warp's ring and a transaction barrier (8 bytes) per stage, 128 bytes of alignment beside them; else
        nothing."""
        if not self.w_ring:
            return 0
        return self.warps * self.w_ring * (self.w_ring_stage_bytes + 8) + 128

    def w_ring_problem(self) -> str | None:
        """Why this stream cannot take its W through a ring (w_ring), or None."""
        if self.w_ring < 0:
            return f"w_ring must be 0 (off) or a number of k steps, got {self.w_ring}"
        if not self.w_ring:
            return None
        if self.w_smem:
            return "w_ring and w_smem both stage W in shared memory; pick one"
        if self.x_stages:
            return f"w_ring needs x in registers, not staged (x_stages {self.x_stages})"
        if not self.depth <= self.w_ring <= self.split_steps:
            return f"w_ring {self.w_ring} must lie within {self.depth} (the slots) and {self.split_steps} (the slice)"
        return None

    @property
    def smem_bytes(self) -> int:
        """The slices' partial sums, one FP32 tile per warp and batch tile, for the fixed-order sum, the x ring,
        and W where it is staged whole (w_smem) or through a ring (w_ring)."""
        return (
            self.warps * self.partial_floats * WARP * 4
            + self.x_ring_vectors * 16
            + self.w_smem_bytes
            + self.w_ring_bytes
        )

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.k * 2

    def code_counts(self) -> dict[str, int]:
        """Instructions the stream's code holds (each pass is its own code, its k loop one rolled body unrolled
        `depth` steps deep, whose W refill the compiler drops when one group covers the slice; accumulators c1 and
        c3 hold batch column 2t + 1, which a one-row tile never has, so the compiler drops their sums and stores)."""
        ahead = 4 * self.depth  # 16-byte W loads that fill every slot: two vectors of two rows per step
        tiles = [-(-count // TILE_N) for count in self.passes]
        live = sum(
            2 * (1 + (min(TILE_N, count - TILE_N * i) >= 2))
            for count in self.passes
            for i in range(n_tiles(count, self.max_n_tiles))
        )
        staged = self.x_stages > 0
        ahead_x = min(self.x_stages - 1, self.split_steps) if staged else 0  # the ring's first steps, per pass
        # body copies: one per step of the unrolled body, but where one group covers the slice the compiler drops
        # those whose step lies past it (their condition is then a constant)
        body_x = (
            self.depth if self.groups > 1 else sum(j + self.x_stages - 1 < self.split_steps for j in range(self.depth))
        )
        # W from HBM in the slots: `ahead` before the wait and once per later pass, one refill body; with w_smem the
        # same slot fills read shared memory after the wait, and the CTA's rows arrive by one bulk copy per row a
        # lane of warp 0 issues (the loop over rows is unrolled: ceil(rows / 32) copies in the code)
        weight_loads = len(tiles) * ahead + (len(tiles) * ahead if self.groups > 1 else 0)
        return {
            "weight_loads_ahead": 0 if self.w_smem else ahead,
            "weight_loads": 0 if self.w_smem else weight_loads,
            "w_shared_loads": weight_loads if self.w_smem else 0,
            "w_bulk_copies": -(-self.rows_per_cta // WARP) if self.w_smem else 0,
            # x: the steps ahead, then one refill per step but the last x_depth of the slice (the compiler drops
            # those when one group covers the slice: their condition is then a constant); none when staged
            "x_loads": 0
            if staged
            else sum(2 * n * (self.depth + (self.x_depth if self.groups > 1 else 0)) for n in tiles),
            # staged: cp.async of every tile's two vectors per step (each warp copies its share at run time), the
            # groups committed (one per step ahead and per body step), the waits (one per body step, one per pass)
            # and the lane's reads of every tile back from the ring
            "x_copies": sum(2 * n * (ahead_x + body_x) for n in tiles) if staged else 0,
            "x_commits": len(tiles) * (self.x_stages - 1 + self.depth) if staged else 0,
            "x_waits": len(tiles) * (self.depth + 1) if staged else 0,
            "x_reads": sum(2 * n * self.depth for n in tiles) if staged else 0,
            # named barriers of a K slice's warps sharing the ring: one per body step and one per pass
            "slice_barriers": len(tiles) * (self.depth + 1) if staged and self.m_tiles > 1 else 0,
            "mmas": sum(4 * self.depth * n for n in tiles),
            "partial_stores": sum(4 * n for n in tiles),
            "partial_loads": live * self.k_splits,
            "out_stores": live,
            "passes": len(tiles),
        }


def n_tiles(batch: int, most: int = MAX_N_TILES) -> int:
    return min(-(-batch // TILE_N), most)


def check_shape(what: str, rows: int, k: int, batch: int) -> None:
    if rows <= 0 or rows % TILE_M:
        raise ValueError(f"the tensor-core {what} needs the rows to be a positive multiple of {TILE_M}, got {rows}")
    if k <= 0 or k % STEP:
        raise ValueError(f"the tensor-core {what} needs K to be a positive multiple of {STEP}, got {k}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")


@dataclass(frozen=True)
class InProjMmaPlan(MmaStream):
    sm_count: int = H200_SMS
    # CTAs each SM holds at once: ptxas caps the registers for them. The projection runs one a SM (its grid is one
    # wave); benchmarks/mma_stream_shapes.py also times taller and shorter CTAs, as o_proj's stream tiles its rows.
    ctas_per_sm: int = 1

    @classmethod
    def for_shape(cls, rows: int, k: int, batch: int, sm_count: int = H200_SMS) -> InProjMmaPlan:
        """One CTA per SM over the fewest rows per CTA that need no more CTAs than SMs (one wave, the rows spread
        to within one); K split over the CTA's warps (the divisor of the steps whose warp count is nearest
        TARGET_WARPS, more on a tie: more loads in flight; within MAX_THREADS)."""
        check_shape("KDA in_proj", rows, k, batch)
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        per_cta = -(-rows // sm_count)
        m_tiles = -(-per_cta // TILE_M)
        steps = k // STEP
        fits = [d for d in range(1, steps + 1) if steps % d == 0 and m_tiles * d * WARP <= MAX_THREADS]
        k_splits = min(fits, key=lambda d: (abs(m_tiles * d - TARGET_WARPS), -d))
        one_pass = batch <= WIDE_N_TILES * TILE_N
        wide = (WIDE_PASS_BY_WARPS if one_pass else WIDE_PASSES_BY_WARPS).get(m_tiles * k_splits)
        if batch <= MAX_N_TILES * TILE_N or wide is None:
            return cls(rows, k, batch, per_cta, m_tiles, k_splits, sm_count=sm_count)
        loads, x_ahead, x_stages = wide
        return cls(
            rows, k, batch, per_cta, m_tiles, k_splits, loads, x_ahead, WIDE_N_TILES, x_stages, sm_count=sm_count
        )

    @property
    def ctas(self) -> int:
        return -(-self.rows // self.rows_per_cta)

    @property
    def last_rows(self) -> int:
        """Rows of the last CTA (fewer than rows_per_cta when they do not divide R)."""
        return self.rows - (self.ctas - 1) * self.rows_per_cta

    @property
    def partial_ring_pass(self) -> bool:
        """Whether x is staged in a ring (x_stages) and the batch fills less than a pass: TP16's one 32-row pass at
        17-31 rows, where ptxas spills 8-16 bytes (expectations.toml's frame allowance says why that stays)."""
        return self.x_stages > 0 and self.batch % (self.max_n_tiles * TILE_N) != 0

    @property
    def masked(self) -> bool:
        """Whether some lanes' rows lie past the CTA's rows (or R): they read the CTA's last row, their sums unused."""
        return self.rows_per_cta % TILE_M != 0 or self.last_rows != self.rows_per_cta

    @property
    def tag(self) -> str:
        return f"r{self.rows}/b{self.batch}"
