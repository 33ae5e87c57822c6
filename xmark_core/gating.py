"""The entropy rule (``WatermarkParams.min_entropy``): which rows of a decoding step the bias may touch.

A position is biased only where the model's min-entropy there, -log of its top token's probability
at temperature 1 before the bias, is at least ``min_entropy`` nats. Every encoder path (the eager
and fused ops, the C++ CPU op, both vLLM processors) turns the other rows off in its ``active``
vector through :func:`gate`, and the likelihood decoder reads the same quantity from the model's
top log-probability (``xmark_core.likelihood``).
"""

from __future__ import annotations

import torch

from .params import WatermarkParams


def open_rows(logits: torch.Tensor, min_entropy: float) -> torch.Tensor:
    """bool [B]: rows whose min-entropy at temperature 1, logsumexp(logits) - max(logits), is at
    least ``min_entropy`` nats. Float32 on the logits' device (two passes over [B, V], no
    host-device synchronisation)."""
    wide = logits.float()
    return (torch.logsumexp(wide, dim=1) - wide.amax(dim=1)) >= min_entropy


def gate(logits: torch.Tensor, active: torch.Tensor, params: WatermarkParams) -> torch.Tensor:
    """bool [B]: the first B entries of ``active`` with the rows the entropy rule skips turned off
    (``active`` itself when the rule is off)."""
    if not params.gated:
        return active
    return active[: logits.shape[0]] & open_rows(logits, params.min_entropy)
