"""How much the demo's unit cache saves: `peerd demo` twice, the first with an empty cache.

Both runs are whole `peerd demo` commands as a user types them (three daemons, planning,
deployment, a 24-token answer), each timed from start to exit; the cache is a fresh
directory (PEERD_CACHE_DIR), so the first run shards the built-in model and the second finds
its units there. Prints both times and their ratio.

    .venv/bin/python -m bench.demo_cache
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_demo(env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "peerd", "demo"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="peerd-bench-cache-") as cache:
        env = {**os.environ, "PEERD_CACHE_DIR": str(Path(cache))}
        first = timed_demo(env)
        second = timed_demo(env)
    print(f"first run (shards the model): {first:.1f} s")
    print(f"second run (units cached):    {second:.1f} s")
    print(f"ratio: {first / second:.1f}x")


if __name__ == "__main__":
    main()
