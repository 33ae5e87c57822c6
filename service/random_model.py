"""Build ``xmark-test-bpe``, a small TEST model with a tokenizer of its own, from nothing but this repo.

The gateway serves several models, and ``/trace`` tries each served model's tokenizer. Testing that
needs a second model whose token ids differ from SmolLM2's, and none may come from a model hub. So
the project builds one: a byte-level BPE tokenizer trained on a fixed corpus shipped in
``service/data/test_model_corpus.txt`` (4,096 tokens against SmolLM2's 49,152), and a two-layer
``LlamaForCausalLM`` with **random weights**. Its text is gibberish; it exists so that two
tokenizers can be served and traced, by transformers and by vLLM alike. Never use it for quality.

The build is deterministic: the same code, corpus and library versions give byte-identical
``model.safetensors`` and ``tokenizer.json`` (the weights come from a seeded generator of their own,
filled in parameter-name order, so neither the global torch seed nor transformers' init order
matters). Like ``service.model_store``, it writes into a staging directory, records the SHA-256 of
every file in a manifest and renames the directory into place; a checkpoint whose manifest verifies
and names the current recipe is left alone, anything else is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.model_store import MANIFEST_NAME, ModelStoreError, offline_env, verify_checkpoint, write_manifest

if TYPE_CHECKING:
    from service.config import Settings

logger = logging.getLogger(__name__)

TEST_MODEL_NAME = "xmark-test-bpe"
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "test_model_corpus.txt"
# Bumped whenever the code below would build different bytes from the same corpus: a checkpoint
# built by an older recipe then fails verification and is rebuilt.
RECIPE_VERSION = 1
SEED = 20_241_126

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)  # ids 0, 1, 2, in this order
VOCAB_SIZE = 4096
# The embedding matrix is padded to a multiple of this (vLLM and matmul kernels prefer it).
VOCAB_MULTIPLE = 64

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 64  # a head size vLLM's CPU attention supports; 2 × 64 = HIDDEN_SIZE
MAX_POSITIONS = 2048
# Standard deviation of the (tied) embedding. The hidden state reaching the head is RMS-normalised,
# so the logits have std ≈ sqrt(HIDDEN_SIZE) · EMBEDDING_STD ≈ 1.1: next-token entropy ≈ 7.7 nats
# of ln 4096 ≈ 8.3, spread but not uniform, so the watermark has room to act. The layers get
# std 1/sqrt(fan_in), which keeps their output well above the embedding in the residual stream;
# otherwise the tied head would mostly predict the current token again.
EMBEDDING_STD = 0.1

# ChatML, as SmolLM2 writes it, without a default system turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_test_model_path(settings: Settings) -> Path:
    """Where ``xmark build-test-model`` puts the checkpoint by default: beside the served model."""
    return settings.resolved_models_dir / TEST_MODEL_NAME


def _corpus_sha256() -> str:
    try:
        return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()
    except OSError as exc:
        raise ModelStoreError(f"the test model's corpus {CORPUS_PATH} is not readable: {exc}") from exc


def _recipe() -> dict[str, str]:
    """The manifest's ``source``: what a checkpoint was built from, compared on every verify."""
    return {
        # the recipe's name since its first build (the module was service/test_model.py then): a
        # checkpoint built before the rename still verifies
        "builder": "service.test_model",
        "recipe": str(RECIPE_VERSION),
        "seed": str(SEED),
        "corpus": CORPUS_PATH.name,
        "corpus_sha256": _corpus_sha256(),
    }


def _manifest_source(target: Path) -> object:
    try:
        manifest = json.loads((target / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest.get("source") if isinstance(manifest, dict) else None


def verify_test_model(target: Path) -> bool:
    """True when every file at ``target`` matches its manifest and the manifest names this recipe."""
    return verify_checkpoint(target).ok and _manifest_source(target) == _recipe()


def _replaceable(target: Path) -> bool:
    """Whether ``target`` may be replaced by a fresh build: absent, an empty directory, or a
    checkpoint this module built (corrupt or of an older recipe). ``--path`` can name any
    directory, and a rebuild deletes what was there: never someone's data or the served model."""
    if not target.exists():
        return True
    if target.is_dir() and not any(target.iterdir()):
        return True
    source = _manifest_source(target)
    return isinstance(source, dict) and source.get("builder") == _recipe()["builder"]


def train_tokenizer() -> Any:
    """Train the byte-level BPE on the shipped corpus; returns a ``tokenizers.Tokenizer``.

    No normalizer: the byte-level pre-tokenizer maps every byte to a symbol, so any text, in any
    script, encodes and decodes back to itself exactly. The corpus is too small for 4,096 merges
    that each occur twice, so merges of pairs seen once are allowed; ties between equally frequent
    pairs are broken by the trainer's fixed pair order, which keeps the result deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise ModelStoreError(f"special token {token} did not get id {expected_id}")
    return tokenizer


def _padded(size: int) -> int:
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _init_weights(model: Any) -> None:
    """Fill every parameter from one seeded generator, in parameter-name order.

    Norm weights are 1; the tied embedding has std ``EMBEDDING_STD``; every other matrix
    ``[out, in]`` has std 1/sqrt(in). Parameters are visited by name (tied ones once), so the bytes
    depend on the architecture and the seed only.
    """
    import torch

    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                parameter.normal_(0.0, EMBEDDING_STD, generator=generator)
            elif parameter.dim() == 2:  # [out_features, in_features]
                parameter.normal_(0.0, 1.0 / math.sqrt(parameter.shape[1]), generator=generator)
            else:
                raise ModelStoreError(f"no initialisation rule for parameter {name}")


def write_test_model(directory: Path) -> None:
    """Write the tokenizer and the random-weight model into ``directory`` (which must exist)."""
    offline_env()
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    pad_id, eos_id = SPECIAL_TOKENS.index(END_OF_TEXT), SPECIAL_TOKENS.index(IM_END)
    config = LlamaConfig(
        vocab_size=_padded(len(tokenizer)),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)  # float32, torch's default dtype
    _init_weights(model)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    model.config.name_or_path = ""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _install(target: Path) -> None:
    """Build in a staging directory beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".xmark-test-model-", dir=target.parent) as work:
        work_dir = Path(work)
        staging = work_dir / "checkpoint"
        staging.mkdir()
        write_test_model(staging)
        write_manifest(staging, _recipe())
        if target.exists():
            target.rename(work_dir / "previous")  # removed with the work directory
        staging.rename(target)
    logger.info("test model installed at %s", target)


def build_test_model(target: Path) -> Path:
    """Make the test model available at ``target`` and return it; a verifying one is left alone."""
    if verify_test_model(target):
        logger.info("test model at %s verified", target)
        return target
    if not _replaceable(target):
        raise ModelStoreError(f"{target} exists and is not a test model built here; not replacing it")
    if target.exists():
        logger.warning("test model at %s does not verify; rebuilding", target)
    _install(target)
    if not verify_test_model(target):
        raise ModelStoreError(f"freshly built test model at {target} failed verification")
    return target
