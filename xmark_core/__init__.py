"""XMark: multi-bit watermarking of LLM text (encoder, cTMM and likelihood decoders, calibrated tests,
attribution).

The decoder side needs numpy only. The torch encoder op (``apply_watermark``,
``TorchWatermarker``) is imported on first use, and the transformers adapter lives in
``xmark_core.hf``, so ``import xmark_core`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .attribution import Attribution, CandidateScore, CandidateSet, attribute
from .decoder import DecodeResult, decode, null_inclusion_probability
from .detect import DEFAULT_ALPHA, Detection, detect, warm_null_cache
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    DecodeInputError,
    MessageError,
    MessageSpaceExhausted,
    ParamsError,
    RequestArgumentError,
    SecretConfigError,
    WorkerConfigError,
    XMarkError,
)
from .gumbel_likelihood import GumbelLikelihoodResult, attribute_gumbel_likelihood, score_gumbel_text
from .hashing import block_index, context_multipliers, shard, token_codes
from .identity import identity_p
from .keys import WatermarkKey
from .likelihood import (
    DEFAULT_EDIT_RATE,
    LikelihoodAttribution,
    LikelihoodResult,
    ModelScores,
    attribute_likelihood,
    score_text,
)
from .message import Message, MessageAllocator, allocate_message, bits_to_blocks
from .naming import DEFAULT_MIN_CONFIDENCE, Multiplicity, NamingRule
from .params import SCHEMES, WatermarkParams

if TYPE_CHECKING:
    from .encoder import TorchWatermarker, apply_watermark

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_EDIT_RATE",
    "DEFAULT_MIN_CONFIDENCE",
    "SCHEMES",
    "ArgumentError",
    "ArgumentTypeError",
    "Attribution",
    "CandidateScore",
    "CandidateSet",
    "DecodeInputError",
    "DecodeResult",
    "Detection",
    "GumbelLikelihoodResult",
    "LikelihoodAttribution",
    "LikelihoodResult",
    "Message",
    "MessageAllocator",
    "MessageError",
    "MessageSpaceExhausted",
    "ModelScores",
    "Multiplicity",
    "NamingRule",
    "ParamsError",
    "RequestArgumentError",
    "SecretConfigError",
    "TorchWatermarker",
    "WatermarkKey",
    "WatermarkParams",
    "WorkerConfigError",
    "XMarkError",
    "allocate_message",
    "apply_watermark",
    "attribute",
    "attribute_gumbel_likelihood",
    "attribute_likelihood",
    "bits_to_blocks",
    "block_index",
    "context_multipliers",
    "decode",
    "detect",
    "identity_p",
    "null_inclusion_probability",
    "score_gumbel_text",
    "score_text",
    "shard",
    "token_codes",
    "warm_null_cache",
]

_LAZY = {"apply_watermark": "encoder", "TorchWatermarker": "encoder"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
