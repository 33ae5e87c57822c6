"""The gateway's vLLM backend against scripted upstreams (aiohttp servers on loopback ports).

The real worker is exercised by tests/e2e_vllm; these tests cover what a live engine cannot be
made to do on demand: a worker that refuses connections, times out, drops the stream after some
tokens, answers 503 to health checks, or runs beside a second worker. Scoring (``score``, the
prompt log-probs ``/trace`` reads) gets the same treatment; tests/e2e_vllm checks its numbers
against the checkpoint run in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.vllm import VllmBackend, upstream_body
from service.errors import (
    InvalidRequestError,
    ServiceUnavailableError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from tests.conftest import checkpoint_path
from xmark_core import Message, WatermarkKey, WatermarkParams

pytestmark = pytest.mark.model

PARAMS = WatermarkParams()
KEY = WatermarkKey.from_secret("gateway-test-secret-4c1d9e8a7b", PARAMS)
STAMP = WatermarkStamp(KEY, Message.from_bits("0110110000011011", PARAMS), "v1")
FP = KEY.fingerprint  # the workers check it against their key version's
REQUEST = GenerationRequest(messages=(ChatTurn("user", "Tell me about cats."),), max_tokens=3, seed=5)
MODEL = "smollm2-135m-instruct"
PROMPT_IDS = [1, 9690, 198, 2683, 359]


def sse(*events: dict[str, Any] | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def completion_events(pieces: list[list[str]], finish: str = "length") -> list[bytes]:
    """vLLM's stream for n = len(pieces) choices: role chunks, one chunk per token, usage, [DONE]."""
    n = len(pieces)
    events: list[dict[str, Any] | str] = [
        {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": PROMPT_IDS}
        for i in range(n)
    ]
    for step in range(max(len(p) for p in pieces)):
        for i, choice_pieces in enumerate(pieces):
            if step < len(choice_pieces):
                last = step == len(choice_pieces) - 1
                events.append(
                    {
                        "choices": [
                            {
                                "index": i,
                                "delta": {"content": choice_pieces[step]},
                                "token_ids": [100 + step],
                                "finish_reason": finish if last else None,
                            }
                        ]
                    }
                )
    total = sum(len(p) for p in pieces)
    events.append({"choices": [], "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": total}})
    events.append("[DONE]")
    return sse(*events)


def whole_answer(texts: list[str], finish: str = "length", tool_calls: list[Any] | None = None) -> dict[str, Any]:
    """vLLM's non-streamed chat completion (``return_token_ids``): one choice per text."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text or None, "tool_calls": tool_calls or []},
            "finish_reason": finish,
            "logprobs": None,
            "token_ids": [100 + t for t in range(len(text.split()) or 1)],
        }
        for i, text in enumerate(texts)
    ]
    total = sum(len(c["token_ids"]) for c in choices)
    return {
        "object": "chat.completion",
        "choices": choices,
        "prompt_token_ids": PROMPT_IDS,
        "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": total, "total_tokens": total + 5},
    }


TEXT_IDS = [1, 9690, 198, 2683, 359, 42]
TOP_K = 4
OUTSIDE_LOGPROB = -11.5  # the text's own token where it is not among the top k


def own_rank(t: int) -> int | None:
    """Where the fake model ranks the text's own token at position t (None: outside the top k)."""
    return None if t == 3 else t % 3 + 1


def top_tokens(t: int) -> list[int]:
    """The fake model's top-k tokens at position t, likeliest first (the text's token in its rank)."""
    tokens = [5000 + 100 * t + j for j in range(TOP_K)]
    rank = own_rank(t)
    if rank is not None:
        tokens[rank - 1] = TEXT_IDS[t]
    return tokens


def top_logprob(j: int) -> float:
    return -0.25 - 0.5 * j


def prompt_logprobs_answer(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's non-streamed completion for a scoring request: ``choices[0].prompt_logprobs`` holds
    None for the first prompt token, then for each position a dict token id (a string in JSON) ->
    {"logprob", "rank", "decoded_token"}: the prompt's own token first (with its rank, also when it
    is outside the top k), then the top k. Listed here likeliest last, so the parser must sort."""
    ids, k = body["prompt"], body["prompt_logprobs"]
    assert ids == TEXT_IDS and k == TOP_K
    rows: list[dict[str, Any] | None] = [None]
    for t in range(1, len(ids)):
        entries = {}
        if own_rank(t) is None:
            entries[ids[t]] = {"logprob": OUTSIDE_LOGPROB, "rank": 4321, "decoded_token": "x"}
        for j, token in enumerate(top_tokens(t)):
            entries[token] = {"logprob": top_logprob(j), "rank": j + 1, "decoded_token": f"t{token}"}
        rows.append({str(token): entry for token, entry in reversed(entries.items())})
    return {
        "object": "text_completion",
        "model": body["model"],
        "choices": [{"index": 0, "text": " the", "finish_reason": "length", "prompt_logprobs": rows, "logprobs": None}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
    }


class Reset(Exception):
    """In a scripted stream: the worker drops the connection there."""


class FakeWorker:
    """A scripted vLLM server on a loopback port: records what it receives, answers what the test
    says (a list of SSE chunks, pauses in seconds and ``Reset`` marks, or an ``aiohttp.web``
    response)."""

    def __init__(self, name: str, upstreams: Upstreams) -> None:
        self.name = name
        self.upstreams = upstreams
        self.requests: list[dict[str, Any]] = []
        self.health_status = 200
        self.health_delay_s = 0.0
        self.on_chat: Callable[[dict[str, Any]], Any] = lambda body: completion_events([["Cats", " are", " great"]])
        self.on_completion: Callable[[dict[str, Any]], Any] = prompt_logprobs_answer
        self.on_whole: Callable[[dict[str, Any]], Any] = lambda body: whole_answer(["Cats are great"])
        self.whole_delay_s = 0.0
        self.left_early = 0  # non-streamed requests whose client closed the connection before the answer
        self.paths: list[str] = []
        self.connections: set[Any] = set()  # the client ends of the connections requests came on
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.name in self.upstreams.refused:  # the connection ends before any answer
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if request.path == "/health":
            await asyncio.sleep(self.health_delay_s)
            return web.Response(status=self.health_status)
        if self.name in self.upstreams.timing_out:
            await asyncio.sleep(3600)
        body = json.loads(await request.read())
        assert request.transport is not None
        self.connections.add(request.transport.get_extra_info("peername"))
        self.requests.append(body)
        self.paths.append(request.path)
        if request.path == "/v1/completions" and "prompt_logprobs" in body:  # scoring: one JSON answer
            answer = self.on_completion(body)
            return answer if isinstance(answer, web.StreamResponse) else web.json_response(answer)
        if body.get("stream") is False:  # a whole answer, once every token exists
            waited = 0.0
            while waited < self.whole_delay_s:
                await asyncio.sleep(0.01)
                waited += 0.01
                if request.transport is None or request.transport.is_closing():
                    self.left_early += 1
                    return web.Response()
            answer = self.on_whole(body)
            return answer if isinstance(answer, web.StreamResponse) else web.json_response(answer)
        answer = self.on_chat(body)
        if isinstance(answer, web.StreamResponse):
            return answer
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in answer:
            if isinstance(chunk, Reset):
                assert request.transport is not None
                request.transport.abort()
                return response
            if isinstance(chunk, float):  # a pause, in seconds
                await asyncio.sleep(chunk)
                continue
            await response.write(chunk)
        await response.write_eof()
        return response


LIVE: list[Upstreams] = []


class Upstreams:
    """Several fake workers, each a real server on a loopback port (started by ``started``)."""

    def __init__(self, *names: str) -> None:
        self.workers = {name: FakeWorker(name, self) for name in names}
        self.refused: set[str] = set()
        self.timing_out: set[str] = set()
        LIVE.append(self)

    async def start(self) -> None:
        for worker in self.workers.values():
            if not worker.url:
                await worker.start()

    def urls(self) -> list[str]:
        return [worker.url for worker in self.workers.values()]

    async def stop(self) -> None:
        for worker in self.workers.values():
            await worker.stop()


@pytest.fixture(autouse=True)
async def _stop_upstreams() -> AsyncIterator[None]:
    yield
    while LIVE:
        await LIVE.pop().stop()


async def started(upstreams: Upstreams, **options: Any) -> VllmBackend:
    path = checkpoint_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 checkpoint is not built (make model)")
    await upstreams.start()
    backend = VllmBackend(upstreams.urls(), MODEL, path, **options)
    await backend.start()
    # 5x margin and more: ready within 20 s here (the module's first start, two cores busy; 1-3 s after)
    assert await backend.wait_ready(120)
    return backend


async def eventually(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``condition`` holds within ``timeout_s`` (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# -- the upstream request ----------------------------------------------------------------------


def test_upstream_body_carries_only_the_validated_request_and_the_gateways_xargs() -> None:
    request = GenerationRequest(
        messages=(ChatTurn("system", "Be brief."), ChatTurn("user", "Hi")),
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop=("\n\n",),
        seed=3,
    )
    body = upstream_body(request, STAMP, MODEL)
    assert body == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": ["\n\n"],
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "vllm_xargs": {"xmark_message": "0110110000011011", "xmark_key_version": "v1", "xmark_fingerprint": FP},
    }


def test_upstream_body_passes_the_honoured_options_through_and_never_the_watermark() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    options = {"tools": tools, "tool_choice": "required", "logprobs": True, "top_logprobs": 2, "top_k": 5}
    request = GenerationRequest(messages=REQUEST.messages, max_tokens=4, options=options)
    body = upstream_body(request, STAMP, MODEL)
    for name, value in options.items():
        assert body[name] == value
    assert set(VllmBackend.honoured_fields) >= set(options)
    # a name outside the pass-through set never reaches the worker, whatever put it in options
    smuggled = GenerationRequest(
        messages=REQUEST.messages, max_tokens=4, options={"vllm_xargs": {"xmark_message": "0" * 16}, "echo": True}
    )
    body = upstream_body(smuggled, STAMP, MODEL)
    assert body["vllm_xargs"] == {
        "xmark_message": STAMP.message.bits,
        "xmark_key_version": "v1",
        "xmark_fingerprint": FP,
    }
    assert "echo" not in body


def test_a_salted_key_versions_requests_carry_their_salt() -> None:
    """A salted distortion-free version: the worker is told the answer's salt (the rotation's)."""
    params = WatermarkParams(bits=16, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
    key = WatermarkKey.from_secret("gateway-test-secret-4c1d9e8a7b", params)
    stamp = WatermarkStamp(key, Message.from_bits("0110110000011011", params), "v3", 11)
    body = upstream_body(REQUEST, stamp, MODEL)
    assert body["vllm_xargs"] == {
        "xmark_message": "0110110000011011",
        "xmark_key_version": "v3",
        "xmark_fingerprint": key.fingerprint,
        "xmark_salt": 11,
    }


def test_a_per_request_versions_companion_is_named_to_the_worker_and_carries_no_salt() -> None:
    """A per-request (auto) version: a stamp of its companion sends xmark_encoder "companion" and the
    companion's fingerprint, no salt; one of its primary the salt and no xmark_encoder. An auto
    worker holding the same secret reads each to its own key slot."""
    from xmark_core.encoders import DEFAULT_MESSAGE_BITS, encoder_keys, spec_for
    from xmark_core.vllm_common import ENV_SCHEME, ENV_SECRETS, WorkerKeyring, parse_request

    secret = "gateway-test-secret-4c1d9e8a7b"
    spec = spec_for("auto", bits=DEFAULT_MESSAGE_BITS)  # a worker's default, the gateway's too
    assert spec.companion is not None
    primary, companion = encoder_keys(secret, spec)
    bits = "01101100000110111001001101100100" * (DEFAULT_MESSAGE_BITS // 32)
    assert VllmBackend.encoders_per_request
    worker = WorkerKeyring.from_variables({ENV_SECRETS: f"v4:{secret}", ENV_SCHEME: "auto"})
    stamp = WatermarkStamp(companion, Message.from_bits(bits, spec.companion), "v4", salt=5, companion=True)
    xargs = upstream_body(REQUEST, stamp, MODEL)["vllm_xargs"]
    assert xargs == {
        "xmark_message": bits,
        "xmark_key_version": "v4",
        "xmark_fingerprint": companion.fingerprint,
        "xmark_encoder": "companion",
    }
    mark = parse_request(xargs, worker)
    assert mark is not None and mark.key_index == worker.index("v4", "companion")
    stamp = WatermarkStamp(primary, Message.from_bits(bits, spec.primary), "v4", salt=5)
    xargs = upstream_body(REQUEST, stamp, MODEL)["vllm_xargs"]
    assert xargs == {
        "xmark_message": bits,
        "xmark_key_version": "v4",
        "xmark_fingerprint": primary.fingerprint,
        "xmark_salt": 5,
    }
    mark = parse_request(xargs, worker)
    assert mark is not None and mark.key_index == worker.index("v4") and mark.salt == 5


def tool_call_events() -> list[bytes]:
    """vLLM's stream of one tool call whose arguments arrive in three pieces, with logprobs."""

    def piece(arguments: str, first: bool = False, finish: str | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
        if first:
            call.update({"id": "call_1", "type": "function"})
            call["function"]["name"] = "publish"
        lp = {"token": arguments, "logprob": -0.5, "bytes": list(arguments.encode()), "top_logprobs": []}
        return {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [call]},
                    "token_ids": [7],
                    "logprobs": {"content": [lp]},
                    "finish_reason": finish,
                }
            ]
        }

    return sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": PROMPT_IDS},
        piece('{"story": ', first=True),
        piece('"Once'),
        piece(' upon"}', finish="tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 3}},
        "[DONE]",
    )


async def test_tool_call_deltas_are_merged_and_logprobs_kept() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_chat = lambda body: tool_call_events()
    backend = await started(upstreams)
    try:
        result = await backend.generate(GenerationRequest(messages=REQUEST.messages, max_tokens=8), STAMP)
        (choice,) = result.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.tool_calls == [
            {"id": "call_1", "type": "function", "function": {"name": "publish", "arguments": '{"story": "Once upon"}'}}
        ]
        assert choice.text == ""
        assert choice.generated_text() == '{"story": "Once upon"}'
        assert [entry["token"] for entry in choice.logprobs or []] == ['{"story": ', '"Once', ' upon"}']
        assert choice.completion_tokens == 3
    finally:
        await backend.close()


# -- streaming -----------------------------------------------------------------------------------


async def test_stream_passes_deltas_through_with_token_counts() -> None:
    upstreams = Upstreams("w1")
    backend = await started(upstreams)
    try:
        stream = await backend.stream(REQUEST, STAMP)
        assert stream.prompt_tokens == len(PROMPT_IDS)
        deltas = [d async for d in stream]
        assert [(d.text, d.completion_tokens, d.finish_reason) for d in deltas] == [
            ("Cats", 1, None),
            (" are", 2, None),
            (" great", 3, "length"),
        ]
        sent = upstreams.workers["w1"].requests
        assert len(sent) == 1 and sent[0]["vllm_xargs"] == {
            "xmark_message": STAMP.message.bits,
            "xmark_key_version": "v1",
            "xmark_fingerprint": FP,
        }
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_requests_reuse_one_keep_alive_connection() -> None:
    """A stream read to its end hands its connection back: one connection serves every request."""
    upstreams = Upstreams("w1")
    backend = await started(upstreams)
    try:
        for _ in range(5):
            assert (await backend.generate(REQUEST, STAMP)).choices[0].text == "Cats are great"
        await backend.score(TEXT_IDS, TOP_K)
        worker = upstreams.workers["w1"]
        assert len(worker.requests) == 6
        assert len(worker.connections) == 1
    finally:
        await backend.close()


BOUND_TEXTS = (
    "Hi",
    "Tell me about cats.",
    "日本語の文章を書いてください。東京は日本の首都です。" * 5,
    "emoji 😀🎉👩‍👩‍👧‍👦 and accents: déjà vu, naïve, Ångström",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n" * 20,
    "    \n\n\t  spaces   and\ttabs  \n",
    "a" * 3000,
    " ".join(str(i) for i in range(500)),
    "<|im_start|>user\nspecial tokens typed by a user<|im_end|>",
)


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "xmark-test-bpe"])
async def test_prompt_token_bound_is_never_below_the_exact_count(model: str) -> None:
    """The bound the gateway reserves without tokenizing (the rendered prompt's bytes plus a slack)
    holds for chats, tools and text completions, in any script, with both tokenizers."""
    path = checkpoint_path().parent / model
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"the {model} checkpoint is not built (make model)")
    upstreams = Upstreams("w1")
    await upstreams.start()
    backend = VllmBackend(upstreams.urls(), model, path)
    await backend.start()
    try:
        assert await backend.wait_ready(120)  # 5x margin and more: ready within 20 s here (as in ``started``)
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        requests = []
        for text in BOUND_TEXTS:
            requests.append(GenerationRequest(messages=(ChatTurn("user", text),), max_tokens=4))
            requests.append(
                GenerationRequest(messages=(ChatTurn("system", text), ChatTurn("user", text)), max_tokens=4)
            )
            requests.append(GenerationRequest(messages=(), prompt=text, max_tokens=4))
            if model == "smollm2-135m-instruct":  # its template renders tools
                requests.append(
                    GenerationRequest(messages=(ChatTurn("user", text),), max_tokens=4, options={"tools": tools})
                )
        for request in requests:
            exact = await backend.count_prompt_tokens(request)
            bound = await backend.prompt_token_bound(request)
            assert exact <= bound, (request, exact, bound)
        # and it is a bound, not a count: far above the tokens for text that tokenizes well
        long = GenerationRequest(messages=(ChatTurn("user", "word " * 400),), max_tokens=4)
        assert await backend.prompt_token_bound(long) > 2 * await backend.count_prompt_tokens(long)
    finally:
        await backend.close()


WHOLE = dataclasses.replace(REQUEST, streamed=False)


async def test_a_client_that_does_not_stream_gets_a_non_streamed_upstream_request() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_whole = lambda body: whole_answer(["Cats are great", "Dogs too"])
    backend = await started(upstreams)
    try:
        result = await backend.generate(dataclasses.replace(WHOLE, n=2), STAMP)
        assert result.prompt_tokens == len(PROMPT_IDS)
        assert [(c.text, c.completion_tokens, c.finish_reason) for c in result.choices] == [
            ("Cats are great", 3, "length"),
            ("Dogs too", 2, "length"),
        ]
        (sent,) = upstreams.workers["w1"].requests
        assert sent["stream"] is False and "stream_options" not in sent
        assert sent["vllm_xargs"] == {
            "xmark_message": STAMP.message.bits,
            "xmark_key_version": "v1",
            "xmark_fingerprint": FP,
        }
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_whole_tool_calls_are_kept_with_their_arguments() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "publish", "arguments": '{"story": "x"}'}}
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_whole = lambda body: whole_answer([""], finish="tool_calls", tool_calls=[call])
    backend = await started(upstreams)
    try:
        (choice,) = (await backend.generate(WHOLE, STAMP)).choices
        assert choice.finish_reason == "tool_calls" and choice.text == ""
        assert choice.tool_calls == [call]
        assert choice.generated_text() == '{"story": "x"}'
    finally:
        await backend.close()


async def test_the_stop_string_that_ended_a_choice_is_reported() -> None:
    """vLLM's ``stop_reason`` names the stop string that ended a choice (None at the end of the turn,
    a token id for a stop token): streamed and whole, the delta carries the string alone."""

    def ended_by(stop_reason: Any) -> list[bytes]:
        events = completion_events([["Cats", " are"]], finish="stop")
        last = json.loads(events[-3].decode().removeprefix("data: "))
        last["choices"][0]["stop_reason"] = stop_reason
        events[-3] = sse(last)[0]
        return events

    upstreams = Upstreams("w1")
    backend = await started(upstreams)
    try:
        for stop_reason, expected in (("\n\n", "\n\n"), (None, None), (2, None)):
            upstreams.workers["w1"].on_chat = lambda body, reason=stop_reason: ended_by(reason)
            (choice,) = (await backend.generate(REQUEST, STAMP)).choices
            assert choice.finish_reason == "stop" and choice.stop_sequence == expected
            answer = whole_answer(["Cats are"], finish="stop")
            answer["choices"][0]["stop_reason"] = stop_reason
            upstreams.workers["w1"].on_whole = lambda body, answer=answer: answer
            (choice,) = (await backend.generate(WHOLE, STAMP)).choices
            assert choice.finish_reason == "stop" and choice.stop_sequence == expected
    finally:
        await backend.close()


async def test_a_request_with_tools_keeps_the_upstream_stream() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_chat = lambda body: tool_call_events()
    backend = await started(upstreams)
    try:
        tools = [{"type": "function", "function": {"name": "publish", "parameters": {"type": "object"}}}]
        request = dataclasses.replace(WHOLE, max_tokens=8, options={"tools": tools})
        (choice,) = (await backend.generate(request, STAMP)).choices
        assert choice.tool_calls[0]["function"]["arguments"] == '{"story": "Once upon"}'
        (sent,) = upstreams.workers["w1"].requests
        assert sent["stream"] is True
    finally:
        await backend.close()


async def test_a_whole_answer_may_take_longer_than_the_worker_timeout() -> None:
    """The timeout bounds the wait for each of a stream's bytes; a non-streamed answer arrives only
    at the end, so the request's own deadline (the caller's) bounds it instead."""
    upstreams = Upstreams("w1")
    # the answer comes after 0.5 s: a 0.2 s bound on it would fire first (timers of one event loop,
    # so load cannot reorder them); 0.2 s still bounds the connect, 5x margin and more: a whole
    # request took at most 2 ms here
    upstreams.workers["w1"].whole_delay_s = 0.5
    backend = await started(upstreams, timeout_s=0.2)
    try:
        assert (await backend.generate(WHOLE, STAMP)).choices[0].text == "Cats are great"
    finally:
        await backend.close()


async def test_a_health_probe_is_bounded_by_its_own_timeout_not_the_request_timeout() -> None:
    """A worker slower to answer /health than the (short) request timeout is still in rotation: the
    probe's bound is HEALTH_TIMEOUT_S. (Bounded by the session's request timeout, the start-up probe
    took a busy worker out of rotation and the first request got 503.)"""
    upstreams = Upstreams("w1")
    # the probe is answered after 0.3 s: past the request timeout (0.1 s, timers of one loop), within
    # HEALTH_TIMEOUT_S (2 s), 5x margin and more over the 0.3 s; the request's 0.1 s connect bound
    # has 5x margin and more too: a whole request took at most 2 ms here
    upstreams.workers["w1"].health_delay_s = 0.3
    backend = await started(upstreams, timeout_s=0.1, health_interval_s=3600)
    try:
        assert backend.pool.workers[0].healthy
        assert (await backend.generate(WHOLE, STAMP)).choices[0].text == "Cats are great"
    finally:
        await backend.close()


async def test_a_stall_of_the_gateways_own_loop_does_not_take_a_worker_out_of_rotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe in flight while the event loop is blocked past the probe's bound (a long garbage
    collection, the start-up heap freeze) times out with the worker's answer unread; the worker is
    probed again instead of leaving rotation (before: the next request got 503 with nothing down)."""
    import aiohttp

    import service.backends.vllm as vllm

    upstreams = Upstreams("w1")
    backend = await started(upstreams, health_interval_s=3600)  # the start-up probe under the usual bound
    try:
        worker = backend.pool.workers[0]
        assert worker.healthy
        # 5x margin and more for the second probe, which must succeed: a probe took at most 1 ms here
        monkeypatch.setattr(vllm, "HEALTH_TIMEOUT_S", 0.5)
        monkeypatch.setattr(vllm, "HEALTH_TIMEOUT", aiohttp.ClientTimeout(total=0.5))
        probe = asyncio.create_task(backend.pool.check(worker))
        for _ in range(5):  # the probe's request is on its way
            await asyncio.sleep(0)
        time.sleep(1.2)  # noqa: ASYNC251  # the stall under test: the loop blocked past the probe's bound
        assert await probe
        assert worker.healthy
        assert (await backend.generate(WHOLE, STAMP)).choices[0].text == "Cats are great"
        # a worker that does not answer /health at all still leaves rotation, after PROBES_TO_LEAVE
        # probes: it would answer after 2.5 s, 5x the probe's bound (each probe's two tries take 1 s)
        upstreams.workers["w1"].health_delay_s = 2.5
        for _ in range(vllm.PROBES_TO_LEAVE - 1):
            assert await backend.pool.check(worker)
        assert not await backend.pool.check(worker)
        assert not worker.healthy
    finally:
        await backend.close()


async def test_leaving_a_whole_request_closes_its_upstream_connection() -> None:
    upstreams = Upstreams("w1")
    worker = upstreams.workers["w1"]
    worker.whole_delay_s = 5.0
    backend = await started(upstreams)
    try:
        task = asyncio.create_task(backend.generate(WHOLE, STAMP))
        # polls of at least 2 s each, 5x margin and more: the request arrived within 7 ms here, and
        # the worker saw its connection closed within 14 ms (long before its answer, at 5 s)
        for _ in range(200):
            if worker.requests:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if worker.left_early:
                break
            await asyncio.sleep(0.02)
        assert worker.left_early == 1  # vLLM aborts a request whose connection closed
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_a_malformed_or_failed_whole_answer_is_a_503() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_whole = lambda body: {"choices": [{"message": {}}]}
    backend = await started(upstreams)
    try:
        with pytest.raises(UpstreamUnavailableError, match="malformed"):
            await backend.generate(WHOLE, STAMP)
        upstreams.workers["w1"].on_whole = lambda body: whole_answer(["x"], finish="error")
        with pytest.raises(UpstreamUnavailableError, match="failed while generating"):
            await backend.generate(WHOLE, STAMP)
    finally:
        await backend.close()


async def test_generate_collects_every_choice() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_chat = lambda body: completion_events([["A", "B"], ["C", "D", "E"]], finish="stop")
    backend = await started(upstreams)
    try:
        result = await backend.generate(GenerationRequest(messages=REQUEST.messages, max_tokens=3, n=2), STAMP)
        assert result.prompt_tokens == len(PROMPT_IDS)
        assert [(c.text, c.completion_tokens, c.finish_reason) for c in result.choices] == [
            ("AB", 2, "stop"),
            ("CDE", 3, "stop"),
        ]
    finally:
        await backend.close()


async def test_upstream_abort_is_reported_as_cancelled() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_chat = lambda body: completion_events([["x", "y"]], finish="abort")
    backend = await started(upstreams)
    try:
        result = await backend.generate(REQUEST, STAMP)
        assert result.choices[0].finish_reason == "cancelled"
    finally:
        await backend.close()


# -- routing and health ----------------------------------------------------------------------


async def test_least_in_flight_routing_spreads_concurrent_requests() -> None:
    upstreams = Upstreams("w1", "w2")
    backend = await started(upstreams)
    try:
        first = await backend.stream(REQUEST, STAMP)
        second = await backend.stream(REQUEST, STAMP)
        assert [len(w.requests) for w in upstreams.workers.values()] == [1, 1]
        async for _ in first:
            pass
        third = await backend.stream(REQUEST, STAMP)  # w1 is idle again, w2 still busy
        assert [len(w.requests) for w in upstreams.workers.values()] == [2, 1]
        for stream in (second, third):
            async for _ in stream:
                pass
        assert [w.in_flight for w in backend.pool.workers] == [0, 0]
    finally:
        await backend.close()


async def test_health_checks_take_a_worker_out_and_bring_it_back() -> None:
    upstreams = Upstreams("w1", "w2")
    backend = await started(upstreams, health_interval_s=0.05)
    try:
        upstreams.workers["w1"].health_status = 503
        # 5x margin and more: the next probe (every 0.05 s) took it out within 0.06 s here
        assert await eventually(lambda: not backend.pool.workers[0].healthy, 5.0)
        assert [w.healthy for w in backend.pool.workers] == [False, True]
        for _ in range(3):
            await backend.generate(REQUEST, STAMP)
        assert [len(w.requests) for w in upstreams.workers.values()] == [0, 3]
        upstreams.workers["w1"].health_status = 200
        # 5x margin and more: the next probe brought it back within 0.06 s here
        assert await eventually(lambda: backend.pool.workers[0].healthy, 5.0)
        assert [w.healthy for w in backend.pool.workers] == [True, True]
        await backend.generate(REQUEST, STAMP)
        assert len(upstreams.workers["w1"].requests) == 1
    finally:
        await backend.close()


async def test_no_reachable_worker_is_a_503_upstream_unavailable() -> None:
    upstreams = Upstreams("w1")
    upstreams.refused.add("w1")
    backend = await started(upstreams)
    try:
        assert backend.ready  # the gateway itself is up: /trace still works
        with pytest.raises(UpstreamUnavailableError) as caught:
            await backend.generate(REQUEST, STAMP)
        assert caught.value.status_code == 503 and caught.value.code == "upstream_unavailable"
    finally:
        await backend.close()


async def test_refused_connection_is_retried_on_another_worker() -> None:
    upstreams = Upstreams("w1", "w2")
    backend = await started(upstreams, health_interval_s=3600)
    try:
        upstreams.refused.add("w1")  # dies after the start-up check
        result = await backend.generate(REQUEST, STAMP)
        assert result.choices[0].text == "Cats are great"
        assert [w.healthy for w in backend.pool.workers] == [False, True]
        assert [w.in_flight for w in backend.pool.workers] == [0, 0]
    finally:
        await backend.close()


async def test_timeout_is_a_504() -> None:
    upstreams = Upstreams("w1")
    upstreams.timing_out.add("w1")
    backend = await started(upstreams, timeout_s=0.3)  # the worker hangs for an hour
    try:
        with pytest.raises(UpstreamTimeoutError) as caught:
            await backend.generate(REQUEST, STAMP)
        assert caught.value.status_code == 504 and caught.value.code == "upstream_timeout"
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_slow_stream_times_out_between_chunks() -> None:
    upstreams = Upstreams("w1")
    events = completion_events([["a", "b", "c"]])
    # a 5 s pause: 25x the bound; the bound has 5x margin and more over the chunks before it: a
    # whole stream took at most 5 ms here
    upstreams.workers["w1"].on_chat = lambda body: [*events[:2], 5.0, *events[2:]]
    backend = await started(upstreams, timeout_s=0.2)
    try:
        stream = await backend.stream(REQUEST, STAMP)
        with pytest.raises(UpstreamTimeoutError):
            async for _ in stream:
                pass
    finally:
        await backend.close()


async def test_a_stream_that_already_produced_tokens_is_not_retried() -> None:
    upstreams = Upstreams("w1", "w2")
    events = completion_events([["a", "b", "c"]])
    upstreams.workers["w1"].on_chat = lambda body: [*events[:3], Reset()]
    backend = await started(upstreams, health_interval_s=3600)
    try:
        stream = await backend.stream(REQUEST, STAMP)
        received = []
        with pytest.raises(UpstreamUnavailableError):
            async for delta in stream:
                received.append(delta.text)
        assert received == ["a", "b"]
        assert [len(w.requests) for w in upstreams.workers.values()] == [1, 0]
        # the worker was probed at once and answered: a dropped connection alone keeps it in rotation
        assert backend.pool.workers[0].healthy is True
        assert backend.pool.workers[0].in_flight == 0
        # a worker that drops a stream and is gone leaves at once (its probe is refused): w2, the
        # least used, takes the next request and drops it after its first tokens
        upstreams.workers["w2"].on_chat = lambda body: [*events[:3], Reset()]
        stream = await backend.stream(REQUEST, STAMP)
        assert [w.in_flight for w in backend.pool.workers] == [0, 1]
        upstreams.refused.add("w2")
        with pytest.raises(UpstreamUnavailableError):
            async for _ in stream:
                pass
        assert [w.healthy for w in backend.pool.workers] == [True, False]
    finally:
        await backend.close()


async def test_connection_lost_before_the_first_token_is_retried() -> None:
    """Lost before any token: the worker is probed; it answers, so it is tried once more (a stale
    keep-alive connection the worker had closed), then the next worker. It stays in rotation."""
    upstreams = Upstreams("w1", "w2")
    upstreams.workers["w1"].on_chat = lambda body: [Reset()]
    backend = await started(upstreams, health_interval_s=3600)
    try:
        result = await backend.generate(REQUEST, STAMP)
        assert result.choices[0].text == "Cats are great"
        assert [len(w.requests) for w in upstreams.workers.values()] == [2, 1]
        assert [w.healthy for w in backend.pool.workers] == [True, True]
    finally:
        await backend.close()


async def test_a_single_worker_that_drops_one_connection_serves_the_retry() -> None:
    """One worker, whose first connection drops before any token (as a keep-alive connection the
    worker closed does): the request is served by its retry on the same worker, not a 503."""
    upstreams = Upstreams("w1")
    events = completion_events([["Cats", " are", " great"]])
    answers = iter([[Reset()], events])
    upstreams.workers["w1"].on_chat = lambda body: next(answers)
    backend = await started(upstreams, health_interval_s=3600)
    try:
        result = await backend.generate(REQUEST, STAMP)
        assert result.choices[0].text == "Cats are great"
        assert len(upstreams.workers["w1"].requests) == 2 and backend.pool.workers[0].healthy
    finally:
        await backend.close()


async def test_a_worker_leaves_rotation_only_after_three_missed_probes_in_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy worker that misses a probe's bound stays in rotation; the third missed probe in a row
    takes it out; a good probe resets the count and brings it back."""
    import aiohttp

    import service.backends.vllm as vllm

    upstreams = Upstreams("w1")
    backend = await started(upstreams, health_interval_s=3600)
    try:
        worker = backend.pool.workers[0]
        # the probe's bound 0.2 s; the worker answers /health after 1 s: 5x margin and more
        monkeypatch.setattr(vllm, "HEALTH_TIMEOUT_S", 0.2)
        monkeypatch.setattr(vllm, "HEALTH_TIMEOUT", aiohttp.ClientTimeout(total=0.2))
        assert vllm.PROBES_TO_LEAVE == 3
        upstreams.workers["w1"].health_delay_s = 1.0
        assert await backend.pool.check(worker) and await backend.pool.check(worker)
        assert worker.healthy and worker.failed_probes == 2
        assert (await backend.generate(REQUEST, STAMP)).choices[0].text == "Cats are great"
        upstreams.workers["w1"].health_delay_s = 0.0
        assert await backend.pool.check(worker) and worker.failed_probes == 0  # the count starts again
        upstreams.workers["w1"].health_delay_s = 1.0
        for _ in range(2):
            assert await backend.pool.check(worker)
        assert not await backend.pool.check(worker)  # the third in a row
        assert not worker.healthy
        upstreams.workers["w1"].health_delay_s = 0.0
        assert await backend.pool.check(worker) and worker.healthy  # back on its first good probe
    finally:
        await backend.close()


async def test_upstream_rejection_is_a_400_with_the_workers_reason() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_chat = lambda body: web.json_response(
        {"error": {"message": "This model's maximum context length is 2048 tokens.", "code": 400}}, status=400
    )
    backend = await started(upstreams)
    try:
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await backend.generate(REQUEST, STAMP)
        assert backend.pool.workers[0].in_flight == 0 and backend.pool.workers[0].healthy
    finally:
        await backend.close()


async def test_error_event_in_the_stream_fails_the_request() -> None:
    upstreams = Upstreams("w1")
    events = completion_events([["a", "b"]])
    upstreams.workers["w1"].on_chat = lambda body: [*events[:2], *sse({"error": {"message": "engine died"}})]
    backend = await started(upstreams)
    try:
        with pytest.raises(UpstreamUnavailableError, match="engine died"):
            await backend.generate(REQUEST, STAMP)
    finally:
        await backend.close()


async def test_cancel_closes_the_upstream_stream() -> None:
    upstreams = Upstreams("w1")
    events = completion_events([["a", "b", "c"]])
    upstreams.workers["w1"].on_chat = lambda body: [*events[:2], 30.0, *events[2:]]
    backend = await started(upstreams)
    try:
        stream = await backend.stream(REQUEST, STAMP)
        assert (await stream.__anext__()).text == "a"
        stream.cancel()
        # a poll of at least 0.5 s, 5x margin and more: in_flight was 0 within 1 ms here (and the
        # worker's pause, 30 s, is far longer than the poll)
        for _ in range(50):
            if backend.pool.workers[0].in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.pool.workers[0].in_flight == 0
        assert stream.upstream_closed
    finally:
        await backend.close()


async def test_tokenizer_is_the_checkpoints_own() -> None:
    upstreams = Upstreams("w1")
    backend = await started(upstreams)
    try:
        tokenizer = backend.tokenizer
        assert tokenizer is not None
        assert tokenizer.encode("Tell me about cats.", add_special_tokens=False) == [31530, 549, 563, 7680, 30]
    finally:
        await backend.close()


# -- scoring (the prompt log-probs /trace reads) ----------------------------------------------


async def test_score_parses_prompt_logprobs_into_model_scores() -> None:
    upstreams = Upstreams("w1")
    backend = await started(upstreams)
    try:
        scores = await backend.score(TEXT_IDS, TOP_K)
        worker = upstreams.workers["w1"]
        assert worker.paths == ["/v1/completions"]
        # the token ids as the prompt, and no vllm_xargs: the worker's processor leaves it unwatermarked
        assert worker.requests == [
            {"model": MODEL, "prompt": TEXT_IDS, "max_tokens": 1, "temperature": 0, "prompt_logprobs": TOP_K}
        ]
        n = len(TEXT_IDS)
        assert scores.token_logprobs.shape == (n,) and scores.token_logprobs.dtype == np.float64
        assert scores.top_ids.shape == (n, TOP_K) and scores.top_ids.dtype == np.int64
        assert scores.top_logprobs.shape == (n, TOP_K) and scores.top_logprobs.dtype == np.float64
        assert scores.vocab_size == 49152  # the checkpoint's config (SmolLM2)
        # row 0: nothing before the first token
        assert np.isnan(scores.token_logprobs[0])
        assert scores.top_ids[0].tolist() == [0] * TOP_K
        assert np.all(scores.top_logprobs[0] == -np.inf)
        expected_top = [top_logprob(j) for j in range(TOP_K)]
        for t in range(1, n):
            assert scores.top_ids[t].tolist() == top_tokens(t)  # likeliest first, exactly K
            assert scores.top_logprobs[t].tolist() == expected_top
            rank = own_rank(t)
            expected_own = OUTSIDE_LOGPROB if rank is None else top_logprob(rank - 1)
            assert scores.token_logprobs[t] == expected_own
        # the token outside the top k has its own log-prob but takes no top-k column
        assert TEXT_IDS[3] not in scores.top_ids[3]
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_score_is_retried_on_another_worker_when_one_is_down() -> None:
    upstreams = Upstreams("w1", "w2")
    backend = await started(upstreams, health_interval_s=3600)
    try:
        upstreams.refused.add("w1")  # dies after the start-up check
        scores = await backend.score(TEXT_IDS, TOP_K)
        assert scores.token_logprobs[3] == OUTSIDE_LOGPROB
        assert [len(w.requests) for w in upstreams.workers.values()] == [0, 1]
        assert [w.healthy for w in backend.pool.workers] == [False, True]
        assert [w.in_flight for w in backend.pool.workers] == [0, 0]
        upstreams.refused.add("w2")
        with pytest.raises(UpstreamUnavailableError):
            await backend.score(TEXT_IDS, TOP_K)
    finally:
        await backend.close()


async def test_score_of_a_text_longer_than_the_context_is_a_400_on_the_text() -> None:
    upstreams = Upstreams("w1")
    upstreams.workers["w1"].on_completion = lambda body: web.json_response(
        status=400,
        data={
            "error": {
                "message": "This model's maximum context length is 1024 tokens. However, your prompt contains "
                "6 input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt. (parameter=input_tokens, value=6)",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
        },
    )
    backend = await started(upstreams)
    try:
        with pytest.raises(InvalidRequestError) as caught:
            await backend.score(TEXT_IDS, TOP_K)
        error = caught.value
        assert error.status_code == 400 and error.param == "text" and error.code == "context_length_exceeded"
        assert error.message == "The text has 6 tokens; the model reads at most 1024"
        assert backend.pool.workers[0].in_flight == 0 and backend.pool.workers[0].healthy
    finally:
        await backend.close()


async def test_score_timeout_is_a_504_and_a_malformed_answer_a_503() -> None:
    upstreams = Upstreams("w1")
    upstreams.timing_out.add("w1")
    # the worker hangs for an hour; the malformed answer after it comes within the same 0.3 s bound,
    # 5x margin and more: a score request took at most 5 ms here
    backend = await started(upstreams, timeout_s=0.3)
    try:
        with pytest.raises(UpstreamTimeoutError):
            await backend.score(TEXT_IDS, TOP_K)
        upstreams.timing_out.clear()
        upstreams.workers["w1"].on_completion = lambda body: {"choices": [{"index": 0, "text": ""}]}
        with pytest.raises(UpstreamUnavailableError, match="malformed"):
            await backend.score(TEXT_IDS, TOP_K)
        assert backend.pool.workers[0].in_flight == 0
    finally:
        await backend.close()


async def test_score_before_the_backend_is_ready_is_a_503() -> None:
    upstreams = Upstreams("w1")
    await upstreams.start()
    backend = VllmBackend(upstreams.urls(), MODEL, checkpoint_path())
    try:
        with pytest.raises(ServiceUnavailableError) as caught:
            await backend.score(TEXT_IDS, TOP_K)
        assert caught.value.status_code == 503
        assert upstreams.workers["w1"].requests == []
    finally:
        await backend.close()
