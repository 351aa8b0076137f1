"""Join tokens: how `peerd invite` hands the cluster secret to `peerd join`.

A token is ``peerd1-`` followed by the unpadded base64url encoding of 37 bytes:
``version (1 byte, = 1) || secret (32 bytes) || first 4 bytes of SHA-256(version || secret)``.
The checksum catches a token damaged in copying; it is not a signature (whoever holds the
token holds the secret, so treat it like a password).
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from peerd.errors import PeerdError
from peerd.wire.identity import SECRET_BYTES, ClusterSecret

PREFIX = "peerd1-"
VERSION = 1
CHECKSUM_BYTES = 4


def _checksum(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()[:CHECKSUM_BYTES]


def encode(secret: ClusterSecret) -> str:
    body = bytes([VERSION]) + secret.secret
    raw = body + _checksum(body)
    return PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode(token: str) -> ClusterSecret:
    token = token.strip()
    if not token.startswith(PREFIX):
        raise PeerdError(f"not a peerd join token (it should start with {PREFIX!r})")
    text = token[len(PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, binascii.Error):
        raise PeerdError("join token is damaged (not base64url)") from None
    if len(raw) != 1 + SECRET_BYTES + CHECKSUM_BYTES:
        raise PeerdError("join token is damaged (wrong length)")
    body, checksum = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
    if _checksum(body) != checksum:
        raise PeerdError("join token is damaged (checksum mismatch)")
    if body[0] != VERSION:
        raise PeerdError(f"join token version {body[0]} is not supported")
    return ClusterSecret(body[1:])
