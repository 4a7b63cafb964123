"""One process per GPU: the TP process group, the start-up agreement of scope verdicts, and object gathers.

Every collective here runs on every rank in the same order; that is the whole protocol. The scope verdict is
gathered before anything is built (k3_decode.runtime.startup: a rank computes its verdict without raising, the
agreed verdict raises on every rank with the same message), so a rank that alone would fall back stops every rank
with one error instead of leaving the others waiting in their first all-reduce.

Processes are started by harness.parallel, which also keeps NVLink multicast off in each of them; this module
reads no environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from k3_decode.runtime.scope import ScopeVerdict


class DistributedSetupError(RuntimeError):
    """The process group cannot be formed as asked; the message names the problem and the fix."""


@dataclass(frozen=True)
class TpGroup:
    """This process's place in the TP group: rank, size, its device and the backend the collectives use."""

    rank: int
    world: int
    device: torch.device
    backend: str  # "nccl" on GPUs, "gloo" for CPU runs at k3-mini dims

    @classmethod
    def join(cls, rank: int, world: int, address: str, port: int, device_kind: str) -> TpGroup:
        """Join (or form) the group: rank r uses cuda:r on a GPU host, the CPU otherwise."""
        if device_kind == "cuda":
            if torch.cuda.device_count() < world:
                raise DistributedSetupError(
                    f"TP={world} needs {world} GPUs, this host has {torch.cuda.device_count()}; lower TP or use a "
                    "larger machine"
                )
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        elif device_kind == "cpu":
            device, backend = torch.device("cpu"), "gloo"
        else:
            raise DistributedSetupError(f"device kind {device_kind!r} is not 'cuda' or 'cpu'")
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(
                backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world, **kwargs
            )
        if dist.get_rank() != rank or dist.get_world_size() != world:
            raise DistributedSetupError(
                f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, asked for rank {rank} of "
                f"{world}; destroy it first"
            )
        return cls(rank, world, device, backend)

    @property
    def group_name(self) -> str:
        group = dist.group.WORLD
        assert group is not None  # joined
        return group.group_name

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_verdicts(self, verdict: ScopeVerdict) -> Sequence[ScopeVerdict]:
        """k3_decode.runtime.startup's GatherVerdicts over this group."""
        return self.gather_objects(verdict)

    def gather_tensors(self, x: Tensor) -> list[Tensor]:
        """Every rank's tensor (same shape and dtype on all ranks), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return parts

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def leave(self) -> None:
        """Leave together: no rank tears the communicator down while a peer may still use it."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()
