"""OpenTelemetry tracing: a server span per request, a child span for its wait in the queue, and a
span per batch linked to every request it served.

Off unless the `otel` extra is installed and the standard OTEL_* variables ask for traces
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER`
other than `none`); when off, the request path holds None and pays one comparison. A caller's W3C
`traceparent` metadata makes the request span its child, so a client's trace continues.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from attnserve_server.domain import BatchReport

log = logging.getLogger(__name__)
# perf_counter() -> epoch nanoseconds, for spans whose times the worker measured.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf_counter_s: float) -> int:
    return int(perf_counter_s * 1e9) + _EPOCH_OFFSET_NS


def wanted(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the OTEL_* environment asks for traces."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "")
    if exporter:
        return exporter.lower() != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def from_environment() -> Tracing | None:
    """Tracing set up from OTEL_* (an OTLP exporter in a batch processor), or None when not asked for."""
    if not wanted():
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces but OpenTelemetry is not installed: pip install 'attnserve[otel]'")
        return None
    service = os.environ.get("OTEL_SERVICE_NAME", "attnserve")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing: OTLP spans as service %r", service)
    return Tracing(provider)


class Tracing:
    """Spans for requests and batches on one tracer provider (the SDK's; tests pass an in-memory one)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._tracer = provider.get_tracer("attnserve")
        self._propagator = TraceContextTextMapPropagator()
        self._provider = provider

    def request_started(self, method: str, model: str, metadata: Sequence[tuple[str, Any]] | None) -> Any:
        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        parent = self._propagator.extract(carrier)
        return self._tracer.start_span(
            f"attnserve {method}",
            context=parent,
            kind=self._trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method, "attnserve.model": model},
        )

    def request_done(self, span: Any, code: str, received_s: float, batch: BatchReport | None) -> None:
        """Ends a request's span; with its batch, records the queue wait as a child span."""
        if batch is not None:
            context = self._trace.set_span_in_context(span)
            queue = self._tracer.start_span("attnserve queue", context=context, start_time=epoch_ns(received_s))
            queue.end(end_time=epoch_ns(batch.started))
            span.set_attributes(
                {
                    "attnserve.batch.requests": batch.requests,
                    "attnserve.batch.sequences": batch.sequences,
                    "attnserve.batch.padded_tokens": batch.padded_tokens,
                }
            )
        span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, code))
        span.end()

    def batch_done(self, model: str, device: str, batch: BatchReport, request_spans: Sequence[Any]) -> None:
        """A span for the batch on its device, linked to the span of every request it served."""
        links = [self._trace.Link(s.get_span_context()) for s in request_spans]
        span = self._tracer.start_span(
            "attnserve batch",
            links=links,
            start_time=epoch_ns(batch.started),
            attributes={
                "attnserve.model": model,
                "attnserve.device": device,
                "attnserve.batch.requests": batch.requests,
                "attnserve.batch.sequences": batch.sequences,
                "attnserve.batch.tokens": batch.tokens,
                "attnserve.batch.padded_tokens": batch.padded_tokens,
                "attnserve.batch.padding_fraction": batch.padding_fraction,
            },
        )
        span.end(end_time=epoch_ns(batch.started + batch.compute_s))

    @staticmethod
    def context_of(span: Any) -> tuple[int, int, int]:
        """A span's identity as plain numbers, to cross to another process (edge -> engine)."""
        context = span.get_span_context()
        return context.trace_id, context.span_id, int(context.trace_flags)

    def remote_span(self, ids: tuple[int, int, int]) -> Any:
        """A stand-in for a span of another process, for a batch span's links."""
        trace_id, span_id, flags = ids
        context = self._trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=self._trace.TraceFlags(flags))
        return self._trace.NonRecordingSpan(context)

    def shutdown(self) -> None:
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is not None:
            shutdown()  # flushes spans still in the batch processor
