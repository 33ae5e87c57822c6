"""The forensic console in Chromium against a real gateway (real model, real PostgreSQL).

An admin signs in and creates a user in the console; that user chats through the API; the admin
traces the user's text in the console and sees the user named and the tokens coloured. The
registry's audit trail lists every change newest first, by page and by action. An auditor sees
no admin view and the API refuses them; hostile text renders as text; signing out leaves the key
nowhere. Screenshots of the main pages go to var/test-artifacts/console/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.sync_api import Browser, Page, Route, expect

from service.routers.console import CONSOLE_CSP
from service.services.reports import decode_public_key, text_sha256, verify_report
from tests.browser.conftest import MODEL, TIMEOUT_MS, admin_headers, create_user, new_page, sign_in

pytestmark = [pytest.mark.model, pytest.mark.browser]

PROMPTS = (
    "Write a detailed, multi-paragraph essay about the history of lighthouses and their keepers.",
    "Explain in depth how bees build honeycombs and organise their hive through the seasons.",
)
USER_LIST = re.compile(r"/admin/users(\?|$)")
HOSTILE = 'Before <script>window.__pwned=1</script> and <img src=x onerror="window.__pwned=1"> after.'


def _chat(server: Any, key: str) -> str:
    # 5x margin and more: a 200-token answer of the in-process model took up to 35 s here, and up
    # to about 140 s on two cores also busy with other test runs (tests/e2e; was 600 s: 4x that)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=1800)
    texts = []
    tokens = 0
    # answers sampled at temperature 1 may end early: ask again (the prompts in turn) until there
    # is enough text to name the user, within a bound. Each answer is seeded (a seed per round) and
    # the user's message ID is seeded too (tests/e2e/conftest.py): the text, and so the verdict and
    # the token counts asserted below, are the same every run.
    for round_ in range(3 * len(PROMPTS)):
        if round_ >= len(PROMPTS) and tokens >= 200:
            break
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[round_ % len(PROMPTS)]}],
            max_tokens=200,
            temperature=1.0,
            seed=20240607 + round_,
        )
        assert completion.usage is not None
        tokens += completion.usage.completion_tokens
        texts.append(completion.choices[0].message.content or "")
    assert tokens >= 200, f"only {tokens} completion tokens to trace"
    return "\n\n".join(texts)


def _trace_in_console(page: Page, text: str) -> None:
    page.goto("/console#/trace")
    page.get_by_label("Text to trace").fill(text)
    page.get_by_role("button", name="Trace", exact=True).click()
    expect(page.locator(".verdict")).to_be_visible()


def test_admin_creates_a_user_and_traces_their_text_to_them(
    live_server: Any, chromium: Browser, artifacts: Path
) -> None:
    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)
    for view in ("Trace", "Audit log", "Registry log", "Users", "API keys", "Key versions", "Usage"):
        expect(page.locator("#nav").get_by_role("link", name=view, exact=True)).to_be_visible()

    # create the user in the console: the key is shown once
    page.goto("/console#/users")
    page.locator("form.create input[name=name]").fill("console-alice")
    page.get_by_role("button", name="Create user").click()
    secret = page.locator("input[data-secret=api-key]")
    expect(secret).to_be_visible()
    user_key = secret.input_value()
    assert user_key.startswith("sk-") or len(user_key) > 20
    expect(page.locator("table.users")).to_contain_text("console-alice")
    page.screenshot(path=str(artifacts / "users.png"), full_page=True)

    text = _chat(live_server, user_key)
    _trace_in_console(page, text)
    expect(page.locator(".verdict-head")).to_have_text("Watermarked")
    expect(page.locator(".verdict-model .model")).to_have_text("smollm2-135m-instruct")  # the model that wrote it
    expect(page.locator(".named-user")).to_contain_text("console-alice")
    expect(page.locator("table.candidates")).to_contain_text("console-alice")
    # the second witness: the answer was served, so the user's generation log holds it
    expect(page.locator(".witness")).to_have_attribute("data-corroboration", "corroborated")
    expect(page.locator("table.matches tbody tr").first).to_contain_text("1.0")
    versions = httpx.get(f"{live_server.base_url}/admin/key-versions", headers=admin_headers(live_server)).json()
    active = next(v for v in versions["data"] if v["status"] == "active")
    expect(page.locator("table.blocks tbody tr")).to_have_count(active["bits"] // active["block_bits"])

    tokens = page.locator(".token-text .tok")
    total = tokens.count()
    assert total == int(page.locator(".token-text").get_attribute("data-tokens") or -1)
    supports = page.locator(".token-text .tok-supports").count()
    contradicts = page.locator(".token-text .tok-contradicts").count()
    unscored = page.locator(".token-text .tok-none").count()
    assert supports + contradicts + unscored == total > 200
    assert supports > contradicts > 0, (supports, contradicts)  # a watermark favours its own list
    legend = page.locator(".legend")
    assert legend.get_attribute("data-supports") == str(supports)
    assert re.match(
        r"block \d+, shards \d+(/\d+)*", page.locator(".token-text .tok-supports").first.get_attribute("title") or ""
    )
    # the text is the traced text, token by token
    assert page.locator(".token-text").text_content() == text
    # the encoder whose reading decided (the suite's single-scheme xmark version) and its sigma
    expect(page.locator(".facts")).to_contain_text(re.compile(r"Encoder\s*xmark"))
    expect(page.locator(".facts")).to_contain_text("Std-dev statistic")
    page.screenshot(path=str(artifacts / "trace.png"), full_page=True)

    # the signed report downloads and verifies against the gateway's published key
    with page.expect_download() as caught:
        page.locator("button[data-action=download-report]").click()
    saved = caught.value
    assert re.fullmatch(r"trc_[A-Za-z0-9_-]+\.json", saved.suggested_filename)
    document = json.loads(Path(saved.path()).read_text())
    published = httpx.get(f"{live_server.base_url}/.well-known/xmark-report-key").json()
    report = verify_report(document, decode_public_key(published["public_key"]))
    assert report["text_sha256"] == text_sha256(text)
    assert report["verdict"] == "watermarked" and report["attributed_user_name"] == "console-alice"
    report_id = report["report_id"]

    # print layout: no navigation, no form, the report stays
    page.emulate_media(media="print")
    expect(page.locator("header.top")).to_be_hidden()
    expect(page.locator("form.trace-form")).to_be_hidden()
    expect(page.locator(".verdict")).to_be_visible()
    page.emulate_media(media="screen")

    # the same text under the identity test: the likelihood decoder names her only after it
    page.goto("/console#/trace")
    page.get_by_label("Text to trace").fill(text)
    page.locator("select[name=identity_level]").select_option("0.01")
    page.get_by_role("button", name="Trace", exact=True).click()
    expect(page.locator(".facts")).to_contain_text("Identity test")
    expect(page.locator(".verdict-p")).to_contain_text("likelihood decoder")
    expect(page.locator(".named-user")).to_contain_text("console-alice")
    expect(page.locator(".facts")).to_contain_text(re.compile(r"p \S+ at level 0\.01"))

    # the audit log lists this trace, the usage view the user's generations
    page.goto("/console#/audit")
    audit = page.locator("table.audit")
    expect(audit).to_contain_text(report_id)
    expect(audit.locator("tr", has_text=report_id)).to_contain_text("console-alice")
    page.screenshot(path=str(artifacts / "audit.png"), full_page=True)
    page.goto("/console#/usage")
    usage = page.locator("table.usage tr", has_text="console-alice")
    expect(usage).to_have_count(1)
    assert int(usage.locator("td").nth(2).text_content() or 0) == len(PROMPTS)  # requests
    page.screenshot(path=str(artifacts / "usage.png"), full_page=True)
    page.goto("/console#/key-versions")
    expect(page.locator("table.versions")).to_contain_text("active")
    page.screenshot(path=str(artifacts / "key-versions.png"), full_page=True)
    page.close()


def _status_of(server: Any, key: str) -> int:
    return httpx.get(f"{server.base_url}/me", headers={"Authorization": f"Bearer {key}"}).status_code


def test_admin_issues_and_revokes_keys_and_disables_users(live_server: Any, chromium: Browser) -> None:
    user_key = create_user(live_server, "console-bob", "user")
    user_id = httpx.get(f"{live_server.base_url}/me", headers={"Authorization": f"Bearer {user_key}"}).json()["user_id"]
    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)

    # a second key, issued in the console and shown once, then revoked there
    page.goto("/console#/keys")
    page.locator("form.create input[name=user_id]").fill(str(user_id))
    page.get_by_role("button", name="Issue key").click()
    secret = page.locator("input[data-secret=api-key]")
    expect(secret).to_be_visible()
    second = secret.input_value()
    assert second != user_key and _status_of(live_server, second) == 200
    rows = page.locator("table.keys tbody tr")
    expect(rows).to_have_count(2)  # the filter is now this user's keys
    rows.last.get_by_role("button", name="Revoke").click()
    expect(rows.last).to_contain_text("revoked")
    assert _status_of(live_server, second) == 401
    assert _status_of(live_server, user_key) == 200

    # disable, then enable, the user from the user list (searched by name)
    page.goto("/console#/users")
    page.locator("form.filters input[name=q]").fill("console-bob")
    page.get_by_role("button", name="Search").click()
    row = page.locator("table.users tbody tr", has_text="console-bob")
    expect(row).to_have_count(1)
    row.get_by_role("button", name="Disable").click()
    expect(row).to_contain_text("disabled")
    assert _status_of(live_server, user_key) in (401, 403)
    row.get_by_role("button", name="Enable").click()
    expect(row).to_contain_text("active")
    assert _status_of(live_server, user_key) == 200
    page.close()


def test_a_late_answer_never_replaces_a_newer_search(live_server: Any, chromium: Browser) -> None:
    """The Users view's first page, answered after the admin's search was (a busy gateway answers
    in any order), is dropped: the table keeps the search's one row. Seen in a loaded suite run, where
    the late first page replaced a search's result under the test's click."""
    create_user(live_server, "console-late-answer", "user")
    page = new_page(chromium, live_server)
    held: list[Route] = []

    def hold_unfiltered_lists(route: Route) -> None:
        if "q=" in route.request.url:
            route.continue_()
        else:
            held.append(route)  # answered below, once the search's answer is shown

    page.route(USER_LIST, hold_unfiltered_lists)
    sign_in(page, live_server.admin_key)
    page.goto("/console#/users")
    page.locator("form.filters input[name=q]").fill("console-late-answer")
    page.get_by_role("button", name="Search").click()
    rows = page.locator("table.users tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("console-late-answer")
    assert held, "the view asked for no unfiltered first page"
    for route in held:
        url = route.request.url
        with page.expect_response(lambda response, url=url: response.url == url) as answer:
            route.continue_()
        assert answer.value.ok
        answer.value.finished()
    # the page's own turn to read the late answers (what showed them before the fix)
    page.evaluate("() => new Promise((resolve) => setTimeout(resolve, 500))")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("console-late-answer")
    page.close()


def test_an_auditor_sees_no_admin_view_and_the_api_refuses_them(live_server: Any, chromium: Browser) -> None:
    key = create_user(live_server, "console-auditor", "auditor")
    page = new_page(chromium, live_server)
    sign_in(page, key)
    nav = page.locator("#nav")
    expect(nav.get_by_role("link", name="Trace", exact=True)).to_be_visible()
    expect(nav.get_by_role("link", name="Audit log", exact=True)).to_be_visible()
    expect(nav.get_by_role("link", name="Registry log", exact=True)).to_be_visible()
    assert nav.get_by_role("link").count() == 3
    for view in ("users", "keys", "key-versions", "usage"):
        page.goto(f"/console#/{view}")
        expect(page.locator(f"[data-forbidden='{view}']")).to_contain_text("this view is for admins")
    auth = {"Authorization": f"Bearer {key}"}
    for path in ("/admin/users", "/admin/key-versions"):
        response = httpx.get(f"{live_server.base_url}{path}", headers=auth)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["message"]
    page.close()


def test_the_registry_log_lists_changes_newest_first_by_page_and_action(
    live_server: Any, chromium: Browser, artifacts: Path
) -> None:
    headers = admin_headers(live_server)
    created = []
    for i in range(22):  # more changes than a page holds (20)
        response = httpx.post(f"{live_server.base_url}/admin/users", json={"name": f"registry-{i}"}, headers=headers)
        assert response.status_code == 201, response.text
        created.append(response.json())
    disabled = httpx.post(f"{live_server.base_url}/admin/users/{created[0]['id']}/disable", headers=headers)
    assert disabled.status_code == 200, disabled.text
    audit = f"{live_server.base_url}/admin/audit"
    newest = httpx.get(audit, params={"order": "desc", "limit": 1}, headers=headers).json()["data"][0]
    assert newest["action"] == "user.disable"
    disables = httpx.get(audit, params={"action": "user.disable", "limit": 500}, headers=headers).json()["data"]

    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)
    page.locator("#nav").get_by_role("link", name="Registry log", exact=True).click()
    rows = page.locator("table.registry tbody tr")
    expect(rows).to_have_count(20)
    first = rows.first
    expect(first.locator("td").first).to_have_text(str(newest["seq"]))
    expect(first).to_contain_text("user.disable")
    expect(first).to_contain_text(f"user #{created[0]['id']}")
    expect(first).to_contain_text("status: active → disabled")
    expect(first).to_contain_text(f"admin (#{newest['actor']['user_id']})")
    expect(first).to_contain_text(newest["request_id"])
    seqs = [int(cell) for cell in rows.locator("td:first-child").all_text_contents()]
    assert seqs == list(range(newest["seq"], newest["seq"] - 20, -1))  # newest first, no gap
    expect(page.locator(".audit-head")).to_have_attribute("data-seq", str(newest["seq"]))
    expect(rows.nth(1)).to_contain_text("name: registry-21")
    page.screenshot(path=str(artifacts / "registry.png"), full_page=True)

    # the next page continues the chain downwards; back again
    page.get_by_role("button", name="Older").click()
    expect(rows.first.locator("td").first).to_have_text(str(newest["seq"] - 20))
    page.get_by_role("button", name="Newer").click()
    expect(rows.first.locator("td").first).to_have_text(str(newest["seq"]))
    expect(page.get_by_role("button", name="Newer")).to_be_disabled()

    # one action only
    page.locator("form.filters select[name=action]").select_option("user.disable")
    page.get_by_role("button", name="Search").click()
    expect(rows).to_have_count(len(disables))
    for cell in rows.locator("td:nth-child(4)").all_text_contents():
        assert cell == "user.disable"
    # the page shows keys by display prefix only
    page.locator("form.filters select[name=action]").select_option("user.create")
    page.get_by_role("button", name="Search").click()
    expect(rows.first).to_contain_text("registry-21")
    content = page.content()
    assert all(user["api_key"] not in content for user in created)
    assert live_server.admin_key not in content
    page.close()


def test_a_plain_user_is_told_the_console_is_for_auditors(live_server: Any, chromium: Browser) -> None:
    key = create_user(live_server, "console-plain", "user")
    page = new_page(chromium, live_server)
    sign_in(page, key)
    expect(page.locator("main")).to_contain_text("The console is for auditors and admins")
    assert page.locator("#nav a").count() == 0
    page.close()


def test_hostile_text_renders_as_text_under_the_csp(live_server: Any, chromium: Browser) -> None:
    page = new_page(chromium, live_server)
    response = page.goto("/console")
    assert response is not None and response.ok
    headers = response.headers
    assert headers["content-security-policy"] == CONSOLE_CSP
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    asset = httpx.get(f"{live_server.base_url}/console/static/app.js")
    assert asset.status_code == 200 and asset.headers["content-type"].startswith("text/javascript")
    assert asset.headers["content-security-policy"] == CONSOLE_CSP
    assert httpx.get(f"{live_server.base_url}/console/static/..%2Fapp.py").status_code == 404

    sign_in(page, live_server.admin_key)
    _trace_in_console(page, HOSTILE)
    expect(page.locator(".verdict-head")).to_have_text("Not watermarked")
    rendered = page.locator(".token-text")
    assert rendered.text_content() == HOSTILE
    expect(rendered).to_contain_text("<script>window.__pwned=1</script>")
    assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    page.wait_for_timeout(300)  # an onerror handler would have run by now (not a bound: a pause)
    assert page.evaluate("typeof window.__pwned") == "undefined"
    page.close()


def test_sign_out_leaves_the_key_nowhere(live_server: Any, chromium: Browser) -> None:
    context = chromium.new_context(base_url=live_server.base_url)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    sign_in(page, live_server.admin_key)
    key = live_server.admin_key
    assert key in page.evaluate("JSON.stringify(Object.values(sessionStorage))")
    assert page.evaluate("localStorage.length") == 0
    assert key not in page.url
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0
    assert page.evaluate("localStorage.length") == 0
    assert context.cookies() == []
    assert key not in page.url
    page.reload()  # nothing left to sign in with
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    expect(page.locator("#nav a")).to_have_count(0)
    context.close()


def test_a_long_text_stays_usable(live_server: Any, chromium: Browser) -> None:
    """Thousands of tokens: one span each, rendered in one pass, the page still answers."""
    page = new_page(chromium, live_server)
    sign_in(page, live_server.admin_key)
    sentences = [f"Sentence {i} of a long report on tides, harbours and the ships that use them." for i in range(400)]
    text = " ".join(sentences)  # about 7,000 tokens
    _trace_in_console(page, text)
    rendered = page.locator(".token-text")
    count = int(rendered.get_attribute("data-tokens") or 0)
    assert count > 5_000
    assert page.locator(".token-text .tok").count() == count
    assert rendered.text_content() == text
    # the page still answers: another view opens
    page.locator("#nav").get_by_role("link", name="Audit log", exact=True).click()
    expect(page.locator("table.audit")).to_be_visible()
    page.close()
