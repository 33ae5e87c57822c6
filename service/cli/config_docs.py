"""``xmark config-docs``: the configuration reference (docs/configuration.md), generated from ``Settings``.

Every row comes from a field of :class:`service.config.Settings`: its environment variable (the
``XMARK_`` prefix, or the names a ``validation_alias`` reads), its type and constraints, its
default and its ``description``. ``GROUPS`` sorts the fields into topics; a field in no group, or
in two, stops the generator. The output depends on the code only (never on the environment), so
tests/service/cli/test_configuration_docs.py can compare it with the committed file.
"""

from __future__ import annotations

import posixpath
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo

from service.config import Settings
from service.exceptions import ServiceError

# where the reference lives, relative to the repository root (links in descriptions are written
# from the root and rewritten relative to this file's folder)
REFERENCE_PATH = "docs/configuration.md"


@dataclass(frozen=True, kw_only=True)
class Group:
    """A topic of the reference: a heading, an optional note under it, and its fields in order."""

    title: str
    fields: tuple[str, ...]
    note: str = ""


GROUPS: tuple[Group, ...] = (
    Group(
        title="Server and processes",
        fields=("host", "port", "workers", "log_level", "api_docs"),
    ),
    Group(
        title="Database and local files",
        fields=(
            "database_url",
            "var_dir",
            "database_pool_size",
            "database_timeout_s",
            "sqlite_write_queue_timeout_s",
            "sqlite_synchronous",
        ),
    ),
    Group(
        title="Secrets",
        fields=("watermark_secrets", "secrets_file", "api_key_pepper", "report_signing_key", "bootstrap_admin_key"),
        note=(
            "A secret's value is never shown here. A secret is refused when it is shorter than 16 bytes, "
            "a placeholder (`changeme`, `example`, `secret`, …) or made of fewer than 4 distinct characters."
        ),
    ),
    Group(
        title="Watermark of new key versions",
        fields=(
            "watermark_scheme",
            "watermark_bits",
            "watermark_block_bits",
            "watermark_num_keys",
            "watermark_delta",
            "watermark_min_entropy",
            "watermark_salts",
            "watermark_sampling_min_temperature",
            "watermark_sampling_min_top_p",
            "keyring_refresh_seconds",
        ),
        note=(
            "These describe the key versions registered while they are set; every key version keeps the "
            "parameters stored with it, so its texts keep tracing "
            "([key versions](docs/service.md#secrets-and-key-versions)). vLLM workers read "
            "`XMARK_WATERMARK_SECRETS` (or `XMARK_SECRETS_FILE`), `XMARK_WATERMARK_SCHEME`, `_BITS`, "
            "`_BLOCK_BITS`, `_NUM_KEYS`, `_DELTA`, `_MIN_ENTROPY` and `_SALTS` as the gateway does, so one "
            "environment file configures both."
        ),
    ),
    Group(
        title="Models and backends",
        fields=(
            "backend",
            "model_name",
            "model_path",
            "models_dir",
            "models_file",
            "vllm_urls",
            "vllm_timeout_s",
            "vllm_health_interval_s",
            "vllm_api_key",
            "model_threads",
            "max_batch_size",
            "prefill_chunk_tokens",
        ),
    ),
    Group(
        title="Embedding models",
        fields=(
            "embedding_model",
            "embedding_model_path",
            "embedding_max_inputs",
            "embedding_max_input_chars",
            "embedding_max_input_tokens",
        ),
        note="See [embedding models](docs/service.md#embedding-models).",
    ),
    Group(
        title="Request limits",
        fields=(
            "max_prompt_chars",
            "max_prompt_tokens",
            "max_completion_tokens",
            "max_trace_chars",
            "max_body_bytes",
            "allow_logprobs",
            "max_top_logprobs",
        ),
        note=(
            "A models file can set `max_prompt_tokens`, `max_completion_tokens` and `max_queued_requests` per "
            "model ([docs/models.md](docs/models.md)); these are the defaults."
        ),
    ),
    Group(
        title="Admission and fairness",
        fields=(
            "max_queued_requests",
            "user_max_parallel_requests",
            "user_requests_per_minute",
            "user_tokens_per_minute",
            "end_users_max_per_account",
            "end_users_new_per_minute",
            "end_users_refusal_delay_s",
            "end_users_max_held_back",
            "end_users_ids_ahead",
            "end_users_reserve",
            "end_user_requests_per_minute",
            "end_user_tokens_per_minute",
            "redis_url",
            "redis_timeout_s",
            "request_timeout_s",
        ),
        note="See [limits and admission](docs/service.md#limits-and-admission).",
    ),
    Group(
        title="Generation records",
        fields=(
            "retain_completions",
            "record_before_response",
            "record_linger_ms",
            "record_backlog_limit",
            "record_spool_drain_interval_s",
        ),
    ),
    Group(
        title="Tracing (`/trace`)",
        fields=(
            "trace_alpha",
            "trace_temperature",
            "trace_top_k",
            "trace_likelihood_max_tokens",
            "trace_edit_rate",
            "trace_identity_level",
            "trace_scorer_dtype",
            "trace_warm_row_tokens",
        ),
    ),
    Group(
        title="Provenance",
        fields=(
            "provenance",
            "provenance_retention_days",
            "provenance_leads",
            "provenance_lead_similarity",
            "provenance_match_similarity",
        ),
    ),
    Group(
        title="Authentication",
        fields=(
            "auth_cache_ttl_s",
            "auth_cache_size",
            "auth_negative_cache_ttl_s",
            "auth_edge_failures",
            "auth_edge_window_s",
            "auth_edge_backoff_s",
            "auth_edge_backoff_max_s",
            "auth_edge_probe_interval_s",
            "auth_edge_refusal_delay_s",
            "auth_edge_max_delayed",
            "auth_edge_max_addresses",
            "auth_edge_known_keys",
            "auth_edge_known_key_ttl_s",
            "auth_edge_ipv6_prefix",
            "auth_edge_exempt",
            "trusted_proxies",
        ),
    ),
    Group(
        title="Slow and hostile clients",
        fields=("body_read_timeout_s", "keep_alive_timeout_s", "max_header_bytes", "max_connections"),
        note="See [database faults and slow clients](docs/service.md#database-faults-and-slow-clients).",
    ),
    Group(
        title="OpenTelemetry",
        fields=("otel_endpoint", "otel_traces_endpoint", "otel_service_name"),
        note="These use the standard OpenTelemetry names, without the `XMARK_` prefix.",
    ),
)

# what the Default column says of a secret (whose value is never printed) when it is unset
SECRET_DEFAULTS: dict[str, str] = {
    "watermark_secrets": "unset; generated on the embedded default",
    "api_key_pepper": "unset; generated on the embedded default",
    "report_signing_key": "unset; derived from the pepper",
}

INTRO = """\
# Configuration

Generated from the fields of `Settings` (`service/config.py`) by `make config-docs`; edit the
field descriptions there, not this file.

Every setting is read from the process environment when the gateway (or an `xmark` command)
starts. The variable names are the field names in capitals with the `XMARK_` prefix
(`XMARK_DATABASE_URL`); the OpenTelemetry settings use the standard OpenTelemetry names. Names
are matched without regard to case, and a variable that names no setting is ignored, so a
misspelt name has no effect. The gateway reads no `.env` file: `docker compose --env-file` and
Kubernetes Secrets put their values into the environment ([deploy/README.md](deploy/README.md)).
A value that does not fit its setting stops the start-up with a message naming the setting,
never the value. Lists are comma-separated. Where a description says "unset (or empty)", an
empty value (as a compose file or a ConfigMap passes an optional one) means unset.

Secrets come from the environment or a file: the watermark secrets from
`XMARK_WATERMARK_SECRETS` or from the file `XMARK_SECRETS_FILE` names, the API-key pepper from
`XMARK_API_KEY_PEPPER`. The embedded default (a `sqlite` `XMARK_DATABASE_URL`) generates a
missing watermark secret and pepper once, into `<XMARK_VAR_DIR>/watermark_secrets` and
`<XMARK_VAR_DIR>/api_key_pepper` (mode 0600, folder 0700), and reuses them on later starts. With
any other database the gateway refuses to start without both, and it always refuses
placeholder values.

A new installation mostly needs `XMARK_DATABASE_URL`, the secrets, `XMARK_BACKEND` (with
`XMARK_VLLM_URLS`), `XMARK_MODEL_NAME` or `XMARK_MODELS_FILE`, and `XMARK_HOST`, `XMARK_PORT`
and `XMARK_WORKERS`; the others have working defaults.
"""

_LINK = re.compile(r"\]\((?!https?://|#)([^)#\s]+)(#[^)\s]*)?\)")
_TYPE_NAMES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    Path: "path",
    SecretStr: "secret",
}
_BOUNDS: tuple[tuple[type[Any], str, str], ...] = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
)


class ConfigDocsError(ServiceError):
    """``GROUPS`` does not cover the fields of ``Settings`` exactly once."""


def grouped_fields() -> list[tuple[Group, list[tuple[str, FieldInfo]]]]:
    """The groups with their fields, checked: every field of ``Settings`` in exactly one group."""
    fields = Settings.model_fields
    placed = [name for group in GROUPS for name in group.fields]
    unknown = sorted(set(placed) - set(fields))
    twice = sorted({name for name in placed if placed.count(name) > 1})
    missing = [name for name in fields if name not in placed]
    if unknown or twice or missing:
        raise ConfigDocsError(f"GROUPS: unknown fields {unknown}, fields in two groups {twice}, in none {missing}")
    return [(group, [(name, fields[name]) for name in group.fields]) for group in GROUPS]


def env_names(name: str, field: FieldInfo) -> tuple[str, ...]:
    """The environment variables a field reads, the first one the documented name."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        choices = [choice for choice in alias.choices if isinstance(choice, str)]
    elif isinstance(alias, str):
        choices = [alias]
    else:
        prefix = Settings.model_config.get("env_prefix", "")
        choices = [prefix + name]
    return tuple(dict.fromkeys(choice.upper() for choice in choices))


def _is_secret(annotation: Any) -> bool:
    return annotation is SecretStr or SecretStr in typing.get_args(annotation)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args if arg is not type(None))
    if origin is Literal:
        values = [f"`{value}`" for value in args]
        return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
    if origin is list:
        return f"list of {_type_name(args[0])}s (comma-separated)"
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def type_text(field: FieldInfo) -> str:
    """The Type column: the type, and the bounds the field's constraints give."""
    bounds = [
        f"{sign} {_number(getattr(item, attr))}"
        for item in field.metadata
        for kind, attr, sign in _BOUNDS
        if isinstance(item, kind)
    ]
    name = _type_name(field.annotation)
    return f"{name}, {', '.join(bounds)}" if bounds else name


def default_text(name: str, field: FieldInfo) -> str:
    """The Default column; a secret's is never a value (and every secret's default is unset)."""
    if _is_secret(field.annotation):
        return SECRET_DEFAULTS.get(name, "unset")
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{','.join(str(item) for item in value)}`" if value else "empty"
    if isinstance(value, int | float):
        return f"`{_number(value)}`"
    return f"`{value}`" if str(value) else "empty"


def _relative_links(text: str) -> str:
    """Links written from the repository root, made relative to the reference's folder."""
    folder = posixpath.dirname(REFERENCE_PATH)

    def relative(match: re.Match[str]) -> str:
        return f"]({posixpath.relpath(match.group(1), folder)}{match.group(2) or ''})"

    return _LINK.sub(relative, text)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _variable_cell(name: str, field: FieldInfo) -> str:
    first, *others = env_names(name, field)
    return f"`{first}`" + (f" (also read: {', '.join(f'`{other}`' for other in others)})" if others else "")


def render() -> str:
    """The whole reference, as docs/configuration.md holds it."""
    lines = [_relative_links(INTRO).rstrip("\n")]
    for group, fields in grouped_fields():
        lines += ["", f"## {group.title}", ""]
        if group.note:
            lines += [_relative_links(group.note), ""]
        lines += ["| Variable | Type | Default | Description |", "|---|---|---|---|"]
        for name, field in fields:
            description = _relative_links(field.description or "")
            cells = (_variable_cell(name, field), type_text(field), default_text(name, field), description)
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines).rstrip("\n") + "\n"


def write(output: str | None) -> None:
    """Print the reference (``output`` None or ``-``), or write it to the file ``output``."""
    text = render()
    if output in (None, "-"):
        print(text, end="")
    else:
        Path(output).write_text(text, encoding="utf-8")
