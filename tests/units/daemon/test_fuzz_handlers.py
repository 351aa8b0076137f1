"""Fuzzing the daemon's message dispatch in one process, deep into stale epochs.

A `Daemon` (not started: no sockets are bound) follows a leader at epoch 5 with one more
member. Hypothesis feeds `_on_message` decoded messages of every kind, as the transport would
after authenticating them, from either member and with epochs older than the current one:
nothing may raise, nothing may change who leads or which epoch it is, no plan or report may be
taken, and every task a handler started must end without an exception.

The real processes get the same treatment in tests/clusters/test_fuzz_daemon.py, where a freshly
formed cluster is usually at epoch 1 and so has no stale epoch above 0 to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from daemon_objects import join, unstarted_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_strategies import KINDS, fields, hex_digests, tensor_fields
from wire_strategies import frames as wire_frames

from peerd.cluster.election import Role
from peerd.wire import protocol
from peerd.wire.transport import Incoming

EPOCH = 5
LEFT_OUT = {"hello", "heartbeat", "goodbye"}  # a member may legitimately restart or leave


@contextlib.asynccontextmanager
async def _follower(state_dir: Path):
    """A fresh daemon following the first of two members, the leader of epoch EPOCH."""
    async with unstarted_daemon(state_dir) as daemon:
        members = [join(daemon, name) for name in ("leader", "other")]
        daemon.cluster.election = dataclasses.replace(
            daemon.cluster.election, epoch=EPOCH, leader=members[0].id, role=Role.FOLLOWER
        )
        yield daemon, members


OVERRIDES = {
    "epoch": st.integers(0, EPOCH - 1),
    "sha256": hex_digests,
    "offset": st.integers(0, 1 << 20),
    "length": st.integers(1, 4096),
    "payload_bytes": st.integers(1, 4096),
}


@st.composite
def stale_messages(draw):
    """A message of any kind that decodes, with an epoch older than the current one."""
    cls = draw(st.sampled_from([c for k, c in sorted(KINDS.items()) if k not in LEFT_OUT]))
    values = draw(fields(cls, OVERRIDES))
    tensors = None
    if "tensors" in tensor_fields(cls):
        name = draw(st.sampled_from(["payload", "data"]))
        tensors = {name: np.zeros(draw(st.integers(1, 64)), np.uint8)}
    try:
        return protocol.decode(wire_frames(cls.KIND, values, tensors))
    except protocol.ProtocolError:
        return None


@pytest.mark.slow
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
async def test_stale_and_wrong_messages_change_nothing_and_raise_nothing(tmp_path, data):
    batch = data.draw(st.lists(st.tuples(st.sampled_from([0, 1]), stale_messages()),
                               min_size=1, max_size=20))
    async with _follower(tmp_path) as (daemon, members):
        leader = members[0].id
        for sender, msg in batch:
            if msg is None:
                continue
            daemon._on_message(Incoming(
                channel=msg.CHANNEL, sender_key=members[sender].public_key,
                peer_address="127.0.0.1", msg=msg, reply=lambda answer: None,
            ))
            state = daemon.cluster.election
            assert (state.leader, state.epoch, state.role) == (leader, EPOCH, Role.FOLLOWER)
            assert daemon.plans.deployment.assignment is None and daemon.measuring.report is None
        tasks = list(daemon._tasks)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert [t.exception() for t in tasks if not t.cancelled() and t.exception()] == []
