"""Watermark secret configuration shared by the gateway and the vLLM workers.

Both read the same ``name:secret[,name:secret...]`` entries (``XMARK_WATERMARK_SECRETS``, or one
entry per line in ``XMARK_SECRETS_FILE``, where ``#`` starts a comment line) and must refuse the
same values: secrets shorter than ``MIN_SECRET_BYTES``, placeholders such as ``changeme``, and
values with too few distinct characters. Error messages name the source, the key version and
the rule, never a secret.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .errors import SecretConfigError
from .keys import MIN_SECRET_BYTES

__all__ = [
    "KEY_VERSION_NAME",
    "MIN_SECRET_BYTES",
    "SecretConfigError",
    "parse_secret_entries",
    "placeholder_reason",
]

KEY_VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PLACEHOLDER_WORDS = (
    "changeme",
    "change-me",
    "change_me",
    "replaceme",
    "replace-me",
    "replace_me",
    "placeholder",
    "your-secret",
    "your_secret",
    "yoursecret",
    "example",
    "secret-here",
    "todo",
)
_PLACEHOLDER_VALUES = {"secret", "password", "default", "test", "xxx", "none", "null"}


def placeholder_reason(value: str | bytes) -> str | None:
    """Why ``value`` is not acceptable as a secret, or None when it is."""
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) < MIN_SECRET_BYTES:
        return f"shorter than {MIN_SECRET_BYTES} bytes"
    text = raw.decode(errors="ignore").strip().lower()
    if text in _PLACEHOLDER_VALUES or any(word in text for word in _PLACEHOLDER_WORDS):
        return "a placeholder value"
    if len(set(raw)) < 4:
        return "too few distinct characters"
    return None


def parse_secret_entries(
    text: str,
    *,
    source: str,
    error: Callable[[str], Exception] = SecretConfigError,
) -> dict[str, bytes]:
    """Parse ``name:secret`` entries separated by commas or new lines (``#`` starts a comment line).

    Every problem raises ``error(message)``: a malformed entry, a bad or repeated key version
    name, a secret that :func:`placeholder_reason` refuses, or no entry at all.
    """
    entries: dict[str, bytes] = {}
    for chunk in re.split(r"[,\n]", text):
        item = chunk.strip()
        if not item or item.startswith("#"):
            continue
        name, sep, secret = item.partition(":")
        name, secret = name.strip(), secret.strip()
        if not sep or not secret:
            raise error(f"{source}: every entry must look like name:secret")
        if not KEY_VERSION_NAME.match(name):
            # the name is not echoed: a secret written where the name belongs would be
            raise error(f"{source}: a key version name must match {KEY_VERSION_NAME.pattern}")
        if name in entries:
            raise error(f"{source}: key version {name!r} is listed twice")
        reason = placeholder_reason(secret)
        if reason is not None:
            raise error(f"{source}: the secret of key version {name!r} is {reason}")
        entries[name] = secret.encode()
    if not entries:
        raise error(f"{source}: no watermark secret configured")
    return entries
