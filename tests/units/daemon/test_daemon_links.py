"""The leader's link measurements: a round that could not measure every link tries again
within seconds, not a whole links interval later (no plan can use a peer without links)."""

import dataclasses
import time

from daemon_objects import join, unstarted_daemon

from peerd.cluster.election import Role
from peerd.cluster.measuring import LINK_RETRY_S

EPOCH = 3


async def test_a_round_missing_links_probes_again_within_seconds(tmp_path):
    async with unstarted_daemon(tmp_path) as daemon:
        join(daemon, "newcomer")  # heard from, but nothing answers its probes yet
        daemon.cluster.election = dataclasses.replace(
            daemon.cluster.election, epoch=EPOCH, leader=daemon.id, role=Role.LEADER
        )
        await daemon.measuring.round(EPOCH)
        assert daemon.measuring.links == ()
        due_in = daemon.measuring.links_at + daemon.options.links_interval_s - time.monotonic()
        assert 0 < due_in <= LINK_RETRY_S
