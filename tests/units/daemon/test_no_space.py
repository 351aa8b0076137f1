"""Telling a full disk from other write failures (peerd.statedir.is_no_space), on a real
small filesystem: a full disk is worth trying again once there is room, other failures
are not."""

from __future__ import annotations

import errno

import numpy as np
from disks import fill, tmpfs

from peerd.statedir import is_no_space


def _numpy_write(path) -> OSError:
    """What numpy's tofile raises when its write fails: an OSError with no errno."""
    try:
        np.zeros(1 << 20, np.float32).tofile(path)
    except OSError as exc:
        return exc
    raise AssertionError("the write did not fail")


def test_an_oserror_without_errno_is_a_full_disk_only_where_the_disk_is_full(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill(disk / "ballast")
        failed = _numpy_write(disk / "weights.bin")
        assert failed.errno is None
        assert is_no_space(failed, disk / "not-made-yet" / "out")
        assert not is_no_space(failed), "without the directory written to, it cannot tell"
        (disk / "ballast").unlink()
        assert not is_no_space(failed, disk), "room again: some other failure"


def test_enospc_anywhere_in_the_chain_is_a_full_disk(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("the exporter failed") from exc
    except RuntimeError as wrapped:
        assert is_no_space(wrapped)
    assert not is_no_space(OSError(errno.EACCES, "Permission denied"), tmp_path)
