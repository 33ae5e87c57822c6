"""Text edits a watermark must survive: copy-paste mixing, random word deletion, random token substitution."""

from __future__ import annotations

import random


def copy_paste(token_ids: list[int], source_ids: list[int], fraction: float, rng: random.Random) -> list[int]:
    """Replace one contiguous span of round(fraction * n) tokens by the same span of an unwatermarked text.

    source_ids is the unwatermarked completion of the same prompt by the same model, so the mixed
    text reads like the model's own output and keeps the length of the original.
    """
    n = len(token_ids)
    span = min(n, round(fraction * n))
    if span == 0:
        return list(token_ids)
    if len(source_ids) < n:
        raise ValueError("the unwatermarked source is shorter than the watermarked text")
    start = rng.randrange(0, n - span + 1)
    return token_ids[:start] + source_ids[start : start + span] + token_ids[start + span :]


def delete_words(text: str, rate: float, rng: random.Random) -> str:
    """Delete round(rate * words) randomly chosen whitespace-separated words."""
    words = text.split()
    drop = set(rng.sample(range(len(words)), min(len(words), round(rate * len(words)))))
    return " ".join(w for i, w in enumerate(words) if i not in drop)


def substitute_tokens(
    token_ids: list[int], rate: float, vocab_low: int, vocab_high: int, rng: random.Random
) -> list[int]:
    """Replace round(rate * n) randomly chosen tokens by uniformly random ids in [vocab_low, vocab_high)."""
    out = list(token_ids)
    for i in rng.sample(range(len(out)), min(len(out), round(rate * len(out)))):
        out[i] = rng.randrange(vocab_low, vocab_high)
    return out
