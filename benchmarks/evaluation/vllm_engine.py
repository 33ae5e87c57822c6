"""Batched generation on the vLLM engine (the CPU build here), when vLLM is installed.

The gateway's own vLLM processor (``xmark_core.vllm_v1``) serves one parameter set with secrets
from the worker's environment; an evaluation needs many settings (MPAC, LoSo, XMark at several
b, k and δ) in one engine, with the evaluation's public keys. ``EvalLogitsProcessor`` is that
variant: each request names its setting and message in ``SamplingParams.extra_args``
(``xmark_eval``), the processor derives the setting's key from the run seed exactly as
``population.evaluation_key`` does and applies the same ``xmark_core`` op as the transformers path
(``TorchWatermarker``), so a row's watermark is the same whichever engine generated it.

What matches the transformers path (``generation.py``):

* the watermark bias is added to the raw logits before vLLM divides by the temperature (custom
  processors are not argmax-invariant, so vLLM applies them before the temperature);
* every special token is suppressed (set to -inf) and EOS is ignored, so each completion has
  exactly ``max_new_tokens`` tokens (the paper's min = max);
* multinomial sampling over the full vocabulary (top-k and top-p off), a seed per row;
* a row's sampling options (``RowJob.options``: ``frequency_penalty``, ``presence_penalty``,
  ``logit_bias``) go to ``SamplingParams``, which applies them itself: ``logit_bias`` as a builtin
  processor and the penalties after every processor, all before the temperature; on the biasing
  schemes' logits every one of them is a sum, so the order does not matter;
* the NLL of each sampled token under the unmodified model comes from vLLM's ``raw_logprobs``
  (log-softmax of the model's logits before any processor), in float32.

Sampling noise differs between engines (different generators), so the two paths give different
texts from the same seed; each is reproducible on its own.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from xmark_core import WatermarkKey, WatermarkParams
from xmark_core.encoder import TorchWatermarker
from xmark_core.encoders import companion_key
from xmark_core.gumbel import salted
from xmark_core.message import bits_to_blocks
from xmark_core.vllm_common import last_two, refuse_speculative_decoding

from .config import engine_options
from .generation import RowJob, RowResult, chat_prompt
from .population import evaluation_key, evaluation_secret

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import LLM, SamplingParams
    from vllm.config import VllmConfig

XARG = "xmark_eval"
PROCESSOR = "benchmarks.evaluation.vllm_engine:EvalLogitsProcessor"


def row_key(params: WatermarkParams, seed: int, companion: bool) -> WatermarkKey:
    """The key a row is written under: the evaluation key of ``params``, or with ``companion`` the
    companion key of the evaluation secret (a per-request key version's biasing encoder, as
    ``xmark_core.encoders.encoder_keys`` derives it)."""
    return companion_key(evaluation_secret(seed), params) if companion else evaluation_key(params, seed)


def request_args(job: RowJob, seed: int, suppress: Sequence[int]) -> dict[str, Any]:
    """The ``extra_args`` of one row: its setting (scheme, b, k, δ, run seed, companion), message and
    suppressed ids."""
    args: dict[str, Any] = {"suppress": list(suppress)}
    if job.key is not None and job.message is not None:
        p = job.key.params
        args.update(
            scheme=p.scheme,
            bits=p.bits,
            block_bits=p.block_bits,
            num_keys=p.num_keys,
            delta=float(p.delta),
            min_entropy=float(p.min_entropy),
            seed=seed,
            message=job.message.bits,
            salts=p.salts,
            salt=job.salt,
            companion=job.companion,
        )
    return {XARG: args}


def _setting(args: dict[str, Any]) -> tuple[tuple[Any, ...], np.ndarray] | None:
    """(setting identity, message blocks) of a request, None when it is not watermarked."""
    if "message" not in args:
        return None
    params = WatermarkParams(
        bits=int(args["bits"]),
        block_bits=int(args["block_bits"]),
        num_keys=int(args["num_keys"]),
        delta=float(args["delta"]),
        scheme=str(args["scheme"]),
        min_entropy=float(args.get("min_entropy", 0.0)),
        salts=int(args.get("salts", 1)),
    )
    message = str(args["message"])
    if len(message) != params.bits or message.strip("01"):
        raise ValueError(f"{XARG}.message must be {params.bits} characters '0' or '1'")
    blocks = salted(bits_to_blocks([message], params)[0], int(args.get("salt", 0)), params)
    return (params, int(args["seed"]), bool(args.get("companion", False))), blocks


class EvalLogitsProcessor(LogitsProcessor):
    """Per-row XMark / LoSo / MPAC / Gumbel watermark with the evaluation's keys, plus special-token
    suppression. The biasing schemes add their bias to the raw logits; ``gumbel`` chooses each row's
    token after suppression, at the row's own temperature (``SamplingParams.temperature``)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = (sampling_params.extra_args or {}).get(XARG)
        if args is None:
            raise ValueError(f"every evaluation request carries {XARG}")
        _setting(args)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        refuse_speculative_decoding(vllm_config)
        self._device = device
        self._markers: dict[tuple[Any, ...], TorchWatermarker] = {}
        rows = max(1, int(vllm_config.scheduler_config.max_num_seqs))
        self._setting: list[tuple[Any, ...] | None] = [None] * rows
        self._blocks: list[np.ndarray | None] = [None] * rows
        self._prompt: list[list[int] | None] = [None] * rows
        self._output: list[list[int] | None] = [None] * rows
        # each row's never-sampled token ids (its request's "suppress"), None: nothing suppressed
        self._suppress: list[torch.Tensor | None] = [None] * rows
        self._suppress_lists: dict[tuple[int, ...], torch.Tensor] = {}
        # scheme gumbel: each row's sampling temperature and the contexts its answer has used
        self._temperature: list[float | None] = [None] * rows
        self._seen: list[set[tuple[int, int]] | None] = [None] * rows

    def is_argmax_invariant(self) -> bool:
        return False

    def _ensure(self, index: int) -> None:
        grow = index + 1 - len(self._setting)
        if grow > 0:
            for column in self._columns():
                column.extend([None] * grow)

    def _columns(self) -> tuple[list[Any], ...]:
        return self._setting, self._blocks, self._prompt, self._output, self._suppress, self._temperature, self._seen

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._ensure(index)
            for column in self._columns():
                column[index] = None
        for index, params, prompt, output in batch_update.added:
            self._ensure(index)
            args = (params.extra_args or {})[XARG]
            self._suppress[index] = self._suppress_list(args.get("suppress") or ())
            found = _setting(args)
            if found is None:
                self._setting[index] = self._blocks[index] = None
            else:
                setting, blocks = found
                if setting not in self._markers:
                    setting_params, seed, companion = setting
                    self._markers[setting] = TorchWatermarker(row_key(setting_params, seed, companion))
                self._setting[index], self._blocks[index] = setting, blocks
            self._prompt[index], self._output[index] = prompt, output
            self._temperature[index] = float(params.temperature)
            self._seen[index] = set()
        for a, b, direction in batch_update.moved:
            self._ensure(max(a, b))
            for column in self._columns():
                if direction == MoveDirectionality.SWAP:
                    column[a], column[b] = column[b], column[a]
                else:
                    column[b], column[a] = column[a], None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        batch = logits.shape[0]
        self._ensure(batch - 1)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for row in range(batch):
            setting = self._setting[row]
            if setting is not None:
                groups.setdefault(setting, []).append(row)
        # the biasing schemes act on the raw logits (as before suppression was moved); the sampling
        # scheme chooses among the tokens left after suppression
        biasing = {s: rows for s, rows in groups.items() if not self._markers[s].params.distortion_free}
        self._watermark(logits, biasing)
        self._suppress_rows(logits, batch)
        self._watermark(logits, {s: rows for s, rows in groups.items() if s not in biasing})
        return logits

    def _watermark(self, logits: torch.Tensor, groups: dict[tuple[Any, ...], list[int]]) -> None:
        for setting, rows in groups.items():
            marker = self._markers[setting]
            live = []
            context = np.zeros((len(rows), 2), dtype=np.int64)  # [g, 2] (x[t-2], x[t-1])
            for row in rows:
                pair = last_two(self._prompt[row], self._output[row])  # type: ignore[arg-type]
                if pair[0] >= 0 and pair[1] >= 0:  # an async-scheduling placeholder: skip this step
                    context[len(live)] = pair
                    live.append(row)
            if not live:
                continue
            # the op runs on this setting's rows only (a gathered [g, V] copy), then writes them back
            index = torch.tensor(live, dtype=torch.int64, device=logits.device)
            sub = logits.index_select(0, index)
            blocks = np.stack([self._blocks[row] for row in live])  # type: ignore[misc]
            active = torch.ones(len(live), dtype=torch.bool)
            temperature = None
            if marker.params.distortion_free:
                # a context the answer already used is sampled normally (xmark_core.gumbel)
                for slot, row in enumerate(live):
                    seen = self._seen[row]
                    assert seen is not None
                    pair = (int(context[slot, 0]), int(context[slot, 1]))
                    active[slot] = pair not in seen
                    seen.add(pair)
                temperature = torch.tensor([self._temperature[row] for row in live], dtype=torch.float32)
            marker.apply(
                sub,
                torch.from_numpy(context[: len(live)]).to(logits.device),
                torch.from_numpy(blocks).to(logits.device),
                active.to(logits.device),
                inplace=True,
                temperature=None if temperature is None else temperature.to(logits.device),
            )
            logits.index_copy_(0, index, sub)

    def _suppress_rows(self, logits: torch.Tensor, batch: int) -> None:
        suppressed: dict[int, list[int]] = {}  # rows by the id of their suppress list
        for row in range(batch):
            ids = self._suppress[row]
            if ids is not None:
                suppressed.setdefault(id(ids), []).append(row)
        for rows in suppressed.values():
            ids = self._suppress[rows[0]]
            assert ids is not None
            if len(rows) == batch:
                logits[:, ids] = float("-inf")
            else:
                index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
                logits[index.unsqueeze(1), ids.unsqueeze(0)] = float("-inf")

    def _suppress_list(self, ids: Sequence[int]) -> torch.Tensor | None:
        """One tensor per distinct list (rows asking for the same list share it)."""
        if not ids:
            return None
        key = tuple(sorted({int(i) for i in ids}))
        if key not in self._suppress_lists:
            self._suppress_lists[key] = torch.tensor(key, dtype=torch.int64, device=self._device)
        return self._suppress_lists[key]


def row_seed(seed: int, job: RowJob) -> int:
    ident = repr((seed, job.spec_name, job.user, job.slot)).encode()
    return int.from_bytes(hashlib.sha256(ident).digest()[:4], "little")


# GiB of KV cache of the in-process engine (the evaluation's batches of up to 128 sequences)
KV_CACHE_GIB = 4


class VllmGenerator:
    """One vLLM engine for the whole run; ``generate`` takes any mix of settings in one call."""

    name = "vllm"

    def __init__(
        self, model_path: Path, tokenizer: PreTrainedTokenizerBase, *, max_model_len: int, max_num_seqs: int
    ) -> None:
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        from vllm import LLM

        # the engine's own KV cache (VLLM_CPU_KVCACHE_SPACE, when set, still overrides it), not the
        # process environment's: a default written there was inherited by every vLLM server the
        # process started later (the e2e tests' workers asked for 4 GiB each instead of their 1)
        kv_cache_gib = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or KV_CACHE_GIB)

        self._tokenizer = tokenizer
        self._llm: LLM = LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype="float32",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            # A whole prompt is prefilled in one step: vLLM's CPU runner cannot rewind a
            # per-request generator after a partial (chunked) prefill, and per-request seeds are
            # what makes each row reproducible whatever else shares its batch.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max_model_len * max_num_seqs,
            logits_processors=[PROCESSOR],
            logprobs_mode="raw_logprobs",
            kv_cache_memory_bytes=kv_cache_gib * 2**30,
            seed=0,
        )
        self.max_num_seqs = max_num_seqs
        special = set(tokenizer.all_special_ids) | {
            i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special
        }
        self._suppress = sorted(special)
        self._prompt_cache: dict[str, list[int]] = {}
        self._checked: set[str] = set()

    @classmethod
    def for_jobs(
        cls, model_path: Path, jobs: Sequence[RowJob], max_new_tokens: int, max_num_seqs: int
    ) -> VllmGenerator:
        """An engine whose context fits the longest of ``jobs``' chat prompts plus ``max_new_tokens``."""
        from .generation import load_model

        _, tokenizer = load_model(model_path)
        longest = max(
            len(tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"])
            for prompt in {j.prompt for j in jobs}
        )
        max_len = -(-(longest + max_new_tokens + 1) // 64) * 64
        return cls(model_path, tokenizer, max_model_len=max_len, max_num_seqs=max_num_seqs)

    def _check_key(self, job: RowJob, run_seed: int) -> None:
        """The worker derives each setting's key from (parameters, run seed, companion): it must be
        the job's key."""
        assert job.key is not None
        if job.spec_name in self._checked:
            return
        if row_key(job.key.params, run_seed, job.companion).fingerprint != job.key.fingerprint:
            kind = "companion key" if job.companion else "evaluation key"
            raise ValueError(f"setting {job.spec_name}: its key is not the {kind} of seed {run_seed}")
        self._checked.add(job.spec_name)

    def describe(self) -> str:
        import vllm

        return f"vLLM {vllm.__version__} engine (CPU), float32, max_num_seqs={self.max_num_seqs}"

    def _prompt_ids(self, text: str) -> list[int]:
        ids = self._prompt_cache.get(text)
        if ids is None:
            ids = self._tokenizer(chat_prompt(self._tokenizer, text), add_special_tokens=False)["input_ids"]
            self._prompt_cache[text] = ids
        return list(ids)

    def generate(
        self,
        jobs: Sequence[RowJob],
        max_new_tokens: int,
        run_seed: int,
        *,
        stop_at_eos: bool = False,
        seed_of: Callable[[RowJob], int] | None = None,
    ) -> list[RowResult]:
        """Complete ``jobs`` (any mix of settings) in one engine call; the engine schedules the rows.

        Every answer is ``max_new_tokens`` long with the special tokens suppressed (the forensic
        protocol), or, with ``stop_at_eos``, ends where the model ends it (the other special tokens
        still suppressed) or at the cap. ``seed_of``: each row's sampling seed (default: from the
        run seed, the setting, the user and the slot).
        """
        from vllm import SamplingParams

        for job in jobs:
            if job.key is not None:
                self._check_key(job, run_seed)
        prompts = [{"prompt_token_ids": self._prompt_ids(job.prompt)} for job in jobs]
        eos = self._tokenizer.eos_token_id
        suppress = [i for i in self._suppress if i != eos] if stop_at_eos else self._suppress
        params = [
            SamplingParams(
                n=1,
                temperature=job.temperature,
                seed=row_seed(run_seed, job) if seed_of is None else seed_of(job),
                max_tokens=max_new_tokens,
                min_tokens=0 if stop_at_eos else max_new_tokens,
                ignore_eos=not stop_at_eos,
                logprobs=0,
                detokenize=False,
                extra_args=request_args(job, run_seed, suppress),
                **{"top_k": 0, "top_p": 1.0, **engine_options(job.options)},
            )
            for job in jobs
        ]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        results = []
        for job, out in zip(jobs, outputs, strict=True):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            if len(ids) != max_new_tokens and not stop_at_eos:
                raise RuntimeError(f"generation stopped after {len(ids)} of {max_new_tokens} tokens")
            assert sample.logprobs is not None
            nll = [round(-float(step[token].logprob), 5) for step, token in zip(sample.logprobs, ids, strict=True)]
            text = self._tokenizer.decode(ids, skip_special_tokens=True)
            results.append(RowResult(job, ids, nll, text))
        return results
