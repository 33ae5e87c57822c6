"""Service-test helpers on top of tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings, parse_secret_entries


@pytest.fixture
def planted_secrets(settings: Settings) -> list[str]:
    """The configured secrets of the test app (what must never leave the process)."""
    assert settings.watermark_secrets is not None and settings.api_key_pepper is not None
    entries = parse_secret_entries(settings.watermark_secrets.get_secret_value(), source="test")
    return [*(v.decode() for v in entries.values()), settings.api_key_pepper.get_secret_value()]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh file-backed SQLite database URL (embedded mode)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'var' / 'xmark.db'}"
