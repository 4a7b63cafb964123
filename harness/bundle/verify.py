"""`k3gate verify`: signature, digests, schemas, and every verdict re-derived from the raw records.

Each problem names the file it was found in, so a reviewer knows what was modified. The envelope kind is
chosen by which seal file the bundle carries; a Sigstore verifier slots in beside the ed25519 one.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

import bundles.schemas as schemas
from harness.bundle import (
    ENVELOPE,
    MANIFEST,
    PAYLOAD_TYPE,
    SEAL_FILES,
    SIGNER_KEY,
    SIGSTORE_BUNDLE,
    STATEMENT,
    archive,
    dsse,
)
from harness.bundle.canonical import NotCanonical, load_canonical, sha256_bytes, sha256_file
from harness.bundle.keys import keyid, openssh_line, parse_public
from harness.errors import UsageError
from harness.verdicts import StageVerdict, derive_outcome, derive_verdict, stored_flag_mismatches


@dataclass
class Signer:
    kind: str  # "ed25519"
    keyid: str
    identity: str  # the OpenSSH public key line
    trusted: bool | None  # None when no trusted keys were given: integrity only, identity unverified

    def describe(self) -> str:
        if self.trusted is None:
            return f"self-attested, unverified identity ({self.kind} key {self.identity})"
        state = "trusted" if self.trusted else "NOT trusted"
        return f"self-attested by a {state} {self.kind} key ({self.identity})"


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    bundle_id: str | None = None
    signer: Signer | None = None
    predicate: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


class _Stop(Exception):
    """A problem after which later checks would only repeat it."""


def _read_json(root: Path, rel: str, report: VerifyReport, schema: str | None = None) -> Any:
    path = root / rel
    if not path.is_file():
        report.problems.append(f"{rel}: missing")
        raise _Stop
    try:
        obj = load_canonical(path.read_bytes())
    except NotCanonical as exc:
        report.problems.append(f"{rel}: {exc}")
        raise _Stop from None
    if schema:
        bad = schemas.problems(schema, obj)
        if bad:
            report.problems.append(f"{rel}: schema: {bad[0]}")
            raise _Stop
    return obj


def _verify_ed25519(root: Path, trusted: list[Ed25519PublicKey] | None, report: VerifyReport) -> bytes:
    envelope = _read_json(root, ENVELOPE, report, "envelope")
    key_path = root / SIGNER_KEY
    if not key_path.is_file():
        report.problems.append(f"{SIGNER_KEY}: missing")
        raise _Stop
    text = key_path.read_text(errors="replace")
    try:
        keys = parse_public(text, SIGNER_KEY)
    except UsageError as exc:
        report.problems.append(f"{SIGNER_KEY}: {exc}")
        raise _Stop from None
    if len(keys) != 1 or text != openssh_line(keys[0], "k3gate-signer") + "\n":
        report.problems.append(f"{SIGNER_KEY}: not the single canonical ssh-ed25519 line k3gate writes")
        raise _Stop
    public = keys[0]
    if envelope["payloadType"] != PAYLOAD_TYPE:
        report.problems.append(f"{ENVELOPE}: payloadType {envelope['payloadType']!r} is not {PAYLOAD_TYPE}")
        raise _Stop
    try:
        payload = dsse.open_envelope(envelope, public)
    except dsse.EnvelopeError as exc:
        report.problems.append(f"{ENVELOPE} (signed with {SIGNER_KEY}): {exc}")
        raise _Stop from None
    is_trusted = None if trusted is None else any(keyid(k) == keyid(public) for k in trusted)
    report.signer = Signer("ed25519", keyid(public), openssh_line(public, "").strip(), is_trusted)
    if is_trusted is False:
        report.problems.append(f"{SIGNER_KEY}: signer {keyid(public)[:16]}… is not among the trusted keys given")
    return payload


# Envelope kinds by the seal file that marks them; the first present wins, so CI's Sigstore seal over the same
# statement outranks the runner's ed25519 one. Imported on use: sigstore is an optional extra.
ENVELOPE_VERIFIERS: dict[str, Callable[[Path, list[Ed25519PublicKey] | None, VerifyReport], bytes]] = {
    SIGSTORE_BUNDLE: lambda *a: importlib.import_module("harness.bundle.sigstore_verify").verify_seal(*a),
    ENVELOPE: _verify_ed25519,
}


def _check_statement(root: Path, payload: bytes, report: VerifyReport, seal: str = ENVELOPE) -> dict[str, Any]:
    statement_path = root / STATEMENT
    if not statement_path.is_file() or statement_path.read_bytes() != payload:
        report.problems.append(f"{STATEMENT}: differs from the payload signed in {seal}")
        raise _Stop
    statement = _read_json(root, STATEMENT, report, "statement")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        report.problems.append(f"{MANIFEST}: missing")
        raise _Stop
    digest = sha256_bytes(manifest_path.read_bytes())
    if statement["subject"][0]["digest"]["sha256"] != digest:
        report.problems.append(f"{MANIFEST}: its sha256 does not match the subject of the signed statement")
        raise _Stop
    report.bundle_id = digest
    return statement["predicate"]


def _check_manifest(root: Path, report: VerifyReport) -> None:
    manifest = _read_json(root, MANIFEST, report, "manifest")
    on_disk = set(archive.bundle_files(root)) - set(SEAL_FILES)
    for rel in sorted(set(manifest) - on_disk):
        report.problems.append(f"{rel}: listed in {MANIFEST} but missing")
    for rel in sorted(on_disk - set(manifest)):
        report.problems.append(f"{rel}: not listed in {MANIFEST} (added after signing)")
    for rel in sorted(set(manifest) & on_disk):
        if sha256_file(root / rel) != manifest[rel]:
            report.problems.append(f"{rel}: sha256 does not match {MANIFEST} (modified after signing)")


def _check_verdicts(root: Path, predicate: dict[str, Any], report: VerifyReport) -> None:
    claimed = {v["stage"]: v for v in predicate["verdicts"]}
    derived: list[StageVerdict] = []
    for stage in sorted(claimed):
        rel = f"stages/{stage}/records.json"
        if not (root / rel).is_file():
            report.problems.append(f"{rel}: missing, so the {stage} verdict cannot be re-derived")
            continue
        try:
            records = json.loads((root / rel).read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            report.problems.append(f"{rel}: not valid JSON ({exc})")
            continue
        bad = schemas.problems("records", records)
        if bad or records.get("stage") != stage:
            report.problems.append(f"{rel}: schema: {bad[0] if bad else 'stage name differs from its folder'}")
            continue
        for name in stored_flag_mismatches(records):
            report.problems.append(f"{rel}: check {name!r} claims a result its value and limit do not give")
        verdict = derive_verdict(records)
        derived.append(verdict)
        if verdict.to_json() != claimed[stage]:
            report.problems.append(
                f"{STATEMENT}: verdict of {stage} says {claimed[stage]['verdict']} but its records give "
                f"{verdict.verdict.value} ({verdict.reason})"
            )
    outcome = derive_outcome(derived, predicate["required"])
    if {"outcome": outcome.outcome.value, "reason": outcome.reason} != predicate["outcome"]:
        report.problems.append(
            f"{STATEMENT}: outcome says {predicate['outcome']['outcome']} but the verdicts give "
            f"{outcome.outcome.value} ({outcome.reason})"
        )
    env_rel = "env/environment.json"
    if (root / env_rel).is_file():
        try:
            bad = schemas.problems("environment", json.loads((root / env_rel).read_bytes()))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            bad = [f"not valid JSON ({exc})"]
        if bad:
            report.problems.append(f"{env_rel}: schema: {bad[0]}")


def verify_dir(root: Path, trusted: list[Ed25519PublicKey] | None = None) -> VerifyReport:
    report = VerifyReport()
    kinds = [name for name in ENVELOPE_VERIFIERS if (root / name).is_file()]
    if not kinds:
        report.problems.append(f"{ENVELOPE}: missing — the bundle is not signed")
        return report
    try:
        # Every seal present must verify over the same statement: an unchecked seal file would be bytes a
        # tamperer could change unnoticed. The first kind (CI's Sigstore seal, when present) names the signer.
        payload, signer = ENVELOPE_VERIFIERS[kinds[0]](root, trusted, report), report.signer
        for name in kinds[1:]:
            if ENVELOPE_VERIFIERS[name](root, trusted, report) != payload:
                report.problems.append(f"{name}: signs a different statement than {kinds[0]}")
                raise _Stop
        report.signer = signer
        report.predicate = _check_statement(root, payload, report, kinds[0])
        _check_manifest(root, report)
        _check_verdicts(root, report.predicate, report)
    except _Stop:
        pass
    return report


def verify(path: Path, trusted: list[Ed25519PublicKey] | None = None) -> VerifyReport:
    """Verify a bundle directory or its .tar.gz archive."""
    if path.is_dir():
        return verify_dir(path, trusted)
    if path.is_file():
        with tempfile.TemporaryDirectory(prefix="k3gate-verify-") as tmp:
            try:
                root = archive.unpack(path, Path(tmp))
            except archive.ArchiveError as exc:
                return VerifyReport(problems=[str(exc)])
            report = verify_dir(root, trusted)
            # The archive must be exactly the deterministic packing of what it holds: otherwise bytes that
            # decompress to the same content (gzip flags, padding bits) could change unnoticed.
            if archive.pack(root, Path(tmp) / "repacked.tar.gz").read_bytes() != path.read_bytes():
                report.problems.append(
                    "archive bytes differ from the deterministic packing of its contents "
                    "(modified after packing; to check the contents alone, verify the folder)"
                )
            report.problems = [f"{path.name}: {p}" for p in report.problems]
            return report
    raise UsageError(f"bundle {path} does not exist — give a bundle directory or its .tar.gz")
