"""ed25519 signing keys: k3gate's own (PEM) and OpenSSH keys contributors already have."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from harness.errors import UsageError

PASSPHRASE_ENV = "K3GATE_KEY_PASSPHRASE"
_FIX_KIND = "k3gate signs with ed25519: create a key with `k3gate keygen` or `ssh-keygen -t ed25519`"


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid(key: Ed25519PublicKey) -> str:
    """sha256 of the raw 32-byte public key, hex: the DSSE keyid."""
    return hashlib.sha256(raw_public(key)).hexdigest()


def openssh_line(key: Ed25519PublicKey, comment: str = "k3gate") -> str:
    text = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return f"{text} {comment}".strip()


def default_key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "k3gate" / "keys" / "default.key"


@dataclass(frozen=True)
class SigningKey:
    private: Ed25519PrivateKey
    source: str

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @property
    def keyid(self) -> str:
        return keyid(self.public)


def generate(path: Path, force: bool = False) -> SigningKey:
    """Write a new private key (PEM, mode 0600) and its `.pub` (OpenSSH line) next to it."""
    pub_path = path.with_suffix(".pub")
    if not force and (path.exists() or pub_path.exists()):
        raise UsageError(f"{path} already exists — pass --force to replace it or --out to write elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    os.replace(tmp, path)
    pub_path.write_text(openssh_line(private.public_key()) + "\n")
    return SigningKey(private, str(path))


def load_private(path: Path) -> SigningKey:
    if not path.is_file():
        raise UsageError(f"signing key {path} does not exist — create one with `k3gate keygen --out {path}`")
    data = path.read_bytes()
    passphrase = os.environ.get(PASSPHRASE_ENV)
    load = (
        serialization.load_ssh_private_key
        if b"BEGIN OPENSSH PRIVATE KEY" in data
        else serialization.load_pem_private_key
    )
    try:
        try:
            key = load(data, password=None)
        except TypeError:  # encrypted: only now is the passphrase needed
            if not passphrase:
                raise UsageError(f"signing key {path} is encrypted — set {PASSPHRASE_ENV} to its passphrase") from None
            key = load(data, password=passphrase.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise UsageError(f"signing key {path} could not be read ({exc}) — {_FIX_KIND}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"signing key {path} is a {type(key).__name__}, not ed25519 — {_FIX_KIND}")
    return SigningKey(key, str(path))


def parse_public(text: str, origin: str) -> list[Ed25519PublicKey]:
    """Public keys from OpenSSH lines (one or many, like github.com/<login>.keys) or one PEM block.

    Lines of other key types are skipped: a contributor's .keys file often lists RSA keys too.
    """
    if "BEGIN PUBLIC KEY" in text:
        try:
            key = serialization.load_pem_public_key(text.encode())
        except ValueError as exc:
            raise UsageError(f"public key {origin} could not be read ({exc}) — give a PEM or OpenSSH key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise UsageError(f"public key {origin} is not ed25519 — {_FIX_KIND}")
        return [key]
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("ssh-ed25519 "):
            continue
        try:
            key = serialization.load_ssh_public_key(line.encode())
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise UsageError(
                f"public key {origin}: bad OpenSSH line ({exc}) — copy the whole `ssh-ed25519 ...` line"
            ) from None
        if isinstance(key, Ed25519PublicKey):
            keys.append(key)
    return keys


def load_trusted(key_file: Path | None = None, keys_dir: Path | None = None) -> list[Ed25519PublicKey]:
    """Trusted signer keys from --key FILE and/or every *.pub / *.keys file in --keys DIR."""
    files: list[Path] = []
    if key_file is not None:
        if not key_file.is_file():
            raise UsageError(f"--key {key_file} does not exist — give a public key file (OpenSSH or PEM)")
        files.append(key_file)
    if keys_dir is not None:
        if not keys_dir.is_dir():
            raise UsageError(f"--keys {keys_dir} is not a folder — give a folder of *.pub or *.keys files")
        files.extend(sorted(p for p in keys_dir.iterdir() if p.suffix in (".pub", ".keys")))
    keys = [k for f in files for k in parse_public(f.read_text(errors="replace"), str(f))]
    if not keys:
        where = ", ".join(map(str, files)) or "(none given)"
        raise UsageError(f"no ed25519 public key found in {where} — give OpenSSH `ssh-ed25519` lines or PEM keys")
    return keys
