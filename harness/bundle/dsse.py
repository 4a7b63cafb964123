"""DSSE envelopes signed with ed25519 (https://github.com/secure-systems-lab/dsse, protocol v1)."""

from __future__ import annotations

from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from harness.bundle import PAYLOAD_TYPE
from harness.bundle.canonical import b64decode_strict, b64encode
from harness.bundle.keys import SigningKey, keyid


def pae(payload_type: str, payload: bytes) -> bytes:
    """Pre-Authentication Encoding: what is actually signed, binding the payload type to the payload."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def sign(payload: bytes, key: SigningKey, payload_type: str = PAYLOAD_TYPE) -> dict[str, Any]:
    sig = key.private.sign(pae(payload_type, payload))
    return {
        "payloadType": payload_type,
        "payload": b64encode(payload),
        "signatures": [{"keyid": key.keyid, "sig": b64encode(sig)}],
    }


class EnvelopeError(ValueError):
    pass


def open_envelope(envelope: dict[str, Any], public: Ed25519PublicKey) -> bytes:
    """The payload, once a signature by `public` over it verifies; raises EnvelopeError otherwise."""
    try:
        payload = b64decode_strict(envelope["payload"])
    except ValueError as exc:
        raise EnvelopeError(f"payload: {exc}") from None
    want = keyid(public)
    sigs = [s for s in envelope["signatures"] if s["keyid"] == want]
    if not sigs:
        raise EnvelopeError(f"no signature with keyid {want[:16]}… (the key in the bundle)")
    for s in sigs:
        try:
            public.verify(b64decode_strict(s["sig"]), pae(envelope["payloadType"], payload))
            return payload
        except (InvalidSignature, ValueError):
            continue
    raise EnvelopeError("the ed25519 signature does not verify over the payload")
