"""The process limits the daemon needs: its soft limit on open files raised to the hard one.

systemd starts services with a soft limit of 1,024 files (the units raise it, LimitNOFILE=);
the daemon's ZeroMQ sockets, unit files and HTTP clients share it, so it takes all it may."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("peerd.daemon.limits")


def raise_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit the kernel caps
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("open-file limit raised from %d to %d", soft, hard)
    return hard
