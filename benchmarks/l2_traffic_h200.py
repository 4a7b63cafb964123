"""L2 and HBM traffic of the KDA layer's GEMM-shaped kernels on an H200, by Nsight Compute's hardware counters.

Why this exists (issue 8: "a profile that shows where the time goes"). From 32 rows the fused o_proj and the
projection's one-pass tensor-core stream are slower than their batch's bytes of weight predict, and cuBLAS is
faster there. The kernels' own design says why to expect it: every CTA of the stream reads all of x (the
projection's input, o_proj's o) from L2 for its own rows of W, so the L2-to-SM traffic is about
(1 + batch / rows per CTA) times the weight's bytes, and at B64 with 16 rows per CTA that is 5x. This script
measures it: each case runs one call of an op inside an NVTX range under `ncu`, which replays every kernel in the
range with the caches flushed and reads the counters below; the JSON holds them per case, summed over the case's
kernels (cuBLAS's split-K pair, for instance), beside the weight's and the input's bytes.

    python3 benchmarks/l2_traffic_h200.py --out benchmarks/results/l2-traffic-h200.json

Each case is a child process of this script under ncu (`--child CASE`); ncu's replays are not timings of the
decode step (its clocks are left alone, `--clock-control none`, but every kernel runs alone with cold caches), so
the duration is for comparing cases, and the CUDA-graph timings in docs/kda-layer-h200.md stay the reference.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RANGE = "k3measure"
# Counter -> the name it has in the JSON. Bytes and nanoseconds (`--print-units base`).
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "l1tex__m_xbar2l1tex_read_bytes.sum": "l2_to_sm_bytes",
    "lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum": "l2_read_hit_sectors",
    "lts__t_sectors_srcunit_tex_op_read.sum": "l2_read_sectors",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_throughput_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
}
SUMMED = {"duration_ns", "dram_read_bytes", "l2_to_sm_bytes", "l2_read_hit_sectors", "l2_read_sectors"}


@dataclass(frozen=True)
class Case:
    """One call of an op at one rank's shape: `impl` is the kernel (ours) or the stock GEMM (cuBLAS)."""

    op: str  # "o_proj" (with the AttnRes after attention when ours) or "in_proj"
    impl: str  # "fused" / "cute" (ours) or "cublas"
    tp: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.op}/{self.impl}/tp{self.tp}/b{self.batch}"


# The batches where our stream and cuBLAS part ways (providers.toml), and B1 as the weight-bound reference.
CASES = [
    *(Case("o_proj", impl, 8, b) for impl in ("fused", "cublas") for b in (1, 32, 64)),
    *(Case("in_proj", impl, 16, b) for impl in ("cute", "cublas") for b in (1, 16, 32)),
]


def case_named(name: str) -> Case:
    for case in CASES:
        if case.name == name:
            return case
    raise SystemExit(f"l2_traffic_h200.py: no case {name!r}; the cases are: {', '.join(c.name for c in CASES)}")


def shapes(case: Case) -> tuple[int, int]:
    """(weight rows, K) of the case's GEMM at its rank's shard."""
    from k3_decode.config import K3

    shard = K3.shard(case.tp)
    if case.op == "o_proj":
        return shard.kda_o_proj
    return shard.kda_in_proj_rows, K3.hidden_size


def run_child(case: Case) -> None:
    """Build the case's operands, warm it (compiles), then one call inside the NVTX range ncu profiles."""
    import torch

    from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
    from k3_decode.config import K3
    from k3_decode.kernels import kda_in_proj_op, kda_o_proj_op
    from k3_decode.reference.attn_res import MixWeights
    from k3_decode.stock import gemm

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(case.batch)
    rows, k = shapes(case)

    def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).bfloat16()

    x, w = bf16(case.batch, k), bf16(rows, k, scale=0.02)
    if case.op == "o_proj" and case.impl == "fused":
        site = AttnResSite("add", None, 1, 1)  # layer 6's kind: one bank block, the prefix added to
        buffers = AttnResBuffers.allocate(case.batch, K3.hidden_size, 8, dev)
        buffers.num_blocks = 1
        buffers.prefix.copy_(bf16(case.batch, K3.hidden_size))
        buffers.blocks.copy_(bf16(case.batch, 8, K3.hidden_size))
        mix = MixWeights(bf16(K3.hidden_size), bf16(1, K3.hidden_size, scale=0.02), bf16(K3.hidden_size))

        def call() -> None:
            kda_o_proj_op.apply(x, w, buffers, site, mix, K3.rms_norm_eps)
    elif case.impl in ("fused", "cute"):
        out = torch.empty(case.batch, rows, dtype=torch.bfloat16, device=dev)

        def call() -> None:
            kda_in_proj_op.linear(x, w, out)
    else:

        def call() -> None:
            gemm.linear(x, w)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu's `--csv --print-units base` report -> one dict per profiled kernel: its name and each metric as a float
    under its JSON name. Lines before the CSV header (ncu's own messages) are skipped."""
    start = text.find('"ID","Process ID"')
    if start < 0:
        raise ValueError("no ncu CSV report in the output (was any kernel profiled inside the NVTX range?)")
    kernels: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        metric = METRICS.get(row.get("Metric Name", ""))
        if metric is None:
            continue
        entry = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        try:
            entry[metric] = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # "n/a": the counter does not apply to this kernel; it is left out, not made 0
            continue
    if not kernels:
        raise ValueError("the ncu report holds none of the requested metrics")
    return [kernels[i] for i in sorted(kernels, key=int)]


def summarize(case: Case, kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's totals over its kernels, with the bytes its operands hold and the traffic per weight byte."""
    rows, k = shapes(case)
    weight, x = rows * k * 2, case.batch * k * 2
    total: dict[str, Any] = {m: sum(kern.get(m, 0.0) for kern in kernels) for m in SUMMED}
    for pct in set(METRICS.values()) - SUMMED:
        total[pct] = max(kern.get(pct, 0.0) for kern in kernels)  # of the busiest kernel
    sectors = total["l2_read_sectors"]
    return {
        **asdict(case),
        "case": case.name,
        "kernels": [kern["kernel"][:120] for kern in kernels],
        "weight_bytes": weight,
        "input_bytes": x,
        **total,
        "l2_to_sm_per_weight_byte": total["l2_to_sm_bytes"] / weight,
        "l2_read_hit_rate": total["l2_read_hit_sectors"] / sectors if sectors else None,
        "duration_us": total["duration_ns"] / 1e3,
        "l2_to_sm_tb_per_s": total["l2_to_sm_bytes"] / total["duration_ns"] / 1e3 if total["duration_ns"] else None,
    }


def ncu_binary() -> str | None:
    return shutil.which("ncu") or next(
        (str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu")) if p.exists()), None
    )


def profile(case: Case, ncu: str, timeout: float) -> dict[str, Any]:
    command = [
        ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--cache-control", "all",
        "--nvtx", "--nvtx-include", f"{RANGE}/", "--metrics", ",".join(METRICS),
        sys.executable, str(Path(__file__).resolve()), "--child", case.name,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"ncu exited {done.returncode} for {case.name}: {' | '.join(tail)}")
    return summarize(case, parse_ncu_csv(done.stdout))


def environment() -> dict[str, Any]:
    import torch

    from benchmarks.stock_h200 import commit_state

    commit, dirty = commit_state()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit, "dirty": dirty}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", help="where to write the JSON results")
    ap.add_argument("--cases", nargs="+", metavar="CASE", help="case names (default: all)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case under ncu")
    ap.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)  # one case's call, under ncu
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        run_child(case_named(args.child))
        return 0
    if not args.out:
        parser().error("--out is required")
    cases = [case_named(n) for n in args.cases] if args.cases else CASES
    import torch

    if not torch.cuda.is_available():
        print("l2_traffic_h200.py: no CUDA device here; run it on the GPU machine (an H200)", file=sys.stderr)
        return 2
    ncu = ncu_binary()
    if ncu is None:
        print("l2_traffic_h200.py: Nsight Compute (ncu) is not on PATH; install it or put it there", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results, failures = [], []
    for case in cases:
        try:
            results.append(profile(case, ncu, args.timeout))
            r = results[-1]
            print(
                f"{case.name}: {r['duration_us']:.1f} us, L2->SM {r['l2_to_sm_bytes'] / 1e6:.1f} MB "
                f"({r['l2_to_sm_per_weight_byte']:.2f}x the weight), HBM read {r['dram_read_bytes'] / 1e6:.1f} MB"
            )
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            failures.append({"case": case.name, "error": str(exc)})
            print(f"{case.name}: FAILED: {exc}", file=sys.stderr)
    out = {
        "benchmark": "L2 and HBM traffic of the KDA layer's GEMM-shaped kernels under Nsight Compute (issue 8)",
        "env": environment(),
        "metrics": METRICS,
        "notes": [
            "one call per case inside an NVTX range; ncu replays each kernel with the caches flushed",
            "sums over the case's kernels; *_pct: the busiest kernel's",
            "l2_to_sm_per_weight_byte: L2-to-SM read bytes over the weight's bytes (1.0: every weight byte once)",
        ],
        "cases": results,
        "failures": failures,
        "wall_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({len(results)} cases, {len(failures)} failed)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
