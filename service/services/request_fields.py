"""Which request fields a backend honours, and the refusal of every other field by name.

A field that changes the output and is not honoured must never be accepted silently: the caller
would believe it had, say, JSON mode or tool calls and get neither. Each field of an OpenAI chat
request therefore falls in one of these classes:

- *honoured* by the backend serving the request (``Backend.honoured_fields``);
- *naming the end user* (``safety_identifier``, ``user``): accepted; the request is watermarked with
  that end user's message ID (``service.end_users``), checked there;
- *without effect on the output* (``metadata``): accepted, never needed;
- *at its neutral value*: a field sent with the value that means "off" (``logprobs: false``,
  ``presence_penalty: 0``, ``tools: []``...) changes nothing, so it is accepted even where the
  feature is not honoured (many clients send such defaults);
- *owned by the gateway* (``vllm_xargs``, ``watermarking``): refused, the watermark is set from the
  caller's identity;
- everything else, known to the OpenAI or vLLM API or not (a typo such as ``max_token``):
  refused with 400 ``unsupported_parameter`` whose ``param`` names the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from service.backends.fields import DEFAULT_HONOURED, SAMPLING_FIELDS
from service.errors import InvalidRequestError

if TYPE_CHECKING:
    from service.schemas.chat import ChatMessage

# POST /v1/completions, on either backend (max_completion_tokens is a chat field)
TEXT_COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "echo", "stream", "stream_options"} | (SAMPLING_FIELDS - {"max_completion_tokens"})
)

# Sampling options /v1/completions honours where the serving backend honours them on chat (the
# penalties, logit_bias and vLLM's top_k / min_p): they act on the logits alike for either prompt.
TEXT_COMPLETION_OPTIONS = frozenset(
    {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p"}
)

# Accepted with any value: they label the request, they do not change what is generated.
WITHOUT_EFFECT = frozenset({"metadata"})

# They name the account's end user the answer is watermarked for (checked by service.end_users).
END_USER_FIELDS = frozenset({"safety_identifier", "user"})

# The watermark is the gateway's: a request cannot set or switch it off.
GATEWAY_OWNED = frozenset({"vllm_xargs", "watermarking"})


def _neutral(values: Iterable[Any]) -> tuple[Any, ...]:
    return (None, *values)


# Values that leave the output as if the field were absent (compared with ==; 0 == 0.0 == False).
NEUTRAL_VALUES: Mapping[str, tuple[Any, ...]] = {
    "logprobs": _neutral([False, 0]),  # 0: /v1/completions' integer form
    "suffix": _neutral([""]),
    "best_of": _neutral([1]),
    "echo": _neutral([False]),
    "top_logprobs": _neutral([0]),
    "tools": _neutral([[]]),
    "tool_choice": _neutral(["none"]),
    "parallel_tool_calls": _neutral([True, False]),
    "functions": _neutral([[]]),
    "function_call": _neutral(["none"]),
    "response_format": _neutral([{"type": "text"}]),
    "presence_penalty": _neutral([0]),
    "frequency_penalty": _neutral([0]),
    "repetition_penalty": _neutral([1]),
    "logit_bias": _neutral([{}]),
    "top_k": _neutral([0, -1]),
    "min_p": _neutral([0]),
    "modalities": _neutral([["text"]]),
    "store": _neutral([False]),
    "service_tier": _neutral(["auto", "default"]),
}

# Fields of the OpenAI (and vLLM) chat API this gateway knows of, for the wording of the refusal.
KNOWN_CHAT_FIELDS = frozenset(
    {
        *DEFAULT_HONOURED,
        *WITHOUT_EFFECT,
        *END_USER_FIELDS,
        *GATEWAY_OWNED,
        *NEUTRAL_VALUES,
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "best_of",
        "echo",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "prompt_logprobs",
        "return_token_ids",
        "priority",
        "prompt_cache_key",
        "verbosity",
    }
)


def equals_neutral(value: Any, neutral: Iterable[Any]) -> bool:
    """Whether ``value`` is one of the ``neutral`` values (those that change nothing). bool is an
    int: `True == 1` must not make top_logprobs=1 look neutral, so types are compared too."""
    return any(value == n and (type(value) is bool) == (type(n) is bool) for n in neutral)


def _is_neutral(name: str, value: Any) -> bool:
    return equals_neutral(value, NEUTRAL_VALUES.get(name, ()))


def refuse_unhonoured(fields: Mapping[str, Any], honoured: frozenset[str], backend: str) -> None:
    """Raise 400 ``unsupported_parameter`` for a field that ``backend`` cannot honour; ``fields``
    holds the fields the client sent, with their values."""
    for name, value in fields.items():
        if name in honoured or name in WITHOUT_EFFECT or name in END_USER_FIELDS or _is_neutral(name, value):
            continue
        if name in GATEWAY_OWNED:
            message = f"'{name}' cannot be set by a request: the gateway sets the watermark from the caller's identity"
        elif name in KNOWN_CHAT_FIELDS:
            message = f"'{name}' is not supported by this gateway's {backend} backend; remove it from the request"
        else:
            message = f"Unknown parameter '{name}'; remove it from the request"
        raise InvalidRequestError(message, param=name, code="unsupported_parameter")


def check_logprobs(options: Mapping[str, Any], *, allowed: bool, max_top: int) -> None:
    """The operator's policy on log-probabilities (``XMARK_ALLOW_LOGPROBS``, ``XMARK_MAX_TOP_LOGPROBS``)
    for a backend that can return them: refused by name when off, ``top_logprobs`` capped."""
    wants = {name for name in ("logprobs", "top_logprobs") if not _is_neutral(name, options.get(name))}
    if not wants:
        return
    if not allowed:
        name = "logprobs" if "logprobs" in wants else "top_logprobs"
        raise InvalidRequestError(
            f"'{name}' is switched off on this gateway: log-probabilities help estimate the watermark",
            param=name,
            code="unsupported_parameter",
        )
    if "top_logprobs" in wants and _is_neutral("logprobs", options.get("logprobs")):
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    top = options.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > max_top:
        raise InvalidRequestError(
            f"'top_logprobs' is at most {max_top} on this gateway (got {top})",
            param="top_logprobs",
            code="invalid_value",
        )


def sent_fields(model: BaseModel) -> dict[str, Any]:
    """The fields a client sent in a pydantic request body: the declared ones it set, and extras."""
    sent = {name: getattr(model, name) for name in sorted(model.model_fields_set)}
    sent.update(model.model_extra or {})
    return sent


def refuse_message_extras(messages: Iterable[BaseModel]) -> None:
    """Raise 400 ``unsupported_parameter`` naming the first unread field of a message or content
    part: dropping ``tool_calls``, ``tool_call_id`` or a part's ``cache_control`` would change what
    the prompt means."""
    for i, message in enumerate(messages):
        for name in message.model_extra or {}:
            raise InvalidRequestError(
                f"'{name}' in messages[{i}] is not supported; remove it from the message",
                param=f"messages.{i}.{name}",
                code="unsupported_parameter",
            )
        content = getattr(message, "content", None)
        if isinstance(content, list):
            for j, part in enumerate(content):
                for name in part.model_extra or {}:
                    raise InvalidRequestError(
                        f"'{name}' in messages[{i}].content[{j}] is not supported; remove it",
                        param=f"messages.{i}.content.{j}.{name}",
                        code="unsupported_parameter",
                    )


def refuse_tool_turns(messages: Sequence[ChatMessage], honoured: frozenset[str], model: str) -> None:
    """Raise 400 ``unsupported_parameter`` for the first turn of a tool-using conversation (a tool
    result, an assistant's tool calls) when the model's backend does not take tools: its chat
    template cannot render them, and dropping them would change what the prompt means."""
    if "tools" in honoured:
        return
    for i, message in enumerate(messages):
        if message.uses_tools:
            field = "tool_calls" if message.tool_calls is not None else "role"
            raise InvalidRequestError(
                f"messages[{i}] is a turn of a tool-using conversation ('{field}'), which the model "
                f"'{model}' cannot render on this backend (tools need the vllm backend)",
                param=f"messages.{i}.{field}",
                code="unsupported_parameter",
            )
