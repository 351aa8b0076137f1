"""`peerd init`, `peerd invite` and `peerd join`: creating and sharing cluster membership."""

from __future__ import annotations

import argparse
import secrets

from peerd import statedir
from peerd.errors import PeerdError
from peerd.wire import identity, join_token


def cmd_init(args: argparse.Namespace) -> int:
    state_dir = statedir.ensure(statedir.resolve(args.state_dir))
    if identity.has_secret(state_dir):
        existing = identity.load_secret(state_dir)
        raise PeerdError(
            f"{state_dir} already belongs to cluster {existing.cluster_id}; "
            "use another --state-dir"
        )
    me = identity.ensure_identity(state_dir, args.name)
    secret = identity.ClusterSecret(secrets.token_bytes(identity.SECRET_BYTES))
    identity.store_secret(state_dir, secret)
    print(f"created cluster {secret.cluster_id}; this peer is {me.name} ({me.id})")
    print("run `peerd invite` to get a token for another device")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    state_dir = statedir.resolve(args.state_dir)
    print(join_token.encode(identity.load_secret(state_dir)))
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    secret = join_token.decode(args.token)
    state_dir = statedir.ensure(statedir.resolve(args.state_dir))
    if identity.has_secret(state_dir):
        existing = identity.load_secret(state_dir)
        if existing.secret != secret.secret:
            raise PeerdError(
                f"{state_dir} already belongs to cluster {existing.cluster_id}; "
                "use another --state-dir"
            )
    else:
        identity.store_secret(state_dir, secret)
    me = identity.ensure_identity(state_dir, args.name)
    print(f"joined cluster {secret.cluster_id}; this peer is {me.name} ({me.id})")
    return 0
