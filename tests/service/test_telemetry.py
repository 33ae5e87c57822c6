"""OpenTelemetry: off unless configured; when on, one span tree per request with the GenAI
attributes, never the prompt, the completion, the API key or the message ID; a collector that is
down costs the requests nothing."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer

from service.config import Settings
from service.telemetry import Telemetry, build_provider, open_telemetry

MODEL = "smollm2-135m-instruct"
PROMPT = "Tell me a secret about zebras, please."


@pytest.fixture
async def spans(app: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[InMemorySpanExporter]:
    assert await app.state.resources.backend.wait_ready(180), "the model backend did not load"
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(build_provider("xmark-test", exporter, batch=False))
    monkeypatch.setattr(app.state.resources, "telemetry", telemetry)
    yield exporter
    telemetry.shutdown()


def _values(span: ReadableSpan) -> list[str]:
    return [json.dumps(v) if not isinstance(v, str) else v for v in (span.attributes or {}).values()]


def _by_name(finished: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    matches = [s for s in finished if s.name == name]
    assert len(matches) == 1, [s.name for s in finished]
    return matches[0]


async def test_a_chat_request_is_one_span_tree_without_secrets_or_text(
    client: httpx.AsyncClient, make_user: Any, spans: InMemorySpanExporter
) -> None:
    principal, key = await make_user("user")
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200
    completion = response.json()["choices"][0]["message"]["content"]
    finished = spans.get_finished_spans()
    server = _by_name(finished, "POST /v1/chat/completions")
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.route"] == "/v1/chat/completions"
    model = _by_name(finished, f"chat {MODEL}")
    for name in ("auth", "queue", "record"):
        child = _by_name(finished, name)
        assert child.context is not None and server.context is not None
        assert child.context.trace_id == server.context.trace_id
    assert model.parent is not None and server.context is not None and model.parent.span_id == server.context.span_id
    attributes = model.attributes or {}
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["gen_ai.usage.output_tokens"] == response.json()["usage"]["completion_tokens"]
    assert attributes["gen_ai.usage.input_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == (response.json()["choices"][0]["finish_reason"],)
    assert attributes["enduser.id"] == str(principal["user_id"])
    secrets = [PROMPT, "zebras", key, key[:12], principal["message_id"]] + ([completion] if completion.strip() else [])
    for span in finished:
        for value in _values(span):
            assert not any(secret in value for secret in secrets), (span.name, value)


async def test_a_streamed_request_and_a_refusal(
    client: httpx.AsyncClient, make_user: Any, spans: InMemorySpanExporter
) -> None:
    _, key = await make_user("user")
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        assert r.status_code == 200
        _ = [line async for line in r.aiter_lines()]
    model = _by_name(spans.get_finished_spans(), f"chat {MODEL}")
    assert (model.attributes or {})["gen_ai.usage.output_tokens"] >= 1
    spans.clear()
    bad = await client.post("/v1/chat/completions", json={"model": MODEL}, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    auth = _by_name(spans.get_finished_spans(), "auth")
    assert (auth.attributes or {})["error.type"] == "AuthenticationError"
    assert "nope" not in json.dumps([_values(s) for s in spans.get_finished_spans()])


@pytest.mark.model  # /trace reads the text with the served model's tokenizer
async def test_a_trace_span_has_the_verdict_not_the_text(
    app: Any, client: httpx.AsyncClient, make_user: Any, spans: InMemorySpanExporter
) -> None:
    assert await app.state.resources.backend.wait_ready(180), "the local model did not load"
    _, key = await make_user("auditor")
    text = "A plain sentence written by a person about gardening in the spring. " * 3
    response = await client.post("/trace", json={"text": text}, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    span = _by_name(spans.get_finished_spans(), "trace")
    attributes = span.attributes or {}
    assert attributes["xmark.trace.watermarked"] is response.json()["watermarked"]
    assert "gardening" not in json.dumps(_values(span))


def test_off_unless_an_endpoint_is_configured(settings: Settings) -> None:
    telemetry = open_telemetry(settings.model_copy(update={"otel_endpoint": None, "otel_traces_endpoint": None}))
    assert not telemetry.enabled and isinstance(telemetry.tracer, NoOpTracer)


def test_the_standard_variables_configure_it(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.invalid:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-eu")
    configured = Settings(**{k: v for k, v in settings.model_dump().items() if not k.startswith("otel_")})
    assert configured.otel_endpoint == "http://collector.invalid:4318"
    assert configured.otel_service_name == "gateway-eu"


async def test_a_collector_that_is_down_costs_the_requests_nothing(
    app: Any, client: httpx.AsyncClient, make_user: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    telemetry = open_telemetry(settings.model_copy(update={"otel_endpoint": f"http://127.0.0.1:{port}"}))
    assert telemetry.enabled
    monkeypatch.setattr(app.state.resources, "telemetry", telemetry)
    _, key = await make_user("user")
    started = time.monotonic()
    for _ in range(5):
        response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
    # the export runs in the background, not in the request: 5x margin and more, the five took
    # 0.03 s here, where an export in the request would cost each the 3.4 s a shutdown takes below
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, elapsed
    started = time.monotonic()
    telemetry.shutdown()
    # bounded by the exporter's timeout (EXPORT_TIMEOUT_S, 5 s), not the SDK's default bound of a
    # flush (30 s): 5x margin, the shutdown took 3.4 s here
    elapsed = time.monotonic() - started
    assert elapsed < 20.0, elapsed
