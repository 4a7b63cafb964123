"""The eval tasks as data (evals/evals.toml + task YAMLs): load their specs, pick their rows, render their YAMLs.

The YAMLs name their data file as the placeholder K3GATE_DATA_FILE; a run writes the rows it uses (the committed
fixture, or the user's full file filtered to the pinned variant) and a copy of each YAML pointing at them into
the run folder, so the bundle holds exactly what lm-eval read.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

PLACEHOLDER = "K3GATE_DATA_FILE"
UTILS = "k3gate_utils.py"


@dataclass(frozen=True)
class TaskSpec:
    name: str  # the key in evals.toml: gsm8k, gpqa_diamond, aime25, mrcr_v2
    task: str  # the lm-eval task name in the YAML
    yaml: str
    fixture: str
    dataset_file: str
    metric: str
    filter: str
    binary: bool
    margin: float
    min_items: int
    train_response: str
    needles: tuple[int, ...] = ()
    max_prompt_tokens: int = 0


def evals_root() -> Path:
    return Path(str(resources.files("evals")))


@cache
def evals_data() -> dict[str, Any]:
    return tomllib.loads((evals_root() / "evals.toml").read_text())


def task_specs() -> dict[str, TaskSpec]:
    specs = {}
    for name, raw in evals_data()["tasks"].items():
        fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items()}
        specs[name] = TaskSpec(name=name, **fields)
    return specs


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path.name} line {number} is not JSON ({exc.msg}) — fix or regenerate the file"
                ) from None
    if not rows:
        raise ValueError(f"{path.name} has no rows — give a JSONL file with one item per line")
    return rows


def select_rows(spec: TaskSpec, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the pinned variant (MRCR: needle counts); other tasks keep every row."""
    if spec.needles:
        rows = [r for r in rows if int(r.get("n_needles", 0)) in spec.needles]
    return rows


def write_task(spec: TaskSpec, rows: list[dict[str, Any]], out_dir: Path) -> tuple[Path, str]:
    """Write the rows and the rendered YAML (+ its helper module) into out_dir; (yaml path, rows sha256)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{spec.name}.jsonl"
    body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    data.write_text(body)
    text = (evals_root() / spec.yaml).read_text()
    if PLACEHOLDER not in text:
        raise ValueError(f"{spec.yaml} does not name its data file as {PLACEHOLDER}")
    yaml_path = out_dir / Path(spec.yaml).name
    yaml_path.write_text(text.replace(PLACEHOLDER, str(data.resolve())))
    shutil.copyfile(evals_root() / "tasks" / UTILS, out_dir / UTILS)
    return yaml_path, hashlib.sha256(body.encode()).hexdigest()


def fixture_rows(spec: TaskSpec) -> list[dict[str, Any]]:
    return select_rows(spec, read_rows(evals_root() / spec.fixture))


def training_pairs(work_dir: Path) -> list[tuple[str, str]]:
    """(user prompt exactly as lm-eval renders it, ideal response) for every fixture row of every task.

    Runs in the vLLM venv (it imports lm_eval): lm-eval itself renders the prompts, so the tiny model is trained
    on the very text the evals stage will send.
    """
    from lm_eval.tasks import TaskManager, get_task_dict

    specs = task_specs()
    for spec in specs.values():
        write_task(spec, fixture_rows(spec), work_dir)
    tasks = get_task_dict([s.task for s in specs.values()], TaskManager(include_path=str(work_dir)))
    pairs = []
    for spec in specs.values():
        task = tasks[spec.task]
        for doc in task.test_docs():
            pairs.append((str(task.doc_to_text(doc)), spec.train_response.format(**doc)))
    return pairs


def fixtures_digest() -> str:
    """Changes whenever anything the tiny model is trained on changes (and not when a margin does)."""
    h = hashlib.sha256()
    for spec in task_specs().values():
        h.update(spec.name.encode() + b"\0" + spec.train_response.encode() + b"\0")
        for rel in (spec.yaml, spec.fixture, f"tasks/{UTILS}"):
            h.update(rel.encode() + b"\0" + (evals_root() / rel).read_bytes())
    return h.hexdigest()
