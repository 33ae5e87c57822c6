"""The models a gateway serves: one entry per model, each with its own backend and limits.

Without ``XMARK_MODELS_FILE`` the gateway serves the one model its settings describe
(``XMARK_MODEL_NAME``, ``XMARK_BACKEND``, ``XMARK_MODEL_PATH``, ``XMARK_VLLM_URLS``), as it
always has. With it, the TOML file lists every served model::

    [[models]]
    name = "smollm2-135m-instruct"      # what clients send as "model"
    aliases = ["smollm2"]               # other names for it (listed nowhere, accepted everywhere)
    backend = "local"                   # in-process transformers model
    path = "models/smollm2"             # its checkpoint (default: <XMARK_MODELS_DIR>/<name>)

    [[models]]
    name = "xmark-test-bpe"
    backend = "vllm"
    urls = ["http://vllm-b:8000"]       # its workers
    path = "/srv/models/xmark-test-bpe" # the tokenizer the gateway counts and traces with
    timeout_s = 120
    api_key_env = "VLLM_B_API_KEY"      # the workers' API key, read from this variable
    max_prompt_tokens = 2048            # per-model limits (default: the gateway's)
    max_completion_tokens = 512
    max_queued_requests = 32

An entry with ``kind = "embedding"`` is an embedding model, served at ``POST /v1/embeddings`` only
(``service.embeddings``): ``backend = "local"`` runs a sentence-embedding checkpoint in-process,
``backend = "vllm"`` forwards to workers running a pooling model (``path``: their tokenizer, with
which the gateway counts input tokens). Chat (the default kind) is every other route's. A file
lists at least one chat model; the chat routes answer 404 for an embedding model and
``/v1/embeddings`` for a chat model. Without a models file, ``XMARK_EMBEDDING_MODEL`` serves the
local checkpoint beside the one chat model.

Each model gets a copy of the process settings with its own fields (:meth:`ModelEntry.settings_for`),
so a backend and the generation service read a model's limits where they always read them.
Relative paths are read from the file's folder. Anything wrong in the file (not TOML, an unknown
key, a duplicate name or alias, a missing checkpoint, a ``vllm`` entry without workers) stops the
gateway at start-up with a message naming the entry and the field.

Key versions are global: one watermark secret serves every model (the token codes are derived per
vocabulary), and a user's message ID is the same whichever model answers.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from service.config import ConfigurationError, Settings
from service.errors import NotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from service.backends import Backend

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$"


class ModelEntry(BaseModel):
    """One served model, as the models file describes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    aliases: tuple[str, ...] = ()
    # chat: the generation routes; embedding: POST /v1/embeddings only
    kind: Literal["chat", "embedding"] = "chat"
    backend: Literal["local", "vllm"] = "local"
    path: Path | None = None
    urls: tuple[str, ...] = ()
    timeout_s: float | None = Field(default=None, gt=0)
    api_key_env: str | None = Field(default=None, min_length=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_queued_requests: int | None = Field(default=None, ge=1)

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for alias in value:
            if not re.match(MODEL_NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} is not a valid model name")
        return value

    @field_validator("urls")
    @classmethod
    def _worker_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        return tuple(url.rstrip("/") for url in value)

    def settings_for(self, base: Settings, folder: Path) -> Settings:
        """``base`` with this model's fields: what its backend and its requests' limits read."""
        path = self.path
        if path is not None and not path.is_absolute():
            path = folder / path
        update: dict[str, object] = {
            "backend": self.backend,
            "model_name": self.name,
            "model_path": path if path is not None else base.resolved_models_dir / self.name,
            "vllm_urls": list(self.urls),
            "models_file": None,
        }
        if self.timeout_s is not None:
            update["vllm_timeout_s"] = self.timeout_s
        if self.api_key_env is not None:
            update["vllm_api_key"] = SecretStr(os.environ.get(self.api_key_env, ""))
        for limit in ("max_prompt_tokens", "max_completion_tokens", "max_queued_requests"):
            if getattr(self, limit) is not None:
                update[limit] = getattr(self, limit)
        return base.model_copy(update=update)


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] = Field(min_length=1)


def _where(models: Sequence[object], loc: tuple[int | str, ...]) -> str:
    """'model 2 ("name"), field urls' for a validation error's location."""
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        index = loc[1]
        entry = models[index] if index < len(models) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        label = f"model {index + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
        field = ".".join(str(part) for part in loc[2:])
        return f"{label}, field '{field}'" if field else label
    return "field '" + ".".join(str(part) for part in loc) + "'"


def load_models_file(path: Path) -> list[ModelEntry]:
    """The entries of a models file; ``ConfigurationError`` naming the entry and field otherwise."""
    source = f"XMARK_MODELS_FILE ({path})"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{source}: cannot be read ({type(exc).__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{source}: not valid TOML ({exc})") from None
    try:
        parsed = ModelsFile.model_validate(raw)
    except ValidationError as exc:
        listed = raw.get("models")
        models: list[object] = listed if isinstance(listed, list) else []
        first = exc.errors()[0]
        raise ConfigurationError(f"{source}: {_where(models, first['loc'])}: {first['msg']}") from None
    seen: dict[str, str] = {}
    for index, entry in enumerate(parsed.models):
        label = f"model {index + 1} ({entry.name!r})"
        for name, field in ((entry.name, "name"), *((alias, "aliases") for alias in entry.aliases)):
            if name in seen:
                raise ConfigurationError(f"{source}: {label}, field '{field}': {name!r} is already {seen[name]}")
            seen[name] = f"the name or an alias of {label}"
        if entry.backend == "vllm" and not entry.urls:
            raise ConfigurationError(f"{source}: {label}, field 'urls': a vllm model needs its workers' URLs")
        if entry.backend == "local" and entry.urls:
            raise ConfigurationError(f"{source}: {label}, field 'urls': only a vllm model has workers")
        if entry.api_key_env is not None and entry.backend != "vllm":
            raise ConfigurationError(f"{source}: {label}, field 'api_key_env': only a vllm model has workers")
        if entry.timeout_s is not None and entry.backend != "vllm":
            raise ConfigurationError(f"{source}: {label}, field 'timeout_s': only a vllm model has workers")
        if entry.kind == "embedding":
            for field in ("max_prompt_tokens", "max_completion_tokens"):
                if getattr(entry, field) is not None:
                    raise ConfigurationError(
                        f"{source}: {label}, field '{field}': an embedding model generates nothing "
                        "(its inputs' limits are XMARK_EMBEDDING_MAX_INPUT_TOKENS and _CHARS)"
                    )
        if entry.api_key_env is not None and not os.environ.get(entry.api_key_env):
            raise ConfigurationError(
                f"{source}: {label}, field 'api_key_env': the variable {entry.api_key_env} is not set"
            )
    if not any(entry.kind == "chat" for entry in parsed.models):
        raise ConfigurationError(f"{source}: no chat model (every entry has kind = 'embedding')")
    return parsed.models


def model_settings(settings: Settings) -> list[tuple[Settings, tuple[str, ...]]]:
    """Each served chat model's settings and aliases, the default model first."""
    if settings.models_file is None:
        return [(settings, ())]
    return _entries_settings(settings, "chat")


def embedding_model_settings(settings: Settings) -> list[tuple[Settings, tuple[str, ...]]]:
    """Each served embedding model's settings (``backend``, ``model_name``, ``model_path`` and
    ``vllm_*`` describe it) and aliases: the models file's ``kind = "embedding"`` entries, or
    without a models file the local checkpoint ``XMARK_EMBEDDING_MODEL`` names (none when unset)."""
    if settings.models_file is not None:
        return _entries_settings(settings, "embedding")
    name = settings.embedding_model
    if name is None:
        return []
    if not re.match(MODEL_NAME_PATTERN, name):
        raise ConfigurationError(f"XMARK_EMBEDDING_MODEL: {name!r} is not a valid model name")
    if name == settings.model_name:
        raise ConfigurationError(f"XMARK_EMBEDDING_MODEL: {name!r} is already the chat model's name (XMARK_MODEL_NAME)")
    path = settings.resolved_embedding_model_path()
    if not (path / "config.json").is_file():
        raise ConfigurationError(
            f"XMARK_EMBEDDING_MODEL: no checkpoint at {path} (run `xmark fetch-embedding-model`, "
            "or set XMARK_EMBEDDING_MODEL_PATH)"
        )
    own = settings.model_copy(update={"backend": "local", "model_name": name, "model_path": path, "vllm_urls": []})
    return [(own, ())]


def _entries_settings(settings: Settings, kind: str) -> list[tuple[Settings, tuple[str, ...]]]:
    """The settings and aliases of the models file's entries of ``kind``, their checkpoints checked."""
    assert settings.models_file is not None
    folder = settings.models_file.parent
    served: list[tuple[Settings, tuple[str, ...]]] = []
    for index, entry in enumerate(load_models_file(settings.models_file)):
        if entry.kind != kind:
            continue
        own = entry.settings_for(settings, folder)
        checkpoint = own.resolved_model_path()
        if not any((checkpoint / name).is_file() for name in ("config.json", "tokenizer.json")):
            field = "path" if entry.path is not None else "name"
            raise ConfigurationError(
                f"XMARK_MODELS_FILE ({settings.models_file}): model {index + 1} ({entry.name!r}), "
                f"field '{field}': no checkpoint at {checkpoint}"
                + ("" if entry.path is not None else " (set 'path', or build the model there)")
            )
        served.append((own, entry.aliases))
    return served


@dataclass(frozen=True)
class ServedModel:
    """A model the gateway serves: its name, its backend and the settings its requests follow
    (None: the process's own, as without a models file)."""

    name: str
    backend: Backend
    settings: Settings | None = None
    aliases: tuple[str, ...] = ()

    def limits(self, process: Settings) -> Settings:
        """The settings this model's requests follow."""
        return process if self.settings is None else self.settings


class Fleet:
    """Every served chat model, by name and alias; the first is the default (listed first).

    ``embedding``: the names and aliases of the embedding models served beside them
    (``service.embeddings``): listed by ``names`` after the chat models, and a chat route naming
    one gets 404 saying so. Iterating the fleet yields the chat models only."""

    def __init__(self, models: Sequence[ServedModel], *, embedding: Sequence[tuple[str, tuple[str, ...]]] = ()) -> None:
        if not models:
            raise ValueError("a fleet serves at least one model")
        self._models = list(models)
        self._names: dict[str, int] = {}
        for index, model in enumerate(self._models):
            for name in (model.name, *model.aliases):
                if name in self._names:
                    raise ValueError(f"model name {name!r} is used twice")
                self._names[name] = index
        self._embedding_names = [name for name, _ in embedding]
        self._embedding: dict[str, str] = {}
        for name, aliases in embedding:
            for other in (name, *aliases):
                if other in self._names or other in self._embedding:
                    raise ValueError(f"model name {other!r} is used twice")
                self._embedding[other] = name

    @classmethod
    def single(cls, backend: Backend) -> Fleet:
        """A fleet of one model (a service built around one backend, as tests and benchmarks do)."""
        return cls([ServedModel(backend.model_id, backend)])

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models))

    def __len__(self) -> int:
        return len(self._models)

    @property
    def default(self) -> ServedModel:
        return self._models[0]

    def replace_backend(self, name: str, backend: Backend) -> None:
        """Serve ``name`` with ``backend`` from now on (tests: a backend that is loading)."""
        index = self._names[name]
        self._models[index] = replace(self._models[index], backend=backend)

    def resolve(self, name: str, *, param: str = "model") -> ServedModel:
        """The model a request names (by its name or an alias); 404 ``model_not_found`` otherwise."""
        index = self._names.get(name)
        if index is None:
            if name in self._embedding:
                raise NotFoundError(
                    f"The model '{name}' is an embedding model: it serves POST /v1/embeddings only",
                    param=param,
                    code="model_not_found",
                )
            raise NotFoundError(f"The model '{name}' does not exist", param=param, code="model_not_found")
        return self._models[index]

    def listed_name(self, name: str) -> str:
        """The name /v1/models lists for ``name`` (a served model's name or alias, chat or
        embedding); 404 ``model_not_found`` for any other."""
        if name in self._embedding:
            return self._embedding[name]
        return self.resolve(name).name

    def is_chat_model(self, name: str) -> bool:
        """Whether ``name`` is a served chat model's name or alias."""
        return name in self._names

    def names(self) -> list[str]:
        """Every served model's name (what /v1/models lists): the chat models, then the embedding models."""
        return [model.name for model in self._models] + self._embedding_names


# tokenizer object -> its fingerprint (tokenizers live as long as their backend: a few per process)
_fingerprints: dict[int, tuple[object, str]] = {}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what a tokenizer maps text to: two models with the same digest read a text in
    the same tokens (computed once per tokenizer object)."""
    cached = _fingerprints.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = backend.to_str()
    else:  # a slow tokenizer: its vocabulary and class
        described = type(tokenizer).__name__ + repr(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(described.encode()).hexdigest()
    _fingerprints[id(tokenizer)] = (tokenizer, digest)
    return digest


def models_by_tokenizer(
    models: Sequence[ServedModel],
) -> list[tuple[tuple[ServedModel, ...], PreTrainedTokenizerBase]]:
    """The models whose tokenizer has loaded, grouped by tokenizer (in the order of ``models``):
    models sharing one read a text in the same tokens, so it is tokenized (and counted) once."""
    groups: dict[str, tuple[list[ServedModel], PreTrainedTokenizerBase]] = {}
    for model in models:
        tokenizer = model.backend.tokenizer
        if tokenizer is None:
            continue
        group = groups.setdefault(tokenizer_fingerprint(tokenizer), ([], tokenizer))
        group[0].append(model)
    return [(tuple(members), tokenizer) for members, tokenizer in groups.values()]
