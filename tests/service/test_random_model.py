"""The test model (``xmark build-test-model``): deterministic, loadable, servable, rebuilt only when needed."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from service import random_model as test_model_module
from service.backends.base import ChatTurn, GenerationRequest, WatermarkStamp
from service.backends.local import LocalBackend
from service.cli import main
from service.model_store import MANIFEST_NAME, ModelStoreError
from service.random_model import (
    SPECIAL_TOKENS,
    TEST_MODEL_NAME,
    VOCAB_SIZE,
    build_test_model,
    verify_test_model,
)
from tests.conftest import checkpoint_path
from xmark_core import Message, WatermarkKey, WatermarkParams


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_model(tmp_path_factory.mktemp("test-model") / TEST_MODEL_NAME)


@pytest.fixture(scope="module")
def tokenizer(built: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built, local_files_only=True)


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    again = build_test_model(tmp_path / TEST_MODEL_NAME)
    first, second = _file_bytes(built), _file_bytes(again)
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", MANIFEST_NAME} <= set(first)
    assert first == second
    # nothing half-built is left beside the checkpoint
    assert [p.name for p in again.parent.iterdir()] == [TEST_MODEL_NAME]


def test_checkpoint_loads_as_a_standard_llama(built: Path, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (128, 256, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 64)
    assert config.tie_word_embeddings and config.max_position_embeddings == 2048
    assert len(tokenizer) == VOCAB_SIZE == config.vocab_size
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tokenizer_round_trips_any_text(tokenizer: Any) -> None:
    text = "Grüße, 世界! Привет 🌍🚀\n\ttabs  e\u0301 \u200b\x00 done <|im_end|> isn't special in text"
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tokenizer.decode(ids) == text
    assert max(ids) < VOCAB_SIZE


def test_chat_template_renders_chatml(tokenizer: Any) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert prompt == rendered + "<|im_start|>assistant\n"


def test_next_token_distributions_are_spread_but_not_uniform(built: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built, local_files_only=True)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB_SIZE, (4, 64), generator=generator)  # [batch, positions] int64
    with torch.inference_mode():
        log_probs = model(ids).logits.float().log_softmax(-1)  # [batch, positions, vocab]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [batch, positions] nats
    # measured ≈ 7.7 nats; uniform would be ln 4096 ≈ 8.32
    assert 0.8 * math.log(VOCAB_SIZE) < float(entropy.mean()) < math.log(VOCAB_SIZE) - 0.3


async def test_local_backend_generates_with_a_watermark(built: Path) -> None:
    backend = LocalBackend(built, TEST_MODEL_NAME, threads=1)
    await backend.start()
    try:
        assert await backend.wait_ready(60), backend.load_error
        params = WatermarkParams(bits=16)
        stamp = WatermarkStamp(WatermarkKey.from_secret("test-model-secret", params), Message.from_int(0xBEEF, params))
        request = GenerationRequest((ChatTurn("user", "Tell me about the river."),), max_tokens=20, seed=11)
        result = await backend.generate(request, stamp)
    finally:
        await backend.close()
    (choice,) = result.choices
    assert choice.completion_tokens == 20 and choice.finish_reason == "length"
    assert choice.text
    assert result.prompt_tokens > 0


@pytest.mark.model  # compares with the SmolLM2 checkpoint (make model)
def test_vocabulary_differs_from_smollm2(tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    smollm2 = AutoTokenizer.from_pretrained(checkpoint_path(), local_files_only=True)
    assert len(smollm2) != len(tokenizer)
    text = "The miller walked across the frozen river to the far bank."
    assert smollm2.encode(text, add_special_tokens=False) != tokenizer.encode(text, add_special_tokens=False)
    assert set(smollm2.get_vocab().items()) != set(tokenizer.get_vocab().items())


def test_a_verified_checkpoint_is_not_rebuilt(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamps = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}

    def forbidden(*_: Any, **__: Any) -> None:
        raise AssertionError("a verified test model must not be rebuilt")

    monkeypatch.setattr(test_model_module, "write_test_model", forbidden)
    assert build_test_model(built) == built
    assert main(["build-test-model", "--path", str(built)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == stamps


def test_a_corrupt_or_outdated_checkpoint_is_rebuilt(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / TEST_MODEL_NAME
    shutil.copytree(built, copy)
    weights = copy / "model.safetensors"
    corrupted = bytearray(weights.read_bytes())
    corrupted[-1] ^= 0xFF
    weights.write_bytes(bytes(corrupted))
    assert not verify_test_model(copy)
    assert build_test_model(copy) == copy
    assert _file_bytes(copy) == _file_bytes(built)

    # the files verify, but a newer recipe would build other bytes: rebuilt too
    monkeypatch.setattr(test_model_module, "RECIPE_VERSION", test_model_module.RECIPE_VERSION + 1)
    assert not verify_test_model(copy)
    build_test_model(copy)
    assert verify_test_model(copy)


def test_a_directory_it_did_not_build_is_never_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "someone-elses"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ModelStoreError, match="not a test model built here"):
        build_test_model(other)
    assert main(["build-test-model", "--path", str(other)]) == 1
    assert "not replacing it" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
