"""Grouped-query attention read in place (service.backends.attention) computes what transformers'
``sdpa`` computes: the same logits on a left-padded batch, the same greedy tokens through a KV
cache, and static-cache generation as the evaluation runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from service.backends.attention import GROUPED_SDPA, use_grouped_sdpa
from tests.conftest import checkpoint_path

pytestmark = pytest.mark.model

PROMPTS = (
    "Hi",
    "Write two sentences about a lighthouse keeper who collects letters.",
    "Continue the following text: The old railway station had been closed for twenty years.",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as the local backend runs beside the suite's other worker (every core but
    one): a second thread spins at its barriers while the other worker holds the core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(checkpoint_path(), local_files_only=True)
    tok.padding_side = "left"
    return tok


def _model() -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(checkpoint_path(), local_files_only=True, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def models() -> tuple[PreTrainedModel, PreTrainedModel]:
    plain, grouped = _model(), _model()
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads  # SmolLM2: 3 of 9
    assert use_grouped_sdpa(grouped) is True
    assert grouped.config._attn_implementation == GROUPED_SDPA
    assert plain.config._attn_implementation == "sdpa"
    return plain, grouped


def _batch(tokenizer: PreTrainedTokenizerBase) -> dict[str, torch.Tensor]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in PROMPTS]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert int(enc["attention_mask"].sum(1).min()) < enc["input_ids"].shape[1]  # really padded
    return dict(enc)


def test_padded_batch_logits_are_the_same(
    models: tuple[PreTrainedModel, PreTrainedModel], tokenizer: PreTrainedTokenizerBase
) -> None:
    plain, grouped = models
    enc = _batch(tokenizer)
    mask = enc["attention_mask"].bool()
    with torch.inference_mode():
        a = plain(**enc).logits[mask]  # [real tokens, V]
        b = grouped(**enc).logits[mask]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_through_the_cache_is_the_same(
    models: tuple[PreTrainedModel, PreTrainedModel], tokenizer: PreTrainedTokenizerBase, cache: str
) -> None:
    plain, grouped = models
    enc = _batch(tokenizer)
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.inference_mode():
        expected = plain.generate(**enc, **kwargs)
        got = grouped.generate(**enc, **kwargs, cache_implementation=cache)
    assert torch.equal(got, expected)


def test_a_model_without_grouped_heads_is_left_alone() -> None:
    model = _model()
    model.config.num_key_value_heads = model.config.num_attention_heads
    assert use_grouped_sdpa(model) is False
    assert model.config._attn_implementation == "sdpa"
