"""What the gateway asks of a model backend, and the values that cross that boundary."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from service.errors import GatewayError
from service.vocabulary import FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from xmark_core import Message, ModelScores, WatermarkKey

Role = Literal["system", "user", "assistant", "tool"]

# One model or tokenizer loads at a time in this process. transformers' loading is not
# thread-safe: two backends (several models served from a models file) loading at once on worker
# threads failed with an ImportError from its lazy imports, or left a model with garbage weights
# whose logits came out partly NaN now and then.
LOAD_LOCK = threading.Lock()

# Below this temperature a request is decoded greedily, as vLLM does (its _SAMPLING_EPS): dividing
# the logits by a temperature this small overflows float32 and sampling from the result fails.
GREEDY_TEMPERATURE = 1e-5


class BackendError(GatewayError):
    """500 ``backend_error``: the model failed while generating (not the request's fault, and not a
    passing outage either: the same request would likely fail again)."""

    status_code = 500
    type = "server_error"
    code = "backend_error"


@dataclass(frozen=True)
class ChatTurn:
    """One message of a chat prompt. ``tool_calls`` (OpenAI's shape) and a null ``content`` come
    from an assistant turn that called tools; ``tool_call_id`` from a tool's result."""

    role: Role
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    null_content: bool = False

    def as_message(self) -> dict[str, Any]:
        """The turn as an OpenAI chat message, as the client sent it."""
        message: dict[str, Any] = {"role": self.role, "content": None if self.null_content else self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def as_template_message(self) -> dict[str, Any]:
        """The turn for a chat template (which reads a null content as empty, as vLLM does)."""
        message = self.as_message()
        if message["content"] is None:
            message["content"] = ""
        return message


@dataclass(frozen=True)
class GenerationRequest:
    """One chat completion request, already validated and normalised by the gateway.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) means greedy decoding. ``seed`` makes
    sampling reproducible. ``stop`` holds up to four strings; the completion is cut before the first
    one produced. ``user_id`` names the caller, so that a backend that queues work can share the
    model fairly between users (None: a caller of its own, e.g. a benchmark calling the backend).
    ``options``: the further OpenAI fields the client sent that this backend declared it honours
    (``honoured_fields``), as sent, e.g. ``tools`` or ``logprobs`` for a vLLM worker.
    ``prompt``: a raw text prompt (``/v1/completions``), continued as it is, without the chat
    template; ``messages`` is then empty. ``streamed`` False: the client takes the completion whole
    (a backend may then generate it without streaming).
    """

    messages: tuple[ChatTurn, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user_id: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    prompt: str | None = None
    streamed: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class WatermarkStamp:
    """The watermark every row of a generation carries: the key version and the caller's message."""

    key: WatermarkKey
    message: Message
    key_version: str = ""  # the key version's name; remote workers look the secret up by it
    # a salted gumbel key version: the salt of the request's first answer (answer j: salt + j, mod S)
    salt: int = 0
    # ``key`` is the key version's companion encoder (``xmark_core.encoders``): remote workers pick
    # that encoder's key of the version named ``key_version``
    companion: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    """Text produced for one choice since the previous delta.

    ``completion_tokens`` counts the tokens generated for this choice so far (the text of every
    one of them is covered by this and earlier deltas, except text held back at a stop string).
    ``finish_reason`` is set on the last delta of a choice. ``tool_calls``: OpenAI tool-call
    deltas (``{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}``); ``logprobs``:
    OpenAI ``logprobs.content`` entries of the tokens of this delta. ``stop_sequence``: on the
    last delta of a choice that one of the request's ``stop`` strings ended, that string.
    """

    index: int
    text: str
    completion_tokens: int
    finish_reason: FinishReason | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    logprobs: tuple[dict[str, Any], ...] = ()
    stop_sequence: str | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # merged: whole calls
    logprobs: list[dict[str, Any]] | None = None  # OpenAI logprobs.content, when asked for
    stop_sequence: str | None = None  # the stop string that ended it, if one did

    def add(self, delta: ChoiceDelta) -> None:
        """Fold one delta of this choice in."""
        self.text += delta.text
        self.completion_tokens = delta.completion_tokens
        for call in delta.tool_calls:
            merge_tool_call(self.tool_calls, call)
        if delta.logprobs:
            self.logprobs = [*(self.logprobs or ()), *delta.logprobs]
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_sequence = delta.stop_sequence

    def generated_text(self) -> str:
        """Everything the model generated for this choice, tool-call arguments included: what the
        generation record hashes and /trace reads (the arguments carry the watermark too)."""
        return self.text + "".join(str(call.get("function", {}).get("arguments") or "") for call in self.tool_calls)


def merge_tool_call(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    """Merge one streamed tool-call delta into ``calls`` (OpenAI: the first delta of a call carries
    its id, type and name; later ones append to ``function.arguments``)."""
    position = int(delta.get("index", len(calls)))
    while len(calls) <= position:
        calls.append({"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
    call = calls[position]
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] = function["name"]
    call["function"]["arguments"] += function.get("arguments") or ""


@dataclass
class GenerationResult:
    prompt_tokens: int
    choices: list[ChoiceResult] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return sum(choice.completion_tokens for choice in self.choices)


@runtime_checkable
class GenerationStream(Protocol):
    """Async iterator of deltas of one running generation."""

    prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[ChoiceDelta]: ...

    async def __anext__(self) -> ChoiceDelta: ...

    def cancel(self) -> None:
        """Stop generating (the client went away); remaining choices finish as ``cancelled``."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A model that the gateway serves.

    ``start`` may return before the model is loaded; ``ready`` turns true once it can generate.
    ``tokenizer`` (None until loaded) is the served model's tokenizer, which ``/trace`` uses.
    ``honoured_fields``: the chat request fields it honours; any other field that would change the
    output is refused by name (:mod:`service.services.request_fields`). ``schemes``: the watermark
    schemes it can encode with (a key version of another scheme is not served through it).
    ``salts_per_answer``: whether the n answers of one request are written under consecutive salts
    of a salted ``gumbel`` key version (false: they would share one, and n > 1 is refused there).
    ``encoders_per_request``: whether it serves both encoders of a per-request key version
    (``xmark_core.encoders``), the one the gateway chose per request (false: the primary alone).
    """

    model_id: str
    honoured_fields: frozenset[str]
    schemes: frozenset[str]
    salts_per_answer: bool
    encoders_per_request: bool

    @property
    def ready(self) -> bool: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None: ...

    async def start(self) -> None: ...

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the backend can generate (or failed to start); True when ready."""
        ...

    async def close(self) -> None: ...

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The prompt's length in the served model's tokens, chat template included (what the
        gateway checks against ``max_prompt_tokens`` and charges to a user's tokens per minute
        before anything is queued). Raises ``ServiceUnavailableError`` while not ready."""
        ...

    async def prompt_token_bound(self, request: GenerationRequest) -> int:
        """At least ``count_prompt_tokens(request)``, and cheaper to know where the backend can (the
        gateway reserves it and counts exactly only when the bound meets a limit); a backend
        without a cheaper bound returns the exact count."""
        ...

    async def stream(self, request: GenerationRequest, stamp: WatermarkStamp) -> GenerationStream:
        """Validate and enqueue ``request``; the returned stream yields its deltas. A failure of
        the model while generating surfaces from the stream as a ``GatewayError`` (``BackendError``
        when the model itself failed), never as choices that look finished."""
        ...

    async def generate(self, request: GenerationRequest, stamp: WatermarkStamp) -> GenerationResult:
        """Run ``request`` to completion."""
        ...

    async def score(self, token_ids: Sequence[int], top_k: int) -> ModelScores:
        """The served model's next-token distribution at every position of a text (``/trace``'s
        likelihood decoder): for each position t >= 1, the log-probability (temperature 1, no
        watermark) of token t given the tokens before it and the ``top_k`` likeliest tokens with
        theirs. Raises ``ServiceUnavailableError`` while the model is not ready and
        ``InvalidRequestError`` (param ``text``) for a text longer than the model's context."""
        ...


async def collect(stream: GenerationStream, n: int) -> GenerationResult:
    """Drain ``stream`` into a result; cancels the generation if the caller is cancelled."""
    result = GenerationResult(prompt_tokens=stream.prompt_tokens, choices=[ChoiceResult(i) for i in range(n)])
    try:
        async for delta in stream:
            result.choices[delta.index].add(delta)
    except BaseException:
        stream.cancel()
        raise
    return result
