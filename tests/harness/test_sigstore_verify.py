"""The Sigstore seal: real staging bundles verified offline, identity policy, subjects, and the verify() glue."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

from harness.bundle import PAYLOAD_TYPE, SIGSTORE_BUNDLE, STATEMENT, archive, sigstore_policy, sigstore_verify
from harness.bundle.canonical import sha256_file
from harness.bundle.sigstore_policy import IdentityPolicy
from harness.bundle.sigstore_verify import SealError, open_seal, parse_statement, subject_problems
from harness.bundle.verify import verify, verify_dir
from harness.cli import main
from harness.errors import UsageError
from tests.harness.bundle_helpers import make_bundle

ASSETS = Path(__file__).with_name("sigstore_assets")
DSSE_BUNDLE = ASSETS / "a.dsse.staging-rekor-v2.txt.sigstore.json"
MESSAGE_BUNDLE = ASSETS / "staging-rekor-v2.txt.sigstore.json"
# The identity in the upstream vectors' certificates: sigstore-conformance's beacon workflow, staging instance.
BEACON = {
    "instance": "staging",
    "issuer": "https://token.actions.githubusercontent.com",
    "repository": "sigstore-conformance/extremely-dangerous-public-oidc-beacon",
    "workflow": ".github/workflows/extremely-dangerous-oidc-beacon.yml",
    "ref": "refs/heads/main",
    "runner_environment": "github-hosted",
}
SLSA = "https://slsa.dev/provenance/v1"


def beacon(**changes: str) -> IdentityPolicy:
    return IdentityPolicy(**{**BEACON, **changes})


@pytest.fixture
def beacon_env(monkeypatch):
    """verify() reads the policy from the environment: point it at the beacon's identity."""
    for key, value in BEACON.items():
        monkeypatch.setenv(f"K3GATE_SIGSTORE_{key.upper()}", value)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("verification tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def smoke_bundle(tmp_path_factory) -> Path:
    # The environment stage alone: a real, complete bundle, without the minutes of numerics a full run takes.
    result, _ = make_bundle(tmp_path_factory.mktemp("smoke"), stages=["environment"])
    return result.bundle_dir


@pytest.fixture
def bundle_dir(smoke_bundle, tmp_path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(smoke_bundle, root)
    return root


def edited(path: Path, edit) -> bytes:
    data = json.loads(path.read_text())
    edit(data)
    return json.dumps(data).encode()


# --- real bundles, real cryptography, no network ------------------------------------------------------------


def test_upstream_dsse_bundle_verifies_offline_for_its_identity(no_network):
    payload, cert = open_seal(DSSE_BUNDLE.read_bytes(), beacon())
    statement = json.loads(payload)
    assert statement["subject"][0]["name"] == "a.txt"
    assert statement["predicateType"] == SLSA
    signer = sigstore_verify.SigstoreSigner.from_certificate(cert, beacon())
    assert signer.identity == beacon().signer_uri
    assert signer.runner == "github-hosted"
    assert signer.run.endswith("/actions/runs/25821282059/attempts/1")
    assert "CI-attested" in signer.describe() and "self-attested" not in signer.describe()


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"repository": "k3gate/k3gate"}, "SANs do not match"),
        ({"workflow": ".github/workflows/gpu-gate.yml"}, "SANs do not match"),
        ({"ref": "refs/pull/1/merge"}, "SANs do not match"),
        ({"issuer": "https://accounts.google.com"}, "OIDCIssuer"),
        ({"runner_environment": "self-hosted"}, "OIDCRunnerEnvironment does not match"),
    ],
)
def test_a_wrong_identity_is_refused(no_network, change, expect):
    with pytest.raises(SealError, match=expect) as info:
        open_seal(DSSE_BUNDLE.read_bytes(), beacon(**change))
    assert "\n" not in str(info.value)


def test_the_production_root_refuses_a_staging_signature(no_network):
    with pytest.raises(SealError, match="does not verify"):
        open_seal(DSSE_BUNDLE.read_bytes(), beacon(instance="production"))


def _tamper_payload(b: dict) -> None:
    statement = json.loads(base64.b64decode(b["dsseEnvelope"]["payload"]))
    statement["subject"][0]["digest"]["sha256"] = "0" * 64
    b["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()


def _tamper_signature(b: dict) -> None:
    sig = bytearray(base64.b64decode(b["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-1] ^= 1
    b["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()


def _tamper_payload_type(b: dict) -> None:
    b["dsseEnvelope"]["payloadType"] = "application/json"


def _tamper_log_proof(b: dict) -> None:
    b["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["hashes"][0] = base64.b64encode(b"\0" * 32).decode()


@pytest.mark.parametrize("tamper", [_tamper_payload, _tamper_signature, _tamper_payload_type, _tamper_log_proof])
def test_a_tampered_bundle_is_refused(no_network, tamper):
    with pytest.raises(SealError):
        open_seal(edited(DSSE_BUNDLE, tamper), beacon())


def test_a_bundle_without_a_dsse_envelope_is_refused(no_network, monkeypatch):
    # This vector's signer is a person, not a workflow: open the identity check to reach the envelope check.
    from sigstore.verify.policy import UnsafeNoOp

    with pytest.raises(SealError, match="OIDCIssuer does not match"):
        open_seal(MESSAGE_BUNDLE.read_bytes(), beacon())
    monkeypatch.setattr(sigstore_verify, "sigstore_policy_for", lambda _policy: UnsafeNoOp())
    with pytest.raises(SealError, match="without a DSSE envelope"):
        open_seal(MESSAGE_BUNDLE.read_bytes(), beacon())


@pytest.mark.parametrize(
    "data", [b"", b"{}", b"not json", b'{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}']
)
def test_garbage_is_not_a_sigstore_bundle(data):
    with pytest.raises(SealError, match="not a Sigstore bundle"):
        open_seal(data, beacon())


# --- the statement and its subjects ---------------------------------------------------------------------------


def test_a_statement_of_another_predicate_type_is_refused():
    payload, _ = open_seal(DSSE_BUNDLE.read_bytes(), beacon())
    with pytest.raises(SealError, match=re.escape(f"predicateType is '{SLSA}'")):
        parse_statement(payload)


@pytest.mark.parametrize(
    ("payload", "expect"),
    [(b"\xff", "not JSON"), (b"[]", "not an in-toto statement"), (b'{"_type": "x"}', "not an in-toto statement")],
)
def test_a_payload_that_is_no_statement_is_refused(payload, expect):
    with pytest.raises(SealError, match=expect):
        parse_statement(payload)


def test_sigstore_accepts_a_statement_whose_subject_is_not_the_file_and_we_do_not(tmp_path):
    # The upstream vector verifies, yet its subject digest is not the sha256 of the sample file shipped with it:
    # exactly the gap verify_dsse leaves to the caller.
    payload, _ = open_seal(DSSE_BUNDLE.read_bytes(), beacon())
    shutil.copy(ASSETS / "a.txt", tmp_path / "a.txt")
    assert subject_problems(json.loads(payload), tmp_path) == [
        "subject a.txt: sha256 differs from the signed digest (modified after signing)"
    ]


def subjects(*pairs):
    return {"subject": [{"name": n, "digest": {"sha256": d}} for n, d in pairs]}


def test_subjects_that_match_their_files_pass_and_any_change_fails(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "stages" / "b.json").write_text("{}")
    good = subjects(
        ("a.txt", sha256_file(tmp_path / "a.txt")), ("stages/b.json", sha256_file(tmp_path / "stages/b.json"))
    )
    assert subject_problems(good, tmp_path) == []
    (tmp_path / "stages" / "b.json").write_text("{ }")
    assert subject_problems(good, tmp_path) == [
        "subject stages/b.json: sha256 differs from the signed digest (modified after signing)"
    ]


@pytest.mark.parametrize(
    ("statement", "expect"),
    [
        ({"subject": []}, "no subjects"),
        ({}, "no subjects"),
        (subjects(("../outside", "0" * 64)), "not a path inside the bundle"),
        (subjects(("/etc/hostname", "0" * 64)), "not a path inside the bundle"),
        (subjects(("", "0" * 64)), "not a path inside the bundle"),
        ({"subject": [{"name": "a.txt", "digest": {"sha512": "00"}}]}, "no sha256 digest"),
        (subjects(("missing.txt", "0" * 64)), "the file is missing"),
    ],
)
def test_bad_subjects_are_named(tmp_path, statement, expect):
    (tmp_path / "a.txt").write_text("a")
    problems = subject_problems(statement, tmp_path)
    assert len(problems) == 1 and expect in problems[0]


# --- verify(): a k3gate bundle with a Sigstore seal -----------------------------------------------------------


def test_the_sigstore_seal_outranks_the_ed25519_one_and_its_checks_run(bundle_dir, beacon_env, no_network):
    # A real seal by someone else's workflow over someone else's statement: the cryptography and the identity
    # pass (it is the beacon's identity), and the statement is then refused for what it is.
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    report = verify_dir(bundle_dir)
    assert report.problems == [
        f"{SIGSTORE_BUNDLE}: the signed statement's predicateType is '{SLSA}', not https://k3gate.dev/result-bundle/v1"
    ]


def test_a_seal_from_another_identity_fails_verify(bundle_dir, beacon_env, monkeypatch):
    monkeypatch.setenv("K3GATE_SIGSTORE_REPOSITORY", "k3gate/k3gate")
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    report = verify_dir(bundle_dir)
    assert len(report.problems) == 1 and "SANs do not match" in report.problems[0]
    assert report.signer is None


@pytest.fixture
def accepting_verifier(monkeypatch):
    """sigstore's verify_dsse stubbed to accept and return statement.json: tests the glue around it."""
    from sigstore.verify import Verifier

    def fake(self, bundle, policy):
        return PAYLOAD_TYPE, fake.payload

    monkeypatch.setattr(Verifier, "verify_dsse", fake)
    return fake


def test_a_sealed_bundle_verifies_through_the_glue_and_edits_still_fail(bundle_dir, beacon_env, accepting_verifier):
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes()
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    report = verify_dir(bundle_dir)
    assert report.ok, report.problems
    assert isinstance(report.signer, sigstore_verify.SigstoreSigner)
    assert "extremely-dangerous-oidc-beacon.yml@refs/heads/main" in report.signer.describe()

    packed = archive.pack(bundle_dir, bundle_dir.with_name("bundle.tar.gz"))
    assert verify(packed).ok  # the seal file travels in the archive and is not a manifest entry

    rel = "stages/environment/records.json"
    (bundle_dir / rel).write_text((bundle_dir / rel).read_text().replace("PASSED", "FAILED", 1) + " ")
    assert f"{rel}: sha256 does not match manifest.json (modified after signing)" in verify_dir(bundle_dir).problems


def test_a_seal_over_another_statement_fails(bundle_dir, beacon_env, accepting_verifier):
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes().replace(b'"tier":"smoke"', b'"tier":"full"')
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    problems = verify_dir(bundle_dir).problems
    # Both seals are checked, and they disagree about the statement.
    assert problems == [f"statement.dsse.json: signs a different statement than {SIGSTORE_BUNDLE}"]


def test_a_seal_whose_subject_is_not_the_manifest_fails(bundle_dir, beacon_env, accepting_verifier):
    statement = json.loads((bundle_dir / STATEMENT).read_bytes())
    statement["subject"][0]["digest"]["sha256"] = "1" * 64
    accepting_verifier.payload = json.dumps(statement).encode()
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    problems = verify_dir(bundle_dir).problems
    assert problems == [
        f"{SIGSTORE_BUNDLE}: subject manifest.json: sha256 differs from the signed digest (modified after signing)"
    ]


def test_a_seal_over_a_payload_of_another_type_fails(bundle_dir, beacon_env, monkeypatch):
    from sigstore.verify import Verifier

    payload = (bundle_dir / STATEMENT).read_bytes()
    monkeypatch.setattr(Verifier, "verify_dsse", lambda self, bundle, policy: ("application/json", payload))
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    assert verify_dir(bundle_dir).problems == [
        f"{SIGSTORE_BUNDLE}: signs a payload of type 'application/json', not {PAYLOAD_TYPE}"
    ]


def test_ed25519_bundles_stay_self_attested(bundle_dir):
    report = verify_dir(bundle_dir)
    assert report.ok and report.signer.describe().startswith("self-attested")


# --- the identity policy ----------------------------------------------------------------------------------------


def test_the_shipped_policy_names_no_repository_and_says_how_to_set_one(bundle_dir, monkeypatch, capsys):
    for key in sigstore_policy.KEYS:
        monkeypatch.delenv(f"K3GATE_SIGSTORE_{key.upper()}", raising=False)
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    assert main(["verify", str(bundle_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--sigstore-repository OWNER/NAME" in err


def test_cli_options_set_the_policy(bundle_dir, monkeypatch, capsys, no_network):
    monkeypatch.setenv("K3GATE_SIGSTORE_REPOSITORY", "someone/else")
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    argv = ["verify", str(bundle_dir), "--sigstore-instance", "staging"]
    argv += ["--sigstore-repository", BEACON["repository"], "--sigstore-workflow", BEACON["workflow"]]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "predicateType is 'https://slsa.dev/provenance/v1'" in err  # the identity passed: options took effect
    assert main(["verify", str(bundle_dir), "--sigstore-instance", "staging"]) == 1  # options do not leak
    assert "SANs do not match" in capsys.readouterr().err


def test_precedence_is_cli_then_environment_then_file(tmp_path, monkeypatch):
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text("\n".join(f'{k} = "{v}"' for k, v in BEACON.items()) + "\n")
    env = {"K3GATE_SIGSTORE_POLICY": str(policy_file), "K3GATE_SIGSTORE_REF": "refs/heads/release"}
    assert sigstore_policy.load(env) == beacon(ref="refs/heads/release")
    parser = argparse.ArgumentParser()
    sigstore_policy.add_options(parser)
    parser.parse_args(["--sigstore-ref", "refs/heads/stable"])
    assert sigstore_policy.load(env).ref == "refs/heads/stable"
    sigstore_policy.add_options(argparse.ArgumentParser())  # building a parser forgets earlier options
    assert sigstore_policy.load(env).ref == "refs/heads/release"


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({"REPOSITORY": "just-a-name"}, "is not OWNER/NAME"),
        ({"WORKFLOW": "gpu-gate.yml"}, "is not .github/workflows/NAME.yml"),
        ({"REF": "main"}, "is not a full ref"),
        ({"ISSUER": "http://token.example"}, "is not an https URL"),
        ({"INSTANCE": "private"}, "is unknown"),
        ({"RUNNER_ENVIRONMENT": "anywhere"}, "is not one of github-hosted, self-hosted"),
        ({"TRUSTED_ROOT": "no/such/trusted_root.json"}, "does not exist"),
        ({"POLICY": "no/such/policy.toml"}, "does not exist"),
    ],
)
def test_bad_policy_values_are_one_line_errors(env, expect):
    environ = {"K3GATE_SIGSTORE_REPOSITORY": "o/r", **{f"K3GATE_SIGSTORE_{k}": v for k, v in env.items()}}
    with pytest.raises(UsageError, match=expect) as info:
        sigstore_policy.load(environ)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "expect"),
    [("repo = 'x'\n", "unknown key 'repo'"), ("ref = 1\n", "must be a string"), ("ref = \n", "not valid TOML")],
)
def test_bad_policy_files_are_one_line_errors(tmp_path, text, expect):
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(UsageError, match=expect):
        sigstore_policy.load({"K3GATE_SIGSTORE_POLICY": str(tmp_path / "p.toml")})


def test_a_trusted_root_file_replaces_the_shipped_one(tmp_path, no_network):
    shipped = sigstore_verify.shipped_trusted_root("staging")
    copy = tmp_path / "trusted_root.json"
    shutil.copy(shipped, copy)
    open_seal(DSSE_BUNDLE.read_bytes(), beacon(instance="production", trusted_root=str(copy)))
    copy.write_text("{}")
    with pytest.raises(UsageError, match="could not be read"):
        open_seal(DSSE_BUNDLE.read_bytes(), beacon(trusted_root=str(copy)))


def test_a_missing_sigstore_package_is_a_usage_error(bundle_dir, beacon_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "sigstore", None)
    shutil.copy(DSSE_BUNDLE, bundle_dir / SIGSTORE_BUNDLE)
    with pytest.raises(UsageError, match=r"pip install 'k3gate\[sigstore\]'"):
        verify_dir(bundle_dir)
