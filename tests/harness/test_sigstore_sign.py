"""`k3gate attest`: what is signed, when signing is refused, and that the seal written verifies (mocked signer)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.bundle import PAYLOAD_TYPE, SIGSTORE_BUNDLE, STATEMENT, archive, sigstore_sign
from harness.bundle.sigstore_sign import attest, expectation_problems
from harness.bundle.verify import verify
from harness.cli import main
from harness.errors import UsageError
from tests.harness.bundle_helpers import make_bundle
from tests.harness.test_sigstore_verify import BEACON, DSSE_BUNDLE

TOKEN = "header.payload.signature"


class FakeSigstoreBundle:
    def __init__(self, text: str) -> None:
        self.text = text

    def to_json(self) -> str:
        return self.text


class FakeSigner:
    """Stands in for sigstore's Signer (which needs Fulcio and Rekor): records what it was asked to sign."""

    def __init__(self, returns: str = DSSE_BUNDLE.read_text(), raises: Exception | None = None) -> None:
        self.returns, self.raises = returns, raises
        self.calls: list[tuple[str, str, bytes]] = []

    def __call__(self, instance: str, token: str):
        @contextmanager
        def context():
            fake = self

            class Signer:
                def sign_dsse(self, statement):
                    fake.calls.append((instance, token, statement._contents))
                    if fake.raises:
                        raise fake.raises
                    return FakeSigstoreBundle(fake.returns)

            yield Signer()

        return context()


@pytest.fixture(autouse=True)
def ci_environment(monkeypatch):
    for key, value in BEACON.items():
        monkeypatch.setenv(f"K3GATE_SIGSTORE_{key.upper()}", value)
    monkeypatch.setenv(sigstore_sign.TOKEN_ENV, TOKEN)


@pytest.fixture(scope="module")
def smoke_bundle(tmp_path_factory) -> Path:
    # The environment stage alone: a real, complete bundle, without the minutes of numerics a full run takes.
    result, _ = make_bundle(tmp_path_factory.mktemp("smoke"), stages=["environment"])
    return result.bundle_dir


@pytest.fixture
def bundle_dir(smoke_bundle, tmp_path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(smoke_bundle, root)
    archive.pack(root, tmp_path / "bundle.tar.gz")
    return root


@pytest.fixture
def accepting_verifier(monkeypatch):
    """verify_dsse accepts and returns what was signed: the fake signer's seal then verifies end to end."""
    from sigstore.verify import Verifier

    def fake(self, bundle, policy):
        return PAYLOAD_TYPE, fake.payload

    monkeypatch.setattr(Verifier, "verify_dsse", fake)
    return fake


def test_attest_signs_statement_json_byte_for_byte_and_the_seal_verifies(bundle_dir, tmp_path, accepting_verifier):
    signer = FakeSigner()
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes()
    out = tmp_path / "signed"
    assert attest(bundle_dir.with_name("bundle.tar.gz"), out, factory=signer) == 0
    assert signer.calls == [("staging", TOKEN, (bundle_dir / STATEMENT).read_bytes())]
    assert (out / SIGSTORE_BUNDLE).read_text() == DSSE_BUNDLE.read_text()
    report = verify(out.with_name("signed.tar.gz"))
    assert report.ok, report.problems
    assert report.signer.kind == "sigstore"
    assert not (bundle_dir / SIGSTORE_BUNDLE).exists()  # the input is left as it was


def test_attest_in_place_repacks_the_archive_beside_the_folder(bundle_dir, accepting_verifier):
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes()
    assert attest(bundle_dir, None, factory=FakeSigner()) == 0
    assert verify(bundle_dir.with_name("bundle.tar.gz")).signer.kind == "sigstore"


def test_a_seal_that_does_not_verify_after_signing_fails(bundle_dir, capsys):
    # Real verification of the returned (foreign) seal: signed by the right identity, over the wrong statement.
    assert attest(bundle_dir, None, factory=FakeSigner()) == 1
    assert "predicateType is 'https://slsa.dev/provenance/v1'" in capsys.readouterr().err


def test_a_bundle_that_does_not_verify_is_not_signed(bundle_dir, capsys):
    signer = FakeSigner()
    rel = "stages/environment/records.json"
    (bundle_dir / rel).write_text((bundle_dir / rel).read_text() + " ")
    assert attest(bundle_dir, None, factory=signer) == 1
    assert signer.calls == []
    assert f"{rel}: sha256 does not match" in capsys.readouterr().err


def test_a_damaged_archive_is_not_signed(tmp_path, capsys):
    (tmp_path / "x.tar.gz").write_bytes(b"not a tar")
    signer = FakeSigner()
    assert attest(tmp_path / "x.tar.gz", tmp_path / "out", factory=signer) == 1
    assert signer.calls == [] and "damaged or not a tar.gz" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("commit", "config", "expect"),
    [
        ("0" * 40, None, "not the approved 0000"),
        (None, "tp8-gb300", "bundle ran config 'cpu-smoke', not 'tp8-gb300'"),
    ],
)
def test_a_bundle_other_than_the_approved_run_is_not_signed(bundle_dir, capsys, commit, config, expect):
    signer = FakeSigner()
    assert attest(bundle_dir, None, commit, config, factory=signer) == 1
    assert signer.calls == [] and expect in capsys.readouterr().err


def test_expectations():
    predicate = {"git": {"commit": "abc", "dirty": False}, "config": {"name": "h200"}}
    assert expectation_problems(predicate, "abc", "h200") == []
    assert expectation_problems(predicate, None, None) == []
    predicate["git"]["dirty"] = True
    assert expectation_problems(predicate, "abc", None) == [
        "bundle ran commit abc with uncommitted changes, not the approved commit as it is"
    ]
    in_image = {"git": {"commit": None, "dirty": False}, "environment": {"env": {"K3GATE_COMMIT": "abc"}}}
    assert expectation_problems(in_image, "abc", None) == []
    assert expectation_problems(in_image, "def", None) == ["bundle ran commit abc, not the approved def"]
    assert expectation_problems({"git": {}}, "def", None) == ["bundle ran commit None, not the approved def"]


def test_signing_failure_writes_nothing(bundle_dir, tmp_path, capsys):
    out = tmp_path / "signed"
    assert attest(bundle_dir, out, factory=FakeSigner(raises=ConnectionError("fulcio.sigstage.dev: no route"))) == 1
    assert not out.exists() and not (bundle_dir / SIGSTORE_BUNDLE).exists()
    assert "Sigstore signing failed (fulcio.sigstage.dev: no route)" in capsys.readouterr().err


def test_no_identity_token_is_a_usage_error(bundle_dir, monkeypatch):
    monkeypatch.delenv(sigstore_sign.TOKEN_ENV)
    monkeypatch.setattr("sigstore.oidc.detect_credential", lambda *a: None)
    with pytest.raises(UsageError, match="id-token: write"):
        attest(bundle_dir, None, factory=FakeSigner())


def test_usage_errors(bundle_dir, tmp_path, accepting_verifier):
    with pytest.raises(UsageError, match="--out is required"):
        attest(bundle_dir.with_name("bundle.tar.gz"), None, factory=FakeSigner())
    with pytest.raises(UsageError, match="does not exist"):
        attest(tmp_path / "nothing", None, factory=FakeSigner())
    with pytest.raises(UsageError, match="already exists"):
        attest(bundle_dir, tmp_path, factory=FakeSigner())
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes()
    assert attest(bundle_dir, None, factory=FakeSigner()) == 0
    with pytest.raises(UsageError, match="already carries a Sigstore seal"):
        attest(bundle_dir, None, factory=FakeSigner())


def test_attest_through_the_cli(bundle_dir, tmp_path, monkeypatch, capsys, accepting_verifier):
    accepting_verifier.payload = (bundle_dir / STATEMENT).read_bytes()
    monkeypatch.setattr(sigstore_sign, "sigstore_signer", FakeSigner())
    commit = json.loads((bundle_dir / STATEMENT).read_text())["predicate"]["git"]["commit"]
    argv = ["attest", str(bundle_dir), "--out", str(tmp_path / "s"), "--expect-config", "cpu-smoke"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "CI-attested" in capsys.readouterr().err
    assert main(["attest", str(bundle_dir), "--expect-commit", commit + "0"]) == 1
    monkeypatch.delenv("K3GATE_SIGSTORE_REPOSITORY")
    monkeypatch.setenv("K3GATE_SIGSTORE_POLICY", str(tmp_path / "missing.toml"))
    assert main(["attest", str(bundle_dir)]) == 2
