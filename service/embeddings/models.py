"""The embedding models a gateway serves, by name and alias, and the backend of each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from service.config import ConfigurationError, Settings
from service.embeddings.base import EmbeddingBackend
from service.errors import NotFoundError
from service.fleet import Fleet


def build_embedding_backend(settings: Settings) -> EmbeddingBackend:
    """The backend of the embedding model ``settings`` describe (``fleet.embedding_model_settings``)."""
    if settings.backend == "local":
        from service.embeddings.local import LocalEmbeddingBackend

        return LocalEmbeddingBackend(
            settings.resolved_model_path(), settings.model_name, threads=settings.model_threads
        )
    if settings.backend == "vllm":
        from service.embeddings.vllm import VllmEmbeddingBackend

        if not settings.vllm_urls:
            raise ConfigurationError(f"embedding model {settings.model_name!r}: a vllm model needs its workers' URLs")
        return VllmEmbeddingBackend(
            settings.vllm_urls,
            settings.model_name,
            settings.resolved_model_path(),
            timeout_s=settings.vllm_timeout_s,
            api_key=None if settings.vllm_api_key is None else settings.vllm_api_key.get_secret_value(),
            health_interval_s=settings.vllm_health_interval_s,
        )
    raise ConfigurationError(f"embedding model {settings.model_name!r}: unknown backend {settings.backend!r}")


@dataclass(frozen=True)
class EmbeddingModel:
    """An embedding model the gateway serves: its name, backend, aliases and the settings its
    requests follow (its queue bound, ``max_queued_requests``)."""

    name: str
    backend: EmbeddingBackend
    settings: Settings
    aliases: tuple[str, ...] = ()


class EmbeddingModels:
    """Every served embedding model, by name and alias (in the order of the configuration)."""

    def __init__(self, models: Sequence[EmbeddingModel] = ()) -> None:
        self._models = list(models)
        self._names: dict[str, EmbeddingModel] = {}
        for model in self._models:
            for name in (model.name, *model.aliases):
                if name in self._names:
                    raise ValueError(f"model name {name!r} is used twice")
                self._names[name] = model

    def __iter__(self) -> Iterator[EmbeddingModel]:
        return iter(list(self._models))

    def __len__(self) -> int:
        return len(self._models)

    def names(self) -> list[tuple[str, tuple[str, ...]]]:
        """Each model's name and aliases (what the chat fleet is told of, ``Fleet(embedding=...)``)."""
        return [(model.name, model.aliases) for model in self._models]

    def resolve(self, name: str, chat: Fleet) -> EmbeddingModel:
        """The model a request names (its name or an alias); 404 ``model_not_found`` otherwise,
        saying so when ``name`` is one of ``chat``'s models."""
        model = self._names.get(name)
        if model is not None:
            return model
        if chat.is_chat_model(name):
            message = f"The model '{name}' is not an embedding model: it serves the chat and completion routes"
        else:
            message = f"The model '{name}' does not exist"
        raise NotFoundError(message, param="model", code="model_not_found")
