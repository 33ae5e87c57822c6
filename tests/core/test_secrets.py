"""Watermark secret entries: one parser and one placeholder rule for the gateway and the workers."""

from __future__ import annotations

import pytest

from xmark_core import vllm_common
from xmark_core.secrets import SecretConfigError, parse_secret_entries, placeholder_reason

GOOD = "Zq8r-2mV7xK1pL9wT4nB6yH3"


def test_entries_are_parsed_from_commas_and_lines() -> None:
    text = f"# rotation\nv1:{GOOD}\n v2 : {GOOD}-two , v3:{GOOD}-three\n"
    assert parse_secret_entries(text, source="s") == {
        "v1": GOOD.encode(),
        "v2": f"{GOOD}-two".encode(),
        "v3": f"{GOOD}-three".encode(),
    }


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "no watermark secret"),
        (GOOD, "name:secret"),
        (f"v1:{GOOD},v1:{GOOD}-b", "listed twice"),
        (f"bad name:{GOOD}", "must match"),
        ("v1:tiny-one", "shorter than 16 bytes"),
        ("v1:changeme-please-changeme", "placeholder"),
        ("v1:your-secret-goes-here", "placeholder"),
        ("v1:" + "ab" * 10, "too few distinct characters"),
    ],
)
def test_bad_entries_are_refused_without_showing_the_secret(text: str, fragment: str) -> None:
    with pytest.raises(SecretConfigError) as caught:
        parse_secret_entries(text, source="XMARK_WATERMARK_SECRETS")
    message = str(caught.value)
    assert fragment in message and message.startswith("XMARK_WATERMARK_SECRETS: ")
    secret = text.partition(":")[2]
    assert not secret or secret not in message


def test_a_secret_written_in_place_of_the_name_is_not_echoed() -> None:
    with pytest.raises(SecretConfigError) as caught:
        parse_secret_entries("s3cr3t+value/with=signs:v1", source="s")
    assert "s3cr3t" not in str(caught.value)


def test_the_error_type_is_the_callers() -> None:
    class Mine(Exception):
        pass

    with pytest.raises(Mine):
        parse_secret_entries("v1:changeme", source="s", error=Mine)


def test_the_worker_parser_applies_the_placeholder_check() -> None:
    with pytest.raises(vllm_common.WorkerConfigError, match="placeholder"):
        vllm_common.parse_secret_entries("v1:changeme-changeme-changeme", source="s")
    assert vllm_common.parse_secret_entries(f"v1:{GOOD}", source="s") == {"v1": GOOD.encode()}
    assert placeholder_reason(GOOD) is None
