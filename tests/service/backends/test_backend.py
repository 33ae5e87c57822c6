"""The local backend's text pipeline (detokenizer, stop strings), batching and lifecycle."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from service.backends import build_backend
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.detokenizer import IncrementalDetokenizer
from service.backends.local import LocalBackend
from service.backends.stop_strings import StopStringBuffer
from service.config import ConfigurationError
from xmark_core import Message, WatermarkKey, decode


@pytest.fixture
async def backend(app: Any) -> LocalBackend:
    backend = app.state.resources.backend
    assert await backend.wait_ready(180)
    return backend  # type: ignore[no-any-return]


def _key(app: Any) -> WatermarkKey:
    """The active version's secret with 16-bit messages: what these tests were calibrated with,
    whatever message length the configuration gives new key versions."""
    keyring = app.state.resources.keyring
    active = keyring.active()
    key: WatermarkKey = keyring.key_for(active.name, replace(active.key.params, bits=16, block_bits=2))
    return key


def _stamp(app: Any, bits: str) -> WatermarkStamp:
    key = _key(app)
    return WatermarkStamp(key, Message.from_bits(bits, key.params))


@pytest.mark.model
def test_detokenizer_never_splits_a_character(backend: LocalBackend) -> None:
    tokenizer = backend.tokenizer
    text = "Grüße, 世界! Привет 🌍🚀 done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # multi-token characters were held back


def test_stop_buffer_holds_possible_prefixes_and_cuts() -> None:
    buffer = StopStringBuffer(("END", "\n\n"))
    assert buffer.push("Hello E") == ("Hello ", False)
    assert buffer.push("N") == ("", False)
    assert buffer.push("X and") == ("ENX and", False)
    assert buffer.push(" more\n") == (" more", False)
    assert buffer.push("\nrest") == ("", True)
    assert buffer.text == "Hello ENX and more"
    assert buffer.push("ignored") == ("", True)


def test_stop_buffer_flushes_an_unfinished_prefix() -> None:
    buffer = StopStringBuffer(("STOP",))
    assert buffer.push("abc ST") == ("abc ", False)
    assert buffer.flush() == "ST"
    assert StopStringBuffer(()).push("anything") == ("anything", False)


def test_vllm_backend_is_a_configuration_error(settings: Any) -> None:
    with pytest.raises(ConfigurationError, match="vllm"):
        build_backend(settings.model_copy(update={"backend": "vllm"}), None)  # type: ignore[arg-type]


@pytest.mark.model
async def test_concurrent_requests_share_a_batch_and_keep_their_own_watermark(app: Any, backend: LocalBackend) -> None:
    """Different users in one generate call: every row decodes to its own caller's message."""
    params = _key(app).params
    messages = ["0110100111000101", "1001011000111010", "1111000010100110"]
    prompt = (ChatTurn("user", "Write a detailed story about a fox who learns to read."),)
    # 200 tokens per row: at 120 the 16 bits of a row were sometimes decoded with 5 errors by
    # chance. Batched rows sample from the global generator: seeded here so a run can be repeated.
    request = GenerationRequest(prompt, max_tokens=200, temperature=0.8)
    torch.manual_seed(20261123)
    blocking = GenerationRequest(prompt, max_tokens=2, temperature=0.8)
    blocker = asyncio.create_task(backend.generate(blocking, _stamp(app, messages[0])))
    # the worker takes the blocker (alone: its own batch, the first draws of the seeded generator);
    # the next three queue up together behind it (5x margin and more: they were queued 0.04 s or
    # less after it ran here, and it ran 1.5 s or more), so the batches, and the draws each row
    # gets, are the same on every run (10 s: 5x margin and more, it ran 0.03 s or less after it was
    # sent here)
    deadline = time.monotonic() + 10
    while not (blocker.done() or any(job.request is blocking for job in backend._running)):
        assert time.monotonic() < deadline, "the worker never took the blocker"
        await asyncio.sleep(0.001)
    results = await asyncio.gather(*(backend.generate(request, _stamp(app, m)) for m in messages))
    await blocker
    key = _key(app)
    tokenizer = backend.tokenizer
    for bits, result in zip(messages, results, strict=True):
        text = result.choices[0].text
        decoded = decode(tokenizer.encode(text, add_special_tokens=False), key, skip_ids=tokenizer.all_special_ids)
        agreement = sum(a == b for a, b in zip(decoded.bits, bits, strict=True))
        assert agreement >= params.bits - 4, (bits, decoded.bits)


@pytest.mark.model
async def test_batches_are_watermarked_by_the_cpp_op_kept_per_key_version(app: Any, backend: LocalBackend) -> None:
    """The C++ op is loaded at start-up and serves the batches, one per key version, built once."""
    assert backend.watermark_op == "cpp", "the C++ op did not build here (a C++ compiler and ninja)"
    prompt = (ChatTurn("user", "Say hello."),)
    first = _stamp(app, "0110100111000101")
    await backend.generate(GenerationRequest(prompt, max_tokens=3, temperature=0.8), first)
    marker = backend._markers[first.key.fingerprint]
    assert marker.uses_cpp_op()
    await backend.generate(GenerationRequest(prompt, max_tokens=3, temperature=0.8), _stamp(app, "1" * 16))
    assert backend._markers[first.key.fingerprint] is marker  # the same key version: the same op


@pytest.mark.model
async def test_cancelled_stream_stops_early(app: Any, backend: LocalBackend) -> None:
    # seeded (alone in its batch): the poem does not end by chance before the third token is read
    request = GenerationRequest(
        (ChatTurn("user", "Write a very long poem."),), max_tokens=300, temperature=0.8, seed=20261206
    )
    stream = await backend.stream(request, _stamp(app, "0101010101010101"))
    deltas = []
    async for delta in stream:
        deltas.append(delta)
        if len(deltas) == 3:
            stream.cancel()
    last = deltas[-1]
    assert last.finish_reason == "cancelled"
    assert last.completion_tokens < 300


@pytest.mark.model
async def test_context_overflow_is_a_clean_error(app: Any, backend: LocalBackend) -> None:
    from service.errors import InvalidRequestError

    request = GenerationRequest((ChatTurn("user", "word " * 9000),), max_tokens=10)
    with pytest.raises(InvalidRequestError) as caught:
        await backend.stream(request, _stamp(app, "0101010101010101"))
    assert caught.value.code == "context_length_exceeded"


async def test_a_backend_without_a_model_never_becomes_ready(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "missing", "m")
    await backend.start()
    assert await backend.wait_ready(60) is False
    assert backend.load_error is not None
    await backend.close()
