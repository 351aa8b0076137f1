"""Where a peer keeps its state, and how secret files are written there.

Resolution order: ``--state-dir``, ``$PEERD_STATE_DIR``, ``$STATE_DIRECTORY`` (set by systemd's
``StateDirectory=peerd`` to ``/var/lib/peerd`` for the system unit), ``$XDG_STATE_HOME/peerd``,
``~/.local/state/peerd``.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from peerd.errors import PeerdError

SOCKET_NAME = "peerd.sock"
EX_TEMPFAIL = 75  # sysexits.h: a temporary failure, worth trying again later


class NoSpace(PeerdError):
    """A write that found its filesystem full; the message names the directory. A command
    ending with it exits with EX_TEMPFAIL, which is how a daemon tells it from a failure
    that trying again cannot cure."""

    exit_code = EX_TEMPFAIL

    def __init__(self, directory: Path, writing: str) -> None:
        super().__init__(f"no space left in {directory} ({writing})")


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is ENOSPC (libraries such
    as the ONNX exporter wrap the OSError of a failed write)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def resolve(explicit: str | None = None) -> Path:
    """The state directory this invocation uses (not created)."""
    if explicit:
        return Path(explicit).expanduser()
    for variable in ("PEERD_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(variable)
        if value:
            # systemd joins several StateDirectory= entries with ':'; ours is the first.
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "peerd"


def ensure(state_dir: Path) -> Path:
    """Create the directory (mode 0700) if needed and check that it is a directory."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise PeerdError(f"cannot create state directory {state_dir}: {exc.strerror}") from None
    if not state_dir.is_dir():
        raise PeerdError(f"state directory {state_dir} is not a directory")
    return state_dir


def socket_path(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


def write_secret_json(path: Path, content: dict[str, Any]) -> None:
    """Write JSON readable by the owner only (0600), atomically: to a temporary name,
    synced, then renamed, so a crash or a full disk never leaves half a file under `path`.
    A full disk is a PeerdError naming the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(content, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise NoSpace(path.parent, f"writing {path.name}") from None
        raise


def read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text())
    except OSError as exc:
        raise PeerdError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise PeerdError(f"{path} is not valid JSON") from None
    if not isinstance(content, dict):
        raise PeerdError(f"{path} does not hold a JSON object")
    return content
