"""Writing a peer's `--battery-file` the way a battery source should: whole, by rename, so
the daemon never reads half a document."""

from __future__ import annotations

import json
from pathlib import Path


def set_battery(path: Path, percent: float, plugged: bool) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"percent": percent, "plugged": plugged}))
    temporary.replace(path)
