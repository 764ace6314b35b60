"""Prometheus metrics, defined once on a registry the caller passes in, and their HTTP endpoint."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from attnserve_server.domain import BatchReport

# 100 us to 10 s.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DROP_REASONS = ("queue_full", "deadline_exceeded", "cancelled", "shutting_down")


class Metrics:
    """Every metric attnserve exports. Label values: model names from config, never from requests."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "attnserve_requests",
            "Requests answered, by model, RPC method and gRPC status code.",
            ["model", "method", "code"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "attnserve_request_duration_seconds",
            "Server-side latency of a request, receipt to response.",
            ["model", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "attnserve_queue_wait_seconds",
            "Time a request waited in its model's queue before its batch ran.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.compute_duration = Histogram(
            "attnserve_compute_duration_seconds",
            "Time a device worker spent on one batch, copies included.",
            ["model", "device"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.batch_requests = Histogram(
            "attnserve_batch_requests",
            "Requests per batch.",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_sequences = Histogram(
            "attnserve_batch_sequences",
            "Sequences per batch.",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "attnserve_batch_tokens",
            "Query tokens per batch, before padding.",
            ["model"],
            buckets=BATCH_TOKEN_BUCKETS,
            registry=registry,
        )
        self.batch_padding = Histogram(
            "attnserve_batch_padding_ratio",
            "Share of a batch's query and key positions that are padding.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "attnserve_tokens",
            "Query tokens computed.",
            ["model"],
            registry=registry,
        )
        self.batch_failures = Counter(
            "attnserve_batch_failures",
            "Batches that raised on their device worker.",
            ["model", "device"],
            registry=registry,
        )
        self.dropped = Counter(
            "attnserve_dropped_requests",
            "Requests accepted or refused without being computed, by reason.",
            ["model", "reason"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "attnserve_queue_depth",
            "Requests waiting in the model's queue.",
            ["model"],
            registry=registry,
        )
        self.queue_capacity = Gauge(
            "attnserve_queue_capacity",
            "The most requests the model's queue holds (max_queue_size); more are refused.",
            ["model"],
            registry=registry,
        )
        self.inflight = Gauge(
            "attnserve_inflight_requests",
            "Requests being handled: received and not yet answered.",
            ["model"],
            registry=registry,
        )
        self.model_info = Info(
            "attnserve_model",
            "A served model's configuration.",
            ["model"],
            registry=registry,
        )

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)

    def watch_cuda_memory(self, devices: list[str]) -> None:
        if devices:
            self.registry.register(_CudaMemoryCollector(devices))

    def serve_http(self, host: str, port: int):
        """Starts the /metrics endpoint on its own thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


@dataclass
class Duration:
    """A count and a total time, as KServe statistics report them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9) * count


@dataclass
class BatchPhases:
    """Compute time split as Triton splits it: inputs, the inference, outputs."""

    input: Duration = field(default_factory=Duration)
    infer: Duration = field(default_factory=Duration)
    output: Duration = field(default_factory=Duration)

    def add(self, report: BatchReport, requests: int) -> None:
        """Each of the batch's `requests` is charged the batch's phase times, as Triton counts them."""
        self.input.add(report.input_s, requests)
        self.infer.add(report.infer_s, requests)
        self.output.add(report.output_s, requests)


@dataclass
class InferenceStats:
    """One model's totals since start, fed by the same calls that feed its Prometheus series.

    Updated and read on the event loop only. KServe v2's ModelStatistics is built from it.
    """

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: BatchPhases = field(default_factory=BatchPhases)  # per request
    by_batch_size: dict[int, BatchPhases] = field(default_factory=dict)  # per batch, by sequences
    inference_count: int = 0  # sequences computed
    execution_count: int = 0  # batches computed
    last_inference_ms: int = 0


class ModelMetrics:
    """One model's label children, bound once (label lookups are not free on the request path)."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._metrics = metrics
        self.model = model
        self._queue_wait = metrics.queue_wait.labels(model)
        self._batch_requests = metrics.batch_requests.labels(model)
        self._batch_sequences = metrics.batch_sequences.labels(model)
        self._batch_tokens = metrics.batch_tokens.labels(model)
        self._batch_padding = metrics.batch_padding.labels(model)
        self._tokens = metrics.tokens.labels(model)
        self._queue_depth = metrics.queue_depth.labels(model)
        self.inflight = metrics.inflight.labels(model)
        self.stats = InferenceStats()
        self._dropped = {reason: metrics.dropped.labels(model, reason) for reason in DROP_REASONS}
        # (method, status code) -> its counter and histogram children: a label lookup takes a lock and
        # builds tuples, so each pair pays it once, not once per request.
        self._done: dict[tuple[str, grpc.StatusCode], tuple[Any, Any]] = {}
        for child in self._dropped.values():
            child.inc(0)

    def describe(self, queue_capacity: int, **info: str) -> None:
        self._metrics.model_info.labels(self.model).info(info)
        self._metrics.queue_capacity.labels(self.model).set(queue_capacity)

    # BatchObserver
    def queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def dropped(self, reason: str) -> None:
        self._dropped[reason].inc()

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
        self._batch_requests.observe(requests)
        for wait in queue_waits_s:
            self._queue_wait.observe(wait)
            self.stats.queue.add(wait)

    # worker reports
    def batch_computed(self, device: str, report: BatchReport) -> None:
        self._metrics.compute_duration.labels(self.model, device).observe(report.compute_s)
        self._batch_sequences.observe(report.sequences)
        self._batch_tokens.observe(report.tokens)
        self._batch_padding.observe(report.padding_fraction)
        self._tokens.inc(report.tokens)
        stats = self.stats
        stats.compute.add(report, report.requests)
        by_size = stats.by_batch_size.get(report.sequences)
        if by_size is None:
            by_size = stats.by_batch_size[report.sequences] = BatchPhases()
        by_size.add(report, 1)
        stats.inference_count += report.sequences
        stats.execution_count += 1
        stats.last_inference_ms = int(time.time() * 1e3)

    def batch_failed(self, device: str) -> None:
        self._metrics.batch_failures.labels(self.model, device).inc()

    def request_done(self, method: str, code: grpc.StatusCode, duration_s: float) -> None:
        children = self._done.get((method, code))
        if children is None:
            m = self._metrics
            children = m.requests.labels(self.model, method, code.name), m.request_duration.labels(self.model, method)
            self._done[(method, code)] = children
        children[0].inc()
        children[1].observe(duration_s)
        (self.stats.success if code is grpc.StatusCode.OK else self.stats.fail).add(duration_s)


class _CudaMemoryCollector(Collector):
    """Reads device memory at scrape time, so the request path pays nothing for it."""

    def __init__(self, devices: list[str]) -> None:
        self._devices = devices

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import torch

        allocated = GaugeMetricFamily(
            "attnserve_device_memory_allocated_bytes",
            "Memory held by tensors on a CUDA device.",
            labels=["device"],
        )
        reserved = GaugeMetricFamily(
            "attnserve_device_memory_reserved_bytes",
            "Memory reserved by torch's caching allocator on a CUDA device.",
            labels=["device"],
        )
        for device in self._devices:
            allocated.add_metric([device], torch.cuda.memory_allocated(device))
            reserved.add_metric([device], torch.cuda.memory_reserved(device))
        yield allocated
        yield reserved
