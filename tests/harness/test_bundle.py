from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.bundle import SEAL_FILES, archive, keys
from harness.bundle.verify import verify, verify_dir
from harness.cli import main
from tests.harness.bundle_helpers import make_bundle, reseal


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sealed")
    result, key = make_bundle(tmp)
    return result, key, tmp


def copy_bundle(src: Path, tmp: Path) -> Path:
    dest = tmp / "copy"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    return dest


def test_fresh_bundle_verifies(sealed):
    result, _, _ = sealed
    report = verify(result.bundle_dir)
    assert report.ok, report.problems
    assert report.bundle_id == result.bundle_id
    assert report.signer.trusted is None and "unverified identity" in report.signer.describe()
    assert verify(result.archive).ok


def test_every_file_is_covered(sealed):
    result, _, _ = sealed
    manifest = json.loads((result.bundle_dir / "manifest.json").read_text())
    on_disk = set(archive.bundle_files(result.bundle_dir)) - set(SEAL_FILES)
    assert set(manifest) == on_disk
    assert {"config.toml", "env/environment.json", "report/report.md", "report/report.html"} <= on_disk
    assert all(f"stages/{s}/records.json" in on_disk for s in ("environment", "isolation", "bundle"))


def test_archive_is_deterministic(sealed, tmp_path):
    result, _, _ = sealed
    first = archive.pack(result.bundle_dir, tmp_path / "a.tar.gz").read_bytes()
    copy = copy_bundle(result.bundle_dir, tmp_path)
    for p in copy.rglob("*"):  # new mtimes and modes must not change the archive
        os.utime(p, (1_000_000, 1_000_000))
        if p.is_file():
            p.chmod(0o600)
    second = archive.pack(copy, tmp_path / "b.tar.gz").read_bytes()
    assert first == second == result.archive.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_change_fails_naming_the_file(sealed, tmp_path, data):
    result, _, _ = sealed
    root = copy_bundle(result.bundle_dir, tmp_path)
    files = archive.bundle_files(root)
    rel = data.draw(st.sampled_from(files), label="file")
    blob = bytearray((root / rel).read_bytes())
    offset = data.draw(st.integers(0, len(blob) - 1), label="offset")
    blob[offset] ^= data.draw(st.integers(1, 255), label="xor")
    (root / rel).write_bytes(bytes(blob))
    report = verify_dir(root)
    assert not report.ok
    assert any(rel in p for p in report.problems), (rel, report.problems)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10**9), xor=st.integers(1, 255))
@example(offset=3, xor=1)  # gzip's FTEXT flag: decompressors ignore it, so only a byte comparison catches it
def test_any_byte_change_in_the_archive_fails(sealed, tmp_path, offset, xor):
    result, _, _ = sealed
    blob = bytearray(result.archive.read_bytes())
    blob[offset % len(blob)] ^= xor
    path = tmp_path / "x.tar.gz"
    path.write_bytes(bytes(blob))
    report = verify(path)
    assert not report.ok and all(p.startswith("x.tar.gz") for p in report.problems)


def test_added_and_removed_files_fail(sealed, tmp_path):
    result, _, _ = sealed
    root = copy_bundle(result.bundle_dir, tmp_path)
    (root / "stages" / "numerics" / "extra.json").write_text("{}")
    (root / "report" / "report.md").unlink()
    problems = verify_dir(root).problems
    assert any("stages/numerics/extra.json: not listed" in p for p in problems)
    assert any("report/report.md: listed in manifest.json but missing" in p for p in problems)


def test_edited_verdict_fails_even_when_resigned(sealed, tmp_path):
    result, _, _ = sealed
    root = copy_bundle(result.bundle_dir, tmp_path)
    attacker = keys.generate(tmp_path / "attacker.key")

    def promote(predicate):
        for v in predicate["verdicts"]:
            v["verdict"], v["reason"] = "PASSED", "all 1 checks passed"
        predicate["outcome"] = {"outcome": "PASSED", "reason": "all 6 required stages passed"}

    reseal(root, attacker, promote)
    problems = verify_dir(root).problems
    assert any("verdict of scope says PASSED but its records give NOT_RUN" in p for p in problems)
    assert any("outcome says PASSED" in p for p in problems)


def test_edited_check_flag_fails_even_when_resigned(sealed, tmp_path):
    result, _, _ = sealed
    root = copy_bundle(result.bundle_dir, tmp_path)
    rec_path = root / "stages" / "environment" / "records.json"
    rec = json.loads(rec_path.read_text())
    rec["checks"][0]["value"] = 0  # packages recorded: 0 >= 1 is false, but the flag still says passed
    rec_path.write_text(json.dumps(rec))
    reseal(root, keys.generate(tmp_path / "attacker.key"))
    problems = verify_dir(root).problems
    assert any("claims a result its value and limit do not give" in p for p in problems)
    assert any("verdict of environment says PASSED but its records give FAILED" in p for p in problems)


def test_consistent_forgery_is_caught_by_trust(sealed, tmp_path):
    result, _, tmp = sealed
    root = copy_bundle(result.bundle_dir, tmp_path)
    reseal(root, keys.generate(tmp_path / "attacker.key"))  # intact, but signed by someone else
    assert verify_dir(root).ok
    trusted = keys.load_trusted(tmp / "signer.pub")
    report = verify_dir(root, trusted)
    assert not report.ok and any("not among the trusted keys" in p for p in report.problems)
    assert verify_dir(result.bundle_dir, trusted).ok


def test_cli_verify_wrong_key_exits_1(sealed, tmp_path, capsys):
    result, _, _ = sealed
    other = keys.generate(tmp_path / "other.key")
    assert other
    assert main(["verify", str(result.archive), "--key", str(tmp_path / "other.pub")]) == 1
    assert "not among the trusted keys" in capsys.readouterr().err
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    shutil.copy(tmp_path / "other.pub", keys_dir / "other.pub")
    assert main(["verify", str(result.bundle_dir), "--keys", str(keys_dir)]) == 1


def test_cli_verify_usage_errors(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert main(["verify", str(tmp_path), "--key", str(tmp_path / "nokey.pub")]) == 2
    assert "does not exist" in capsys.readouterr().err


def ssh_keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dev@example", "-f", str(path)], check=True)


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="ssh-keygen (openssh-client) is not installed")
def test_signing_with_an_openssh_key(tmp_path):
    ssh_keygen(tmp_path / "id_ed25519")
    key = keys.load_private(tmp_path / "id_ed25519")
    from harness import pipeline
    from harness.config.loader import load_config
    from harness.hardware import detect

    result = pipeline.run(load_config("cpu-smoke"), detect(), key, tmp_path / "b", ["numerics"])
    # A reviewer trusts the contributor's public key, e.g. from github.com/<login>.keys (with an RSA line too).
    gh_keys = tmp_path / "dev.keys"
    gh_keys.write_text("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC0 dev\n" + (tmp_path / "id_ed25519.pub").read_text())
    assert main(["verify", str(result.archive), "--key", str(gh_keys)]) == 0


def test_rejects_non_ed25519_and_encrypted_keys(tmp_path, monkeypatch):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from harness.errors import UsageError

    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(UsageError, match="not ed25519"):
        keys.load_private(tmp_path / "ec.pem")
    enc = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"),
    )
    (tmp_path / "enc.pem").write_bytes(enc)
    monkeypatch.delenv(keys.PASSPHRASE_ENV, raising=False)
    with pytest.raises(UsageError, match="encrypted"):
        keys.load_private(tmp_path / "enc.pem")
    monkeypatch.setenv(keys.PASSPHRASE_ENV, "pw")
    assert keys.load_private(tmp_path / "enc.pem").keyid
    keys.generate(tmp_path / "plain.key")  # a set passphrase must not break unencrypted keys
    assert keys.load_private(tmp_path / "plain.key").keyid
    monkeypatch.setenv(keys.PASSPHRASE_ENV, "wrong")
    with pytest.raises(UsageError, match="could not be read"):
        keys.load_private(tmp_path / "enc.pem")


def test_keygen_refuses_to_overwrite(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path / "k.key")]) == 0
    assert capsys.readouterr().out.startswith("ssh-ed25519 ")
    assert oct((tmp_path / "k.key").stat().st_mode & 0o777) == "0o600"
    assert main(["keygen", "--out", str(tmp_path / "k.key")]) == 2
    assert main(["keygen", "--out", str(tmp_path / "k.key"), "--force"]) == 0
