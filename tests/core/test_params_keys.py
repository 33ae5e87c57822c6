"""WatermarkParams validation and WatermarkKey derivation: errors, secrecy, fingerprints."""

from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest

from xmark_core import Message, WatermarkKey, WatermarkParams, decode

SECRET = "TOPSECRET-value-0123456789"


@pytest.mark.parametrize(
    ("fields", "exc", "pattern"),
    [
        ({"bits": 15}, ValueError, r"bits.*multiple of block_bits"),
        ({"bits": 18, "block_bits": 4}, ValueError, r"bits.*multiple of block_bits=4"),
        ({"bits": 0}, ValueError, r"bits must be in \[2, 256\]"),
        ({"bits": -4}, ValueError, r"bits must be in \[2, 256\]"),
        ({"bits": 258}, ValueError, r"bits must be in \[2, 256\]"),
        ({"bits": 16.0}, TypeError, r"bits must be an integer in \[2, 256\]"),
        ({"bits": True}, TypeError, r"bits must be an integer"),
        ({"block_bits": 0}, ValueError, r"block_bits must be in \[1, 8\]"),
        ({"block_bits": 5, "bits": 20}, ValueError, r"block_bits must be in \[1, 4\] for scheme 'xmark'"),
        ({"block_bits": 8, "bits": 32, "scheme": "mpac", "num_keys": 1}, ValueError, r"\[1, 4\] for scheme 'mpac'"),
        ({"block_bits": 9, "bits": 36, "scheme": "gumbel", "num_keys": 1}, ValueError, r"must be in \[1, 8\]"),
        ({"block_bits": "2"}, TypeError, r"block_bits must be an integer in \[1, 8\]"),
        ({"num_keys": 0}, ValueError, r"num_keys must be in \[1, 8\]"),
        ({"num_keys": 9}, ValueError, r"num_keys must be in \[1, 8\]"),
        ({"num_keys": 2.0}, TypeError, r"num_keys must be an integer in \[1, 8\]"),
        ({"delta": 0.0}, ValueError, r"delta must be a finite number > 0"),
        ({"delta": -1.0}, ValueError, r"delta must be a finite number > 0"),
        ({"delta": float("nan")}, ValueError, r"delta must be a finite number > 0"),
        ({"delta": float("inf")}, ValueError, r"delta must be a finite number > 0"),
        ({"delta": float("-inf")}, ValueError, r"delta must be a finite number > 0"),
        ({"delta": "2"}, TypeError, r"delta must be a number > 0"),
        ({"delta": None}, TypeError, r"delta must be a number > 0"),
        ({"scheme": "kgw"}, ValueError, r"scheme must be one of xmark, mpac, loso"),
        ({"scheme": "XMARK"}, ValueError, r"scheme must be one of"),
        ({"scheme": "loso", "num_keys": 2}, ValueError, r"num_keys must be 1 for scheme 'loso'"),
        ({"scheme": "mpac", "num_keys": 3}, ValueError, r"num_keys must be 1 for scheme 'mpac'"),
    ],
)
def test_invalid_params_name_the_field_and_its_range(fields: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        WatermarkParams(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"bits": 2, "block_bits": 2},
        {"bits": 256, "block_bits": 4, "num_keys": 8},
        {"bits": 7, "block_bits": 1},
        {"bits": 24, "block_bits": 3, "delta": 0.5},
        {"scheme": "loso", "num_keys": 1},
        {"scheme": "mpac", "num_keys": 1, "delta": 5},
        {"bits": 32, "block_bits": 8, "num_keys": 1, "scheme": "gumbel"},
        {"bits": 40, "block_bits": 5, "num_keys": 1, "scheme": "gumbel"},
    ],
)
def test_valid_params_and_derived_sizes(fields: dict) -> None:
    p = WatermarkParams(**fields)
    assert p.num_blocks * p.block_bits == p.bits
    assert p.num_shards == 2**p.block_bits
    assert WatermarkParams.from_dict(p.to_dict()) == p
    with pytest.raises(AttributeError):
        p.bits = 4  # type: ignore[misc]  # assigning to a frozen field on purpose


def test_default_params_are_the_papers() -> None:
    p = WatermarkParams()
    assert (p.bits, p.block_bits, p.num_keys, p.delta, p.scheme) == (16, 2, 2, 2.0, "xmark")
    assert (p.num_blocks, p.num_shards) == (8, 4)


@pytest.mark.parametrize("secret", ["short-secret-15", b"fifteen-bytes!!", "é" * 7 + "x", b"", ""])
def test_short_secret_is_rejected_without_echoing_it(secret: str | bytes) -> None:
    raw = secret.encode() if isinstance(secret, str) else secret
    assert len(raw) < 16
    with pytest.raises(ValueError, match="at least 16 bytes") as info:
        WatermarkKey.from_secret(secret, WatermarkParams())
    if secret:
        assert str(secret) not in str(info.value) and repr(secret) not in str(info.value)


def test_sixteen_bytes_are_enough_and_non_text_secret_is_a_type_error() -> None:
    WatermarkKey.from_secret("é" * 8, WatermarkParams())  # 16 UTF-8 bytes
    WatermarkKey.from_secret(bytearray(b"x" * 16), WatermarkParams())
    with pytest.raises(TypeError, match="secret must be str or bytes") as info:
        WatermarkKey.from_secret([SECRET], WatermarkParams())  # type: ignore[arg-type]  # a wrong type on purpose
    assert SECRET not in str(info.value)


def _secret_forms(secret: str) -> list[str]:
    raw = secret.encode()
    return [secret, raw.hex(), repr(raw), secret[:10]]


def test_secret_never_appears_in_repr_str_or_errors() -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams())
    texts = [repr(key), str(key), format(key), repr(key.params)]
    errors: list[BaseException] = []
    for action in (
        lambda: pickle.dumps(key),
        lambda: copy.deepcopy(key),
        lambda: decode([1, 2], key),
        lambda: decode([1, 2, -3], key),
        lambda: decode("some text", key),
        lambda: decode([1, 2, 3], key, min_observations=0),
        lambda: WatermarkKey.from_secret(SECRET[:12], WatermarkParams()),
        lambda: WatermarkKey.from_secret(SECRET, WatermarkParams(bits=15)),
    ):
        with pytest.raises(Exception) as info:
            action()
        errors.append(info.value)
    texts += [str(e) for e in errors] + [repr(e) for e in errors]
    for text in texts:
        for form in _secret_forms(SECRET):
            assert form not in text, text
    assert "fingerprint" in repr(key) and key.fingerprint not in repr(key)  # only a prefix is shown


def test_key_does_not_keep_the_secret() -> None:
    key = WatermarkKey.from_secret(SECRET, WatermarkParams())
    assert not hasattr(key, "__dict__")
    for slot in type(key).__slots__:
        value = getattr(key, slot)
        for form in _secret_forms(SECRET):
            assert form not in repr(value) and form.encode() not in np.asarray(value).tobytes()


def test_fingerprint_is_stable_and_separates_secrets_and_params() -> None:
    base = WatermarkParams()
    fp = WatermarkKey.from_secret(SECRET, base).fingerprint
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert WatermarkKey.from_secret(SECRET, WatermarkParams()).fingerprint == fp
    assert WatermarkKey.from_secret(SECRET.encode(), base).fingerprint == fp  # str and its UTF-8 bytes
    others = [
        WatermarkKey.from_secret(SECRET + "!", base).fingerprint,
        WatermarkKey.from_secret("another-secret-of-some-length", base).fingerprint,
    ]
    for fields in (
        {"bits": 32},
        {"block_bits": 1},
        {"num_keys": 3},
        {"delta": 2.5},
        {"scheme": "loso", "num_keys": 1},
        {"scheme": "mpac", "num_keys": 1},
    ):
        others.append(WatermarkKey.from_secret(SECRET, WatermarkParams(**fields)).fingerprint)
    assert fp not in others and len(set(others)) == len(others)
    assert fp not in {SECRET, SECRET.encode().hex()}


def test_fingerprint_survives_a_params_round_trip() -> None:
    """Equal parameters must give the same fingerprint, also after to_dict/from_dict (storage).

    WatermarkParams(delta=2) == WatermarkParams(delta=2.0), and from_dict turns delta into a float.
    """
    stored = WatermarkParams(delta=2)
    loaded = WatermarkParams.from_dict(stored.to_dict())
    assert loaded == stored
    assert WatermarkKey.from_secret(SECRET, loaded).fingerprint == WatermarkKey.from_secret(SECRET, stored).fingerprint


def test_derived_words_differ_across_keys_and_secrets() -> None:
    params = WatermarkParams(bits=16, num_keys=8)
    words = WatermarkKey.from_secret(SECRET, params).words
    assert words.shape == (8, 5) and words.dtype == np.int64
    assert words.min() >= 0 and words.max() < 2**32
    assert len({tuple(row) for row in words}) == 8
    assert np.unique(words).size == words.size  # no word repeats within or across keys
    other = WatermarkKey.from_secret(SECRET + "?", params).words
    assert not np.isin(words, other).any()
    np.testing.assert_array_equal(WatermarkKey.from_secret(SECRET, params).words, words)  # deterministic
    with pytest.raises(ValueError):
        words[0, 0] = 1  # read-only


def test_message_of_other_length_is_not_accepted_by_a_key() -> None:
    with pytest.raises(ValueError, match="16 bits"):
        Message("0" * 8, WatermarkParams())
