"""Chunked prefill: a prompt's KV cache built a slice at a time, outside the batched ``generate``.

A long prompt read in one forward pass holds the model for as long as that pass takes; nothing
can stop it, and every other request waits. Read in slices of at most a token budget per model
step (vLLM's ``max_num_batched_tokens``), the worker can run a decoding step of the batch on the
model between two slices, and drop a prompt whose client left at the next slice.

Each job's prompt but its last token goes into a cache of its own (``Job.cache``, one row, no
padding, positions 0..n-2). The batch's ``generate`` call then gets every row's cache, left-padded
to the batch's width as its ``input_ids`` are, and reads only the last prompt token itself. The
padded positions are masked out by the attention mask, so the cache equals, up to float
rounding, the one a single forward pass over the left-padded prompts would have built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from service.backends.batch import Job

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# the default token budget of one prefill slice (XMARK_PREFILL_CHUNK_TOKENS)
DEFAULT_PREFILL_CHUNK_TOKENS = 512


def prefill_target(job: Job) -> int:
    """How many prompt tokens go into the job's cache (all but the last, which ``generate`` reads)."""
    return max(0, len(job.prompt_ids) - 1)


def prefill_done(job: Job) -> bool:
    return job.prefilled >= prefill_target(job)


def release(job: Job) -> None:
    """Free the job's cache (it was cancelled, or its batch ran or failed); ``slices`` keeps
    counting what was read."""
    job.cache = None
    job.prefilled = 0


def prefill_slice(model: PreTrainedModel, jobs: Sequence[Job], budget: int) -> int:
    """Read at most ``budget`` prompt tokens of ``jobs`` (in order; cancelled jobs skipped) into
    their caches: one slice, i.e. one model step's worth. Returns the tokens read."""
    from transformers import DynamicCache

    read = 0
    for job in jobs:
        if read >= budget:
            break
        if job.cancelled.is_set() or prefill_done(job):
            continue
        start = job.prefilled
        take = min(budget - read, prefill_target(job) - start)
        if job.cache is None:
            job.cache = DynamicCache(config=model.config)
        ids = torch.tensor([job.prompt_ids[start : start + take]], dtype=torch.long)  # [1, take] int64
        with torch.inference_mode():
            # positions continue from the cache's length; only the last position's logits are made
            model(input_ids=ids, past_key_values=job.cache, use_cache=True, logits_to_keep=1)
        job.prefilled = start + take
        job.slices += 1
        read += take
    return read


def batch_cache(model: PreTrainedModel, jobs: Sequence[Job], width: int) -> Any:
    """The ``past_key_values`` of a ``generate`` call over ``jobs`` (each ``job.rows`` rows) whose
    ``input_ids`` are ``width`` columns wide, left-padded: every row's cache, left-padded to
    ``width - 1`` positions. None where no job has anything cached."""
    from transformers import DynamicCache

    if not all(prefill_done(job) for job in jobs):
        raise RuntimeError("a prompt of the batch was not read to its end")
    if width <= 1 or all(job.cache is None for job in jobs):
        return None
    if len(jobs) == 1 and jobs[0].rows == 1 and prefill_target(jobs[0]) == width - 1:
        return jobs[0].cache  # one row, no padding: the cache as it is
    template = next(job.cache for job in jobs if job.cache is not None)
    layers = []
    for index, layer in enumerate(template.layers):
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for job in jobs:
            if job.cache is None:  # a one-token prompt: all padding here
                shape = (1, layer.keys.shape[1], 0, layer.keys.shape[3])
                key = value = layer.keys.new_zeros(shape)
            else:
                key, value = job.cache.layers[index].keys, job.cache.layers[index].values
            # key / value: [1, kv_heads, cached, head_dim] -> [rows, kv_heads, width - 1, head_dim]
            pad = (0, 0, width - 1 - key.shape[2], 0)
            keys.append(torch.nn.functional.pad(key, pad).expand(job.rows, -1, -1, -1))
            values.append(torch.nn.functional.pad(value, pad).expand(job.rows, -1, -1, -1))
        layers.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=layers, config=model.config)
