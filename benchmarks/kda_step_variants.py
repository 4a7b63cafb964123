"""The fused KDA step's variants per call, from the GPU timing test's results file: a table for the docs, and the
kda_step_choice.toml rules that the measurement supports.

`tests/k3_decode/kernels/test_kda_step_gpu.py::test_the_plan_picks_a_cluster_within_ten_percent_of_the_fastest`
times every cluster, register budget, warming and request group side by side at each batch and, with
K3_STEP_CLUSTER_RESULTS set, adds one row per (TP, batch) to a JSON file through `append_rows`. A file holds one
run: one commit on one GPU kind, so its `env` is true of every row (a second call of the same run, the other TP,
appends; a different commit or GPU is refused with the fix).

    python3 benchmarks/kda_step_variants.py --table benchmarks/results/kda-step-clusters-h200.json
    python3 benchmarks/kda_step_variants.py --rules benchmarks/results/kda-step-clusters-h200.json [--margin 0.05]

`--rules` prints the rules to paste into kda_step_choice.toml: at each measured batch, the fastest variant at the
plan's own cluster (the file chooses the budget, the warming and the group; the cluster is KdaStepPlan.for_shape's
rule) where it beats the served variant by more than the margin, merged over neighbouring measured batches that
agree. A variant faster at another cluster is reported beside them: that is the cluster rule's to change, in code.
The figures are per call; the layer benchmark (kda_layer_h200.py) decides whether a rule is served.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WHAT = "KDA decode step per call by variant (tests/k3_decode/kernels/test_kda_step_gpu.py)"
RUN_KEYS = ("gpu", "commit", "dirty")  # what makes two calls one run
DEFAULT_MARGIN = 0.05  # below this a per-call difference is within what two timings of one variant differ by
# Variants this close to the fastest are a tie: the rule serves the one with the fewest extras (no warming, one request
# per cluster), since an extra that buys nothing measurable still costs L2 traffic or shared memory in the layer.
TIE = 0.01
_LABEL = re.compile(r"^c(?P<cluster>\d+)(?:/t(?P<threads>\d+))?(?P<warm>/warm)?(?:/r(?P<group>\d+))?$")


class ResultsError(ValueError):
    """A results file that cannot be read or appended to; the message names the file and the fix."""


@dataclass(frozen=True)
class Variant:
    cluster: int
    resident_threads: int
    warm_ahead: bool
    requests_per_cta: int

    @classmethod
    def parse(cls, label: str) -> Variant:
        """A label as the timing test writes it: c<cluster> and KdaStepPlan.variant_suffix (/t1536, /warm, /r2)."""
        from k3_decode.kernels.kda_step_plan import RESIDENT_THREADS

        m = _LABEL.match(label)
        if m is None:
            raise ResultsError(f"variant label {label!r} is not c<cluster>[/t<threads>][/warm][/r<requests>]")
        threads = int(m["threads"]) if m["threads"] else RESIDENT_THREADS
        return cls(int(m["cluster"]), threads, bool(m["warm"]), int(m["group"]) if m["group"] else 1)

    def choice(self) -> dict[str, Any]:
        """The knobs kda_step_choice.toml sets (everything but the cluster)."""
        knobs: dict[str, Any] = {"resident_threads": self.resident_threads, "warm_ahead": self.warm_ahead}
        if self.requests_per_cta > 1:
            knobs["requests_per_cta"] = self.requests_per_cta
        return knobs

    @property
    def extras(self) -> tuple[bool, bool]:
        """What a tie is broken on: the warming, then the request groups (False sorts first)."""
        return (self.warm_ahead, self.requests_per_cta > 1)

    @property
    def order(self) -> tuple[int, int, int, bool]:
        """Table columns: the largest cluster first, then the budget, the group and the warming."""
        return (-self.cluster, self.resident_threads, self.requests_per_cta, self.warm_ahead)


@dataclass(frozen=True)
class Cell:
    tp: int
    batch: int
    plan: str
    us: dict[str, float]
    bytes: int

    @property
    def fastest(self) -> str:
        return min(self.us, key=self.us.__getitem__)

    @classmethod
    def of(cls, row: dict[str, Any], where: str) -> Cell:
        """A row of either format: the current one (labels), or 30aac8f's clusters-only one (`plan_cluster`, times
        keyed by the cluster)."""
        try:
            if "plan_cluster" in row:
                us = {f"c{k}": float(v) for k, v in row["us"].items()}
                return cls(int(row["tp"]), int(row["batch"]), f"c{row['plan_cluster']}", us, int(row["bytes"]))
            us = {str(k): float(v) for k, v in row["us"].items()}
            cell = cls(int(row["tp"]), int(row["batch"]), str(row["plan"]), us, int(row["bytes"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ResultsError(f"{where}: not a timing row ({exc!r}); rows come from the GPU timing test") from exc
        if cell.plan not in cell.us:
            raise ResultsError(f"{where}: the served variant {cell.plan} has no time")
        return cell


def load(path: Path) -> tuple[dict[str, Any], list[Cell]]:
    """(env, cells) of a results file; a missing or malformed file is a ResultsError naming it."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ResultsError(f"{path}: no such results file (K3_STEP_CLUSTER_RESULTS writes it on the GPU)") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: not a JSON results file ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), list) or not isinstance(doc.get("env"), dict):
        raise ResultsError(f"{path}: a results file holds `env` and `cells`; this one does not")
    return doc["env"], [Cell.of(row, f"{path} cells[{i}]") for i, row in enumerate(doc["cells"])]


def append_rows(path: str | os.PathLike[str], rows: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """Add `rows` to the results file at `path`, creating it with `env`. A file of another run (another GPU,
    commit or dirty state) is refused and left as it was; the file is replaced whole, never half-written."""
    path = Path(path)
    if path.exists():
        doc = json.loads(path.read_text())
        held = doc.get("env", {})
        differ = [k for k in RUN_KEYS if held.get(k) != env.get(k)]
        if differ:
            theirs = ", ".join(f"{k} {held.get(k)!r}" for k in differ)
            ours = ", ".join(f"{k} {env.get(k)!r}" for k in differ)
            raise ResultsError(
                f"{path} holds another run ({theirs}; this one has {ours}): set K3_STEP_CLUSTER_RESULTS to a new file"
            )
    else:
        doc = {"what": WHAT, "env": env, "cells": []}
    doc["cells"] = [*doc["cells"], *rows]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def table(cells: list[Cell]) -> str:
    """One markdown table per TP: each variant's us per call at each batch (the served one in bold), the fastest,
    how much slower the served one is, and the bandwidth it reached (bytes moved / its time)."""
    out = []
    for tp in sorted({c.tp for c in cells}):
        rows = sorted((c for c in cells if c.tp == tp), key=lambda c: c.batch)
        labels = list(dict.fromkeys(label for c in rows for label in c.us))
        labels.sort(key=lambda s: Variant.parse(s).order)
        out.append(f"TP{tp}, us per call (served in bold)\n")
        out.append("| B | " + " | ".join(labels) + " | fastest | served / fastest | TB/s |")
        out.append("|---" * (len(labels) + 4) + "|")
        for c in rows:
            shown = [
                "" if k not in c.us else (f"**{c.us[k]:.2f}**" if k == c.plan else f"{c.us[k]:.2f}") for k in labels
            ]
            ratio = c.us[c.plan] / c.us[c.fastest]
            tbs = c.bytes / (c.us[c.plan] * 1e-6) / 1e12
            out.append(f"| {c.batch} | " + " | ".join(shown) + f" | {c.fastest} | {ratio:.3f} | {tbs:.2f} |")
        out.append("")
    return "\n".join(out)


@dataclass(frozen=True)
class Suggestion:
    heads: int
    first: int
    last: int
    variant: Variant
    gain: float  # the least per-call gain over the served variant among the batches the rule spans

    def toml(self) -> str:
        knobs = self.variant.choice()
        text = ", ".join(f"{k} = {json.dumps(v)}" for k, v in knobs.items())
        return f"{{ heads = {self.heads}, batches = [{self.first}, {self.last}], {text} }}"


def suggest(cells: list[Cell], margin: float = DEFAULT_MARGIN) -> tuple[list[Suggestion], list[str]]:
    """(rules for kda_step_choice.toml, notes): per TP, the fastest variant at the plan's cluster (of those within
    TIE of it, the one with the fewest extras) where it beats the served one by more than `margin`, merged over
    neighbouring measured batches that agree; a note where another cluster is faster than the served variant by more
    than `margin`."""
    from k3_decode.config import K3

    rules, notes = [], []
    for tp in sorted({c.tp for c in cells}):
        heads = K3.shard(tp).kda_heads
        run: list[tuple[int, Variant | None, float]] = []  # (batch, the variant to serve there or None, its gain)
        for c in sorted((c for c in cells if c.tp == tp), key=lambda c: c.batch):
            served = Variant.parse(c.plan)
            same = {k: v for k, v in c.us.items() if Variant.parse(k).cluster == served.cluster}
            quickest = min(same.values())
            tied = [k for k, v in same.items() if v <= quickest * (1 + TIE)]
            best = min(tied, key=lambda k: (Variant.parse(k).extras, same[k]))
            gain = c.us[c.plan] / same[best] - 1
            run.append((c.batch, Variant.parse(best), gain) if best != c.plan and gain > margin else (c.batch, None, 0))
            lead = c.us[c.plan] / c.us[c.fastest] - 1
            if Variant.parse(c.fastest).cluster != served.cluster and lead > margin:
                notes.append(
                    f"TP{tp} B{c.batch}: {c.fastest} is {lead:.1%} faster than the served {c.plan}: the cluster is "
                    "KdaStepPlan.for_shape's rule, not the choice file's"
                )
        # Neighbours whose knobs agree make one rule (the cluster may differ between them).
        for key, group in itertools.groupby(run, key=lambda e: e[1] and tuple(e[1].choice().items())):
            if key:
                spans = list(group)
                least = min(g for _, _, g in spans)
                rules.append(Suggestion(heads, spans[0][0], spans[-1][0], spans[0][1], least))
    return rules, notes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--table", metavar="FILE", type=Path, help="print the per-call tables of a results file")
    what.add_argument("--rules", metavar="FILE", type=Path, help="print the kda_step_choice.toml rules it supports")
    ap.add_argument(
        "--margin", type=float, default=DEFAULT_MARGIN, help="least per-call gain a rule needs (default 0.05)"
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 0 <= args.margin < 1:
        print(f"kda_step_variants.py: --margin is a fraction in [0, 1), got {args.margin}", file=sys.stderr)
        return 2
    try:
        env, cells = load(args.table or args.rules)
        if args.table:
            print(f"{env.get('gpu', '?')}, commit {env.get('commit', '?')}\n")
            print(table(cells))
            return 0
        rules, notes = suggest(cells, args.margin)
    except ResultsError as exc:
        print(f"kda_step_variants.py: {exc}", file=sys.stderr)
        return 2
    print(f"# measured per call on {env.get('gpu', '?')} at {env.get('commit', '?')}; gains over the served variant")
    print("# above the margin; confirm each in the layer graph (benchmarks/kda_layer_h200.py) before serving it")
    for rule in rules:
        print(f"#   heads {rule.heads} B{rule.first}-{rule.last}: at least {rule.gain:.1%} faster per call")
    print("rules = [" + "".join(f"\n  {r.toml()}," for r in rules) + ("\n]" if rules else "]"))
    for note in notes:
        print(f"# note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
