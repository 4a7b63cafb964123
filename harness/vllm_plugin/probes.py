"""Finding a model's proof-of-path probe.

A probe is `install(model, decide) -> None`: it hooks the model's own per-step planning so that each decision
calls `decide("specialized" | "stock", reason)`. Probes are model-specific, so they live with the model's adapter
(for example in k3_decode/) and are registered under the `k3gate.path_probes` entry-point group, named by the
model class vLLM instantiates (e.g. `KimiLinearForCausalLM`). A model without a probe gets no coverage verdict.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from harness.vllm_plugin import PROBES_ENV

GROUP = "k3gate.path_probes"
Probe = Callable[[Any, Callable[[str, str], None]], None]


def _from_env() -> dict[str, str]:
    found = {}
    for item in filter(None, (os.environ.get(PROBES_ENV) or "").split(";")):
        arch, _, target = item.partition("=")
        if arch.strip() and target.strip():
            found[arch.strip()] = target.strip()
    return found


def find(architecture: str) -> str | None:
    """The probe target ("module:function") for a model class, or None."""
    if target := _from_env().get(architecture):
        return target
    for ep in entry_points(group=GROUP):
        if ep.name == architecture:
            return ep.value
    return None


def load(target: str) -> Probe:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
