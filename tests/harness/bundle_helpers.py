"""Builders shared by the bundle tests: one real bundle from a cpu-smoke run."""

from __future__ import annotations

import json
from pathlib import Path

from harness import pipeline
from harness.bundle import STATEMENT, keys, writer
from harness.config.loader import load_config
from harness.hardware import detect


def make_bundle(tmp: Path, key_path: Path | None = None, stages: list[str] | None = None):
    key = keys.generate(key_path or tmp / "signer.key")
    result = pipeline.run(load_config("cpu-smoke"), detect(), key, tmp / "bundle", stages)
    return result, key


def reseal(root: Path, key: keys.SigningKey, edit_predicate=None) -> None:
    """What an attacker with their own key can do: edit, then re-seal the bundle consistently."""
    predicate = json.loads((root / STATEMENT).read_text())["predicate"]
    if edit_predicate:
        edit_predicate(predicate)
    writer.seal(root, predicate, key)
