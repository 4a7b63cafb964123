"""Every attention-side Triton kernel compiles for sm_90 (H200) on the CPU, with the exact launch configuration its
launcher uses at real K3 TP8 shapes, spills at most a few registers, and has no butterfly reduction step contracted
into an FMA (lanes with different sums racing for one shared-memory word: harness/ptx_lint.py).

The launchers run on meta tensors with the kernel replaced by a recorder, so the constexprs, dtypes and warp
counts compiled here are the ones a GPU run would use. Triton compiles ahead of time for a target without a GPU
(ASTSource + GPUTarget) and its bundled cuobjdump reports registers and local memory (spills) per kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from harness.ptx_lint import contracted_butterflies
from k3_decode.config import K3

triton = pytest.importorskip("triton", reason="Triton compiles the kernels")
pytestmark = pytest.mark.slow

TP8 = K3.shard(8)
DTYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.uint8: "*u8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
MAX_REGISTERS = 255
# A few registers spilled to the stack stay in L1 and cost little; a larger stack means a tile does not fit.
MAX_SPILL_BYTES = 64


@dataclass
class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    kernel: object
    calls: list[tuple[tuple, dict]] = field(default_factory=list)

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


def compile_recorded(kernel, args: tuple, kwargs: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = {p.name: p for p in kernel.params}
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    constexprs = {n: v for n, v in values.items() if params[n].is_constexpr}
    signature = {n: "constexpr" if n in constexprs else _arg_type(values[n]) for n in names}
    options = {k: v for k, v in kwargs.items() if k not in params}
    attrs = _divisibility(names, values, constexprs)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _divisibility(names: list[str], values: dict, constexprs: dict) -> dict:
    """The `tt.divisibility` hints Triton's launcher derives at run time: a pointer whose address and an integer
    whose value is a multiple of 16 (meta tensors sit at address 0). Without them the compiler cannot prove
    alignment and splits vector loads into bytes, so the SASS checked here would not be the SASS a GPU runs."""
    attrs = {}
    for i, name in enumerate(names):
        value = values.get(name)
        if name in constexprs:
            continue
        aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0
        )
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resource_usage(compiled) -> tuple[int, int]:
    """(registers, stack + local bytes) of the compiled cubin, read with Triton's bundled cuobjdump; register
    spills show up in the stack frame."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("Triton's bundled cuobjdump is missing")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", out)
    assert match, out
    return int(match.group(1)), int(match.group(2)) + int(match.group(3))


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _attn_res(module) -> None:
    hidden = K3.hidden_size
    variants = (  # (delta dtype, output norm, saved block, restart, bank blocks read): K3's kinds of site
        (None, True, 0, False, 0),
        (torch.float32, True, None, False, 2),
        (torch.bfloat16, True, None, True, 4),
        (torch.bfloat16, False, None, False, 8),
    )
    for delta, out_norm, save, restart, blocks in variants:
        module.launch_attn_res(
            meta(64, hidden),
            None if delta is None else meta(64, hidden, dtype=delta),
            meta(64, 8, hidden),
            meta(64, hidden),
            meta(64, 2, hidden, dtype=torch.float32),
            meta(hidden),
            meta(hidden),
            meta(hidden) if out_norm else None,
            num_blocks=blocks,
            save_index=save,
            restart=restart,
            eps=1e-5,
        )


def _kda_decode(module) -> None:
    heads, proj, d = TP8.kda_heads, TP8.kda_proj, K3.kda.head_dim
    module.launch_kda_decode(
        meta(64, TP8.kda_in_proj_rows),
        meta(64, proj),
        meta(65, 3 * proj, 3),
        meta(3 * proj, 4),
        meta(heads, dtype=torch.float32),
        meta(proj, dtype=torch.float32),
        meta(d),
        meta(65, heads, d, d, dtype=torch.float32),
        meta(64, dtype=torch.int64),
        meta(64, proj),
        heads=heads,
        head_dim=d,
        beta_offset=4 * proj + K3.kda.gate_rank,
        lower_bound=-5.0,
        l2_eps=1e-6,
        norm_eps=1e-5,
    )


def _kda_verify(module) -> None:
    heads, proj, d, q = TP8.kda_heads, TP8.kda_proj, K3.kda.head_dim, 8
    slots = meta(64, q, dtype=torch.int64)
    module.launch_verify_conv(
        meta(64 * q, TP8.kda_in_proj_rows),
        meta(600, 3 * proj, 3 + q - 1),
        meta(3 * proj, 4),
        slots,
        meta(64, dtype=torch.int64),
        meta(3, 64 * q, proj),
        meta(64 * q, heads),
        meta(64, q, dtype=torch.int32),
        meta(64, dtype=torch.int32),
        heads=heads,
        proj=proj,
        beta_offset=4 * proj + K3.kda.gate_rank,
    )
    module.launch_state_scatter(meta(64 * q, heads, d, d, dtype=torch.float32), meta(600, heads, d, d), slots)
    module.launch_gated_norm(
        meta(64 * q, heads, d),
        meta(64 * q, TP8.kda_in_proj_rows),
        slots,
        meta(d),
        meta(64 * q, proj),
        heads=heads,
        head_dim=d,
        gate_offset=3 * proj,
        eps=1e-5,
    )


def _mla(module) -> None:
    mla, heads = K3.mla, TP8.mla_heads
    module.launch_qkv_norm(
        meta(64, TP8.mla_qkv_a_g_rows), meta(mla.q_lora_rank), meta(mla.kv_lora_rank),
        meta(64, mla.q_lora_rank), meta(64, mla.kv_lora_rank), eps=1e-5,
    )  # fmt: skip
    module.launch_query_insert(
        meta(heads, 64, mla.kv_lora_rank),
        meta(64, heads * mla.qk_head_dim),
        meta(64, mla.kv_lora_rank),
        meta(64, TP8.mla_qkv_a_g_rows),
        meta(64, dtype=torch.int64),
        meta(64, heads, mla.cache_row, dtype=torch.uint8),
        meta(4096, 64, mla.cache_row, dtype=torch.uint8),
        nope=mla.qk_nope_head_dim,
        k_pe_offset=mla.q_lora_rank + mla.kv_lora_rank,
        q_scale=1.0,
        k_scale=1.0,
    )
    module.launch_sigmoid_gate(meta(heads, 64, mla.v_head_dim), meta(64, heads * mla.v_head_dim), meta(64, 1536))


def _mla_attention(module) -> None:
    mla, heads = K3.mla, TP8.mla_heads
    part_out = meta(64, 64, heads, mla.kv_lora_rank, dtype=torch.float32)
    part_lse = meta(64, 64, heads, dtype=torch.float32)
    module.launch_split_kv(
        meta(64, heads, mla.cache_row, dtype=torch.uint8),
        meta(4096, 64, mla.cache_row, dtype=torch.uint8),
        meta(64, 64, dtype=torch.int32),
        meta(64, dtype=torch.int32),
        part_out,
        part_lse,
        kv_lora_rank=mla.kv_lora_rank,
        score_scale=0.1,
        value_scale=1.0,
    )
    module.launch_merge(part_out, part_lse, meta(heads, 64, mla.kv_lora_rank))


CASES = {
    "attn_res": ("attn_res", ("attn_res_kernel",), _attn_res),
    "kda_decode": ("kda_decode", ("kda_decode_kernel",), _kda_decode),
    "kda_verify": ("kda_verify", ("verify_conv_kernel", "state_scatter_kernel", "gated_norm_kernel"), _kda_verify),
    "mla": ("mla", ("qkv_norm_kernel", "query_insert_kernel", "sigmoid_gate_kernel"), _mla),
    "mla_attention": ("mla_attention", ("split_kv_kernel", "merge_kernel"), _mla_attention),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_compile_for_sm90_without_large_spills(case: str, monkeypatch):
    import importlib

    module_name, kernels, launch = CASES[case]
    module = importlib.import_module(f"k3_decode.stock.triton_kernels.{module_name}")
    recorders = {name: Recorder(getattr(module, name)) for name in kernels}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    launch(module)
    for name, recorder in recorders.items():
        assert recorder.calls, f"{name} was never launched"
        for args, kwargs in recorder.calls:
            compiled = compile_recorded(recorder.kernel, args, kwargs)
            registers, spilled = resource_usage(compiled)
            assert spilled <= MAX_SPILL_BYTES, f"{name} spills {spilled} bytes to the stack ({registers} registers)"
            assert registers <= MAX_REGISTERS
            contracted = contracted_butterflies(compiled.asm["ptx"])
            assert not contracted, f"{name}: lane-asymmetric butterfly step at {contracted[0].describe()}"


def test_the_butterfly_lint_finds_the_race_racecheck_found(monkeypatch):
    """Red team: kda_decode_kernel as it was before the fix (FP contraction on) is flagged, at its norms' lines."""
    from k3_decode.stock.triton_kernels import kda_decode

    recorder = Recorder(kda_decode.kda_decode_kernel)
    monkeypatch.setattr(kda_decode, "kda_decode_kernel", recorder)
    _kda_decode(kda_decode)
    (args, kwargs), *_ = recorder.calls
    assert kwargs.pop("enable_fp_fusion") is False
    contracted = contracted_butterflies(compile_recorded(recorder.kernel, args, kwargs).asm["ptx"])
    assert contracted, "the lint misses the contracted sum of squares racecheck reported"
