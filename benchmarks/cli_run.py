"""Benchmark: the whole `k3gate run` process on a config, timed over several runs.

Writes benchmarks/results/cli-run-<config>.json with the commit, the machine, and min/median/max wall times.
Usage: python benchmarks/cli_run.py [--config cpu-smoke] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="cpu-smoke")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    times, codes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "XDG_CONFIG_HOME": str(Path(tmp) / "xdg"), "PYTHONPATH": str(REPO)}
        for i in range(args.runs + 1):  # the first run creates the signing key and warms caches: not counted
            start = time.perf_counter()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "harness",
                    "run",
                    "--config",
                    args.config,
                    "--quiet",
                    "--out",
                    str(Path(tmp) / f"b{i}"),
                ],
                capture_output=True,
                env=env,
            )
            if i:
                times.append(time.perf_counter() - start)
                codes.append(proc.returncode)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    result = {
        "benchmark": "k3gate run, whole process",
        "config": args.config,
        "runs": args.runs,
        "seconds": {"min": min(times), "median": statistics.median(times), "max": max(times)},
        "exit_codes": sorted(set(codes)),
        "commit": commit.strip(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "system": platform.system(),
            "processor": platform.machine(),
        },
    }
    out = REPO / "benchmarks" / "results" / f"cli-run-{args.config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
