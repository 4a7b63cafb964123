"""Deployments outside the optimization's scope must fail at start-up with the model's clear error, or run and
fall back visibly (the probe reports stock for every decode step). Serving them silently on the specialized
path is the failure this cell exists to catch.

Each case comes from the config (`vllm.out_of_scope`): extra server arguments that leave the scope (e.g. expert
parallelism, eager mode) and the error text the model must give.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from harness.runners import pathproof
from harness.runners.client import OpenAIClient, RequestFailed
from harness.runners.server import ServerError, ServerSpec, VllmServer
from harness.verdicts import Check


def judge(spec: ServerSpec, case: dict[str, Any], log: Path, path_dir: Path) -> tuple[Check | None, str | None]:
    """(check, None) or (None, why the case cannot be judged)."""
    name = case["name"]
    spec = dataclasses.replace(spec, extra_args=spec.extra_args + tuple(case["extra_args"]))
    server = VllmServer(spec, log, f"out-of-scope {name}")
    try:
        with server:
            client = OpenAIClient(server.base_url, spec.served_model_name, 600)
            before = pathproof.read(path_dir)
            client.completion(prompt="The quick brown fox", max_tokens=16, temperature=0.0)
            done = time.time()
            path = pathproof.cell_path(before, pathproof.settle(path_dir, done), done)
    except RequestFailed as exc:
        # It started but cannot serve: neither a clear refusal nor a visible fallback.
        return Check(
            f"out of scope ({name}): refused at start-up or served with a visible fallback",
            False,
            "==",
            True,
            f"the server started, then a request failed: {exc}",
        ), None
    except ServerError as exc:
        refused = "exited" in str(exc) and case["expect_error"] in log.read_text(errors="replace")
        return (
            Check(
                f"out of scope ({name}): start-up refused with the model's error",
                refused,
                "==",
                True,
                f"expected {case['expect_error']!r}; got: {str(exc)[:300]}",
            ),
            None,
        )
    if path.probe is None:
        return None, f"out of scope ({name}): the server started and no probe can show it fell back"
    reasons = ", ".join(path.fallback_reasons) or "none"
    return (
        Check(
            f"out of scope ({name}): started, so every decode step must fall back visibly",
            path.specialized_decode,
            "==",
            0,
            f"{path.specialized_decode}/{path.decode_steps} decode steps specialized; fallback reasons: {reasons}",
        ),
        None,
    )
