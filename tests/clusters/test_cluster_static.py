"""Static peers: where multicast is blocked, `--peer HOST:PORT` alone forms the cluster."""

import netns
import pytest

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]

PORT = 7700


def test_peers_behind_a_multicast_block_join_by_hello(tmp_path):
    dirs = netns.make_state_dirs(tmp_path, 2)
    with netns.Network(2) as network:
        for i in range(2):
            network.block_multicast(i)
        try:
            first = network.start_peer(0, dirs[0], "--port", str(PORT))
            # Only the second peer knows the first; the first learns it from the hello.
            second = network.start_peer(1, dirs[1], "--peer", f"{network.address(0)}:{PORT}")
            agreed = netns.wait_for(
                lambda: netns.agreement([first.status(), second.status()],
                                        [first.id, second.id]),
                timeout=netns.FORMED_S, what="the two peers to find each other by hello",
            )
        except BaseException:
            for peer in network.peers:
                print(peer.log())
            raise
        assert agreed["leader"] in (first.id, second.id)
        ports = first.status()["ports"]
        assert (ports["hello"], ports["control"], ports["data"]) == (PORT, PORT + 1, PORT + 2)
        for peer in (first, second):
            assert peer.status()["security"]["ignored_records"] == 0
