"""How the KDA input projection kernel (k3_decode/kernels/kda_in_proj.py) splits its work, without CuTe DSL.

The kernel computes out[B, R] = x[B, K] @ W[R, K]^T. A CTA of `warps` warps owns `warps * rows_per_warp`
consecutive rows of W; each warp owns `rows_per_warp` of them over the whole of K, a lane one 16-byte vector
(8 columns) of each row per k step of 256 columns. The batch is taken in chunks of at most 8 rows, each staged
whole in shared memory. Every number here is fixed at compile time, so listing builds needs neither CuTe DSL nor
torch, and the build expectations can count instructions from these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

VECTOR = 8  # BF16 elements in one 16-byte load
WARP = 32
WARPS = 8  # 256 threads: two CTAs of 128 registers per thread fill the 64K-register file of an SM
STEP = WARP * VECTOR  # the columns one warp covers per k step
MAX_CHUNK = 8  # batch rows staged in shared memory at once: 8 x 7168 x 2 B = 112 KiB, two CTAs per SM
LOADS_IN_FLIGHT = 12  # 16-byte weight loads a thread keeps outstanding (see the module docstring of the kernel)
ROWS_PER_WARP = (4, 3, 2, 1)  # tried in this order
H200_SMS = 132


class WeightStream:
    """The k loop of the weight stream (kda_in_proj.py), for the plans of the kernels that run it: the input
    projection's and the fused o_proj's (kda_o_proj_plan.py). A plan has K, the rows each warp streams and the
    threads of its CTA."""

    k: int
    rows_per_warp: int
    threads: int

    @property
    def steps(self) -> int:
        """k steps per row: each is one 16-byte weight load per lane and row."""
        return self.k // STEP

    @property
    def depth(self) -> int:
        """k steps of weights a thread has in flight: its register slots, refilled each group of `depth` steps.
        The smallest divisor of `steps` that keeps LOADS_IN_FLIGHT loads outstanding (all of K when it has fewer
        steps), so every group is whole."""
        want = -(-LOADS_IN_FLIGHT // self.rows_per_warp)
        return next(d for d in range(1, self.steps + 1) if self.steps % d == 0 and d >= min(want, self.steps))

    @property
    def groups(self) -> int:
        """Trips of the k loop: each multiplies `depth` steps and issues the loads of the next `depth`."""
        return self.steps // self.depth


@dataclass(frozen=True)
class InProjPlan(WeightStream):
    rows: int  # R, the output features of this rank
    k: int  # K, the hidden size
    batch: int
    sm_count: int
    rows_per_warp: int

    @classmethod
    def for_shape(cls, rows: int, k: int, batch: int, sm_count: int = H200_SMS) -> InProjPlan:
        """The plan for one shape: the most rows per warp (the most reuse of each staged x vector) that still
        gives every SM at least one CTA and leaves no partial CTA (K3's rows are multiples of 16)."""
        if k <= 0 or k % STEP:
            raise ValueError(f"the KDA in_proj kernel needs K to be a positive multiple of {STEP}, got {k}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        whole = [r for r in ROWS_PER_WARP if rows > 0 and rows % (WARPS * r) == 0]
        if not whole:
            raise ValueError(f"the KDA in_proj kernel needs the rows to be a positive multiple of {WARPS}, got {rows}")
        filling = [r for r in whole if rows // (WARPS * r) >= sm_count]
        return cls(rows, k, batch, sm_count, (filling or whole[-1:])[0])

    @property
    def threads(self) -> int:
        return WARPS * WARP

    @property
    def chunked(self) -> bool:
        """More than one batch chunk: W is streamed once per chunk (batches above 8, the lower-priority shapes)."""
        return len(self.chunks) > 1

    @property
    def ctas_per_sm(self) -> int:
        """CTAs each SM must hold at once (ptxas caps registers to fit them): all CTAs in one wave for B <= 8.
        A chunked batch gets the whole register file for one CTA instead: under the 128-register cap its
        accumulators and weight slots spill, and it is FMA-bound, not stream-bound, so a second wave costs little."""
        return 1 if self.chunked else -(-self.ctas // self.sm_count)

    @property
    def rows_per_cta(self) -> int:
        return WARPS * self.rows_per_warp

    @property
    def ctas(self) -> int:
        return self.rows // self.rows_per_cta

    @property
    def chunks(self) -> tuple[int, ...]:
        """The batch rows of each chunk staged in shared memory, in order."""
        full, rest = divmod(self.batch, MAX_CHUNK)
        return (MAX_CHUNK,) * full + ((rest,) if rest else ())

    @property
    def code_chunks(self) -> tuple[int, ...]:
        """The chunk sizes as the compiled code holds them: the first chunk, one rolled body for all further
        full chunks, one for a last partial chunk. Instruction counts in the PTX and SASS follow these."""
        first, rest = self.chunks[0], self.chunks[1:]
        middle = (first,) if first in rest else ()
        tail = (rest[-1],) if rest and rest[-1] != first else ()
        return (first, *middle, *tail)

    @property
    def chunk_rows(self) -> int:
        return self.chunks[0]

    @property
    def smem_bytes(self) -> int:
        return self.chunk_rows * self.k * 2

    def fill_loads(self, chunk: int) -> int:
        """16-byte x loads (and shared stores) per thread that stage a chunk of `chunk` batch rows."""
        return -(-chunk * (self.k // VECTOR) // self.threads)

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.k * 2

    @property
    def tag(self) -> str:
        return f"r{self.rows}/b{self.batch}"
