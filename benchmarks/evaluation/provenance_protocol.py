"""The provenance corpus's watermark: what ``provenance_corpus --scheme`` writes the answers under and
records in ``protocol.json``, and what the provenance evaluations read back from it (no vLLM here)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from xmark_core import WatermarkParams

from .config import GenSpec

BITS, NUM_KEYS, DELTA = 32, 4, 2.0
# the watermark an author's answer carries, per --scheme: (scheme, keys, bits per block, salts)
SCHEMES: dict[str, tuple[str, int, int, int]] = {
    "xmark": ("xmark", NUM_KEYS, 2, 1),
    "gumbel": ("gumbel", 1, 8, 16),
}


def watermark_spec(temperature: float, scheme: str = "xmark") -> GenSpec:
    name, keys, block_bits, salts = SCHEMES[scheme]
    return GenSpec(name, BITS, keys, DELTA, temperature, block_bits=block_bits, salts=salts)


def salt_of(author: int, seed: int, salts: int) -> int:
    """The salt an author's answer is written under (0 without salts): drawn at random from the seed,
    as the gateway's consecutive salts look to a reader of one answer."""
    return random.Random(f"xmark-provenance/{seed}/salt/{author}").randrange(salts) if salts > 1 else 0


def watermark_protocol(scheme: str) -> dict[str, Any]:
    """The answers' watermark as ``protocol.json`` records it (the xmark corpus's record is unchanged, so
    its earlier caches stay valid); the provenance evaluation reads its parameters from it."""
    name, keys, block_bits, salts = SCHEMES[scheme]
    out: dict[str, Any] = {"bits": BITS, "block_bits": block_bits, "num_keys": keys, "delta": DELTA}
    if scheme != "xmark":
        out.update(scheme=name, salts=salts)
    return out


def corpus_params(folder: Path) -> WatermarkParams:
    """The watermark the corpus's answers carry, as its ``protocol.json`` records it (``provenance_corpus
    --scheme``); a corpus without the record is the xmark one (b = 32, k = 4, δ = 2, d = 2)."""
    path = folder / "protocol.json"
    held = json.loads(path.read_text("utf-8")).get("watermark", {}) if path.is_file() else {}
    return WatermarkParams(
        bits=int(held.get("bits", 32)),
        block_bits=int(held.get("block_bits", 2)),
        num_keys=int(held.get("num_keys", 4)),
        delta=float(held.get("delta", 2.0)),
        scheme=held.get("scheme", "xmark"),
        salts=int(held.get("salts", 1)),
    )
