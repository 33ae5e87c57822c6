"""Append-only cache of generated completions (JSON lines), so a run resumes and a partial run reports."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .generation import RowResult


@dataclass(frozen=True)
class Completion:
    spec: str
    user: int
    slot: int
    prompt_id: str
    token_ids: list[int]
    nll: list[float]
    text: str


class GenerationStore:
    """Completions keyed by (spec name, user, slot); one JSON object per line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._rows: dict[tuple[str, int, int], Completion] = {}
        if path.is_file():
            with path.open(encoding="utf-8") as handle:
                for line in handle:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by an interrupted run
                    item = Completion(**row)
                    self._rows[(item.spec, item.user, item.slot)] = item

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self._rows

    def get(self, spec: str, user: int, slot: int) -> Completion | None:
        return self._rows.get((spec, user, slot))

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, results: list[RowResult]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            for r in results:
                item = Completion(
                    spec=r.job.spec_name,
                    user=r.job.user,
                    slot=r.job.slot,
                    prompt_id=r.job.prompt_id,
                    token_ids=r.token_ids,
                    nll=r.nll,
                    text=r.text,
                )
                self._rows[(item.spec, item.user, item.slot)] = item
                handle.write(json.dumps(item.__dict__, ensure_ascii=False) + "\n")
            handle.flush()
