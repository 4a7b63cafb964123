"""The stack executor with real tensor parallelism: one process per rank, each holding its shard of the layers.

`start_rank` starts one rank: the runtime's start-up with the scope verdict agreed across ranks (a rank that alone
would reject or fall back stops every rank with one error), the rank's executor, and the row-parallel combines
of the chosen transport. Every rank must then run the same steps in the same order: each layer all-reduces.

`replication_errors` checks what TP promises: a replicated value (the layer inputs and outputs after each
all-reduce) has the same bits on every rank. It gathers a SHA-256 of each tensor's bytes, so it is exact and
cheap; a mismatch names the tensor and the ranks that disagree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from k3_decode.distributed.allreduce import PeerAllReduce, Transport, build
from k3_decode.distributed.group import TpGroup
from k3_decode.distributed.row_parallel import FusedRowParallel, UnfusedRowParallel
from k3_decode.executor import StackExecutor, load_stack
from k3_decode.reference.decoder import LayerTrace, Numerics
from k3_decode.reference.decoder import all_reduce as oracle_all_reduce


@dataclass(frozen=True)
class TpStackSpec:
    stack: str  # a stacks.toml name; its TP is the group's size
    transport: Transport = "ordered"
    fused: bool = False  # the peer transport's epilogue fusion (AttnRes, latent norm); needs transport "peer"
    decode_backend: str = "auto"
    overrides: Mapping[str, Any] = field(default_factory=dict)  # StackConfig fields (max_context, graph_batches)

    def __post_init__(self) -> None:
        if self.fused and self.transport != "peer":
            raise ValueError(f"fused row-parallel combines need transport 'peer', not {self.transport!r}")

    @property
    def label(self) -> str:
        return f"{self.transport}{'+fused' if self.fused else ''}"


def start_rank(
    group: TpGroup, spec: TpStackSpec, *, weights: Mapping[int, Any] | None = None, log: Callable[[str], None] = print
) -> StackExecutor:
    config = load_stack(spec.stack, group.world, rank=group.rank, **dict(spec.overrides))
    kwargs: dict[str, Any] = {"log": log}
    if weights is not None:
        kwargs["weights"] = weights
    executor = StackExecutor.start(
        config,
        {"decode_backend": spec.decode_backend},
        device=group.device,
        gather=group.gather_verdicts,
        tp_all_reduce=group.world > 1,
        **kwargs,
    )
    transport = build(spec.transport, group, max_rows=config.max_requests, max_width=config.dims.hidden_size)
    if spec.fused:
        assert isinstance(transport, PeerAllReduce)
        executor.runner.row_parallel = FusedRowParallel(transport)
    else:
        executor.runner.row_parallel = UnfusedRowParallel(transport)
    return executor


def oracle_reduce(group: TpGroup, dtype: torch.dtype = torch.float64) -> Callable[[Tensor], Tensor]:
    """The teacher-forced oracle's all-reduce across ranks: every rank's partial, combined by the two-shot rule."""
    numerics = Numerics(dtype=dtype, all_reduce="two_shot")
    return lambda partial: oracle_all_reduce(group.gather_tensors(partial), numerics)


def tensor_digest(x: Tensor) -> str:
    data = x.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def trace_tensors(trace: Sequence[LayerTrace], prefix: str = "") -> dict[str, Tensor]:
    """The replicated fields of a per-layer trace (attn_output is the all-reduced one in a TP trace)."""
    out = {}
    for t in trace:
        for name, value in t.hidden():
            out[f"{prefix}layer {t.layer} {name}"] = value
    return out


def replication_errors(group: TpGroup, tensors: Mapping[str, Tensor]) -> list[str]:
    """Tensors whose bits differ between ranks, each naming the ranks grouped by digest; [] when all agree."""
    digests = {name: tensor_digest(t) for name, t in tensors.items()}
    every = group.gather_objects(digests)
    errors = []
    for name in digests:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(every):
            groups.setdefault(d.get(name, "missing"), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {ranks} {d[:12]}" for d, ranks in groups.items())
            errors.append(f"{name}: ranks disagree ({parts})")
    return errors
