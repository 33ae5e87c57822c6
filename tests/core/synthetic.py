"""A seeded synthetic language model and small helpers shared by the xmark_core tests.

The synthetic LM draws i.i.d. logits ``scale * N(0, 1)`` over a vocabulary of ``vocab`` tokens at
every step (seeded ``torch.Generator``), applies the XMark op with one message per batch row
(None = that row is not watermarked) and samples the next token. It stands in for a real model
wherever a statistical property of encoder + decoder is tested; the per-step entropy of its
unwatermarked distribution is measured and reported with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xmark_core import Message, WatermarkKey, WatermarkParams

SECRET = "core-test-secret-0123456789abcdef"
OTHER_SECRET = "another-secret-fedcba9876543210"

# scale 4 over 4096 tokens: mean per-step entropy ~2.9 nats (range ~0.3 .. 4.7), the range of
# sampled LLM text at temperature 1; asserted in test_roundtrip.
LM_VOCAB = 4096
LM_SCALE = 4.0


@dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # int64 [B, 2 + T]: two random context tokens, then T sampled tokens
    entropy: np.ndarray  # float64 [B, T] entropy (nats) of the unwatermarked next-token distribution
    # with top_k > 0: the unwatermarked distribution at temperature 1 of every sampled position
    top_ids: np.ndarray | None = None  # int64 [B, T, K]
    top_logprobs: np.ndarray | None = None  # float64 [B, T, K]
    token_logprobs: np.ndarray | None = None  # float64 [B, T] of the sampled token


def generate(
    key: WatermarkKey,
    messages: Sequence[Message | None],
    steps: int,
    *,
    vocab: int = LM_VOCAB,
    scale: float = LM_SCALE,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    salts: Sequence[int] | None = None,
) -> Generation:
    """Sample ``steps`` tokens per row from the synthetic LM, watermarking row i with messages[i].

    Sampling divides the watermarked logits by ``temperature``; ``top_k`` > 0 also records the
    unwatermarked distribution (temperature 1) that the likelihood decoder scores with. ``salts``:
    each row's salt under a salted ``gumbel`` key (0 by default)."""
    import torch

    from xmark_core import TorchWatermarker

    params = key.params
    gen = torch.Generator().manual_seed(seed)
    batch = len(messages)
    watermarker = TorchWatermarker(key)
    blocks = torch.from_numpy(
        np.stack([m.blocks if m is not None else np.zeros(params.num_blocks, np.int64) for m in messages])
    )  # [B, r]
    if salts is not None:
        blocks = blocks + torch.tensor(list(salts), dtype=torch.int64)[:, None] * params.num_shards
    active = torch.tensor([m is not None for m in messages], dtype=torch.bool)  # [B]
    out = torch.empty((batch, steps + 2), dtype=torch.int64)
    out[:, :2] = torch.randint(0, vocab, (batch, 2), generator=gen)  # [B, 2]
    entropy = torch.empty((batch, steps), dtype=torch.float64)
    top_ids = torch.empty((batch, steps, max(top_k, 1)), dtype=torch.int64)
    top_lp = torch.empty((batch, steps, max(top_k, 1)), dtype=torch.float64)
    own_lp = torch.empty((batch, steps), dtype=torch.float64)
    temperatures = torch.full((batch,), temperature)  # what scheme gumbel samples at (the others ignore it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread is faster, and far faster on a busy machine
    try:
        for t in range(steps):
            logits = torch.randn(batch, vocab, generator=gen) * scale  # [B, V]
            logp = torch.log_softmax(logits, dim=-1)
            entropy[:, t] = -(logp.exp() * logp).sum(-1)
            marked = watermarker.apply(logits, out[:, t : t + 2], blocks, active, temperature=temperatures)
            nxt = torch.multinomial(torch.softmax(marked / temperature, dim=-1), 1, generator=gen)  # [B, 1]
            out[:, t + 2] = nxt[:, 0]
            if top_k > 0:
                best = logp.topk(top_k, dim=-1)  # values, indices: [B, K]
                top_ids[:, t] = best.indices
                top_lp[:, t] = best.values.double()
                own_lp[:, t] = logp.gather(1, nxt)[:, 0].double()
    finally:
        torch.set_num_threads(threads)
    if top_k == 0:
        return Generation(tokens=out.numpy(), entropy=entropy.numpy())
    return Generation(
        tokens=out.numpy(),
        entropy=entropy.numpy(),
        top_ids=top_ids.numpy(),
        top_logprobs=top_lp.numpy(),
        token_logprobs=own_lp.numpy(),
    )


def random_messages(params: WatermarkParams, count: int, seed: int) -> list[Message]:
    """``count`` distinct uniformly random messages (seeded)."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    out: list[Message] = []
    while len(out) < count:
        bits = "".join(map(str, rng.integers(0, 2, params.bits)))
        if bits not in seen:
            seen.add(bits)
            out.append(Message.from_bits(bits, params))
    return out


def bit_accuracy(decoded: str, truth: str) -> float:
    """Fraction of positions where the decoded bit equals the true bit ('?' counts as wrong)."""
    assert len(decoded) == len(truth)
    return sum(a == b for a, b in zip(decoded, truth, strict=True)) / len(truth)
