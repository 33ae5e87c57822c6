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
from service.exceptions import ServiceError
from service.security import ApiKeyFormatError, parse_api_key
from xmark_core.encoders import (
    DEFAULT_CONFIGURED_SCHEME,
    DEFAULT_MESSAGE_BITS,
    ConfiguredScheme,
    KeyVersionSpec,
    spec_for,
)
from xmark_core.errors import XMarkError
from xmark_core.secrets import (  # re-exported: the gateway's names for the shared rules
    KEY_VERSION_NAME,
    placeholder_reason,
)
from xmark_core.secrets import parse_secret_entries as _parse_secret_entries

WATERMARK_SECRETS_FILE = "watermark_secrets"
API_KEY_PEPPER_FILE = "api_key_pepper"
# the folder name of the local sentence-embedding checkpoint `xmark fetch-embedding-model` builds
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class ConfigurationError(ServiceError):
    """The configuration cannot be used; the message says what to change (never a secret)."""


def parse_secret_entries(text: str, *, source: str) -> dict[str, bytes]:
    """Parse ``name:secret`` entries separated by commas or new lines (``#`` starts a comment line).

    The rules are those of the vLLM workers (:func:`xmark_core.secrets.parse_secret_entries`);
    problems raise :class:`ConfigurationError`.
    """
    return _parse_secret_entries(text, source=source, error=ConfigurationError)


class Settings(BaseSettings):
    """Every setting of the gateway; environment variables use the ``XMARK_`` prefix.

    Each field's description is its entry in docs/configuration.md (``xmark config-docs`` writes it).
    """

    model_config = SettingsConfigDict(env_prefix="XMARK_", extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        default="sqlite+aiosqlite:///./var/xmark.db",
        description=(
            "The database: `postgresql+asyncpg://…` in production. A `sqlite` URL is the embedded default: "
            "one machine, secrets generated on first start."
        ),
    )
    var_dir: Path = Field(
        default=Path("var"),
        description=(
            "The folder of the embedded database, the generated secrets, the spool of generation records "
            "(`spool/`) and, unless `XMARK_MODELS_DIR` is set, the model checkpoints (`models/`)."
        ),
    )

    watermark_secrets: SecretStr | None = Field(
        default=None,
        description=(
            "The watermark secrets per key version: `name:secret[,name:secret…]` (commas or new lines; each "
            "secret at least 16 bytes, no placeholders). Set this or `XMARK_SECRETS_FILE`, not both; one of "
            "them is required outside the embedded default, which generates a missing secret once into "
            "`<XMARK_VAR_DIR>/watermark_secrets`. vLLM workers read the same variable."
        ),
    )
    secrets_file: Path | None = Field(
        default=None,
        description=(
            "The alternative to `XMARK_WATERMARK_SECRETS`: a file with one `name:secret` entry per line "
            "(`#` starts a comment line)."
        ),
    )
    watermark_bits: int = Field(
        default=DEFAULT_MESSAGE_BITS,
        description=(
            "The message-ID length (bits) of new key versions; 64-bit IDs keep 10^7 registered users and end "
            "users far apart (32 bits name fewer short answers past 10^6). Existing versions keep their own (a "
            "32-bit version registered before keeps 32 bits and keeps tracing), and each user holds a message "
            "ID of every length in use ([details](docs/service.md#message-lengths-and-key-versions))."
        ),
    )
    watermark_scheme: ConfiguredScheme = Field(
        default=DEFAULT_CONFIGURED_SCHEME,
        description=(
            "The scheme of new key versions. `auto` gives each version two encoders under its secret, chosen "
            "per request (xmark_core.encoders): the distortion-free keyed sampler (`gumbel`: each token drawn "
            "with the key from the model's own distribution at the request's temperature, within its nucleus, "
            "so no answer's distribution changes) where the request leaves the model a choice (temperature at "
            "least `XMARK_WATERMARK_SAMPLING_MIN_TEMPERATURE`, no penalties or `logit_bias`), and the paper's "
            "XMark bias (`xmark`, k = 4) for greedy and low-temperature requests, narrow nuclei, penalties, "
            "`logit_bias` and `n` > 1 on vLLM workers, so no request is refused or left unmarked for the "
            "watermark's sake; `/trace` reads both. `gumbel` or `xmark` alone: one encoder for every request "
            "(`gumbel` refuses by name what it cannot carry); `loso` and `mpac` are the baselines. Served by the "
            "local backend and by vLLM workers, which read the same variables "
            "([details](docs/service.md#two-encoders-per-key-version-the-default); "
            "[docs/results/QUALITY.md](docs/results/QUALITY.md) compares the schemes)."
        ),
    )
    watermark_block_bits: int | None = Field(
        default=None,
        description=(
            "The bits per block of new key versions. Unset (or empty): the scheme's own (xmark_core.params), "
            "8 for `gumbel` and 2 for the biasing schemes; under `auto`, its distortion-free encoder's."
        ),
    )
    watermark_num_keys: int | None = Field(
        default=None,
        description=(
            "The keys (k) of new key versions. Unset (or empty): the scheme's own, 1 for `gumbel` and 4 for the "
            "biasing schemes (k = 4 names the author of a short text more often than k = 2 at a small quality "
            "cost, [docs/results/FORENSIC.md](docs/results/FORENSIC.md)); under `auto`, its biasing encoder's."
        ),
    )
    watermark_delta: float | None = Field(
        default=None,
        description=(
            "The bias (δ) of new key versions. Unset (or empty): 2.0 for a single biasing scheme, none for "
            "`gumbel`, and `COMPANION_DELTA` (4.0) for the biasing encoder of scheme `auto` (xmark_core.encoders): "
            "the smallest measured bias naming at least 95 % in every cell it serves "
            "([docs/results/TEMPERATURE.md](docs/results/TEMPERATURE.md)). `2.5` names more authors of short "
            "texts sampled cold, at a cost in quality "
            "([measured](docs/benchmarks.md#a-stronger-watermark-at-temperature-07))."
        ),
    )
    watermark_min_entropy: float = Field(
        default=0.0,
        description=(
            "The entropy rule of new key versions (nats): positions where the model's min-entropy (-log of its "
            "top token's probability) is below this are not biased; 0 biases every position. Each key version "
            "keeps its own rule, so its texts keep tracing. What it costs and buys: "
            "[docs/results/QUALITY.md](docs/results/QUALITY.md)."
        ),
    )
    watermark_salts: int | None = Field(
        default=None,
        description=(
            "Scheme `gumbel` (and the distortion-free encoder of `auto`): the salts its answers draw from "
            "(1–256, WatermarkParams.salts). A user's consecutive answers take consecutive salts, so up to that "
            "many answers to one prompt are sampled independently; `/trace` tries every salt (its p-values "
            "count them). Unset (or empty): 16 for `gumbel`, 1 (none) for the biasing schemes."
        ),
    )
    watermark_sampling_min_temperature: float = Field(
        default=0.7,
        gt=0.0,
        le=2.0,
        description=(
            "Scheme `auto`: the lowest temperature a request is written by the distortion-free encoder at; "
            "below it (and for greedy requests, penalties and `logit_bias`) the biasing encoder writes it. "
            "0.7: the keyed sampler names the author of 98.0 % of 150-token texts at 0.7 but 56.5 % at 0.5 and "
            "2.0 % at 0.3 ([docs/results/FORENSIC-GUMBEL8S16.md](docs/results/FORENSIC-GUMBEL8S16.md), "
            "[FORENSIC-GUMBEL8S16-LOW.md](docs/results/FORENSIC-GUMBEL8S16-LOW.md))."
        ),
    )
    watermark_sampling_min_top_p: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description=(
            "Scheme `auto`: the lowest `top_p` a request is written by the distortion-free encoder at (a "
            "nucleus of a few tokens is as near greedy as a low temperature); `top_k` = 1 never is. 0.9 is a "
            "cautious bound: the keyed sampler's naming within a nucleus is measured at `top_p` 1 only."
        ),
    )
    api_key_pepper: SecretStr | None = Field(
        default=None,
        description=(
            "The HMAC key of the stored API-key hashes (at least 16 bytes, no placeholders). Required outside "
            "the embedded default, which generates a missing one once into `<XMARK_VAR_DIR>/api_key_pepper`."
        ),
    )
    report_signing_key: SecretStr | None = Field(
        default=None,
        description=(
            "The secret the Ed25519 key that signs trace reports is derived from (HKDF, under a label of its "
            "own; the same rules as the pepper). Unset: derived from `XMARK_API_KEY_PEPPER`, under that label "
            "([trace reports](docs/api.md#trace-reports-signed-the-audit-log-and-the-report-key))."
        ),
    )

    backend: Literal["local", "vllm"] = Field(
        default="local",
        description=(
            "The model backend: `local` (an in-process transformers model with the XMark logits processor, on "
            "the CPU) or `vllm` (vLLM OpenAI servers at `XMARK_VLLM_URLS` running the XMark vLLM logits processor)."
        ),
    )
    vllm_urls: Annotated[list[str], NoDecode] = Field(
        default=[],
        description=(
            "vLLM backend: the worker URLs, comma-separated, each `http://` or `https://`; a request goes to the "
            "least busy healthy worker."
        ),
    )
    vllm_timeout_s: float = Field(
        default=60.0,
        description=(
            "vLLM backend: the longest wait for a worker's next bytes (its answer's head, each streamed token). "
            "A non-streamed answer, which only arrives once complete, is bounded by `XMARK_REQUEST_TIMEOUT_S`."
        ),
    )
    vllm_health_interval_s: float = Field(
        default=5.0, description="vLLM backend: the seconds between two health checks of each worker."
    )
    vllm_api_key: SecretStr | None = Field(default=None, description="vLLM backend: the API key the workers expect.")
    model_path: Path | None = Field(
        default=None,
        description="The model checkpoint. Unset: `<XMARK_MODELS_DIR>/<XMARK_MODEL_NAME>`.",
    )
    model_name: str = Field(
        default="smollm2-135m-instruct",
        description=(
            "The name clients use for the served model (a request's `model`), and its checkpoint's folder "
            "name under `XMARK_MODELS_DIR`."
        ),
    )
    models_dir: Path | None = Field(
        default=None,
        description=(
            "The folder of checkpoints named by their model: `<models dir>/<model name>` is a model's checkpoint "
            "unless `XMARK_MODEL_PATH` (or a models file's `path`) says otherwise. Unset (or empty): "
            "`<XMARK_VAR_DIR>/models`; the images set `/models`."
        ),
    )
    models_file: Path | None = Field(
        default=None,
        description=(
            "Several models behind one gateway: a TOML file with one entry per served model (its name, aliases, "
            "backend, checkpoint or workers, limits; service/fleet.py); `/trace` reads a text with every model. "
            "The file describes every served model, so `XMARK_MODEL_PATH`, `XMARK_VLLM_URLS`, "
            "`XMARK_EMBEDDING_MODEL` and `XMARK_EMBEDDING_MODEL_PATH` must be unset. Unset (or empty): the one "
            "model the other settings describe ([docs/models.md](docs/models.md); example: "
            "`deploy/models.example.toml`)."
        ),
    )
    retain_completions: bool = Field(
        default=False, description="Store completion texts in the generation records; otherwise only their SHA-256."
    )
    record_before_response: bool = Field(
        default=False,
        description=(
            "A completion is sent as soon as it exists and its generation rows are written as its response ends; "
            "a row the database cannot take in time waits in a durable local spool (`<XMARK_VAR_DIR>/spool/`) "
            "and is drained when the database is back. `true`: a non-streamed completion (and a stream's "
            "`[DONE]`) is sent only once its rows are durable ([details](docs/service.md#generation-records))."
        ),
    )
    record_linger_ms: float = Field(
        default=20.0,
        description=(
            "On PostgreSQL the rows of a non-streamed completion already sent wait this long (0–1000 ms) before "
            "they are written, so the write stays off the busy moment after the response and completions "
            "finishing close together share one commit; 0 writes at once "
            "([details](docs/service.md#generation-records))."
        ),
    )
    record_backlog_limit: int = Field(
        default=512,
        description=(
            "While this many completions' records are being written (a slow or locked database that has fallen "
            "behind), a non-streamed completion is sent only once its own record is durable: the backlog of "
            "writes after responses stays bounded and clients slow down instead of being refused (1–1,000,000; "
            "[details](docs/service.md#generation-records))."
        ),
    )

    # OpenTelemetry (service/telemetry.py) reads the standard OpenTelemetry variable names
    otel_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "otel_endpoint"),
        description=(
            "OpenTelemetry traces of each request (auth, queue, model with `gen_ai.*` attributes, record, trace) "
            "are exported over OTLP/HTTP to this endpoint (`/v1/traces` appended); off unless it or "
            "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set. They never carry prompts, completions or keys "
            "([details](docs/service.md#tracing-with-opentelemetry))."
        ),
    )
    otel_traces_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "otel_traces_endpoint"),
        description=(
            "The OTLP/HTTP endpoint of the traces, used as it is; it takes precedence over "
            "`OTEL_EXPORTER_OTLP_ENDPOINT`."
        ),
    )
    otel_service_name: str = Field(
        default="xmark-gateway",
        validation_alias=AliasChoices("OTEL_SERVICE_NAME", "otel_service_name"),
        description="The service name the exported traces carry.",
    )

    allow_logprobs: bool = Field(
        default=False,
        description=(
            "Serve `logprobs`/`top_logprobs` (off: refused with 400 `unsupported_parameter`). They describe the "
            "model's distribution before the watermark bias, but with the sampled tokens they let a caller "
            "estimate which tokens were boosted in a context: allow them only for trusted callers "
            "([docs/api.md](docs/api.md#log-probabilities-and-the-watermark))."
        ),
    )
    max_top_logprobs: int = Field(
        default=5,
        ge=0,
        le=20,
        description="The most `top_logprobs` a request may ask for when log-probabilities are allowed.",
    )

    max_prompt_chars: int = Field(
        default=32_000,
        description="The most characters a request's prompt may have; a longer one gets 400 `context_length_exceeded`.",
    )
    max_completion_tokens: int = Field(
        default=1024,
        description=(
            "The most tokens a completion may ask for (`max_tokens`, `max_completion_tokens`; more is refused "
            "with 400 `invalid_value`), and what a chat request that asks for none gets."
        ),
    )
    max_trace_chars: int = Field(
        default=100_000, description="The longest text `/trace` takes, in characters; a longer one gets 413."
    )
    max_body_bytes: int = Field(default=1_000_000, description="Larger request bodies get 413.")

    log_level: str = Field(
        default="INFO",
        description="The level of the JSON-lines logs on stderr: DEBUG, INFO, WARNING, ERROR or CRITICAL.",
    )
    api_docs: bool = Field(
        default=True,
        description=(
            "Interactive API docs at `/docs` (Swagger UI) and `/redoc`, served from assets in the package (no "
            "CDN: they work offline), and the schema at `/openapi.json`; `false` switches all three off."
        ),
    )
    host: str = Field(default="127.0.0.1", description="The listen address (`xmark serve --host` overrides it).")
    port: int = Field(default=8000, description="The listen port (`xmark serve --port` overrides it).")
    bootstrap_admin_key: SecretStr | None = Field(
        default=None,
        description=(
            "When set and no admin exists at start-up, this well-formed API key becomes the first admin's key."
        ),
    )
    trace_alpha: float = Field(
        default=1e-3,
        description=(
            "The significance level of `/trace` verdicts: `watermarked` is the detection verdict at this level, "
            "and a user is named only when the best candidate's p-value, corrected for the registry size, is "
            "below it."
        ),
    )
    trace_warm_row_tokens: int = Field(
        default=64,
        description=(
            "At start-up, in the background, the null distributions of `/trace`'s test are simulated for block "
            "rows of up to this many tokens (enough for texts of about 800 tokens at b = 32 and 400 at b = 16, "
            "d = 2): about 0.1 s of one core per row size. A larger row size costs that much inside the first "
            "request that meets it. 0 (none) to 4096; 0 turns the warm-up off."
        ),
    )
    trace_temperature: float = Field(
        default=0.7,
        description=(
            "The sampling temperature `/trace`'s likelihood decoder assumes (0.05–2): it changes the decoder's "
            "power, never its calibration ([details](docs/api.md#post-trace))."
        ),
    )
    trace_top_k: int = Field(
        default=20,
        description="How many of the model's likeliest tokens per position the likelihood decoder reads (1–100).",
    )
    trace_likelihood_max_tokens: int = Field(
        default=2048,
        description=(
            "The longest text (tokens, 3–100,000) the likelihood decoder scores; longer texts are read by "
            "counting alone."
        ),
    )
    trace_edit_rate: float = Field(
        default=0.01,
        description=(
            "The share of a suspect text's tokens (0–0.5) the likelihood decoder assumes were edited in rather "
            "than generated: a token the model would not have written then weighs nothing instead of "
            "everything. It changes power under substitutions, never calibration; 0 reads every token as the "
            "model's ([details](docs/xmark_core.md#the-likelihood-decoder))."
        ),
    )
    trace_identity_level: float | None = Field(
        default=None,
        description=(
            "The likelihood decoder's identity test (xmark_core.identity_test): when set (between 0 and 1), a "
            "user is named only if every other registered user is rejected at this level, which bounds the "
            "chance of naming a wrong registered user on an unedited watermarked text without trusting the "
            "model; it costs naming on short texts "
            "([docs/xmark_core.md](docs/xmark_core.md#which-registered-user-the-identity-test-opt-in)). "
            "Unset: off unless a request asks for it with `identity_level`; a request may only make it stricter "
            "([details](docs/api.md#post-trace))."
        ),
    )
    provenance: Literal["on", "off"] = Field(
        default="on",
        description=(
            "A keyed content sketch of every completion (hashes, never the text) is logged with its record "
            "(service/provenance), and `/trace` retrieves the logged completions a suspect text resembles: "
            "leads, the retrieved users' watermark test, and corroboration of a naming. `off` stores no sketch "
            "and searches none ([details](docs/service.md#provenance-the-generation-log-as-second-witness))."
        ),
    )
    provenance_retention_days: int = Field(
        default=365,
        ge=0,
        description=(
            "Sketches older than this many days are dropped by `xmark purge-sketches` (the records stay); "
            "0 keeps them for ever."
        ),
    )
    provenance_leads: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="The retrieved users whose message IDs `/trace` tests when the registry-wide test names nobody.",
    )
    provenance_lead_similarity: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="A logged completion at least this similar to the suspect text is a lead (its user is tested).",
    )
    provenance_match_similarity: float = Field(
        default=0.3,
        gt=0.0,
        le=1.0,
        description="A named user's logged completion at least this similar to the text corroborates the naming.",
    )
    trace_scorer_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description=(
            "The local backend's forward pass for `/trace`: `auto` is `bfloat16` where the CPU computes it "
            "natively (AVX512-BF16, AMX, Arm BF16; about half the time of `float32`) and `float32` elsewhere; "
            "generation stays `float32` "
            "([details](docs/benchmarks.md#trace-throughput-with-the-likelihood-decoder))."
        ),
    )
    keyring_refresh_seconds: float = Field(
        default=30.0,
        description="How often each replica re-reads key-version changes made elsewhere, in seconds (0: never).",
    )
    workers: int = Field(
        default=1,
        description=(
            "`xmark serve`: gateway processes sharing the port (`--workers N` overrides it), each a replica with "
            "its own event loop, caches and, on the local backend, its own copy of the model; `/metrics` sums "
            "them ([details](docs/service.md#worker-processes))."
        ),
    )
    database_pool_size: int = Field(
        default=10,
        description=(
            "PostgreSQL connections kept per process (plus up to 10 more under load, and one each for the "
            "generation and trace records)."
        ),
    )
    auth_cache_ttl_s: float = Field(
        default=5.0,
        description=(
            "Authenticated API keys are remembered per process (by their HMAC) for this long (0 disables the "
            "cache). Revoking, disabling or deleting through a replica applies there at once; other replicas "
            "accept the old state for up to this long ([details](docs/service.md#authentication-cache))."
        ),
    )
    auth_cache_size: int = Field(default=10_000, description="The most authenticated API keys a process remembers.")
    model_threads: int | None = Field(
        default=None, description="Local backend: the model's intra-op threads. Unset: every core but one."
    )
    max_batch_size: int = Field(
        default=8, description="Local backend: the most rows (requests × `n`) one batched generate call takes."
    )
    prefill_chunk_tokens: int = Field(
        default=512,
        gt=0,
        description=(
            "Local backend: the most prompt tokens read per model step (chunked prefill). A long prompt is read "
            "in slices this long, with a decoding step of the running batch between two slices, and a prompt "
            "whose client left stops at the next slice. Larger than `XMARK_MAX_PROMPT_TOKENS`: every prompt in "
            "one pass ([details](docs/service.md#limits-and-admission))."
        ),
    )

    # -- admission and fairness (docs/service.md, "Limits and admission") ----------------------
    max_queued_requests: int = Field(
        default=64,
        description=(
            "Requests admitted to the backend but not finished yet (generating or waiting for it), per process; "
            "one more is refused with 429 (`param: queue`) and `Retry-After`."
        ),
    )
    user_max_parallel_requests: int = Field(
        default=8,
        description=(
            "A user's requests in flight at once, by default (0: unlimited); an admin overrides it per user "
            "(`PATCH /admin/users/{id}`). Past any per-user limit: 429 `rate_limit_exceeded` with `Retry-After`, "
            "`param` naming the limit ([details](docs/service.md#limits-and-admission))."
        ),
    )
    user_requests_per_minute: int = Field(
        default=600,
        description="A user's requests per minute, by default (0: unlimited); an admin overrides it per user.",
    )
    user_tokens_per_minute: int = Field(
        default=200_000,
        description="A user's tokens per minute, by default (0: unlimited); an admin overrides it per user.",
    )
    end_users_max_per_account: int = Field(
        default=1_000_000,
        description=(
            "The most end users (`safety_identifier`, `user`, `metadata.user_id`) one account may have, deleted "
            "ones included (0: unlimited), by default; an admin overrides it per account (`end_users_max` on "
            "`PATCH /admin/users/{id}`). A request naming a new end user past it gets 429 "
            "`end_user_limit_exceeded`."
        ),
    )
    end_users_new_per_minute: int = Field(
        default=600,
        description=(
            "The most end users one account may add per minute (0: unlimited), by default; an admin overrides it "
            "per account (`end_users_new_per_minute`). A request naming a new end user past it gets 429 "
            "`end_user_limit_exceeded`."
        ),
    )
    end_users_refusal_delay_s: float = Field(
        default=1.0,
        ge=0,
        le=30,
        description=(
            "A request refused for an account's end-user caps (429 `end_user_limit_exceeded`) is answered this "
            "many seconds late (0: at once), so that an account flooding new identifiers over a few connections "
            "sends a few a second and leaves the gateway to the others. Once an account is found at a cap, its "
            "new identifiers are refused without a count for `XMARK_AUTH_CACHE_TTL_S` seconds."
        ),
    )
    end_users_ids_ahead: int = Field(
        default=16,
        ge=0,
        le=1024,
        description=(
            "Message IDs each process draws ahead, per length in use, for end users' first sights (0: each first "
            "sight draws its own, reading every registered ID of the length below 10^5 of them)."
        ),
    )
    end_users_reserve: int = Field(
        default=8,
        ge=0,
        le=256,
        description=(
            "End-user slots each process reserves ahead per account with first sights (rows with their message "
            "IDs, counted within the account's caps). A first sight takes one and is claimed for its identifier "
            "in the background, after its answer; with the account's identifiers known to the process (read "
            "every `XMARK_AUTH_CACHE_TTL_S`), an identifier surely new costs no statement on the request path "
            "(0: each first sight creates its end user on the request path). Unused slots are given back when "
            "the process stops, and those a killed process left, an hour without renewal, when the account "
            "reaches its cap."
        ),
    )
    end_users_max_held_back: int = Field(
        default=256,
        ge=0,
        description="The most end-user cap refusals a process holds back at once; the others are answered at once.",
    )
    end_user_requests_per_minute: int = Field(
        default=60,
        description=(
            "The requests one end user of an account may start per minute, by default (0: unlimited); counted "
            "apart for each end user, under the account's own limits, which still apply. An admin overrides it "
            "per account (`PATCH /admin/users/{id}`) and per end user. Past it: 429 "
            "`end_user_rate_limit_exceeded` with `Retry-After`; the account's other end users are not held back "
            "([details](docs/service.md#end-users))."
        ),
    )
    end_user_tokens_per_minute: int = Field(
        default=50_000,
        description=(
            "The tokens (prompt plus n x max_tokens, reserved as for the account) one end user may use per "
            "minute, by default (0: unlimited); overridden per account and per end user like "
            "`XMARK_END_USER_REQUESTS_PER_MINUTE`."
        ),
    )
    redis_url: SecretStr | None = Field(
        default=None,
        description=(
            "Per-user counters shared by every replica through Redis (`redis://host:port/db`). Unset: counted in "
            "each process. When Redis is down or slow, each process counts alone (logged and counted, never an "
            "error)."
        ),
    )
    redis_timeout_s: float = Field(
        default=0.25,
        description="The longest wait for Redis: a slower answer counts as Redis down (the process counts alone).",
    )
    request_timeout_s: float = Field(
        default=300.0,
        description=(
            "A chat request that has not finished in this many seconds ends with 504 `request_timeout` (a stream: "
            "an error event); its generation stops."
        ),
    )
    max_prompt_tokens: int = Field(
        default=8192,
        description=(
            "The prompt tokens (after the chat template) a request may carry, checked before the model runs: "
            "400 `context_length_exceeded`."
        ),
    )

    # -- embeddings (docs/service.md, "Embedding models") ----------------------------------------
    embedding_model: str | None = Field(
        default=None,
        description=(
            "Without `XMARK_MODELS_FILE`: serve the local sentence-embedding checkpoint at `POST "
            "/v1/embeddings` under this name (e.g. `all-minilm-l6-v2`; `xmark fetch-embedding-model` "
            "builds it). Unset (or empty): no embedding model. With a models file, list it there "
            '(`kind = "embedding"`).'
        ),
    )
    embedding_model_path: Path | None = Field(
        default=None,
        description=(
            "The local embedding checkpoint. Unset (or empty): `<XMARK_MODELS_DIR>/<XMARK_EMBEDDING_MODEL>`, or "
            "`<XMARK_MODELS_DIR>/all-minilm-l6-v2` for `xmark fetch-embedding-model` when no name is set."
        ),
    )
    embedding_max_inputs: int = Field(
        default=256, ge=1, le=2048, description="The most texts one `/v1/embeddings` request may carry in `input`."
    )
    embedding_max_input_chars: int = Field(
        default=32_000, ge=1, description="The most characters one text of a `/v1/embeddings` `input` may have."
    )
    embedding_max_input_tokens: int = Field(
        default=8192,
        ge=1,
        description=(
            "The most tokens one text of a `/v1/embeddings` `input` may have (the model's own context "
            "bounds it further: 256 for all-MiniLM-L6-v2); a longer text is refused, never cut."
        ),
    )

    # -- slow and hostile clients ------------------------------------------------------------
    body_read_timeout_s: float = Field(
        default=10.0,
        description="The whole request body must arrive within this many seconds of the request head; else 408.",
    )
    keep_alive_timeout_s: float = Field(
        default=5.0,
        description="Idle keep-alive connections, and request heads that trickle, are closed after this many seconds.",
    )
    max_header_bytes: int = Field(default=16_384, description="A larger request head is refused with 431.")
    max_connections: int = Field(
        default=1024,
        description=(
            "Connections per process; beyond the cap 503 `overloaded` (open connections only: requests whose "
            "records are still being written do not count)."
        ),
    )
    auth_negative_cache_ttl_s: float = Field(
        default=10.0,
        description=(
            "Refused API keys are remembered (by their HMAC) for this long, so repeating one costs no database "
            "query (0: off)."
        ),
    )
    auth_edge_failures: int = Field(
        default=20,
        ge=0,
        description=(
            "Failed authentications per client address (service/services/auth_edge.py): after this many refused "
            "keys within `XMARK_AUTH_EDGE_WINDOW_S`, an address is backed off, and while it is, keys not known to "
            "be valid get their 401 without a database read. Keys known to be valid always pass. 0 switches this "
            "off ([details](docs/service.md#failed-authentication-at-the-edge))."
        ),
    )
    auth_edge_window_s: float = Field(
        default=60.0, gt=0, description="The window in which `XMARK_AUTH_EDGE_FAILURES` refusals back an address off."
    )
    auth_edge_backoff_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "An address's first back-off, doubling on each further failure up to `XMARK_AUTH_EDGE_BACKOFF_MAX_S`."
        ),
    )
    auth_edge_backoff_max_s: float = Field(default=60.0, gt=0, description="The longest back-off of an address.")
    auth_edge_probe_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="While an address is backed off, one database read per this many seconds is still made for it.",
    )
    auth_edge_refusal_delay_s: float = Field(
        default=1.0,
        ge=0,
        le=30,
        description=(
            "A refusal at the edge is answered this late (at most `XMARK_AUTH_EDGE_MAX_DELAYED` at once per "
            "process, the rest at once), which slows a flood on a few connections to a few requests per second."
        ),
    )
    auth_edge_max_delayed: int = Field(
        default=256,
        ge=0,
        description="The most refusals a process holds back at once; the others are answered at once.",
    )
    auth_edge_max_addresses: int = Field(
        default=100_000, ge=1, description="Client addresses tracked per process; the least recently seen leave first."
    )
    auth_edge_known_keys: int = Field(
        default=100_000,
        ge=1,
        description=(
            "Keys remembered per process as recently valid (by their HMAC, for `XMARK_AUTH_EDGE_KNOWN_KEY_TTL_S`): "
            "those are never held back."
        ),
    )
    auth_edge_known_key_ttl_s: float = Field(
        default=86_400.0, ge=0, description="How long a key stays known as recently valid, in seconds."
    )
    auth_edge_ipv6_prefix: int = Field(
        default=64,
        ge=16,
        le=128,
        description="IPv6 clients are counted by their network of this many bits (a /64 is one subscriber's).",
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default=[],
        description=(
            "Proxies whose `X-Forwarded-For` is believed (addresses or CIDRs, comma-separated); the client is the "
            "right-most address in it that is not one of them. Empty: the peer is the client."
        ),
    )
    auth_edge_exempt: Annotated[list[str], NoDecode] = Field(
        default=[],
        description=(
            "Client addresses the per-address budget of failed authentications leaves alone (addresses or CIDRs, "
            "comma-separated). Empty by default: every address that can send a key is counted, loopback too, since "
            "a proxy on the same host that is not in `XMARK_TRUSTED_PROXIES` stands for every client behind it. "
            "Health probes send no key and are never counted. Opt in for a local tool that must never be backed "
            "off, for example `127.0.0.0/8,::1/128`."
        ),
    )

    # -- database faults ---------------------------------------------------------------------
    database_timeout_s: float = Field(
        default=1.0,
        description=(
            "The bound of each database step of a request (connect, pool checkout, statement): past it the client "
            "gets 503 `database_unavailable` with `Retry-After` "
            "([details](docs/service.md#database-faults-and-slow-clients))."
        ),
    )
    sqlite_write_queue_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "SQLite (embedded default): the writes of a process take turns in a queue of its own; a write that has "
            "not had its turn after this many seconds gets 503 `database_unavailable`. The wait for another "
            "process's lock stays bounded by `XMARK_DATABASE_TIMEOUT_S` "
            "([details](docs/service.md#database-faults-and-slow-clients))."
        ),
    )
    sqlite_synchronous: Literal["full", "normal"] = Field(
        default="full",
        description=(
            "SQLite's synchronous setting (WAL journal): `full` syncs the log at every commit (a success survives "
            "a power cut); `normal` syncs only at checkpoints (faster; a power cut or OS crash may undo the last "
            "commits, though it never corrupts the file)."
        ),
    )
    record_spool_drain_interval_s: float = Field(
        default=2.0,
        description=(
            "Generation records that cannot be written wait in a local spool (SQLite under `XMARK_VAR_DIR`) and "
            "are drained into the database when it answers again, also after a restart: this often, in seconds, "
            "and at start-up."
        ),
    )

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

    @field_validator(
        "user_max_parallel_requests",
        "user_requests_per_minute",
        "user_tokens_per_minute",
        "end_users_max_per_account",
        "end_users_new_per_minute",
        "end_user_requests_per_minute",
        "end_user_tokens_per_minute",
    )
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
        except XMarkError as exc:  # the library's parameter checks (ParamsError, ArgumentError)
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
