"""Result bundles: a directory plus a deterministic tar.gz, a manifest of digests, a signed in-toto statement."""

MANIFEST = "manifest.json"
STATEMENT = "statement.json"
ENVELOPE = "statement.dsse.json"
SIGNER_KEY = "signer.pub"
SIGSTORE_BUNDLE = "statement.sigstore.json"  # Sigstore bundle v0.3 over the same statement, added by CI
# Files that seal the bundle; the manifest covers every other file.
SEAL_FILES = (MANIFEST, STATEMENT, ENVELOPE, SIGNER_KEY, SIGSTORE_BUNDLE)
PREDICATE_TYPE = "https://k3gate.dev/result-bundle/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
ARCHIVE_ROOT = "k3gate-bundle"
