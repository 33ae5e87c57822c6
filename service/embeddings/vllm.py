"""An embedding model on vLLM workers (``vllm serve <model> --runner pooling``): the client side.

The workers' connections, health checks and failures are the chat backend's
(``service.backends.vllm.VllmBackend``, which this composes): one keep-alive pool per worker, a
background ``/health`` probe, the healthy worker with the fewest requests in flight, a worker
whose connection fails leaves the rotation and the request goes to the next, none left is a 503
``upstream_unavailable`` at once, no answer within the model's ``timeout_s`` a 504
``upstream_timeout``. The request goes to the worker's own ``/v1/embeddings`` with the validated
texts only (as floats; the gateway encodes base64 itself), so nothing else the client sent
reaches a worker. The gateway counts and limits input tokens with its copy of the model's
tokenizer (the models file's ``path``) before a worker is asked; the worker's own usage is what
is charged afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.backends.vllm import VllmBackend
from service.embeddings.base import Embedded
from service.errors import InvalidRequestError, ServiceUnavailableError, UpstreamUnavailableError

EMBEDDINGS_PATH = "/v1/embeddings"


def embeddings_from_response(payload: Any, count: int) -> Embedded:
    """A worker's embeddings answer as vectors in input order; 503 when it is malformed."""
    try:
        rows: list[Any] = [None] * count
        for item in payload["data"]:
            index = int(item["index"])
            if not 0 <= index < count or rows[index] is not None:
                raise ValueError("an index out of range or repeated")
            rows[index] = item["embedding"]
        if any(row is None for row in rows):
            raise ValueError("an input without its embedding")
        vectors = np.asarray(rows, dtype=np.float32)  # [count, D]
        if vectors.ndim != 2 or not np.isfinite(vectors).all():
            raise ValueError("not one finite vector per input")
        usage = payload.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise UpstreamUnavailableError("The model worker answered with malformed embeddings") from None
    return Embedded(vectors=vectors, prompt_tokens=prompt_tokens)


class VllmEmbeddingBackend:
    """Embeddings served by one or more vLLM workers running a pooling model."""

    def __init__(
        self,
        urls: Sequence[str],
        model_id: str,
        tokenizer_path: Path,
        *,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        health_interval_s: float = 5.0,
    ) -> None:
        self.model_id = model_id
        self._workers = VllmBackend(
            urls,
            model_id,
            tokenizer_path,
            timeout_s=timeout_s,
            api_key=api_key,
            health_interval_s=health_interval_s,
        )

    @property
    def workers(self) -> VllmBackend:
        """The workers' client (their pool, health and tokenizer)."""
        return self._workers

    @property
    def ready(self) -> bool:
        """True once the tokenizer is loaded; worker outages surface per request as 503."""
        return self._workers.ready

    @property
    def dimensions(self) -> int | None:
        return None  # the workers' model decides (and ``dimensions`` where it is a Matryoshka model)

    @property
    def max_input_tokens(self) -> int | None:
        return None  # the workers' --max-model-len: they refuse a longer text, named by the gateway

    async def start(self) -> None:
        await self._workers.start()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        return await self._workers.wait_ready(timeout)

    async def close(self) -> None:
        await self._workers.close()

    async def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's tokens by the gateway's copy of the model's tokenizer (special tokens
        included, as the worker reads it), off the event loop; no worker round trip."""
        tokenizer = self._workers.tokenizer
        if tokenizer is None or not self.ready:
            raise ServiceUnavailableError(f"The model '{self.model_id}' is still loading; retry shortly")

        def count() -> list[int]:
            return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]

        return await asyncio.to_thread(count)

    async def embed(self, texts: Sequence[str], *, dimensions: int | None = None) -> Embedded:
        body: dict[str, Any] = {"model": self.model_id, "input": list(texts), "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        try:
            payload = await self._workers.post_json(EMBEDDINGS_PATH, body)
        except InvalidRequestError as exc:  # the body is ours but for the texts and dimensions
            param = "dimensions" if dimensions is not None and "dimension" in exc.message.lower() else "input"
            raise InvalidRequestError(
                f"The model worker refused the request: {exc.message}", param=param, code=exc.code
            ) from None
        return embeddings_from_response(payload, len(texts))
