"""The local sentence-embedding model: a transformers encoder run in the gateway process.

One worker thread of its own owns the model: it loads it (``ready`` flips afterwards) and runs
every request's forward passes in turn, so the event loop never waits for the model and two
requests never share its intra-op threads. A request's texts are embedded in batches of similar
length (less padding) and pooled as the checkpoint says (``checkpoint.read_layout``: mean over
the attention mask for all-MiniLM-L6-v2, then L2-normalised), which is what sentence-transformers
computes for the same folder. Texts are counted with the same tokenizer on another thread, so a
count never waits behind a forward pass. Nothing is read from a model hub: ``HF_HUB_OFFLINE``
is set before the model loads, and only the local folder is read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.backends.base import LOAD_LOCK, BackendError
from service.backends.local import default_threads
from service.embeddings.base import Embedded
from service.embeddings.checkpoint import EmbeddingLayout, read_layout
from service.errors import InvalidRequestError, ServiceUnavailableError
from service.model_store import offline_env

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# texts per forward pass (sorted by length, so a batch pads little)
BATCH_TEXTS = 32


class LocalEmbeddingBackend:
    """Embeddings of a local sentence-embedding checkpoint (see the module docstring)."""

    def __init__(self, path: Path, model_id: str, *, threads: int | None = None) -> None:
        self.model_id = model_id
        self._path = path
        self._threads = threads if threads is not None else default_threads()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._loading: asyncio.Future[None] | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._model: PreTrainedModel | None = None
        self._layout: EmbeddingLayout | None = None
        self._closed = False
        self.load_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._model is not None and not self._closed

    @property
    def dimensions(self) -> int | None:
        return None if self._layout is None else self._layout.dimensions

    @property
    def max_input_tokens(self) -> int | None:
        return None if self._layout is None else self._layout.max_tokens

    async def start(self) -> None:
        if self._executor is not None:
            return
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="xmark-embedding")
        self._loading = asyncio.wrap_future(self._executor.submit(self._load))
        # read here: a failed load is logged (and kept in load_error) whether or not anyone waits for it
        self._loading.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def wait_ready(self, timeout: float | None = None) -> bool:
        if self._loading is not None:
            # the wait timed out, or the load failed (logged, and kept in load_error)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._loading), timeout)
        return self.ready

    async def close(self) -> None:
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is not None:
            # a forward pass under way finishes first (at most one batch); queued ones are dropped
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)

    def _load(self) -> None:
        """On the model's thread: load the tokenizer and the encoder from the folder alone."""
        try:
            layout = read_layout(self._path)
            # transformers' (lazy) imports and loading are not thread-safe: a chat model may be loading
            with LOAD_LOCK:
                offline_env()
                import torch
                from transformers import AutoModel, AutoTokenizer

                torch.set_num_threads(self._threads)
                tokenizer = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
                model = AutoModel.from_pretrained(self._path, local_files_only=True, dtype=torch.float32).eval()
            self._tokenizer, self._layout = tokenizer, layout
            self._model = model
            logger.info(
                "embedding model loaded",
                extra={"model": self.model_id, "dimensions": layout.dimensions, "max_tokens": layout.max_tokens},
            )
        except Exception as exc:
            self.load_error = type(exc).__name__
            logger.error(
                "embedding model failed to load", extra={"model": self.model_id, "error_type": self.load_error}
            )
            raise

    # -- requests ----------------------------------------------------------------------------

    def _ready_parts(self) -> tuple[PreTrainedTokenizerBase, PreTrainedModel, EmbeddingLayout]:
        tokenizer, model, layout = self._tokenizer, self._model, self._layout
        if tokenizer is None or model is None or layout is None or self._closed:
            raise ServiceUnavailableError(f"The model '{self.model_id}' is still loading; retry shortly")
        return tokenizer, model, layout

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        tokenizer, _, _ = self._ready_parts()

        def count() -> list[int]:
            encoded = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
            return [len(ids) for ids in encoded]

        return await asyncio.to_thread(count)

    async def embed(self, texts: Sequence[str], *, dimensions: int | None = None) -> Embedded:
        tokenizer, model, layout = self._ready_parts()
        if dimensions is not None and dimensions != layout.dimensions:
            raise InvalidRequestError(
                f"The model '{self.model_id}' gives {layout.dimensions}-dimensional embeddings and cannot "
                f"shorten them; leave dimensions out or send {layout.dimensions}",
                param="dimensions",
                code="unsupported_value",
            )
        executor = self._executor
        if executor is None:
            raise ServiceUnavailableError(f"The model '{self.model_id}' is not running")
        try:
            return await asyncio.wrap_future(executor.submit(self._embed, tokenizer, model, layout, list(texts)))
        except (RuntimeError, ValueError) as exc:  # the model itself failed (never the request's fault)
            logger.error("embedding failed", extra={"model": self.model_id, "error_type": type(exc).__name__})
            raise BackendError(f"The model '{self.model_id}' failed while embedding") from None

    def _embed(
        self, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, layout: EmbeddingLayout, texts: list[str]
    ) -> Embedded:
        """On the model's thread: the texts' vectors, batched by length."""
        import torch

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        vectors = np.empty((len(texts), layout.dimensions), dtype=np.float32)  # [N, D]
        tokens = 0
        with torch.inference_mode():
            for start in range(0, len(order), BATCH_TEXTS):
                positions = order[start : start + BATCH_TEXTS]
                batch: Any = tokenizer(
                    [texts[i] for i in positions],
                    padding=True,
                    truncation=True,
                    max_length=layout.max_tokens,
                    return_tensors="pt",
                )
                states = model(**batch).last_hidden_state  # [B, L, H] float32
                mask = batch["attention_mask"]  # [B, L] int64
                tokens += int(mask.sum())
                if layout.pooling == "cls":
                    pooled = states[:, 0]  # [B, H]
                else:
                    weights = mask.unsqueeze(-1).to(states.dtype)  # [B, L, 1]
                    pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)  # [B, H]
                if layout.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
                vectors[positions] = pooled.numpy()
        return Embedded(vectors=vectors, prompt_tokens=tokens)
