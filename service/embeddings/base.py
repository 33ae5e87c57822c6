"""What the gateway asks of an embedding model's backend, and the value that crosses that boundary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Embedded:
    """The embeddings of a request's texts.

    ``vectors``: float32 [len(texts), dimensions], row i the embedding of text i.
    ``prompt_tokens``: the tokens the model read for them (special tokens included).
    """

    vectors: np.ndarray
    prompt_tokens: int


@runtime_checkable
class EmbeddingBackend(Protocol):
    """An embedding model the gateway serves.

    ``start`` may return before the model is loaded; ``ready`` turns true once it can embed.
    ``dimensions``: the length of its vectors once known (None: the workers decide, e.g. a vLLM
    pooling model). ``max_input_tokens``: the most tokens one text may have (the model's own
    context; None where only the workers know it: they refuse a longer text themselves).
    """

    model_id: str

    @property
    def ready(self) -> bool: ...

    @property
    def dimensions(self) -> int | None: ...

    @property
    def max_input_tokens(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the backend can embed (or failed to start); True when ready."""
        ...

    async def close(self) -> None: ...

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's length in the model's tokens, special tokens included (what the gateway
        checks against the limits and reserves from the caller's tokens per minute). Raises
        ``ServiceUnavailableError`` while not ready."""
        ...

    async def embed(self, texts: Sequence[str], *, dimensions: int | None = None) -> Embedded:
        """The texts' embeddings, in order. ``dimensions``: the length the caller asked for (None:
        the model's own); a backend that cannot honour it raises ``InvalidRequestError`` naming it."""
        ...
