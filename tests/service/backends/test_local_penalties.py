"""The local backend's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias``: the processor
on hand-computed tensors, the checks of the values, and their effect on the real model."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, cast

import httpx
import pytest
import torch

from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.local import LocalBackend
from service.backends.penalties import (
    NEUTRAL,
    PenaltyProcessor,
    SamplingPenalties,
    penalty_processor,
    sampling_penalties,
)
from service.errors import InvalidRequestError
from xmark_core import Message

MODEL = "smollm2-135m-instruct"
VOCAB = 6
CHECKED_VOCAB = 400  # the checks' vocabulary: room for more than 300 distinct token ids


def _apply(rows: list[SamplingPenalties], width: int, input_ids: list[list[int]]) -> torch.Tensor:
    """The processor's logits for zero logits: [rows, VOCAB] float32, the change alone."""
    ids = cast(torch.LongTensor, torch.tensor(input_ids, dtype=torch.long))  # [rows, width + generated]
    scores = cast(torch.FloatTensor, torch.zeros(len(rows), VOCAB))  # [rows, VOCAB]
    out = PenaltyProcessor(rows, width)(ids, scores)
    assert not scores.any(), "the scores passed in are left as they were"
    return out


# -- the processor ---------------------------------------------------------------------------------


def test_frequency_penalty_counts_each_generated_token() -> None:
    # prompt [3, 3]; generated 1, 1, 2: token 1 twice, token 2 once; the prompt's 3 is not counted
    out = _apply([SamplingPenalties(frequency=0.5)], 2, [[3, 3, 1, 1, 2]])
    assert out.tolist() == [[0.0, -1.0, -0.5, 0.0, 0.0, 0.0]]


def test_presence_penalty_counts_each_generated_token_once() -> None:
    out = _apply([SamplingPenalties(presence=0.75)], 2, [[3, 3, 1, 1, 2]])
    assert out.tolist() == [[0.0, -0.75, -0.75, 0.0, 0.0, 0.0]]


def test_negative_penalties_raise_the_logits() -> None:
    # token 1: -(-1.0 * 2) - (-0.5) = 2.5; token 2: 1.0 + 0.5 = 1.5
    out = _apply([SamplingPenalties(frequency=-1.0, presence=-0.5)], 2, [[3, 3, 1, 1, 2]])
    assert out.tolist() == [[0.0, 2.5, 1.5, 0.0, 0.0, 0.0]]


def test_rows_have_their_own_values_and_left_padding_is_not_counted() -> None:
    rows = [
        NEUTRAL,
        SamplingPenalties(frequency=1.0, bias=((4, 10.0),)),
        SamplingPenalties(presence=2.0, bias=((0, -100.0), (5, 1.5))),
        SamplingPenalties(frequency=0.5, presence=0.25),
    ]
    # width 3: rows 1 and 3 are left-padded with 0; the generated tokens follow
    ids = [
        [1, 2, 3, 1, 1],
        [0, 5, 5, 5, 4],
        [2, 2, 2, 2, 2],
        [0, 0, 4, 3, 3],
    ]
    out = _apply(rows, 3, ids)
    assert out.tolist() == [
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # neutral: untouched although it repeats 1
        [0.0, 0.0, 0.0, 0.0, 10.0 - 1.0, -1.0],  # 5 once, 4 once (+10 bias); the prompt's 5s not counted
        [-100.0, 0.0, -2.0, 0.0, 0.0, 1.5],  # 2 generated twice, the presence penalty once
        [0.0, 0.0, 0.0, -1.25, 0.0, 0.0],  # 3 twice: 0.5 * 2 + 0.25; the pads are prompt
    ]


def test_the_first_step_is_biased_only() -> None:
    # no token generated yet (input_ids is the prompt): nothing to count, the bias applies
    rows = [SamplingPenalties(frequency=2.0, presence=2.0, bias=((1, -3.0),))]
    assert _apply(rows, 3, [[1, 1, 1]]).tolist() == [[0.0, -3.0, 0.0, 0.0, 0.0, 0.0]]


def test_a_neutral_batch_gets_no_processor() -> None:
    assert penalty_processor([NEUTRAL, NEUTRAL], 4) is None
    assert isinstance(penalty_processor([NEUTRAL, SamplingPenalties(presence=0.1)], 4), PenaltyProcessor)


def test_a_batch_of_another_size_is_an_error() -> None:
    processor = PenaltyProcessor([SamplingPenalties(presence=1.0)], 1)
    ids = cast(torch.LongTensor, torch.zeros((2, 2), dtype=torch.long))
    with pytest.raises(ValueError, match="batch rows"):
        processor(ids, cast(torch.FloatTensor, torch.zeros(2, VOCAB)))


# -- the checks ------------------------------------------------------------------------------------


def test_values_are_read_as_sent() -> None:
    values = sampling_penalties(
        {"frequency_penalty": 0.5, "presence_penalty": -2, "logit_bias": {"5": 100, "2": -1.5, "3": 0}}, 6
    )
    assert values == SamplingPenalties(frequency=0.5, presence=-2.0, bias=((2, -1.5), (5, 100.0)))
    assert sampling_penalties({"frequency_penalty": None, "presence_penalty": 0, "logit_bias": None}, 6) is NEUTRAL
    assert sampling_penalties({"logit_bias": {}}, 6) is NEUTRAL


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": [1]}, "presence_penalty"),
        ({"presence_penalty": 10**400}, "presence_penalty"),
        ({"logit_bias": [[1, 5]]}, "logit_bias"),
        ({"logit_bias": "5"}, "logit_bias"),
        ({"logit_bias": {"token": 5}}, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"logit_bias": {str(CHECKED_VOCAB): 5}}, "logit_bias"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"1": "5"}}, "logit_bias"),
        ({"logit_bias": {"1": None}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_values_are_400_naming_the_field(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sampling_penalties(options, CHECKED_VOCAB)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, param, "invalid_value")


# -- the real model --------------------------------------------------------------------------------

PROMPT = (ChatTurn("user", "Write the word 'apple' ten times, one per line."),)


@pytest.fixture
def backend(app: Any, ready: None) -> LocalBackend:
    return cast(LocalBackend, app.state.resources.backend)


@pytest.fixture
def stamp(app: Any) -> WatermarkStamp:
    """The active key version (the suite's biasing scheme, which marks greedy answers too)."""
    key = app.state.resources.keyring.active().key
    assert not key.params.distortion_free
    return WatermarkStamp(key, Message.from_bits(("01" * key.params.bits)[: key.params.bits], key.params))


async def _tokens(backend: LocalBackend, stamp: WatermarkStamp, max_tokens: int, **options: Any) -> list[str]:
    """The text of each token of a greedy answer to PROMPT (from its logprobs entries)."""
    request = GenerationRequest(PROMPT, max_tokens=max_tokens, temperature=0, options={"logprobs": True, **options})
    result = await backend.generate(request, stamp)
    return [str(entry["token"]) for entry in result.choices[0].logprobs or ()]


@pytest.mark.model
async def test_a_banned_token_never_comes_first(backend: LocalBackend, stamp: WatermarkStamp) -> None:
    first = (await _tokens(backend, stamp, 2))[0]
    ids = backend.tokenizer.encode(first, add_special_tokens=False)  # type: ignore[union-attr]
    assert len(ids) == 1, first
    banned = await _tokens(backend, stamp, 2, logit_bias={str(ids[0]): -100})
    assert banned[0] != first


@pytest.mark.model
async def test_a_boosted_token_appears_in_its_own_row_of_a_shared_batch(
    backend: LocalBackend, stamp: WatermarkStamp
) -> None:
    ids = backend.tokenizer.encode(" zebra", add_special_tokens=False)  # type: ignore[union-attr]
    assert len(ids) == 1
    blocker = await backend.stream(GenerationRequest(PROMPT, max_tokens=16, temperature=0), stamp)
    await blocker.__anext__()  # decoding now: the two queue behind it and share the next batch
    boosted, plain = await asyncio.gather(
        _tokens(backend, stamp, 4, logit_bias={str(ids[0]): 100}), _tokens(backend, stamp, 4)
    )
    _ = [delta async for delta in blocker]
    assert boosted == [" zebra"] * 4
    assert " zebra" not in plain


@pytest.mark.model
async def test_frequency_penalty_thins_the_most_repeated_token(backend: LocalBackend, stamp: WatermarkStamp) -> None:
    plain = Counter(await _tokens(backend, stamp, 40))
    token, count = plain.most_common(1)[0]
    assert count >= 4, plain  # the answer repeats itself: something for the penalty to act on
    penalised = Counter(await _tokens(backend, stamp, 40, frequency_penalty=2.0))
    assert penalised[token] < count, (token, plain, penalised)


@pytest.mark.model
async def test_a_bad_value_is_refused_before_it_is_queued(backend: LocalBackend, stamp: WatermarkStamp) -> None:
    vocab = backend._vocab_size
    request = GenerationRequest(PROMPT, max_tokens=2, options={"logit_bias": {str(vocab): 1}})
    with pytest.raises(InvalidRequestError) as caught:
        await backend.stream(request, stamp)
    assert caught.value.param == "logit_bias"
    assert backend._inbox.empty()


@pytest.mark.model
async def test_chat_with_penalties_through_the_app(client: httpx.AsyncClient, make_user: Any, ready: None) -> None:
    _, key = await make_user("user")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
    answered = await client.post(
        "/v1/chat/completions",
        json={**body, "frequency_penalty": 0.5, "presence_penalty": 0.2, "logit_bias": {"42": -5, "7": 3}},
        headers=headers,
    )
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["finish_reason"] in {"stop", "length"}
    refused = await client.post("/v1/chat/completions", json={**body, "presence_penalty": 3}, headers=headers)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "presence_penalty",
        "invalid_value",
    )
