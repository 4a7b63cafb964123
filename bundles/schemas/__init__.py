"""JSON schemas of everything a k3gate result bundle holds."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import jsonschema


@cache
def schema(name: str) -> dict[str, Any]:
    return json.loads(resources.files("bundles.schemas").joinpath(f"{name}.schema.json").read_text())


def problems(name: str, instance: Any) -> list[str]:
    """Schema violations as one-liners `path: message`, empty when the instance is valid."""
    validator = jsonschema.Draft202012Validator(schema(name))
    out = []
    for err in sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {err.message}")
    return out
