"""The composed reference decoder: a 20-layer k3-mini stack, TP equivalence, batch independence, verify steps."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from k3_decode.config import K3, K3_MINI, ModelDims
from k3_decode.reference import kda
from k3_decode.reference.decoder import (
    DecodeState,
    KdaRank,
    LayerTrace,
    Numerics,
    ReferenceDecoder,
    StepOutput,
    first_divergence,
    kda_rank_attention,
)
from k3_decode.weights import SyntheticWeights

STACK = K3_MINI.with_layers(20)  # MLA at 0-indexed 3, 7, 11, 15, 19; dense layer 0; 7 AttnRes blocks of 3
PREFILL, DECODE, BATCH = 8, 16, 3

# FP64 compute with the unrounded all-reduce: two runs that differ only in summation order (TP split, batch
# composition, a verify step vs decode steps) then agree to ~1e-15, far from every BF16 / FP8 / top-k rounding
# boundary, so any difference above TIGHT is a semantic bug (a wrong shard, slot, page or position), not noise.
# Measured: the TP=2 and TP=4 runs below are bit-identical to TP=1.
EXACT = Numerics(dtype=torch.float64, all_reduce="exact")
TIGHT = 1e-9


def tokens(seed: int, batch: int, length: int, dims: ModelDims = STACK) -> Tensor:
    return torch.randint(0, dims.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_decode(dec: ReferenceDecoder, prompt: Tensor, max_context: int = 32) -> tuple[list[StepOutput], DecodeState]:
    """One decode step per column of prompt [B, T], keeping every step's trace."""
    state = dec.new_state(prompt.shape[0], max_context)
    return [dec.step(state, prompt[:, t : t + 1], verify=False) for t in range(prompt.shape[1])], state


def first_step(dims: ModelDims, prompt: Tensor, tp: int, numerics: Numerics) -> StepOutput:
    """The first decode step of prompt [B, 1] on a fresh decoder."""
    dec = ReferenceDecoder.synthetic(dims, tp=tp, numerics=numerics)
    return dec.step(dec.new_state(prompt.shape[0], 4), prompt, verify=False)


@dataclass(frozen=True)
class StackRun:
    dims: ModelDims
    outputs: list[StepOutput]
    state: DecodeState


@pytest.fixture(scope="module")
def stack() -> StackRun:
    """The default oracle (FP32, two-shot all-reduce) at TP=1: 8 prefill + 16 decode steps for 3 requests."""
    dec = ReferenceDecoder.synthetic(STACK)
    outputs, state = run_decode(dec, tokens(0, BATCH, PREFILL + DECODE))
    return StackRun(STACK, outputs, state)


@pytest.fixture(scope="module")
def exact_tp1() -> ReferenceDecoder:
    return ReferenceDecoder.synthetic(STACK, numerics=EXACT)


# --- the 20-layer stack ---------------------------------------------------------------------------------------


def token_rms(x: Tensor) -> Tensor:
    return x.double().square().mean(dim=-1).sqrt()


# Why these bands (weights.py draws projections with std 1/sqrt(fan_in) and norm weights 1 +- 0.1):
# - the attention and MLP inputs are RMSNorm(mixed) * norm weight, so each token's RMS is the RMS of the norm
#   weight over its (normalized) entries: 1 +- a few percent. [0.8, 1.25] fails on any NaN or zero row.
# - sublayer outputs are unit-gain projections of bounded activations. KDA: per-head RMSNorm times a sigmoid
#   gate, ~0.5 (at most ~1.1). MLA: a softmax-weighted mean of unit-RMS cache rows times a sigmoid gate, 0.5 at
#   one token, shrinking with the context to ~0.14 at 24. Dense SiTU MLP: ~0.5. MoE: the normed latent (RMS ~1)
#   through the unit-gain up-projection plus the shared experts (~0.5), ~1.2 (at most ~1.5). Each band sits 3-4x
#   beyond its expected range on both sides, so a dead, exploding or mis-scaled layer leaves it.
# - the final hidden is normed (~1) and the lm_head is unit-gain, so the logits' spread over the vocabulary is ~1.
INPUT_BAND = (0.8, 1.25)
OUTPUT_BANDS = {"kda": (0.1, 2.0), "mla": (0.03, 2.0), "dense": (0.1, 2.0), "moe": (0.25, 3.0)}
LOGIT_STD_BAND = (0.5, 2.0)


def band(layer: LayerTrace, name: str) -> tuple[float, float]:
    if name.endswith("input"):
        return INPUT_BAND
    return OUTPUT_BANDS[layer.kind if name == "attn_output" else layer.mlp_kind]


def test_every_layer_stays_finite_and_in_band(stack: StackRun) -> None:
    assert len(stack.outputs) == PREFILL + DECODE
    for step, out in enumerate(stack.outputs):
        assert len(out.layers) == STACK.num_layers
        for layer in out.layers:
            for name, x in layer.hidden():
                where = f"step {step} layer {layer.layer} ({layer.kind}) {name}"
                assert x.shape == (BATCH, 1, STACK.hidden_size), where
                assert bool(torch.isfinite(x).all()), f"{where}: not finite"
                lo, hi = band(layer, name)
                rms = token_rms(x)
                assert lo < rms.min().item() and rms.max().item() < hi, f"{where}: token RMS {rms.flatten().tolist()}"
        rms = token_rms(out.final_hidden)
        assert INPUT_BAND[0] < rms.min().item() and rms.max().item() < INPUT_BAND[1]
        assert bool(torch.isfinite(out.logits).all())


def test_logits_vary_across_tokens_and_requests(stack: StackRun) -> None:
    logits = torch.cat([out.logits for out in stack.outputs], dim=1)  # [B, steps, vocab]
    assert logits.shape == (BATCH, PREFILL + DECODE, STACK.vocab_size)
    spread = logits.std(dim=-1)
    assert LOGIT_STD_BAND[0] < spread.min().item() and spread.max().item() < LOGIT_STD_BAND[1]
    # Requests at the same step, and one request at successive steps, must see different distributions.
    for b in range(BATCH):
        for c in range(b + 1, BATCH):
            assert (logits[b] - logits[c]).abs().amax(dim=-1).min().item() > 0.5
        assert (logits[b, 1:] - logits[b, :-1]).abs().amax(dim=-1).min().item() > 0.5
    # 72 greedy tokens from 512: a decoder stuck on a few outputs would repeat them.
    assert logits.argmax(dim=-1).unique().numel() > 30


def written_mla_rows(state: DecodeState, layer: int, rank: int = 0) -> Tensor:
    """[B, max_context] bool: which positions of each request hold a non-zero cache row."""
    cache = state.mla[layer][rank]
    page = cache.shape[1]
    pos = torch.arange(state.max_context)
    rows = cache[state.block_table[:, pos // page], pos % page]  # [B, positions, row]
    return (rows != 0).any(dim=-1)


def test_layer_kinds_follow_the_pattern_and_own_their_caches(stack: StackRun) -> None:
    dims, state = stack.dims, stack.state
    mla_layers = {i for i in range(dims.num_layers) if dims.layer_kind(i) == "mla"}
    assert mla_layers == {3, 7, 11, 15, 19}
    assert set(state.mla) == mla_layers and set(state.kda) == set(range(20)) - mla_layers
    out = stack.outputs[-1]
    assert [t.kind for t in out.layers] == list(dims.layer_kinds)
    assert [t.mlp_kind for t in out.layers] == ["dense"] + ["moe"] * 19
    assert out.layers[0].expert_ids is None
    assert all(t.expert_ids.shape == (BATCH, 1, dims.moe.top_k) for t in out.layers[1:])

    steps = PREFILL + DECODE
    assert state.context_lens.tolist() == [steps] * BATCH
    for layer in mla_layers:
        written = written_mla_rows(state, layer)
        assert bool(written[:, :steps].all()) and not bool(written[:, steps:].any()), f"MLA layer {layer}"
    for layer, (cache,) in state.kda.items():
        used = state.kda_slots[:, 0]
        assert bool((cache.recurrent[0] == 0).all()) and bool((cache.conv[0] == 0).all()), "NULL slot 0 written"
        assert bool((cache.recurrent[used] != 0).any(dim=(1, 2, 3)).all()), f"KDA layer {layer} state not written"


def test_each_layer_reads_its_own_cache() -> None:
    # Corrupt one layer's cache: the next step must first diverge at that layer's attention, not earlier.
    dims = K3_MINI.with_layers(8)
    dec = ReferenceDecoder.synthetic(dims, numerics=EXACT)
    _, state = run_decode(dec, tokens(1, 2, 4, dims))
    nxt = tokens(2, 2, 1, dims)
    ref = dec.step(copy.deepcopy(state), nxt, verify=False)
    for layer, corrupt in (
        (2, lambda s: s.kda[2][0].recurrent.mul_(0.5)),
        (5, lambda s: s.kda[5][0].conv.zero_()),
        (3, lambda s: s.mla[3][0].zero_()),
        (7, lambda s: s.mla[7][0][s.block_table[1, 0], 1].fill_(0x38)),  # request 1, position 1 reads 1.0
    ):
        bad = copy.deepcopy(state)
        corrupt(bad)
        found = first_divergence(ref, dec.step(bad, nxt, verify=False), atol=TIGHT)
        assert found is not None and found.startswith(f"layer {layer} attn_output"), (layer, found)


# --- tensor parallelism ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exact_tp1_run(exact_tp1: ReferenceDecoder) -> list[StepOutput]:
    return run_decode(exact_tp1, tokens(3, 2, 8))[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_tp1(tp: int, exact_tp1_run: list[StepOutput]) -> None:
    # Every rank runs its own SyntheticWeights shard and keeps its own caches; the o_proj, dense-down, latent and
    # shared partials are summed in rank order. A wrong shard (rank, section, padding) shows as an O(1) error.
    dec = ReferenceDecoder.synthetic(STACK, tp=tp, numerics=EXACT)
    outputs, state = run_decode(dec, tokens(3, 2, 8))
    assert len(state.kda[0]) == tp and state.kda[0][0].recurrent.shape[1] == STACK.kda.num_heads // tp
    for step, (ref, out) in enumerate(zip(exact_tp1_run, outputs, strict=True)):
        found = first_divergence(ref, out, atol=TIGHT)
        assert found is None, f"TP={tp} step {step}: {found}"
    # Every rank's MLA cache holds the same replicated latent rows.
    for layer in state.mla:
        assert all(torch.equal(c, state.mla[layer][0]) for c in state.mla[layer][1:])


def test_two_shot_all_reduce_rounds_the_partials_once() -> None:
    # With the BF16 two-shot transport, TP=2 differs from TP=1 only by rounding each rank's partial before the
    # FP32 sum: for layer 0's attention output, a few BF16 rounding steps at the output's scale (2^-8 relative).
    dims = K3_MINI.with_layers(1)
    prompt = tokens(4, 3, 1, dims)
    ref, two, exact = (
        first_step(dims, prompt, tp, n)
        for tp, n in ((1, Numerics()), (2, Numerics()), (2, Numerics(all_reduce="exact")))
    )
    a, b, c = (o.layers[0].attn_output for o in (ref, two, exact))
    assert a.dtype == torch.float32
    assert torch.equal(a, a.bfloat16().float()) and torch.equal(b, b.bfloat16().float()), "two-shot output is BF16"
    assert not torch.equal(c, c.bfloat16().float()), "the exact transport must not round"
    assert (a - b).abs().max().item() <= 2 * 2.0**-8 * a.abs().max().item()
    assert not torch.equal(a, b)  # the rounding of the partials is really there


# --- batches and verify steps ---------------------------------------------------------------------------------


def test_requests_in_one_batch_equal_each_run_alone(exact_tp1: ReferenceDecoder) -> None:
    prompt = tokens(5, 2, 10)
    together, state = run_decode(exact_tp1, prompt)
    # The two requests' pages interleave, so a block-table or slot mistake would read the neighbour's rows.
    assert state.block_table[0, 0] != state.block_table[1, 0] and state.kda_slots[1, 0] > 1
    for b in range(2):
        alone, _ = run_decode(exact_tp1, prompt[b : b + 1])
        for step, (x, y) in enumerate(zip(together, alone, strict=True)):
            diff = (x.logits[b] - y.logits[0]).abs().max().item()
            assert diff < TIGHT, f"request {b} step {step}: {diff:.3g}"


def test_verify_steps_equal_sequential_decodes(exact_tp1: ReferenceDecoder) -> None:
    # Batched verify steps of 4 tokens with per-request acceptance against each request decoded alone, one token
    # at a time: all accepted, then partial acceptance (KDA state read from slot a-1, MLA rows overwritten past the
    # accepted context), then one accepted and a plain decode step after it.
    dec, q = exact_tp1, 4
    prompt, drafts, last = tokens(6, 2, 5), tokens(7, 2, 4 * q), tokens(8, 2, 1)
    chunks = drafts.split(q, dim=1)
    accepted = ([4, 4], [2, 3], [4, 4], [1, 1])

    state = dec.new_state(2, 32, max_tokens_per_step=q)
    dec.prefill(state, prompt)
    verified = []
    for chunk, acc in zip(chunks, accepted, strict=True):
        verified.append(dec.verify_step(state, chunk))
        dec.accept(state, acc)
    final = dec.decode_step(state, last[:, 0])
    assert state.context_lens.tolist() == [5 + 11 + 1, 5 + 12 + 1]

    for b in range(2):
        alone = dec.new_state(1, 32)
        dec.prefill(alone, prompt[b : b + 1])
        for step, (chunk, acc, logits) in enumerate(zip(chunks, accepted, verified, strict=True)):
            n = acc[b]
            want = dec.prefill(alone, chunk[b : b + 1, :n])[0]
            diff = (logits[b, :n] - want).abs().max().item()
            assert diff < TIGHT, f"request {b} verify {step}: {diff:.3g}"
        diff = (final[b] - dec.decode_step(alone, last[b])).abs().max().item()
        assert diff < TIGHT, f"request {b} final decode: {diff:.3g}"


# --- options and errors ---------------------------------------------------------------------------------------


def test_mxfp8_hook_touches_only_the_routed_experts() -> None:
    dims = K3_MINI.with_layers(2)  # layer 0 dense, layer 1 MoE
    prompt = tokens(9, 3, 1, dims)
    plain, quant = (first_step(dims, prompt, 1, Numerics(expert_act_quant=flag)) for flag in (False, True))
    p, q = plain.layers, quant.layers
    assert torch.equal(p[0].mlp_output, q[0].mlp_output) and torch.equal(p[1].attn_output, q[1].attn_output)
    rel = ((p[1].mlp_output - q[1].mlp_output).norm() / p[1].mlp_output.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # E4M3 keeps ~3 mantissa bits: a few percent at most


@pytest.fixture(scope="module")
def tiny() -> ReferenceDecoder:
    return ReferenceDecoder.synthetic(K3_MINI.with_layers(2))


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda d, s: d.decode_step(s, torch.tensor([0, 512])), "token ids must lie in 0..511"),
        (lambda d, s: d.decode_step(s, torch.tensor([0.0, 1.0])), "integer ids"),
        (lambda d, s: d.decode_step(s, torch.tensor([0, 1, 2])), "tokens hold 3 requests, the state 2"),
        (lambda d, s: d.decode_step(s, torch.tensor([[0, 1]])), "decode_step takes tokens [batch]"),
        (lambda d, s: d.verify_step(s, torch.zeros(2, 3, dtype=torch.long)), "raise max_tokens_per_step"),
        (lambda d, s: d.accept(s, [1, 1]), "no verify step is pending"),
        (lambda d, s: d.prefill(s, torch.zeros(2, 9, dtype=torch.long)), "beyond max_context 8"),
    ],
)
def test_bad_steps_are_rejected(tiny: ReferenceDecoder, action, message: str) -> None:
    state = tiny.new_state(2, 8, max_tokens_per_step=2)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        action(tiny, state)


def test_verify_protocol_is_enforced(tiny: ReferenceDecoder) -> None:
    state = tiny.new_state(2, 8, max_tokens_per_step=2)
    chunk = torch.zeros(2, 2, dtype=torch.long)
    tiny.verify_step(state, chunk)
    with pytest.raises(ValueError, match="awaits accept"):
        tiny.decode_step(state, chunk[:, 0])
    with pytest.raises(ValueError, match=r"must lie in 1\.\.2"):
        tiny.accept(state, [0, 2])
    with pytest.raises(ValueError, match="one count per request"):
        tiny.accept(state, [1])
    tiny.accept(state, [2, 1])
    with pytest.raises(ValueError, match="must be a verify step of at least 2 tokens"):
        tiny.decode_step(state, chunk[:, 0])
    tiny.verify_step(state, chunk)  # a verify step of 2 may follow
    assert state.context_lens.tolist() == [2, 1]
    with pytest.raises(ValueError, match="another model or TP size"):
        ReferenceDecoder.synthetic(K3_MINI.with_layers(2), tp=2).decode_step(tiny.new_state(2, 8), chunk[:, 0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.bfloat16}, "torch.float32 or torch.float64"),
        ({"all_reduce": "ring"}, "'two_shot' or 'exact'"),
        ({"mla_k_scale": 0.0}, "must be positive"),
        ({"mla_page_size": 0}, "at least 1"),
    ],
)
def test_bad_numerics_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Numerics(**kwargs)


# --- real K3 shapes -------------------------------------------------------------------------------------------


def test_real_k3_tp8_kda_layer_on_one_rank() -> None:
    # One rank of a real K3 TP8 KDA layer (12 heads, in_proj 6288 x 7168): three decode steps for two requests.
    start = time.perf_counter()
    spec = kda.KdaSpec.for_rank(K3, 8)
    w = KdaRank.from_weights(SyntheticWeights(K3, 8, 5).attention(1), torch.float32)
    cache = kda.KdaCache.zeros(spec, num_slots=4)
    slots = torch.tensor([[3], [1]])
    x = torch.randn(3, 2, 1, K3.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = [kda_rank_attention(spec, w, x[t], cache, slots, None, torch.float32) for t in range(3)]
    for out in outs:
        assert out.shape == (2, 1, K3.hidden_size) and bool(torch.isfinite(out).all())
        # One rank's partial carries 1/8 of the heads: ~0.5 * sqrt(1536 / 12288) ~ 0.18 RMS for unit inputs.
        rms = token_rms(out)
        assert rms.min().item() > 0.05 and rms.max().item() < 0.6, rms.flatten().tolist()
    assert cache.recurrent.shape == (4, 12, 128, 128) and cache.conv.shape == (4, 3 * 1536, 3)
    written = (cache.recurrent != 0).flatten(1).any(dim=1).tolist()
    assert written == [False, True, False, True], "only the two requests' slots may be written"
    assert time.perf_counter() - start < 10
