"""The daemon's open-file limit: raised from the soft limit to the hard one at start (in a
child process, so this test's own limits stay as they are)."""

from __future__ import annotations

import resource
import subprocess
import sys

RAISE = ("import resource; from peerd.daemon.limits import raise_file_limit; "
         "print(raise_file_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))")


def _raised_under(soft: int, hard: int) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", RAISE], capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    )
    assert done.returncode == 0, done.stderr
    return [int(n) for n in done.stdout.split()]


def test_the_soft_file_limit_is_raised_to_the_hard_one():
    assert _raised_under(256, 1024) == [1024, 1024, 1024]


def test_a_soft_limit_already_at_the_hard_one_stays():
    assert _raised_under(1024, 1024) == [1024, 1024, 1024]
