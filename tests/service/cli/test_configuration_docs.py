"""docs/configuration.md is generated from the fields of ``Settings``: it must be current and complete."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.cli import main
from service.cli.config_docs import (
    GROUPS,
    REFERENCE_PATH,
    SECRET_DEFAULTS,
    ConfigDocsError,
    env_names,
    grouped_fields,
    render,
)
from service.config import Settings

REPO_ROOT = Path(__file__).resolve().parents[3]
REFERENCE = REPO_ROOT / REFERENCE_PATH
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*#*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: Path) -> set[str]:
    """The heading anchors GitHub gives a Markdown file (code blocks skipped, repeats numbered)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        heading = None if fenced else _HEADING.match(line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_the_committed_reference_is_current() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == render(), (
        f"{REFERENCE_PATH} is out of date with service/config.py: run `make config-docs` and commit the result"
    )


def test_the_output_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = render()
    monkeypatch.setenv("XMARK_PORT", "9999")
    monkeypatch.setenv("XMARK_WATERMARK_SECRETS", "v1:an-environment-secret-0123456789")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "elsewhere")
    assert render() == expected


def test_every_setting_has_a_description() -> None:
    missing = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"fields of Settings without a description: {missing}"


def test_every_setting_is_in_exactly_one_group() -> None:
    placed = [name for group in GROUPS for name in group.fields]
    assert sorted(placed) == sorted(Settings.model_fields)
    assert sum(len(fields) for _, fields in grouped_fields()) == len(Settings.model_fields)


def test_a_field_without_a_group_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("service.cli.config_docs.GROUPS", GROUPS[1:])
    with pytest.raises(ConfigDocsError, match="in none"):
        grouped_fields()


def test_every_setting_appears_in_the_reference_with_each_variable_it_reads() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    rows = {line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `")}
    for name, field in Settings.model_fields.items():
        names = env_names(name, field)
        row = [row for row in rows if row.startswith(f"| `{names[0]}`")]
        assert len(row) == 1, f"{names[0]} ({name}) has {len(row)} rows in {REFERENCE_PATH}"
        for other in names[1:]:
            assert f"`{other}`" in row[0], f"{other} ({name}) is read but not shown"


def test_aliased_settings_show_the_standard_names() -> None:
    assert env_names("otel_endpoint", Settings.model_fields["otel_endpoint"])[0] == "OTEL_EXPORTER_OTLP_ENDPOINT"
    assert env_names("otel_service_name", Settings.model_fields["otel_service_name"]) == ("OTEL_SERVICE_NAME",)
    assert env_names("port", Settings.model_fields["port"]) == ("XMARK_PORT",)


def test_secrets_show_no_default_value() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    for name in SECRET_DEFAULTS:
        variable = env_names(name, Settings.model_fields[name])[0]
        row = next(line for line in text.splitlines() if line.startswith(f"| `{variable}`"))
        assert row.split(" | ")[2] == SECRET_DEFAULTS[name]


def test_the_links_of_the_reference_resolve() -> None:
    broken = []
    for target in _LINK.findall(REFERENCE.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (REFERENCE.parent / path).resolve() if path else REFERENCE
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"links in {REFERENCE_PATH} that lead nowhere: {broken}"


def test_the_cli_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-docs"]) == 0
    assert capsys.readouterr().out == render()
