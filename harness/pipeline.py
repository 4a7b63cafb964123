"""`k3gate run`: run the selected stages, derive verdicts, write and seal the bundle.

The bundle is assembled in `<out>.partial/` and renamed only once sealed, so an interrupted run never leaves
a folder that looks like a finished bundle.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import bundles.schemas as schemas
from harness import environment
from harness.bundle import archive, writer
from harness.bundle.canonical import finite, sha256_bytes
from harness.bundle.keys import SigningKey
from harness.bundle.verify import verify_dir
from harness.config.loader import GateConfig
from harness.errors import UsageError
from harness.hardware import Hardware
from harness.report import markdown, page
from harness.stages import BUNDLE_STAGE, Stage, StageContext, registered, stage_names
from harness.subjects import load_subject
from harness.verdicts import Check, GateResult, StageRecords, StageVerdict, derive_outcome, derive_verdict

ALWAYS = ("environment", BUNDLE_STAGE)  # a bundle without these could not be reproduced or trusted

# (event, stage, detail): "start" / "progress" / "done"
Listener = Callable[[str, str, str], None]


@dataclass
class RunResult:
    bundle_dir: Path
    archive: Path
    bundle_id: str
    verdicts: list[StageVerdict]
    outcome: GateResult
    selected: list[str] = field(default_factory=list)


def select_stages(requested: list[str] | None) -> list[str]:
    known = stage_names()
    if requested is None:
        return known
    unknown = [s for s in requested if s not in known]
    if unknown:
        raise UsageError(f"--stages: unknown stage {unknown[0]!r} — choose from {', '.join(known)}")
    return [s for s in known if s in requested or s in ALWAYS]


def default_out(config: GateConfig, now: dt.datetime) -> Path:
    return Path("k3gate-out") / f"{config.name}-{now.strftime('%Y%m%dT%H%M%SZ')}"


def prepare_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already exists and is not empty — choose a new folder")
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def _run_one(stage: Stage, ctx: StageContext) -> StageRecords:
    cfg = ctx.config
    if stage.needs_hardware:
        missing = ctx.hardware.satisfies(cfg.hardware["gpu"], cfg.hardware["gpu_count"])
        if missing:
            return StageRecords.not_run(stage.name, f"config {cfg.name} {missing}")
    try:
        records = stage.run(ctx)
    except Exception as exc:  # a crashing stage is evidence too: record it and go on to the bundle
        path, rel = ctx.evidence_path(stage.name, "traceback.txt")
        path.write_text(traceback.format_exc())
        return StageRecords.error(stage.name, f"{type(exc).__name__}: {exc} (traceback in {rel})", [rel])
    if records.stage != stage.name:
        raise RuntimeError(f"stage {stage.name} returned records for {records.stage}")
    return records


def _write_records(bundle_dir: Path, records: StageRecords) -> dict:
    """Write the records as strict JSON (NaN/Inf become null) and return exactly what was written, so the
    verdict is derived from the same data `k3gate verify` will read."""
    folder = bundle_dir / "stages" / records.stage
    folder.mkdir(parents=True, exist_ok=True)
    data = finite(records.to_json())
    (folder / "records.json").write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    return data


def _bundle_records(bundle_dir: Path, ran: list[str]) -> StageRecords:
    """The bundle stage's own evidence: every record valid, every listed evidence file present."""
    invalid, missing_evidence = [], []
    for stage in ran:
        rel = f"stages/{stage}/records.json"
        data = json.loads((bundle_dir / rel).read_text())
        if schemas.problems("records", data):
            invalid.append(rel)
        missing_evidence += [e for e in data["evidence"] if not (bundle_dir / e).is_file()]
    env_ok = (bundle_dir / "env" / "environment.json").is_file()
    checks = [
        Check("stage records valid against the schema", len(invalid), "==", 0, ", ".join(invalid)),
        Check("evidence files present", len(missing_evidence), "==", 0, ", ".join(missing_evidence)),
        Check("environment captured", env_ok, "==", True),
        Check("stage records written", len(ran), "==", len(set(ran))),
    ]
    return StageRecords(stage=BUNDLE_STAGE, checks=checks, metrics={"stages_recorded": len(ran)})


def run(
    config: GateConfig,
    hardware: Hardware,
    key: SigningKey,
    out: Path | None = None,
    stages: list[str] | None = None,
    listener: Listener | None = None,
) -> RunResult:
    notify = listener or (lambda *_: None)
    started = dt.datetime.now(dt.UTC)
    selected = select_stages(stages)
    final = out or default_out(config, started)
    bundle_dir = prepare_out(final)
    (bundle_dir / "config.toml").write_text(config.text)

    def progress_for(name: str):
        return lambda what, frac: notify("progress", name, what if frac is None else f"{what} ({frac:.0%})")

    verdicts: list[StageVerdict] = []
    ran: list[str] = []
    for stage in registered():
        if stage.name not in selected:
            continue
        notify("start", stage.name, stage.description)
        ctx = StageContext(config=config, hardware=hardware, bundle_dir=bundle_dir, progress=progress_for(stage.name))
        records = _run_one(stage, ctx)
        written = _write_records(bundle_dir, records)
        ran.append(stage.name)
        verdict = derive_verdict(written)
        verdicts.append(verdict)
        notify("done", stage.name, f"{verdict.verdict.value}: {verdict.reason}")

    notify("start", BUNDLE_STAGE, "manifest, signed statement, archive")
    bundle_records = _bundle_records(bundle_dir, ran)
    verdicts.append(derive_verdict(_write_records(bundle_dir, bundle_records)))
    required = [s for s in config.required_stages if s in selected]
    outcome = derive_outcome(verdicts, required)
    env_summary = json.loads((bundle_dir / "env" / "environment.json").read_text())
    predicate = {
        "k3gate_version": environment.k3gate_version(),
        "config": {
            "name": config.name,
            "source": config.source,
            "sha256": sha256_bytes(config.text.encode()),
            "resolved": config.resolved(),
        },
        "subject": load_subject(config.subject).describe(),
        "tier": config.tier,
        "stages_selected": selected,
        "required": required,
        "verdicts": [v.to_json() for v in verdicts],
        "outcome": {"outcome": outcome.outcome.value, "reason": outcome.reason},
        "environment": {k: env_summary[k] for k in ("os", "python", "torch", "gpu", "env")},
        "git": env_summary["k3gate"]["git"],
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    report_dir = bundle_dir / "report"
    report_dir.mkdir()
    (report_dir / "report.md").write_text(markdown.render(predicate, bundle_dir))
    (report_dir / "report.html").write_text(page.render(predicate, bundle_dir))
    bundle_id = writer.seal(bundle_dir, predicate, key)
    check = verify_dir(bundle_dir)
    if not check.ok:
        raise RuntimeError(f"the bundle failed its own verification: {check.problems[0]}")
    if final.exists():
        final.rmdir()
    bundle_dir.rename(final)
    tar = archive.pack(final, final.with_name(final.name + ".tar.gz"))
    notify("done", BUNDLE_STAGE, f"{verdicts[-1].verdict.value}: bundle {bundle_id[:16]}…")
    return RunResult(final, tar, bundle_id, verdicts, outcome, selected)
