"""Rank functions the distributed tests start through harness.parallel (module level, so spawned children import
them). Each returns plain data the parent asserts on."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from k3_decode.distributed.allreduce import OrderedAllReduce, build
from k3_decode.distributed.group import TpGroup
from k3_decode.distributed.row_parallel import UnfusedRowParallel
from k3_decode.distributed.tp_stack import (
    TpStackSpec,
    oracle_reduce,
    replication_errors,
    start_rank,
    trace_tensors,
)
from k3_decode.reference.allreduce import TwoShotMismatch, verify_two_shot

SPECIAL = torch.tensor(
    [0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-38, -1e-38, 9.2e-41, -9.2e-41, 65504.0, 2.0**-133],
    dtype=torch.float32,
)

ORDER_LADDER = (1.0, 2.0**-24, 2.0**-24, -1.0)


def partial_rows(rank: int, rows: int, width: int, seed: int) -> Tensor:
    """A rank's partial: normal values at mixed scales, with -0.0, subnormals and near-overflow values placed so
    that the rank-order FP32 sum differs from a BF16 running sum and from other orders."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    scale = torch.logspace(-3, 3, width, dtype=torch.float32)[torch.randperm(width, generator=gen)]
    x = torch.randn(rows, width, generator=gen) * scale
    x[:, : SPECIAL.numel()] = SPECIAL * (1 if rank % 2 == 0 else -1)
    # FP32 addition is commutative but not associative: with 3+ ranks, 1 + 2^-24 + 2^-24 - 1 is 0 in rank order
    # and 2^-23 in reverse, a difference BF16 keeps.
    n = SPECIAL.numel()
    x[:, n] = ORDER_LADDER[rank % 4]
    x[:, n + 1] = ORDER_LADDER[(rank + 1) % 4]
    return x.bfloat16()


class ReversedOrder(OrderedAllReduce):
    """Red team: the two-shot shape with the FP32 sum taken in reverse rank order."""

    def __call__(self, x: Tensor) -> Tensor:
        parts = self.group.gather_tensors(x)
        acc = parts[-1].float()
        for p in reversed(parts[:-1]):
            acc = acc + p.float()
        return acc.bfloat16()


class Bf16RunningSum(OrderedAllReduce):
    """Red team: rank order, but a BF16 running sum that rounds after every add."""

    def __call__(self, x: Tensor) -> Tensor:
        parts = self.group.gather_tensors(x)
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc


class TruncatingSum(OrderedAllReduce):
    """Red team: rank order in FP32, but rounded toward zero instead of to nearest even (wrong at any TP size)."""

    def __call__(self, x: Tensor) -> Tensor:
        parts = self.group.gather_tensors(x)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        return (acc.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


TRANSPORTS: dict[str, Any] = {"reversed": ReversedOrder, "bf16-running": Bf16RunningSum, "truncating": TruncatingSum}


def all_reduce_bits(
    rank: int, world: int, address: str, port: int, kind: str, transport: str, repeats: int = 1
) -> dict[str, Any]:
    """Reduce seeded partials with `transport` (`repeats` times back to back, fresh values each time: a race shows
    as a wrong row); report the oracle's verdict and whether every rank got the same bits."""
    group = TpGroup.join(rank, world, address, port, kind)
    try:
        ar = TRANSPORTS[transport](group) if transport in TRANSPORTS else build(transport, group)
        out: dict[str, Any] = {}
        for rows, width in ((1, 64 * world), (5, 32 * world), (3, 7168), (64, 7168), (64, 3584)):
            xs = [partial_rows(rank, rows, width, seed=rows + 100 * i).to(group.device) for i in range(repeats)]
            befores = [x.clone() for x in xs]
            gots = [ar(x) for x in xs]  # queued back to back on the stream
            x, got = xs[-1], gots[-1]
            reruns = [ar(x_) for x_ in xs]
            pairs = zip(gots, reruns, strict=True)
            if any(not torch.equal(g.view(torch.int16), r.view(torch.int16)) for g, r in pairs):
                out[f"{rows}x{width}"] = {"oracle": "a back-to-back call differs from its rerun"}
                continue
            outputs, partials = group.gather_tensors(got), group.gather_tensors(x)
            try:
                verify_two_shot(outputs, partials)
                verdict = "ok"
            except TwoShotMismatch as exc:
                verdict = str(exc)
            out[f"{rows}x{width}"] = {
                "oracle": verdict,
                "identical": all(torch.equal(o.view(torch.int16), outputs[0].view(torch.int16)) for o in outputs),
                "input_unchanged": all(
                    torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(xs, befores, strict=True)
                ),
            }
        return out
    finally:
        group.leave()


def stack_numerics(
    rank: int, world: int, address: str, port: int, kind: str, stack: str, transport: str, elide: bool
) -> dict[str, Any]:
    """Prefill and one traced decode step of a TP stack; the per-layer oracle failures and the replication errors
    of this rank. `elide` is the red team: the row-parallel combines skip the all-reduce."""
    from k3_decode.executor.oracle import teacher_forced
    from tests.k3_decode.executor.helpers import decode_requests, layer_failures, prefill, snapshot

    group = TpGroup.join(rank, world, address, port, kind)
    try:
        ex = start_rank(group, TpStackSpec(stack, transport), log=lambda line: None)
        if elide:
            ex.runner.row_parallel = UnfusedRowParallel(lambda t: t)
        prefill(ex, {0: 3, 1: 5, 3: 2})
        reqs = decode_requests(ex, [3, 0, 2, 1], seed=7)
        before = snapshot(ex, reqs)
        result = ex.step(reqs, trace=True)
        assert result.trace is not None
        ref = teacher_forced(ex.dims, world, ex.weights, result.trace, before, reduce=oracle_reduce(group))
        outputs = {f"output of request {r}": t for r, t in result.outputs.items()}
        return {
            "failures": layer_failures(result.trace, ref),
            "replication": replication_errors(group, trace_tensors(result.trace) | outputs),
            "calls": dict(ex.runner.row_parallel.calls),
        }
    finally:
        group.leave()


def start_with_stack(rank: int, world: int, address: str, port: int, kind: str, stacks: list[str]) -> str:
    """Start rank r on stacks[r] (a rank-specific deployment): the agreement must stop every rank."""
    group = TpGroup.join(rank, world, address, port, kind)
    try:
        start_rank(group, TpStackSpec(stacks[rank]), log=lambda line: None)
        return "started"
    finally:
        group.leave()


def digest_check(rank: int, world: int, address: str, port: int, kind: str, perturb_rank: int) -> list[str]:
    group = TpGroup.join(rank, world, address, port, kind)
    try:
        x = torch.arange(12, dtype=torch.float32).bfloat16().reshape(3, 4)
        if rank == perturb_rank:
            x.view(torch.int16)[1, 2] += 1  # one BF16 ulp on one rank
        return replication_errors(group, {"same": torch.ones(3), "layer 6 mlp_output": x})
    finally:
        group.leave()


def fused_epilogues(rank: int, world: int, address: str, port: int, kind: str, batches: list[int]) -> dict[str, Any]:
    """The peer kernel's fused epilogues against the unfused composition (ordered all-reduce, then the stock
    kernel): the latent RMSNorm and the AttnRes application after attention. Both must give the same bits."""
    from k3_decode.config import K3
    from k3_decode.reference.attn_res import MixWeights, blocks_before_mlp
    from k3_decode.stock import AttnResBuffers
    from k3_decode.stock.attn_res import after_attention, after_attention_reduced
    from k3_decode.stock.triton_moe.elementwise import rms_norm

    group = TpGroup.join(rank, world, address, port, kind)
    try:
        dev, h, lat = group.device, K3.hidden_size, K3.moe.latent_size
        peer, ordered = build("peer", group), build("ordered", group)
        gen = torch.Generator().manual_seed(11)  # same weights and AttnRes state on every rank
        norm = (1 + 0.1 * torch.randn(lat, generator=gen)).bfloat16().to(dev)
        mix = MixWeights(
            res_norm=(1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().to(dev),
            res_proj=(0.05 * torch.randn(h, generator=gen)).bfloat16().to(dev),
            out_norm=(1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().to(dev),
        )
        out: dict[str, Any] = {}
        for batch in batches:
            routed = partial_rows(rank, batch, lat, seed=batch).to(dev)
            fused = peer(routed, norm=norm, eps=K3.rms_norm_eps)
            unfused = rms_norm(ordered(routed), norm, K3.rms_norm_eps)
            out[f"rms_norm B{batch}"] = torch.equal(fused.view(torch.int16), unfused.view(torch.int16))
            for layer in (6, 11):  # a mid-block layer and a block-write layer (the prefix restarts)
                n = blocks_before_mlp(layer, K3.attn_res_block_size)
                prefix = torch.randn(batch, h, generator=gen).bfloat16().to(dev)
                bank = torch.randn(batch, max(n, 1), h, generator=gen).bfloat16().to(dev)
                a = AttnResBuffers(prefix.clone(), bank.clone(), n)
                b = AttnResBuffers(prefix.clone(), bank.clone(), n)
                partial = partial_rows(rank, batch, h, seed=layer).to(dev) * 1e-3
                got = after_attention_reduced(a, layer, partial, mix, K3.attn_res_block_size, K3.rms_norm_eps, peer)
                want = after_attention(b, layer, ordered(partial), mix, K3.attn_res_block_size, K3.rms_norm_eps)
                same = all(
                    torch.equal(x.view(torch.int16), y.view(torch.int16))
                    for x, y in ((got, want), (a.prefix, b.prefix), (a.blocks, b.blocks))
                )
                out[f"attn_res L{layer} B{batch}"] = same
        return out
    finally:
        group.leave()
