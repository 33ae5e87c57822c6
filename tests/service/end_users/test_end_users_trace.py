"""/trace names the account and its end user when the text carries the end user's message ID, also
after the end user is deleted (a tombstone keeps its IDs); the signed report holds the end user."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from service.models import Trace

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_registry", "seeded_message_ids")]

MODEL = "smollm2-135m-instruct"
ESSAY = "Write a detailed essay about the history of sailing ships, with many facts."


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_trace_names_the_account_and_the_end_user_also_after_deletion(
    client: httpx.AsyncClient, db_session: AsyncSession, make_user: Any, admin_key: str, ready: None
) -> None:
    account, key = await make_user("user", "writing-app")
    await make_user("user")  # another account: a registry of more than one
    _, auditor = await make_user("auditor")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ESSAY}],
        "max_tokens": 300,
        "temperature": 0.8,
        "seed": 7,
        "safety_identifier": "hmac-of-user-42",
    }
    answer = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
    assert answer.status_code == 200, answer.text
    text = answer.json()["choices"][0]["message"]["content"]
    end_users = (await client.get(f"/admin/users/{account['id']}/end-users", headers=_auth(admin_key))).json()
    end_user = end_users["data"][0]

    async def trace() -> dict[str, Any]:
        response = await client.post("/trace", json={"text": text}, headers=_auth(auditor))
        assert response.status_code == 200, response.text
        return dict(response.json())

    report = await trace()
    assert report["watermarked"], report
    attribution = report["attribution"]
    assert attribution["user_id"] == account["id"] and attribution["name"] == "writing-app"
    assert attribution["end_user"] == {"id": end_user["id"], "identifier": "hmac-of-user-42"}
    assert report["candidates"][0]["end_user"]["id"] == end_user["id"]
    # the log's witness: the end user's own generation
    assert report["corroboration"]["status"] == "corroborated"
    assert report["corroboration"]["matches"][0]["end_user_id"] == end_user["id"]
    # the signed report and the trace row name the end user
    document = (await client.get(f"/trace/{report['report_id']}", headers=_auth(auditor))).json()
    assert document["report"]["attributed_user_id"] == account["id"]
    assert document["report"]["attributed_end_user"] == {"id": end_user["id"], "identifier": "hmac-of-user-42"}
    row = (await db_session.scalars(select(Trace).where(Trace.report_id == report["report_id"]))).one()
    assert (row.attributed_user_id, row.attributed_end_user_id) == (account["id"], end_user["id"])

    deleted = await client.delete(f"/admin/users/{account['id']}/end-users/{end_user['id']}", headers=_auth(admin_key))
    assert deleted.status_code == 200
    after = await trace()
    assert after["attribution"]["end_user"] == {"id": end_user["id"], "identifier": "hmac-of-user-42"}
