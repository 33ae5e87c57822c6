"""The console in a real browser: the system Chromium (``make browser`` installs it; Playwright
never downloads one) driving a real gateway on a local port with the real model and its own
PostgreSQL database (the fixtures of tests/e2e)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import _seeded_message_ids, e2e_database_url, live_server, message_id_rng

# the live server's fixtures, its seeded message IDs (the autouse one) included
__all__ = ["ARTIFACTS", "_seeded_message_ids", "e2e_database_url", "live_server", "message_id_rng"]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO_ROOT / "var" / "test-artifacts" / "console"


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    """One headless Chromium per module. Not per session: Playwright's sync API keeps an event
    loop running in this thread while it is open, and the asyncio tests that run after the
    browser tests need the thread without one."""
    executable = CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")
    if executable is None:
        pytest.fail("Chromium is missing: run `make browser` (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
