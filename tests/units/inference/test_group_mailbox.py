"""A group share's mailbox, without a network: a send of this share's that failed fails its
own step's wait, and only that step's: a later step, once the link is back, is not failed
by it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from peerd.inference.groups import GroupLost, Mailbox
from peerd.inference.shares import ShareTag
from peerd.wire.protocol import SharePhase
from shards.share_split import Span

WAIT_S = 600.0  # never waited out: each wait ends by a message or a failure
FAILED_WITHIN_S = 30.0  # a wait the failure does not end fails on its own after this


def _tag(step: int, share: int) -> ShareTag:
    return ShareTag("1.1", "s", step, 1, SharePhase.GATHER, share)


def _from_share_1(step: int):
    return _tag(step, 1).of(Span(0, 1), np.ones((1, 1, 4), np.float32))


def test_a_failed_send_fails_the_wait_of_its_step_in_progress():
    mailbox = Mailbox()
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            mailbox.take(_tag(0, 0), [1], FAILED_WITHIN_S)
        except GroupLost as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    mailbox.fail(("s", 0), GroupLost("a share's data was not sent"))
    waiter.join(2 * FAILED_WITHIN_S)
    assert not waiter.is_alive()
    assert [str(exc) for exc in raised] == ["a share's data was not sent"]


def test_a_failure_of_an_earlier_step_does_not_fail_a_later_one():
    mailbox = Mailbox()
    mailbox.fail(("s", 0), GroupLost("a share's data was not sent"))
    mailbox.put(_from_share_1(1))
    got = mailbox.take(_tag(1, 0), [1], WAIT_S)
    np.testing.assert_array_equal(got[1].tensors["rows"], np.ones((1, 1, 4), np.float32))
    mailbox.put(_from_share_1(2))  # and it is forgotten, not kept for another step
    assert 1 in mailbox.take(_tag(2, 0), [1], WAIT_S)


def test_a_failure_of_its_step_comes_before_the_messages_that_have_come():
    mailbox = Mailbox()
    mailbox.put(_from_share_1(3))
    mailbox.fail(("s", 3), GroupLost("a share's data was not sent"))
    with pytest.raises(GroupLost):
        mailbox.take(_tag(3, 0), [1], WAIT_S)
