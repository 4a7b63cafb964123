"""Per-request state of a stack on one rank: KDA state slots and paged FP8 MLA caches, and each step's slot tables.

Request r (0 <= r < max_requests) owns KDA slot 1 + r in every KDA layer (slot 0 is the NULL slot: padding rows
point there and the kernels never write it) and MLA pages j * max_requests + r, j = 0 .. pages_per_request - 1,
in every MLA layer. The pages of different requests interleave, as in the reference decoder, so a block-table
mistake reads another request's rows instead of passing unnoticed. The context length of each request is host
bookkeeping; a step's tables are built on the host from it and copied to the device.
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
    kda_slots: Tensor  # [rows] int32: 1 + request, NULL_SLOT for padding
    block_table: Tensor  # [rows, pages_per_request] int32; padding rows are all page 0 and read nothing
    seq_lens: Tensor  # [rows] int32: context + 1 (the new token included), 0 for padding
    slot_mapping: Tensor  # [rows] int64: the new token's cache slot (page * page_size + offset), -1 for padding

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
        slots = 1 + config.max_requests
        self.kda: dict[int, KdaCache] = {i: KdaCache.zeros(self.spec, slots, device=device) for i in config.kda_layers}
        pages = config.max_requests * config.pages_per_request
        shape = (pages, config.page_size, dims.mla.cache_row)
        self.mla: dict[int, Tensor] = {
            i: torch.zeros(shape, dtype=torch.uint8, device=device) for i in config.mla_layers
        }
        r, j = torch.arange(config.max_requests), torch.arange(config.pages_per_request)
        self.block_table_host = (j[None, :] * config.max_requests + r[:, None]).to(torch.int32)  # host copy
        self.block_table = self.block_table_host.to(device)
        self.context_lens = [0] * config.max_requests

    def _check(self, requests: Sequence[int]) -> None:
        bad = [r for r in requests if not 0 <= r < self.config.max_requests]
        if bad:
            raise ValueError(f"requests {bad} are outside 0..{self.config.max_requests - 1}; raise max_requests")
        if len(set(requests)) != len(requests):
            raise ValueError(f"a step lists request(s) {sorted(requests)} twice; give each request one row")

    def kda_slot(self, request: int) -> int:
        return 1 + request

    def tables(self, requests: Sequence[int], rows: int | None = None) -> StepTables:
        """Host tables for one decode iteration of `requests`, padded with NULL rows to `rows`."""
        self._check(requests)
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

    def advance(self, requests: Sequence[int]) -> None:
        """Commit one token to each request's context (after its iteration ran)."""
        for r in requests:
            self.context_lens[r] += 1

    def fill_synthetic(self, requests: Sequence[int], length: int, seed: int = 0) -> None:
        """Benchmarks only: give `requests` a context of `length` tokens of random state without running them.

        Decode cost depends on the context length and not on its values, so the MLA pages get quantized unit-normal
        rows and the KDA slots random states of the model's magnitudes. Correctness tests prefill through
        StackExecutor.prefill instead.
        """
        self._check(requests)
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
