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
    """The split kernel at TP8 and TP16 with pages of 64 (vLLM's FlashMLA block size, two per tile) and 16 (eight
    per tile), and the merge at the B1, B8 and B64 grids of the split policy."""
    mla = K3.mla
    for tp, page_size in ((8, 64), (16, 64), (8, 16)):
        heads = K3.shard(tp).mla_heads
        part_out = meta(64, 2, heads, mla.kv_lora_rank, dtype=torch.float32)
        module.launch_split_kv(
            meta(64, heads, mla.cache_row, dtype=torch.uint8),
            meta(4096, page_size, mla.cache_row, dtype=torch.uint8),
            meta(64, 64, dtype=torch.int32),
            meta(64, dtype=torch.int32),
            part_out,
            meta(64, 2, heads, dtype=torch.float32),
            kv_lora_rank=mla.kv_lora_rank,
            score_scale=0.1,
            value_scale=1.0,
        )
    for batch, splits in ((1, 32), (8, 16), (64, 2)):
        part_out = meta(batch, splits, TP8.mla_heads, mla.kv_lora_rank, dtype=torch.float32)
        part_lse = meta(batch, splits, TP8.mla_heads, dtype=torch.float32)
        module.launch_merge(part_out, part_lse, meta(TP8.mla_heads, batch, mla.kv_lora_rank))


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


# --- MLA split-KV: the SASS the H200 runs -------------------------------------------------------------------------

SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);", re.M)
H100_SHARED_PER_SM = 228 * 1024  # bytes of shared memory per SM (sm_90), 1 KiB of it reserved per CTA
H100_REGISTERS_PER_SM = 65536


def sass_instructions(compiled) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every SASS instruction of the cubin (Triton's bundled cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("Triton's bundled cuobjdump is missing")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(out)]


def innermost_loop_with(instructions: list[tuple[int, str, str]], opcode: str) -> list[tuple[int, str, str]]:
    """The body of the smallest backward-branch loop that contains `opcode`."""
    loops = []
    for addr, op, rest in instructions:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [i for i in instructions if int(target.group(1), 16) <= i[0] <= addr]
            if any(op_.startswith(opcode) for _, op_, _ in body):
                loops.append(body)
    assert loops, f"no loop contains {opcode}"
    return min(loops, key=len)


def _recorded_mla_attention(monkeypatch, name: str) -> Recorder:
    from k3_decode.stock.triton_kernels import mla_attention as module

    recorders = {kernel: Recorder(getattr(module, kernel)) for kernel in ("split_kv_kernel", "merge_kernel")}
    for kernel, recorder in recorders.items():
        monkeypatch.setattr(module, kernel, recorder)
    _mla_attention(module)
    assert recorders[name].calls, f"{name} was never launched"
    return recorders[name]


def test_mla_split_kv_streams_rows_into_wgmma_with_one_conversion_per_byte(monkeypatch):
    """At every K3 build (TP8/TP16, pages of 64 and 16): at most a few spilled registers and no more than 8
    local-memory accesses per tile (Triton 3.6, the H200's: none; 3.9: 24-32 bytes, 6-7 accesses per 128
    positions); one CTA per SM, as choose_num_splits assumes;
    in the tile loop, 16-byte row loads, each cache byte converted FP8 -> FP16 exactly once, 16-byte stores of
    the converted tile, both dots as wgmma m64n16k16 over shared memory (the value dot on the transposed tile),
    no byte-gathered operand loads (what a dot on the FP8 tile in registers compiles to), and at most 1600 SASS
    instructions per warp per 128-position tile (~1250 on Triton 3.6: about half of the tile's HBM time)."""
    from k3_decode.stock import mla as sm
    from k3_decode.stock.triton_kernels import mla_attention as ka

    recorder = _recorded_mla_attention(monkeypatch, "split_kv_kernel")
    threads = 32 * ka.NUM_WARPS
    row = K3.mla.cache_row
    for args, kwargs in recorder.calls:
        what = f"split_kv_kernel PAGE={kwargs['PAGE']} heads={args[7]}"
        compiled = compile_recorded(recorder.kernel, args, kwargs)
        registers, spilled = resource_usage(compiled)
        assert spilled <= MAX_SPILL_BYTES, f"{what}: {spilled} bytes spilled ({registers} registers)"
        per_sm = min(
            H100_SHARED_PER_SM // (compiled.metadata.shared + 1024),
            H100_REGISTERS_PER_SM // (-(-registers // 8) * 8 * threads),
        )
        assert per_sm == 1, f"{what}: {per_sm} CTAs per SM; choose_num_splits sizes one wave of one CTA per SM"
        assert kwargs["BLOCK_N"] == sm.POSITIONS_PER_TILE and kwargs["BLOCK_H"] == sm.HEADS_PER_PROGRAM
        loop = innermost_loop_with(sass_instructions(compiled), "HGMMA")
        ops = [op for _, op, _ in loop]
        count = {key: sum(1 for op in ops if op.startswith(key)) for key in ("LDG.E.128", "F2FP.F16.E4M3", "STS.128")}
        vectors = ka.BLOCK_N * row // (16 * threads)  # 16-byte pieces of one tile per thread
        assert count["LDG.E.128"] == vectors, f"{what}: {count['LDG.E.128']} 16-byte row loads, expected {vectors}"
        assert count["F2FP.F16.E4M3"] == ka.BLOCK_N * row // (2 * threads), f"{what}: {count} conversions"
        assert 2 * vectors <= count["STS.128"] <= 2 * vectors + 4, f"{what}: {count['STS.128']} 16-byte stores"
        local = [op for op in ops if op.startswith(("LDL", "STL"))]
        assert len(local) <= 8, f"{what}: {len(local)} local-memory accesses per tile (spills in the loop)"
        wgmma = [(op, rest) for _, op, rest in loop if op.startswith("HGMMA")]
        assert all(op == "HGMMA.64x16x16.F32" and "gdesc" in rest for op, rest in wgmma), f"{what}: {set(wgmma)}"
        # per warpgroup: the score dot's K steps, then the value dot's 64-row blocks of its share of the latent
        k_steps = row // 16 + K3.mla.kv_lora_rank // 64 // (ka.NUM_WARPS // 4) * (ka.BLOCK_N // 16)
        assert len(wgmma) == k_steps, f"{what}: {len(wgmma)} wgmma per warpgroup, expected {k_steps}"
        assert sum("tnspA" in rest for _, rest in wgmma) > 0, f"{what}: the value dot must read the tile transposed"
        gathers = [op for op in ops if op.startswith(("LDS.U8", "LDS.U16", "LDS.S8", "LDS.S16", "PRMT"))]
        assert not gathers, f"{what}: byte-gathered operand loads in the tile loop: {sorted(set(gathers))}"
        assert len(loop) <= 1600, f"{what}: {len(loop)} SASS instructions per warp per tile"
        print(
            f"{what}: {registers} registers, {spilled} B spilled ({len(local)} accesses per tile), "
            f"{compiled.metadata.shared} B shared, {len(loop)} instructions per warp per tile"
        )


def test_mla_merge_loads_whole_vectors(monkeypatch):
    recorder = _recorded_mla_attention(monkeypatch, "merge_kernel")
    for args, kwargs in recorder.calls:
        compiled = compile_recorded(recorder.kernel, args, kwargs)
        registers, spilled = resource_usage(compiled)
        assert spilled == 0 and registers <= 128, f"merge {kwargs}: {registers} registers, {spilled} B spilled"
        ops = [op for _, op, _ in sass_instructions(compiled)]
        assert any(op.startswith("LDG.E.128") for op in ops), f"merge {kwargs}: no 16-byte partial loads"
        assert not any(op.startswith("ATOM") or op.startswith("RED") for op in ops), "the merge must not use atomics"
