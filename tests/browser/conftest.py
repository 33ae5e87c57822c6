"""The console in a real browser: the system Chromium (``make browser`` installs it; Playwright
never downloads one) driving a real gateway on a local port with the real model and its own
PostgreSQL database (the fixtures of tests/e2e)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import _seeded_message_ids, e2e_database_url, live_server, message_id_rng

# the live server's fixtures, its seeded message IDs (the autouse one) included
__all__ = ["ARTIFACTS", "_seeded_message_ids", "e2e_database_url", "live_server", "message_id_rng"]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO_ROOT / "var" / "test-artifacts" / "console"
MODEL = "smollm2-135m-instruct"
# each page action's and expectation's bound (the pages' default and, set here, the assertions':
# their own default, 5 s, failed here on two busy cores when the 7,000-token trace of
# test_a_long_text_stays_usable took longer); 5x margin and more: a page, a form or a trace of a
# few hundred tokens (2.5 s at most here, tests/e2e) is ready within seconds, and that long trace,
# the slowest, took 4.4 s with its sign-in, a little over 5 s when it failed
TIMEOUT_MS = 120_000
expect.set_options(timeout=TIMEOUT_MS)


def admin_headers(server: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.admin_key}"}


def new_page(browser: Browser, server: Any, dialogs: list[str] | None = None) -> Page:
    """A page on the live server that accepts the console's confirmations (their text appended to
    ``dialogs`` when given)."""
    page = browser.new_page(base_url=server.base_url, viewport={"width": 1280, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)

    def accept(dialog: Any) -> None:
        if dialogs is not None:
            dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    return page


def sign_in(page: Page, key: str) -> None:
    page.goto("/console")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()


def create_user(server: Any, name: str, role: str) -> str:
    """A new user created over the admin API: its API key."""
    response = httpx.post(
        f"{server.base_url}/admin/users", json={"name": name, "role": role}, headers=admin_headers(server)
    )
    assert response.status_code == 201, response.text
    return str(response.json()["api_key"])


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
