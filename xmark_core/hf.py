"""transformers adapter: a LogitsProcessor that watermarks each batch row with its own message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from transformers import LogitsProcessor

from .encoder import TorchWatermarker
from .errors import ArgumentError, ParamsError
from .gumbel import Truncation, repeated_context, salted
from .keys import WatermarkKey
from .message import Message


class XMarkLogitsProcessor(LogitsProcessor):
    """Adds the XMark bias with a different message per batch row.

    ``messages[i]`` is the message of batch row i, or None to leave that row unwatermarked, so one
    ``model.generate`` call can serve several users. When generate expands rows (num_return_sequences
    > 1) the messages are repeated accordingly. The context of the first generated tokens is the
    last two prompt tokens, as in the paper.

    ``watermarker`` is the op to use, for ``key``: pass one that lives longer than a batch (a fused
    one, compiled once at start-up) to share it; without it the eager op is built for this batch.

    Scheme ``gumbel`` chooses the next token itself (``xmark_core.gumbel``): pass the generation's
    ``temperature`` (0: greedy, left alone) and ``top_p`` (None or 1: off); it samples from the
    model's distribution at that temperature, within that nucleus. Only the chosen token's score
    stays finite, so transformers' temperature and top-k/top-p warpers, which run after the
    processors given to ``generate``, return that token. With a salted
    key (``params.salts`` > 1), ``salts[i]`` is the salt of row i's first answer; when generate
    expands row i into n answers, answer j is written under salt (salts[i] + j) mod S, so the n
    answers of one request are sampled independently of each other.
    """

    def __init__(
        self,
        key: WatermarkKey,
        messages: Sequence[Message | None],
        *,
        watermarker: TorchWatermarker | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        salts: Sequence[int] | None = None,
    ) -> None:
        if not messages:
            raise ArgumentError("messages must name one message (or None) per batch row")
        params = key.params
        if params.distortion_free and (temperature is None or not temperature >= 0.0):
            raise ParamsError("scheme 'gumbel' samples itself: pass the generation's temperature (>= 0)")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ParamsError(f"top_p must be in (0, 1] (got {top_p!r})")
        self._temperature = temperature
        self._top_p = top_p if params.distortion_free and top_p is not None and top_p < 1.0 else None
        self._start: int | None = None  # the first generated position, seen on the first call
        blocks = np.zeros((len(messages), params.num_blocks), dtype=np.int64)
        for row, message in enumerate(messages):
            if message is None:
                continue
            if message.params.bits != params.bits or message.params.block_bits != params.block_bits:
                raise ParamsError("message length does not match the key's parameters")
            blocks[row] = message.blocks
        if salts is not None and len(salts) != len(messages):
            raise ArgumentError(f"got {len(salts)} salts for {len(messages)} batch rows")
        first = [0] * len(messages) if salts is None else list(salts)
        for salt in first:
            salted(np.zeros(0, dtype=np.int64), salt, params)  # validates it
        self._params = params
        self._salts = torch.tensor(first, dtype=torch.int64)  # [rows]
        self._blocks = torch.from_numpy(blocks)  # [rows, r]
        self._active = torch.tensor([m is not None for m in messages], dtype=torch.bool)  # [rows]
        if watermarker is not None and watermarker.key.fingerprint != key.fingerprint:
            raise ArgumentError("the watermarker was built for another key")
        self._watermarker = watermarker if watermarker is not None else TorchWatermarker(key)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = scores.shape[0]
        rows = self._blocks.shape[0]
        if batch % rows:
            raise ArgumentError(f"batch of {batch} rows does not expand {rows} messages")
        if self._blocks.device != scores.device:
            self._blocks = self._blocks.to(scores.device)
            self._active = self._active.to(scores.device)
        blocks, active = self._blocks, self._active
        copies = batch // rows
        salts = self._salts.to(blocks.device)
        if batch != rows:
            blocks = blocks.repeat_interleave(copies, dim=0)
            active = active.repeat_interleave(copies, dim=0)
            salts = salts.repeat_interleave(copies) + torch.arange(copies, device=blocks.device).repeat(rows)
        if self._params.salts > 1:  # answer j of row i: salt (salts[i] + j) mod S
            blocks = blocks + ((salts % self._params.salts) * self._params.num_shards)[:, None]
        context = input_ids[:, -2:]  # [B, 2]: (x[t-2], x[t-1])
        if context.shape[1] < 2:
            context = torch.nn.functional.pad(context, (2 - context.shape[1], 0))
        temperature = None
        if self._temperature is not None:
            if self._start is None:
                self._start = input_ids.shape[1]
            # distortion-free sampling: a context already used in this answer is sampled normally
            active = active & ~repeated_context(input_ids, self._start)
            temperature = torch.full((batch,), self._temperature, dtype=torch.float32, device=scores.device)
        truncation = None
        if self._top_p is not None:
            truncation = Truncation(top_p=torch.full((batch,), self._top_p, dtype=torch.float32, device=scores.device))
        marked = self._watermarker.apply(
            scores, context.to(torch.int64), blocks, active, temperature=temperature, truncation=truncation
        )
        # apply returns a tensor of the scores' dtype, which transformers' signature calls FloatTensor
        return cast(torch.FloatTensor, marked)
