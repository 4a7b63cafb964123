"""RFC 8785 canonical JSON and digests: the byte forms every signature and manifest is computed over."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import rfc8785


def finite(obj: Any) -> Any:
    """RFC 8785 has no NaN/Inf: store them as null so a metric never breaks the bundle."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def canonical_bytes(obj: Any) -> bytes:
    return rfc8785.dumps(finite(obj))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class NotCanonical(ValueError):
    pass


def load_canonical(data: bytes) -> Any:
    """Parse JSON that must already be in canonical form: any other byte form is a modification."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotCanonical(f"not valid JSON ({exc})") from None
    try:
        again = rfc8785.dumps(obj)
    except Exception as exc:  # rfc8785 raises several domain errors; all mean "cannot be canonical"
        raise NotCanonical(f"cannot be canonicalized ({exc})") from None
    if again != data:
        raise NotCanonical("is not in RFC 8785 canonical form")
    return obj


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode_strict(text: str) -> bytes:
    """Decode base64 that must re-encode to the same text (unused padding bits would hide a change)."""
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise ValueError(f"invalid base64 ({exc})") from None
    if b64encode(data) != text:
        raise ValueError("base64 is not in canonical form")
    return data
