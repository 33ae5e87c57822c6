"""An account's end users in the console, in Chromium against a real gateway (real model, real
PostgreSQL).

A platform account's requests name end users (``safety_identifier``); an admin opens the account's
end users from the Users view, searches one by identifier as they type, disables it (its requests
get 403), enables it and deletes it (the confirmation says its IDs stay reserved); the API's errors
show in the panel. Identifiers, and whatever fields the API adds to an end user, render as text;
nothing of them is kept in the URL or web storage. The Registry log, filtered to end-user changes,
lists exactly the trail's end_user.* entries.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, Route, expect

from service.vocabulary import AuditAction
from tests.browser.conftest import MODEL, admin_headers, create_user, new_page, sign_in

pytestmark = [pytest.mark.model, pytest.mark.browser]

HOSTILE_IDENTIFIER = '<img src=x onerror="window.__pwned=1">'
# 5x margin and more: a 200-token answer of the in-process model took up to about 140 s on two
# cores also busy with other test runs (tests/browser/test_console.py); these ask for 2 tokens
CHAT_TIMEOUT_S = 600.0
END_USER_LIST = re.compile(r"/admin/users/\d+/end-users(\?|$)")


def _account(server: Any, name: str) -> tuple[int, str]:
    """A new platform account: its id and API key."""
    key = create_user(server, name, "user")
    me = httpx.get(f"{server.base_url}/me", headers={"Authorization": f"Bearer {key}"})
    assert me.status_code == 200, me.text
    return int(me.json()["user_id"]), key


def _chat(server: Any, key: str, identifier: str) -> httpx.Response:
    """A chat request of the account for its end user ``identifier``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 2,
        "safety_identifier": identifier,
    }
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=CHAT_TIMEOUT_S,
    )


def _served(server: Any, key: str, identifier: str) -> None:
    response = _chat(server, key, identifier)
    assert response.status_code == 200, response.text


def _refused(server: Any, key: str, identifier: str, code: str) -> None:
    response = _chat(server, key, identifier)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == code


def _end_users(server: Any, user_id: int) -> dict[str, dict[str, Any]]:
    """The account's end users as the API lists them, by identifier."""
    response = httpx.get(
        f"{server.base_url}/admin/users/{user_id}/end-users", params={"limit": 500}, headers=admin_headers(server)
    )
    assert response.status_code == 200, response.text
    return {e["identifier"]: e for e in response.json()["data"]}


def _shown_date(value: str) -> str:
    """A timestamp of the API as the console shows it (dom.js formatDate: UTC to the second)."""
    return datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _account_row(page: Page, name: str) -> Locator:
    """The Users view, searched by name: the account's one row."""
    page.goto("/console#/users")
    page.locator("form.filters input[name=q]").fill(name)
    page.get_by_role("button", name="Search").click()
    row = page.locator("table.users tbody tr", has_text=name)
    expect(row).to_have_count(1)
    return row


def _open_end_users(page: Page, name: str) -> Locator:
    """The Users view, the account found by name, its End users panel opened."""
    _account_row(page, name).get_by_role("button", name="End users").click()
    panel = page.locator("section.end-users-panel")
    expect(panel).to_be_visible()
    return panel


def _headers(panel: Locator) -> list[str]:
    return [h.strip() for h in panel.locator("table.end-users thead th").all_text_contents()]


def test_admin_searches_disables_enables_and_deletes_an_end_user(
    live_server: Any, chromium: Browser, artifacts: Path
) -> None:
    user_id, key = _account(live_server, "platform-ends-1")
    identifiers = ("eu-ada@example.test", "eu-brook@example.test", "eu-cyd@example.test")
    for identifier in identifiers:
        _served(live_server, key, identifier)
    listed = _end_users(live_server, user_id)
    assert set(listed) == set(identifiers)

    dialogs: list[str] = []
    page = new_page(chromium, live_server, dialogs)
    searched: list[str] = []

    def note_search(request: Any) -> None:
        if END_USER_LIST.search(request.url) and "q=" in request.url:
            searched.append(httpx.URL(request.url).params["q"])

    page.on("request", note_search)
    sign_in(page, live_server.admin_key)
    panel = _open_end_users(page, "platform-ends-1")
    expect(panel.locator("h3")).to_have_text(f"End users of platform-ends-1 (#{user_id})")
    rows = panel.locator("table.end-users tbody tr")
    expect(rows).to_have_count(3)
    assert _headers(panel)[:6] == ["ID", "Identifier", "Status", "First seen", "Last seen", "Message IDs"]
    ada = listed["eu-ada@example.test"]
    cells = rows.filter(has_text="eu-ada@example.test").locator("td")
    expect(cells.nth(0)).to_have_text(str(ada["id"]))
    expect(cells.nth(1)).to_have_text("eu-ada@example.test")
    expect(cells.nth(2)).to_have_text("active")
    expect(cells.nth(3)).to_have_text(_shown_date(ada["created_at"]))
    expect(cells.nth(4)).to_have_text(_shown_date(ada["last_seen_at"]))
    expect(cells.nth(5)).to_have_text(str(len(ada["message_ids"])))
    assert len(ada["message_ids"]) >= 1

    # search as you type: one request once typing pauses, not one per key
    panel.get_by_label("Identifier").press_sequentially("brook", delay=20)
    expect(rows).to_have_count(1)
    brook = rows.filter(has_text="eu-brook@example.test")
    expect(brook).to_have_count(1)
    assert searched[-1] == "brook" and len(searched) < len("brook"), searched

    # disable: its requests get 403, the account's other end users are served
    brook.get_by_role("button", name="Disable").click()
    expect(brook.locator("td").nth(2)).to_have_text("disabled")
    expect(panel.locator(".status-line")).to_contain_text("is disabled")
    _refused(live_server, key, "eu-brook@example.test", "end_user_disabled")
    _served(live_server, key, "eu-ada@example.test")

    # the status filter, the search cleared: only the disabled one
    panel.get_by_label("Identifier").fill("")
    panel.locator("select[name=status]").select_option("disabled")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("eu-brook@example.test")
    panel.locator("select[name=status]").select_option("")
    expect(rows).to_have_count(3)

    # enable: served again
    brook.get_by_role("button", name="Enable").click()
    expect(brook.locator("td").nth(2)).to_have_text("active")
    _served(live_server, key, "eu-brook@example.test")

    # delete, confirmed: refused for good, its message IDs kept
    brook.get_by_role("button", name="Delete").click()
    expect(brook.locator("td").nth(2)).to_have_text("deleted")
    assert len(dialogs) == 1 and "eu-brook@example.test" in dialogs[0], dialogs
    assert "message IDs stay reserved" in dialogs[0] and "cannot be undone" in dialogs[0]
    expect(brook.get_by_role("button")).to_have_count(0)
    _refused(live_server, key, "eu-brook@example.test", "end_user_deleted")
    kept = _end_users(live_server, user_id)["eu-brook@example.test"]
    assert kept["status"] == "deleted" and kept["message_ids"] == listed["eu-brook@example.test"]["message_ids"]
    expect(brook.locator("td").nth(5)).to_have_text(str(len(kept["message_ids"])))
    page.screenshot(path=str(artifacts / "end-users.png"), full_page=True)

    # the API's refusal shows in the panel: deleted elsewhere while the page still offers Disable
    cyd = rows.filter(has_text="eu-cyd@example.test")
    gone = httpx.delete(
        f"{live_server.base_url}/admin/users/{user_id}/end-users/{listed['eu-cyd@example.test']['id']}",
        headers=admin_headers(live_server),
    )
    assert gone.status_code == 200, gone.text
    cyd.get_by_role("button", name="Disable").click()
    expect(panel.get_by_role("alert")).to_have_text("Disable: A deleted end user cannot be changed")
    expect(cyd.locator("td").nth(2)).to_have_text("deleted")  # the list is read again

    # identifiers stay in the page: not in the URL, not in web storage
    assert page.evaluate("localStorage.length") == 0
    stored = page.evaluate("JSON.stringify(Object.entries(sessionStorage))")
    assert not any(identifier in stored for identifier in identifiers)
    assert "eu-" not in page.url
    page.close()


def test_identifiers_and_added_fields_render_as_text(live_server: Any, chromium: Browser) -> None:
    user_id, key = _account(live_server, "platform-ends-2")
    _served(live_server, key, HOSTILE_IDENTIFIER)
    served = _end_users(live_server, user_id)[HOSTILE_IDENTIFIER]

    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)
    panel = _open_end_users(page, "platform-ends-2")
    row = panel.locator("table.end-users tbody tr")
    expect(row).to_have_count(1)
    expect(row.locator("td").nth(1)).to_have_text(HOSTILE_IDENTIFIER)
    assert page.locator("main img").count() == 0
    page.wait_for_timeout(300)  # an onerror handler would have run by now (not a bound: a pause)
    assert page.evaluate("typeof window.__pwned") == "undefined"
    # a column for limits or usage only where the API serves them
    present = [
        (name, label) for name, label in (("limits", "Limits"), ("usage", "Usage")) if served.get(name) is not None
    ]
    assert _headers(panel)[6:-1] == [label for _, label in present]
    for column, (name, _) in enumerate(present, start=6):
        for field in served[name]:
            expect(row.locator("td").nth(column)).to_contain_text(f"{field}: ")

    # fields an end user may carry (limits, usage) are shown generically, as text
    def with_fields(route: Route) -> None:
        response = route.fetch()
        page_ = response.json()
        for end_user in page_["data"]:
            end_user["limits"] = {"requests_per_minute": 5, "tokens": {"per_day": None}}
            end_user["usage"] = {"since": "2026-01-02T03:04:05.678+00:00", "requests": 3, "note": "<b>bold</b>"}
        route.fulfill(response=response, json=page_)

    page.route(END_USER_LIST, with_fields)
    panel = _open_end_users(page, "platform-ends-2")
    expect(panel.locator("table.end-users thead th")).to_have_count(9)
    assert _headers(panel)[6:8] == ["Limits", "Usage"]
    cells = panel.locator("table.end-users tbody tr td")
    expect(cells.nth(6)).to_have_text("requests_per_minute: 5tokens.per_day: –")
    expect(cells.nth(7)).to_have_text("since: 2026-01-02 03:04:05Zrequests: 3note: <b>bold</b>")
    assert page.locator("main b").count() == 0
    page.close()


def _end_user_entries(server: Any) -> list[dict[str, Any]]:
    """Every end_user.* entry of the registry's audit trail, newest first (every page of it)."""
    entries: list[dict[str, Any]] = []
    after: int | None = None
    while True:
        params: dict[str, Any] = {"order": "desc", "limit": 500}
        if after is not None:
            params["after_seq"] = after
        page = httpx.get(f"{server.base_url}/admin/audit", params=params, headers=admin_headers(server)).json()
        entries += [e for e in page["data"] if e["action"].startswith("end_user.")]
        if not page["has_more"]:
            return entries
        after = page["next_after_seq"]


def test_the_registry_log_filters_end_user_changes(live_server: Any, chromium: Browser, artifacts: Path) -> None:
    user_id, key = _account(live_server, "platform-ends-3")
    for identifier in ("eu-dale@example.test", "eu-eve@example.test"):
        _served(live_server, key, identifier)
    dale = _end_users(live_server, user_id)["eu-dale@example.test"]
    base = f"{live_server.base_url}/admin/users/{user_id}/end-users/{dale['id']}"
    for step in ("disable", "enable"):
        assert httpx.post(f"{base}/{step}", headers=admin_headers(live_server)).status_code == 200
    entries = _end_user_entries(live_server)
    assert [e["action"] for e in entries[:4]] == [
        "end_user.enable",
        "end_user.disable",
        "end_user.create",
        "end_user.create",
    ]

    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)
    page.locator("#nav").get_by_role("link", name="Registry log", exact=True).click()
    action = page.locator("form.filters select[name=action]")
    # the filter offers every action the trail records, and a group for each kind with several
    values = set(action.locator("option").evaluate_all("options => options.map((o) => o.value)"))
    assert {v for v in values if v and not v.endswith(".*")} == {a.value for a in AuditAction}
    assert {"user.*", "api_key.*", "key_version.*", "end_user.*"} <= values

    rows = page.locator("table.registry tbody tr")
    action.select_option("end_user.*")
    page.get_by_role("button", name="Search").click()
    expected = entries[:20]  # a page
    expect(rows).to_have_count(len(expected))
    expect(rows.first.locator("td").first).to_have_text(str(expected[0]["seq"]))
    assert [int(c) for c in rows.locator("td:first-child").all_text_contents()] == [e["seq"] for e in expected]
    assert all(c.startswith("end_user.") for c in rows.locator("td:nth-child(4)").all_text_contents())
    newest = rows.first
    expect(newest).to_contain_text(f"end_user #{dale['id']}")
    expect(newest).to_contain_text("status: disabled → active")
    expect(newest).to_contain_text("identifier: – → eu-dale@example.test")
    page.screenshot(path=str(artifacts / "registry-end-users.png"), full_page=True)

    # one end-user action
    action.select_option("end_user.disable")
    page.get_by_role("button", name="Search").click()
    disables = [e for e in entries if e["action"] == "end_user.disable"][:20]
    expect(rows).to_have_count(len(disables))
    expect(rows.first.locator("td").first).to_have_text(str(disables[0]["seq"]))
    page.close()


def _user(server: Any, user_id: int) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/admin/users/{user_id}", headers=admin_headers(server))
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_admin_edits_an_accounts_and_an_end_users_limits(live_server: Any, chromium: Browser, artifacts: Path) -> None:
    user_id, key = _account(live_server, "platform-ends-4")
    _served(live_server, key, "eu-fay@example.test")
    fay = _end_users(live_server, user_id)["eu-fay@example.test"]

    page = new_page(chromium, live_server)
    patches: list[dict[str, Any]] = []
    page.on("request", lambda r: patches.append(r.post_data_json) if r.method == "PATCH" else None)
    sign_in(page, live_server.admin_key)
    row = _account_row(page, "platform-ends-4")

    # the account's seven limits, each unset: the gateway's default
    row.get_by_role("button", name="Limits").click()
    form = page.locator("form[data-limits=account]")
    expect(form.locator("h4")).to_have_text(f"Limits of platform-ends-4 (#{user_id})")
    expect(form.locator("input")).to_have_count(7)
    expect(form.locator(".limit-shown[data-limit=tokens_per_minute]")).to_have_text("gateway's default")

    # a value that is not a limit is refused in the page, by its field's name, and nothing is sent
    tokens = form.get_by_label("Tokens per minute", exact=True)
    tokens.fill("-3")
    expect(form.locator(".limit-shown[data-limit=tokens_per_minute]")).to_have_text("not a limit")
    form.get_by_role("button", name="Save limits").click()
    expect(form.get_by_role("alert")).to_contain_text("Tokens per minute: a whole number from 0 (unlimited)")
    assert patches == []

    # 0 reads "unlimited"; only the fields changed are sent, and the API holds them
    tokens.fill("0")
    expect(form.locator(".limit-shown[data-limit=tokens_per_minute]")).to_have_text("unlimited")
    form.get_by_label("End users in all", exact=True).fill("1")
    form.get_by_role("button", name="Save limits").click()
    expect(form.locator(".status-line")).to_contain_text("Saved: 2 limits changed.")
    assert patches == [{"tokens_per_minute": 0, "end_users_max": 1}]
    account = _user(live_server, user_id)
    assert (account["tokens_per_minute"], account["end_users_max"]) == (0, 1)
    assert account["requests_per_minute"] is None and account["end_user_tokens_per_minute"] is None
    # the cap holds from the next request: its one end user is served, a second identifier is refused
    _served(live_server, key, "eu-fay@example.test")
    refused = _chat(live_server, key, "eu-gil@example.test")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "end_user_limit_exceeded"
    assert "end_users_max" in refused.json()["error"]["message"]

    # an emptied field goes back to the default (null)
    tokens.fill("")
    expect(form.locator(".limit-shown[data-limit=tokens_per_minute]")).to_have_text("gateway's default")
    form.get_by_role("button", name="Save limits").click()
    expect(form.locator(".status-line")).to_contain_text("Saved: 1 limit changed.")
    assert patches[-1] == {"tokens_per_minute": None}
    assert _user(live_server, user_id)["tokens_per_minute"] is None
    form.get_by_role("button", name="Save limits").click()
    expect(form.locator(".status-line")).to_have_text("Nothing changed.")
    assert len(patches) == 2
    form.get_by_role("button", name="Close").click()
    expect(form).to_have_count(0)

    # an end user's own limits: unset shows the account's limit in force; 0 reads "unlimited"
    row.get_by_role("button", name="End users").click()
    panel = page.locator("section.end-users-panel")
    end_user = panel.locator("table.end-users tbody tr", has_text="eu-fay@example.test")
    end_user.get_by_role("button", name="Limits").click()
    own = panel.locator("form[data-limits=end-user]")
    expect(own.locator("input")).to_have_count(2)
    in_force = fay["limits"]["requests_per_minute"]
    expect(own.locator(".limit-shown[data-limit=requests_per_minute]")).to_have_text(
        f"account's end-user limit: {in_force:,}" if in_force else "account's end-user limit: unlimited"
    )
    own.get_by_label("Requests per minute", exact=True).fill("0")
    own.get_by_role("button", name="Save limits").click()
    expect(own.locator(".status-line")).to_contain_text("Saved: 1 limit changed.")
    assert patches[-1] == {"requests_per_minute": 0}
    listed = _end_users(live_server, user_id)["eu-fay@example.test"]
    assert listed["requests_per_minute"] == 0 and listed["limits"]["requests_per_minute"] == 0
    limits_cell = end_user.locator("td").nth(_headers(panel).index("Limits"))
    expect(limits_cell).to_contain_text("requests_per_minute: unlimited")
    page.screenshot(path=str(artifacts / "limits.png"), full_page=True)
    page.close()
