"""API-key format: checksum rejects typos before any lookup; only an HMAC is ever compared."""

from __future__ import annotations

import pytest

from service.security import ApiKeyFormatError, ApiKeyHasher, generate_api_key, parse_api_key


def test_generated_keys_parse_and_differ() -> None:
    keys = {generate_api_key().plaintext for _ in range(200)}
    assert len(keys) == 200
    for key in keys:
        parsed = parse_api_key(key)
        assert parsed.plaintext == key and key.startswith(parsed.prefix)
        assert len(parsed.prefix) == 11


def test_every_single_character_typo_is_rejected() -> None:
    key = generate_api_key().plaintext
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    for position in range(3, len(key)):
        if key[position] == "_":
            continue
        for replacement in alphabet[:8]:
            if replacement == key[position]:
                continue
            typo = key[:position] + replacement + key[position + 1 :]
            with pytest.raises(ApiKeyFormatError):
                parse_api_key(typo)


@pytest.mark.parametrize(
    "text", ["", "xm_", "sk-abc", "xm_" + "a" * 43, "xm_" + "a" * 43 + "_" + "a" * 7, " " + "x" * 53]
)
def test_malformed_keys_are_rejected_without_echo(text: str) -> None:
    with pytest.raises(ApiKeyFormatError) as info:
        parse_api_key(text)
    assert text.strip() == "" or text not in str(info.value)


def test_hash_depends_on_the_pepper_and_hides_it() -> None:
    key = generate_api_key()
    first = ApiKeyHasher(b"pepper-one-0123456789")
    second = ApiKeyHasher(b"pepper-two-0123456789")
    assert first.hash(key) != second.hash(key)
    assert first.matches(key, first.hash(key)) and not second.matches(key, first.hash(key))
    assert key.plaintext not in first.hash(key) and "pepper-one" not in repr(first)
    assert key.plaintext not in repr(key)
