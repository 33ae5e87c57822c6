"""OpenAI's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` for the local backend.

As OpenAI and vLLM define them, on the raw logits of each row, counting only the tokens generated
so far in this completion (not the prompt)::

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)
    logits[j] += logit_bias[j]

``sampling_penalties`` reads and checks a request's values (400 ``invalid_value`` naming the field);
``PenaltyProcessor`` applies them, each batch row with its own values, before temperature, top-p and
the watermark (the ``gumbel`` scheme's keyed choice then samples from the penalised logits).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import LogitsProcessor

from service.errors import InvalidRequestError

PENALTY_FIELDS = ("frequency_penalty", "presence_penalty")
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_BIAS_ENTRIES = 300  # OpenAI's cap
_TOKEN_ID = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class SamplingPenalties:
    """One request's values; ``bias`` holds (token id, bias) pairs, one per token, in id order."""

    frequency: float = 0.0
    presence: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalised(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0

    @property
    def neutral(self) -> bool:
        return not self.penalised and not self.bias


NEUTRAL = SamplingPenalties()


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a number (bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range
        return None
    return number if math.isfinite(number) else None


def _penalty(options: Mapping[str, Any], name: str) -> float:
    value = options.get(name)
    if value is None:
        return 0.0
    number = _number(value)
    if number is None or not -MAX_PENALTY <= number <= MAX_PENALTY:
        raise InvalidRequestError(
            f"'{name}' must be a number from {-MAX_PENALTY:g} to {MAX_PENALTY:g}", param=name, code="invalid_value"
        )
    return number


def _token_id(key: Any, vocab_size: int) -> int | None:
    """A ``logit_bias`` key as a token id of the model (JSON keys are strings of digits), or None."""
    if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
        token = int(key)
    elif isinstance(key, int) and not isinstance(key, bool):  # a Python caller's map
        token = key
    else:
        return None
    return token if 0 <= token < vocab_size else None


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            "'logit_bias' must be an object mapping token ids to biases", param="logit_bias", code="invalid_value"
        )
    if len(value) > MAX_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"'logit_bias' has at most {MAX_BIAS_ENTRIES} entries", param="logit_bias", code="invalid_value"
        )
    biases: dict[int, float] = {}
    for key, raw in value.items():
        token = _token_id(key, vocab_size)
        if token is None:
            raise InvalidRequestError(
                f"'logit_bias' keys must be token ids: integers from 0 to {vocab_size - 1}",
                param="logit_bias",
                code="invalid_value",
            )
        bias = _number(raw)
        if bias is None or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise InvalidRequestError(
                f"'logit_bias' values must be numbers from {-MAX_BIAS:g} to {MAX_BIAS:g}",
                param="logit_bias",
                code="invalid_value",
            )
        biases[token] = bias  # "42" and "042" name one token: the later one wins, as in vLLM
    return tuple(sorted((token, bias) for token, bias in biases.items() if bias != 0.0))


def sampling_penalties(options: Mapping[str, Any], vocab_size: int) -> SamplingPenalties:
    """The penalties and biases of a request's ``options`` (``GenerationRequest.options``), checked:
    raises ``InvalidRequestError`` (400 ``invalid_value``, ``param`` the field) for a penalty that
    is not a number in [-2, 2], or a ``logit_bias`` that is not an object of at most 300 entries
    mapping token ids in [0, ``vocab_size``) to numbers in [-100, 100]. A field absent or null is
    neutral."""
    frequency, presence = (_penalty(options, name) for name in PENALTY_FIELDS)
    bias = _logit_bias(options.get("logit_bias"), vocab_size)
    values = SamplingPenalties(frequency, presence, bias)
    return NEUTRAL if values.neutral else values


class PenaltyProcessor(LogitsProcessor):
    """Applies each batch row's ``SamplingPenalties`` to its next-token logits.

    ``rows[i]`` holds the values of batch row i (a job of n answers has n rows with the same
    values); ``prompt_width`` is the width of the left-padded prompts at the head of ``input_ids``,
    whose tokens are not counted. Only rows with a penalty are counted and only rows with a bias are
    biased: a neutral row costs nothing. Build it with ``penalty_processor``, which returns None for
    a batch without any such row.
    """

    def __init__(self, rows: Sequence[SamplingPenalties], prompt_width: int) -> None:
        if not rows:
            raise ValueError("rows must hold the values of every batch row")
        if prompt_width < 0:
            raise ValueError("prompt_width must not be negative")
        self._rows = len(rows)
        self._width = prompt_width
        penalised = [i for i, row in enumerate(rows) if row.penalised]
        self._penalised = torch.tensor(penalised, dtype=torch.int64)  # [p] batch rows with a penalty
        self._frequency = torch.tensor([rows[i].frequency for i in penalised], dtype=torch.float32)  # [p]
        self._presence = torch.tensor([rows[i].presence for i in penalised], dtype=torch.float32)  # [p]
        entries = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.bias]
        self._bias_rows = torch.tensor([e[0] for e in entries], dtype=torch.int64)  # [e]
        self._bias_tokens = torch.tensor([e[1] for e in entries], dtype=torch.int64)  # [e]
        self._bias_values = torch.tensor([e[2] for e in entries], dtype=torch.float32)  # [e]

    def _to(self, device: torch.device) -> None:
        if self._penalised.device != device:
            self._penalised, self._frequency, self._presence = (
                t.to(device) for t in (self._penalised, self._frequency, self._presence)
            )
            self._bias_rows, self._bias_tokens, self._bias_values = (
                t.to(device) for t in (self._bias_rows, self._bias_tokens, self._bias_values)
            )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids``: [rows, prompt_width + generated] int64, the prompts then the tokens generated
        so far; ``scores``: [rows, vocab] float logits of the next token. Returns new [rows, vocab]
        logits of the scores' dtype (``scores`` itself is left as it was)."""
        if scores.shape[0] != self._rows:
            raise ValueError(f"got {scores.shape[0]} batch rows for the values of {self._rows}")
        self._to(scores.device)
        out: torch.Tensor = scores
        generated = input_ids.shape[1] - self._width
        if self._penalised.numel() and generated > 0:
            new = input_ids[self._penalised, self._width :]  # [p, generated] int64
            counts = torch.zeros((new.shape[0], scores.shape[1]), dtype=scores.dtype, device=scores.device)
            counts.scatter_add_(1, new, torch.ones_like(new, dtype=scores.dtype))  # [p, vocab]
            frequency = self._frequency.to(scores.dtype)[:, None]  # [p, 1]
            presence = self._presence.to(scores.dtype)[:, None]  # [p, 1]
            cut = frequency * counts + presence * (counts > 0).to(scores.dtype)  # [p, vocab]
            out = out.index_add(0, self._penalised, cut, alpha=-1)
        if self._bias_rows.numel():
            values = self._bias_values.to(scores.dtype)  # [e]
            out = out.index_put((self._bias_rows, self._bias_tokens), values, accumulate=True)
        # transformers' signature calls a float tensor a FloatTensor
        return cast(torch.FloatTensor, out)


def penalty_processor(rows: Sequence[SamplingPenalties], prompt_width: int) -> PenaltyProcessor | None:
    """The processor of a batch whose row i has ``rows[i]``; None when every row is neutral."""
    if all(row.neutral for row in rows):
        return None
    return PenaltyProcessor(rows, prompt_width)
