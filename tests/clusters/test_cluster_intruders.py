"""Strangers and garbage: a daemon of another cluster, a non-member CURVE client, random
bytes and malformed messages on every port. Members must ignore them and keep working."""

import json
import sys

import netns
import pytest

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]


def _form(peers):
    return netns.wait_for(
        lambda: netns.agreement([p.status() for p in peers], [p.id for p in peers]),
        timeout=netns.FORMED_S, what="the members to form a cluster",
    )


def _security(peer, counter: str) -> int:
    """One of the peer's security counters; -1 while it cannot answer."""
    status = peer.status()
    return status["security"][counter] if status else -1


def _public_keys(peers) -> dict[str, str]:
    """Every member's public key, as the others list it."""
    return {
        entry["id"]: entry["public_key"]
        for status in (p.status() for p in peers)
        for entry in status["peers"]
        if not entry["self"]
    }


def _tool(network, namespace_index: int, command: str, spec: dict) -> dict:
    result = network.run(
        namespace_index, [sys.executable, str(netns.HERE), command, json.dumps(spec)], timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_peer_of_another_cluster_is_never_a_member_and_cannot_handshake(tmp_path):
    dirs = netns.make_state_dirs(tmp_path, 3) + netns.make_state_dirs(tmp_path, 1, "stranger")
    with netns.cluster(dirs) as (network, everyone):
        members, stranger = everyone[:3], everyone[3]
        _form(members)
        netns.wait_for(
            lambda: all(_security(p, "ignored_records") >= 1 for p in everyone),
            timeout=15, what="every daemon to have seen and refused the other cluster's record",
        )
        for status in (p.status() for p in members):
            assert stranger.id not in {p["id"] for p in status["peers"]}
        assert [p["id"] for p in stranger.status()["peers"]] == [stranger.id]

        target = members[0].status()
        refused_before = target["security"]["refused_handshakes"]
        probe = _tool(network, 3, "curve-probe", {
            "address": members[0].address, "port": target["ports"]["control"],
            "server_key": _public_keys(members)[members[0].id], "timeout": 3.0,
        })
        assert not probe["answered"]
        assert "HANDSHAKE_FAILED_AUTH" in probe["events"]
        assert "HANDSHAKE_SUCCEEDED" not in probe["events"]
        assert members[0].status()["security"]["refused_handshakes"] > refused_before
        assert all(p.running() for p in everyone)


def test_garbage_on_every_port_leaves_every_daemon_running_and_correct(tmp_path):
    dirs = netns.make_state_dirs(tmp_path, 3)
    with netns.cluster(dirs) as (network, peers):
        before = _form(peers)
        keys = _public_keys(peers)
        targets = [
            {"address": p.address, "ports": list(p.status()["ports"].values()),
             "public_key": keys[p.id]}
            for p in peers
        ]
        # The attacker holds peer 2's keys: its junk passes the handshake at peers 0 and 1.
        identity = json.loads((dirs[2] / "identity.json").read_text())
        sent = _tool(network, 2, "garbage", {"targets": targets, "member_keys": identity})
        assert sent["tcp"] == 18 and sent["member"] > 0

        netns.wait_for(
            lambda: all(_security(p, "malformed_messages") > 0 for p in peers[:2]),
            timeout=10, what="the junk to reach the decoders and be dropped",
        )
        assert all(p.running() for p in peers)
        after = _form(peers)
        assert after == before
