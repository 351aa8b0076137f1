"""A peer's fixed memory: what a daemon imports before it serves anything.

Each library below is resident in every daemon that imports it (measured: aiohttp 12 MB,
onnx 10 MB, tokenizers with jinja2 10 MB, torch and scipy far more), and a peer's RSS is
meant to be its units plus K/V plus a small fixed overhead."""

import subprocess
import sys

NOT_IN_A_DAEMON = ("aiohttp", "onnx", "jinja2", "tokenizers", "torch", "scipy", "textual")


def test_a_daemon_without_the_openai_endpoint_or_a_tokenizer_leaves_heavy_libraries_out():
    code = ("import sys, peerd.daemon.start, peerd.daemon.wiring\n"
            f"print(' '.join(m for m in {NOT_IN_A_DAEMON!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == []
