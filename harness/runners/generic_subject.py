"""The `vllm-generic` subject: any model vLLM serves that has no adapter of its own (in CI, the tiny Llama).

It has no scope file and no specialized decode: `decode_backend` reaches the model but changes nothing, so both
arms run the same code. The gate can still exercise every vLLM stage end to end against it; what it cannot do is
prove a decode path, and the stages say so (NOT_RUN) instead of passing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.subjects import ConfigIssue

NOTE = "no specialized decode: decode_backend changes nothing, both arms run the same code"


@dataclass(frozen=True)
class GenericVllmSubject:
    name: str = "vllm-generic"

    def config_issues(self, config: dict[str, Any]) -> list[ConfigIssue]:
        if "vllm" not in config:
            return [ConfigIssue("vllm", f"subject {self.name} drives a vLLM server but has no vllm table", "add one")]
        return []

    def describe(self) -> dict[str, Any]:
        return {"subject": self.name, "scope_file": None, "specialized_decode": False, "note": NOTE}


VLLM_GENERIC = GenericVllmSubject()
