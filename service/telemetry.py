"""OpenTelemetry traces of each request, exported over OTLP/HTTP when an endpoint is configured.

Off by default: with no ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) the tracer is
OpenTelemetry's no-op tracer and a span costs a function call. On, each HTTP request gets a server
span (``POST /v1/chat/completions``...) with children:

- ``auth``: the API key checked;
- ``queue``: admission (a queue slot and the caller's limits);
- ``chat {model}`` / ``text_completion {model}``: the generation, with the GenAI semantic
  conventions' ``gen_ai.*`` attributes (model, sampling parameters, finish reasons, token usage);
- ``record``: the generation records made durable;
- ``trace``: a /trace analysis (decoder, verdict, scored tokens).

Spans never carry prompt or completion text, API keys, key hashes, secrets or message IDs: the
attributes below are the whole list, and the tests check it. The caller is ``enduser.id`` (the
numeric user id, as in the generation records). The exporter runs in a background thread with a
bounded queue: a collector that is down or slow never slows a request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from service.config import Settings

INSTRUMENTATION_NAME = "xmark-gateway"
# the exporter's own wait for a collector, in seconds (it runs off the request path)
EXPORT_TIMEOUT_S = 5.0

AttributeValue = str | bool | int | float | list[str] | list[int] | list[float]


# reentrant and stateless: one for every span of a process whose telemetry is off
_NO_SPAN = contextlib.nullcontext(INVALID_SPAN)


class Telemetry:
    """The process's tracer (no-op unless configured) and its shutdown."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._provider = provider
        self.tracer: Tracer = NoOpTracer() if provider is None else provider.get_tracer(INSTRUMENTATION_NAME)

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def span(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue | None] | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> contextlib.AbstractContextManager[Span]:
        """A child of the current span; an exception marks it as an error (its type only). With
        telemetry off, the invalid span in a null context (a no-op tracer's span still switches the
        current context in and out on every call, for nothing)."""
        if self._provider is None:
            return _NO_SPAN
        return self._span(name, attributes, kind)

    @contextlib.contextmanager
    def _span(
        self, name: str, attributes: Mapping[str, AttributeValue | None] | None, kind: SpanKind
    ) -> Iterator[Span]:
        clean = {k: v for k, v in (attributes or {}).items() if v is not None}
        with self.tracer.start_as_current_span(
            name, kind=kind, attributes=clean, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                yield span
            except BaseException as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.set_attribute("error.type", type(exc).__name__)
                raise

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()


def build_provider(service_name: str, exporter: SpanExporter, *, batch: bool = True) -> TracerProvider:
    """A tracer provider of its own (never the global one) exporting to ``exporter``."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    processor = BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_S * 1000) if batch else None
    provider.add_span_processor(processor or SimpleSpanProcessor(exporter))
    return provider


def open_telemetry(settings: Settings) -> Telemetry:
    """The configured telemetry: OTLP/HTTP to ``otel_traces_endpoint`` or ``otel_endpoint``, else off."""
    if settings.otel_traces_endpoint:
        endpoint = settings.otel_traces_endpoint
    elif settings.otel_endpoint:
        endpoint = settings.otel_endpoint.rstrip("/") + "/v1/traces"
    else:
        return Telemetry()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    return Telemetry(build_provider(settings.otel_service_name, exporter))


def _route_name(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return str(path) if path else "unmatched"


class TracingMiddleware:
    """The server span of each HTTP request: method and route template as its name; method, path
    (never the query string), route and status as attributes. Reads the process's ``Telemetry``
    from the app's resources, so it does nothing before start-up or when telemetry is off."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        resources = getattr(scope["app"].state, "resources", None) if scope["type"] == "http" else None
        telemetry: Telemetry | None = getattr(resources, "telemetry", None)
        if telemetry is None or not telemetry.enabled:
            await self.app(scope, receive, send)
            return
        method = str(scope.get("method", ""))
        status = 500
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        attributes: dict[str, Any] = {"http.request.method": method, "url.path": str(scope.get("path", ""))}
        with telemetry.tracer.start_as_current_span(
            method, kind=SpanKind.SERVER, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                route = _route_name(scope)
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                span.set_attribute("xmark.duration_ms", (time.perf_counter() - started) * 1000)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
