"""Per-request state of a stack on one rank: KDA state slots and paged FP8 MLA caches, and each step's slot tables.

Request r (0 <= r < max_requests) owns q KDA slots 1 + r * q + t, t = 0 .. q - 1, in every KDA layer, where q is the
stack's tokens per request (1 + num_speculative_tokens); slot 0 is the NULL slot: padding rows point there and the
kernels never write it. Without speculative tokens that is slot 1 + r, as before. A verify step of q tokens stores
the state after its token t in slot 1 + r * q + t and rewrites the conv row kept in the request's first slot
(k3_decode.reference.kda); the next step reads the state after the last accepted token, slot 1 + r * q + a - 1.
Prefill and decode iterations read and write the first slot, which is where a verify that accepted one token left
the state, so a verify after a prefill reads it with num_accepted 1. The conv state has W - 2 + q columns (vLLM's
W - 1 + num_spec).

MLA pages j * max_requests + r, j = 0 .. pages_per_request - 1, belong to request r in every MLA layer. The pages
of different requests interleave, as in the reference decoder, so a block-table mistake reads another request's
rows instead of passing unnoticed. The context length of each request is host bookkeeping; a step's tables are
built on the host from it and copied to the device. A verify step writes q cache rows past the context and leaves
the context where it was: `unconfirmed[r]` remembers those q tokens until the next step says how many of them
were accepted, and that count is what the context then advances by (the rejected rows are rewritten by that step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.executor.config import StackConfig
from k3_decode.reference.kda import KdaCache, KdaSpec
from k3_decode.reference.mla import quantize_e4m3

NULL_SLOT = 0
# Magnitudes of the synthetic context (benchmarks only): conv taps like unit-RMS projection outputs, recurrent
# states of the size the delta rule keeps them (as the stock attention tests draw them).
SYNTHETIC_RECURRENT_STD = 0.3


@dataclass(frozen=True)
class StepTables:
    """One decode iteration's tables for `rows` rows: the live requests in order, then NULL padding rows."""

    requests: tuple[int, ...]
    kda_slots: Tensor  # [rows] int32: the request's first slot, NULL_SLOT for padding (verify: [B * q], see below)
    block_table: Tensor  # [rows, pages_per_request] int32; padding rows are all page 0 and read nothing
    seq_lens: Tensor  # [rows] int32: context + 1 (the new token included), 0 for padding
    slot_mapping: Tensor  # [rows] int64: the new token's cache slot (page * page_size + offset), -1 for padding
    # A verify iteration (q > 1): rows are (request, token) pairs in request-major order; kda_slots holds each
    # request's q slots (the [B, q] table, flattened), and num_accepted [B] the previous verify's accepted counts
    # (1 for a NULL padding request).
    tokens_per_request: int = 1
    num_accepted: Tensor | None = None  # [B] int32, verify only

    @property
    def rows(self) -> int:
        return self.kda_slots.shape[0]

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.rows else 0


class RequestState:
    """KDA caches and MLA caches of every request, on one device."""

    def __init__(self, config: StackConfig, device: torch.device) -> None:
        self.config = config
        dims = config.dims
        self.spec = KdaSpec.for_rank(dims, config.tp)
        self.q = config.tokens_per_request
        slots = 1 + config.max_requests * self.q
        self.kda: dict[int, KdaCache] = {
            i: KdaCache.zeros(self.spec, slots, num_spec=self.q - 1, device=device) for i in config.kda_layers
        }
        pages = config.max_requests * config.pages_per_request
        shape = (pages, config.page_size, dims.mla.cache_row)
        self.mla: dict[int, Tensor] = {
            i: torch.zeros(shape, dtype=torch.uint8, device=device) for i in config.mla_layers
        }
        r, j = torch.arange(config.max_requests), torch.arange(config.pages_per_request)
        self.block_table_host = (j[None, :] * config.max_requests + r[:, None]).to(torch.int32)  # host copy
        self.block_table = self.block_table_host.to(device)
        self.context_lens = [0] * config.max_requests
        # Tokens of each request's last verify step whose acceptance the next step reports (0: none pending).
        self.unconfirmed = [0] * config.max_requests

    def check(self, requests: Sequence[int]) -> None:
        """Each request once, and each within max_requests: a one-line error naming the fix otherwise."""
        bad = [r for r in requests if not 0 <= r < self.config.max_requests]
        if bad:
            raise ValueError(f"requests {bad} are outside 0..{self.config.max_requests - 1}; raise max_requests")
        if len(set(requests)) != len(requests):
            raise ValueError(f"a step lists request(s) {sorted(requests)} twice; give each request one row")

    def kda_slot(self, request: int) -> int:
        """The request's first KDA slot: what prefill and decode iterations read and write, and the conv row."""
        return 1 + request * self.q

    def kda_slots(self, request: int) -> tuple[int, ...]:
        """The request's q KDA slots, slot[b, t] of a verify step's table."""
        first = self.kda_slot(request)
        return tuple(range(first, first + self.q))

    def verify_context(self, request: int, accepted: int) -> int:
        """The context a verify step of `request` starts at, once `accepted` tokens of its last verify count."""
        return self.context_lens[request] + (accepted if self.unconfirmed[request] else 0)

    def tables(self, requests: Sequence[int], rows: int | None = None) -> StepTables:
        """Host tables for one decode iteration of `requests`, padded with NULL rows to `rows`."""
        self.check(requests)
        rows = len(requests) if rows is None else rows
        if rows < len(requests):
            raise ValueError(f"{len(requests)} requests do not fit {rows} rows; use a larger graph batch")
        page_size, pages = self.config.page_size, self.config.pages_per_request
        kda_slots = torch.full((rows,), NULL_SLOT, dtype=torch.int32)
        block_table = torch.zeros(rows, pages, dtype=torch.int32)
        seq_lens = torch.zeros(rows, dtype=torch.int32)
        slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
        for b, r in enumerate(requests):
            n = self.context_lens[r]
            if n + 1 > self.config.max_context:
                raise ValueError(
                    f"request {r} would reach {n + 1} tokens, beyond max_context {self.config.max_context}; "
                    "build the stack with a larger max_context"
                )
            kda_slots[b] = self.kda_slot(r)
            block_table[b] = self.block_table_host[r]
            seq_lens[b] = n + 1
            slot_mapping[b] = int(self.block_table_host[r, n // page_size]) * page_size + n % page_size
        return StepTables(tuple(requests), kda_slots, block_table, seq_lens, slot_mapping)

    def verify_tables(self, requests: Sequence[int], accepted: Sequence[int], batch: int | None = None) -> StepTables:
        """Host tables for one verify iteration of q tokens per request; row b * q + t is token t of requests[b], an
        MLA decode row of its own at position ctx + t (seq_len ctx + t + 1), ctx = `verify_context`. Every row's
        cache entry is inserted before any row attends (the stock MLA step inserts all rows, then attends), so
        row t sees tokens 0..t of this step and not the later ones: the causal verify.

        `batch`: pad with NULL requests to `batch` requests (a verify graph's): their q slots are all NULL_SLOT,
        their rows have seq_len 0 and cache slot -1, so no kernel writes state for them, and their accepted count is
        1, so a kernel that reads slot[b, a - 1] before its NULL check still reads inside the table."""
        self.check(requests)
        if len(accepted) != len(requests):
            raise ValueError(f"{len(accepted)} accepted counts for {len(requests)} requests; give one per request")
        batch = len(requests) if batch is None else batch
        if batch < len(requests):
            raise ValueError(f"{len(requests)} requests do not fit a verify batch of {batch}; use a larger graph batch")
        q, page_size = self.q, self.config.page_size
        rows = batch * q
        kda_slots = torch.full((rows,), NULL_SLOT, dtype=torch.int32)
        block_table = torch.zeros(rows, self.config.pages_per_request, dtype=torch.int32)
        seq_lens = torch.zeros(rows, dtype=torch.int32)
        slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
        for b, (r, a) in enumerate(zip(requests, accepted, strict=True)):
            ctx = self.verify_context(r, a)
            if ctx + q > self.config.max_context:
                raise ValueError(
                    f"request {r} would reach {ctx + q} tokens, beyond max_context {self.config.max_context}; "
                    "build the stack with a larger max_context"
                )
            kda_slots[b * q : (b + 1) * q] = torch.tensor(self.kda_slots(r), dtype=torch.int32)
            for t in range(q):
                pos = ctx + t
                block_table[b * q + t] = self.block_table_host[r]
                seq_lens[b * q + t] = pos + 1
                slot_mapping[b * q + t] = int(self.block_table_host[r, pos // page_size]) * page_size + pos % page_size
        num_accepted = torch.ones(batch, dtype=torch.int32)
        num_accepted[: len(accepted)] = torch.tensor(list(accepted), dtype=torch.int32)
        return StepTables(tuple(requests), kda_slots, block_table, seq_lens, slot_mapping, q, num_accepted)

    def advance(self, requests: Sequence[int]) -> None:
        """Commit one token to each request's context (after its iteration ran)."""
        for r in requests:
            self.context_lens[r] += 1

    def verified(self, requests: Sequence[int], accepted: Sequence[int]) -> None:
        """After a verify iteration ran: the accepted tokens of each request's previous verify join its context,
        and this step's q tokens wait for the next step's count."""
        for r, a in zip(requests, accepted, strict=True):
            self.context_lens[r] = self.verify_context(r, a)
            self.unconfirmed[r] = self.q

    def fill_synthetic(self, requests: Sequence[int], length: int, seed: int = 0) -> None:
        """Benchmarks only: give `requests` a context of `length` tokens of random state without running them.

        Decode cost depends on the context length and not on its values, so the MLA pages get quantized unit-normal
        rows and the KDA slots random states of the model's magnitudes. Correctness tests prefill through
        StackExecutor.prefill instead.
        """
        self.check(requests)
        if not 0 <= length <= self.config.max_context:
            raise ValueError(f"context length {length} outside 0..{self.config.max_context} (max_context)")
        device = self.block_table.device
        gen = torch.Generator(device=device).manual_seed(seed)
        page_size = self.config.page_size
        used = -(-length // page_size)
        for cache in self.kda.values():
            for r in requests:
                slot = self.kda_slot(r)
                cache.conv[slot].copy_(torch.randn(cache.conv[slot].shape, generator=gen, device=device))
                rec = torch.randn(cache.recurrent[slot].shape, generator=gen, device=device)
                cache.recurrent[slot].copy_(rec * SYNTHETIC_RECURRENT_STD)
        for cache in self.mla.values():
            for r in requests:
                pages = self.block_table_host[r, :used].to(device=device, dtype=torch.long)
                rows = torch.randn(len(pages), page_size, cache.shape[2], generator=gen, device=device)
                cache[pages] = quantize_e4m3(rows, self.config.k_scale)
        for r in requests:
            self.context_lens[r] = length
            self.unconfirmed[r] = 0
