"""The one exception type a command raises to end with exit code 1 and a one-line reason."""


class PeerdError(Exception):
    """A failure the user should read: the message is printed as one line on stderr."""
