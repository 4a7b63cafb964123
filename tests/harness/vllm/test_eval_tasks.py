"""The eval task data: fixtures in the real datasets' schemas, YAMLs that lm-eval can point at them, scoring."""

from __future__ import annotations

import json

import pytest

from evals.tasks import k3gate_utils
from harness.runners import eval_tasks

SCHEMAS = {
    "gsm8k": {"question", "answer"},
    "gpqa_diamond": {"Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"},
    "aime25": {"problem", "answer", "id"},
    "mrcr_v2": {"prompt", "answer", "random_string_to_prepend", "n_needles", "desired_msg_index", "total_messages"},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_fixture_rows_have_the_real_schema(name):
    spec = eval_tasks.task_specs()[name]
    rows = eval_tasks.fixture_rows(spec)
    assert rows and all(SCHEMAS[name] <= set(r) for r in rows)
    assert spec.margin > 0 and spec.min_items >= len(rows)


def test_rendered_task_points_lm_eval_at_the_rows(tmp_path):
    spec = eval_tasks.task_specs()["mrcr_v2"]
    yaml_path, digest = eval_tasks.write_task(spec, eval_tasks.fixture_rows(spec), tmp_path)
    text = yaml_path.read_text()
    assert eval_tasks.PLACEHOLDER not in text and str((tmp_path / "mrcr_v2.jsonl").resolve()) in text
    assert (tmp_path / eval_tasks.UTILS).is_file() and len(digest) == 64


def test_mrcr_variant_filter_and_score():
    spec = eval_tasks.task_specs()["mrcr_v2"]
    rows = [{"n_needles": 2}, {"n_needles": 4}, {"n_needles": 8}]
    assert eval_tasks.select_rows(spec, rows) == [{"n_needles": 2}]
    assert k3gate_utils.mrcr_score("ab12 hello", "ab12 hello", "ab12") == 1.0
    assert k3gate_utils.mrcr_score("hello", "ab12 hello", "ab12") == 0.0  # must start with the random string
    assert 0 < k3gate_utils.mrcr_score("ab12 help", "ab12 hello", "ab12") < 1
    row = eval_tasks.fixture_rows(spec)[0]
    text = k3gate_utils.mrcr_doc_to_text(row)
    assert text.startswith("User: ") and "Assistant: " in text and len(json.loads(row["prompt"])) > 2


class Rows(list):
    def map(self, fn):  # the one Dataset method process_docs uses
        return Rows(fn(r) for r in self)


def test_gpqa_choice_order_is_fixed_and_the_letter_names_the_correct_answer():
    spec = eval_tasks.task_specs()["gpqa_diamond"]
    rows = Rows(eval_tasks.fixture_rows(spec))
    first, second = k3gate_utils.gpqa_process_docs(rows), k3gate_utils.gpqa_process_docs(rows)
    assert first == second
    for raw, doc in zip(rows, first, strict=True):
        letter = doc["answer_letter"]
        assert doc[f"choice{'ABCD'.index(letter) + 1}"] == raw["Correct Answer"]


def test_bad_jsonl_is_one_clear_line(tmp_path):
    bad = tmp_path / "gsm8k.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"gsm8k.jsonl line 2 is not JSON"):
        eval_tasks.read_rows(bad)
