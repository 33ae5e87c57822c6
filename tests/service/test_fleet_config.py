"""The models file (``XMARK_MODELS_FILE``): what it accepts, and every mistake stopping start-up
with a message naming the entry and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.config import ConfigurationError, Settings
from service.errors import NotFoundError
from service.fleet import Fleet, ServedModel, load_models_file, model_settings
from tests.fakes import FakeBackend


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def _settings(tmp_path: Path, text: str, **overrides: object) -> Settings:
    models_file = tmp_path / "models.toml"
    models_file.write_text(text)
    values: dict[str, object] = {
        "database_url": "sqlite+aiosqlite:///x.db",
        "var_dir": tmp_path / "var",
        "models_file": models_file,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def test_each_entry_gets_its_own_settings_and_relative_paths_read_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint(tmp_path / "var" / "models" / "alpha")
    _checkpoint(tmp_path / "ckpt" / "beta")
    monkeypatch.setenv("BETA_WORKER_KEY", "worker-key-123")
    settings = _settings(
        tmp_path,
        """
[[models]]
name = "alpha"
aliases = ["a", "first"]

[[models]]
name = "beta"
backend = "vllm"
urls = ["http://127.0.0.1:9/"]
path = "ckpt/beta"
timeout_s = 12.5
api_key_env = "BETA_WORKER_KEY"
max_prompt_tokens = 100
max_completion_tokens = 50
max_queued_requests = 3
""",
        max_prompt_tokens=4000,
    )
    (alpha, alpha_aliases), (beta, beta_aliases) = model_settings(settings)
    assert (alpha.model_name, alpha.backend, alpha_aliases) == ("alpha", "local", ("a", "first"))
    assert alpha.resolved_model_path() == tmp_path / "var" / "models" / "alpha"
    assert alpha.max_prompt_tokens == 4000  # the gateway's own limit where the entry sets none
    assert (beta.model_name, beta.backend, beta_aliases) == ("beta", "vllm", ())
    assert beta.resolved_model_path() == tmp_path / "ckpt" / "beta"
    assert beta.vllm_urls == ["http://127.0.0.1:9"]
    assert beta.vllm_timeout_s == 12.5
    assert beta.vllm_api_key is not None and beta.vllm_api_key.get_secret_value() == "worker-key-123"
    assert (beta.max_prompt_tokens, beta.max_completion_tokens, beta.max_queued_requests) == (100, 50, 3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[models]\nname = 'x'", "not valid TOML"),
        ("", "field 'models': Field required"),
        ("[[models]]\nname = 'alpha'\ncolour = 'red'", "model 1 ('alpha'), field 'colour': Extra inputs"),
        ("[[models]]\nname = 'alpha'\nbackend = 'tgi'", "model 1 ('alpha'), field 'backend'"),
        ("[[models]]\nname = 'al pha'", "model 1 ('al pha'), field 'name'"),
        (
            "[[models]]\nname = 'alpha'\n[[models]]\nname = 'beta'\naliases = ['alpha']",
            "model 2 ('beta'), field 'aliases': 'alpha' is already the name or an alias of model 1 ('alpha')",
        ),
        ("[[models]]\nname = 'alpha'\n[[models]]\nname = 'alpha'", "model 2 ('alpha'), field 'name'"),
        ("[[models]]\nname = 'alpha'\nbackend = 'vllm'", "model 1 ('alpha'), field 'urls': a vllm model needs"),
        ("[[models]]\nname = 'alpha'\nurls = ['http://w:1']", "model 1 ('alpha'), field 'urls': only a vllm"),
        ("[[models]]\nname = 'alpha'\nmax_prompt_tokens = 0", "model 1 ('alpha'), field 'max_prompt_tokens'"),
        (
            "[[models]]\nname = 'alpha'\nbackend = 'vllm'\nurls = ['http://w:1']\n"
            "api_key_env = 'XMARK_NOT_SET_ANYWHERE'",
            "field 'api_key_env': the variable XMARK_NOT_SET_ANYWHERE is not set",
        ),
        ("[[models]]\nname = 'alpha'\nbackend = 'vllm'\nurls = ['ftp://w']", "model 1 ('alpha'), field 'urls'"),
    ],
)
def test_a_mistake_in_the_file_names_the_entry_and_the_field(tmp_path: Path, text: str, expected: str) -> None:
    _checkpoint(tmp_path / "var" / "models" / "alpha")
    with pytest.raises(ConfigurationError) as raised:
        model_settings(_settings(tmp_path, text))
    assert expected in str(raised.value)
    assert str(tmp_path / "models.toml") in str(raised.value)


def test_a_missing_checkpoint_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"model 1 \('ghost'\), field 'name': no checkpoint at"):
        model_settings(_settings(tmp_path, "[[models]]\nname = 'ghost'"))
    with pytest.raises(ConfigurationError, match=r"model 1 \('ghost'\), field 'path': no checkpoint at"):
        model_settings(_settings(tmp_path, "[[models]]\nname = 'ghost'\npath = 'nowhere'"))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no such file"):
        load_models_file(tmp_path / "absent.toml")


def test_the_file_and_the_single_model_settings_are_not_mixed(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unset XMARK_MODEL_PATH"):
        _settings(tmp_path, "[[models]]\nname = 'alpha'", model_path=tmp_path)
    with pytest.raises(ValidationError, match="unset XMARK_VLLM_URLS"):
        _settings(tmp_path, "[[models]]\nname = 'alpha'", vllm_urls=["http://w:1"])


def test_without_a_file_the_settings_describe_the_one_model(tmp_path: Path) -> None:
    settings = Settings(database_url="sqlite+aiosqlite:///x.db", var_dir=tmp_path, model_name="solo")  # type: ignore[call-arg]
    assert model_settings(settings) == [(settings, ())]


def test_the_fleet_resolves_names_and_aliases_and_refuses_the_rest() -> None:
    fleet = Fleet(
        [ServedModel("alpha", FakeBackend("alpha"), aliases=("a",)), ServedModel("beta", FakeBackend("beta"))]
    )
    assert fleet.resolve("a").name == "alpha"
    assert fleet.resolve("beta").name == "beta"
    assert fleet.default.name == "alpha"
    assert fleet.names() == ["alpha", "beta"]
    with pytest.raises(NotFoundError) as raised:
        fleet.resolve("gamma")
    assert raised.value.code == "model_not_found"
    with pytest.raises(ValueError, match="used twice"):
        Fleet([ServedModel("alpha", FakeBackend("alpha")), ServedModel("b", FakeBackend("b"), aliases=("alpha",))])


def test_the_models_dir_names_the_default_checkpoints(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpts" / "alpha")
    settings = _settings(tmp_path, "[[models]]\nname = 'alpha'", models_dir=str(tmp_path / "ckpts"))
    ((alpha, _),) = model_settings(settings)
    assert alpha.resolved_model_path() == tmp_path / "ckpts" / "alpha"
    single = Settings(database_url="sqlite+aiosqlite:///x.db", var_dir=tmp_path, models_dir=tmp_path / "ckpts")  # type: ignore[call-arg]
    assert single.resolved_model_path() == tmp_path / "ckpts" / "smollm2-135m-instruct"
    # a deployment file's empty variable means unset
    assert Settings(database_url="sqlite+aiosqlite:///x.db", models_file="", models_dir="").models_file is None  # type: ignore[call-arg,arg-type]


def test_the_deployment_models_files_are_valid(tmp_path: Path) -> None:
    import yaml

    repo = Path(__file__).resolve().parents[2]
    compose = load_models_file(repo / "deploy" / "models.compose.toml")
    manifest = yaml.safe_load((repo / "deploy" / "k8s" / "models-configmap.yaml").read_text())
    (tmp_path / "k8s.toml").write_text(manifest["data"]["models.toml"])
    k8s = load_models_file(tmp_path / "k8s.toml")
    for entries in (compose, k8s):
        assert [e.name for e in entries] == ["smollm2-135m-instruct", "xmark-test-bpe"]
        assert all(e.backend == "vllm" and e.urls for e in entries)
