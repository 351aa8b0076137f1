"""The chat prompt on a real pseudo-terminal: Ctrl-C there ends the session even when the
signal misses readline's wait.

CPython's readline loop acts on a signal only when it interrupts its select(); a Ctrl-C typed
the moment the prompt shows can land just before select() starts, and the prompt then waits
for the next key. The test makes that miss certain rather than waiting for it to happen: the
program blocks SIGINT in its main thread, so every SIGINT lands on a second thread and never
interrupts the main thread's select(), exactly as one arriving before it would not.
"""

from __future__ import annotations

import sys

from terminal import Terminal

from peerd.commands.chat import PROMPT

ENDED_S = 10

PROGRAM = """
import signal, sys, threading
from pathlib import Path
from peerd.commands.chat import EditedLines
lines = EditedLines(Path(sys.argv[1]))
threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # SIGINT goes to the thread above
while (line := lines.read()) is not None:
    sys.stderr.write(f"[read {line}]\\n")
sys.stderr.write("[ended]\\n")
"""


def test_ctrl_c_at_the_prompt_ends_the_session_though_it_missed_the_wait_for_a_key(tmp_path):
    session = Terminal([sys.executable, "-c", PROGRAM, str(tmp_path / "history")])
    try:
        session.read_until(PROMPT)
        session.type(b"hello\n")
        assert "[read hello]" in session.read_until(PROMPT)
        session.type(b"\x03")
        session.read_until("[ended]", timeout=ENDED_S)
        assert session.process.wait(timeout=ENDED_S) == 0
    finally:
        session.close()
