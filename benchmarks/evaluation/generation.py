"""Batched generation with the in-process transformers model: one message (or none) per row.

Rows of several generation settings share one ``model.generate`` call. Each setting's rows are
watermarked by its own ``xmark_core.hf.XMarkLogitsProcessor`` (one message per row); the same
processor call records the raw model log-probability of every generated token (for perplexity),
suppresses the special tokens (so every completion has exactly ``max_new_tokens`` tokens, the
paper's min = max) and divides by the row's sampling temperature. The order matches transformers'
own (processors, then the temperature warper): the watermark bias is added before the temperature.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import __version__ as transformers_version

from service.backends.attention import use_grouped_sdpa
from xmark_core import Message, WatermarkKey
from xmark_core.hf import XMarkLogitsProcessor

from .config import SamplingOptions


@dataclass(frozen=True)
class RowJob:
    """One completion to generate: a chat prompt and, when watermarked, the key and the user's message."""

    spec_name: str
    user: int
    slot: int
    prompt_id: str
    prompt: str
    temperature: float
    key: WatermarkKey | None
    message: Message | None
    salt: int = 0  # a salted ``gumbel`` key: the salt the answer is written under
    # ``key`` is a per-request key version's companion key (``xmark_core.encoders.companion_key``)
    companion: bool = False
    options: SamplingOptions = ()  # sampling options the engine applies (``config.engine_options``)


@dataclass(frozen=True)
class RowResult:
    job: RowJob
    token_ids: list[int]
    nll: list[float]  # negative log-likelihood of each generated token under the unmodified model
    text: str


def load_model(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local checkpoint (never a hub download) in float32 for the CPU."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model checkpoint at {path}: run `xmark fetch-model` or pass --model-path to a local "
            "transformers checkpoint directory"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.eval()
    use_grouped_sdpa(model)  # the KV cache read in place, not copied per step (service.backends.attention)
    return model, tokenizer


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


class MixedRowsProcessor(LogitsProcessor):
    """Watermarks each group of rows with its own processor; records raw log-probs; suppression; temperature.

    groups: (row indices int64 [g], XMarkLogitsProcessor for those rows in that order).
    temperatures: float32 [B]; suppress_ids: token ids that must never be sampled.
    """

    def __init__(
        self,
        groups: Sequence[tuple[torch.Tensor, XMarkLogitsProcessor]],
        temperatures: torch.Tensor,
        suppress_ids: Sequence[int],
    ) -> None:
        self._groups = list(groups)
        self._temperatures = temperatures[:, None]  # [B, 1]
        self._suppress = torch.tensor(sorted(set(suppress_ids)), dtype=torch.int64)
        self._prev_logits: torch.Tensor | None = None  # [B, V] raw logits of the previous step
        self._prev_lse: torch.Tensor | None = None  # [B]
        self._nll: list[torch.Tensor] = []  # each [B]

    def _record(self, chosen: torch.Tensor) -> None:
        if self._prev_logits is None or self._prev_lse is None:
            return
        picked = self._prev_logits.gather(1, chosen[:, None].to(torch.int64))[:, 0]  # [B]
        self._nll.append(self._prev_lse - picked)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._record(input_ids[:, -1])
        raw = scores.float()
        self._prev_logits = raw.clone()
        self._prev_lse = torch.logsumexp(raw, dim=-1)
        out = raw.clone()
        for rows, processor in self._groups:
            out[rows] = processor(input_ids[rows], out[rows])
        out[:, self._suppress] = float("-inf")
        return out / self._temperatures

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """float64 [B, n]: the NLL of every generated token (call once, with the last generated tokens)."""
        self._record(last_tokens)
        return torch.stack(self._nll, dim=1).double()


class TransformersGenerator:
    """The in-process transformers model: rows of several settings share one ``model.generate`` call."""

    name = "transformers"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, threads: int) -> None:
        self._model, self._tokenizer, self._threads = model, tokenizer, threads

    def describe(self) -> str:
        return f"in-process transformers {transformers_version} on the CPU, float32, {self._threads} torch thread(s)"

    def generate(self, jobs: Sequence[RowJob], max_new_tokens: int, run_seed: int) -> list[RowResult]:
        return generate_rows(self._model, self._tokenizer, jobs, max_new_tokens, batch_seed(run_seed, jobs))


def batch_seed(seed: int, jobs: Sequence[RowJob]) -> int:
    """The sampling seed of one transformers batch (a function of the run seed and its rows)."""
    ident = repr((seed, [(j.spec_name, j.user, j.slot) for j in jobs])).encode()
    return int.from_bytes(hashlib.sha256(ident).digest()[:4], "little")


def generate_rows(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    jobs: Sequence[RowJob],
    max_new_tokens: int,
    seed: int,
) -> list[RowResult]:
    """Generate exactly max_new_tokens tokens for every job in one batched generate call."""
    if any(job.options for job in jobs):
        raise ValueError(
            "the transformers path applies no sampling options (penalties, logit_bias): use the vLLM engine"
        )
    prompts = [chat_prompt(tokenizer, job.prompt) for job in jobs]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    by_spec: dict[str, list[int]] = {}
    for row, job in enumerate(jobs):
        if job.key is not None:
            by_spec.setdefault(job.spec_name, []).append(row)
    groups = []
    for rows in by_spec.values():
        key = jobs[rows[0]].key
        assert key is not None
        processor = XMarkLogitsProcessor(key, [jobs[r].message for r in rows])
        groups.append((torch.tensor(rows, dtype=torch.int64), processor))
    temperatures = torch.tensor([job.temperature for job in jobs], dtype=torch.float32)
    special = set(tokenizer.all_special_ids) | {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    mixer = MixedRowsProcessor(groups, temperatures, sorted(special))
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            # every row runs to max_new_tokens: one cache allocated up front, not grown each step
            cache_implementation="static",
            logits_processor=LogitsProcessorList([mixer]),
            pad_token_id=tokenizer.pad_token_id,
        )
    generated = out[:, enc["input_ids"].shape[1] :]  # [B, max_new_tokens]
    if generated.shape[1] != max_new_tokens:
        raise RuntimeError(f"generation stopped after {generated.shape[1]} of {max_new_tokens} tokens")
    nll = mixer.finish(generated[:, -1])  # [B, max_new_tokens]
    results = []
    for row, job in enumerate(jobs):
        ids = generated[row].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        results.append(RowResult(job, ids, [round(float(x), 5) for x in nll[row]], text))
    return results
