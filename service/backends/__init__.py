"""Model backends: the in-process transformers model (``local``) and, later, remote vLLM workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.backends.base import (
    Backend,
    ChatTurn,
    ChoiceDelta,
    ChoiceResult,
    GenerationRequest,
    GenerationResult,
    GenerationStream,
    WatermarkStamp,
)
from service.config import ConfigurationError

if TYPE_CHECKING:
    from service.config import Settings
    from service.metrics import Metrics

__all__ = [
    "Backend",
    "ChatTurn",
    "ChoiceDelta",
    "ChoiceResult",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStream",
    "WatermarkStamp",
    "build_backend",
]


def build_backend(settings: Settings, metrics: Metrics) -> Backend:
    """The backend named by ``settings.backend``.

    ``metrics`` is accepted for backends that report upstream figures of their own; the local
    backend's token counts are recorded by the generation service.
    """
    if settings.backend == "local":
        from service.backends.local import LocalBackend

        return LocalBackend(
            settings.resolved_model_path(),
            settings.model_name,
            max_batch_rows=settings.max_batch_size,
            threads=settings.model_threads,
            scorer_dtype=settings.trace_scorer_dtype,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
        )
    if settings.backend == "vllm":
        from service.backends.vllm import VllmBackend

        if not settings.vllm_urls:
            raise ConfigurationError("XMARK_BACKEND=vllm needs XMARK_VLLM_URLS (comma-separated worker URLs)")
        return VllmBackend(
            settings.vllm_urls,
            settings.model_name,
            settings.resolved_model_path(),
            timeout_s=settings.vllm_timeout_s,
            api_key=None if settings.vllm_api_key is None else settings.vllm_api_key.get_secret_value(),
            health_interval_s=settings.vllm_health_interval_s,
        )
    raise ConfigurationError(f"XMARK_BACKEND={settings.backend!r} is not a known backend; use 'local' or 'vllm'")
