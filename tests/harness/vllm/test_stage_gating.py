"""When the vLLM stages cannot run, they say NOT_RUN with the reason (and never start anything)."""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path

import pytest

from harness.config.loader import load_config
from harness.errors import ConfigError
from harness.hardware import Hardware
from harness.runners import arms, eval_tasks, interpreter
from harness.stages import evals
from harness.stages.base import StageContext
from harness.stages.evals import EvalsStage
from harness.stages.scope import ScopeStage
from harness.verdicts import Verdict, derive_verdict


def ctx(tmp_path, name: str = "cpu-vllm", **vllm_evals) -> StageContext:
    cfg = load_config(name)
    if vllm_evals:
        data = copy.deepcopy(cfg.data)
        data["vllm"]["evals"].update(vllm_evals)
        cfg = dataclasses.replace(cfg, data=data)
    return StageContext(cfg, Hardware("none", 0), tmp_path, lambda *_: None)


def verdict(records):
    return derive_verdict(records.to_json())


@pytest.mark.parametrize("stage", [ScopeStage(), EvalsStage()])
def test_in_process_subjects_are_not_run_with_a_reason(tmp_path, stage):
    v = verdict(stage.run(ctx(tmp_path, "cpu-smoke")))
    assert v.verdict is Verdict.NOT_RUN and "runs in process" in v.reason


@pytest.mark.parametrize("stage", [ScopeStage(), EvalsStage()])
def test_missing_vllm_is_not_run_and_says_how_to_install_it(tmp_path, monkeypatch, stage):
    monkeypatch.setattr(interpreter, "_candidates", lambda: [("/nonexistent/python3", "test")])
    interpreter.find.cache_clear()
    try:
        v = verdict(stage.run(ctx(tmp_path)))
    finally:
        interpreter.find.cache_clear()
    assert v.verdict is Verdict.NOT_RUN and "scripts/setup-vllm" in v.reason


def full_datasets(folder: Path) -> Path:
    """A dataset folder in the user's layout: each task's file under its dataset_file name (fixture rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    for spec in eval_tasks.task_specs().values():
        shutil.copy(eval_tasks.evals_root() / spec.fixture, folder / spec.dataset_file)
    return folder


@pytest.fixture
def no_datasets(tmp_path, monkeypatch):
    """No K3GATE_EVAL_DATA and an empty cache folder (never the developer's own)."""
    monkeypatch.delenv("K3GATE_EVAL_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(interpreter, "find", lambda: interpreter.VllmPython("python", "0", "0"))
    return tmp_path


def test_evals_without_datasets_is_not_run_naming_all_three_places(no_datasets, monkeypatch):
    tmp_path = no_datasets
    cache = tmp_path / "xdg-cache" / "k3gate" / "eval-data"
    v = verdict(EvalsStage().run(ctx(tmp_path, datasets="dir")))
    assert v.verdict is Verdict.NOT_RUN and "\n" not in v.reason  # one line
    assert f"missing in {cache} (named by the cache folder)" in v.reason and "gsm8k.jsonl" in v.reason
    assert "K3GATE_EVAL_DATA (not set)" in v.reason and "vllm.evals.dataset_dir (not set)" in v.reason
    monkeypatch.setenv("K3GATE_EVAL_DATA", str(tmp_path / "empty"))
    v = verdict(EvalsStage().run(ctx(tmp_path, datasets="dir", dataset_dir=str(tmp_path / "cfg"))))
    assert v.verdict is Verdict.NOT_RUN and f"missing in {tmp_path / 'empty'} (named by K3GATE_EVAL_DATA)" in v.reason
    assert f"vllm.evals.dataset_dir ({tmp_path / 'cfg'})" in v.reason and str(cache) in v.reason


def plan_folder(tmp_path: Path, **evals_keys: object) -> tuple[object, str]:
    vllm = copy.deepcopy(load_config("cpu-vllm").data["vllm"])
    vllm["evals"].update({"datasets": "dir", **evals_keys})
    return evals._plan(vllm, "python")


def test_eval_datasets_come_from_the_env_then_the_config_then_the_cache(no_datasets, monkeypatch):
    tmp_path = no_datasets
    full = full_datasets(tmp_path / "xdg-cache" / "k3gate" / "eval-data")
    plan, problem = plan_folder(tmp_path)
    assert plan is not None and problem == "" and plan.rows["gsm8k"]  # the cache folder, nothing set
    assert evals.dataset_folder(None) == (full, "the cache folder")
    # Broken case: the cache lacks a file, so the full dataset is missing.
    (full / "aime25.jsonl").unlink()
    plan, problem = plan_folder(tmp_path)
    assert plan is None and "aime25.jsonl" in problem and "gsm8k.jsonl" not in problem
    # The config's folder comes before the cache, the environment before both.
    configured = full_datasets(tmp_path / "configured")
    assert evals.dataset_folder(str(configured)) == (configured, "vllm.evals.dataset_dir")
    assert plan_folder(tmp_path, dataset_dir=str(configured))[0] is not None
    monkeypatch.setenv("K3GATE_EVAL_DATA", str(tmp_path / "nowhere"))
    assert evals.dataset_folder(str(configured)) == (tmp_path / "nowhere", "K3GATE_EVAL_DATA")
    assert plan_folder(tmp_path, dataset_dir=str(configured))[0] is None  # an explicit folder is never skipped


def test_the_cache_folder_follows_xdg_or_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert evals.cache_dir() == tmp_path / "xdg" / "k3gate" / "eval-data"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/path"):  # the XDG spec ignores an empty or relative value
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert evals.cache_dir() == tmp_path / "home" / ".cache" / "k3gate" / "eval-data"


def test_evals_metrics_carry_every_teacher_forcing_limit_with_its_reason(no_datasets, monkeypatch):
    # No deployment to measure: the stage stops after its plan, with the metrics it always records.
    monkeypatch.setattr(arms, "deployments", lambda data: [])
    records = EvalsStage(provider=lambda group, dep: None).run(ctx(no_datasets)).to_json()
    limits = records["metrics"]["teacher_forcing_limits"]
    tf = eval_tasks.evals_data()["teacher_forcing"]
    assert set(limits) == {"max_mean_kl", "max_p99_kl", "min_mean_top5_overlap", "max_abs_target_logprob_diff"}
    for key, entry in limits.items():
        assert entry == {"limit": tf[key], "why": tf["why"][key]}
        assert entry["why"].startswith("CPU-calibrated placeholder")


def test_vllm_config_keys_are_checked(tmp_path):
    from harness.config import loader

    text = loader._read("cpu-vllm")[2].replace("concurrency = [1, 4]", "concurrency = [0]")
    path = tmp_path / "cpu-vllm.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"vllm\.evals\.concurrency\.0"):
        load_config(str(path))
    path.write_text(loader._read("cpu-vllm")[2].replace('tasks = ["gsm8k"', 'tasks = ["mmlu"'))
    with pytest.raises(ConfigError, match=r"vllm\.evals\.tasks\.0"):
        load_config(str(path))
