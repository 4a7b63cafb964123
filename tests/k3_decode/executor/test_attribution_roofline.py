"""Kernel attribution from profiler traces (synthetic chrome traces in the format torch.profiler writes) and the
byte counts of the roofline."""

from __future__ import annotations

import pytest

from k3_decode.config import K3
from k3_decode.executor.attribution import (
    RangeKernels,
    attribute,
    device_events,
    kernels_by_range,
    split_range,
    stock_kernel_info,
)
from k3_decode.executor.forward import MLA_ATTENTION_OPS, parse_range_name, range_name
from k3_decode.executor.roofline import StepShape, layer_bytes, layer_ops, op_bytes
from k3_decode.weights import expert_bytes, memory_bytes

INFO = stock_kernel_info()


class Trace:
    """Builds a chrome trace: ranges on the CPU, launches inside them, kernels on the GPU linked by correlation."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.clock = 0.0
        self.corr = 0

    def range(self, layer: int, ops: tuple[str, ...], kernels: list[tuple[str, float]], driver: bool = False) -> None:
        start = self.clock
        for name, dur in kernels:
            self.corr += 1
            self.clock += 1
            cat, launch = ("cuda_driver", "cuLaunchKernel") if driver else ("cuda_runtime", "cudaLaunchKernel")
            self.events.append({"ph": "X", "cat": cat, "name": launch, "ts": self.clock, "dur": 0.5,
                                "args": {"correlation": self.corr}})  # fmt: skip
            gpu = 1000 + self.clock
            self.events.append({"ph": "X", "cat": "kernel", "name": name, "ts": gpu, "dur": dur,
                                "args": {"correlation": self.corr}})  # fmt: skip
        self.clock += 1
        self.events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": range_name(layer, ops),
                "ts": start,
                "dur": self.clock - start,
            }
        )
        self.clock += 1

    def loose(self, name: str) -> None:
        self.corr += 1
        self.events.append({"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": 5000.0, "dur": 1.0,
                            "args": {"correlation": self.corr}})  # fmt: skip

    def json(self) -> dict:
        return {"traceEvents": self.events}


def test_range_names_round_trip_and_foreign_names_are_ignored() -> None:
    assert parse_range_name(range_name(7, MLA_ATTENTION_OPS)) == (7, MLA_ATTENTION_OPS)
    assert parse_range_name("ProfilerStep#3") is None
    assert parse_range_name("k3.Lx.attn_res") is None


def test_kernels_go_to_the_range_open_when_they_were_launched() -> None:
    t = Trace()
    t.range(6, ("attn_res",), [("attn_res_kernel", 3.0)])
    t.range(6, ("kda_in_proj",), [("sm90_xmma_gemm_bf16", 10.0), ("splitKreduce_kernel", 1.0)], driver=True)
    t.loose("Memcpy HtoD")
    ranges, loose = kernels_by_range(t.json())
    assert [(r.layer, r.ops, [e.name for e in r.events]) for r in ranges] == [
        (6, ("attn_res",), ["attn_res_kernel"]),
        (6, ("kda_in_proj",), ["sm90_xmma_gemm_bf16", "splitKreduce_kernel"]),
    ]
    assert [e.name for e in loose] == ["Memcpy HtoD"]
    assert [e.category for e in device_events(t.json())] == ["kernel", "kernel", "kernel", "gpu_memcpy"]


def _range(ops: tuple[str, ...], names: list[str]) -> RangeKernels:
    t = Trace()
    t.range(7, ops, [(n, 1.0) for n in names])
    return kernels_by_range(t.json())[0][0]


def test_named_kernels_anchor_their_op_and_cublas_kernels_fill_the_gaps() -> None:
    names = ["gemm_a", "qkv_norm_kernel", "gemm_b", "gemm_c", "query_insert_kernel", "split_kv_kernel"]
    names += ["merge_kernel", "gemm_d", "sigmoid_gate_kernel", "gemm_e"]
    got = {o.label: [e.name for e in o.events] for o in split_range(_range(MLA_ATTENTION_OPS, names), INFO)}
    assert got == {
        "mla_qkv_a_g": ["gemm_a"],
        "mla_qkv_norm": ["qkv_norm_kernel"],
        "mla_q_b": ["gemm_b"],
        "mla_w_uk": ["gemm_c"],
        "mla_query_insert": ["query_insert_kernel"],
        "mla_attention": ["split_kv_kernel", "merge_kernel"],
        "mla_w_uv": ["gemm_d"],
        "mla_gate": ["sigmoid_gate_kernel"],
        "mla_o_proj": ["gemm_e"],
    }


def test_cublas_ops_that_cannot_be_told_apart_are_reported_together() -> None:
    names = ["gemm_a", "qkv_norm_kernel", "gemm_b", "splitk_b", "gemm_c", "query_insert_kernel"]
    names += ["split_kv_kernel", "merge_kernel", "gemm_d", "sigmoid_gate_kernel", "gemm_e"]
    got = {o.label: len(o.events) for o in split_range(_range(MLA_ATTENTION_OPS, names), INFO)}
    assert got["mla_q_b+mla_w_uk"] == 3
    assert "mla_q_b" not in got and sum(got.values()) == len(names)


def test_unnamed_kernels_beside_triton_only_ops_join_their_neighbour() -> None:
    got = split_range(_range(("kda_f_b", "kda_decode"), ["gemm", "kda_decode_kernel", "fill"]), INFO)
    assert {o.label: [e.name for e in o.events] for o in got} == {
        "kda_f_b": ["gemm"],
        "kda_decode": ["kda_decode_kernel", "fill"],
    }


def test_the_two_attn_res_ranges_of_a_layer_are_before_and_after() -> None:
    t = Trace()
    for layer in (6, 7):
        t.range(layer, ("attn_res",), [("attn_res_kernel", 1.0)])
        t.range(layer, ("attn_res",), [("attn_res_kernel", 2.0)])
    labels = [(o.layer, o.label, o.time_us) for o in attribute(kernels_by_range(t.json())[0], INFO)]
    assert labels == [
        (6, "attn_res_before", 1.0),
        (6, "attn_res_after", 2.0),
        (7, "attn_res_before", 1.0),
        (7, "attn_res_after", 2.0),
    ]


# --- roofline bytes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "layer"), [(8, 6), (8, 7), (16, 6), (16, 7), (8, 0)])
def test_one_token_moves_the_layer_weights_once(tp: int, layer: int) -> None:
    """At batch 1 and context 1 the bytes are the weights the step reads, within the activations (< 0.5 %)."""
    kind, mlp = K3.layer_kind(layer), K3.mlp_kind(layer)
    top_k = K3.moe.top_k if mlp == "moe" else None
    shape = StepShape(1, (1,), 1, top_k)
    w = memory_bytes(K3, tp, kind, mlp)
    expected = w.residual + w.attention + w.mlp + (top_k or 0) * expert_bytes(K3.shard(tp))
    state = 0
    if kind == "kda":
        s = K3.shard(tp)
        state = 2 * (4 * s.kda_recurrent_state[0] * s.kda_recurrent_state[1] ** 2 + 2 * s.kda_conv_state[0] * 3)
    total = sum(layer_bytes(K3, tp, layer, shape).values()) - state
    assert expected <= total < expected * 1.005


def test_bytes_grow_with_the_context_the_experts_and_the_batch() -> None:
    one = StepShape(1, (1000,), 1, 16)
    assert (
        op_bytes(K3, 8, 7, "mla_attention", StepShape(1, (1001,), 1, 16)) - op_bytes(K3, 8, 7, "mla_attention", one)
        == K3.mla.cache_row
    )
    assert op_bytes(K3, 8, 6, "experts", StepShape(1, (1,), 1, 17)) - op_bytes(
        K3, 8, 6, "experts", StepShape(1, (1,), 1, 16)
    ) == expert_bytes(K3.shard(8))
    s = K3.shard(8)
    per_request = 2 * (4 * s.kda_heads * 128 * 128 + 2 * 3 * s.kda_proj * 3)
    two = op_bytes(K3, 8, 6, "kda_decode", StepShape(2, (1, 1)))
    assert two - op_bytes(K3, 8, 6, "kda_decode", StepShape(1, (1,))) >= per_request
    assert layer_ops(K3, 6)[0] == "attn_res_before" and layer_ops(K3, 6)[-1] == "latent_tail"


def test_bytes_need_the_routed_experts_and_a_known_op() -> None:
    with pytest.raises(ValueError, match="distinct routed experts"):
        op_bytes(K3, 8, 6, "experts", StepShape(1, (1,)))
    with pytest.raises(ValueError, match="no byte count for stock op 'warp_drive'"):
        op_bytes(K3, 8, 6, "warp_drive", StepShape(1, (1,)))
