from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from harness.cli import main
from harness.config.loader import builtin_names, load_config
from harness.errors import ConfigError

SHIPPED = ["cpu-smoke", "cpu-vllm", "h200", "tp16-gb300", "tp8-gb300", "tp8-h200"]


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
