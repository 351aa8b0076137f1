"""Where and how the OpenAI-compatible endpoint serves: `peerd start`'s --openai* options.

Apart from peerd/api/openai_api.py so that a daemon imports aiohttp (12 MB resident,
measured) only when it serves the endpoint.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from peerd.errors import PeerdError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 30.0  # an idle keep-alive connection is closed after this long


@dataclass(frozen=True)
class Settings:
    """Where and how the endpoint serves."""

    host: str = DEFAULT_HOST
    port: int = 0
    cors: tuple[str, ...] = ()  # origins whose pages may call it ("*": any)
    key: str | None = None  # the bearer key every request must carry, if any
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = IDLE_TIMEOUT_S


def settings_from_args(args: argparse.Namespace) -> Settings | None:
    """`peerd start`'s --openai* options; None when --openai is not given."""
    if not args.openai:
        given = [flag for flag, value in (
            ("--openai-cors", args.openai_cors), ("--openai-key-file", args.openai_key_file),
            ("--openai-max-connections", args.openai_max_connections is not None)) if value]
        if given:
            raise PeerdError(f"{given[0]} needs --openai [HOST:]PORT")
        return None
    max_connections = args.openai_max_connections
    if max_connections is None:
        max_connections = DEFAULT_MAX_CONNECTIONS
    elif max_connections < 1:
        raise PeerdError(f"--openai-max-connections {max_connections} must be at least 1")
    return Settings(
        *parse_address(args.openai),
        cors=tuple(parse_origin(o) for o in args.openai_cors),
        key=read_key(Path(args.openai_key_file)) if args.openai_key_file else None,
        max_connections=max_connections,
    )


def parse_address(text: str) -> tuple[str, int]:
    """`--openai`'s HOST:PORT (``[v6]:PORT`` for IPv6), or PORT alone for 127.0.0.1:PORT."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_HOST
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise PeerdError(f"--openai {text!r} is not [HOST:]PORT")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise PeerdError(f"--openai {text!r}: the host must be an IP address") from None
    return host, int(port)


def parse_origin(text: str) -> str:
    """An --openai-cors origin: SCHEME://HOST[:PORT] as a browser sends it, or "*"."""
    if text == "*":
        return text
    try:
        parts = urlsplit(text.rstrip("/"))
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or (
        parts.path or parts.query or parts.fragment or "@" in parts.netloc
    ):
        raise PeerdError(f"--openai-cors {text!r} is not an origin such as "
                         "http://localhost:3000 (or *)")
    return f"{parts.scheme}://{parts.netloc}"


def read_key(path: Path) -> str:
    """The key in --openai-key-file: its one line, without surrounding whitespace."""
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        raise PeerdError(f"--openai-key-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise PeerdError(f"--openai-key-file {path}: cannot read it: {reason}") from None
    if not key:
        raise PeerdError(f"--openai-key-file {path} is empty: put the key in it")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise PeerdError(f"--openai-key-file {path}: the key must be one word of printable "
                         "ASCII")
    return key
