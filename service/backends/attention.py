"""Grouped-query attention that reads the KV cache in place.

SmolLM2-135M has 9 query heads over 3 key/value heads. transformers' ``sdpa`` attention passes
that grouping to PyTorch's ``scaled_dot_product_attention`` (``enable_gqa``) only when no
attention mask is given; a left-padded batch has one, so every layer of every decoding step copies
its whole key and value cache three times over (``repeat_kv``) before attending. On this machine's
CPU the evaluation's batch of 64 rows of 150 tokens took 139 s with the copy and 77.5 s with this
and a static cache.

``use_grouped_sdpa`` switches a loaded model to the same kernel with ``enable_gqa`` always set:
the same attention, computed from the same tensors (the logits of a padded batch are identical,
``tests/service/backends/test_attention.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

GROUPED_SDPA = "sdpa_grouped"


def _grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` for decoder models without position bias, with
    the key/value heads shared by their query groups instead of repeated.

    query: [batch, heads, q_len, head_dim]; key, value: [batch, kv_heads, kv_len, head_dim];
    attention_mask: None or [batch, 1, q_len, kv_len] (bool or additive float).
    Returns [batch, q_len, heads, head_dim] and no attention weights.
    """
    import torch

    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{GROUPED_SDPA} serves decoder models without position bias")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length = query.shape[2]
    # as transformers does: the causal flag only for a prefill without a mask; a prefill into an
    # empty static cache attends to its own keys only
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length, :], value[:, :, :q_length, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: PreTrainedModel) -> bool:
    """Serve ``model``'s attention with ``_grouped_sdpa_forward`` where it groups its heads and
    uses ``sdpa`` now; True when it does (the scorer's copy of the model inherits the choice)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or kv_heads == heads:
        return False
    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return True
