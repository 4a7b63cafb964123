"""The plan of the TMA + warpgroup-MMA weight stream (wgmma_stream.py): how one skinny GEMM out[B, R] = x[B, K] @
W[R, K]^T is cut into CTAs, k tiles and ring stages, and what each cut costs in threads and shared memory. Kept apart
from the kernel so that the benchmarks and tests can check plans without CuTe DSL."""

from __future__ import annotations

import dataclasses

MAX_BATCH = 64  # one wgmma N covers the batch; more would need a second N tile
# Not below 9 rows (wgmma N 8): no plan at N 8 has run on a GPU but the fused o_proj's wgmma build, whose first GPU run
# (an H100, at 812a7fd) raised an illegal instruction at TP8 B1 (N 8), not diagnosed, while B9-B64 (N 16-64) ran; the
# other builds serve 1-8 rows.
MIN_BATCH = 9
MAX_SMEM = 227 * 1024  # bytes of shared memory a Hopper CTA may ask for
MAX_K_SPLITS = 8  # the largest portable cluster
WARPGROUP = 128
WARP = 32
MMA_M = 64  # rows of one wgmma, and of one consumer warpgroup
MMA_K = 16
SWIZZLE_K = 64  # BF16 elements in a 128-byte swizzle row: a k tile is a whole number of them
ALIGN = 16  # bytes: TMA needs 16-byte aligned global tensors and row pitches
BARRIER_BYTES = 1024  # the mbarriers, padded to the 1024-byte alignment of the swizzled tiles after them


def wgmma_n(batch: int) -> int:
    """The wgmma N for `batch` rows (WgmmaStreamPlan.n): the batch rounded up to a multiple of 16."""
    return -(-batch // 16) * 16


@dataclasses.dataclass(frozen=True)
class WgmmaStreamPlan:
    """How one shape (rows R, k K, batch B) is cut: `m_rows` W rows per CTA, k tiles of `k_tile` columns in a ring of
    `stages`, K split over a cluster of `k_splits` CTAs."""

    rows: int
    k: int
    batch: int
    m_rows: int = 64
    k_tile: int = 64
    stages: int = 4
    k_splits: int = 1

    @property
    def n(self) -> int:
        """The wgmma N: the batch rounded up to a multiple of 16 (TMA zero-fills the rows past B). CuTe DSL 4.8.1 aborts
        the process compiling an N that is an odd multiple of 8 above 8 (24, 40, 56) with these swizzled operands, so
        those batches take the next multiple of 16 (and N 8, below MIN_BATCH, is never planned)."""
        return wgmma_n(self.batch)

    @property
    def m_tiles(self) -> int:
        return -(-self.rows // self.m_rows)

    @property
    def ctas(self) -> int:
        return self.m_tiles * self.k_splits

    @property
    def consumer_groups(self) -> int:
        return self.m_rows // MMA_M

    @property
    def consumer_threads(self) -> int:
        return self.consumer_groups * WARPGROUP

    @property
    def threads(self) -> int:
        return self.consumer_threads + WARP  # and one producer warp

    @property
    def k_tiles(self) -> int:
        """k tiles each CTA streams (its K slice)."""
        return self.k // (self.k_tile * self.k_splits)

    @property
    def ahead(self) -> int:
        """k tiles of W issued before the dependency wait: as many as the ring holds."""
        return min(self.stages, self.k_tiles)

    @property
    def stage_bytes(self) -> int:
        """Bytes one stage's two TMA copies deliver (the full barrier's transaction count)."""
        return (self.m_rows + self.n) * self.k_tile * 2

    @property
    def acc_values(self) -> int:
        """FP32 accumulators per consumer thread."""
        return MMA_M * self.n // WARPGROUP

    @property
    def live_groups(self) -> int:
        """Groups of 8 batch columns of the accumulator that hold a batch row for some thread: the code keeps the
        stores (and K-split exchanges) of only these; the compiler drops a group past the batch for every thread."""
        return -(-self.batch // 8)

    @property
    def stored_values(self) -> int:
        """Accumulator values per thread the epilogue's code stores, masked to B: a live group of 8 columns holds 2
        adjacent columns a thread in each of 2 rows, and the compiler drops the second column's stores where no
        thread's can be a batch row (group g's least second column, 8g + 1, is at least B: B = 33 stores 18, not
        20)."""
        return sum(2 * (1 + (8 * g + 1 < self.batch)) for g in range(self.live_groups))

    @property
    def partial_bytes(self) -> int:
        """Rank 0's buffer for the other ranks' FP32 partial tiles."""
        return (self.k_splits - 1) * self.m_rows * self.n * 4

    @property
    def smem_bytes(self) -> int:
        return BARRIER_BYTES + self.stages * self.stage_bytes + self.partial_bytes

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.k * 2

    def problem(self) -> str | None:
        """Why this plan cannot run, in one line; None when it can."""
        if self.rows < 1:
            return f"rows must be at least 1, got {self.rows}"
        if not MIN_BATCH <= self.batch <= MAX_BATCH:
            return f"batch must be {MIN_BATCH}..{MAX_BATCH} (one wgmma N tile of 16 to 64), got {self.batch}"
        if self.m_rows not in (64, 128):
            return f"m_rows must be 64 or 128 (one or two consumer warpgroups), got {self.m_rows}"
        if self.k_tile % SWIZZLE_K or not SWIZZLE_K <= self.k_tile <= 4 * SWIZZLE_K:
            return f"k_tile must be 64, 128, 192 or 256 (whole 128-byte swizzle rows), got {self.k_tile}"
        if not 1 <= self.k_splits <= MAX_K_SPLITS:
            return f"k_splits must be 1..{MAX_K_SPLITS} (a portable cluster), got {self.k_splits}"
        if self.stages < 2:
            return f"stages must be at least 2 for TMA to overlap the MMAs, got {self.stages}"
        if self.k < 1 or self.k % (self.k_tile * self.k_splits):
            return f"k={self.k} must be a positive multiple of k_tile * k_splits = {self.k_tile * self.k_splits}"
        if self.smem_bytes > MAX_SMEM:
            return f"needs {self.smem_bytes} bytes of shared memory, over the {MAX_SMEM} a CTA may have: fewer stages"
        return None
