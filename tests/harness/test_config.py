from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from harness.cli import main
from harness.config.loader import builtin_names, load_config
from harness.errors import ConfigError
from harness.runners.eval_tasks import evals_data
from harness.subjects import load_subject

SHIPPED = ["cpu-smoke", "cpu-tp2", "cpu-vllm", "h200", "tp16-gb300", "tp8-gb300", "tp8-h200"]


def cpu_smoke_text() -> str:
    return resources.files("harness.config.configs").joinpath("cpu-smoke.toml").read_text()


def write_variant(tmp_path: Path, old: str, new: str, name: str = "cpu-smoke") -> Path:
    text = cpu_smoke_text()
    assert old in text, f"test setup: {old!r} not in cpu-smoke.toml"
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace(old, new, 1))
    return path


def test_shipped_configs_all_load():
    assert builtin_names() == SHIPPED
    for name in SHIPPED:
        cfg = load_config(name)
        assert cfg.name == name and "environment" in cfg.required_stages and "bundle" in cfg.required_stages


def test_tier_override_changes_required_stages():
    assert "evals" not in load_config("tp8-gb300", "smoke").required_stages
    assert "evals" in load_config("tp8-gb300", "full").required_stages


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("batches = [1, 2, 4]", "batchez = [1, 2, 4]", ["workload", "batchez", "allowed"]),
        ("batches = [1, 2, 4]", "batches = [1, 'two']", ["workload.batches.1", "integer"]),
        ("batches = [1, 2, 4]", "batches = [1, 0]", ["workload.batches.1", "minimum"]),
        ('tier = "smoke"', 'tier = "quick"', ["tier", "'smoke'"]),
        ("tp = [1, 2]", "tp = [3]", ["parallel.tp", "TP=3", "use one of"]),
        ("batches = [1, 2, 4]", "batches = [1, 128]", ["workload.batches", "128", "maximum of 64"]),
        ("tokens_per_request = [1, 2]", "tokens_per_request = [9]", ["tokens_per_request", "maximum of 8"]),
        ("dcp = [1]", "dcp = [4]", ["parallel.dcp", "DCP=4"]),
        ("gpu_count = 0", "gpu_count = 2", ["hardware.gpu_count", "none"]),
        ('model = "k3-mini"', 'model = "k3"', ["hardware.gpu", "without a GPU"]),
        (
            '"perf", "bundle"]\nmax_cells',
            '"perff", "bundle"]\nmax_cells',
            ["tiers.smoke.required", "'perff'"],
        ),
        ("contexts = [1, 17, 64]", "contexts = [1, 17, 512]", ["workload.contexts", "512"]),
    ],
)
def test_bad_values_name_the_key_and_the_fix(tmp_path, old, new, names):
    path = write_variant(tmp_path, old, new)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert "\n" not in message and " — " in message  # one line: problem — fix
    for part in names:
        assert part in message


def test_tp_that_does_not_divide_heads(tmp_path):
    # k3-mini has 8 heads: TP=16 is in the subject's TP list but cannot shard k3-mini.
    path = write_variant(tmp_path, "tp = [1, 2]", "tp = [16]")
    with pytest.raises(ConfigError, match=r"parallel\.tp: k3-mini: TP=16"):
        load_config(str(path))


def test_name_must_match_file(tmp_path):
    path = write_variant(tmp_path, "batches = [1, 2, 4]", "batches = [1, 2, 4]", name="other")
    with pytest.raises(ConfigError, match="differs from the file name"):
        load_config(str(path))


def test_invalid_toml_and_missing_file(tmp_path):
    bad = tmp_path / "cpu-smoke.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="unknown config 'nope'"):
        load_config("nope")


def test_cli_config_error_is_one_line_exit_2(tmp_path, capsys):
    path = write_variant(tmp_path, "tp = [1, 2]", "tp = [3]")
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("k3gate: error: config cpu-smoke: parallel.tp")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_lists_and_shows_configs(capsys):
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == SHIPPED
    assert main(["show-config", "tp16-gb300", "--tier", "full"]) == 0
    out = capsys.readouterr().out
    assert 'tier = "full"' in out and 'candidate_backend = "latency_specialized"' in out


def test_a_bad_perf_sweep_is_a_config_error(tmp_path):
    # A sweep axis outside the config's own workload would time cells the scope checks never saw.
    path = write_variant(tmp_path, "batches = [1, 4]\ncontexts = [17]", "batches = [1, 3]\ncontexts = [17]")
    with pytest.raises(ConfigError, match="perf") as err:
        load_config(str(path))
    assert "\n" not in str(err.value)


# --- the vllm-k3 configs: out-of-scope deployments, small-batch and long-context evals -------------------------
def vllm_k3_configs() -> list[str]:
    names = [n for n in SHIPPED if load_config(n).subject == "vllm-k3"]
    assert names == ["tp16-gb300", "tp8-gb300"]  # the check below must not pass by finding nothing
    return names


def refusal_problems(config: dict) -> list[str]:
    """Out-of-scope cases whose expected error is not one the model gives (k3_decode/scope/vllm-k3.toml)."""
    refusal = load_subject("vllm-k3").scope["refusal"]
    known = {refusal["prefix"] + reason for reason in refusal["reasons"]}
    cases = config["vllm"].get("out_of_scope", [])
    problems = [f"{c['name']}: {c['expect_error']!r}" for c in cases if c["expect_error"] not in known]
    if len({c["name"] for c in cases}) != len(cases):
        problems.append("two cases share a name (their logs and snapshot folders would collide)")
    return problems


def test_out_of_scope_cases_expect_the_models_own_refusals(tmp_path):
    for name in vllm_k3_configs():
        vllm = load_config(name).data["vllm"]
        assert len(vllm["out_of_scope"]) >= 5 and refusal_problems({"vllm": vllm}) == []
        # The V1-runner case reaches the model through the environment, not an argument.
        assert {"VLLM_USE_V2_MODEL_RUNNER": "0"} in [c.get("env") for c in vllm["out_of_scope"]]
    # Broken case: a paraphrased error would never match the log, so the case could only ever fail.
    bad = load_config("tp8-gb300").data["vllm"]
    bad = {"vllm": {**bad, "out_of_scope": [{**bad["out_of_scope"][0], "expect_error": "does not support eager"}]}}
    assert refusal_problems(bad) == ["eager, no CUDA graphs: 'does not support eager'"]


def test_vllm_k3_evals_cover_small_batches_long_context_and_full_datasets():
    prepared = set(load_subject("vllm-k3").scope["deployment"]["prepared_batches"])
    for name in vllm_k3_configs():
        vllm = load_config(name).data["vllm"]
        ev = vllm["evals"]
        assert ev["datasets"] == "dir" and "dataset_dir" not in ev  # the user's folder, never a path of ours
        assert ev["tasks"] == ["gsm8k", "gpqa_diamond", "aime25", "mrcr_v2"]
        assert ev["concurrency"][0] == 1 and max(ev["concurrency"]) == 8 and set(ev["concurrency"]) <= prepared
        # Long context: MRCR rows up to max_model_len minus its answer budget; forcing prompts must still fit.
        assert vllm["max_model_len"] >= 131072
        assert ev["teacher_forcing_tokens"] + 64 < vllm["max_model_len"]
        assert vllm["cudagraph_mode"] in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def test_the_in_process_configs_have_no_vllm_table():
    for name in ("h200", "tp8-h200", "cpu-smoke"):
        assert "vllm" not in load_config(name).data


def gb300_variant(tmp_path: Path, old: str, new: str) -> Path:
    text = resources.files("harness.config.configs").joinpath("tp8-gb300.toml").read_text()
    assert old in text, f"test setup: {old!r} not in tp8-gb300.toml"
    path = tmp_path / "tp8-gb300.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        (
            'env = {VLLM_USE_V2_MODEL_RUNNER = "0"}',
            "env = {VLLM_USE_V2_MODEL_RUNNER = 0}",
            ["VLLM_USE_V2_MODEL_RUNNER"],
        ),
        ('name = "expert parallelism"', 'name = "expert parallelism"\nexpect = "refusal"', ["'expect'", "allowed"]),
        ("concurrency = [1, 2, 4, 8]", "concurrency = [0, 8]", ["vllm.evals.concurrency.0", "minimum"]),
        ('datasets = "dir"', 'datasets = "hub"', ["vllm.evals.datasets", "'fixtures'"]),
    ],
)
def test_bad_vllm_k3_values_are_one_line_errors(tmp_path, old, new, names):
    with pytest.raises(ConfigError) as err:
        load_config(str(gb300_variant(tmp_path, old, new)))
    message = str(err.value)
    assert "\n" not in message and " — " in message
    for part in names:
        assert part in message


def test_show_config_prints_the_out_of_scope_cases_and_eval_cells(capsys):
    assert main(["show-config", "tp16-gb300"]) == 0
    out = capsys.readouterr().out
    assert out.count("[[vllm.out_of_scope]]") == 6 and "[vllm.out_of_scope.env]" in out
    assert "[vllm.evals]" in out and 'datasets = "dir"' in out


# --- the teacher-forcing limits say where their numbers come from -----------------------------------------------
def uncalibrated(limits: dict) -> list[str]:
    """Limits (max_*/min_*) whose why text does not say they are CPU-calibrated placeholders."""
    why = limits.get("why", {})
    return [
        key
        for key in limits
        if key.startswith(("max_", "min_")) and "CPU-calibrated placeholder, not a GPU number" not in why.get(key, "")
    ]


def test_teacher_forcing_limits_are_marked_cpu_calibrated_placeholders():
    limits = evals_data()["teacher_forcing"]
    assert {k for k in limits if k.startswith(("max_", "min_"))} == set(limits["why"])
    assert uncalibrated(limits) == []
    # Broken case: a new limit without its reason is caught.
    assert uncalibrated({**limits, "max_js": 0.1}) == ["max_js"]


def test_a_distributed_config_needs_a_gpu_per_rank_on_gpus_but_not_on_the_cpu(tmp_path: Path) -> None:
    text = resources.files("harness.config.configs").joinpath("tp8-h200.toml").read_text()
    path = tmp_path / "tp8-h200.toml"
    path.write_text(text.replace("gpu_count = 8", "gpu_count = 4"))
    with pytest.raises(ConfigError, match=r"hardware\.gpu_count: 4 GPUs cannot hold TP=8"):
        load_config(str(path))
    cfg = load_config("cpu-tp2")  # CPU ranks are processes: no GPU count applies
    assert cfg.data["parallel"] == {"tp": [2], "dcp": [1], "mode": "distributed"}
