"""Sealing a bundle directory: manifest -> statement -> DSSE envelope -> deterministic archive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.bundle import (
    ENVELOPE,
    MANIFEST,
    PREDICATE_TYPE,
    SEAL_FILES,
    SIGNER_KEY,
    STATEMENT,
    STATEMENT_TYPE,
    archive,
    dsse,
)
from harness.bundle.canonical import canonical_bytes, sha256_bytes, sha256_file
from harness.bundle.keys import SigningKey, openssh_line


def build_manifest(root: Path) -> dict[str, str]:
    return {rel: sha256_file(root / rel) for rel in archive.bundle_files(root) if rel not in SEAL_FILES}


def statement(manifest_digest: str, predicate: dict[str, Any]) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": MANIFEST, "digest": {"sha256": manifest_digest}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def seal(root: Path, predicate: dict[str, Any], key: SigningKey) -> str:
    """Write the seal files into `root`; returns the bundle id (sha256 of manifest.json)."""
    for name in SEAL_FILES:
        (root / name).unlink(missing_ok=True)
    manifest_bytes = canonical_bytes(build_manifest(root))
    (root / MANIFEST).write_bytes(manifest_bytes)
    bundle_id = sha256_bytes(manifest_bytes)
    payload = canonical_bytes(statement(bundle_id, predicate))
    (root / STATEMENT).write_bytes(payload)
    (root / ENVELOPE).write_bytes(canonical_bytes(dsse.sign(payload, key)))
    (root / SIGNER_KEY).write_text(openssh_line(key.public, "k3gate-signer") + "\n")
    return bundle_id
