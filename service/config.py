"""Gateway configuration: the one reader of the environment, and secret resolution.

`Settings` reads every ``XMARK_*`` variable. Secrets (watermark secrets per key version and the
API-key pepper) come from the environment or a secrets file; only the embedded default (SQLite)
may generate them, and then keeps them under ``var/`` with 0600 permissions.
"""

from __future__ import annotations

import os
import secrets as _secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.client_address import parse_networks
from service.security import ApiKeyFormatError, parse_api_key
from xmark_core.encoders import DEFAULT_CONFIGURED_SCHEME, ConfiguredScheme, KeyVersionSpec, spec_for
from xmark_core.secrets import (  # re-exported: the gateway's names for the shared rules
    KEY_VERSION_NAME,
    placeholder_reason,
)
from xmark_core.secrets import parse_secret_entries as _parse_secret_entries

WATERMARK_SECRETS_FILE = "watermark_secrets"
API_KEY_PEPPER_FILE = "api_key_pepper"
# the folder name of the local sentence-embedding checkpoint `xmark fetch-embedding-model` builds
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class ConfigurationError(Exception):
    """The configuration cannot be used; the message says what to change (never a secret)."""


def parse_secret_entries(text: str, *, source: str) -> dict[str, bytes]:
    """Parse ``name:secret`` entries separated by commas or new lines (``#`` starts a comment line).

    The rules are those of the vLLM workers (:func:`xmark_core.secrets.parse_secret_entries`);
    problems raise :class:`ConfigurationError`.
    """
    return _parse_secret_entries(text, source=source, error=ConfigurationError)


class Settings(BaseSettings):
    """Every setting of the gateway; environment variables use the ``XMARK_`` prefix."""

    model_config = SettingsConfigDict(env_prefix="XMARK_", extra="ignore", hide_input_in_errors=True)

    database_url: str = "sqlite+aiosqlite:///./var/xmark.db"
    var_dir: Path = Path("var")

    watermark_secrets: SecretStr | None = None
    secrets_file: Path | None = None
    # Parameters of new key versions. 32-bit IDs keep 10,000s of registered users far apart. The
    # scheme: ``auto`` (the default) gives each key version two encoders, chosen per request
    # (xmark_core.encoders): distortion-free keyed sampling (``gumbel``) where the request leaves
    # the model a choice (temperature >= XMARK_WATERMARK_SAMPLING_MIN_TEMPERATURE, no penalties or
    # logit_bias), the paper's XMark bias everywhere else (greedy, low temperatures, penalties), so no
    # request is refused or left unmarked for the watermark's sake. ``gumbel`` and ``xmark`` use one
    # encoder for every request (``gumbel`` refuses what it cannot carry); ``loso`` and ``mpac`` are
    # the baselines. docs/results/QUALITY.md compares them.
    watermark_bits: int = 32
    watermark_scheme: ConfiguredScheme = DEFAULT_CONFIGURED_SCHEME
    # Unset: the scheme's own (xmark_core.params): 8-bit blocks and 1 key for gumbel; 2-bit blocks and
    # k = 4 keys for the biasing schemes (k = 4 names the author of a short text more often than k = 2
    # at a small quality cost, docs/results/FORENSIC.md). Scheme auto: the block bits are its
    # distortion-free encoder's, the keys (and delta, min_entropy) its biasing encoder's.
    watermark_block_bits: int | None = None
    watermark_num_keys: int | None = None
    # Unset (or empty): 2.0 for a single biasing scheme, COMPANION_DELTA (4.0) for scheme auto's
    # biasing encoder (xmark_core.encoders; docs/results/TEMPERATURE.md).
    watermark_delta: float | None = None
    # The entropy rule of new key versions: positions where the model's min-entropy (-log of its top
    # token's probability, nats) is below this are not biased; 0 biases every position.
    watermark_min_entropy: float = 0.0
    # Scheme gumbel (and auto's distortion-free encoder): the salts its answers draw from
    # (WatermarkParams.salts). A user's consecutive answers take consecutive salts, so up to S answers
    # to one prompt are sampled independently; the decoders try all S (p-values x S). Unset: 16 for
    # gumbel, 1 (none) for the biasing schemes.
    watermark_salts: int | None = None
    # Scheme auto: the lowest temperature a request is written by the distortion-free encoder at;
    # below it (and for greedy requests, penalties, logit_bias) the biasing encoder writes it. 0.7:
    # the keyed sampler names the author of 98.0 % of 150-token texts at 0.7 but 56.5 % at 0.5 and
    # 2.0 % at 0.3 (docs/results/FORENSIC-GUMBEL8S16.md, FORENSIC-GUMBEL8S16-LOW.md).
    watermark_sampling_min_temperature: float = Field(default=0.7, gt=0.0, le=2.0)
    # Scheme auto: the lowest top_p a request is written by the distortion-free encoder at (a
    # nucleus of a few tokens is as near greedy as a low temperature); top_k = 1 never is. 0.9 is a
    # cautious bound: the keyed sampler's naming within a nucleus is measured at top_p 1 only.
    watermark_sampling_min_top_p: float = Field(default=0.9, gt=0.0, le=1.0)
    api_key_pepper: SecretStr | None = None
    # Trace reports are signed with an Ed25519 key derived from this secret (unset: from the
    # API-key pepper, under a label of its own); see docs/api.md, "Trace reports".
    report_signing_key: SecretStr | None = None

    backend: Literal["local", "vllm"] = "local"
    vllm_urls: Annotated[list[str], NoDecode] = []
    vllm_timeout_s: float = 60.0
    vllm_health_interval_s: float = 5.0
    vllm_api_key: SecretStr | None = None
    model_path: Path | None = None
    model_name: str = "smollm2-135m-instruct"
    # The folder of checkpoints named by their model: <models_dir>/<model name> is a model's
    # checkpoint unless XMARK_MODEL_PATH (or a models file's `path`) says otherwise. Unset: <var_dir>/models.
    models_dir: Path | None = None
    # Several models behind one gateway: a TOML file with one entry per served model (its name,
    # aliases, backend, checkpoint or workers, limits); see service/fleet.py and docs/models.md.
    # Unset: the one model the settings above describe.
    models_file: Path | None = None
    retain_completions: bool = False
    # A non-streamed completion is sent as soon as it exists and its generations rows are written
    # as the response ends (as a stream's are). True: sent only once its rows have committed.
    record_before_response: bool = False
    # The rows of a non-streamed completion already sent wait this long before they are written,
    # so that they do not compete with the client and the next request, and completions finishing
    # close together share one commit (0 writes at once); see docs/service.md.
    record_linger_ms: float = 20.0
    # While this many completions' records are being written (a slow or locked database), a
    # non-streamed completion is sent only once its own record is durable: the backlog of writes
    # after responses stays bounded and clients slow down instead of being refused.
    record_backlog_limit: int = 512

    # OpenTelemetry traces (service/telemetry.py): off unless an OTLP/HTTP endpoint is set, under
    # the standard OpenTelemetry variable names
    otel_endpoint: str | None = Field(
        default=None, validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "otel_endpoint")
    )
    otel_traces_endpoint: str | None = Field(
        default=None, validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "otel_traces_endpoint")
    )
    otel_service_name: str = Field(
        default="xmark-gateway", validation_alias=AliasChoices("OTEL_SERVICE_NAME", "otel_service_name")
    )

    # Log-probabilities in responses (vLLM backend): off by default. They describe the model's
    # distribution before the watermark bias, but with the sampled tokens they let a caller estimate
    # which tokens were boosted in a context (docs/api.md, "Log-probabilities and the watermark").
    allow_logprobs: bool = False
    max_top_logprobs: int = Field(default=5, ge=0, le=20)

    max_prompt_chars: int = 32_000
    max_completion_tokens: int = 1024
    max_trace_chars: int = 100_000
    max_body_bytes: int = 1_000_000

    log_level: str = "INFO"
    # /docs (Swagger UI), /redoc and /openapi.json, served from assets in the package (no CDN);
    # false switches all three off
    api_docs: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    bootstrap_admin_key: SecretStr | None = None
    trace_alpha: float = 1e-3
    # /trace: the null distributions of rows of up to this many tokens are simulated in the
    # background at start-up; larger rows on first use.
    trace_warm_row_tokens: int = 64
    # /trace's likelihood decoder: the sampling temperature it assumes (changes its power, never its
    # calibration), how many of the model's likeliest tokens per position it reads, and the longest
    # text (tokens) it scores; longer texts are read by counting alone.
    trace_temperature: float = 0.7
    trace_top_k: int = 20
    trace_likelihood_max_tokens: int = 2048
    # the share of a suspect text's tokens the likelihood decoder assumes were edited in (power
    # only, never calibration); 0 reads every token as the model's
    trace_edit_rate: float = 0.01
    # the likelihood decoder's identity test (xmark_core.identity_test): when set, a user is named
    # only if every other registered user is rejected at this level, which bounds the chance of
    # naming a wrong registered user on an unedited watermarked text without trusting the model;
    # it costs naming on short texts (docs/xmark_core.md). None: off unless a request asks for it.
    trace_identity_level: float | None = None
    # Provenance (service/provenance): a keyed content sketch of every completion is logged with
    # its record, and /trace retrieves the logged completions a suspect text resembles: leads, the
    # retrieved users' watermark test, and corroboration of a naming. "off" stores no sketch and
    # searches none.
    provenance: Literal["on", "off"] = "on"
    # sketches older than this many days are purged by `xmark purge-sketches` (0: kept for ever)
    provenance_retention_days: int = Field(default=365, ge=0)
    # the retrieved users whose message IDs /trace tests when the registry-wide test names nobody
    provenance_leads: int = Field(default=20, ge=1, le=1000)
    # a logged completion at least this similar to the suspect text is a lead (its user is tested)
    provenance_lead_similarity: float = Field(default=0.1, ge=0.0, le=1.0)
    # a named user's logged completion at least this similar corroborates the naming
    provenance_match_similarity: float = Field(default=0.3, gt=0.0, le=1.0)
    # the local backend's forward pass for /trace: bfloat16 where the CPU computes it natively
    # (auto), else float32; generation keeps float32
    trace_scorer_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    keyring_refresh_seconds: float = 30.0
    # `xmark serve`: gateway processes sharing the port (each with its own event loop, caches
    # and, on the local backend, its own copy of the model); see docs/service.md.
    workers: int = 1
    database_pool_size: int = 10
    # Authenticated API keys are remembered per process for this long (0 disables the cache).
    auth_cache_ttl_s: float = 5.0
    auth_cache_size: int = 10_000
    # Local backend: intra-op threads of the model (default: every core but one) and the most
    # rows (requests x n) one batched generate call takes.
    model_threads: int | None = None
    max_batch_size: int = 8
    # Local backend: the most prompt tokens read per model step (chunked prefill); a long prompt
    # is read in slices this long, with a decoding step of the running batch between two slices.
    # Larger than max_prompt_tokens: every prompt in one pass.
    prefill_chunk_tokens: int = Field(default=512, gt=0)

    # -- admission and fairness (docs/service.md, "Limits") --------------------------------------
    # Requests admitted to the backend but not finished yet (generating or waiting for it), per
    # process; one more is refused with 429 and Retry-After.
    max_queued_requests: int = 64
    # Per-user defaults (0: unlimited); an admin overrides them per user (PATCH /admin/users/{id}).
    user_max_parallel_requests: int = 8
    user_requests_per_minute: int = 600
    user_tokens_per_minute: int = 200_000
    # Counters shared by every replica (redis://host:port/db); unset: counted in each process.
    redis_url: SecretStr | None = None
    redis_timeout_s: float = 0.25
    # A chat request that has not finished in this many seconds ends with 504 (streams: an error event).
    request_timeout_s: float = 300.0
    # Prompt tokens (after the chat template) a request may carry; checked before the model runs.
    max_prompt_tokens: int = 8192

    # -- embeddings (docs/service.md, "Embedding models") ----------------------------------------
    embedding_model: str | None = Field(
        default=None,
        description=(
            "Without XMARK_MODELS_FILE: serve the local sentence-embedding checkpoint at POST "
            "/v1/embeddings under this name (e.g. all-minilm-l6-v2; `xmark fetch-embedding-model` "
            "builds it). Unset: no embedding model. With a models file, list it there "
            '(kind = "embedding").'
        ),
    )
    embedding_model_path: Path | None = Field(
        default=None,
        description=(
            "The local embedding checkpoint (default <XMARK_MODELS_DIR>/<XMARK_EMBEDDING_MODEL>, or "
            "<XMARK_MODELS_DIR>/all-minilm-l6-v2 for `xmark fetch-embedding-model` when no name is set)."
        ),
    )
    embedding_max_inputs: int = Field(
        default=256, ge=1, le=2048, description="The most texts one /v1/embeddings request may carry in `input`."
    )
    embedding_max_input_chars: int = Field(
        default=32_000, ge=1, description="The most characters one text of a /v1/embeddings `input` may have."
    )
    embedding_max_input_tokens: int = Field(
        default=8192,
        ge=1,
        description=(
            "The most tokens one text of a /v1/embeddings `input` may have (the model's own context "
            "bounds it further: 256 for all-MiniLM-L6-v2); a longer text is refused, never cut."
        ),
    )

    # -- slow and hostile clients ------------------------------------------------------------
    # The whole request body must arrive within this many seconds of the request head.
    body_read_timeout_s: float = 10.0
    # Idle keep-alive connections are closed after this many seconds; a request head larger than
    # max_header_bytes is refused; at most max_connections connections per process.
    keep_alive_timeout_s: float = 5.0
    max_header_bytes: int = 16_384
    max_connections: int = 1024
    # Refused API keys are remembered (by their HMAC) for this long, sparing the database.
    auth_negative_cache_ttl_s: float = 10.0
    # Failed authentications per client address (service/services/auth_edge.py, docs/service.md,
    # "Failed authentication at the edge"): after auth_edge_failures refusals within
    # auth_edge_window_s, an address is backed off for auth_edge_backoff_s, doubling on each
    # further failure up to auth_edge_backoff_max_s; while backed off, keys not known to be valid
    # are refused without a database read, except one read per auth_edge_probe_interval_s.
    # auth_edge_failures = 0 switches this off.
    auth_edge_failures: int = Field(default=20, ge=0)
    auth_edge_window_s: float = Field(default=60.0, gt=0)
    auth_edge_backoff_s: float = Field(default=1.0, gt=0)
    auth_edge_backoff_max_s: float = Field(default=60.0, gt=0)
    auth_edge_probe_interval_s: float = Field(default=1.0, gt=0)
    # a refusal at the edge is answered this late (at most auth_edge_max_delayed at once per
    # process, the rest at once), which slows a flood on a few connections to a few requests/s
    auth_edge_refusal_delay_s: float = Field(default=1.0, ge=0, le=30)
    auth_edge_max_delayed: int = Field(default=256, ge=0)
    # addresses tracked per process (least recently seen leave first), and keys remembered as
    # recently valid (by their HMAC, for auth_edge_known_key_ttl_s): those are never held back
    auth_edge_max_addresses: int = Field(default=100_000, ge=1)
    auth_edge_known_keys: int = Field(default=100_000, ge=1)
    auth_edge_known_key_ttl_s: float = Field(default=86_400.0, ge=0)
    # IPv6 clients are counted by their network of this many bits (a /64 is one subscriber's)
    auth_edge_ipv6_prefix: int = Field(default=64, ge=16, le=128)
    # Proxies whose X-Forwarded-For is believed (addresses or CIDRs, comma-separated); the client
    # is the right-most address in it that is not one of them. Empty: the peer is the client.
    trusted_proxies: Annotated[list[str], NoDecode] = []
    # Client addresses the budget above leaves alone (addresses or CIDRs, comma-separated; empty:
    # none). Loopback by default: health checks and other local processes, and a proxy on the same
    # host that is not in XMARK_TRUSTED_PROXIES (it would stand for every client behind it).
    auth_edge_exempt: Annotated[list[str], NoDecode] = ["127.0.0.0/8", "::1/128"]

    # -- database faults ---------------------------------------------------------------------
    # Connect, pool checkout and statement timeout of the requests' database work: past it the
    # client gets 503 database_unavailable with Retry-After.
    database_timeout_s: float = 1.0
    # SQLite (embedded default): the writes of a process take turns in a queue of its own; a write
    # that has not had its turn after this many seconds gets 503 database_unavailable. The wait for
    # another process's lock stays bounded by database_timeout_s (docs/service.md, "SQLite writes").
    sqlite_write_queue_timeout_s: float = Field(default=30.0, gt=0)
    # SQLite's synchronous setting (WAL journal): "full" syncs the log at every commit (a success
    # survives a power cut); "normal" syncs only at checkpoints (faster; a power cut or OS crash may
    # undo the last commits, though never corrupts the file).
    sqlite_synchronous: Literal["full", "normal"] = "full"
    # Generation records that cannot be written wait in a local spool (SQLite under var_dir) and
    # are drained into the database when it answers again, also after a restart.
    record_spool_drain_interval_s: float = 2.0

    @field_validator("watermark_salts", "watermark_block_bits", "watermark_num_keys", "watermark_delta", mode="before")
    @classmethod
    def _scheme_default_when_empty(cls, value: object) -> object:
        """An empty XMARK_WATERMARK_SALTS, _BLOCK_BITS, _NUM_KEYS or _DELTA (a compose or ConfigMap default)
        means unset: the scheme's own value."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("models_file", "models_dir", "embedding_model", "embedding_model_path", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # a deployment file passes an optional path as an empty variable (${VAR:-})
        return None if value == "" else value

    @field_validator("vllm_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            return [url.strip() for url in value.split(",") if url.strip()]
        return value

    @field_validator("trusted_proxies", "auth_edge_exempt", mode="before")
    @classmethod
    def _split_proxies(cls, value: object) -> object:
        if isinstance(value, str):
            return [entry.strip() for entry in value.split(",") if entry.strip()]
        return value

    @field_validator("trusted_proxies", "auth_edge_exempt")
    @classmethod
    def _ip_networks(cls, value: list[str]) -> list[str]:
        parse_networks(value)  # ValueError names the entry
        return value

    @field_validator("vllm_urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError("every worker URL must start with http:// or https://")
        return value

    @field_validator(
        "vllm_timeout_s", "vllm_health_interval_s", "database_timeout_s", "body_read_timeout_s", "keep_alive_timeout_s"
    )
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("user_max_parallel_requests", "user_requests_per_minute", "user_tokens_per_minute")
    @classmethod
    def _limit_or_unlimited(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be zero (unlimited) or positive")
        return value

    @field_validator("max_queued_requests", "max_prompt_tokens")
    @classmethod
    def _positive_admission_count(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @field_validator("request_timeout_s", "redis_timeout_s")
    @classmethod
    def _positive_admission_seconds(cls, value: float) -> float:
        if not value > 0:
            raise ValueError("must be a positive number of seconds")
        return value

    @field_validator("trace_temperature")
    @classmethod
    def _temperature_range(cls, value: float) -> float:
        if not 0.05 <= value <= 2.0:
            raise ValueError("must be between 0.05 and 2")
        return value

    @field_validator("trace_edit_rate")
    @classmethod
    def _edit_rate_range(cls, value: float) -> float:
        if not 0.0 <= value <= 0.5:
            raise ValueError("must be between 0 and 0.5")
        return value

    @field_validator("trace_identity_level")
    @classmethod
    def _identity_level_range(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError("must be a number between 0 and 1 (exclusive), or unset")
        return value

    @field_validator("trace_top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if not 1 <= value <= 100:
            raise ValueError("must be between 1 and 100")
        return value

    @field_validator("trace_likelihood_max_tokens")
    @classmethod
    def _max_tokens_range(cls, value: int) -> int:
        if not 3 <= value <= 100_000:
            raise ValueError("must be between 3 and 100000")
        return value

    @field_validator("record_backlog_limit")
    @classmethod
    def _backlog_range(cls, value: int) -> int:
        if not 1 <= value <= 1_000_000:
            raise ValueError("must be between 1 and 1000000")
        return value

    @field_validator("record_linger_ms")
    @classmethod
    def _linger_range(cls, value: float) -> float:
        if not 0 <= value <= 1000:
            raise ValueError("must be between 0 and 1000 milliseconds")
        return value

    @field_validator("auth_cache_ttl_s", "auth_negative_cache_ttl_s")
    @classmethod
    def _not_negative_seconds(cls, value: float) -> float:
        if not value >= 0:
            raise ValueError("must be zero (disabled) or a positive number of seconds")
        return value

    @field_validator("auth_cache_size", "max_batch_size", "workers", "max_header_bytes", "max_connections")
    @classmethod
    def _positive_count(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @field_validator("model_threads")
    @classmethod
    def _positive_threads(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive number of threads")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return level

    @field_validator("max_body_bytes", "max_prompt_chars", "max_completion_tokens", "max_trace_chars")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @field_validator("trace_warm_row_tokens")
    @classmethod
    def _warm_rows(cls, value: int) -> int:
        if not 0 <= value <= 4096:
            raise ValueError("must be between 0 (none) and 4096")
        return value

    @field_validator("bootstrap_admin_key")
    @classmethod
    def _well_formed_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            try:
                parse_api_key(value.get_secret_value())
            except ApiKeyFormatError as exc:
                raise ValueError(f"is not a well-formed API key ({exc})") from None
        return value

    @model_validator(mode="after")
    def _secrets_present(self) -> Settings:
        if self.watermark_secrets is not None and self.secrets_file is not None:
            raise ValueError("set either XMARK_WATERMARK_SECRETS or XMARK_SECRETS_FILE, not both")
        if self.watermark_secrets is not None:
            try:
                parse_secret_entries(self.watermark_secrets.get_secret_value(), source="XMARK_WATERMARK_SECRETS")
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        if self.api_key_pepper is not None:
            reason = placeholder_reason(self.api_key_pepper.get_secret_value())
            if reason is not None:
                raise ValueError(f"XMARK_API_KEY_PEPPER is {reason}")
        if self.report_signing_key is not None:
            reason = placeholder_reason(self.report_signing_key.get_secret_value())
            if reason is not None:
                raise ValueError(f"XMARK_REPORT_SIGNING_KEY is {reason}")
        if not self.embedded:
            if self.watermark_secrets is None and self.secrets_file is None:
                raise ValueError(
                    "a watermark secret is required outside the embedded SQLite default: "
                    "set XMARK_WATERMARK_SECRETS or XMARK_SECRETS_FILE"
                )
            if self.api_key_pepper is None:
                raise ValueError("XMARK_API_KEY_PEPPER is required outside the embedded SQLite default")
        if self.models_file is not None:
            clashing = [f"XMARK_{name.upper()}" for name in ("model_path", "vllm_urls") if getattr(self, name)]
            if clashing:
                raise ValueError(
                    f"XMARK_MODELS_FILE describes every served model: unset {' and '.join(clashing)} "
                    "(give each model's checkpoint or workers in the file)"
                )
        if self.models_file is not None and (self.embedding_model or self.embedding_model_path):
            raise ValueError(
                "XMARK_MODELS_FILE describes every served model: unset XMARK_EMBEDDING_MODEL and "
                'XMARK_EMBEDDING_MODEL_PATH (list the embedding model in the file, with kind = "embedding")'
            )
        try:
            self.watermark_spec()
        except ValueError as exc:
            raise ValueError(f"invalid watermark parameters: {exc}") from None
        return self

    def watermark_spec(self) -> KeyVersionSpec:
        """The encoders of new key versions, as configured (``xmark_core.encoders.spec_for``)."""
        return spec_for(
            self.watermark_scheme,
            bits=self.watermark_bits,
            block_bits=self.watermark_block_bits,
            num_keys=self.watermark_num_keys,
            delta=self.watermark_delta,
            min_entropy=self.watermark_min_entropy,
            salts=self.watermark_salts,
        )

    @property
    def embedded(self) -> bool:
        """True for the single-process SQLite default, which may generate its own secrets."""
        return self.database_url.startswith("sqlite")

    @property
    def resolved_models_dir(self) -> Path:
        """The folder of model checkpoints named by their model (``<var_dir>/models`` unless set)."""
        return self.models_dir if self.models_dir is not None else self.var_dir / "models"

    def resolved_model_path(self) -> Path:
        """Where the model checkpoint lives (``<models dir>/<model_name>`` unless configured)."""
        if self.model_path is not None:
            return self.model_path
        return self.resolved_models_dir / self.model_name

    def resolved_embedding_model_path(self) -> Path:
        """Where the local embedding checkpoint lives: ``XMARK_EMBEDDING_MODEL_PATH``, else
        ``<models dir>/<embedding_model>`` (``<models dir>/all-minilm-l6-v2`` when no name is set)."""
        if self.embedding_model_path is not None:
            return self.embedding_model_path
        return self.resolved_models_dir / (self.embedding_model or DEFAULT_EMBEDDING_MODEL)


@dataclass(frozen=True)
class ResolvedSecrets:
    """Secret material in memory only; ``repr`` never shows it."""

    watermark: dict[str, bytes] = field(repr=False)
    api_key_pepper: bytes = field(repr=False)
    watermark_source: Literal["env", "file", "generated"] = "env"
    # the secret the trace-report signing key is derived from (XMARK_REPORT_SIGNING_KEY or the pepper)
    report_signing: bytes = field(default=b"", repr=False)

    def all_values(self) -> list[bytes]:
        """Every secret value (for log scrubbing)."""
        return [*self.watermark.values(), self.api_key_pepper, *([self.report_signing] if self.report_signing else [])]


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)


def _read_private_file(path: Path) -> str:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        path.chmod(0o600)
    return path.read_text()


def _create_private_file(path: Path, content: str) -> bool:
    """Write ``content`` to a new file with 0600 permissions; False when it already exists."""
    _private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(content)
    return True


def _new_secret() -> str:
    return _secrets.token_urlsafe(32)


def load_secrets(settings: Settings) -> ResolvedSecrets:
    """Resolve the watermark secrets and the API-key pepper, generating them only when embedded."""
    if settings.watermark_secrets is not None:
        watermark = parse_secret_entries(
            settings.watermark_secrets.get_secret_value(), source="XMARK_WATERMARK_SECRETS"
        )
        source: Literal["env", "file", "generated"] = "env"
    elif settings.secrets_file is not None:
        try:
            text = settings.secrets_file.read_text()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read XMARK_SECRETS_FILE {settings.secrets_file}: {exc.strerror}"
            ) from None
        watermark = parse_secret_entries(text, source=f"secrets file {settings.secrets_file}")
        source = "file"
    elif settings.embedded:
        path = settings.var_dir / WATERMARK_SECRETS_FILE
        _create_private_file(path, f"v1:{_new_secret()}\n")
        watermark = parse_secret_entries(_read_private_file(path), source=str(path))
        source = "generated"
    else:
        raise ConfigurationError("no watermark secret configured")

    if settings.api_key_pepper is not None:
        pepper = settings.api_key_pepper.get_secret_value().encode()
    elif settings.embedded:
        path = settings.var_dir / API_KEY_PEPPER_FILE
        _create_private_file(path, _new_secret() + "\n")
        pepper = _read_private_file(path).strip().encode()
        reason = placeholder_reason(pepper)
        if reason is not None:
            raise ConfigurationError(f"{path}: the API-key pepper is {reason}")
    else:
        raise ConfigurationError("no API-key pepper configured")
    signing = settings.report_signing_key.get_secret_value().encode() if settings.report_signing_key else pepper
    return ResolvedSecrets(watermark=watermark, api_key_pepper=pepper, watermark_source=source, report_signing=signing)


def generate_embedded_secret(settings: Settings, name: str) -> bytes:
    """Append a newly generated secret for key version ``name`` to the embedded secrets file."""
    if not KEY_VERSION_NAME.match(name):
        raise ConfigurationError(f"key version name must match {KEY_VERSION_NAME.pattern}")
    path = settings.var_dir / WATERMARK_SECRETS_FILE
    existing = parse_secret_entries(_read_private_file(path), source=str(path))
    if name in existing:
        return existing[name]
    secret = _new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as handle:
        handle.write(f"{name}:{secret}\n")
    return secret.encode()
