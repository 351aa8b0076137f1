"""The one exception type a command raises to end with exit code 1 and a one-line reason, and
the kinds of failure it carries, so clients act on the kind (the HTTP layer picks a status
code, `peerd chat` suggests --prompt-ids) instead of matching the message's text."""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    """What kind of failure, as the local API's error answers name it (``"kind"``)."""

    FAILED = "failed"  # anything else: the message says what
    INVALID_REQUEST = "invalid_request"  # the request is wrong: asking again cannot help
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + new tokens exceed the model's positions
    NO_TOKENIZER = "no_tokenizer"  # text sent to a model that takes token ids only
    BUSY = "busy"  # every answer slot is taken: ask again shortly
    UNAVAILABLE = "unavailable"  # no plan serves the model now (none yet, or peers lost)

    @classmethod
    def parse(cls, value: object) -> ErrorKind:
        """The kind an error answer names; FAILED for one it does not (an older peer)."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED


class PeerdError(Exception):
    """A failure the user should read: the message is printed as one line on stderr."""

    exit_code = 1  # what a command that ends with this error exits with

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.FAILED) -> None:
        super().__init__(message)
        self.kind = kind

    def answer(self) -> dict[str, object]:
        """This error as a local API answer."""
        return {"ok": False, "error": str(self), "kind": self.kind.value}


def invalid(message: str) -> PeerdError:
    """A request that is wrong in itself: asking again cannot help."""
    return PeerdError(message, ErrorKind.INVALID_REQUEST)
