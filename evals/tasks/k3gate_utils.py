"""Helpers the k3gate task YAMLs name with `!function` (lm-eval imports this file from the YAML's folder)."""

from __future__ import annotations

import hashlib
import json
from difflib import SequenceMatcher
from typing import Any

LETTERS = "ABCD"


def _clean(text: str | None) -> str:
    return " ".join((text or "").replace(" [title]", ". ").split())


def gpqa_process_docs(dataset: Any) -> Any:
    def one(doc: dict[str, Any]) -> dict[str, Any]:
        correct = _clean(doc["Correct Answer"])
        choices = [_clean(doc[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
        # A fixed order from the question's hash: the same prompt on every run and on both arms.
        key = lambda c: hashlib.sha256((doc["Question"] + "\0" + c).encode()).hexdigest()  # noqa: E731
        choices.sort(key=key)
        letter = LETTERS[choices.index(correct)]
        return {**{f"choice{i + 1}": c for i, c in enumerate(choices)}, "answer_letter": letter}

    return dataset.map(one)


def mrcr_messages(doc: dict[str, Any]) -> list[dict[str, str]]:
    messages = json.loads(doc["prompt"]) if isinstance(doc["prompt"], str) else doc["prompt"]
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def mrcr_doc_to_text(doc: dict[str, Any]) -> str:
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in mrcr_messages(doc))


def mrcr_score(response: str, answer: str, prefix: str) -> float:
    if not response.startswith(prefix):
        return 0.0
    return SequenceMatcher(None, response.removeprefix(prefix), answer.removeprefix(prefix)).ratio()


def mrcr_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"mrcr_score": mrcr_score(results[0], doc["answer"], doc["random_string_to_prepend"])}


FORCING_FIELDS = {"gsm8k": "question", "gpqa_diamond": "Question", "aime25": "problem"}


def forcing_prompt(task: str, row: dict[str, Any]) -> str:
    """The user turn the teacher-forced comparison sends for a raw dataset row (MRCR: the whole conversation)."""
    if task == "mrcr_v2":
        return mrcr_doc_to_text(row)
    return str(row[FORCING_FIELDS[task]])
