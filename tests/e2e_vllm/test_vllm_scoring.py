"""Scoring against a real vLLM worker: the prompt log-probs ``VllmBackend.score`` reads from
``/v1/completions`` agree with the same checkpoint run in-process by transformers.

The worker is conftest.py's CPU ``vllm serve`` (with the XMark processor loaded; the scoring
request carries no ``vllm_xargs``, and prompt log-probs come from the raw logits). One text of
about 60 tokens keeps this to a few seconds once the worker is up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from benchmarks.launch import MAX_MODEL_LEN, MODEL_NAME
from service.backends.vllm import VllmBackend
from service.errors import InvalidRequestError

pytestmark = [pytest.mark.vllm, pytest.mark.model]

TOP_K = 20
TEXT = (
    "To install the package, open a terminal and run the installer with administrator rights. Then "
    "restart your computer, open the settings page, and enter the license key that was sent to your "
    "email address. If the key is rejected, contact the support team with your order number."
)
# The CPU worker downcasts the float32 checkpoint to bfloat16 ("Downcasting torch.float32 to
# torch.bfloat16" in its log; vLLM's CPU default), while the reference runs in float32. bfloat16
# keeps 8 significant bits (relative rounding ~2e-3), so logits of magnitude 10-30 drift by
# ~0.05-0.1 through 30 layers. Measured on five ~50-63-token texts: the text's own log-probs differ
# by at most 0.28 nats (mean 0.03-0.04), the top-20 entries (tail tokens included) by at most
# 0.40; every top-1 disagreement is a near tie (the reference's margin at most 0.17 nats), and
# top-1 agreement is 0.93-1.00 per text (0.98 on this one). The same five texts scored by a worker
# started with --dtype float32 agree to < 1e-4 nats with 100 % top-1 agreement, and scoring one row
# off (an alignment bug) is off by 15 nats or more: these bounds catch a misaligned or misparsed
# row and leave room for bfloat16 kernels on other CPUs.
OWN_TOLERANCE = 0.5
OWN_MEAN_TOLERANCE = 0.1
TOP_TOLERANCE = 1.0
MIN_TOP1_AGREEMENT = 0.95


def reference_logprobs(model_path: Any, token_ids: list[int]) -> np.ndarray:
    """float64 [n - 1, V]: log-softmax of the checkpoint's logits (transformers, float32, in-process)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]  # [n - 1, V]
        return torch.log_softmax(logits.float(), dim=-1).double().numpy()


async def test_worker_scores_match_the_checkpoint_run_in_process(vllm_worker: Any, e2e_config: Any) -> None:
    url = str(vllm_worker.health_url).removesuffix("/health")
    # 5x margin and more: scoring about 60 tokens takes a few seconds once the worker is up, and the
    # backend was ready within 20 s here (tests/vllm, the tokenizer loaded, two cores busy)
    backend = VllmBackend([url], MODEL_NAME, e2e_config.model_path, timeout_s=300.0)
    await backend.start()
    try:
        assert await backend.wait_ready(120)
        tokenizer = backend.tokenizer
        assert tokenizer is not None
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        assert 50 <= len(ids) <= 80
        scores = await backend.score(ids, TOP_K)

        n = len(ids)
        assert scores.token_logprobs.shape == (n,) and scores.top_ids.shape == (n, TOP_K)
        assert np.isnan(scores.token_logprobs[0]) and np.all(scores.top_logprobs[0] == -np.inf)
        assert scores.vocab_size == len(tokenizer) == 49152
        assert np.all(np.diff(scores.top_logprobs[1:], axis=1) <= 0)  # likeliest first

        reference = reference_logprobs(e2e_config.model_path, ids)  # row t - 1 predicts token t
        own_reference = reference[np.arange(n - 1), ids[1:]]
        own_diff = np.abs(scores.token_logprobs[1:] - own_reference)
        top_reference = np.take_along_axis(reference, scores.top_ids[1:], axis=1)
        top_diff = np.abs(scores.top_logprobs[1:] - top_reference)
        agreeing = int(np.sum(scores.top_ids[1:, 0] == reference.argmax(axis=1)))
        top1 = agreeing / (n - 1)
        print(
            f"\n{n} tokens: max |own log-prob diff| {own_diff.max():.3g} nats (mean {own_diff.mean():.3g}), "
            f"max |top-{TOP_K} log-prob diff| {top_diff.max():.3g} nats, top-1 agreement {top1:.3f} "
            f"({agreeing}/{n - 1})"
        )
        assert own_diff.max() < OWN_TOLERANCE and own_diff.mean() < OWN_MEAN_TOLERANCE, own_diff
        assert top_diff.max() < TOP_TOLERANCE, top_diff.max()
        assert top1 >= MIN_TOP1_AGREEMENT, top1
        # where the top-1 ids differ, the reference itself all but ties them
        worker_top1 = reference[np.arange(n - 1), scores.top_ids[1:, 0]]
        assert np.all(reference.max(axis=1) - worker_top1 < OWN_TOLERANCE)

        # the worker's own 400 for a text longer than its context, as the gateway reports it
        too_long = (ids * (MAX_MODEL_LEN // n + 2))[: MAX_MODEL_LEN + 10]
        with pytest.raises(InvalidRequestError) as caught:
            await backend.score(too_long, TOP_K)
        assert caught.value.param == "text" and caught.value.code == "context_length_exceeded"
        assert caught.value.message == f"The text has {len(too_long)} tokens; the model reads at most {MAX_MODEL_LEN}"
    finally:
        await backend.close()
