"""What runs inside compute-sanitizer: one cell per planned kernel, once.

`python -m suites.sanitize_child --report FILE [--cells op,op] [--redteam]`. A stock cell is a numerics cell run
through the stock path; every Triton launch is recorded by name through Triton's launch hook, per cell. A CuTe DSL
cell calls its op (k3_decode/kernels/*_op.py) directly on small deterministic inputs built here; Triton's hook
cannot see those kernels, so the cell reads the kernel's device-side launch counter before and after, and records
the kernel's pattern as launched when the counter moved (and raises unless it moved by exactly the launches the cell
made). Either way the runner can tell a kernel that ran clean from one that never ran. Where the CuTe DSL kernels
cannot run (`k3_decode.kernels.providers.not_built_reason()`), their cells are recorded as not run with that reason
and the stock cells still run. Markers on stdout (`K3SAN-BEGIN op` / `K3SAN-END op`, `K3SAN-NOT-RUN op: reason`)
bracket each cell in the sanitizer's log. A cell that raises is recorded and the next one still runs (after a
device fault they will fail too, and say so).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from suites import sanitize_redteam
from suites.sanitize import Cell, Plan, load_plan

MARK_BEGIN = "K3SAN-BEGIN"
MARK_END = "K3SAN-END"
MARK_NOT_RUN = "K3SAN-NOT-RUN"


def _install_launch_hook(record: Callable[[str], None]) -> None:
    """Call `record(kernel name)` at every Triton launch (Triton >= 3.4 keeps a hook chain; older a single hook)."""
    from triton import knobs

    def hook(metadata: Any) -> None:
        data = metadata.get() if hasattr(metadata, "get") else metadata
        record(str(data["name"]))

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        previous = chain

        def both(metadata: Any) -> None:
            if previous is not None:
                previous(metadata)
            hook(metadata)

        knobs.runtime.launch_enter_hook = both


def _run_one(name: str, fn: Callable[[], None], launched: list[str]) -> dict[str, Any]:
    start = len(launched)
    print(f"{MARK_BEGIN} {name}", flush=True)
    try:
        fn()
        torch.cuda.synchronize()
        status, error = "ok", ""
    except Exception as exc:  # recorded for the runner, which turns it into an ERROR with this text
        status, error = "error", "".join(traceback.format_exception_only(type(exc), exc)).strip()
    print(f"{MARK_END} {name}", flush=True)
    return {"status": status, "error": error, "launched": sorted(set(launched[start:]))}


def _not_run(name: str, reason: str) -> dict[str, Any]:
    print(f"{MARK_NOT_RUN} {name}: {reason}", flush=True)
    return {"status": "not_run", "error": "", "reason": reason, "launched": []}


# --- CuTe DSL cells ----------------------------------------------------------------------------------------------


def _generator(plan: Plan, cell: Cell) -> torch.Generator:
    """A CPU generator seeded from the plan's seed and the cell's op: the same inputs on every run."""
    return torch.Generator().manual_seed(plan.seed + sum(cell.op.encode()))


def _bf16(gen: torch.Generator, device: torch.device, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Any:
    """A fresh BF16 tensor of exactly this shape on `device`: its own allocation, so an access past its end leaves
    it (memcheck runs with the caching allocator off and padding after every allocation; see sanitize.toml)."""
    return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.bfloat16).to(device)


def attn_res_cell(cell: Cell, plan: Plan, device: torch.device) -> int:
    """One AttnRes application per kind of the cell (`kinds`: AttnResKind tags of the model's own sites), each on
    fresh buffers of exactly `batches` rows and the model's bank capacity. Returns the launches made."""
    from k3_decode.config import load_dims
    from k3_decode.kernels import attn_res_op

    axes = dict(cell.axes)
    dims, batch = load_dims(plan.model), int(axes["batches"])
    gen = _generator(plan, cell)
    for tag in axes["kinds"]:
        kind, site, buffers, weights = _attn_res_site(dims, tag, batch, gen, device)
        delta = None
        if kind.delta != "none":
            dtype = torch.float32 if kind.delta_dtype == "float32" else torch.bfloat16
            delta = torch.randn(batch, dims.hidden_size, generator=gen).to(dtype).to(device)
        attn_res_op.apply(buffers, site, delta, weights, dims.rms_norm_eps)
    return len(axes["kinds"])


def _attn_res_site(dims: Any, tag: str, batch: int, gen: torch.Generator, device: torch.device) -> tuple[Any, ...]:
    """(kind, site, buffers, weights) of the model's AttnRes kind `tag` on fresh buffers of exactly `batch` rows and
    the model's bank capacity: the site reads the whole bank it finds and saves into the next block (as in the
    kernel's test)."""
    from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
    from k3_decode.kernels.attn_res_plan import AttnResKind, site_kinds
    from k3_decode.reference.attn_res import MixWeights

    kind = AttnResKind.from_tag(tag)
    if kind not in site_kinds(dims):
        raise ValueError(f"AttnRes kind {tag} is not a site of {dims.name}; pick one of its sites' kinds")
    hidden, capacity = dims.hidden_size, dims.num_attn_res_blocks
    site = AttnResSite(kind.delta, kind.num_blocks if kind.save else None, kind.num_blocks, kind.num_blocks)
    buffers = AttnResBuffers(
        _bf16(gen, device, batch, hidden), _bf16(gen, device, batch, capacity, hidden), kind.num_blocks
    )
    weights = MixWeights(
        _bf16(gen, device, hidden, scale=0.1, shift=1.0),
        _bf16(gen, device, 1, hidden, scale=0.02),
        _bf16(gen, device, hidden, scale=0.1, shift=1.0) if kind.out_norm else None,
    )
    return kind, site, buffers, weights


def kda_o_proj_cell(cell: Cell, plan: Plan, device: torch.device) -> int:
    """o_proj at the rank's shard for `tp` with the AttnRes after attention of each of `kinds` (its delta is o_proj's
    output, so the kinds must take a BF16 delta), one fused launch per kind, then the first kind at `two_row_batch`
    rows where given (the epilogue clusters take two rows each above 32) with each build, the mma.sync one and the
    wgmma one (kda_o_proj_wgmma.py). Returns the launches made."""
    from k3_decode.config import load_dims
    from k3_decode.kernels import kda_o_proj_op

    axes = dict(cell.axes)
    dims, batch = load_dims(plan.model), int(axes["batches"])
    hidden, proj = dims.shard(int(axes["tp"])).kda_o_proj
    gen = _generator(plan, cell)
    for tag in axes["kinds"]:
        kind, site, buffers, weights = _attn_res_site(dims, tag, batch, gen, device)
        if kind.delta == "none" or kind.delta_dtype != "bfloat16":
            raise ValueError(f"cell {cell.op}: kind {tag} takes no BF16 delta; o_proj's output is its delta")
        o = _bf16(gen, device, batch, proj)
        kda_o_proj_op.apply(o, _bf16(gen, device, hidden, proj, scale=0.02), buffers, site, weights, dims.rms_norm_eps)
    wide = axes.get("two_row_batch")
    if wide is None:
        return len(axes["kinds"])
    for wgmma in (False, True):
        _, site, buffers, weights = _attn_res_site(dims, axes["kinds"][0], int(wide), gen, device)
        o, w = _bf16(gen, device, int(wide), proj), _bf16(gen, device, hidden, proj, scale=0.02)
        kda_o_proj_op.apply(o, w, buffers, site, weights, dims.rms_norm_eps, wgmma=wgmma)
    return len(axes["kinds"]) + 2


def kda_in_proj_cell(cell: Cell, plan: Plan, device: torch.device) -> int:
    """x [batches, hidden] @ W[rows, hidden]^T at the rank's packed rows for `tp`, once with each build (the
    CUDA-core, tensor-core and wgmma kernels share the provider's kernel name; the wgmma one at `wgmma_batch` rows,
    its least being 9), then the tensor-core build at `ring_batch` rows where given. Returns the launches made."""
    from k3_decode.config import RankShapes, load_dims
    from k3_decode.kernels import kda_in_proj_op

    axes = dict(cell.axes)
    dims = load_dims(plan.model)
    rows = RankShapes.for_tp(dims, int(axes["tp"])).kda_in_proj_rows
    gen = _generator(plan, cell)
    w = _bf16(gen, device, rows, dims.hidden_size, scale=0.02)
    for kernel in kda_in_proj_op.KERNELS:
        batch = int(axes["wgmma_batch"] if kernel == "wgmma" else axes["batches"])
        kda_in_proj_op.linear(_bf16(gen, device, batch, dims.hidden_size), w, kernel=kernel)
    ring = axes.get("ring_batch")
    if ring is None:
        return len(kda_in_proj_op.KERNELS)
    kda_in_proj_op.linear(_bf16(gen, device, int(ring), dims.hidden_size), w, kernel="tensor_core")
    return len(kda_in_proj_op.KERNELS) + 1


def _kda_step_inputs(
    cell: Cell, plan: Plan, device: torch.device, tokens: int = 0
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """(spec, weights, packed, cache, slots, num_accepted) of a KDA step cell at the rank's shapes for `tp`: the
    decode step's (`slots`, one entry per request, into `cache_slots`; num_accepted None) or, with `tokens`, the
    verify step's (`verify_slots` [B, q] flattened, `accepted`, into `verify_cache_slots` slots of 2 + q conv
    columns). Every tensor in its own allocation, values of the magnitudes the model keeps."""
    from k3_decode.config import load_dims
    from k3_decode.reference.kda import KdaCache, KdaSpec, KdaWeights

    axes = dict(cell.axes)
    spec = KdaSpec.for_rank(load_dims(plan.model), int(axes["tp"]))
    batch = int(axes["batches"])
    q = max(tokens, 1)
    rows = list(axes["verify_slots"] if tokens else axes["slots"])
    num_slots = int(axes["verify_cache_slots"] if tokens else axes["cache_slots"])
    if len(rows) != batch * q or not all(s < num_slots for s in rows):
        raise ValueError(f"cell {cell.op}: slots {rows} must list {batch} x {q} slots below {num_slots}")
    gen = _generator(plan, cell)
    p = spec.proj
    weights = KdaWeights(
        f_b=_bf16(gen, device, p, spec.gate_rank, scale=0.05),
        conv=_bf16(gen, device, spec.conv_channels, spec.conv_width, scale=0.5),
        a_log=(torch.randn(spec.heads, generator=gen) * 0.5).to(device),
        dt_bias=(torch.randn(p, generator=gen) * 0.5).to(device),
        o_norm=_bf16(gen, device, spec.head_dim, scale=0.1, shift=1.0),
    )
    packed = _bf16(gen, device, *((batch, q) if tokens else (batch,)), spec.in_proj_rows)
    cache = KdaCache(
        _bf16(gen, device, num_slots, spec.conv_channels, spec.conv_taps(q)),
        (torch.randn(num_slots, spec.heads, spec.head_dim, spec.head_dim, generator=gen) * 0.05).to(device),
    )
    slots = torch.tensor(rows, dtype=torch.int32).view(batch, q) if tokens else torch.tensor(rows, dtype=torch.int32)
    accepted = torch.tensor(list(axes["accepted"]), dtype=torch.int32).to(device) if tokens else None
    return spec, weights, packed, cache, slots.to(device), accepted


def kda_step_cell(cell: Cell, plan: Plan, device: torch.device) -> int:
    """One fused KDA decode step (q = 1) and one verify step (`tokens` per request), each on its own cache and slot
    table. Returns the launches made."""
    from k3_decode.kernels import kda_step_op

    spec, weights, packed, cache, slots, _ = _kda_step_inputs(cell, plan, device)
    kda_step_op.decode_step(spec, weights, packed, cache, slots)
    kda_step_op.verify_step(*_kda_step_inputs(cell, plan, device, int(dict(cell.axes)["tokens"])))
    return 2


@dataclass(frozen=True)
class CuteOp:
    run: Callable[[Cell, Plan, torch.device], int]  # builds the inputs, launches, returns the launches it made
    counter: str  # the module whose launch_count() reads the kernel's device-side counter
    kernel: str  # the kernel's name in its provider's `launches` (k3_decode/kernels/providers.py)


CUTE_OPS: dict[str, CuteOp] = {
    "cute_attn_res": CuteOp(attn_res_cell, "k3_decode.kernels.attn_res_op", "AttnResKernel"),
    "cute_kda_in_proj": CuteOp(kda_in_proj_cell, "k3_decode.kernels.kda_in_proj_op", "KdaInProjKernel"),
    "cute_kda_step": CuteOp(kda_step_cell, "k3_decode.kernels.kda_step_op", "KdaStepKernel"),
    "cute_kda_o_proj": CuteOp(kda_o_proj_cell, "k3_decode.kernels.kda_o_proj_op", "KdaOProjKernel"),
}


def cute_runner(cell: Cell, plan: Plan, device: torch.device, launched: list[str]) -> Callable[[], None]:
    """The cell's body: run the op and record its kernel pattern as launched if the device counter moved."""

    def run() -> None:
        op = CUTE_OPS.get(cell.op)
        if op is None:
            raise ValueError(f"no CuTe DSL cell {cell.op!r} in suites/sanitize_child.py; known: {sorted(CUTE_OPS)}")
        (pattern,) = cell.patterns  # load_plan: a CuTe DSL cell names exactly one kernel
        if pattern != op.kernel:
            raise ValueError(f"cell {cell.op} names {pattern!r}, but its op launches {op.kernel!r}")
        count: Callable[[], int] = importlib.import_module(op.counter).launch_count
        before = count()
        made = 0
        try:
            made = op.run(cell, plan, device)
        finally:
            seen = count() - before  # synchronizes: every launch of the cell has finished and counted
            if seen > 0:
                launched.append(pattern)
        if seen != made:
            raise RuntimeError(f"the device counter of {pattern} moved by {seen}; the cell launched it {made} time(s)")

    return run


CUTE_REDTEAM = "cute_attn_res_oob"
CUTE_REDTEAM_KERNEL = "AttnResKernel"


def cute_redteam(plan: Plan, device: torch.device) -> None:
    """The CuTe DSL red team (tests/suites/test_sanitize_cute.py runs it under memcheck on an H200): the AttnRes
    kernel of the plan's saving kind told to save into block `capacity`, one past the bank. The launcher is called
    without the op's checks (which refuse that index), so the last row's block is written past the end of the bank's
    allocation, into the padding memcheck puts after it. If memcheck says nothing about it, a clean memcheck of the
    CuTe DSL kernels proves nothing. Never run it outside the sanitizer: it writes past an allocation."""
    import cutlass.cute as cute

    from k3_decode.config import load_dims
    from k3_decode.kernels import attn_res_op
    from k3_decode.kernels.attn_res import AttnResKernel, compile_args
    from k3_decode.kernels.attn_res_plan import AttnResKind

    (cell,) = [c for c in plan.cells if c.op == "cute_attn_res"]
    kind = next(k for k in map(AttnResKind.from_tag, dict(cell.axes)["kinds"]) if k.save and k.delta == "add")
    dims, batch = load_dims(plan.model), int(dict(cell.axes)["batches"])
    hidden, capacity = dims.hidden_size, dims.num_attn_res_blocks
    gen = _generator(plan, cell)
    prefix, bank = _bf16(gen, device, batch, hidden), _bf16(gen, device, batch, capacity, hidden)
    delta, out = _bf16(gen, device, batch, hidden), torch.empty(batch, hidden, dtype=torch.bfloat16, device=device)
    norm, proj = _bf16(gen, device, hidden, scale=0.1, shift=1.0), _bf16(gen, device, hidden, scale=0.02)
    compiled = cute.compile(AttnResKernel(hidden, kind), *compile_args(hidden, kind, batch, capacity))
    stream = torch.cuda.current_stream(device).cuda_stream
    out_norm = norm if kind.out_norm else None
    tensors = (prefix, delta, bank, out, norm, proj, out_norm, attn_res_op.launch_counter(device))
    attn_res_op.launch(compiled, tensors, capacity, dims.rms_norm_eps, stream)  # save_index = capacity: the bug


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.sanitize_child")
    p.add_argument("--report", required=True, type=Path)
    p.add_argument("--cells", default="", help="comma-separated ops of the plan (default: all)")
    p.add_argument("--redteam", action="store_true", help="run only the deliberately out-of-bounds kernel")
    p.add_argument("--redteam-cute", action="store_true", help="run only the out-of-bounds CuTe DSL launch")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    launched: list[str] = []
    _install_launch_hook(launched.append)
    results: dict[str, Any] = {}
    not_run: dict[str, str] = {}
    if args.redteam:
        results[sanitize_redteam.NAME] = _run_one(sanitize_redteam.NAME, lambda: sanitize_redteam.run(device), launched)
    elif args.redteam_cute:
        from k3_decode.kernels import attn_res_op

        plan = load_plan()

        def red() -> None:
            before = attn_res_op.launch_count()
            try:
                cute_redteam(plan, device)
            finally:
                if attn_res_op.launch_count() > before:
                    launched.append(CUTE_REDTEAM_KERNEL)

        results[CUTE_REDTEAM] = _run_one(CUTE_REDTEAM, red, launched)
    else:
        from k3_decode.kernels.providers import not_built_reason

        plan = load_plan()
        wanted = [c for c in args.cells.split(",") if c]
        cells = [c for c in plan.cells if not wanted or c.op in wanted]
        cute_reason = not_built_reason()
        stock: tuple[Any, dict[str, Any]] | None = None  # (suite, its stock ops), built for the first stock cell
        for cell in cells:
            if cell.runner == "cute":
                if cute_reason is not None:
                    results[cell.op] = _not_run(cell.op, cute_reason)
                    not_run |= dict.fromkeys(cell.names, cute_reason)
                else:
                    results[cell.op] = _run_one(cell.op, cute_runner(cell, plan, device, launched), launched)
                continue
            if stock is None:
                from suites.k3.suite import K3Suite

                suite = K3Suite("k3-hopper", plan.model)
                stock = suite, suite.implementations(device)[0].ops
            case = stock[0].case(cell.op, dict(cell.axes))

            def run(case: Any = case, op: str = cell.op, ops: dict[str, Any] = stock[1]) -> None:
                ops[op](case.make(plan.seed, device))

            results[cell.op] = _run_one(cell.op, run, launched)
    report = {"cells": results, "launched": sorted(set(launched)), "not_run": not_run}
    args.report.write_text(json.dumps(report, indent=1))
    return 0 if all(r["status"] in ("ok", "not_run") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
