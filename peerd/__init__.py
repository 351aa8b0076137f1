"""peerd: distributed LLM inference across the trusted devices of one home."""

__version__ = "0.1.0"
