"""Hash keys derived from one watermark secret.

The k hash keys come from HMAC-SHA256(secret, label) with a distinct label per key; each key
is five 32-bit words (three for the context multiplier, two for the token code, see
``hashing``). The fingerprint is HMAC-SHA256 of the parameters under a key derived from the
secret: safe to store and show, it identifies the secret+parameters without revealing either.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import NoReturn

import numpy as np

from .errors import ArgumentError, ArgumentTypeError, SecretConfigError
from .params import WatermarkParams

MIN_SECRET_BYTES = 16
WORDS_PER_KEY = 5
_LABEL = b"xmark/v1"


class WatermarkKey:
    """The derived hash keys of one key version. The secret itself is not kept."""

    __slots__ = ("_fingerprint", "_params", "_words")

    def __init__(self, params: WatermarkParams, words: np.ndarray, fingerprint: str) -> None:
        if words.shape != (params.num_keys, WORDS_PER_KEY) or words.dtype != np.int64:
            raise ArgumentError(f"key words must be int64 [{params.num_keys}, {WORDS_PER_KEY}]")
        words = words.copy()
        words.setflags(write=False)
        self._params = params
        self._words = words
        self._fingerprint = fingerprint

    @classmethod
    def from_secret(cls, secret: str | bytes, params: WatermarkParams) -> WatermarkKey:
        if isinstance(secret, str):
            secret_bytes = secret.encode("utf-8")
        elif isinstance(secret, (bytes, bytearray)):
            secret_bytes = bytes(secret)
        else:
            raise ArgumentTypeError(f"secret must be str or bytes (got {type(secret).__name__})")
        if len(secret_bytes) < MIN_SECRET_BYTES:
            raise SecretConfigError(f"secret must be at least {MIN_SECRET_BYTES} bytes long")
        words = np.empty((params.num_keys, WORDS_PER_KEY), dtype=np.int64)
        for j in range(params.num_keys):
            digest = hmac.new(secret_bytes, _LABEL + b"/hash-key/%d" % j, hashlib.sha256).digest()
            words[j] = np.frombuffer(digest[: 4 * WORDS_PER_KEY], dtype="<u4").astype(np.int64)
        fp_key = hmac.new(secret_bytes, _LABEL + b"/fingerprint", hashlib.sha256).digest()
        canonical = json.dumps(params.to_dict(), sort_keys=True).encode()
        fingerprint = hmac.new(fp_key, canonical, hashlib.sha256).hexdigest()
        return cls(params, words, fingerprint)

    @property
    def params(self) -> WatermarkParams:
        return self._params

    @property
    def words(self) -> np.ndarray:
        """int64 [k, 5], every value in [0, 2**32). Treat as secret."""
        return self._words

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"WatermarkKey(params={self._params!r}, fingerprint={self._fingerprint[:12]}…)"

    def __reduce__(self) -> NoReturn:  # pragma: no cover - keys must not be pickled by accident
        raise ArgumentTypeError("WatermarkKey cannot be pickled")
