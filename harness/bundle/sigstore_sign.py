"""`k3gate attest`: add a Sigstore keyless seal to a bundle that verifies, as CI's attest job does.

The seal signs the bundle's own statement.json bytes, unchanged, so the Sigstore payload is exactly the statement
the ed25519 seal covers and `k3gate verify` runs the same checks behind either seal. Signing needs an OIDC
identity token (GitHub Actions' ambient one, with `permissions: id-token: write`) and the network; the job
that holds the token never runs pull-request code, so the token cannot sign anything but a verified bundle.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from harness.bundle import SIGSTORE_BUNDLE, STATEMENT, sigstore_policy
from harness.errors import UsageError
from harness.verdicts import ExitCode

err = Console(stderr=True, highlight=False, soft_wrap=True)

TOKEN_ENV = "SIGSTORE_ID_TOKEN"  # the variable sigstore's own CLI reads a token from

# Given (instance, token): a context manager yielding an object with `sign_dsse(statement) -> Bundle`.
SignerFactory = Callable[[str, str], Any]


class SigningFailed(RuntimeError):
    pass


def sigstore_signer(instance: str, token: str) -> Any:
    """sigstore's signer for the public-good `instance`; contacts its TUF repository, Fulcio and Rekor."""
    try:
        from sigstore.models import ClientTrustConfig
        from sigstore.oidc import IdentityToken
        from sigstore.sign import SigningContext
    except ImportError:
        raise UsageError("signing needs the sigstore package — pip install 'k3gate[sigstore]'") from None
    trust = ClientTrustConfig.production() if instance == "production" else ClientTrustConfig.staging()
    return SigningContext.from_trust_config(trust).signer(IdentityToken(token))


def identity_token(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    try:
        from sigstore.oidc import detect_credential
    except ImportError:
        raise UsageError("signing needs the sigstore package — pip install 'k3gate[sigstore]'") from None
    token = detect_credential()
    if not token:
        raise UsageError(
            "no OIDC identity token for keyless signing — run in GitHub Actions with `permissions: id-token: "
            f"write`, or set {TOKEN_ENV}"
        )
    return token


def sign_statement(payload: bytes, instance: str, token: str, factory: SignerFactory | None = None) -> bytes:
    """The Sigstore bundle (JSON bytes) of a DSSE envelope over exactly `payload`."""
    try:
        from sigstore.dsse import Statement
    except ImportError:
        raise UsageError("signing needs the sigstore package — pip install 'k3gate[sigstore]'") from None
    statement = Statement(payload)  # the bytes as they are: a re-serialized statement would not match the file
    try:
        with (factory or sigstore_signer)(instance, token) as signer:
            bundle = signer.sign_dsse(statement)
    except UsageError:
        raise
    except Exception as exc:  # network, Fulcio and Rekor failures all end the same way: no seal
        raise SigningFailed(" ".join(str(exc).split()) or type(exc).__name__) from None
    return bundle.to_json().encode()


def expectation_problems(predicate: dict[str, Any], commit: str | None, config: str | None) -> list[str]:
    """What the approving maintainer expected the bundle to be, against what the bundle says it is."""
    problems = []
    git = predicate.get("git", {})
    # A run from a checkout records git's view; a run in the image (no .git) the commit the image was built from.
    ran = git.get("commit") or predicate.get("environment", {}).get("env", {}).get("K3GATE_COMMIT")
    if commit is not None and ran != commit:
        problems.append(f"bundle ran commit {ran}, not the approved {commit}")
    elif commit is not None and git.get("dirty"):
        problems.append(f"bundle ran commit {commit} with uncommitted changes, not the approved commit as it is")
    name = predicate.get("config", {}).get("name")
    if config is not None and name != config:
        problems.append(f"bundle ran config {name!r}, not {config!r}")
    return problems


def _print_problems(what: str, problems: list[str]) -> None:
    err.print(f"[red]FAILED[/]: {what} ({len(problems)} problems)")
    for p in problems:
        err.print(f"  - {p}", markup=False)


def attest(
    bundle: Path,
    out: Path | None,
    expect_commit: str | None = None,
    expect_config: str | None = None,
    factory: SignerFactory | None = None,
) -> int:
    from harness.bundle import archive
    from harness.bundle.verify import verify, verify_dir

    if not bundle.exists():
        raise UsageError(f"bundle {bundle} does not exist — give a bundle directory or its .tar.gz")
    if bundle.is_file() and out is None:
        raise UsageError(f"--out is required to attest an archive ({bundle.name}) — name the folder to write")
    policy = sigstore_policy.load()  # the identity the new seal must meet: a bad policy fails before signing
    with tempfile.TemporaryDirectory(prefix="k3gate-attest-") as tmp:
        try:
            source = archive.unpack(bundle, Path(tmp)) if bundle.is_file() else bundle
        except archive.ArchiveError as exc:
            _print_problems(f"{bundle} is not a bundle archive, so it is not signed", [str(exc)])
            return int(ExitCode.FAILED)
        if (source / SIGSTORE_BUNDLE).exists():
            raise UsageError(f"{bundle} already carries a Sigstore seal — attest the bundle as the runner wrote it")
        before = verify(bundle)  # an archive is checked byte for byte against its own deterministic packing
        if not before.ok:
            _print_problems(f"{bundle} does not verify, so it is not signed", before.problems)
            return int(ExitCode.FAILED)
        assert before.predicate is not None
        unmet = expectation_problems(before.predicate, expect_commit, expect_config)
        if unmet:
            _print_problems(f"{bundle} is not the run that was approved", unmet)
            return int(ExitCode.FAILED)
        if out is not None and out.exists() and out.resolve() != bundle.resolve():
            raise UsageError(f"--out {out} already exists — choose a new folder")
        try:
            sealed = sign_statement((source / STATEMENT).read_bytes(), policy.instance, identity_token(), factory)
        except SigningFailed as exc:
            err.print(f"[red]FAILED[/]: Sigstore signing failed ({exc}); nothing was written", markup=False)
            return int(ExitCode.FAILED)
        root = source
        if out is not None and out.resolve() != bundle.resolve():
            shutil.copytree(source, out)
            root = out
    (root / SIGSTORE_BUNDLE).write_bytes(sealed)
    packed = archive.pack(root, root.with_name(root.name + ".tar.gz"))
    after = verify_dir(root)
    if not after.ok:
        _print_problems(f"the Sigstore seal written to {root} does not verify", after.problems)
        return int(ExitCode.FAILED)
    assert after.signer is not None
    err.print(f"[green]sealed[/] {root} ({packed.name}): {after.signer.describe()}")
    return 0


def cmd_attest(args: argparse.Namespace) -> int:
    return attest(
        Path(args.bundle),
        Path(args.out) if args.out else None,
        args.expect_commit,
        args.expect_config,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attest", help="add a Sigstore keyless seal to a bundle that verifies (CI's attest job)")
    p.add_argument("bundle", help="bundle folder or .tar.gz")
    p.add_argument("--out", help="folder for the sealed bundle (default: seal the folder in place)")
    p.add_argument("--expect-commit", metavar="SHA", help="refuse unless the bundle ran this clean commit")
    p.add_argument("--expect-config", metavar="NAME", help="refuse unless the bundle ran this config")
    sigstore_policy.add_options(p)  # the identity the seal is checked against once written
    p.set_defaults(fn=cmd_attest)
