"""OpenTelemetry through the real server: a span per request continuing the client's trace, its queue
wait as a child, and a span per batch linked to every request it served (SDK in-memory exporter)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from attnserve import AttnServeError, Client
from attnserve_server import tracing
from attnserve_server.domain import BatchReport

from conftest import model, running, settings


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_requests_and_their_batch_are_traced_and_linked(spans) -> None:
    provider, exporter = spans
    # Two requests, one batch: it closes at two sequences, long before its minute of delay.
    # One process: with edge processes the request spans are the edges' (exported by their own OTLP
    # exporter), out of this exporter's sight; the link across processes is tested below.
    served = settings(model(embed_dim=32, num_heads=4, max_batch_size=2, max_queue_delay_ms=60_000), edge_processes=1)
    with running(served, tracer_provider=provider) as handle:
        client_tracer = provider.get_tracer("test-client")
        with (
            client_tracer.start_as_current_span("caller") as caller,
            Client(handle.target, timeout_s=30, trace=True) as c,
        ):
            trace_id = caller.get_span_context().trace_id
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                # Threads do not inherit the current span: the context goes along explicitly.
                from opentelemetry import context

                ctx = context.get_current()

                def call() -> object:
                    token = context.attach(ctx)
                    try:
                        return c.attend(np.ones((3, 32), np.float32))
                    finally:
                        context.detach(token)

                results = [f.result() for f in [pool.submit(call) for _ in range(2)]]
        assert all(r.timing.batch_size == 2 for r in results)
    finished = exporter.get_finished_spans()
    requests = [s for s in finished if s.name == "attnserve Attend"]
    queues = [s for s in finished if s.name == "attnserve queue"]
    batches = [s for s in finished if s.name == "attnserve batch"]
    assert len(requests) == 2 and len(queues) == 2 and len(batches) == 1
    for span in requests:
        assert span.context.trace_id == trace_id  # the client's trace continues on the server
        assert span.attributes["attnserve.model"] == "default" and span.attributes["rpc.grpc.status_code"] == "OK"
        assert (
            span.attributes["attnserve.batch.requests"] == 2 and span.attributes["attnserve.batch.padded_tokens"] == 6
        )
    assert {q.parent.span_id for q in queues} == {s.context.span_id for s in requests}
    (batch,) = batches
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in requests}
    assert batch.attributes["attnserve.batch.sequences"] == 2 and batch.attributes["attnserve.device"] == "cpu"
    assert batch.start_time <= batch.end_time


def test_a_failed_request_has_an_error_span(spans) -> None:
    provider, exporter = spans
    served = settings(model(embed_dim=32, num_heads=4), edge_processes=1)  # see above
    with (
        running(served, tracer_provider=provider) as handle,
        Client(handle.target, timeout_s=10) as c,
        pytest.raises(AttnServeError),
    ):
        c.attend(np.ones((3, 16), np.float32))  # wrong width
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "attnserve Attend"]
    assert span.attributes["rpc.grpc.status_code"] == "INVALID_ARGUMENT" and not span.status.is_ok


def test_tracing_is_off_unless_the_environment_asks_for_it() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    with running(settings(model(embed_dim=32, num_heads=4))) as handle:
        assert handle.server.tracing is None  # the test environment sets no OTEL_* variable


def test_a_batch_span_links_a_request_span_of_another_process(spans) -> None:
    # With edge processes, a request's span is the edge's; its identity crosses to the engine as
    # plain numbers, and the engine's batch span links to it.
    provider, exporter = spans
    t = tracing.Tracing(provider)
    request_span = t.request_started("Attend", "default", None)
    ids = t.context_of(request_span)
    report = BatchReport(1.0, 0.001, 0.0001, 0.0008, 0.0001, 1, 1, 8, 8, 0.0)
    t.batch_done("default", "cpu", report, [t.remote_span(ids)])
    (batch,) = [s for s in exporter.get_finished_spans() if s.name == "attnserve batch"]
    (linked,) = batch.links
    assert (linked.context.trace_id, linked.context.span_id) == ids[:2]
    assert linked.context.trace_id == request_span.get_span_context().trace_id
