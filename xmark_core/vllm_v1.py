"""vLLM adapter for the V1 model-runner interface (the CPU runner, and GPU engines on the V1 runner).

Load it with ``vllm serve MODEL --logits-processors xmark_core.vllm_v1:XMarkLogitsProcessor``
(GPU engines on the default V2 runner use ``xmark_core.vllm_v2:XMarkLogitsProcessor``). The
worker reads its secrets at start-up (see ``xmark_core.vllm_common``); each request names its
message and key version in ``vllm_xargs`` / ``SamplingParams.extra_args``.

What vLLM 0.32 does that matters here:

* the persistent batch changes through ``update_state``: removed, then added, then moved
  (one-way moves and swaps); a preempted request is removed and later added again with its
  live output list, so resumption needs nothing special;
* ``n > 1`` arrives as n child requests with copies of the same sampling params: every
  sample carries the caller's message;
* under async scheduling the output lists may end in -1 placeholders; vLLM replaces them before
  the sampler runs, and a row whose context still holds a placeholder is left unwatermarked for
  that step rather than biased with a wrong context;
* prefix caching changes what is computed, not the prompt and output ids we read;
* speculative decoding is refused (vLLM itself refuses custom processors with it, and so does
  this class when it is loaded another way).

Each row is written by its own request's encoder (its key slot: a key version's primary, or under
the configured scheme ``auto`` its companion, ``xmark_core.vllm_common.WorkerKeyring``). A row of a
distortion-free (``gumbel``) slot has its token chosen by keyed sampling at the row's own temperature
(``SamplingParams.temperature``), within its own top-k / top-p / min-p (applied before the choice,
:func:`xmark_core.gumbel.truncate_`), leaving only that token finite; a context the answer already
used is sampled normally (each such row keeps the contexts its answer used, rebuilt from the output
list when a preempted request is added again). A row of a biasing slot gets δ on its evergreen list.
One batch may hold both: each step biases the biasing slots' rows and samples the gumbel slots'
rows, one call of each slot's op (built and compiled at start-up) per slot present; rows are
independent, so neither touches the other's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .gumbel import Truncation
from .vllm_common import (
    ProcessorProfile,
    RequestWatermark,
    ValidatesXMarkArguments,
    build_watermarkers,
    last_two,
    logger,
    nucleus_of,
    parse_request,
    start_worker,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .cpu_op import Step


# misc: where mypy runs (.venv) vLLM is not installed and this base class is Any; unused-ignore: where it is
class XMarkLogitsProcessor(ValidatesXMarkArguments, LogitsProcessor):  # type: ignore[misc, unused-ignore]
    """Adds δ to each watermarked row's evergreen list, with that row's own message and key."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        keyring = self._keyring = start_worker(vllm_config, XMarkLogitsProcessor)
        self._device = device
        self._pin = is_pin_memory and device.type != "cpu"
        # The op runs as one fused pass over the logits instead of the eager op's several (CPU
        # workers: the C++ op of xmark_core.cpu_op; CUDA: a torch.compile'd Triton kernel). It is
        # built here, at start-up, for every key slot, so that no request waits for it;
        # benchmarks/encode_gpu.py measures the GPU ops, `make bench-core` the CPU ones.
        self._watermarkers = build_watermarkers(keyring, vllm_config, device, fused=device.type in ("cpu", "cuda"))
        slot_params = [marker.params for marker in self._watermarkers]
        # Per key slot: whether its encoder samples (gumbel) rather than biases, and which blocks table
        # holds its rows' blocks (one per message width r: an auto version's primary and companion differ)
        self._sampling_slot = np.array([p.distortion_free for p in slot_params], dtype=bool)  # [slots]
        self._samples = bool(self._sampling_slot.any())  # some slot samples
        self._biases = not bool(self._sampling_slot.all())  # some slot biases
        widths = sorted({p.num_blocks for p in slot_params})
        self._table_of = [widths.index(p.num_blocks) for p in slot_params]  # [slots] -> blocks table
        rows = max(1, int(vllm_config.scheduler_config.max_num_seqs))
        # Per batch row (host side; rows move as the persistent batch changes).
        self._blocks = [np.zeros((rows, r), dtype=np.int64) for r in widths]  # per width r: [rows, r] blocks
        self._key = np.zeros(rows, dtype=np.int64)  # [rows] key slot
        self._active = np.zeros(rows, dtype=bool)  # [rows] watermarked?
        self._prompt: list[list[int] | None] = [None] * rows
        self._output: list[list[int] | None] = [None] * rows
        self._context = np.zeros((rows, 2), dtype=np.int64)  # [rows, 2] (x[t-2], x[t-1]) of the step
        self._usable = np.zeros(rows, dtype=bool)  # [rows] active and no placeholder in the context
        self._marked = np.zeros(rows, dtype=bool)  # [rows] scratch: the rows of one key slot this step
        # rows of a gumbel slot: the sampling temperature and the contexts its answer has used
        self._temperature = np.ones(rows, dtype=np.float32)  # [rows]
        self._nucleus = np.zeros((rows, 3), dtype=np.float32)  # [rows, 3]: top_k (0: off), top_p, min_p
        self._nucleus[:, 1] = 1.0
        self._seen: list[set[tuple[int, int]] | None] = [None] * rows
        self._bind_views()
        # CPU workers: the C++ op bound to each biasing key slot's operands (xmark_core.cpu_op), set on
        # the first step for that logits width (None where it does not build: the generic path)
        self._steps: dict[int, Step] | None = None
        self._step_width = -1
        self._profile = ProcessorProfile.from_environment()
        logger.info("XMark watermark (V1 runner) ready with key versions %s", keyring.describe())

    def is_argmax_invariant(self) -> bool:
        return False

    # -- batch bookkeeping -------------------------------------------------------------------

    def _ensure_rows(self, index: int) -> None:
        rows = self._active.shape[0]
        if index < rows:
            return
        grow = max(index + 1, 2 * rows)
        self._blocks = [
            np.concatenate([table, np.zeros((grow - rows, table.shape[1]), np.int64)]) for table in self._blocks
        ]
        self._key = np.concatenate([self._key, np.zeros(grow - rows, np.int64)])
        self._active = np.concatenate([self._active, np.zeros(grow - rows, bool)])
        self._prompt.extend([None] * (grow - rows))
        self._output.extend([None] * (grow - rows))
        self._context = np.concatenate([self._context, np.zeros((grow - rows, 2), np.int64)])
        self._usable = np.concatenate([self._usable, np.zeros(grow - rows, bool)])
        self._marked = np.concatenate([self._marked, np.zeros(grow - rows, bool)])
        self._temperature = np.concatenate([self._temperature, np.ones(grow - rows, np.float32)])
        self._nucleus = np.concatenate(
            [self._nucleus, np.tile(np.array([0.0, 1.0, 0.0], dtype=np.float32), (grow - rows, 1))]
        )
        self._seen.extend([None] * (grow - rows))
        self._bind_views()

    def _bind_views(self) -> None:
        """CPU tensors sharing memory with the host arrays (what the C++ op reads, no copy per step)."""
        self._context_t = torch.from_numpy(self._context)
        self._blocks_t = [torch.from_numpy(table) for table in self._blocks]
        self._active_t = torch.from_numpy(self._active)
        self._usable_t = torch.from_numpy(self._usable)
        self._marked_t = torch.from_numpy(self._marked)

    def _clear(self, index: int) -> None:
        self._active[index] = False
        self._prompt[index] = None
        self._output[index] = None
        self._seen[index] = None

    def _set(
        self,
        index: int,
        mark: RequestWatermark | None,
        prompt: list[int] | None,
        output: list[int],
        temperature: float = 1.0,
        nucleus: tuple[float, float, float] = (0.0, 1.0, 0.0),
    ) -> None:
        self._ensure_rows(index)
        if mark is None:
            self._clear(index)
            return
        slot = mark.key_index
        self._active[index] = True
        self._key[index] = slot
        self._blocks[self._table_of[slot]][index] = mark.blocks
        self._prompt[index] = prompt
        self._output[index] = output
        if self._sampling_slot[slot]:
            self._temperature[index] = temperature
            self._nucleus[index] = nucleus
            self._seen[index] = used_contexts(prompt, output)
        else:
            self._seen[index] = None

    def _move(self, src: int, dst: int) -> None:
        self._ensure_rows(max(src, dst))
        self._active[dst] = self._active[src]
        self._key[dst] = self._key[src]
        for table in self._blocks:
            table[dst] = table[src]
        self._prompt[dst] = self._prompt[src]
        self._output[dst] = self._output[src]
        self._temperature[dst] = self._temperature[src]
        self._nucleus[dst] = self._nucleus[src]
        self._seen[dst] = self._seen[src]
        self._clear(src)

    def _swap(self, a: int, b: int) -> None:
        self._ensure_rows(max(a, b))
        self._active[[a, b]] = self._active[[b, a]]
        self._key[[a, b]] = self._key[[b, a]]
        for table in self._blocks:
            table[[a, b]] = table[[b, a]]
        self._temperature[[a, b]] = self._temperature[[b, a]]
        self._nucleus[[a, b]] = self._nucleus[[b, a]]
        self._prompt[a], self._prompt[b] = self._prompt[b], self._prompt[a]
        self._output[a], self._output[b] = self._output[b], self._output[a]
        self._seen[a], self._seen[b] = self._seen[b], self._seen[a]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        if self._profile is None:
            self._update_state(batch_update)
            return
        start = self._profile.now()
        self._update_state(batch_update)
        self._profile.updated(self._profile.now() - start)

    def _update_state(self, batch_update: BatchUpdate) -> None:
        for index in batch_update.removed:
            if index < self._active.shape[0]:
                self._clear(index)
        for index, params, prompt, output in batch_update.added:
            mark = parse_request(params.extra_args, self._keyring)
            self._set(index, mark, prompt, output, float(params.temperature), nucleus_of(params))
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self._swap(a, b)
            else:
                self._move(a, b)

    # -- sampling step -----------------------------------------------------------------------

    def _to_device(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        """A small host array on the logits' device; pinned + non-blocking on GPUs (no host sync)."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if device.type == "cpu":
            return host
        if not self._pin:
            return host.to(device)
        return host.pin_memory().to(device, non_blocking=True)  # the pinned copy lives until copied

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: float [B, V], row i = persistent-batch row i. Modified in place and returned."""
        if self._profile is None:
            return self._apply(logits)
        watermarked = bool(self._active[: logits.shape[0]].any())
        start = self._profile.now()
        self._apply(logits)
        self._profile.applied(self._profile.now() - start, watermarked=watermarked)
        return logits

    def _cpu_steps(self, logits: torch.Tensor) -> dict[int, Step] | None:
        """The C++ op of each biasing key slot for these logits (float32 on the CPU), else None."""
        if self._device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
            return None
        width = logits.shape[1]
        if width > self._step_width:  # once per worker (the vocabulary does not change)
            biasing = [slot for slot, sampling in enumerate(self._sampling_slot.tolist()) if not sampling]
            steps = {slot: step for slot in biasing if (step := self._watermarkers[slot].cpu_step(width)) is not None}
            self._steps = steps if len(steps) == len(biasing) else None
            self._step_width = width
        return self._steps

    def _apply(self, logits: torch.Tensor) -> torch.Tensor:
        batch = logits.shape[0]
        if batch > self._active.shape[0]:
            self._ensure_rows(batch - 1)
        active = self._active[:batch]
        rows = np.flatnonzero(active)
        if rows.size == 0:
            return logits
        prompt, output = self._prompt, self._output
        # arg-type: an active row always holds its output list (set together with the flag in _set)
        pairs = np.array([last_two(prompt[i], output[i]) for i in rows.tolist()], dtype=np.int64)  # type: ignore[arg-type]
        self._context[rows] = pairs  # [n, 2]; inactive rows keep stale values the op never reads
        mask, mask_t = active, self._active_t
        if pairs.min() < 0:  # placeholders (async scheduling): those rows sit this step out
            usable = self._usable
            usable[:batch] = active
            usable[rows[(pairs < 0).any(axis=1)]] = False
            mask, mask_t = usable[:batch], self._usable_t
        if not self._samples:  # every slot biases
            return self._bias(logits, mask, mask_t)
        if not self._biases:  # every slot samples
            return self._sample(logits, rows, pairs, mask)
        sampling = self._sampling_slot[self._key[:batch]]  # [B] rows of a gumbel slot (stale where inactive)
        keyed = mask & sampling  # [B]
        biased = mask & ~sampling  # [B]
        if biased.any():
            self._bias(logits, biased, None)
        if keyed.any():
            self._sample(logits, rows, pairs, keyed)
        return logits

    def _bias(self, logits: torch.Tensor, mask: np.ndarray, mask_t: torch.Tensor | None) -> torch.Tensor:
        """δ on each row of ``mask`` (bool [B], rows of biasing key slots) with its slot's key and
        blocks. ``mask_t``: a CPU tensor over a buffer whose first B entries are ``mask`` (what the C++
        op reads without a copy), or None."""
        batch = logits.shape[0]
        keys = self._key[:batch]
        present = np.unique(keys[mask]).tolist()  # the key slots of this step's rows
        steps = self._cpu_steps(logits)
        if steps is not None:  # the CPU worker: one call per key slot, on buffers of >= B rows
            for slot in present:
                rows_t = mask_t
                if rows_t is None or len(present) > 1:
                    np.logical_and(mask, keys == slot, out=self._marked[:batch])
                    rows_t = self._marked_t
                steps[slot](logits, self._context_t, self._blocks_t[self._table_of[slot]], rows_t)
            return logits
        device = logits.device
        context_t = self._to_device(self._context[:batch], device)
        for slot in present:
            rows_of_slot = mask if len(present) == 1 else mask & (keys == slot)
            blocks_t = self._to_device(self._blocks[self._table_of[slot]][:batch], device)
            self._watermarkers[slot].apply(
                logits, context_t, blocks_t, self._to_device(rows_of_slot, device), inplace=True
            )
        return logits

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, pairs: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """The rows of ``mask`` (bool [B], usable rows of gumbel key slots): each one's token chosen
        with its slot's key at its temperature; a row whose context its answer already used is
        sampled normally this step. ``rows``/``pairs``: the active rows and their contexts [n, 2]."""
        batch = logits.shape[0]
        keyed = mask.copy()  # [B]
        for row, pair in zip(rows.tolist(), pairs.tolist(), strict=True):
            if not keyed[row]:
                continue  # another slot's row, or a placeholder in its context: sits this step out
            seen = self._seen[row]
            context = (int(pair[0]), int(pair[1]))
            if seen is None:
                continue
            if context in seen:
                keyed[row] = False
            else:
                seen.add(context)
        device = logits.device
        context_t = self._to_device(self._context[:batch], device)
        temperature_t = self._to_device(self._temperature[:batch], device)
        truncation = None
        nucleus = self._nucleus[:batch]
        if ((nucleus[:, 0] > 0) | (nucleus[:, 1] < 1) | (nucleus[:, 2] > 0))[keyed].any():
            table = self._to_device(nucleus, device)
            truncation = Truncation(top_k=table[:, 0].to(torch.int64), top_p=table[:, 1], min_p=table[:, 2])
        keys = self._key[:batch]
        for slot in np.unique(keys[keyed]).tolist():
            rows_of_slot = keyed & (keys == slot)
            blocks_t = self._to_device(self._blocks[self._table_of[slot]][:batch], device)
            self._watermarkers[slot].apply(
                logits,
                context_t,
                blocks_t,
                self._to_device(rows_of_slot, device),
                inplace=True,
                temperature=temperature_t,
                truncation=truncation,
            )
        return logits


def used_contexts(prompt: list[int] | None, output: list[int]) -> set[tuple[int, int]]:
    """The contexts (x[t-2], x[t-1]) of the answer's tokens so far (a request added again after
    preemption brings its output), the prompt's last tokens standing before the first."""
    history = [*(prompt or ()), *output]
    start = len(history) - len(output)
    return {
        (history[t - 2] if t >= 2 else 0, history[t - 1] if t >= 1 else 0)
        for t in range(start, len(history))
        if history[t] >= 0
    }
