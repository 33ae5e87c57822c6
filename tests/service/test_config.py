"""Configuration: placeholder and missing secrets are refused outside the embedded default."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from service.config import (
    API_KEY_PEPPER_FILE,
    WATERMARK_SECRETS_FILE,
    ConfigurationError,
    Settings,
    generate_embedded_secret,
    load_secrets,
    placeholder_reason,
)
from service.security import generate_api_key

PG = "postgresql+asyncpg://root@127.0.0.1:5432/test"
GOOD_SECRET = "Zq8r-2mV7xK1pL9wT4nB6yH3"
GOOD_PEPPER = "pepper-7Hq2Lx9Vb4Nm1Ks8Rt5Y"


def _settings(**values: object) -> Settings:
    return Settings(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "secret",
    [
        "changeme",
        "changeme-changeme-changeme",
        "CHANGEME1234567890",
        "short-secret",
        "x" * 40,
        "your-secret-goes-here-please",
        "replace-me-with-a-real-one",
    ],
)
def test_placeholder_watermark_secrets_are_refused(secret: str) -> None:
    with pytest.raises(ValidationError) as info:
        _settings(database_url=PG, watermark_secrets=SecretStr(f"v1:{secret}"), api_key_pepper=SecretStr(GOOD_PEPPER))
    assert "v1" in str(info.value)
    assert secret not in str(info.value)


@pytest.mark.parametrize("pepper", ["changeme", "secret", "0123456789", "placeholder-placeholder"])
def test_placeholder_pepper_is_refused(pepper: str) -> None:
    with pytest.raises(ValidationError) as info:
        _settings(database_url=PG, watermark_secrets=SecretStr(f"v1:{GOOD_SECRET}"), api_key_pepper=SecretStr(pepper))
    assert "PEPPER" in str(info.value)
    assert pepper not in str(info.value).replace("XMARK_API_KEY_PEPPER", "")


def test_missing_secrets_are_refused_outside_embedded_mode() -> None:
    with pytest.raises(ValidationError, match="watermark secret is required"):
        _settings(database_url=PG, api_key_pepper=SecretStr(GOOD_PEPPER))
    with pytest.raises(ValidationError, match="XMARK_API_KEY_PEPPER is required"):
        _settings(database_url=PG, watermark_secrets=SecretStr(f"v1:{GOOD_SECRET}"))


@pytest.mark.parametrize(
    "value",
    ["v1", "v1:", ":secretsecretsecret1", "bad name:Zq8r-2mV7xK1pL9wT4nB6yH3", f"v1:{GOOD_SECRET},v1:{GOOD_SECRET}x"],
)
def test_malformed_secret_lists_are_refused(value: str) -> None:
    with pytest.raises(ValidationError):
        _settings(database_url=PG, watermark_secrets=SecretStr(value), api_key_pepper=SecretStr(GOOD_PEPPER))


def test_env_and_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not both"):
        _settings(
            database_url=PG,
            watermark_secrets=SecretStr(f"v1:{GOOD_SECRET}"),
            secrets_file=tmp_path / "s",
            api_key_pepper=SecretStr(GOOD_PEPPER),
        )


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XMARK_DATABASE_URL", PG)
    monkeypatch.setenv("XMARK_WATERMARK_SECRETS", f"v1:{GOOD_SECRET},v2:{GOOD_SECRET}-2")
    monkeypatch.setenv("XMARK_API_KEY_PEPPER", GOOD_PEPPER)
    monkeypatch.setenv("XMARK_MAX_BODY_BYTES", "1234")
    settings = Settings()
    assert settings.max_body_bytes == 1234 and not settings.embedded
    secrets = load_secrets(settings)
    assert list(secrets.watermark) == ["v1", "v2"]
    assert GOOD_SECRET not in repr(settings) and GOOD_SECRET not in repr(secrets)
    assert settings.resolved_model_path() == Path("var/models/smollm2-135m-instruct")


def test_new_key_versions_default_to_both_encoders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, new key versions carry two encoders (scheme ``auto``): the distortion-free ``gumbel`` in
    8-bit blocks with 1 key and 16 salts, and the paper's ``xmark`` in 2-bit blocks with 4 keys at the
    companion's bias (COMPANION_DELTA, where a single ``xmark`` version keeps 2.0), both of 64 bits
    (DEFAULT_MESSAGE_BITS); naming one scheme gives that scheme alone with its own defaults; empty values (compose
    and ConfigMap defaults) are unset; explicit values win (under ``auto``: block bits and salts the
    primary's, keys and delta the companion's)."""
    from service.keyring import params_from_settings, spec_from_settings
    from xmark_core import WatermarkParams
    from xmark_core.encoders import COMPANION_DELTA, KeyVersionSpec

    monkeypatch.delenv("XMARK_WATERMARK_SCHEME", raising=False)  # the suite pins the biasing scheme
    gumbel = WatermarkParams(bits=64, block_bits=8, num_keys=1, scheme="gumbel", salts=16)
    assert COMPANION_DELTA != 2.0
    assert spec_from_settings(Settings()) == KeyVersionSpec(
        gumbel, WatermarkParams(bits=64, block_bits=2, num_keys=4, delta=COMPANION_DELTA, scheme="xmark")
    )
    monkeypatch.setenv("XMARK_WATERMARK_DELTA", "")  # the compose and ConfigMap default: unset
    assert spec_from_settings(Settings()).companion == WatermarkParams(
        bits=64, block_bits=2, num_keys=4, delta=COMPANION_DELTA, scheme="xmark"
    )
    assert params_from_settings(Settings()) == gumbel
    monkeypatch.setenv("XMARK_WATERMARK_NUM_KEYS", "2")
    monkeypatch.setenv("XMARK_WATERMARK_DELTA", "3")
    monkeypatch.setenv("XMARK_WATERMARK_SALTS", "4")
    assert spec_from_settings(Settings()) == KeyVersionSpec(
        WatermarkParams(bits=64, block_bits=8, num_keys=1, scheme="gumbel", salts=4),
        WatermarkParams(bits=64, block_bits=2, num_keys=2, delta=3.0, scheme="xmark"),
    )
    monkeypatch.delenv("XMARK_WATERMARK_DELTA")
    monkeypatch.setenv("XMARK_WATERMARK_SCHEME", "gumbel")
    for name in ("XMARK_WATERMARK_BLOCK_BITS", "XMARK_WATERMARK_NUM_KEYS", "XMARK_WATERMARK_SALTS"):
        monkeypatch.setenv(name, "")
    assert spec_from_settings(Settings()) == KeyVersionSpec(gumbel)
    monkeypatch.setenv("XMARK_WATERMARK_SCHEME", "xmark")
    assert params_from_settings(Settings()) == WatermarkParams(bits=64, block_bits=2, num_keys=4, scheme="xmark")
    assert spec_from_settings(Settings()).companion is None
    monkeypatch.setenv("XMARK_WATERMARK_NUM_KEYS", "2")
    monkeypatch.setenv("XMARK_WATERMARK_BLOCK_BITS", "4")
    assert params_from_settings(Settings()) == WatermarkParams(bits=64, block_bits=4, num_keys=2, scheme="xmark")
    monkeypatch.setenv("XMARK_WATERMARK_BLOCK_BITS", "5")
    with pytest.raises(ValidationError, match="positive multiple of block_bits"):
        Settings()
    monkeypatch.setenv("XMARK_WATERMARK_SCHEME", "mixed")
    monkeypatch.setenv("XMARK_WATERMARK_BLOCK_BITS", "")
    with pytest.raises(ValidationError, match="watermark_scheme"):
        Settings()


def test_secrets_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "secrets"
    path.write_text(f"# key versions\nv1:{GOOD_SECRET}\nv2:{GOOD_SECRET}-two\n")
    settings = _settings(database_url=PG, secrets_file=path, api_key_pepper=SecretStr(GOOD_PEPPER))
    secrets = load_secrets(settings)
    assert secrets.watermark == {"v1": GOOD_SECRET.encode(), "v2": f"{GOOD_SECRET}-two".encode()}
    assert secrets.watermark_source == "file"

    path.write_text("v1:changeme\n")
    with pytest.raises(ConfigurationError, match=r"placeholder|shorter") as info:
        load_secrets(settings)
    assert "changeme" not in str(info.value)
    missing = _settings(database_url=PG, secrets_file=tmp_path / "absent", api_key_pepper=SecretStr(GOOD_PEPPER))
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_secrets(missing)


def test_embedded_default_generates_private_secrets(tmp_path: Path) -> None:
    var = tmp_path / "var"
    settings = _settings(database_url=f"sqlite+aiosqlite:///{var / 'x.db'}", var_dir=var)
    assert settings.embedded
    first = load_secrets(settings)
    second = load_secrets(settings)
    assert first.watermark == second.watermark and first.api_key_pepper == second.api_key_pepper
    assert list(first.watermark) == ["v1"] and first.watermark_source == "generated"
    assert placeholder_reason(first.watermark["v1"]) is None
    assert placeholder_reason(first.api_key_pepper) is None
    for name in (WATERMARK_SECRETS_FILE, API_KEY_PEPPER_FILE):
        assert stat.S_IMODE((var / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(var.stat().st_mode) == 0o700

    new = generate_embedded_secret(settings, "v2")
    assert load_secrets(settings).watermark == {"v1": first.watermark["v1"], "v2": new}
    assert generate_embedded_secret(settings, "v2") == new


def test_embedded_files_with_loose_permissions_are_tightened(tmp_path: Path) -> None:
    var = tmp_path / "var"
    settings = _settings(database_url=f"sqlite+aiosqlite:///{var / 'x.db'}", var_dir=var)
    load_secrets(settings)
    (var / API_KEY_PEPPER_FILE).chmod(0o644)
    load_secrets(settings)
    assert stat.S_IMODE((var / API_KEY_PEPPER_FILE).stat().st_mode) == 0o600


def test_embedded_mode_still_refuses_configured_placeholders(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        _settings(database_url="sqlite+aiosqlite:///x.db", var_dir=tmp_path, watermark_secrets=SecretStr("v1:changeme"))


def test_bootstrap_admin_key_must_be_well_formed() -> None:
    good = generate_api_key().plaintext
    assert (
        _settings(database_url="sqlite+aiosqlite:///x.db", bootstrap_admin_key=SecretStr(good)).bootstrap_admin_key
        is not None
    )
    for bad in ("not-a-key-at-all", good[:-1] + ("A" if good[-1] != "A" else "B"), good + "x"):
        with pytest.raises(ValidationError) as info:
            _settings(database_url="sqlite+aiosqlite:///x.db", bootstrap_admin_key=SecretStr(bad))
        assert bad not in str(info.value)


def test_unknown_backend_and_bad_limits_are_refused() -> None:
    with pytest.raises(ValidationError):
        _settings(database_url="sqlite+aiosqlite:///x.db", backend="tgi")
    with pytest.raises(ValidationError):
        _settings(database_url="sqlite+aiosqlite:///x.db", max_body_bytes=0)
    with pytest.raises(ValidationError):
        _settings(database_url="sqlite+aiosqlite:///x.db", watermark_bits=15)


def test_auth_cache_and_local_model_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = _settings(database_url="sqlite+aiosqlite:///x.db")
    assert (defaults.auth_cache_ttl_s, defaults.auth_cache_size) == (5.0, 10_000)
    assert (defaults.model_threads, defaults.max_batch_size, defaults.workers) == (None, 8, 1)
    assert defaults.record_linger_ms == 20.0
    monkeypatch.setenv("XMARK_WORKERS", "2")
    monkeypatch.setenv("XMARK_AUTH_CACHE_TTL_S", "0")
    monkeypatch.setenv("XMARK_AUTH_CACHE_SIZE", "50")
    monkeypatch.setenv("XMARK_MODEL_THREADS", "3")
    monkeypatch.setenv("XMARK_MAX_BATCH_SIZE", "4")
    configured = _settings(database_url="sqlite+aiosqlite:///x.db")
    assert (configured.auth_cache_ttl_s, configured.auth_cache_size) == (0.0, 50)
    assert (configured.model_threads, configured.max_batch_size, configured.workers) == (3, 4, 2)
    for bad in (
        {"auth_cache_ttl_s": -1},
        {"auth_cache_size": 0},
        {"model_threads": 0},
        {"max_batch_size": 0},
        {"workers": 0},
        {"record_linger_ms": -1},
        {"record_linger_ms": 1001},
    ):
        with pytest.raises(ValidationError):
            _settings(database_url="sqlite+aiosqlite:///x.db", **bad)


def test_the_likelihood_decoder_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = _settings(database_url="sqlite+aiosqlite:///x.db")
    assert (defaults.trace_edit_rate, defaults.trace_scorer_dtype) == (0.01, "auto")
    assert defaults.trace_identity_level is None
    monkeypatch.setenv("XMARK_TRACE_EDIT_RATE", "0")
    monkeypatch.setenv("XMARK_TRACE_SCORER_DTYPE", "float32")
    monkeypatch.setenv("XMARK_TRACE_IDENTITY_LEVEL", "0.01")
    configured = _settings(database_url="sqlite+aiosqlite:///x.db")
    assert (configured.trace_edit_rate, configured.trace_scorer_dtype) == (0.0, "float32")
    assert configured.trace_identity_level == 0.01
    for bad in (
        {"trace_edit_rate": -0.1},
        {"trace_edit_rate": 0.6},
        {"trace_scorer_dtype": "float16"},
        {"trace_identity_level": 0.0},
        {"trace_identity_level": 1.0},
    ):
        with pytest.raises(ValidationError):
            _settings(database_url="sqlite+aiosqlite:///x.db", **bad)


def test_the_local_backend_takes_its_threads_and_batch_size_from_the_settings(tmp_path: Path) -> None:
    from service.backends import build_backend
    from service.backends.local import LocalBackend, default_threads
    from service.metrics import Metrics

    configured = build_backend(
        _settings(
            database_url="sqlite+aiosqlite:///x.db", model_threads=3, max_batch_size=2, trace_scorer_dtype="float32"
        ),
        Metrics(),
    )
    assert isinstance(configured, LocalBackend)
    assert (configured._threads, configured._max_batch_rows, configured._scorer_dtype) == (3, 2, "float32")
    default = build_backend(_settings(database_url="sqlite+aiosqlite:///x.db"), Metrics())
    assert isinstance(default, LocalBackend)
    assert (default._threads, default._max_batch_rows, default._scorer_dtype) == (default_threads(), 8, "auto")


@pytest.mark.parametrize("secret", ["changeme-changeme-changeme", "tiny-one", "aaaaaaaaaaaaaaaaaaaaaaaa"])
def test_the_gateway_and_the_workers_refuse_the_same_secrets(secret: str) -> None:
    from service.config import parse_secret_entries
    from xmark_core.vllm_common import WorkerConfigError
    from xmark_core.vllm_common import parse_secret_entries as worker_parse

    with pytest.raises(ConfigurationError) as gateway:
        parse_secret_entries(f"v1:{secret}", source="XMARK_WATERMARK_SECRETS")
    with pytest.raises(WorkerConfigError) as worker:
        worker_parse(f"v1:{secret}", source="XMARK_WATERMARK_SECRETS")
    assert str(gateway.value) == str(worker.value)
    assert secret not in str(gateway.value)
