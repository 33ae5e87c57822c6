"""Chunked prefill in the local backend (``service.backends.prefill``), on the real model: a
prompt read in slices gives the same tokens as one read at once, a running request keeps decoding
between another prompt's slices, and a prompt whose client left stops at the next slice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from service.backends.attention import GROUPED_SDPA
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp, collect
from service.backends.local import LocalBackend, LocalStream
from service.vocabulary import FinishReason
from tests.conftest import checkpoint_path
from xmark_core import Message, WatermarkKey, WatermarkParams

pytestmark = pytest.mark.model

UNCHUNKED = 1 << 30
SENTENCE = "the river runs to the sea and the boat goes with it while the birds sing in the trees"
COUNTING = (ChatTurn("user", "Count from 1 to 1000, one number per line."),)


def _long(words: int, tag: str = "") -> tuple[ChatTurn, ...]:
    words_of = SENTENCE.split()
    text = " ".join(words_of[i % len(words_of)] for i in range(words))
    return (ChatTurn("user", f"{tag}Summarise this text in one sentence.\n\n{text}"),)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LocalBackend]:
    backend = LocalBackend(checkpoint_path(), "prefill-test")
    await backend.start()
    assert await backend.wait_ready(180), backend.load_error
    yield backend
    await backend.close()


@pytest.fixture(scope="module")
def stamp() -> WatermarkStamp:
    params = WatermarkParams(bits=32, block_bits=2, num_keys=2, delta=2.0)
    key = WatermarkKey.from_secret(b"prefill-slices-test-secret-0123456789", params)
    return WatermarkStamp(key, Message.from_int(0x2468ACE1, params))


async def _until(condition: Any, timeout: float = 60.0) -> None:
    """Poll ``condition`` (a counter the worker thread moves) every 5 ms, for at most ``timeout`` s."""
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def _texts(backend: LocalBackend, stamp: WatermarkStamp, budget: int) -> tuple[list[list[str]], int]:
    """The completions of a few requests read with slices of ``budget`` tokens (greedy, seeded
    sampling with n=2, and two prompts of different lengths sharing one batch, left-padded), and
    the slices the first prompt took."""
    backend.prefill_chunk_tokens = budget
    long, short = _long(120), (ChatTurn("user", "Name three rivers."),)
    stream = await backend.stream(GenerationRequest(long, max_tokens=8, temperature=0), stamp)
    greedy = await collect(stream, 1)
    seeded = await backend.generate(GenerationRequest(long, max_tokens=8, temperature=0.9, seed=7, n=2), stamp)
    # a blocker holds the model while the two queue up; they then share one batch, and their
    # prompts are read during the blocker's steps
    blocking = GenerationRequest(short, max_tokens=4, temperature=0)
    blocker = asyncio.create_task(backend.generate(blocking, stamp))
    # until the worker runs the blocker (alone: the pair is sent after), or it is done already: the
    # same batches on every run (10 s: 5x margin and more, it ran 0.03 s or less after it was sent here)
    deadline = time.monotonic() + 10
    while not (blocker.done() or any(job.request is blocking for job in backend._running)):
        assert time.monotonic() < deadline, "the worker never took the blocker"
        await asyncio.sleep(0.001)
    pair = await asyncio.gather(
        backend.generate(GenerationRequest(long, max_tokens=8, temperature=0), stamp),
        backend.generate(GenerationRequest(short, max_tokens=8, temperature=0), stamp),
    )
    await blocker
    return [[c.text for c in result.choices] for result in (greedy, seeded, *pair)], stream.prefill_slices


async def test_a_prompt_read_in_slices_gives_the_same_tokens(backend: LocalBackend, stamp: WatermarkStamp) -> None:
    try:
        sliced, slices = await _texts(backend, stamp, 16)  # a ~150-token prompt: ~10 slices
        whole, one = await _texts(backend, stamp, UNCHUNKED)
    finally:
        backend.prefill_chunk_tokens = 512
    assert slices >= 8 and one == 1  # read in slices, or in one pass
    assert sliced == whole
    assert all(text for texts in sliced for text in texts)
    assert sliced[0][0] == sliced[2][0]  # alone or left-padded beside a shorter prompt: the same


async def test_grouped_attention_gives_the_tokens_of_transformers_own(
    backend: LocalBackend, stamp: WatermarkStamp
) -> None:
    """The backend's model reads its KV cache in place (``service.backends.attention``): read in
    slices or at once, alone, seeded or left-padded in a shared batch, the tokens are those of
    transformers' own ``sdpa`` attention."""
    model = backend._model
    assert model is not None and model.config._attn_implementation == GROUPED_SDPA
    grouped = [await _texts(backend, stamp, budget) for budget in (16, UNCHUNKED)]
    model.set_attn_implementation("sdpa")  # between requests: the worker thread is idle
    try:
        plain = [await _texts(backend, stamp, budget) for budget in (16, UNCHUNKED)]
    finally:
        model.set_attn_implementation(GROUPED_SDPA)
        backend.prefill_chunk_tokens = 512
    assert grouped == plain


async def test_a_running_request_keeps_decoding_between_a_long_prompts_slices(
    backend: LocalBackend, stamp: WatermarkStamp
) -> None:
    backend.prefill_chunk_tokens = 64
    try:
        running = await backend.stream(GenerationRequest(COUNTING, max_tokens=400, temperature=0), stamp)
        assert (await running.__anext__()).finish_reason is None  # decoding now
        long: LocalStream = await backend.stream(GenerationRequest(_long(900), max_tokens=1, temperature=0), stamp)
        target = long.prompt_tokens - 1
        seen: list[int] = []  # the long prompt's tokens read, as each token of the running request arrives
        async with asyncio.timeout(120):
            async for delta in running:
                assert delta.finish_reason is None, "the running request ended before the prompt was read"
                seen.append(long.prefilled_tokens)
                if seen[-1] >= target:
                    break
            running.cancel()  # the long prompt's batch runs next
            _ = [delta async for delta in running]
            answer = [delta async for delta in long]
    finally:
        backend.prefill_chunk_tokens = 512
    during = [n for n in seen if 0 < n < target]
    # slices of 64 tokens of a ~950-token prompt, one after each decoding step
    assert len(set(during)) >= 5, seen
    assert seen == sorted(seen)
    assert answer[-1].finish_reason in {FinishReason.STOP, FinishReason.LENGTH}
    assert long.prefill_slices == -(-target // 64)


@pytest.mark.parametrize("behind_a_running_request", [False, True])
async def test_an_abandoned_long_prompt_stops_at_the_next_slice(
    backend: LocalBackend, stamp: WatermarkStamp, behind_a_running_request: bool
) -> None:
    backend.prefill_chunk_tokens = 64
    running = None
    try:
        if behind_a_running_request:
            running = await backend.stream(GenerationRequest(COUNTING, max_tokens=400, temperature=0), stamp)
            await running.__anext__()
        long = await backend.stream(GenerationRequest(_long(1500), max_tokens=4, temperature=0), stamp)
        await _until(lambda: long.prefill_slices >= 1)
        long.cancel()  # the client left
        at_cancel = long.prefill_slices
        if running is not None:
            # two more decoding steps: the step after the slice that was being read sees the
            # cancellation and drops the cache, while the running request goes on
            for _ in range(3):
                assert (await running.__anext__()).finish_reason is None
            assert long.prefilled_tokens == 0
            running.cancel()
        async with asyncio.timeout(60):
            deltas = [delta async for delta in long]
        if running is not None:
            async with asyncio.timeout(60):
                _ = [delta async for delta in running]
    finally:
        backend.prefill_chunk_tokens = 512
    assert [d.finish_reason for d in deltas] == [FinishReason.CANCELLED]
    assert deltas[0].completion_tokens == 0
    # at most the slice in flight when the client left; the prompt needs ~25 of them
    assert long.prefill_slices <= at_cancel + 1 < (long.prompt_tokens - 1) // 64
    assert long.prefilled_tokens == 0  # its cache is gone
    after = await backend.generate(GenerationRequest(COUNTING, max_tokens=2, temperature=0), stamp)
    assert after.completion_tokens == 2
