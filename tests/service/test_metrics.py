"""Prometheus metrics: requests by route and status, latency, generation and trace counters."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import httpx

from service.metrics import Metrics


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}") + 1]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_requests_are_counted_by_route_template_and_status(client: httpx.AsyncClient, admin_key: str) -> None:
    before = (await client.get("/metrics")).text
    await client.get("/healthz")
    await client.get("/admin/users/1", headers={"Authorization": f"Bearer {admin_key}"})
    await client.get("/admin/users/2", headers={"Authorization": f"Bearer {admin_key}"})
    await client.get("/admin/users/3")
    await client.get("/no/such/route")
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = response.text

    def delta(**labels: str) -> float:
        return _sample(after, "xmark_http_requests_total", **labels) - _sample(
            before, "xmark_http_requests_total", **labels
        )

    assert delta(route="/healthz", method="GET", status="200") == 1
    user_route = "/admin/users/{user_id}"
    assert (
        delta(route=user_route, method="GET", status="404") + delta(route=user_route, method="GET", status="200") == 2
    )
    assert delta(route=user_route, method="GET", status="401") == 1
    assert delta(route="unmatched", method="GET", status="404") == 1
    assert "/admin/users/1" not in after  # raw paths never become labels
    assert _sample(after, "xmark_http_request_duration_seconds_count", route="/healthz") >= 1
    assert 'xmark_http_request_duration_seconds_bucket{le="0.005",route="/healthz"}' in after


async def test_domain_counters_are_exposed(app: Any, client: httpx.AsyncClient) -> None:
    metrics: Metrics = app.state.resources.metrics
    metrics.tokens_generated.labels(kind="completion", model="m").inc(5)
    metrics.trace_verdicts.labels(verdict="watermarked", attributed="yes").inc()
    text = (await client.get("/metrics")).text
    assert _sample(text, "xmark_tokens_total", kind="completion") >= 5
    assert _sample(text, "xmark_trace_verdicts_total", verdict="watermarked", attributed="yes") >= 1
    assert "# TYPE xmark_generations_total counter" in text


def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.generations.labels(finish_reason="stop", model="m").inc()
    assert b'finish_reason="stop"' in first.render()
    assert b'finish_reason="stop"' not in second.render()


async def test_latency_ends_with_the_response_not_with_work_after_it(caplog: Any) -> None:
    """Work an app does after its last byte is sent (a generation record) is not client latency."""
    after_response_s = 1.5
    import asyncio
    import logging

    from starlette.applications import Starlette

    from service.middleware import RequestContextMiddleware

    async def respond_then_work(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})
        await asyncio.sleep(after_response_s)  # after the response

    holder = Starlette()
    holder.state.resources = SimpleNamespace(metrics=Metrics())  # what the middleware reads of the app
    inner = RequestContextMiddleware(respond_then_work)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = holder
        await inner(scope, receive, send)

    with caplog.at_level(logging.INFO, logger="xmark.access"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.get("/x")).text == "done"
    [line] = [r for r in caplog.records if r.name == "xmark.access"]
    # not the 1.5 s spent after the response; 5x margin and more below it: the response itself
    # took a few ms here (was 150 ms against 300 ms after it, 2x, too little for a busy machine)
    assert line.duration_ms < 300
    rendered = holder.state.resources.metrics.render().decode()
    # the histogram too: below the bucket the 1.5 s would fall in
    assert _sample(rendered, "xmark_http_request_duration_seconds_bucket", route="unmatched", le="0.5") == 1
