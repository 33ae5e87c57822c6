"""The likelihood decoder's forward pass: a causal LM re-reads texts and reports, at every position,
the log-probability of the text's own token and the model's top-K next-token log-probabilities.

Used by the local backend (on its model thread) and by the evaluation (``benchmarks.evaluation``),
so both read a suspect text the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from xmark_core import ModelScores

ScorerDtype = Literal["auto", "float32", "bfloat16"]
# /proc/cpuinfo flags of CPUs that multiply bfloat16 natively (x86 AVX512-BF16 / AMX, Arm BF16)
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def native_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bfloat16 matrix products natively (else they are emulated, slower
    than float32). False where the CPU's flags cannot be read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in {"flags", "features"}:
            return not _NATIVE_BF16_FLAGS.isdisjoint(value.split())
    return False


def resolve_scorer_dtype(choice: ScorerDtype) -> torch.dtype:
    """The dtype of the scoring forward pass: ``auto`` is bfloat16 where the CPU has it natively."""
    import torch

    if choice == "bfloat16" or (choice == "auto" and native_bfloat16()):
        return torch.bfloat16
    return torch.float32


def scoring_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` itself when it already has ``dtype``; else a copy cast to it (SmolLM2-135M in
    bfloat16 is ~270 MB). bfloat16 halves the forward pass on CPUs with native bfloat16; the
    log-probs move by a few hundredths of a nat (the vLLM backend scores in bfloat16 too), which
    changes the decoder's power a little and its calibration not at all."""
    if next(model.parameters()).dtype == dtype:
        return model
    scorer: PreTrainedModel = copy.deepcopy(model)
    scorer.to(dtype=dtype)  # type: ignore[call-arg]  # transformers types .to() through its own wrapper
    scorer.eval()
    return scorer


def score_texts(model: PreTrainedModel, pad_id: int, texts: Sequence[Sequence[int]], top_k: int) -> list[ModelScores]:
    """One forward pass over every text (right-padded); each text's log-probs at temperature 1.

    Row t of a text's scores is the distribution that predicted token t from the tokens before it
    (row 0 has no such distribution: NaN and -inf).
    """
    import torch

    from xmark_core import ModelScores

    width = max(len(ids) for ids in texts)
    # input_ids / attention_mask: [texts, width] int64, right-padded
    input_ids = torch.tensor([list(ids) + [pad_id] * (width - len(ids)) for ids in texts], dtype=torch.long)
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in texts], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [texts, width, V]
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [texts, width, V]
        vocab = int(logprobs.shape[-1])
        k = min(top_k, vocab - 1)
        out = []
        for row, ids in enumerate(texts):
            n = len(ids)
            # row t of the scores is the distribution after tokens < t: logits position t - 1
            predicted = logprobs[row, : n - 1]  # [n - 1, V]
            best = predicted.topk(k, dim=-1)  # [n - 1, K] sorted, descending
            following = input_ids[row, 1:n]  # [n - 1]
            own = predicted.gather(1, following[:, None])[:, 0]  # [n - 1]
            out.append(
                ModelScores(
                    token_logprobs=np.concatenate([[np.nan], own.double().numpy()]),
                    top_ids=np.concatenate([np.zeros((1, k), np.int64), best.indices.numpy()]),
                    top_logprobs=np.concatenate([np.full((1, k), -np.inf), best.values.double().numpy()]),
                    vocab_size=vocab,
                )
            )
    return out
