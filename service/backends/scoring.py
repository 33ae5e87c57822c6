"""The likelihood decoder's forward pass: a causal LM re-reads texts and reports, at every position,
the log-probability of the text's own token and the model's top-K next-token log-probabilities.

Used by the local backend (on its model thread) and by the evaluation (``benchmarks.evaluation``),
so both read a suspect text the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from xmark_core import ModelScores


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
