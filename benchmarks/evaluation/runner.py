"""The generation phase: every (setting, user, prompt) completion once, in batches, cached as it goes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from .config import EvalConfig, GenSpec
from .generation import RowJob, RowResult, chat_prompt
from .population import evaluation_key, user_messages
from .prompts import Prompt, assign_prompts
from .store import GenerationStore


@dataclass
class GenerationLog:
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    stopped_early: bool = False
    per_batch: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "rows": self.rows,
            "generated_tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": round(self.seconds, 1),
            "generated_tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
            "seconds_per_row": round(self.seconds / self.rows, 3) if self.rows else None,
            "stopped_early": self.stopped_early,
        }


def all_jobs(config: EvalConfig, prompts: list[Prompt]) -> list[tuple[GenSpec, RowJob]]:
    assignment = assign_prompts(prompts, config.users, config.seed)
    jobs: list[tuple[GenSpec, RowJob]] = []
    for spec in config.specs():
        key = evaluation_key(spec.params(), config.seed) if spec.watermarked else None
        messages = user_messages(spec.bits, config.users, config.seed) if spec.watermarked else None
        for user, pair in enumerate(assignment):
            for slot, prompt in enumerate(pair):
                jobs.append(
                    (
                        spec,
                        RowJob(
                            spec_name=spec.name,
                            user=user,
                            slot=slot,
                            prompt_id=prompt.id,
                            prompt=prompt.text,
                            temperature=spec.temperature,
                            key=key,
                            message=messages[user] if messages is not None else None,
                        ),
                    )
                )
    return jobs


class Generator(Protocol):
    """An engine that completes rows of any mix of settings (``generation.TransformersGenerator``,
    ``vllm_engine.VllmGenerator``)."""

    name: str

    def describe(self) -> str: ...

    def generate(self, jobs: Sequence[RowJob], max_new_tokens: int, run_seed: int) -> list[RowResult]: ...


def generate_all(
    config: EvalConfig,
    prompts: list[Prompt],
    generator: Generator,
    tokenizer: PreTrainedTokenizerBase,
    store: GenerationStore,
    batch_size: int,
    *,
    budget_s: float | None = None,
    log: Callable[[str], None] = print,
) -> GenerationLog:
    """Generate every missing completion, tier by tier, ``batch_size`` rows of similar prompt length per call.

    Each call's results are appended to the store before the next call starts.
    """
    stats = GenerationLog()
    pending = [
        (spec, job) for spec, job in all_jobs(config, prompts) if (job.spec_name, job.user, job.slot) not in store
    ]
    lengths = {
        p.id: len(tokenizer(chat_prompt(tokenizer, p.text), add_special_tokens=False)["input_ids"]) for p in prompts
    }
    pending.sort(
        key=lambda item: (item[0].tier, lengths[item[1].prompt_id], item[1].spec_name, item[1].user, item[1].slot)
    )
    total = len(pending)
    log(f"{total} completions to generate ({len(store)} cached), {config.max_new_tokens} tokens each")
    start = time.monotonic()
    index = 0
    while index < total:
        tier = pending[index][0].tier
        batch = [pending[index][1]]
        index += 1
        while index < total and len(batch) < batch_size and pending[index][0].tier == tier:
            batch.append(pending[index][1])
            index += 1
        if budget_s is not None and time.monotonic() - start > budget_s:
            stats.stopped_early = True
            left = total - index + len(batch)
            log(f"generation budget of {budget_s:.0f} s spent; stopping with {left} completions left")
            break
        t0 = time.monotonic()
        results = generator.generate(batch, config.max_new_tokens, config.seed)
        elapsed = time.monotonic() - t0
        store.add(results)
        stats.batches += 1
        stats.rows += len(batch)
        stats.tokens += len(batch) * config.max_new_tokens
        stats.prompt_tokens += sum(lengths[j.prompt_id] for j in batch)
        stats.seconds += elapsed
        stats.per_batch.append({"tier": tier, "rows": len(batch), "seconds": round(elapsed, 1)})
        done = stats.rows
        rate = stats.seconds / done
        log(
            f"batch {stats.batches}: tier {tier}, {len(batch)} rows in {elapsed:.1f} s "
            f"({len(batch) * config.max_new_tokens / elapsed:.1f} tok/s); {done}/{total} done, "
            f"~{rate * (total - done) / 60:.1f} min left"
        )
    return stats
