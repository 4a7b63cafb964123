"""Named TOML configs: find, parse, validate against the schema and the subject's scope, resolve the tier."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from harness.errors import ConfigError
from harness.subjects import load_subject, subject_names

TIERS = ("smoke", "standard", "full")


@dataclass(frozen=True)
class GateConfig:
    name: str
    source: str  # "builtin" or the file path the user gave
    text: str  # the TOML exactly as read, kept in the bundle
    data: dict[str, Any]
    tier: str

    @property
    def subject(self) -> str:
        return self.data["subject"]

    @property
    def hardware(self) -> dict[str, Any]:
        return self.data["hardware"]

    @property
    def required_stages(self) -> list[str]:
        return list(self.data["tiers"][self.tier]["required"])

    def resolved(self) -> dict[str, Any]:
        """The config as the run used it (tier applied), for the statement and `show-config`."""
        return {**self.data, "tier": self.tier}


@cache
def _schema() -> dict[str, Any]:
    return json.loads(resources.files("harness.config").joinpath("schema.json").read_text())


def builtin_names() -> list[str]:
    folder = resources.files("harness.config.configs")
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def _read(name_or_path: str) -> tuple[str, str, str]:
    """(name hint, source, text) for a builtin name or a path to a TOML file."""
    if name_or_path in builtin_names():
        text = resources.files("harness.config.configs").joinpath(f"{name_or_path}.toml").read_text()
        return name_or_path, "builtin", text
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(
                f"config file {path} does not exist — give an existing .toml file or one of: "
                f"{', '.join(builtin_names())}"
            )
        return path.stem, str(path), path.read_text()
    raise ConfigError(
        f"unknown config {name_or_path!r} — use one of: {', '.join(builtin_names())} "
        "(see `k3gate configs`) or a path to a .toml file"
    )


def _schema_error_line(err: jsonschema.ValidationError) -> str:
    key = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        return f"{key}: unknown key {', '.join(map(repr, extra))} — allowed keys here: {', '.join(allowed)}"
    if err.validator == "required":
        return f"{key}: {err.message} — add it (see `k3gate show-config cpu-smoke` for an example)"
    if err.validator == "enum":
        return f"{key}: {err.instance!r} is not allowed — use one of {', '.join(map(repr, err.validator_value))}"
    if err.validator == "type":
        return f"{key}: {err.instance!r} is not of type {err.validator_value} — write a {err.validator_value}"
    if err.validator in ("minimum", "maximum"):
        return f"{key}: {err.instance!r} is out of range — it must be {err.validator} {err.validator_value}"
    return f"{key}: {err.message} — fix this value"


def _generic_issues(name: str, data: dict[str, Any]) -> list[str]:
    from harness.stages import stage_names  # late: stages import configs for their own needs

    issues = []
    if data["name"] != name:
        issues.append(f"name: {data['name']!r} differs from the file name {name!r} — make them equal")
    if data["subject"] not in subject_names():
        issues.append(f"subject: unknown subject {data['subject']!r} — use one of {', '.join(subject_names())}")
    hw = data["hardware"]
    if (hw["gpu"] == "none") != (hw["gpu_count"] == 0):
        issues.append("hardware.gpu_count: must be 0 exactly when hardware.gpu is 'none' — make them agree")
    # A distributed config on the CPU runs its ranks as processes (gloo); on GPUs each rank needs its own GPU.
    distributed = data["parallel"].get("mode") == "distributed"
    if distributed and hw["gpu"] != "none" and hw["gpu_count"] < max(data["parallel"]["tp"]):
        issues.append(
            f"hardware.gpu_count: {hw['gpu_count']} GPUs cannot hold TP={max(data['parallel']['tp'])} "
            "— raise gpu_count or use parallel.mode = 'per-rank-shapes'"
        )
    known = stage_names()
    for tier, spec in data["tiers"].items():
        for stage in spec["required"]:
            if stage not in known:
                issues.append(f"tiers.{tier}.required: unknown stage {stage!r} — use stages from: {', '.join(known)}")
    return issues


def validate(name: str, data: dict[str, Any]) -> None:
    errors = sorted(jsonschema.Draft202012Validator(_schema()).iter_errors(data), key=lambda e: e.path)
    if errors:
        raise ConfigError(f"config {name}: {_schema_error_line(errors[0])}")
    issues = _generic_issues(name, data)
    if not issues:
        issues = [i.line() for i in load_subject(data["subject"]).config_issues(data)]
    if not issues:
        from harness.perf.plan import config_issues as perf_issues  # late: keeps config loading light

        issues = perf_issues(data)  # a bad sweep grammar is a usage error at load, not a stage ERROR later
    if issues:
        more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
        raise ConfigError(f"config {name}: {issues[0]}{more}")


def load_config(name_or_path: str, tier: str | None = None) -> GateConfig:
    name, source, text = _read(name_or_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {name}: not valid TOML ({exc}) — fix the syntax in {source}") from None
    validate(name, data)
    if tier is not None and tier not in TIERS:
        raise ConfigError(f"--tier {tier!r} is not a tier — use one of {', '.join(TIERS)}")
    return GateConfig(name=name, source=source, text=text, data=data, tier=tier or data["tier"])
