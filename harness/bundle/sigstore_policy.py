"""The identity a Sigstore seal must carry: policy data from a file, the environment and `verify --sigstore-*`.

Kept apart from the verifier so the CLI can add its options without importing sigstore (an optional extra).
`verify()` takes only ed25519 keys, so the options reach the verifier through this module: the parser's actions
record them here, and `load()` merges them over the environment and the data file.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from harness.errors import UsageError

POLICY_FILE = Path(__file__).with_name("sigstore_policy.toml")
ENV_PREFIX = "K3GATE_SIGSTORE_"
# TUF repositories of the public-good instances: sigstore-python ships each one's trusted root under this name.
INSTANCES = {
    "production": "https://tuf-repo-cdn.sigstore.dev",
    "staging": "https://tuf-repo-cdn.sigstage.dev",
}
RUNNER_ENVIRONMENTS = ("github-hosted", "self-hosted")
GITHUB = "https://github.com"

_REPOSITORY = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_WORKFLOW = re.compile(r"^\.github/workflows/[A-Za-z0-9_.-]+\.ya?ml$")


@dataclass(frozen=True)
class IdentityPolicy:
    instance: str
    issuer: str
    repository: str
    workflow: str
    ref: str
    runner_environment: str
    trusted_root: str = ""  # a trusted_root.json to use instead of the one sigstore ships (after a key rotation)

    @property
    def repository_uri(self) -> str:
        return f"{GITHUB}/{self.repository}"

    @property
    def signer_uri(self) -> str:
        """The certificate's SAN and Build Signer URI for a job of `workflow` run from `ref`."""
        return f"{GITHUB}/{self.repository}/{self.workflow}@{self.ref}"

    def describe(self) -> str:
        return f"{self.signer_uri} on a {self.runner_environment} runner, issuer {self.issuer}, {self.instance}"

    def check(self, origin: str) -> None:
        """Raise UsageError naming the first bad key; `origin` says where the values came from."""
        fix = f"set it in {origin}, by `k3gate verify --sigstore-KEY`, or by {ENV_PREFIX}KEY"
        if self.instance not in INSTANCES:
            raise UsageError(f"Sigstore instance {self.instance!r} is unknown — use one of {', '.join(INSTANCES)}")
        if not self.repository:
            raise UsageError(
                "the Sigstore identity policy names no repository, so no CI seal can be trusted — pass "
                f"--sigstore-repository OWNER/NAME or set {ENV_PREFIX}REPOSITORY (or `repository` in {origin})"
            )
        if not _REPOSITORY.match(self.repository):
            raise UsageError(f"Sigstore repository {self.repository!r} is not OWNER/NAME — {fix}")
        if not _WORKFLOW.match(self.workflow):
            raise UsageError(f"Sigstore workflow {self.workflow!r} is not .github/workflows/NAME.yml — {fix}")
        if not self.ref.startswith("refs/"):
            raise UsageError(f"Sigstore ref {self.ref!r} is not a full ref such as refs/heads/main — {fix}")
        if not self.issuer.startswith("https://"):
            raise UsageError(f"Sigstore issuer {self.issuer!r} is not an https URL — {fix}")
        if self.runner_environment not in RUNNER_ENVIRONMENTS:
            raise UsageError(
                f"Sigstore runner_environment {self.runner_environment!r} is not one of "
                f"{', '.join(RUNNER_ENVIRONMENTS)} — {fix}"
            )
        if self.trusted_root and not Path(self.trusted_root).is_file():
            raise UsageError(f"Sigstore trusted root {self.trusted_root} does not exist — give a trusted_root.json")


KEYS = tuple(f.name for f in fields(IdentityPolicy))

# Values given on the command line, by key. Reset whenever a parser is built, so one in-process CLI call
# never leaks its options into the next.
_cli: dict[str, str] = {}


def _read_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise UsageError(f"Sigstore policy {path} does not exist — give a TOML file with the keys {', '.join(KEYS)}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"Sigstore policy {path} is not valid TOML ({exc}) — fix the file") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise UsageError(f"Sigstore policy {path}: unknown key {unknown[0]!r} — the keys are {', '.join(KEYS)}")
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    if bad:
        raise UsageError(f"Sigstore policy {path}: {bad[0]} must be a string — quote it")
    return data


def load(environ: Mapping[str, str] | None = None) -> IdentityPolicy:
    """The policy in force: command line over environment over the data file; checked."""
    env = os.environ if environ is None else environ
    path = Path(_cli.get("policy") or env.get(f"{ENV_PREFIX}POLICY") or POLICY_FILE)
    values = _read_file(path)
    for key in KEYS:
        if f"{ENV_PREFIX}{key.upper()}" in env:
            values[key] = env[f"{ENV_PREFIX}{key.upper()}"]
        if key in _cli:
            values[key] = _cli[key]
    missing = [k for k in KEYS if k not in values and k != "trusted_root"]
    if missing:
        raise UsageError(f"Sigstore policy {path} lacks {missing[0]!r} — add it (the keys are {', '.join(KEYS)})")
    policy = IdentityPolicy(**values)
    policy.check(str(path))
    return policy


class _Option(argparse.Action):
    """Records `--sigstore-KEY VALUE` for `load()`, as well as on the namespace."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        _cli[self.dest.removeprefix("sigstore_")] = str(values)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The `--sigstore-*` options (for `verify`, they apply when the bundle carries a Sigstore seal)."""
    _cli.clear()
    group = parser.add_argument_group("Sigstore seal (bundles signed keyless by CI)")
    group.add_argument("--sigstore-repository", action=_Option, metavar="OWNER/NAME", help="repository that signs")
    group.add_argument("--sigstore-workflow", action=_Option, metavar="PATH", help="signing workflow file")
    group.add_argument("--sigstore-ref", action=_Option, metavar="REF", help="ref the workflow ran from")
    group.add_argument("--sigstore-issuer", action=_Option, metavar="URL", help="OIDC issuer")
    group.add_argument("--sigstore-runner-environment", action=_Option, choices=RUNNER_ENVIRONMENTS)
    group.add_argument("--sigstore-instance", action=_Option, choices=tuple(INSTANCES), help="Sigstore instance")
    group.add_argument("--sigstore-trusted-root", action=_Option, metavar="FILE", help="trusted_root.json to use")
    group.add_argument("--sigstore-policy", action=_Option, metavar="FILE", help="policy TOML replacing the shipped")
