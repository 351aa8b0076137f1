"""A real `Daemon` object built without starting it: its handlers and rounds can be driven
directly, with members that exist only as records (nothing answers on their ports)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from peerd.cluster import membership
from peerd.cluster.records import PeerRecord
from peerd.daemon.wiring import Daemon, Options
from peerd.wire.identity import ClusterSecret, KeyPair, ensure_identity, peer_id_for


@contextlib.asynccontextmanager
async def unstarted_daemon(state_dir: Path, options: Options | None = None):
    identity = ensure_identity(state_dir, "me")
    daemon = Daemon(identity, ClusterSecret(b"s" * 32),
                    options or Options(state_dir=state_dir, interface="127.0.0.1"))
    try:
        yield daemon
    finally:
        await daemon.serving.close()
        await daemon.plans.close()
        await daemon.transport.close()


def join(daemon: Daemon, name: str) -> PeerRecord:
    """A member the daemon has heard from (its record and one heartbeat)."""
    keys = KeyPair.generate()
    record = PeerRecord(peer_id_for(keys.public), name, "run1", keys.public, 1, 2, 3)
    daemon.cluster.on_record(record, "127.0.0.1")
    daemon.cluster.apply_membership(membership.HeartbeatSeen(record.id, "run1", True, 1e9,
                                                            time.monotonic()))
    return record
