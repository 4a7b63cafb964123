"""Deployments outside the optimization's scope must fail at start-up with the model's clear error, or run and
fall back visibly (the probe reports stock, with a reason, for every decode step). Serving them silently on the
specialized path is the failure this cell exists to catch.

Each case comes from the config (`vllm.out_of_scope`): extra server arguments and environment that leave the scope
(e.g. expert parallelism, eager mode, the V1 model runner) and the error text the model must give. The extra
arguments come after the deployment's own, so a case's value wins over the arm's.
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

PROMPT = "The quick brown fox"
MAX_TOKENS = 16


def case_spec(spec: ServerSpec, case: dict[str, Any]) -> ServerSpec:
    """The candidate arm's server with the case's arguments appended and its environment merged over the arm's."""
    env = dict(spec.env) | {str(k): str(v) for k, v in case.get("env", {}).items()}
    return dataclasses.replace(
        spec, extra_args=spec.extra_args + tuple(case["extra_args"]), env=tuple(sorted(env.items()))
    )


def stock_decode_steps(path: pathproof.CellPath) -> int:
    """Decode steps the probe reported as stock (the recorder keys fallback reasons "<shape>: <reason>")."""
    return sum(n for key, n in path.fallback_reasons.items() if key.startswith("decode: "))


def fallback_check(name: str, path: pathproof.CellPath) -> tuple[Check | None, str | None]:
    """A started out-of-scope server: (check, None), or (None, why the fallback cannot be judged)."""
    if path.stale:
        return None, f"out of scope ({name}): the server started and wrote no fresh proof-of-path snapshot"
    if path.probe is None:
        return None, f"out of scope ({name}): the server started and no probe can show it fell back ({path.probe_note})"
    label = f"out of scope ({name}): started, so every decode step must fall back visibly"
    if path.decode_steps == 0:
        # Zero specialized steps out of zero proves nothing: a fallback nobody observed is not visible.
        return Check(label, 0, ">=", 1, "no decode step was observed, so the fallback is unproven"), None
    stock = stock_decode_steps(path)
    reasons = ", ".join(k for k in path.fallback_reasons if k.startswith("decode: ")) or "none"
    # Equal to every decode step: a step the probe did not report ("unrecorded") is not a visible fallback either.
    return (
        Check(
            label + " (decode steps reported stock)",
            stock,
            "==",
            path.decode_steps,
            f"{path.specialized_decode}/{path.decode_steps} decode steps specialized, {stock} reported stock; "
            f"fallback reasons: {reasons}",
        ),
        None,
    )


def judge(spec: ServerSpec, case: dict[str, Any], log: Path, path_dir: Path) -> tuple[Check | None, str | None]:
    """(check, None) or (None, why the case cannot be judged)."""
    name = case["name"]
    server = VllmServer(case_spec(spec, case), log, f"out-of-scope {name}")
    try:
        with server:
            client = OpenAIClient(server.base_url, spec.served_model_name, 600)
            before = pathproof.read(path_dir)
            client.completion(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
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
    return fallback_check(name, path)
