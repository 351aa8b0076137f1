"""Three daemons in three network namespaces: forming a cluster, and losing its leader."""

import time

import netns
import pytest

pytestmark = pytest.mark.skipif(
    netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason())
)


def test_three_peers_find_each_other_by_mdns_agree_on_a_leader_and_measure_all(tmp_path):
    dirs = netns.make_state_dirs(tmp_path, 3)
    started = time.monotonic()
    with netns.cluster(dirs) as (_, peers):
        ids = [p.id for p in peers]
        agreed = netns.wait_for(
            lambda: netns.agreement([p.status() for p in peers], ids),
            timeout=15 - (time.monotonic() - started),
            what="three peers to agree on a leader and measure every peer and link",
        )
        assert agreed["leader"] in ids and agreed["epoch"] >= 1
        for status in (p.status() for p in peers):
            assert status["plan"] is None
            roles = {p["id"]: p for p in status["peers"]}
            assert roles[status["self"]]["self"]
            assert all(p["address"].startswith("10.77.") for p in status["peers"])
            assert (status["role"] == "leader") == (status["self"] == agreed["leader"])


def test_killing_the_leader_elects_a_new_one_with_a_higher_epoch_within_5s(tmp_path):
    with netns.cluster(netns.make_state_dirs(tmp_path, 3)) as (_, peers):
        first = netns.wait_for(
            lambda: netns.agreement([p.status() for p in peers], [p.id for p in peers]),
            timeout=30, what="the cluster to form",
        )
        leader = next(p for p in peers if p.id == first["leader"])
        survivors = [p for p in peers if p is not leader]
        leader.kill()
        killed = time.monotonic()

        def new_leader():
            statuses = [p.status() for p in survivors]
            if None in statuses:
                return None
            views = {(s["leader"], s["epoch"]) for s in statuses}
            new, epoch = views.pop()
            if views or new in (None, leader.id) or epoch <= first["epoch"]:
                return None
            for status in statuses:
                gone = next(p for p in status["peers"] if p["id"] == leader.id)
                if gone["state"] == "alive":
                    return None
            return new, epoch

        new, epoch = netns.wait_for(new_leader, timeout=5, what="a new leader")
        print(f"new leader {new} in epoch {epoch} after {time.monotonic() - killed:.2f}s")
        assert new in {p.id for p in survivors}
        assert all(p.running() for p in survivors)
