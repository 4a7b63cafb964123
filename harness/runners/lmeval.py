"""Run the real lm-eval against one arm's OpenAI chat endpoint and read its per-sample log."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.runners.eval_tasks import TaskSpec
from harness.runners.server import log_tail

SEED = 1234


class LmEvalFailed(RuntimeError):
    """lm-eval exited non-zero or wrote no samples; one line with its log tail."""


@dataclass(frozen=True)
class LmEvalRun:
    arm: str
    concurrency: int
    output_dir: Path
    log: Path
    seconds: float
    samples: dict[str, Path]  # task key (gsm8k, ...) -> samples_<task>_<time>.jsonl


@dataclass(frozen=True)
class Item:
    doc_id: int
    score: float
    prompt_hash: str
    doc_hash: str
    response: str


def command(
    python: str,
    base_url: str,
    served_model: str,
    specs: list[TaskSpec],
    tasks_dir: Path,
    out_dir: Path,
    concurrency: int,
    max_gen_toks: int | None,
    limit: int | None,
) -> list[str]:
    model_args = ",".join(
        [
            f"model={served_model}",
            f"base_url={base_url}/v1/chat/completions",
            f"num_concurrent={concurrency}",
            "max_retries=2",
            "tokenized_requests=False",
        ]
    )
    cmd = [
        python,
        "-m",
        "lm_eval",
        "--model",
        "local-chat-completions",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(s.task for s in specs),
        "--include_path",
        str(tasks_dir),
        "--apply_chat_template",
        "--log_samples",
        "--output_path",
        str(out_dir),
        "--seed",
        str(SEED),
    ]
    if max_gen_toks:
        cmd += ["--gen_kwargs", f"max_gen_toks={max_gen_toks}"]
    if limit:
        cmd += ["--limit", str(limit)]
    return cmd


def run(
    arm: str,
    python: str,
    base_url: str,
    served_model: str,
    specs: list[TaskSpec],
    tasks_dir: Path,
    out_dir: Path,
    concurrency: int,
    max_gen_toks: int | None = None,
    limit: int | None = None,
    timeout_s: float = 24 * 3600,
) -> LmEvalRun:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "lm_eval.log"
    cmd = command(python, base_url, served_model, specs, tasks_dir, out_dir, concurrency, max_gen_toks, limit)
    # Datasets come from local files only: never let a run reach for the hub (and fail slowly offline).
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    with log.open("w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LmEvalFailed(f"lm-eval on {arm} ran past {timeout_s:.0f} s: {log_tail(log)}") from None
    if proc.returncode != 0:
        raise LmEvalFailed(f"lm-eval on {arm} exited with code {proc.returncode}: {log_tail(log)}")
    samples = {}
    for spec in specs:
        found = sorted(out_dir.rglob(f"samples_{spec.task}_*.jsonl"))
        if not found:
            raise LmEvalFailed(f"lm-eval on {arm} wrote no samples for {spec.task}: {log_tail(log)}")
        samples[spec.name] = found[-1]
    return LmEvalRun(arm, concurrency, out_dir, log, round(time.monotonic() - start, 1), samples)


def _response(sample: dict[str, Any]) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return str(first[0] if isinstance(first, list) and first else first)


def items(samples_path: Path, spec: TaskSpec) -> dict[int, Item]:
    """doc_id -> the item's score under the task's metric and filter."""
    out = {}
    for line in samples_path.read_text().splitlines():
        if not line.strip():
            continue
        sample = json.loads(line)
        if sample.get("filter", "none") != spec.filter:
            continue
        if spec.metric not in sample:
            raise LmEvalFailed(f"{samples_path.name}: sample {sample.get('doc_id')} has no {spec.metric!r} value")
        out[int(sample["doc_id"])] = Item(
            doc_id=int(sample["doc_id"]),
            score=float(sample[spec.metric]),
            prompt_hash=str(sample.get("prompt_hash", "")),
            doc_hash=str(sample.get("doc_hash", "")),
            response=_response(sample),
        )
    if not out:
        raise LmEvalFailed(f"{samples_path.name}: no samples with filter {spec.filter!r}")
    return out
