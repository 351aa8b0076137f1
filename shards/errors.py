"""The error raised for a model directory that cannot be used.

`shards` never imports `peerd`, so this is its own exception type; command handlers turn it
into `peerd.errors.PeerdError` (same one-line message, exit 1).
"""


class ModelError(Exception):
    """A model directory is missing, malformed or unsupported; the message is one line."""


class NoTokenizer(ModelError):
    """The model has no tokenizer that can be used; it still runs from token ids."""
