"""End to end with a real vLLM worker serving the distortion-free scheme: the worker's processor
samples every token with the user's key (8-bit blocks, 16 salts), the gateway gives a user's answers
consecutive salts and traces each to its author (also one sampled within a top-p / top-k / min-p
nucleus), and what a worker could not honour is refused by name before it reaches one.

The processes come from conftest.py: a CPU ``vllm serve`` with ``XMARK_WATERMARK_SCHEME=gumbel`` and
an ``xmark serve`` gateway with the same settings on a SQLite database of its own.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

pytestmark = [pytest.mark.vllm, pytest.mark.model]

MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper. Use many paragraphs."}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_answers_sampled_by_the_workers_key_are_traced_to_their_authors(
    gumbel_gateway: Any, gumbel_worker: Any, e2e_config: Any
) -> None:
    base = str(gumbel_gateway.health_url).removesuffix("/readyz")
    async with httpx.AsyncClient(base_url=base, timeout=600.0) as client:
        people = {}
        for name, role in (("g-alice", "user"), ("g-bob", "user"), ("g-auditor", "auditor")):
            created = await client.post(
                "/admin/users", json={"name": name, "role": role}, headers=_auth(e2e_config.admin_key)
            )
            assert created.status_code == 201, created.text
            people[name] = created.json()
        alice, bob, auditor = people["g-alice"], people["g-bob"], people["g-auditor"]
        versions = await client.get("/admin/key-versions", headers=_auth(e2e_config.admin_key))
        active = [v for v in versions.json()["data"] if v["status"] == "active"]
        assert [(v["scheme"], v["block_bits"], v["salts"]) for v in active] == [("gumbel", 8, 16)]

        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 160, "temperature": 0.8, "seed": 3}
        texts = []
        # bob's request sets a nucleus: the worker samples with the key inside it
        for person, nucleus in ((alice, {}), (alice, {}), (bob, {"top_p": 0.95, "top_k": 50, "min_p": 0.01})):
            response = await client.post(
                "/v1/chat/completions", json={**body, **nucleus}, headers=_auth(person["api_key"])
            )
            assert response.status_code == 200, response.text
            texts.append((person, response.json()["choices"][0]["message"]["content"]))
        # alice asked twice with the same seed: consecutive salts, two different answers
        assert texts[0][1] != texts[1][1]
        for person, text in texts:
            traced = await client.post("/trace", json={"text": text}, headers=_auth(auditor["api_key"]))
            assert traced.status_code == 200, traced.text
            report = traced.json()
            assert report["attribution"] is not None, report["candidates"]
            assert report["attribution"]["user_id"] == person["id"]

        # what the worker would apply after its choice, and n > 1 (one salt for vLLM's child requests)
        for extra, param in (
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"temperature": 0}, "temperature"),
            ({"n": 2}, "n"),
        ):
            refused = await client.post(
                "/v1/chat/completions", json={**body, "max_tokens": 4, **extra}, headers=_auth(alice["api_key"])
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == param and error["code"] == "unsupported_value"

    # the worker itself refuses a watermarked request it could not honour, naming the field
    async with httpx.AsyncClient(base_url=str(gumbel_worker.health_url).removesuffix("/health"), timeout=60.0) as raw:
        xargs = {"xmark_message": alice["message_id"], "xmark_key_version": "v1", "xmark_salt": 0}
        refused = await raw.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 4, "presence_penalty": 0.5, "vllm_xargs": xargs},
        )
        assert refused.status_code == 400 and "presence_penalty is not supported" in refused.text, refused.text
