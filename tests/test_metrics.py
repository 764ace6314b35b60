"""The request path's plain-number series export exactly what prometheus_client would."""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from attnserve_server.metrics import LATENCY_BUCKETS_S, Metrics


def samples(registry: CollectorRegistry, family: str) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_request_latency_matches_a_prometheus_client_histogram_bucket_for_bucket() -> None:
    # Values on bucket bounds, between them, below the first and above the last.
    values = [0.0, 0.0001, 0.00011, 0.001, 0.0049, 0.005, 0.3, 10.0, 11.0, 0.25, 0.25]
    ours = CollectorRegistry()
    model = Metrics(ours).for_model("m")
    theirs = CollectorRegistry()
    reference = Histogram(
        "attnserve_request_duration_seconds", "x", ["model", "method"], buckets=LATENCY_BUCKETS_S, registry=theirs
    )
    for v in values:
        model.request_started()
        model.request_done("Attend", grpc.StatusCode.OK, v)
        reference.labels("m", "Attend").observe(v)
    got = samples(ours, "attnserve_request_duration_seconds")
    want = samples(theirs, "attnserve_request_duration_seconds")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-12, key


def test_requests_in_flight_and_by_code_are_counted() -> None:
    registry = CollectorRegistry()
    model = Metrics(registry).for_model("m")
    for code in (grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT):
        model.request_started()
        model.request_done("ModelInfer", code, 0.01)
    model.request_started()  # still being handled
    model.queue_depth(3)
    requests = samples(registry, "attnserve_requests")
    assert requests[("attnserve_requests_total", (("code", "OK"), ("method", "ModelInfer"), ("model", "m")))] == 2
    assert (
        requests[("attnserve_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "ModelInfer"), ("model", "m")))]
        == 1
    )
    assert samples(registry, "attnserve_inflight_requests") == {("attnserve_inflight_requests", (("model", "m"),)): 1}
    assert samples(registry, "attnserve_queue_depth") == {("attnserve_queue_depth", (("model", "m"),)): 3}
