"""compute-sanitizer over the stock kernels: the plan, the log parsing and verdicts (on real H200 logs), NOT_RUN
without CUDA, and on the GPU the red team: an out-of-bounds Triton kernel memcheck must flag."""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from suites import sanitize
from suites.sanitize import judge, load_plan, parse_log

DATA = Path(__file__).with_name("data")
PLAN = load_plan()


def _stock_triton_kernels() -> set[str]:
    names: set[str] = set()
    for table in ("attention_ops.toml", "moe_ops.toml"):
        ops = tomllib.loads(resources.files("k3_decode.stock").joinpath(table).read_text())["ops"]
        names |= {k for row in ops.values() for k in row["kernels"]}
    return names


def test_the_plan_has_a_cell_for_every_stock_triton_kernel():
    assert _stock_triton_kernels() <= set(PLAN.kernels)
    assert len(PLAN.kernels) == len(set(PLAN.kernels))
    assert set(PLAN.tools) == set(sanitize.TOOLS)


def test_commands_filter_kernels_except_for_racecheck(tmp_path):
    mem = sanitize.command("cs", "memcheck", PLAN, tmp_path / "r.json", redteam=False)
    assert mem[:5] == ["cs", "--tool", "memcheck", "--error-exitcode", str(sanitize.ERROR_EXIT)]
    regex = mem[mem.index("--kernel-name") + 1]
    exact = [k for k in PLAN.kernels if k not in PLAN.patterns]
    assert regex.startswith("regex=^(") and all(k in regex for k in exact)
    # The CuTe DSL kernels' patterns are substring filters of their own (tests/suites/test_sanitize_cute.py).
    filters = [mem[i + 1] for i, a in enumerate(mem) if a == "--kernel-name"]
    assert filters[1:] == [f"kns={k}" for k in PLAN.kernels if k in PLAN.patterns] and len(filters) > 1
    assert "--kernel-name" not in sanitize.command("cs", "racecheck", PLAN, tmp_path / "r.json", redteam=False)
    red = sanitize.command("cs", "memcheck", PLAN, tmp_path / "r.json", redteam=True)
    assert red[-1] == "--redteam" and "k3san_oob_kernel" in red[red.index("--kernel-name") + 1]


def test_racecheck_log_from_the_h200_is_attributed_per_kernel():
    """Real output (compute-sanitizer 2025.3.1, H200): a hazard in the stock KDA decode kernel counts; the cuBLAS
    Hopper GEMMs' reports are listed as ignored, with the plan's reason."""
    log = (DATA / "racecheck-h200.log").read_text()
    child = json.loads((DATA / "racecheck-h200.child.json").read_text())
    result = judge("racecheck", 86, log, child, list(PLAN.kernels), PLAN.tools["racecheck"])
    assert result.status == "FAILED"
    assert result.errors == 1 and result.kernels["kda_decode_kernel"].errors == 1
    assert "kda_decode_kernel (1)" in result.reason
    assert sum(result.ignored_kernels.values()) == 7 and all(
        k.startswith("nvjet_sm90_") for k in result.ignored_kernels
    )
    assert result.ignore_reason and not result.other_kernels
    # Without the plan's ignore rule the same log fails on cuBLAS too: nothing is dropped silently.
    strict = judge("racecheck", 86, log, child, list(PLAN.kernels))
    assert strict.errors == 8 and len(strict.other_kernels) == 5


def test_memcheck_lists_cuda_python_entry_point_lookups_and_counts_other_api_errors():
    """Real output (compute-sanitizer 2025.3.1, H100, driver 580.159, 80c6ed2): cuda-python's first driver call
    (the o_proj's cluster-residency query) fails 34 cuGetProcAddress lookups; the plan lists them, not counts them.
    Without the rule, or with any other failed API call beside them, memcheck fails."""
    log = (DATA / "memcheck-api-probes-h100.log").read_text()
    child = json.loads((DATA / "memcheck-api-probes-h100.child.json").read_text())
    kernels, plan = list(PLAN.kernels), PLAN.tools["memcheck"]
    result = judge("memcheck", 86, log, child, kernels, plan, PLAN.patterns)
    assert result.status == "PASSED", result.reason
    assert result.ignored_api_errors == {"cuGetProcAddress_v2": 34} and result.ignore_api_reason
    assert not result.host_errors and result.errors == 0
    strict = judge("memcheck", 86, log, child, kernels, None, PLAN.patterns)
    assert strict.status == "FAILED" and strict.unattributed_errors == 34 and not strict.ignored_api_errors
    other = (
        '========= Program hit CUDA_ERROR_INVALID_HANDLE (error 400) due to "invalid resource handle" on CUDA API'
        " call to cuLaunchKernelEx.\n=========     Saved host backtrace up to driver entry point at error\n"
    )
    broken = log.replace("========= ERROR SUMMARY: 34 errors", other + "========= ERROR SUMMARY: 35 errors")
    failed = judge("memcheck", 86, broken, child, kernels, plan, PLAN.patterns)
    assert failed.status == "FAILED" and failed.unattributed_errors == 1
    assert failed.host_errors and "cuLaunchKernelEx" in failed.host_errors[0]
    # Alone, too: the rule names one driver call, not API errors at large.
    clean = CLEAN.replace("K3SAN-END x", "K3SAN-END x\n" + other)
    assert judge("memcheck", 86, clean.replace("0 errors", "1 errors"), child, kernels, plan).status == "FAILED"


def test_memcheck_catches_the_red_team_kernel_in_the_h200_log():
    log = (DATA / "memcheck-redteam-h200.log").read_text()  # the first 60 lines of 100 reports, then the summary
    child = {"cells": {"k3san_oob_kernel": {"status": "ok", "error": "", "launched": ["k3san_oob_kernel"]}}}
    child["launched"] = ["k3san_oob_kernel"]
    result = judge("memcheck-redteam", 86, log, child, ["k3san_oob_kernel"], PLAN.tools["memcheck"])
    parsed = parse_log(log)
    assert parsed.summary_errors == 100 and parsed.reports[0].startswith("Invalid __global__ read of size 4 bytes")
    assert result.kernels["k3san_oob_kernel"].errors == len(parsed.reports) > 5
    assert result.errors == 100  # the reports past the print limit count too
    assert result.status == "FAILED"


CLEAN = "========= COMPUTE-SANITIZER\nK3SAN-BEGIN x\nK3SAN-END x\n========= ERROR SUMMARY: 0 errors\n"


def _child(launched, status="ok"):
    return {
        "cells": {"x": {"status": status, "error": "boom" if status != "ok" else "", "launched": launched}},
        "launched": launched,
    }


def test_verdicts_of_a_tool_run():
    kernels = ["a_kernel", "b_kernel"]
    assert judge("memcheck", 0, CLEAN, _child(kernels), kernels).status == "PASSED"
    missing = judge("memcheck", 0, CLEAN, _child(["a_kernel"]), kernels)
    assert missing.status == "ERROR" and "never launched: b_kernel" in missing.reason
    assert judge("memcheck", 1, CLEAN, _child(kernels, "error"), kernels).status == "ERROR"
    assert judge("memcheck", 1, CLEAN, None, kernels).status == "ERROR"
    assert judge("memcheck", 3, CLEAN, _child(kernels), kernels).status == "ERROR"
    unnamed = CLEAN.replace("0 errors", "2 errors")
    result = judge("memcheck", 86, unnamed, _child(kernels), kernels)
    assert result.status == "FAILED" and result.unattributed_errors == 2


def test_an_ignore_rule_needs_a_reason():
    text = (resources.files("suites").joinpath("sanitize.toml")).read_text()
    broken = text.replace('ignore_reason = "', 'ignored_reason = "')
    with pytest.raises(ValueError, match="without an ignore_reason"):
        load_plan(broken)
    broken = text.replace('ignore_api_reason = "', 'ignored_api_reason = "')
    with pytest.raises(ValueError, match="without an ignore_api_reason"):
        load_plan(broken)


def test_without_cuda_the_run_is_not_run_with_the_reason(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert sanitize.main(["--out", str(tmp_path), "--tool", "memcheck"]) == 3
    result = json.loads((tmp_path / "sanitize.json").read_text())
    assert result["status"] == "NOT_RUN" and "no CUDA device" in result["reason"]
    assert result["tools"]["memcheck"]["status"] == "NOT_RUN"


@pytest.mark.gpu
@pytest.mark.slow
def test_memcheck_flags_the_out_of_bounds_red_team_kernel(tmp_path):
    """Needs CUDA and compute-sanitizer: the red-team kernel reads 1 GiB past a 400-byte tensor."""
    if sanitize.find_sanitizer() is None:
        pytest.skip("compute-sanitizer is not installed here")
    result = sanitize.run_tool(sanitize.find_sanitizer(), "memcheck", PLAN, tmp_path, timeout=300, redteam=True)
    assert result.kernels[PLAN.redteam_kernel].launched
    assert result.kernels[PLAN.redteam_kernel].errors > 0, result.reason


def test_k3gate_subcommand_registers_the_same_run(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    sanitize.register(parser.add_subparsers())
    args = parser.parse_args(["sanitize", "--tool", "synccheck", "--out", str(tmp_path)])
    assert (args.tool, args.out, args.no_redteam) == ("synccheck", tmp_path, False)
    assert args.fn is sanitize._run_args


def test_the_environment_names_the_gpu_driver(monkeypatch) -> None:
    """A sanitizer result is evidence about one GPU and driver: on a CUDA machine the record names both (from the
    project's nvidia-smi probe), and says so when the probe gave no driver."""
    import torch

    from harness.hardware import Hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(sanitize.hardware, "detect", lambda: Hardware(kind="hopper", count=1, driver="580.159.04"))
    monkeypatch.setattr("k3_decode.kernels.providers.not_built_reason", lambda: None)  # it would probe the GPU
    env = sanitize._environment(None)
    assert env["gpu"] == "NVIDIA H200" and env["driver"] == "580.159.04"
    monkeypatch.setattr(sanitize.hardware, "detect", lambda: Hardware(kind="none", count=0))
    assert sanitize._environment(None)["driver"].startswith("unknown")
