"""A copied state directory: two daemons with one identity are reported, not merged."""

import shutil

import netns
import pytest

pytestmark = [pytest.mark.cluster, netns.needs_namespaces]


def test_two_daemons_with_one_identity_are_reported_and_kept_out(tmp_path):
    dirs = netns.make_state_dirs(tmp_path, 2)
    copy = tmp_path / "copy"
    shutil.copytree(dirs[1], copy)
    with netns.cluster([*dirs, copy]) as (_, (honest, original, duplicate)):
        assert original.id == duplicate.id

        def reported():
            statuses = [p.status() for p in (honest, original, duplicate)]
            if None in statuses:
                return None
            seen_by_honest = {p["id"]: p for p in statuses[0]["peers"]}
            both_know = all(s["duplicate_of_self"] for s in statuses[1:])
            flagged = original.id in seen_by_honest and seen_by_honest[original.id]["duplicate"]
            # a leader elected before the duplicate was seen is dropped a moment later
            follows_honest = statuses[0]["leader"] in (honest.id, None)
            return statuses if both_know and flagged and follows_honest else None

        honest_view, *_ = netns.wait_for(reported, timeout=netns.FORMED_S,
                                         what="the duplicate to be reported")
        others = [p for p in honest_view["peers"] if not p["self"]]
        assert [p["id"] for p in others] == [original.id]  # listed once, never merged
        assert all(p.running() for p in (honest, original, duplicate))
