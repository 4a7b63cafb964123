"""How close the implementations come to their tolerances: the numbers behind suites/tolerances.toml.

    python -m suites.margins [--config NAME] [--tier T] [--seeds N] [--ops a,b] [--json FILE]

For every cell of the config's grid (and its off-grid cells), over several seeds, and every output and in-place
tensor judged by a numeric (non-exact) entry, it reports the worst:
- use: the largest |out - ref| / (atol + rtol |ref|) once the entry's unmatched share is set aside (1.0 = at the
  tolerance; the tolerance holds while this stays below 1);
- max_abs: the largest error, against the entry's max_abs;
- outside: the share of elements beyond atol + rtol |ref| (the entry allows 1 - matched_fraction); for an entry
  that counts another unit (matched_unit, e.g. MLA's heads), the share of such units with any element beyond, and
  `use` then sets aside the worst units the entry lets off (unmatched_units, or 1 - matched_fraction of them);
- rel_rms: rms(out - ref) / rms(ref), the summary the stock tests print.
A new entry's numbers come from this table with headroom, and its reason says how much.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from harness.config.loader import load_config
from harness.numerics.compare import ToleranceTable
from harness.stages.numerics import NumericsStage
from suites.k3.suite import K3Suite


@dataclass
class Margin:
    op: str
    output: str
    use: float = 0.0
    max_abs: float = 0.0
    max_abs_limit: float = 0.0
    outside: float = 0.0
    allowed_outside: float = 0.0
    rel_rms: float = 0.0
    ref_peak: float = 0.0
    samples: int = 0
    worst_cell: str = ""
    unit: str = "element"  # what `outside` and the set-aside share count (the entry's matched_unit)


def measure(config_name: str, tier: str | None, seeds: int, ops: set[str], per_op: int = 0) -> list[Margin]:
    config = load_config(config_name)
    if tier:
        config = replace(config, tier=tier)
    suite = K3Suite(config.subject, config.data["model"])
    device = torch.device("cuda" if config.hardware["gpu"] != "none" else "cpu")
    table = ToleranceTable.load()
    impl = suite.implementations(device)[0]
    margins: dict[tuple[str, str], Margin] = {}
    taken: dict[str, int] = {}
    for case in suite.cells(config, random.Random(NumericsStage.seed)):
        spec = case.spec
        if (ops and spec.op not in ops) or (per_op and taken.get(spec.op, 0) >= per_op):
            continue
        taken[spec.op] = taken.get(spec.op, 0) + 1
        start = time.monotonic()
        for seed in range(seeds):
            call = case.make(seed, device)
            ref = case.reference(call.clone())
            got = dict(impl.ops[spec.op](call))
            got |= {name: call.tensors[name] for name in spec.inplace}
            for name, out in got.items():
                tol = table.get(spec.tolerance_of(name), spec.dtype_of(name))
                if tol.exact:
                    continue
                e_all = ref[name].double().cpu()
                keep = torch.isfinite(e_all)
                err_all = torch.where(keep, (out.double().cpu() - e_all).abs(), torch.zeros_like(e_all))
                err, e = err_all[keep], e_all[keep]
                limit = tol.atol + tol.rtol * e.abs()
                ratio = err / limit
                if tol.matched_unit != "element":
                    # As the judge counts (harness.numerics.compare): a unit's ratio is its worst element's.
                    size = case.unit_size(name, tol.matched_unit)
                    if size is None:
                        raise ValueError(f"{case.id}: the case defines no {tol.matched_unit!r} for {name!r}")
                    per_element = torch.zeros_like(err_all)
                    per_element[keep] = ratio
                    ratio = per_element.reshape(-1, size).amax(dim=-1)[keep.reshape(-1, size).any(dim=-1)]
                ratio = ratio.flatten().sort().values if ratio.numel() else torch.zeros(1)
                # The most units the judge lets off: (n - k) / n >= matched_fraction, or unmatched_units of them.
                skip = max(tol.unmatched_units, int((1 - tol.matched_fraction) * ratio.numel() + 1e-9))
                m = margins.setdefault((spec.op, name), Margin(spec.op, name, unit=tol.matched_unit))
                use = float(ratio[-1 - skip]) if ratio.numel() > skip else 0.0
                if use > m.use:
                    m.use, m.worst_cell = use, f"{case.id} seed {seed}"
                m.max_abs = max(m.max_abs, float(err.max()) if err.numel() else 0.0)
                m.max_abs_limit, m.allowed_outside = tol.max_abs, 1 - tol.matched_fraction
                m.outside = max(m.outside, float((ratio > 1).double().mean()) if err.numel() else 0.0)
                rms = float(e.square().mean().sqrt()) if e.numel() else 0.0
                m.rel_rms = max(m.rel_rms, float(err.square().mean().sqrt()) / rms if rms else 0.0)
                m.ref_peak = max(m.ref_peak, float(e.abs().max()) if e.numel() else 0.0)
                m.samples += 1
        print(f"  {case.id}: {time.monotonic() - start:.1f} s", flush=True)  # a run cut short still shows progress
    return list(margins.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.margins", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu-smoke")
    p.add_argument("--tier", default=None, help="override the config's tier (standard: the whole grid)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--ops", default="", help="comma-separated ops (default: all)")
    p.add_argument("--per-op", type=int, default=0, help="at most this many cells per op (default: all)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    start = time.monotonic()
    rows = measure(args.config, args.tier, args.seeds, {o for o in args.ops.split(",") if o}, args.per_op)
    for m in rows:
        print(
            f"{m.op:16s} {m.output:8s} use {m.use:5.3f}  max_abs {m.max_abs:.3e} / {m.max_abs_limit:.3e}  "
            f"outside {m.outside:.2e} / {m.allowed_outside:.0e} of {m.unit}s  rel_rms {m.rel_rms:.2e}  "
            f"peak {m.ref_peak:.3g}  "
            f"n {m.samples}  worst {m.worst_cell}"
        )
    if args.json:
        env = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
        }
        args.json.write_text(
            json.dumps({"config": args.config, "env": env, "margins": [asdict(m) for m in rows]}, indent=1)
        )
    print(f"{len(rows)} outputs in {time.monotonic() - start:.1f} s")
    return 0 if all(m.use < 1 and m.max_abs <= m.max_abs_limit for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
