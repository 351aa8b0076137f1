"""A program run on a pseudo-terminal that is its controlling terminal: keys typed at it, and
what it prints. Ctrl-C typed there is the terminal's own: the terminal sends SIGINT to the
program, as it does for a person."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import termios
import time

ANSWER_S = 120


class Terminal:
    """A program on a pseudo-terminal: keys typed at it and what it prints.

    Output processing is off (a newline stays one byte) and typed keys are not echoed, so
    the screen holds exactly the bytes the session wrote.
    """

    def __init__(self, args: list[str]) -> None:
        self.fd, tty = os.openpty()
        attrs = termios.tcgetattr(tty)
        attrs[1] &= ~termios.OPOST
        attrs[3] = (attrs[3] | termios.ISIG | termios.ICANON) & ~termios.ECHO
        termios.tcsetattr(tty, termios.TCSANOW, attrs)
        self.process = subprocess.Popen(
            args, stdin=tty, stdout=tty, stderr=tty, start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
        os.close(tty)
        self.screen = b""
        self._seen = 0

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def read_until(self, text: str, timeout: float = ANSWER_S) -> str:
        """What was printed since the last read, up to and including `text`."""
        wanted = text.encode()
        deadline = time.monotonic() + timeout
        while (end := self.screen.find(wanted, self._seen)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {text!r} on the screen: {self.screen[-400:]!r}")
        printed = self.screen[self._seen : end + len(wanted)]
        self._seen = end + len(wanted)
        return printed.decode()

    def wait_for_output(self, timeout: float = ANSWER_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.screen) == self._seen:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError("the session printed nothing")

    def _read(self, timeout: float) -> bool:
        """Read what is there within `timeout`; False once the session closed the terminal."""
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                return False
            self.screen += chunk
            return bool(chunk)
        return True

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        os.close(self.fd)


def _controlling_terminal() -> None:
    """In the child: the pty on stdin becomes its controlling terminal, and Ctrl-C is
    SIGINT's default again (a background job of a shell inherits it ignored)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
