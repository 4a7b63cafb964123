"""`k3gate byo`: the docker run it plans, its one-line errors, and the bundle it collects (fake docker client).

The real image and the real docker SDK path are exercised by scripts/test-docker.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
from pathlib import Path

import pytest

import docker
from harness import byo, pipeline
from harness.bundle import keys
from harness.cli import main
from harness.errors import UsageError
from harness.hardware import Hardware
from harness.stages import EnvironmentStage
from harness.verdicts import Check, StageRecords

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
CPU = Hardware(kind="none", count=0)
GB300 = Hardware(kind="gb300", count=8, names=("NVIDIA GB300",))


def args(tmp_path: Path, **changes) -> argparse.Namespace:
    base = dict(
        image="k3gate:test",
        config="cpu-smoke",
        out=str(tmp_path / "out"),
        tier=None,
        stages=None,
        key=None,
        gpus=None,
        hf_home=None,
        offline=False,
        network=None,
        pull=False,
    )
    return argparse.Namespace(**{**base, **changes})


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(byo.os, "getuid", lambda: 0)


@pytest.fixture
def host(monkeypatch):
    """The host's GPUs as `byo` sees them; CPU unless a test says otherwise."""
    state = {"hw": CPU}
    monkeypatch.setattr("harness.hardware.detect", lambda: state["hw"])
    return state


# --- the plan ----------------------------------------------------------------------------------------------------


def test_a_cpu_config_runs_without_gpus_and_mounts_out_and_key(tmp_path, as_root):
    plan = byo.make_plan(args(tmp_path), NOW)
    name = "cpu-smoke-20260102T030405Z"
    assert plan.command == ["--config", "cpu-smoke", "--out", f"k3gate-out/{name}", "--key", byo.CONTAINER_KEY]
    assert plan.gpus is None and plan.user is None
    assert plan.bundle_dir == (tmp_path / "out" / name).resolve()
    assert plan.volumes[str((tmp_path / "out").resolve())] == {"bind": byo.CONTAINER_OUT, "mode": "rw"}
    key = keys.default_key_path().resolve()
    assert plan.volumes[str(key)] == {"bind": byo.CONTAINER_KEY, "mode": "ro"}
    assert not key.exists()  # created only once docker is known to work (ensure_default_key)
    byo.ensure_default_key(plan)
    assert keys.load_private(key)
    assert plan.environment == {"K3GATE_IMAGE": "k3gate:test"}
    assert "--gpus" not in plan.docker_line()


def test_a_gpu_config_asks_docker_for_every_gpu(tmp_path, as_root):
    plan = byo.make_plan(args(tmp_path, config="tp8-gb300", tier="smoke", stages="isolation"), NOW)
    assert plan.gpus == "all" and plan.needs == "8x GB300"
    assert plan.command[-6:] == ["--tier", "smoke", "--stages", "isolation", "--key", byo.CONTAINER_KEY]
    line = plan.docker_line()
    assert line.startswith("docker run --rm --ipc=host --gpus all -v ") and line.endswith(" --key /k3gate/signing.key")


def test_a_config_file_is_mounted_read_only(tmp_path, as_root):
    src = Path(__file__).parents[2] / "harness" / "config" / "configs" / "cpu-smoke.toml"
    mine = tmp_path / "cpu-smoke.toml"
    shutil.copy(src, mine)
    plan = byo.make_plan(args(tmp_path, config=str(mine)), NOW)
    inside = f"{byo.CONTAINER_CONFIGS}/cpu-smoke.toml"
    assert plan.command[:2] == ["--config", inside]
    assert plan.volumes[str(mine.resolve())] == {"bind": inside, "mode": "ro"}


def test_offline_weights_and_datasets(tmp_path, as_root):
    hf = tmp_path / "hf"
    hf.mkdir()
    plan = byo.make_plan(args(tmp_path, hf_home=str(hf), offline=True, network="none"), NOW)
    assert plan.volumes[str(hf.resolve())] == {"bind": byo.CONTAINER_HF, "mode": "rw"}
    assert plan.environment["HF_HOME"] == byo.CONTAINER_HF
    assert plan.environment["HF_HUB_OFFLINE"] == plan.environment["HF_DATASETS_OFFLINE"] == "1"
    assert "--network none" in plan.docker_line()


def test_a_non_root_user_runs_the_container_as_themselves(tmp_path, monkeypatch):
    monkeypatch.setattr(byo.os, "getuid", lambda: 1000)
    monkeypatch.setattr(byo.os, "getgid", lambda: 100)
    plan = byo.make_plan(args(tmp_path), NOW)
    assert plan.user == "1000:100" and plan.environment["HOME"] == byo.CONTAINER_HOME


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [("all", {"count": -1}), ("8", {"count": 8}), ("device=0,3", {"device_ids": ["0", "3"]})],
)
def test_gpus_follow_dockers_grammar(value, kwargs):
    assert byo.parse_gpus(value) == kwargs


@pytest.mark.parametrize("value", ["0", "none", "device=", "-1"])
def test_bad_gpus_are_usage_errors(value):
    with pytest.raises(UsageError, match="use all, a count"):
        byo.parse_gpus(value)


def test_an_encrypted_key_is_refused_rather_than_its_passphrase_passed_on(tmp_path, as_root, monkeypatch):
    from cryptography.hazmat.primitives import serialization

    key = keys.generate(tmp_path / "plain.key")
    pem = key.private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret phrase"),
    )
    (tmp_path / "locked.key").write_bytes(pem)
    monkeypatch.setenv("K3GATE_KEY_PASSPHRASE", "secret phrase")
    with pytest.raises(UsageError, match="is encrypted"):
        byo.make_plan(args(tmp_path, key=str(tmp_path / "locked.key")), NOW)
    monkeypatch.delenv("K3GATE_KEY_PASSPHRASE")
    plan = byo.make_plan(args(tmp_path, key=str(tmp_path / "plain.key")), NOW)
    assert plan.volumes[str((tmp_path / "plain.key").resolve())]["mode"] == "ro"
    assert "K3GATE_KEY_PASSPHRASE" not in plan.environment


def test_bad_inputs_are_usage_errors(tmp_path, as_root):
    with pytest.raises(UsageError, match="not a folder"):
        byo.make_plan(args(tmp_path, hf_home=str(tmp_path / "nope")), NOW)
    with pytest.raises(UsageError, match="does not exist"):
        byo.make_plan(args(tmp_path, key=str(tmp_path / "nokey")), NOW)
    with pytest.raises(UsageError, match="config"):
        byo.make_plan(args(tmp_path, config="no-such-config"), NOW)
    plan = byo.make_plan(args(tmp_path), NOW)
    plan.bundle_dir.mkdir(parents=True)
    with pytest.raises(UsageError, match="already exists"):
        byo.make_plan(args(tmp_path), NOW)


# --- errors before and at docker -----------------------------------------------------------------------------------


def test_a_gpu_config_on_a_machine_without_gpus_is_a_one_line_error(tmp_path, host, capsys):
    assert main(["byo", "--config", "tp8-gb300", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs 8x GB300 but this machine has no CUDA GPU" in err
    host["hw"] = GB300
    byo.check_host_gpus(byo.make_plan(args(tmp_path, config="tp8-gb300"), NOW))  # GPUs present: no error


def test_missing_docker_sdk(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "docker", None)
    assert main(["byo", "--out", str(tmp_path)]) == 2
    assert "pip install 'k3gate[byo]'" in capsys.readouterr().err


def test_no_docker_daemon(tmp_path, host, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    assert main(["byo", "--config", "cpu-smoke", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot reach the docker daemon" in err and "start docker" in err


class FakeContainer:
    def __init__(self, code: int, logs: list[bytes]) -> None:
        self.code, self._logs, self.removed = code, logs, False

    def logs(self, stream: bool, follow: bool):
        return iter(self._logs)

    def wait(self):
        return {"StatusCode": self.code}

    def remove(self, force: bool) -> None:
        self.removed = True


class FakeDocker:
    """The slice of docker.DockerClient byo uses. `behaviour(plan_kwargs, host_paths)` plays the container."""

    def __init__(self, behaviour=None, image_missing=False, run_error: str | None = None) -> None:
        self.behaviour, self.image_missing, self.run_error = behaviour, image_missing, run_error
        self.runs: list[dict] = []
        self.pulled: list[str] = []
        self.images = self
        self.containers = self
        self.container: FakeContainer | None = None

    # images
    def get(self, name):
        if self.image_missing:
            raise docker.errors.ImageNotFound(f"No such image: {name}")
        return argparse.Namespace(id="sha256:feed")

    def pull(self, name):
        self.pulled.append(name)
        return argparse.Namespace(id="sha256:pulled")

    # containers
    def run(self, image, command, **kwargs):
        if self.run_error:
            raise docker.errors.APIError(self.run_error, explanation=self.run_error)
        self.runs.append({"image": image, "command": command, **kwargs})
        host = {spec["bind"]: Path(h) for h, spec in kwargs["volumes"].items()}
        self.container = self.behaviour(command, host) if self.behaviour else FakeContainer(0, [])
        return self.container


def k3gate_in_process(command: list[str], host: dict[str, Path]) -> FakeContainer:
    """What the image does: `k3gate run` with the container's paths mapped to the host's mounts."""
    mapped = []
    for arg in command:
        if arg.startswith("k3gate-out/"):
            arg = str(host[byo.CONTAINER_OUT] / arg.removeprefix("k3gate-out/"))
        mapped.append(str(host.get(arg, arg)))
    code = main(["run", "--quiet", *mapped])
    return FakeContainer(code, [b"k3gate run: config cpu-smoke\n"])


def run_byo(tmp_path, client, monkeypatch, *extra: str) -> int:
    monkeypatch.setattr(byo, "docker_client", lambda: client)
    # The environment stage alone keeps the in-process "container" quick; the bundle is complete all the same.
    argv = ["byo", "--config", "cpu-smoke", "--stages", "environment", "--out", str(tmp_path / "out"), *extra]
    return main(argv)


def test_the_bundle_written_through_the_mount_is_verified_and_its_outcome_returned(
    tmp_path, host, as_root, monkeypatch, capsys
):
    client = FakeDocker(k3gate_in_process)
    assert run_byo(tmp_path, client, monkeypatch, "--image", "k3gate:test") == 0
    (call,) = client.runs
    assert call["image"] == "sha256:feed" and call["device_requests"] == [] and call["ipc_mode"] == "host"
    assert call["environment"]["K3GATE_IMAGE"] == "k3gate:test"
    assert client.container.removed
    err = capsys.readouterr().err
    assert "k3gate run: config cpu-smoke" in err and "verified here" in err and "PASSED" in err


class FailingNumerics:
    name = "numerics"
    description = "a numerics stage whose one check fails"
    needs_hardware = False

    def run(self, ctx):
        return StageRecords(stage=self.name, checks=[Check("max abs error", 7.0, "<=", 1.0)])


def test_the_verified_outcome_decides_the_exit_code_not_the_container(tmp_path, host, as_root, monkeypatch):
    def claims_incomplete(command, mounts):
        container = k3gate_in_process(command, mounts)
        assert container.code == 0
        container.code = 3
        return container

    assert run_byo(tmp_path, FakeDocker(claims_incomplete), monkeypatch) == 0
    monkeypatch.setattr(pipeline, "registered", lambda: [EnvironmentStage(), FailingNumerics()])
    assert run_byo(tmp_path / "failing", FakeDocker(k3gate_in_process), monkeypatch, "--stages", "numerics") == 1


def test_gpu_configs_get_a_device_request(tmp_path, host, as_root, monkeypatch):
    host["hw"] = GB300
    client = FakeDocker()
    monkeypatch.setattr(byo, "docker_client", lambda: client)
    main(["byo", "--config", "tp8-gb300", "--out", str(tmp_path / "out"), "--gpus", "device=0,1"])
    (request,) = client.runs[0]["device_requests"]
    assert request["DeviceIDs"] == ["0", "1"] and request["Capabilities"] == [["gpu"]]


def test_a_bundle_modified_before_collection_fails(tmp_path, host, as_root, monkeypatch, capsys):
    def tampering(command, mounts):
        container = k3gate_in_process(command, mounts)
        (bundle,) = [p for p in mounts[byo.CONTAINER_OUT].iterdir() if p.is_dir()]
        records = bundle / "stages" / "environment" / "records.json"
        records.write_text(records.read_text() + " ")
        from harness.bundle import archive

        archive.pack(bundle, bundle.with_name(bundle.name + ".tar.gz"))
        return container

    assert run_byo(tmp_path, FakeDocker(tampering), monkeypatch) == 1
    assert "does not verify: " in capsys.readouterr().err


def test_a_container_that_dies_without_a_bundle_is_incomplete(tmp_path, host, as_root, monkeypatch, capsys):
    client = FakeDocker(lambda command, mounts: FakeContainer(137, [b"Killed\n"]))
    assert run_byo(tmp_path, client, monkeypatch) == 3
    assert "exited with 137 and left no sealed bundle" in capsys.readouterr().err


def test_a_missing_image_says_how_to_build_it_or_pull_it(tmp_path, host, as_root, monkeypatch, capsys):
    assert run_byo(tmp_path, FakeDocker(image_missing=True), monkeypatch) == 2
    assert "docker build -f docker/Dockerfile -t k3gate:" in capsys.readouterr().err
    client = FakeDocker(image_missing=True)
    run_byo(tmp_path, client, monkeypatch, "--pull", "--image", "registry.example/k3gate:1")
    assert client.pulled == ["registry.example/k3gate:1"] and client.runs[0]["image"] == "sha256:pulled"


def test_docker_without_the_gpu_runtime_is_a_one_line_error(tmp_path, host, as_root, monkeypatch, capsys):
    host["hw"] = GB300
    client = FakeDocker(run_error='could not select device driver "" with capabilities: [[gpu]]')
    monkeypatch.setattr(byo, "docker_client", lambda: client)
    assert main(["byo", "--config", "tp8-gb300", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NVIDIA Container Toolkit" in err and "could not select device driver" in err
