"""The committed prompt set and the assignment of two prompts to every simulated user."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).with_name("prompts.jsonl")
CATEGORIES = ("completion", "story", "summarization", "explanation", "factual")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(path: Path = PROMPTS_PATH) -> list[Prompt]:
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("category") not in CATEGORIES or not str(row.get("prompt", "")).strip():
                raise ValueError(f"{path}:{number}: each prompt needs a known category and a non-empty prompt")
            prompts.append(Prompt(id=str(row["id"]), category=row["category"], text=row["prompt"]))
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError(f"{path}: prompt ids must be unique")
    return prompts


def assign_prompts(prompts: list[Prompt], users: int, seed: int) -> list[tuple[Prompt, Prompt]]:
    """Two distinct prompts per user from a seeded shuffle (prompts are reused only past len/2 users)."""
    if len(prompts) < 2:
        raise ValueError("need at least two prompts")
    order = list(prompts)
    random.Random(f"xmark-eval/{seed}/prompts").shuffle(order)
    n = len(order)
    return [(order[(2 * u) % n], order[(2 * u + 1) % n]) for u in range(users)]
