"""Sigstore seals: a Sigstore bundle over the statement, verified offline with an identity policy.

CI's attest job signs the bundle's own statement.json keyless (sigstore's `sign_dsse`) and adds the Sigstore
bundle as `statement.sigstore.json`. sigstore's `verify_dsse` checks the Fulcio certificate chain, the
transparency-log proof, the signature and the identity, then hands back the payload: it does not check the
statement's subjects against any file, so that is done here before the payload goes on to the common checks.

The trusted root is the one shipped inside the installed sigstore package (or a file the policy names), never
one fetched at verification time: verifying needs no network and gives the same answer tomorrow.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from cryptography import x509

from harness.bundle import PAYLOAD_TYPE, PREDICATE_TYPE, SIGSTORE_BUNDLE, STATEMENT_TYPE, sigstore_policy
from harness.bundle.canonical import sha256_file
from harness.bundle.sigstore_policy import INSTANCES, IdentityPolicy
from harness.bundle.verify import Signer, VerifyReport, _Stop
from harness.errors import UsageError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

# Fulcio certificate extensions (https://github.com/sigstore/fulcio/blob/main/docs/oid-info.md) shown to a
# reviewer: which run signed, from which commit of the workflow's repository, on which kind of runner.
_RUN_INVOCATION = "1.3.6.1.4.1.57264.1.21"
_SOURCE_DIGEST = "1.3.6.1.4.1.57264.1.13"
_RUNNER_ENVIRONMENT = "1.3.6.1.4.1.57264.1.11"
_BUILD_SIGNER = "1.3.6.1.4.1.57264.1.9"
_BUILD_TRIGGER = "1.3.6.1.4.1.57264.1.20"


class SealError(ValueError):
    """The Sigstore seal does not hold; the message is one line naming what failed."""


def _sigstore() -> Any:
    try:
        import sigstore.errors
        import sigstore.models
        import sigstore.verify
    except ImportError:
        raise UsageError(
            f"this bundle carries a Sigstore seal ({SIGSTORE_BUNDLE}) but the sigstore package is not installed "
            "— pip install 'k3gate[sigstore]'"
        ) from None
    return sigstore


def shipped_trusted_root(instance: str) -> Path:
    """The trusted_root.json that the installed sigstore package embeds for `instance`."""
    _sigstore()
    name = quote(INSTANCES[instance], safe="")
    path = Path(str(resources.files("sigstore") / "_store" / name / "trusted_root.json"))
    if not path.is_file():
        raise UsageError(
            f"the installed sigstore package ships no trusted root for {instance} — reinstall 'k3gate[sigstore]' "
            "or pass --sigstore-trusted-root FILE"
        )
    return path


def sigstore_policy_for(policy: IdentityPolicy) -> Any:
    """The sigstore verification policy: every field of the identity must match the certificate."""
    p = _sigstore().verify.policy
    return p.AllOf(
        [
            p.Identity(identity=policy.signer_uri, issuer=policy.issuer),
            p.OIDCIssuerV2(policy.issuer),
            p.OIDCSourceRepositoryURI(policy.repository_uri),
            p.OIDCBuildSignerURI(policy.signer_uri),
            p.OIDCRunnerEnvironment(policy.runner_environment),
        ]
    )


def open_seal(data: bytes, policy: IdentityPolicy) -> tuple[bytes, x509.Certificate]:
    """The payload of a Sigstore bundle that verifies offline under `policy`, and its signing certificate."""
    sigstore = _sigstore()
    try:
        bundle = sigstore.models.Bundle.from_json(data)
    except Exception as exc:  # sigstore raises its own errors, pydantic's and json's for malformed input
        raise SealError(f"not a Sigstore bundle ({_one_line(exc)}) — re-download it or re-run the attest job") from None
    root_file = Path(policy.trusted_root) if policy.trusted_root else shipped_trusted_root(policy.instance)
    try:
        trusted_root = sigstore.models.TrustedRoot.from_file(str(root_file))
    except Exception as exc:
        raise UsageError(
            f"trusted root {root_file} could not be read ({_one_line(exc)}) — give a trusted_root.json"
        ) from None
    verifier = sigstore.verify.Verifier(trusted_root=trusted_root)
    try:
        payload_type, payload = verifier.verify_dsse(bundle, sigstore_policy_for(policy))
    except sigstore.errors.Error as exc:
        raise SealError(f"does not verify for the identity {policy.describe()}: {_one_line(exc)}") from None
    if payload_type != PAYLOAD_TYPE:
        raise SealError(f"signs a payload of type {payload_type!r}, not {PAYLOAD_TYPE}")
    return payload, bundle.signing_certificate


def parse_statement(payload: bytes) -> dict[str, Any]:
    """The signed payload as an in-toto Statement v1 carrying a k3gate result."""
    try:
        statement = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SealError(f"the signed payload is not JSON ({exc})") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise SealError(f"the signed payload is not an in-toto statement ({STATEMENT_TYPE})")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise SealError(
            f"the signed statement's predicateType is {statement.get('predicateType')!r}, not {PREDICATE_TYPE}"
        )
    return statement


def subject_problems(statement: dict[str, Any], root: Path) -> list[str]:
    """Every subject must name a file inside `root` whose sha256 is the one signed."""
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects:
        return ["the signed statement has no subjects"]
    problems = []
    for subject in subjects:
        name = subject.get("name") if isinstance(subject, dict) else None
        want = subject.get("digest", {}).get("sha256") if isinstance(subject, dict) else None
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or name.startswith("/") or ".." in parts:
            problems.append(f"subject {name!r} is not a path inside the bundle")
        elif not isinstance(want, str):
            problems.append(f"subject {name}: no sha256 digest signed")
        elif not (root / name).is_file():
            problems.append(f"subject {name}: signed, but the file is missing")
        elif sha256_file(root / name) != want:
            problems.append(f"subject {name}: sha256 differs from the signed digest (modified after signing)")
    return problems


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _utf8_extension(cert: x509.Certificate, oid: str) -> str:
    """A Fulcio v2 extension's value (a DER UTF8String), or "" when the certificate lacks it."""
    try:
        raw = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value.value
    except x509.ExtensionNotFound:
        return ""
    if len(raw) < 2 or raw[0] != 0x0C:
        return ""
    length, start = raw[1], 2
    if length & 0x80:  # long form: the low bits give how many length bytes follow
        count = length & 0x7F
        length, start = int.from_bytes(raw[2 : 2 + count], "big"), 2 + count
    return raw[start : start + length].decode("utf-8", errors="replace")


@dataclass
class SigstoreSigner(Signer):
    """A signer proven by a Fulcio certificate: the CI workflow run, not a key someone holds."""

    instance: str = "production"
    run: str = ""
    source_commit: str = ""
    runner: str = ""
    trigger: str = ""

    @classmethod
    def from_certificate(cls, cert: x509.Certificate, policy: IdentityPolicy) -> SigstoreSigner:
        from cryptography.hazmat.primitives import serialization

        fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
        return cls(
            kind="sigstore",
            keyid=fingerprint,
            identity=_utf8_extension(cert, _BUILD_SIGNER) or policy.signer_uri,
            trusted=True,
            instance=policy.instance,
            run=_utf8_extension(cert, _RUN_INVOCATION),
            source_commit=_utf8_extension(cert, _SOURCE_DIGEST),
            runner=_utf8_extension(cert, _RUNNER_ENVIRONMENT),
            trigger=_utf8_extension(cert, _BUILD_TRIGGER),
        )

    def describe(self) -> str:
        run = f", run {self.run}" if self.run else ""
        on = f" on {self.trigger}" if self.trigger else ""
        return (
            f"CI-attested: Sigstore keyless ({self.instance}) by workflow {self.identity}{on}{run}, "
            f"{self.runner or 'unknown'} runner; matches the identity policy"
        )


def verify_seal(root: Path, trusted: list[Ed25519PublicKey] | None, report: VerifyReport) -> bytes:
    """`k3gate verify`'s check of a Sigstore-sealed bundle; returns the signed statement bytes.

    `trusted` (ed25519 keys) does not apply: a Sigstore seal's signer is checked against the identity policy.
    """
    policy = sigstore_policy.load()
    try:
        payload, cert = open_seal((root / SIGSTORE_BUNDLE).read_bytes(), policy)
        statement = parse_statement(payload)
    except SealError as exc:
        report.problems.append(f"{SIGSTORE_BUNDLE}: {exc}")
        raise _Stop from None
    bad = subject_problems(statement, root)
    if bad:
        report.problems.extend(f"{SIGSTORE_BUNDLE}: {p}" for p in bad)
        raise _Stop
    report.signer = SigstoreSigner.from_certificate(cert, policy)
    return payload
