"""vLLM adapter for the V2 model-runner interface (the default runner of GPU engines in vLLM 0.32).

Load it with ``vllm serve MODEL --logits-processors xmark_core.vllm_v2:XMarkLogitsProcessor``
(the CPU engine runs the V1 runner and uses ``xmark_core.vllm_v1:XMarkLogitsProcessor``; the
V2 loader rejects V1-interface classes and vice versa).

Per-request state lives in preallocated device tensors indexed by the runner's request slot:
``add_request`` (host, once per request, also on resumption after preemption) stages the slot's
message blocks, key slot and on/off flag; ``apply_staged_writes`` ships the staged rows in one
non-blocking copy and scatters them on the device. ``apply`` then works on the device only:

* row -> slot through ``ctx.expanded_idx_mapping``;
* context (x[t-2], x[t-1]) = ``req_states.all_token_ids[slot, total_len-2 : total_len]``: the
  runner appends each sampled token to that history on the device (``post_update``) before the
  next step's sampler runs, so async scheduling has no placeholders to wait for, and on
  resumption the history holds prompt + output so far; prefix caching only skips computing
  cached prompt tokens, the runner still stages the whole prompt into the history;
* ``n > 1`` arrives as n requests (slots) sharing copies of the same sampling params;
* one call of the encoder op for the whole batch per key slot present in the batch (a key slot
  is one encoder of one key version, ``xmark_core.vllm_common.WorkerKeyring``: one or two in
  steady state, a rotation in flight adds the old version's).

No Python loop over rows and no device-to-host synchronisation: the only host work per step is
a numpy lookup of which key slots the scheduled request slots use (``ctx.idx_mapping_np``).

Each row is written by its own request's encoder. A row of a distortion-free (``gumbel``) key slot
has its token chosen by keyed sampling at the request's temperature, within its top-k / top-p /
min-p (staged with the blocks, applied before the choice); a context the answer already used is
sampled normally, found on the device by comparing the current context with the contexts of the
slot's generated tokens in ``all_token_ids`` (from ``prompt_len`` on). A row of a biasing key slot
(an ``auto`` version's companion, or every slot of a biasing scheme) gets δ on its evergreen list.
One batch may hold both: each slot's op (built and compiled at start-up) sees its own rows only,
and its own message width (the blocks table is as wide as the widest encoder's r; each op reads its
encoder's first r columns, gathered per row into a contiguous [rows, r]).
Speculative decoding (one row per draft token, drafts not in the committed history) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from .gumbel import Truncation
from .vllm_common import (
    RequestWatermark,
    ValidatesXMarkArguments,
    build_watermarkers,
    logger,
    nucleus_of,
    parse_request,
    start_worker,
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


# misc: where mypy runs (.venv) vLLM is not installed and this base class is Any; unused-ignore: where it is
class XMarkLogitsProcessor(ValidatesXMarkArguments, LogitsProcessor):  # type: ignore[misc, unused-ignore]
    """Adds δ to each watermarked row's evergreen list, with that row's own message and key."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        keyring = self._keyring = start_worker(vllm_config, XMarkLogitsProcessor)
        self._req_states = req_states
        slots, device = req_states.max_num_reqs, req_states.device
        # On CUDA the op runs as one fused Triton kernel (torch.compile), bit-identical to the
        # eager op in one pass over the logits instead of several. It is compiled here, at
        # start-up, for every key slot, so that no request waits for the compilation;
        # benchmarks/encode_gpu.py measures both ops. Other devices run the eager op.
        self._watermarkers = build_watermarkers(keyring, vllm_config, device, fused=device.type == "cuda")
        slot_params = [marker.params for marker in self._watermarkers]
        # Per key slot (host): whether its encoder samples (gumbel) rather than biases, and its r
        self._sampling_slot = np.array([p.distortion_free for p in slot_params], dtype=bool)  # [key slots]
        self._samples = bool(self._sampling_slot.any())
        self._width_of = [p.num_blocks for p in slot_params]  # [key slots]
        r = max(self._width_of)
        # Device tables, one row per request slot.
        self._blocks = torch.zeros((slots, r), dtype=torch.int64, device=device)  # [slots, r]: r of the widest
        self._key = torch.zeros(slots, dtype=torch.int64, device=device)  # [slots] key slot
        self._active = torch.zeros(slots, dtype=torch.bool, device=device)  # [slots]
        # rows of a gumbel key slot: the request's sampling temperature
        self._temperature = torch.ones(slots, dtype=torch.float32, device=device)  # [slots]
        self._staged_temperature: dict[int, float] = {}
        # and its top-k (0: off), top-p and min-p, applied before the choice (host flag: any set)
        self._nucleus = torch.zeros((slots, 3), dtype=torch.float32, device=device)  # [slots, 3]
        self._staged_nucleus: dict[int, tuple[float, float, float]] = {}
        self._truncates_np = np.zeros(slots, dtype=bool)
        # Host mirrors of the on/off flag and key slot, for skipping work without a device sync.
        self._active_np = np.zeros(slots, dtype=bool)
        self._key_np = np.zeros(slots, dtype=np.int64)
        self._staged: dict[int, RequestWatermark | None] = {}
        logger.info("XMark watermark (V2 runner) ready with key versions %s", keyring.describe())

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """Stage slot ``req_idx``'s state (every field is overwritten: slots are recycled)."""
        mark = parse_request(sampling_params.extra_args, self._keyring)
        self._staged[req_idx] = mark
        self._staged_temperature[req_idx] = float(sampling_params.temperature)
        nucleus = self._staged_nucleus[req_idx] = nucleus_of(sampling_params)
        self._active_np[req_idx] = mark is not None
        self._key_np[req_idx] = 0 if mark is None else mark.key_index
        # the nucleus is applied before a gumbel slot's choice only (a biasing slot leaves it to vLLM)
        sampled = mark is not None and bool(self._sampling_slot[mark.key_index])
        self._truncates_np[req_idx] = sampled and nucleus != (0.0, 1.0, 0.0)
        return mark is not None

    def apply_staged_writes(self) -> None:
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        temperatures, self._staged_temperature = self._staged_temperature, {}
        nuclei, self._staged_nucleus = self._staged_nucleus, {}
        slots = np.fromiter(staged, dtype=np.int64, count=len(staged))  # [n]
        r = self._blocks.shape[1]
        table = np.zeros((len(staged), r + 2), dtype=np.int64)  # [n, r + 2]: blocks (zero-padded to r) | key | on
        for row, mark in enumerate(staged.values()):
            if mark is not None:
                table[row, : mark.blocks.shape[0]] = mark.blocks
                table[row, r] = mark.key_index
                table[row, r + 1] = 1
        device = self._blocks.device
        host = torch.from_numpy(np.concatenate([slots[:, None], table], axis=1))  # [n, r + 3]
        if device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps it alive until copied
        packed = host.to(device, non_blocking=True)
        index = packed[:, 0]
        self._blocks.index_copy_(0, index, packed[:, 1 : r + 1])
        self._key.index_copy_(0, index, packed[:, r + 1])
        self._active.index_copy_(0, index, packed[:, r + 2].bool())
        if self._samples:
            staged_t = torch.tensor([temperatures.get(int(s), 1.0) for s in slots], dtype=torch.float32)
            self._temperature.index_copy_(0, index, staged_t.to(device, non_blocking=True))
            staged_n = torch.tensor([nuclei.get(int(s), (0.0, 1.0, 0.0)) for s in slots], dtype=torch.float32)
            self._nucleus.index_copy_(0, index, staged_n.to(device, non_blocking=True))

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """logits: float32 [rows, V]; modified in place and returned."""
        scheduled = ctx.idx_mapping_np[ctx.idx_mapping_np >= 0]
        on = self._active_np[scheduled]
        if not on.any():
            return logits
        key_slots = np.unique(self._key_np[scheduled[on]]).tolist()  # the key slots of this step's rows

        states = self._req_states
        slot = ctx.expanded_idx_mapping.to(torch.int64)  # [rows]
        valid = slot >= 0  # padded rows, if any, map to a negative slot
        slot = slot.clamp(min=0)
        total = states.total_len.gpu.index_select(0, slot).to(torch.int64)  # [rows] tokens so far
        history = states.all_token_ids.gpu  # [slots, max_model_len] int32
        prev1 = history[slot, (total - 1).clamp(min=0)].to(torch.int64) * (total >= 1)  # [rows]
        prev2 = history[slot, (total - 2).clamp(min=0)].to(torch.int64) * (total >= 2)  # [rows]
        context = torch.stack((prev2, prev1), dim=1)  # [rows, 2] (x[t-2], x[t-1])
        active = self._active.index_select(0, slot) & valid  # [rows]
        keyed = temperature = truncation = None
        if self._sampling_slot[key_slots].any():  # some row of a gumbel key slot
            start = states.prompt_len.gpu.index_select(0, slot).to(torch.int64)  # [rows]
            keyed = active & ~_repeated_context(history, slot, start, total, context)  # [rows]
            temperature = self._temperature.index_select(0, slot)  # [rows]
            if self._truncates_np[scheduled[on]].any():  # some gumbel row's top-k / top-p / min-p
                nucleus = self._nucleus.index_select(0, slot)  # [rows, 3]
                truncation = Truncation(top_k=nucleus[:, 0].to(torch.int64), top_p=nucleus[:, 1], min_p=nucleus[:, 2])
        keys = None if len(key_slots) == 1 else self._key.index_select(0, slot)  # [rows]
        for key_index in key_slots:
            sampling = bool(self._sampling_slot[key_index])
            rows = keyed if sampling and keyed is not None else active  # [rows]
            if keys is not None:
                rows = rows & (keys == key_index)
            width = self._width_of[key_index]
            table = self._blocks if width == self._blocks.shape[1] else self._blocks[:, :width]
            blocks = table.index_select(0, slot)  # [rows, r] of this slot's encoder, contiguous
            self._watermarkers[key_index].apply(
                logits,
                context,
                blocks,
                rows,
                inplace=True,
                temperature=temperature if sampling else None,
                truncation=truncation if sampling else None,
            )
        return logits


def _repeated_context(
    history: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, total: torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    """bool [rows]: rows whose current context (x[t-2], x[t-1]) was already the context of one of the
    answer's tokens, at positions start .. total - 1 (start: the prompt's length; positions below 2
    have no full context). history: [slots, L] committed ids; slot, start, total: int64 [rows]."""
    width = history.shape[1]
    positions = torch.arange(2, width, device=history.device)  # [L - 2] token positions j
    rows = history.index_select(0, slot).to(torch.int64)  # [rows, L]
    prev2, prev1 = rows[:, :-2], rows[:, 1:-1]  # [rows, L - 2]: the context of the token at j
    window = (positions[None, :] >= start[:, None]) & (positions[None, :] < total[:, None])  # [rows, L - 2]
    same = (prev2 == context[:, :1]) & (prev1 == context[:, 1:])
    return (same & window).any(dim=1)
