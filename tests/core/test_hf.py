"""The transformers adapter: per-row messages, num_return_sequences expansion, LogitsProcessor use."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from xmark_core import Message, TorchWatermarker, WatermarkKey, WatermarkParams, apply_watermark
from xmark_core.hf import XMarkLogitsProcessor

from .synthetic import random_messages

VOCAB = 49_152  # SmolLM2's vocabulary size


def _row_by_row(key: WatermarkKey, messages: list[Message | None], input_ids: torch.Tensor, scores: torch.Tensor):
    """The reference: apply_watermark on each batch row alone (batch of one)."""
    w = TorchWatermarker(key)
    rows = []
    for i, message in enumerate(messages):
        blocks = torch.from_numpy(message.blocks) if message is not None else torch.zeros(8, dtype=torch.int64)
        rows.append(
            apply_watermark(
                scores[i : i + 1],
                input_ids[i : i + 1, -2:].to(torch.int64),
                blocks[None, :],
                torch.tensor([message is not None]),
                words=w.words(scores.device),
                codes=w.codes(scores.device, scores.shape[1]),
                params=key.params,
            )
        )
    return torch.cat(rows)


def _batch(rows: int, length: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=g)  # [B, L] prompt + generated so far
    scores = (torch.randn(rows, VOCAB, generator=g) * 4).to(dtype)  # [B, V]
    return input_ids, scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_rows_three_messages_match_the_op_row_by_row(key: WatermarkKey, dtype: torch.dtype) -> None:
    m1, m2 = random_messages(key.params, 2, seed=1)
    messages = [m1, None, m2]
    proc = XMarkLogitsProcessor(key, messages)
    assert isinstance(proc, LogitsProcessor)
    input_ids, scores = _batch(3, 17, seed=2, dtype=dtype)
    original = scores.clone()
    out = proc(input_ids, scores)
    assert out.shape == scores.shape and out.dtype == dtype
    assert torch.equal(out, _row_by_row(key, messages, input_ids, original))
    assert torch.equal(out[1], original[1])  # None row untouched
    assert (out[0] != original[0]).any() and (out[2] != original[2]).any()
    assert not torch.equal(out[0] - original[0], out[2] - original[2])  # different messages, different masks
    # several decoding steps: the context follows input_ids
    for step in range(3):
        input_ids = torch.cat([input_ids, out.argmax(dim=1, keepdim=True)], dim=1)
        _, scores = _batch(3, 1, seed=10 + step, dtype=dtype)
        out = proc(input_ids, scores.clone())
        assert torch.equal(out, _row_by_row(key, messages, input_ids, scores))


def test_a_shared_watermarker_gives_the_same_scores_and_must_match_the_key(key: WatermarkKey) -> None:
    """A watermarker that outlives the batch (a fused one compiled at start-up) may be passed in;
    one built for another key is refused."""
    messages = [*random_messages(key.params, 2, seed=5), None]
    input_ids, scores = _batch(3, 11, seed=6)
    shared = TorchWatermarker(key)
    expected = XMarkLogitsProcessor(key, messages)(input_ids, scores.clone())
    assert torch.equal(XMarkLogitsProcessor(key, messages, watermarker=shared)(input_ids, scores.clone()), expected)
    other = WatermarkKey.from_secret("another-key-secret-for-the-hf-test", key.params)
    with pytest.raises(ValueError, match="another key"):
        XMarkLogitsProcessor(key, messages, watermarker=TorchWatermarker(other))


def test_num_return_sequences_repeats_each_message(key: WatermarkKey) -> None:
    m1, m2 = random_messages(key.params, 2, seed=3)
    messages = [m1, None, m2]
    proc = XMarkLogitsProcessor(key, messages)
    input_ids, scores = _batch(6, 9, seed=4)  # generate() expands with repeat_interleave: rows 0,0,1,1,2,2
    out = proc(input_ids, scores.clone())
    expanded = [m1, m1, None, None, m2, m2]
    assert torch.equal(out, _row_by_row(key, expanded, input_ids, scores))
    assert torch.equal(out[2:4], scores[2:4])


def test_works_inside_a_logits_processor_list(key: WatermarkKey) -> None:
    from transformers import TemperatureLogitsWarper

    (m,) = random_messages(key.params, 1, seed=5)
    input_ids, scores = _batch(1, 30, seed=6)
    chain = LogitsProcessorList([TemperatureLogitsWarper(0.7), XMarkLogitsProcessor(key, [m])])
    out = chain(input_ids, scores.clone())
    assert torch.allclose(out, _row_by_row(key, [m], input_ids, scores / 0.7))


def test_single_token_prompt_is_padded_with_zero(key: WatermarkKey) -> None:
    (m,) = random_messages(key.params, 1, seed=7)
    input_ids, scores = _batch(2, 1, seed=8)
    out = XMarkLogitsProcessor(key, [m, m])(input_ids, scores.clone())
    padded = torch.cat([torch.zeros(2, 1, dtype=torch.int64), input_ids], dim=1)
    assert torch.equal(out, _row_by_row(key, [m, m], padded, scores))


def test_bad_construction_and_batch(key: WatermarkKey) -> None:
    with pytest.raises(ValueError, match="one message"):
        XMarkLogitsProcessor(key, [])
    other = Message.from_int(3, WatermarkParams(bits=32))
    with pytest.raises(ValueError, match="does not match"):
        XMarkLogitsProcessor(key, [other])
    proc = XMarkLogitsProcessor(key, random_messages(key.params, 2, seed=9))
    input_ids, scores = _batch(3, 5, seed=10)
    with pytest.raises(ValueError, match="batch of 3"):
        proc(input_ids, scores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scores(key: WatermarkKey) -> None:
    messages = [*random_messages(key.params, 2, seed=11), None]
    input_ids, scores = _batch(3, 12, seed=12)
    proc = XMarkLogitsProcessor(key, messages)
    out = proc(input_ids.cuda(), scores.cuda())
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), _row_by_row(key, messages, input_ids, scores))
