"""`k3gate byo`: run the gate inside the bring-your-own-GPU image with docker, and collect the bundle it writes.

The image's entrypoint is `k3gate run`. This command chooses the container's options (GPUs, the output folder,
your signing key, model and dataset caches), streams the run's output, and verifies the bundle on this side of
the container before it reports the outcome: a bundle that does not verify here is not a result.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.verdicts import OUTCOME_EXIT, ExitCode, Outcome

# Where things live inside the image (docker/Dockerfile sets the working directory to WORKDIR).
WORKDIR = "/k3gate"
CONTAINER_OUT = f"{WORKDIR}/k3gate-out"
CONTAINER_KEY = f"{WORKDIR}/signing.key"
CONTAINER_CONFIGS = f"{WORKDIR}/configs"
CONTAINER_HF = f"{WORKDIR}/hf"
CONTAINER_HOME = f"{WORKDIR}/home"  # world-writable in the image: HOME for a container run as your own user
BUILD_HINT = "docker build -f docker/Dockerfile -t {image} ."
# Codes `k3gate run` exits with; anything else means the run itself broke.
RUN_CODES = {int(c) for c in ExitCode}


def default_image() -> str:
    try:
        version = importlib.metadata.version("k3gate")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    return f"k3gate:{version}"


@dataclass(frozen=True)
class Plan:
    """One `docker run` of the image, with the host folder where its bundle will appear."""

    image: str
    command: list[str]
    volumes: dict[str, dict[str, str]]
    environment: dict[str, str]
    gpus: str | None  # docker's --gpus value; None runs without GPUs (a CPU config)
    bundle_dir: Path
    user: str | None = None
    network: str | None = None  # docker's --network; None leaves docker's default
    config_name: str = ""
    needs: str = ""  # what the config asks for, in words

    def docker_line(self) -> str:
        """The same run as a `docker run` command line, printed so it can be repeated by hand."""
        parts = ["docker", "run", "--rm", "--ipc=host"]
        if self.gpus:
            parts += ["--gpus", self.gpus]
        if self.user:
            parts += ["--user", self.user]
        if self.network:
            parts += ["--network", self.network]
        for host, spec in self.volumes.items():
            parts += ["-v", f"{host}:{spec['bind']}:{spec['mode']}"]
        for key, value in self.environment.items():
            parts += ["-e", f"{key}={value}"]
        return shlex.join([*parts, self.image, *self.command])


def parse_gpus(value: str) -> dict[str, Any]:
    """docker's --gpus grammar, as keyword arguments of docker.types.DeviceRequest."""
    if value == "all":
        return {"count": -1}
    if value.isdigit() and int(value) > 0:
        return {"count": int(value)}
    if value.startswith("device="):
        ids = [d for d in value.removeprefix("device=").split(",") if d]
        if ids:
            return {"device_ids": ids}
    raise UsageError(f"--gpus {value!r} is not understood — use all, a count such as 8, or device=0,1")


def _encrypted(path: Path) -> bool:
    from cryptography.hazmat.primitives import serialization

    data = path.read_bytes()
    try:
        if b"BEGIN OPENSSH PRIVATE KEY" in data:
            serialization.load_ssh_private_key(data, password=None)
        else:
            serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's way of saying "a password is needed"
        return True
    except ValueError:
        return False
    return False


def signing_key_path(path: str | None) -> Path:
    """The host key file to mount: --key (checked now, not inside the container) or your default k3gate key."""
    from harness.bundle import keys

    key = Path(path) if path else keys.default_key_path()
    if path:
        keys.load_private(key)
    if key.exists() and _encrypted(key):
        # Its passphrase would have to enter the container as a variable, and the environment capture would
        # then write it into the bundle, which is published with the pull request.
        raise UsageError(
            f"signing key {key} is encrypted, and byo will not pass its passphrase into the container — give byo "
            "an unencrypted key (`k3gate keygen --out FILE`, then --key FILE)"
        )
    return key.resolve()


def ensure_default_key(plan: Plan) -> None:
    """Create your default k3gate key on first use, as `k3gate run` does (only once docker is known to work)."""
    from harness.bundle import keys

    default = keys.default_key_path().resolve()
    if str(default) in plan.volumes and not default.exists():
        created = keys.generate(default)
        print(f"created your signing key {default} (keyid {created.keyid[:16]}…)", file=sys.stderr)


def make_plan(args: argparse.Namespace, now: dt.datetime | None = None) -> Plan:
    from harness.config.loader import load_config

    if args.config is None:
        from harness.cli import default_config_name

        config_arg, why = default_config_name()
        print(f"using config {config_arg} ({why}); pass --config to choose another", file=sys.stderr)
    else:
        config_arg = args.config
    config = load_config(config_arg, args.tier)
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    name = f"{config.name}-{stamp}"
    out = Path(args.out).resolve()
    if (out / name).exists():
        raise UsageError(f"{out / name} already exists — wait a second or choose another --out")
    volumes = {str(out): {"bind": CONTAINER_OUT, "mode": "rw"}}
    command = ["--out", f"k3gate-out/{name}"]
    if Path(config_arg).is_file():  # a config file of the user's: give the container the same file, read-only
        inside = f"{CONTAINER_CONFIGS}/{Path(config_arg).name}"
        volumes[str(Path(config_arg).resolve())] = {"bind": inside, "mode": "ro"}
        command = ["--config", inside, *command]
    else:
        command = ["--config", config_arg, *command]
    if args.tier:
        command += ["--tier", args.tier]
    if args.stages:
        command += ["--stages", args.stages]
    volumes[str(signing_key_path(args.key))] = {"bind": CONTAINER_KEY, "mode": "ro"}
    command += ["--key", CONTAINER_KEY]

    environment = {"K3GATE_IMAGE": args.image}  # recorded in the bundle's environment capture
    if args.hf_home:
        hf = Path(args.hf_home)
        if not hf.is_dir():
            raise UsageError(f"--hf-home {hf} is not a folder — give your Hugging Face cache (weights, datasets)")
        volumes[str(hf.resolve())] = {"bind": CONTAINER_HF, "mode": "rw"}
        environment["HF_HOME"] = CONTAINER_HF
    if args.offline:
        environment.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    user = None
    if hasattr(os, "getuid") and os.getuid() != 0:  # files in the bundle belong to you, not to root
        user = f"{os.getuid()}:{os.getgid()}"
        environment["HOME"] = CONTAINER_HOME

    hw = config.hardware
    needs_gpus = hw["gpu"] != "none"
    gpus = args.gpus or ("all" if needs_gpus else None)
    if gpus:
        parse_gpus(gpus)
    needs = f"{hw['gpu_count']}x {hw['gpu'].upper()}" if needs_gpus else "no GPU"
    return Plan(args.image, command, volumes, environment, gpus, out / name, user, args.network, config.name, needs)


def check_host_gpus(plan: Plan) -> None:
    """A GPU config on a machine without any CUDA GPU cannot give the container one: say so before docker does."""
    from harness.hardware import detect

    hw = detect()
    if plan.gpus and hw.count == 0:
        raise UsageError(
            f"config {plan.config_name} needs {plan.needs} but this machine has no CUDA GPU (nvidia-smi found none) "
            "— run `k3gate byo` on the GPU machine, or choose a CPU config such as --config cpu-smoke"
        )


def docker_client() -> Any:
    try:
        import docker
    except ImportError:
        raise UsageError("`k3gate byo` needs the docker Python SDK — pip install 'k3gate[byo]'") from None
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise UsageError(
            f"cannot reach the docker daemon ({' '.join(str(exc).split())}) — start docker, or set DOCKER_HOST; "
            "as a non-root user, join the docker group"
        ) from None
    return client


def _image(client: Any, plan: Plan, pull: bool) -> Any:
    import docker

    try:
        return client.images.get(plan.image)
    except docker.errors.ImageNotFound:
        if not pull:
            raise UsageError(
                f"image {plan.image} is not on this machine — build it with `{BUILD_HINT.format(image=plan.image)}`, "
                "or pass --pull to fetch it from its registry"
            ) from None
    try:
        return client.images.pull(plan.image)
    except docker.errors.APIError as exc:
        raise UsageError(f"could not pull {plan.image} ({exc.explanation or exc}) — check the name and login") from None


def run_plan(client: Any, plan: Plan, pull: bool, echo: Callable[[bytes], Any]) -> int:
    """Run the container to the end; returns its exit code."""
    import docker

    image = _image(client, plan, pull)
    device_requests = []
    if plan.gpus:
        device_requests = [docker.types.DeviceRequest(capabilities=[["gpu"]], **parse_gpus(plan.gpus))]
    try:
        container = client.containers.run(
            image.id,
            plan.command,
            volumes=plan.volumes,
            environment=plan.environment,
            device_requests=device_requests,
            ipc_mode="host",  # NCCL and vLLM's workers share memory through /dev/shm
            user=plan.user,
            network_mode=plan.network,
            detach=True,
        )
    except docker.errors.APIError as exc:
        text = " ".join(str(exc.explanation or exc).split())
        if "device driver" in text or "nvidia" in text.lower():
            raise UsageError(
                f"docker cannot give the container GPUs ({text}) — install the NVIDIA Container Toolkit and "
                "restart docker"
            ) from None
        raise UsageError(f"docker could not start the container ({text})") from None
    try:
        for chunk in container.logs(stream=True, follow=True):
            echo(chunk)
        return int(container.wait().get("StatusCode", -1))
    finally:
        container.remove(force=True)


def collect(plan: Plan, code: int) -> int:
    """The outcome of the run, once its bundle verifies on this side of the container."""
    from harness.bundle.verify import verify

    archive = plan.bundle_dir.with_name(plan.bundle_dir.name + ".tar.gz")
    if code == int(ExitCode.USAGE):
        print(f"k3gate byo: the run inside the container refused its arguments (exit {code})", file=sys.stderr)
        return code
    if code not in RUN_CODES or not plan.bundle_dir.is_dir() or not archive.is_file():
        # No sealed bundle means no evidence, which is never green; the run did not finish.
        print(
            f"k3gate byo: the container exited with {code} and left no sealed bundle at {plan.bundle_dir} "
            "— its output above says why",
            file=sys.stderr,
        )
        return int(ExitCode.INCOMPLETE)
    report = verify(archive)
    if not report.ok:
        print(f"k3gate byo: the bundle {archive} does not verify: {report.problems[0]}", file=sys.stderr)
        return int(ExitCode.FAILED)
    assert report.predicate is not None
    outcome = report.predicate["outcome"]
    print(f"{outcome['outcome']}: {outcome['reason']}", file=sys.stderr)
    print(f"bundle {plan.bundle_dir} ({archive.name}), id {report.bundle_id}; verified here", file=sys.stderr)
    # The verified outcome decides, not the container's word for it.
    return int(OUTCOME_EXIT[Outcome(outcome["outcome"])])


def cmd_byo(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    check_host_gpus(plan)
    client = docker_client()
    ensure_default_key(plan)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"k3gate byo: {plan.docker_line()}", file=sys.stderr)
    code = run_plan(client, plan, args.pull, _echo)
    return collect(plan, code)


def _echo(chunk: bytes) -> None:
    sys.stderr.buffer.write(chunk)
    sys.stderr.flush()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("byo", help="run the gate in the bring-your-own-GPU docker image and collect the bundle")
    p.add_argument("--image", default=default_image(), help="image to run (default: %(default)s, built locally)")
    p.add_argument("--config", help="config name or a .toml path; default: by this machine's hardware")
    p.add_argument("--out", default="k3gate-out", help="host folder the bundle is written to (default: %(default)s)")
    p.add_argument("--tier", choices=["smoke", "standard", "full"], help="override the config's tier")
    p.add_argument("--stages", help="comma-separated stages to run")
    p.add_argument("--key", help="ed25519 private key to sign with (default: your k3gate key)")
    p.add_argument("--gpus", help="GPUs for the container: all (default for GPU configs), a count, or device=0,1")
    p.add_argument("--hf-home", help="your Hugging Face cache folder (weights and datasets), mounted into the run")
    p.add_argument("--offline", action="store_true", help="use only local weights and datasets (HF_*_OFFLINE=1)")
    p.add_argument("--network", help="docker network for the run, e.g. none for a provably offline run, host")
    p.add_argument("--pull", action="store_true", help="pull the image when it is not on this machine")
    p.set_defaults(fn=cmd_byo)
