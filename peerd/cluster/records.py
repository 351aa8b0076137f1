"""The signed record a peer publishes about itself: in its mDNS TXT record and in hellos.

A record is a flat map of short text keys (the TXT record's key=value pairs):

  v     protocol version            id    peer id (hash of pk)     name  human name
  inst  random id of this daemon run (tells a restart from a copied state directory)
  pk    CURVE public key (Z85)      hp, cp, dp  hello, control and data ports
  mac   HMAC-SHA256, hex, over every other pair (sorted, "key=value" joined by newlines),
        keyed with a key derived from the cluster secret

Only a cluster member can produce a valid mac. The address is not part of the record: it
comes from the mDNS address record or the hello connection, and a wrong one only makes the
CURVE handshake fail.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping

from zmq.utils import z85

from peerd.wire.identity import ClusterSecret, peer_id_for
from peerd.wire.protocol import PROTOCOL_VERSION

MAX_NAME_CHARS = 63
MAX_VALUE_BYTES = 200


class RecordError(ValueError):
    """A record that is not a valid, authentic record of this cluster."""


@dataclasses.dataclass(frozen=True)
class PeerRecord:
    id: str
    name: str
    instance: str
    public_key: str
    hello_port: int
    control_port: int
    data_port: int

    def fields(self) -> dict[str, str]:
        return {
            "v": str(PROTOCOL_VERSION),
            "id": self.id,
            "name": self.name,
            "inst": self.instance,
            "pk": self.public_key,
            "hp": str(self.hello_port),
            "cp": str(self.control_port),
            "dp": str(self.data_port),
        }

    def signed(self, secret: ClusterSecret) -> dict[str, str]:
        """The record's key/value pairs with their mac."""
        pairs = self.fields()
        return {**pairs, "mac": _mac(pairs, secret)}


def _mac(pairs: Mapping[str, str], secret: ClusterSecret) -> str:
    canonical = "\n".join(f"{key}={pairs[key]}" for key in sorted(pairs))
    return secret.mac(canonical.encode("utf-8")).hex()


def _text(value: str | bytes | None, key: str) -> str:
    if value is None:
        raise RecordError(f"record key {key!r} has no value")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError(f"record key {key!r} is not UTF-8") from None
    if len(value.encode("utf-8")) > MAX_VALUE_BYTES:
        raise RecordError(f"record key {key!r} is too long")
    return value


def verify(
    pairs: Mapping[str, str | None] | Mapping[bytes, bytes | None], secret: ClusterSecret
) -> PeerRecord:
    """The record these pairs describe, if their mac proves cluster membership."""
    text = {_text(k, "key"): _text(v, str(k)) for k, v in pairs.items()}
    claimed = text.pop("mac", None)
    if claimed is None:
        raise RecordError("record has no mac")
    if not hmac.compare_digest(claimed, _mac(text, secret)):
        raise RecordError("record mac does not verify (another cluster, or forged)")
    return _parse(text)


def _parse(text: dict[str, str]) -> PeerRecord:
    missing = {"v", "id", "name", "inst", "pk", "hp", "cp", "dp"} - set(text)
    if missing:
        raise RecordError(f"record lacks {sorted(missing)}")
    if text["v"] != str(PROTOCOL_VERSION):
        raise RecordError(f"record speaks protocol {text['v']!r}, not {PROTOCOL_VERSION}")
    record = PeerRecord(
        id=text["id"],
        name=text["name"][:MAX_NAME_CHARS],
        instance=text["inst"],
        public_key=text["pk"],
        hello_port=_port(text["hp"]),
        control_port=_port(text["cp"]),
        data_port=_port(text["dp"]),
    )
    if not _is_curve_key(record.public_key) or record.id != peer_id_for(record.public_key):
        raise RecordError("record id does not match its public key")
    return record


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RecordError(f"record has a bad port {text!r}")
    return int(text)


def _is_curve_key(text: str) -> bool:
    try:
        return len(text) == 40 and len(z85.decode(text)) == 32
    except (ValueError, KeyError, UnicodeEncodeError):
        return False
