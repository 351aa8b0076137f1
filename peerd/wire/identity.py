"""A peer's persistent identity (CURVE key pair, id, name) and the cluster secret.

Files in the state directory, both mode 0600:
  identity.json  {"format": 1, "id", "name", "public_key", "secret_key"}  (keys in Z85)
  cluster.json   {"format": 1, "secret": base64url of 32 bytes}

The peer id is derived from the public key (first 16 hex digits of its SHA-256), so it is
stable for the life of the key pair, and a record cannot claim an id that its key does not
hash to. A copied state directory therefore yields two peers with the same id and key; the
membership layer detects that by their different run instances.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import socket
from pathlib import Path

import zmq
from zmq.utils import z85

from peerd import statedir
from peerd.errors import PeerdError

FORMAT = 1
SECRET_BYTES = 32
IDENTITY_FILE = "identity.json"
CLUSTER_FILE = "cluster.json"


def peer_id_for(public_key: str) -> str:
    return hashlib.sha256(public_key.encode("ascii")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair in Z85 text (40 characters each)."""

    public: str
    secret: str

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        """The key pair whose secret key is these 32 bytes."""
        secret = z85.encode(seed)
        return cls(zmq.curve_public(secret).decode("ascii"), secret.decode("ascii"))


@dataclasses.dataclass(frozen=True)
class Identity:
    id: str
    name: str
    keys: KeyPair


@dataclasses.dataclass(frozen=True)
class ClusterSecret:
    secret: bytes

    @property
    def cluster_id(self) -> str:
        """A short public fingerprint, shown in status to tell clusters apart."""
        return self.derive(b"cluster id").hex()[:8]

    def derive(self, purpose: bytes) -> bytes:
        return hmac.new(self.secret, b"peerd/" + purpose, hashlib.sha256).digest()

    def mac(self, message: bytes) -> bytes:
        return hmac.new(self.derive(b"record mac"), message, hashlib.sha256).digest()

    def hello_server_keys(self) -> KeyPair:
        """The hello socket's server key pair: only members can derive (and so reach) it."""
        return KeyPair.from_seed(self.derive(b"hello server key"))

    def hello_client_keys(self) -> KeyPair:
        """The only client key the hello socket admits."""
        return KeyPair.from_seed(self.derive(b"hello client key"))


def default_name() -> str:
    return socket.gethostname() or "peer"


def ensure_identity(state_dir: Path, name: str | None) -> Identity:
    """The stored identity (renamed if a new name is given), or a new one."""
    if (state_dir / IDENTITY_FILE).exists():
        identity = load_identity(state_dir)
        if name and name != identity.name:
            identity = dataclasses.replace(identity, name=name)
            _store_identity(state_dir, identity)
        return identity
    keys = KeyPair.generate()
    identity = Identity(peer_id_for(keys.public), name or default_name(), keys)
    _store_identity(state_dir, identity)
    return identity


def _store_identity(state_dir: Path, identity: Identity) -> None:
    keys = identity.keys
    statedir.write_secret_json(
        state_dir / IDENTITY_FILE,
        {
            "format": FORMAT,
            "id": identity.id,
            "name": identity.name,
            "public_key": keys.public,
            "secret_key": keys.secret,
        },
    )


def load_identity(state_dir: Path) -> Identity:
    path = state_dir / IDENTITY_FILE
    if not path.exists():
        raise PeerdError(f"no identity in {state_dir}: run `peerd init` or `peerd join TOKEN`")
    content = statedir.read_json(path)
    try:
        keys = KeyPair(str(content["public_key"]), str(content["secret_key"]))
        if zmq.curve_public(keys.secret.encode("ascii")).decode("ascii") != keys.public:
            raise ValueError
        identity = Identity(str(content["id"]), str(content["name"]), keys)
    except (KeyError, ValueError, zmq.ZMQError):
        raise PeerdError(f"{path} is damaged (bad keys or fields)") from None
    if identity.id != peer_id_for(keys.public):
        raise PeerdError(f"{path} is damaged (id does not match the public key)")
    return identity


def has_secret(state_dir: Path) -> bool:
    return (state_dir / CLUSTER_FILE).exists()


def store_secret(state_dir: Path, secret: ClusterSecret) -> None:
    encoded = base64.urlsafe_b64encode(secret.secret).decode("ascii")
    statedir.write_secret_json(state_dir / CLUSTER_FILE, {"format": FORMAT, "secret": encoded})


def load_secret(state_dir: Path) -> ClusterSecret:
    path = state_dir / CLUSTER_FILE
    if not path.exists():
        raise PeerdError(
            f"no cluster secret in {state_dir}: run `peerd init` or `peerd join TOKEN`"
        )
    content = statedir.read_json(path)
    try:
        secret = base64.urlsafe_b64decode(str(content["secret"]).encode("ascii"))
    except (KeyError, ValueError, binascii.Error):
        raise PeerdError(f"{path} is damaged (no readable secret)") from None
    if len(secret) != SECRET_BYTES:
        raise PeerdError(f"{path} is damaged (secret is not {SECRET_BYTES} bytes)")
    return ClusterSecret(secret)
