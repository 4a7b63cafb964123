"""TP all-reduces of BF16 rows [rows, width], one object per transport, all with the same call shape.

    nccl         torch.distributed.all_reduce: NCCL's own algorithm and summation order (a BF16 ring or tree
                 rounds after each step), the baseline every deployment already has. Identical on every rank,
                 but not the rank-order rule's bits.
    ordered      the two-shot rule composed from collectives: exchange the owned chunks (all-to-all), add the
                 `world` BF16 slots in FP32 in rank order and round once (torch), all-gather the chunks. Works on
                 any backend (gloo on the CPU), so the rule runs in CI; three launches and two collectives.
    peer         the same rule in one Triton launch over a symmetric-memory buffer (triton_twoshot), with the
                 latent RMSNorm or the AttnRes application fused as epilogue. CUDA only.

`ordered` and `peer` give every rank the bits of k3_decode.reference.allreduce.two_shot_all_reduce; `nccl` gives
every rank the same bits, which the rule's oracle does not predict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from k3_decode.distributed.group import TpGroup

Transport = Literal["nccl", "ordered", "peer"]
TRANSPORTS: tuple[Transport, ...] = ("nccl", "ordered", "peer")
FRAGMENT_COLS = 8  # BF16 columns per 16-byte store: an owned chunk is a whole number of them (the oracle's rule)
ALIGN = 256


# torch 2.13 renames all_gather_into_tensor (and warns on the old name); torch 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllReduceError(ValueError):
    """A row the transport cannot reduce; the message names the shape and the fix."""


def check_rows(x: Tensor, world: int, max_rows: int | None = None) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise AllReduceError(f"all-reduce takes BF16 rows [rows, width], got {x.dtype} {tuple(x.shape)}")
    rows, width = x.shape
    if width % world or (width // world) % FRAGMENT_COLS:
        raise AllReduceError(
            f"width {width} does not split into {world} chunks of whole {FRAGMENT_COLS}-column fragments; pad the row"
        )
    if max_rows is not None and rows > max_rows:
        raise AllReduceError(f"{rows} rows exceed the {max_rows} the buffer was sized for; build it for more rows")
    return rows, width


def _canonical_zero(x: Tensor) -> Tensor:
    return torch.where(x == 0, torch.zeros_like(x), x)


@dataclass
class NcclAllReduce:
    group: TpGroup
    name: str = "nccl"

    def __call__(self, x: Tensor) -> Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out


@dataclass
class OrderedAllReduce:
    """The two-shot rule through collectives."""

    group: TpGroup
    name: str = "ordered"

    def __call__(self, x: Tensor) -> Tensor:
        world, rank = self.group.world, self.group.rank
        rows, width = check_rows(x, world)
        chunk = width // world
        send = x.reshape(rows, world, chunk).transpose(0, 1).contiguous()  # [owner, rows, chunk]
        if self.group.backend == "nccl":
            slots = torch.empty_like(send)  # [source, rows, chunk]: every rank's partial of this rank's chunk
            dist.all_to_all_single(slots, send)
        else:  # gloo has no all-to-all: gather everything and keep this rank's chunk of each source
            slots = torch.stack([part[rank] for part in self.group.gather_tensors(send)])
        acc = slots[0].float()
        for src in range(1, world):
            acc = acc + slots[src].float()
        mine = _canonical_zero(acc.bfloat16()).contiguous()
        gathered = torch.empty(world * rows, chunk, dtype=x.dtype, device=x.device)  # owners stacked on dim 0
        _all_gather_single(gathered, mine)
        return gathered.view(world, rows, chunk).transpose(0, 1).reshape(rows, width)


@dataclass
class PeerAllReduce:
    """The two-shot rule in one launch over peer memory; `max_rows` x `max_width` bounds every call."""

    group: TpGroup
    max_rows: int
    max_width: int
    name: str = "peer"
    _tables: dict[str, Tensor] = field(default_factory=dict, repr=False)
    _buffer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.group.device.type != "cuda":
            raise AllReduceError("the peer all-reduce needs CUDA devices; use transport 'ordered' on the CPU")
        import torch.distributed._symmetric_memory as symm_mem

        world = self.group.world
        check_rows(torch.empty(0, self.max_width, dtype=torch.bfloat16), world)
        elems = self.max_rows * self.max_width
        slot_bytes = _aligned(2 * elems)  # [world, rows, chunk] BF16 = rows * width values
        gather_bytes = _aligned(2 * elems)  # [rows, width] BF16
        pad_bytes = _aligned(4 * 2 * self.max_rows * world)  # [2 phases, rows, world] int32
        buffer = symm_mem.empty(slot_bytes + gather_bytes + pad_bytes, dtype=torch.uint8, device=self.group.device)
        buffer.zero_()  # the pads start unsignalled; the data regions are always written before they are read
        handle = symm_mem.rendezvous(buffer, self.group.group_name)
        ptrs = list(handle.buffer_ptrs)
        if len(ptrs) != world or ptrs[self.group.rank] != buffer.data_ptr():
            raise AllReduceError(
                f"symmetric memory handed {len(ptrs)} peer pointers (own {ptrs[self.group.rank]:#x} vs buffer "
                f"{buffer.data_ptr():#x}); check the torch build's symmetric-memory backend"
            )
        base = torch.tensor(ptrs, dtype=torch.int64, device=self.group.device)
        self._tables = {"slots": base, "gather": base + slot_bytes, "pads": base + slot_bytes + gather_bytes}
        self._buffer = buffer  # keeps the allocation alive
        self.group.barrier()  # no rank signals a peer whose pads are not zeroed yet

    def _launch_args(self, x: Tensor) -> tuple[int, int, dict[str, Any]]:
        from k3_decode.distributed.triton_twoshot import block_c

        world = self.group.world
        rows, width = check_rows(x, world, self.max_rows)
        if width > self.max_width:
            raise AllReduceError(f"width {width} exceeds the {self.max_width} the buffer was sized for")
        if x.device != self.group.device or x.stride(1) != 1:
            raise AllReduceError(f"rows must be row-contiguous on {self.group.device}, got {x.device} {x.stride()}")
        chunk = width // world
        consts = {"RANK": self.group.rank, "WORLD": world, "CHUNK": chunk, "BLOCK_C": block_c(chunk)}
        return rows, width, consts

    def __call__(self, x: Tensor, norm: Tensor | None = None, eps: float = 0.0) -> Tensor:
        """The reduced rows; with `norm`, RMSNorm(reduced) * norm instead (the latent norm, fused)."""
        from k3_decode.distributed.triton_twoshot import EPILOGUE_COPY, EPILOGUE_RMS_NORM, block_w, two_shot_kernel

        rows, width, consts = self._launch_args(x)
        if norm is not None and norm.numel() != width:
            raise AllReduceError(f"norm weight has {norm.numel()} elements for rows of {width}")
        out = torch.empty_like(x)
        big = block_w(width) >= 4096
        two_shot_kernel[(rows,)](
            x,
            x.stride(0),
            out,
            out.stride(0),
            x if norm is None else norm,
            self._tables["slots"],
            self._tables["gather"],
            self._tables["pads"],
            width,
            self.max_rows,
            eps,
            BLOCK_W=block_w(width),
            EPILOGUE=EPILOGUE_COPY if norm is None else EPILOGUE_RMS_NORM,
            num_warps=8 if big else 4,
            **consts,
        )
        return out

    def attn_res_after(
        self,
        partial: Tensor,
        prefix: Tensor,
        blocks: Tensor,
        res_norm: Tensor,
        res_proj: Tensor,
        out_norm: Tensor | None,
        *,
        num_blocks: int,
        restart: bool,
        eps: float,
    ) -> Tensor:
        """All-reduce the o_proj partial and run the AttnRes application after attention on it, in one launch."""
        import triton

        from k3_decode.distributed.triton_twoshot import two_shot_attn_res_kernel
        from k3_decode.stock.triton_kernels import LANE_SYMMETRIC
        from k3_decode.stock.triton_kernels import attn_res as kernel

        rows, width, consts = self._launch_args(partial)
        if tuple(prefix.shape) != (rows, width) or blocks.shape[0] != rows or blocks.shape[2] != width:
            raise AllReduceError(
                f"AttnRes state prefix {tuple(prefix.shape)} / bank {tuple(blocks.shape)} does not match the partial "
                f"{(rows, width)}"
            )
        out = torch.empty_like(prefix)
        scratch = torch.empty(rows, 2, width, dtype=torch.float32, device=prefix.device)
        block_s = max(2, triton.next_power_of_2(num_blocks + 1))
        two_shot_attn_res_kernel[(rows,)](
            partial,
            partial.stride(0),
            self._tables["slots"],
            self._tables["gather"],
            self._tables["pads"],
            width,
            self.max_rows,
            prefix,
            blocks,
            out,
            scratch,
            res_norm,
            res_proj,
            res_norm if out_norm is None else out_norm,
            num_blocks,
            prefix.stride(0),
            blocks.stride(0),
            blocks.stride(1),
            out.stride(0),
            eps,
            RESTART=restart,
            HAS_OUT_NORM=out_norm is not None,
            BLOCK_S=block_s,
            BLOCK_H=min(kernel.BLOCK_H_MAX, kernel.TILE_ELEMS // block_s, triton.next_power_of_2(width)),
            BLOCK_O=min(kernel.BLOCK_OUT, triton.next_power_of_2(width)),
            num_warps=kernel.NUM_WARPS,
            **LANE_SYMMETRIC,
            **consts,
        )
        return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build(transport: Transport, group: TpGroup, max_rows: int = 64, max_width: int = 7168) -> Any:
    """The all-reduce object for `transport` (max_rows/max_width size the peer buffer)."""
    if transport == "nccl":
        return NcclAllReduce(group)
    if transport == "ordered":
        return OrderedAllReduce(group)
    if transport == "peer":
        return PeerAllReduce(group, max_rows, max_width)
    raise AllReduceError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
