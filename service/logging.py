"""Structured (JSON-lines) logging.

Log records carry a message and a few structured fields (``extra=``). Nothing logs request
headers or bodies; as a second line of defence the handler scrubs API-key-shaped tokens, bearer
credentials and every configured secret from the formatted line.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, TextIO

from service.errors import scrub

_STANDARD_ATTRS = set(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}
_HANDLER_NAME = "xmark-json"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the process id (which worker of
    ``xmark serve --workers N``) and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                payload[key] = value if isinstance(value, (int, float, bool, type(None))) else str(value)
        if record.exc_info and record.exc_info[0] is not None:
            payload["exception"] = record.exc_info[0].__name__
        return json.dumps(payload, ensure_ascii=False)


class RedactingFormatter(JsonFormatter):
    """JSON formatter that removes key-shaped tokens and the given secret values."""

    def __init__(self, secrets: Iterable[bytes | str] = ()) -> None:
        super().__init__()
        self._secrets = tuple(s.decode(errors="ignore") if isinstance(s, bytes) else s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        line = scrub(super().format(record))
        for secret in self._secrets:
            line = line.replace(secret, "[redacted]")
        return line


def configure_logging(level: str, secrets: Iterable[bytes | str] = (), stream: TextIO | None = None) -> None:
    """Install (or replace) the JSON handler on the root logger (writing to stderr by default)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(RedactingFormatter(secrets))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("uvicorn.access",):
        logging.getLogger(noisy).disabled = True
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for chatty in ("httpx", "httpcore"):  # one line per upstream call and health check otherwise
        logging.getLogger(chatty).setLevel(max(level if isinstance(level, int) else logging.INFO, logging.WARNING))
