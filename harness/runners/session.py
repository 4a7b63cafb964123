"""Running arms: start the servers an experiment needs, hand out clients and proof-of-path folders, stop them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.runners import arms as arms_mod
from harness.runners import pathproof
from harness.runners.client import OpenAIClient, RequestFailed
from harness.runners.server import ServerSpec, VllmServer
from harness.verdicts import Check


@dataclass
class RunningArm:
    name: str
    spec: ServerSpec
    server: VllmServer
    client: OpenAIClient
    path_dir: Path

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return pathproof.read(self.path_dir)

    def settled(self) -> dict[str, dict[str, Any]]:
        return pathproof.settle(self.path_dir, time.time())

    def alive_or_raise(self, during: str) -> None:
        self.server.ensure_alive(during)


# (arm names, deployment) -> a context manager yielding {arm name: RunningArm}
ArmProvider = Callable[[tuple[str, ...], arms_mod.Deployment], AbstractContextManager[dict[str, RunningArm]]]


def config_provider(
    vllm: dict[str, Any],
    python: str,
    model_path: str,
    stage_dir: Path,
    overrides: arms_mod.ArmOverrides | None = None,
    request_timeout_s: float = 3600.0,
) -> ArmProvider:
    """The provider a stage uses by default: fresh servers from the config, logs and snapshots in the stage dir."""

    @contextlib.contextmanager
    def provide(names: tuple[str, ...], dep: arms_mod.Deployment) -> Iterator[dict[str, RunningArm]]:
        running: dict[str, RunningArm] = {}
        with contextlib.ExitStack() as stack:
            for name in names:
                path_dir = stage_dir / f"path-{name}-{dep.label()}"
                spec = arms_mod.arm_spec(vllm, name, dep, python, model_path, path_dir, overrides)
                server = VllmServer(spec, stage_dir / f"server-{name}-{dep.label()}.log", name)
                stack.callback(server.stop)
                server.start()  # start every arm first so their start-ups overlap
                client = OpenAIClient(server.base_url, spec.served_model_name, request_timeout_s)
                running[name] = RunningArm(name, spec, server, client, path_dir)
            for arm in running.values():
                arm.server.wait_healthy()
            yield running

    return provide


def backend_check(arm: RunningArm) -> tuple[Check | None, str | None]:
    """Did the model in this arm's worker receive the decode_backend the arm asked for? (From the plugin.)"""
    snaps = arm.settled()
    if not snaps:
        return None, f"{arm.name}: the k3gate vLLM plugin wrote no snapshot, so the arm's configuration is unproven"
    got = sorted({str(s.get("additional_config", {}).get("decode_backend")) for s in snaps.values()})
    return (
        Check(
            f"{arm.name}: decode_backend the model received",
            got[0] if len(got) == 1 else got,
            "==",
            arm.spec.decode_backend,
        ),
        None,
    )


def call_cell(arm: RunningArm, label: str, fn: Callable[[], Any]) -> tuple[Any, Check | None]:
    """Run one cell; a failed request on a live server is a failed check, a dead server raises ServerError."""
    try:
        return fn(), None
    except RequestFailed as exc:
        arm.alive_or_raise(label)
        return None, Check(f"{label}: requests answered", False, "==", True, str(exc)[:300])
