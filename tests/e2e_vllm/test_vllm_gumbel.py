"""End to end with a real vLLM worker on the default watermark parameters (configured scheme ``auto``):
the worker's processor samples every token of a request for a key version's distortion-free primary
with the user's key (8-bit blocks, 16 salts), the gateway gives a user's answers consecutive salts and
traces each to its author (also one sampled within a top-p / top-k / min-p nucleus); what the keyed
sampler cannot carry (greedy decoding, penalties, n > 1) the gateway sends to the version's biasing
companion, which the worker serves too, and the worker itself refuses it for the primary by name.

The processes come from conftest.py: a CPU ``vllm serve`` with no watermark parameter set and an
``xmark serve`` gateway on the same defaults, on a SQLite database of its own.
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
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
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

        # no seed: a request with one is written under a salt derived from it (the same seed, the same answer)
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 160, "temperature": 0.8}
        texts = []
        # bob's request sets a nucleus: the worker samples with the key inside it
        for person, nucleus in ((alice, {}), (alice, {}), (bob, {"top_p": 0.95, "top_k": 50, "min_p": 0.01})):
            response = await client.post(
                "/v1/chat/completions", json={**body, **nucleus}, headers=_auth(person["api_key"])
            )
            assert response.status_code == 200, response.text
            texts.append((person, response.json()["choices"][0]["message"]["content"]))
        # alice asked twice: consecutive salts, two different answers (the keyed choice is the draw)
        assert texts[0][1] != texts[1][1]
        for person, text in texts:
            traced = await client.post("/trace", json={"text": text}, headers=_auth(auditor["api_key"]))
            assert traced.status_code == 200, traced.text
            report = traced.json()
            # a draw (unseeded answers of 160 tokens): conftest.py, statistical outcomes
            assert report["attribution"] is not None, report["candidates"]
            assert report["attribution"]["user_id"] == person["id"]

        # what the worker would apply after its choice, greedy decoding, and n > 1 (one salt for vLLM's
        # child requests): written by the companion, not refused
        for extra in ({"presence_penalty": 0.5}, {"temperature": 0}, {"n": 2}):
            served = await client.post(
                "/v1/chat/completions", json={**body, "max_tokens": 4, **extra}, headers=_auth(alice["api_key"])
            )
            assert served.status_code == 200, served.text
            assert len(served.json()["choices"]) == extra.get("n", 1)

    # the worker itself refuses a request for the primary that it could not honour, naming the field
    # (5x margin and more: a refusal answers at once)
    async with httpx.AsyncClient(base_url=str(gumbel_worker.health_url).removesuffix("/health"), timeout=60.0) as raw:
        xargs = {"xmark_message": alice["message_id"], "xmark_key_version": "v1", "xmark_salt": 0}
        refused = await raw.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 4, "presence_penalty": 0.5, "vllm_xargs": xargs},
        )
        assert refused.status_code == 400 and "presence_penalty is not supported" in refused.text, refused.text


async def test_a_default_worker_writes_a_greedy_answer_with_the_companion(gumbel_worker: Any, e2e_config: Any) -> None:
    """The worker on the defaults (configured scheme auto) serves both encoders of a key version: a
    greedy request whose xargs select the companion (what the gateway sends for it) is biased by the
    companion, and the answer's tokens decode under the companion's key to the message."""
    from xmark_core import Message, decode, detect
    from xmark_core.encoders import DEFAULT_MESSAGE_BITS, encoder_keys, spec_for
    from xmark_core.secrets import parse_secret_entries

    secret = parse_secret_entries(e2e_config.watermark_secrets, source="the test secrets")["v1"]
    _, companion = encoder_keys(secret, spec_for("auto", bits=DEFAULT_MESSAGE_BITS))
    bits = "01101100000110111001001101100100" * (DEFAULT_MESSAGE_BITS // 32)
    xargs = {
        "xmark_message": bits,
        "xmark_key_version": "v1",
        "xmark_encoder": "companion",
        "xmark_fingerprint": companion.fingerprint,
    }
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    # 5x margin and more: four answers of 256 tokens in one batch of a CPU worker took 27 s here,
    # a trace 28 s at most (test_vllm_e2e)
    async with httpx.AsyncClient(base_url=str(gumbel_worker.health_url).removesuffix("/health"), timeout=600.0) as raw:
        response = await raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    token_ids = response.json()["choices"][0]["token_ids"]
    assert len(token_ids) > 200
    decoded = decode(token_ids, companion)
    # the watermark is there (the calibrated test at its default level), and the message read from
    # it: greedy text repeats itself (the decoder reads each context once), so some of the 32 blocks
    # may be misread or unread; 18 or more right has probability 1.6e-4 by chance (Binomial(32, 1/4))
    detection = detect(decoded)
    assert detection.is_watermarked, detection
    sent = Message.from_bits(bits, companion.params).blocks
    assert len(sent) == 32
    right = int((decoded.blocks == sent).sum())
    assert right >= 18, (decoded.bits, bits, decoded.scored_tokens)
