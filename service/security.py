"""API keys: ``xm_<random>_<checksum>``.

* random: 32 random bytes written as 43 base62 characters;
* checksum: CRC32 of the random part as 6 base62 characters, so a mistyped key is rejected
  before any database lookup;
* stored: HMAC-SHA256(pepper, key) and a short display prefix only; compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import zlib
from dataclasses import dataclass, field

from service.exceptions import ServiceError

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_RANDOM_BYTES = 32
_RANDOM_CHARS = 43  # 62**43 > 2**256
_CHECKSUM_CHARS = 6  # 62**6 > 2**32
_PREFIX_RANDOM_CHARS = 8
KEY_PATTERN = re.compile(r"xm_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")
_FULL_KEY = re.compile(rf"^{KEY_PATTERN.pattern}$")
MAX_KEY_LENGTH = 3 + _RANDOM_CHARS + 1 + _CHECKSUM_CHARS


class ApiKeyFormatError(ServiceError, ValueError):
    """The text is not a well-formed gateway API key (the message never contains the text)."""


def _base62(value: int, width: int) -> str:
    chars = []
    while value:
        value, rem = divmod(value, 62)
        chars.append(_ALPHABET[rem])
    text = "".join(reversed(chars))
    return text.rjust(width, _ALPHABET[0])


def _checksum(random_part: str) -> str:
    return _base62(zlib.crc32(random_part.encode()), _CHECKSUM_CHARS)


@dataclass(frozen=True)
class ParsedKey:
    """A key that passed the format and checksum test."""

    plaintext: str = field(repr=False)
    prefix: str


def display_prefix(random_part: str) -> str:
    return "xm_" + random_part[:_PREFIX_RANDOM_CHARS]


def generate_api_key() -> ParsedKey:
    """A fresh key; its plaintext is shown to the caller once and never stored."""
    random_part = _base62(int.from_bytes(secrets.token_bytes(_RANDOM_BYTES), "big"), _RANDOM_CHARS)
    plaintext = f"xm_{random_part}_{_checksum(random_part)}"
    return ParsedKey(plaintext=plaintext, prefix=display_prefix(random_part))


def parse_api_key(text: str) -> ParsedKey:
    """Check format and checksum without touching the database."""
    if len(text) != MAX_KEY_LENGTH or not _FULL_KEY.match(text):
        raise ApiKeyFormatError("malformed API key")
    random_part = text[3 : 3 + _RANDOM_CHARS]
    if not hmac.compare_digest(text[-_CHECKSUM_CHARS:], _checksum(random_part)):
        raise ApiKeyFormatError("API key checksum mismatch")
    return ParsedKey(plaintext=text, prefix=display_prefix(random_part))


class ApiKeyHasher:
    """HMAC-SHA256 of API keys under the server-side pepper."""

    def __init__(self, pepper: bytes) -> None:
        self._pepper = pepper

    def __repr__(self) -> str:
        return "ApiKeyHasher(pepper=<hidden>)"

    def hash(self, key: ParsedKey) -> str:
        return hmac.new(self._pepper, key.plaintext.encode(), hashlib.sha256).hexdigest()

    def matches(self, key: ParsedKey, stored_hash: str) -> bool:
        return hmac.compare_digest(self.hash(key), stored_hash)
