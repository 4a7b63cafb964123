"""When the vLLM stages cannot run, they say NOT_RUN with the reason (and never start anything)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from harness.config.loader import load_config
from harness.errors import ConfigError
from harness.hardware import Hardware
from harness.runners import interpreter
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


def test_evals_without_datasets_is_not_run(tmp_path, monkeypatch):
    monkeypatch.delenv("K3GATE_EVAL_DATA", raising=False)
    monkeypatch.setattr(interpreter, "find", lambda: interpreter.VllmPython("python", "0", "0"))
    v = verdict(EvalsStage().run(ctx(tmp_path, datasets="dir")))
    assert v.verdict is Verdict.NOT_RUN and "dataset_dir" in v.reason and "gsm8k.jsonl" in v.reason
    monkeypatch.setenv("K3GATE_EVAL_DATA", str(tmp_path))
    v = verdict(EvalsStage().run(ctx(tmp_path, datasets="dir")))
    assert v.verdict is Verdict.NOT_RUN and "missing" in v.reason


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
