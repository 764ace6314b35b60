"""Prometheus metrics, defined once on a registry the caller passes in (served by metrics_http.py)."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
DROP_REASONS = ("queue_full", "deadline_exceeded", "cancelled", "shutting_down", "unsent_answers")


class Metrics:
    """Every metric attnserve exports. Label values: model names from config, never from requests.

    The series a request or a batch touches are plain numbers updated on the event loop and exported
    at scrape time, the request path's by `_RequestPathCollector`, the batches' by `_BatchCollector`: a
    prometheus_client update takes a lock, a request made eight of them and a batch seven more, and
    on a lone request's cache-cold CPU the batch's cost 20-25 µs (BENCHMARKS.md, fourteenth pass).
    Only the series set once (queue capacity, model info) are prometheus_client objects.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._models: list[ModelMetrics] = []
        self._remote: list[Callable[[], list[ProcessSnapshot]]] = []
        self._front: Callable[[], FrontLoad] = FrontLoad  # watch_front
        registry.register(_RequestPathCollector(self.snapshot, self._remote))
        registry.register(_BatchCollector(self._models))
        self.queue_capacity = Gauge(
            "attnserve_queue_capacity",
            "The most requests the model's queue holds (max_queue_size); more are refused.",
            ["model"],
            registry=registry,
        )
        self.model_info = Info(
            "attnserve_model",
            "A served model's configuration.",
            ["model"],
            registry=registry,
        )
        # Set only when the quiet layout switches (runtime/cpu_layout.py), rarely: plain objects will do.
        self._quiet_layout = Gauge(
            "attnserve_quiet_layout",
            "1 while the quiet CPU layout pins the server's threads (a quiet server), else 0.",
            registry=registry,
        )
        self._quiet_layout_pinned = Counter(
            "attnserve_quiet_layout_pinned",
            "Times the quiet CPU layout pinned the server's threads (it frees them under load).",
            registry=registry,
        )

    def quiet_layout_changed(self, pinned: bool) -> None:
        self._quiet_layout.set(1 if pinned else 0)
        if pinned:
            self._quiet_layout_pinned.inc()

    def for_model(self, model: str) -> ModelMetrics:
        return self._add(ModelMetrics(self, model))

    def for_unknown_models(self) -> ModelMetrics:
        """Where requests naming no served model are counted: `model=""`, in the request series only
        (it has no queue and no batches, so no batch series either)."""
        return self._add(ModelMetrics(self, ""))

    def _add(self, model_metrics: ModelMetrics) -> ModelMetrics:
        self._models.append(model_metrics)
        return model_metrics

    def snapshot(self) -> ProcessSnapshot:
        """The request path's numbers now, model by model, and what this process's gRPC servers hold (an
        edge process sends them to its engine)."""
        return ProcessSnapshot([m.snapshot() for m in list(self._models)], self._front())

    def add_remote(self, source: Callable[[], list[ProcessSnapshot]]) -> None:
        """Request-path numbers counted in other processes (the edges), summed into every scrape."""
        self._remote.append(source)

    def watch_front(self, source: Callable[[], FrontLoad]) -> None:
        """`source()`: what this process's gRPC servers hold now (answers owed, streams open), read at
        scrape time."""
        self._front = source

    def watch_cuda_memory(self, devices: list[str], pinned: Callable[[], dict[str, dict[str, int]]]) -> None:
        """Device memory per CUDA device, and `pinned()` ({model: {device: bytes}}) of page-locked host
        buffers, read at scrape time."""
        if devices:
            self.registry.register(_CudaMemoryCollector(devices, pinned))

    def watch_shared_memory(self, regions: Callable[[], dict[str, tuple[str, int, int]]]) -> None:
        """Clients' shared memory regions (edge/shared_memory.py): `regions()` is the table
        ({name: (key, offset, byte_size)}), read at scrape time."""
        self.registry.register(_SharedMemoryCollector(regions))


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
        # The batch series, exported for named models only: "" is the unknown-model sink
        # (for_unknown_models), which never batches. Written on the event loop (see Metrics).
        self.batch_requests = FastHistogram(BATCH_SIZE_BUCKETS)
        self.batch_sequences = FastHistogram(BATCH_SIZE_BUCKETS)
        self.batch_tokens = FastHistogram(BATCH_TOKEN_BUCKETS)
        self.batch_padding = FastHistogram(RATIO_BUCKETS)
        self.tokens = 0
        self.solo_batches = 0
        self.compute_duration: dict[str, FastHistogram] = {}  # device -> seconds a batch
        self.cpu_batches: dict[tuple[str, int], int] = {}  # (device, intra-op threads) -> batches
        self.paired_batches: dict[str, int] = {}  # device -> CPU batches computed beside another
        self.batch_failures: dict[str, int] = {}  # device -> batches that raised
        self.stats = InferenceStats()
        # The request path's series: plain numbers, written on the event loop only (see Metrics).
        self.inflight = 0
        self.depth = 0
        self.requests: dict[tuple[str, str], int] = {}  # (method, status code name) -> count
        self.durations: dict[str, FastHistogram] = {}  # method -> receipt-to-response seconds
        self.queue_wait = FastHistogram(LATENCY_BUCKETS_S)
        self.drops = dict.fromkeys(DROP_REASONS, 0)  # reason -> requests refused or dropped

    def describe(self, queue_capacity: int, **info: str) -> None:
        self._metrics.model_info.labels(self.model).info(info)
        self._metrics.queue_capacity.labels(self.model).set(queue_capacity)

    # BatchObserver
    def queue_depth(self, depth: int) -> None:
        self.depth = depth

    def dropped(self, reason: str) -> None:
        self.drops[reason] += 1

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
        self.batch_requests.observe(requests)
        for wait in queue_waits_s:
            self.queue_wait.observe(wait)
            self.stats.queue.add(wait)

    # worker reports
    def batch_computed(self, device: str, report: BatchReport) -> None:
        duration = self.compute_duration.get(device)
        if duration is None:
            duration = self.compute_duration[device] = FastHistogram(LATENCY_BUCKETS_S)
        duration.observe(report.compute_s)
        self.batch_sequences.observe(report.sequences)
        self.batch_tokens.observe(report.tokens)
        self.batch_padding.observe(report.padding_fraction)
        self.tokens += report.tokens
        if report.threads:
            key = (device, report.threads)
            self.cpu_batches[key] = self.cpu_batches.get(key, 0) + 1
            if report.paired:
                self.paired_batches[device] = self.paired_batches.get(device, 0) + 1
        stats = self.stats
        stats.compute.add(report, report.requests)
        by_size = stats.by_batch_size.get(report.sequences)
        if by_size is None:
            by_size = stats.by_batch_size[report.sequences] = BatchPhases()
        by_size.add(report, 1)
        stats.inference_count += report.sequences
        stats.execution_count += 1
        stats.last_inference_ms = int(time.time() * 1e3)

    def solo_ran(self) -> None:
        self.solo_batches += 1

    def batch_failed(self, device: str) -> None:
        self.batch_failures[device] = self.batch_failures.get(device, 0) + 1

    def request_started(self) -> None:
        self.inflight += 1

    def snapshot(self) -> RequestPathSnapshot:
        durations = {method: (list(h.counts), h.sum) for method, h in list(self.durations.items())}
        stats = self.stats
        return RequestPathSnapshot(
            self.model,
            self.inflight,
            self.depth,
            dict(self.requests),
            durations,
            (list(self.queue_wait.counts), self.queue_wait.sum),
            Duration(stats.success.count, stats.success.ns),
            Duration(stats.fail.count, stats.fail.ns),
            dict(self.drops),
        )

    def request_done(self, method: str, code: grpc.StatusCode, duration_s: float) -> None:
        self.inflight -= 1
        key = (method, code.name)
        self.requests[key] = self.requests.get(key, 0) + 1
        histogram = self.durations.get(method)
        if histogram is None:
            histogram = self.durations[method] = FastHistogram(LATENCY_BUCKETS_S)
        histogram.observe(duration_s)
        (self.stats.success if code is grpc.StatusCode.OK else self.stats.fail).add(duration_s)


@dataclass
class RequestPathSnapshot:
    """One model's request-path numbers in one process, as plain data: what crosses from an edge
    process to its engine, and what scrapes and KServe statistics sum over every process."""

    model: str
    inflight: int
    depth: int
    requests: dict[tuple[str, str], int]  # (method, status code name) -> count
    durations: dict[str, tuple[list[int], float]]  # method -> (bucket counts, sum)
    queue_wait: tuple[list[int], float]
    success: Duration
    fail: Duration
    drops: dict[str, int]  # reason -> count

    def add(self, other: RequestPathSnapshot) -> None:
        self.inflight += other.inflight
        self.depth += other.depth
        for key, n in other.requests.items():
            self.requests[key] = self.requests.get(key, 0) + n
        for method, histogram in other.durations.items():
            mine = self.durations.get(method)
            self.durations[method] = histogram if mine is None else _sum_histograms(mine, histogram)
        self.queue_wait = _sum_histograms(self.queue_wait, other.queue_wait)
        self.success = Duration(self.success.count + other.success.count, self.success.ns + other.success.ns)
        self.fail = Duration(self.fail.count + other.fail.count, self.fail.ns + other.fail.ns)
        for reason, n in other.drops.items():
            self.drops[reason] = self.drops.get(reason, 0) + n


@dataclass(frozen=True, slots=True)
class FrontLoad:
    """What a process's gRPC servers hold now: the bytes of answers they owe clients, being computed or
    sent and not yet read (edge/outbox.py), the streams open, and the streams refused so far for
    max_open_streams (edge/registration.OpenStreams)."""

    unsent_bytes: int = 0
    open_streams: int = 0
    refused_streams: int = 0

    def __add__(self, other: FrontLoad) -> FrontLoad:
        return FrontLoad(
            self.unsent_bytes + other.unsent_bytes,
            self.open_streams + other.open_streams,
            self.refused_streams + other.refused_streams,
        )


@dataclass(frozen=True, slots=True)
class ProcessSnapshot:
    """One process's request-path numbers, model by model, and what its gRPC servers hold."""

    models: list[RequestPathSnapshot]
    front: FrontLoad


def _sum_histograms(a: tuple[list[int], float], b: tuple[list[int], float]) -> tuple[list[int], float]:
    return [x + y for x, y in zip(a[0], b[0], strict=True)], a[1] + b[1]


def merge_snapshots(snapshots: Iterable[RequestPathSnapshot]) -> dict[str, RequestPathSnapshot]:
    """Sums snapshots model by model, in the order models first appear."""
    merged: dict[str, RequestPathSnapshot] = {}
    for snap in snapshots:
        mine = merged.get(snap.model)
        if mine is None:
            empty = ([0] * len(snap.queue_wait[0]), 0.0)
            merged[snap.model] = mine = RequestPathSnapshot(snap.model, 0, 0, {}, {}, empty, Duration(), Duration(), {})
        mine.add(snap)
    return merged


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    total, out = 0, []
    for bound, n in zip((*bounds, math.inf), counts, strict=True):
        total += n
        out.append((floatToGoString(bound), total))
    return out


class FastHistogram:
    """A histogram as plain numbers: one writer (the event loop), read at scrape time without a lock.

    A scrape copies the bucket list in one step, so its count always equals its +Inf bucket; the sum
    may be one observation ahead, which Prometheus' rate() arithmetic does not notice.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.sum += value


class _RequestPathCollector(Collector):
    """Exports the request path's plain-number series of every model at scrape time, summed over
    this process and any remote sources (edge processes)."""

    def __init__(self, local: Callable[[], ProcessSnapshot], remote: list[Callable[[], list[ProcessSnapshot]]]) -> None:
        self._local = local
        self._remote = remote

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily(
            "attnserve_requests", "Requests answered, by model, RPC method and gRPC status code.",
            labels=["model", "method", "code"],
        )  # fmt: skip
        duration = HistogramMetricFamily(
            "attnserve_request_duration_seconds", "Server-side latency of a request, receipt to response.",
            labels=["model", "method"],
        )  # fmt: skip
        queue_wait = HistogramMetricFamily(
            "attnserve_queue_wait_seconds", "Time a request waited in its model's queue before its batch ran.",
            labels=["model"],
        )  # fmt: skip
        depth = GaugeMetricFamily("attnserve_queue_depth", "Requests waiting in the model's queue.", labels=["model"])
        inflight = GaugeMetricFamily(
            "attnserve_inflight_requests", "Requests being handled: received and not yet answered.", labels=["model"]
        )
        dropped = CounterMetricFamily(
            "attnserve_dropped_requests", "Requests accepted or refused without being computed, by reason.",
            labels=["model", "reason"],
        )  # fmt: skip
        unsent = GaugeMetricFamily(
            "attnserve_unsent_answer_bytes",
            "Bytes of answers owed to clients: admitted requests' answers being computed, or sent and not yet"
            " read (max_unsent_bytes), over every gRPC process.",
        )
        open_streams = GaugeMetricFamily(
            "attnserve_open_streams",
            "Streams open (AttendStream, ModelStreamInfer, health Watch, reflection), over every gRPC process.",
        )
        refused_streams = CounterMetricFamily(
            "attnserve_refused_streams",
            "Streams refused RESOURCE_EXHAUSTED as they opened: their gRPC process had max_open_streams open.",
        )
        processes = [self._local()]
        for source in self._remote:
            processes.extend(source())
        front = sum((p.front for p in processes), FrontLoad())
        unsent.add_metric([], front.unsent_bytes)
        open_streams.add_metric([], front.open_streams)
        refused_streams.add_metric([], front.refused_streams)
        for m in merge_snapshots(s for p in processes for s in p.models).values():
            for (method, code), n in m.requests.items():
                requests.add_metric([m.model, method, code], n)
            for method, (counts, total) in m.durations.items():
                duration.add_metric([m.model, method], _cumulative(LATENCY_BUCKETS_S, counts), total)
            if m.model:  # "" collects requests for unknown models: it has no queue
                counts, total = m.queue_wait
                queue_wait.add_metric([m.model], _cumulative(LATENCY_BUCKETS_S, counts), total)
                depth.add_metric([m.model], m.depth)
                for reason, n in m.drops.items():
                    dropped.add_metric([m.model, reason], n)
            inflight.add_metric([m.model], m.inflight)
        yield from (requests, duration, queue_wait, depth, inflight, dropped, unsent, open_streams, refused_streams)


def _histogram(h: FastHistogram) -> tuple[list[tuple[str, int]], float]:
    """A FastHistogram as HistogramMetricFamily.add_metric takes it: cumulative buckets, and the sum."""
    return _cumulative(h.bounds, list(h.counts)), h.sum


class _BatchCollector(Collector):
    """Exports every served model's batch series (ModelMetrics' plain numbers) at scrape time. They are
    counted where batches run, the engine, so no edge process has any to send."""

    def __init__(self, models: list[ModelMetrics]) -> None:
        self._models = models

    def collect(self) -> Iterator[Any]:
        compute = HistogramMetricFamily(
            "attnserve_compute_duration_seconds", "Time a device worker spent on one batch, copies included.",
            labels=["model", "device"],
        )  # fmt: skip
        requests = HistogramMetricFamily("attnserve_batch_requests", "Requests per batch.", labels=["model"])
        sequences = HistogramMetricFamily("attnserve_batch_sequences", "Sequences per batch.", labels=["model"])
        tokens_per_batch = HistogramMetricFamily(
            "attnserve_batch_tokens", "Query tokens per batch, before padding.", labels=["model"]
        )
        padding = HistogramMetricFamily(
            "attnserve_batch_padding_ratio", "Share of a batch's query and key positions that are padding.",
            labels=["model"],
        )  # fmt: skip
        tokens = CounterMetricFamily("attnserve_tokens", "Query tokens computed.", labels=["model"])
        failures = CounterMetricFamily(
            "attnserve_batch_failures", "Batches that raised on their device worker.", labels=["model", "device"]
        )
        cpu = CounterMetricFamily(
            "attnserve_cpu_batches",
            "CPU batches computed, by the intra-op threads each ran on (compute/threads.py chooses).",
            labels=["model", "device", "threads"],
        )
        paired = CounterMetricFamily(
            "attnserve_cpu_paired_batches",
            "CPU batches computed beside another on a share of the threads (pairing: cpu_pair_macs).",
            labels=["model", "device"],
        )
        solo = CounterMetricFamily(
            "attnserve_solo_batches",
            "Lone requests computed on the event loop while the server was quiet (solo runs), batches of one.",
            labels=["model"],
        )
        for m in list(self._models):
            if not m.model:  # the unknown-model sink: no batches
                continue
            name = [m.model]
            requests.add_metric(name, *_histogram(m.batch_requests))
            sequences.add_metric(name, *_histogram(m.batch_sequences))
            tokens_per_batch.add_metric(name, *_histogram(m.batch_tokens))
            padding.add_metric(name, *_histogram(m.batch_padding))
            tokens.add_metric(name, m.tokens)
            solo.add_metric(name, m.solo_batches)
            # list(): a first batch on another device may add a key on the loop meanwhile
            for device, h in list(m.compute_duration.items()):
                compute.add_metric([m.model, device], *_histogram(h))
            for (device, threads), n in list(m.cpu_batches.items()):
                cpu.add_metric([m.model, device, str(threads)], n)
            for device, n in list(m.paired_batches.items()):
                paired.add_metric([m.model, device], n)
            for device, n in list(m.batch_failures.items()):
                failures.add_metric([m.model, device], n)
        yield from (compute, requests, sequences, tokens_per_batch, padding, tokens, failures, cpu, paired, solo)


class _CudaMemoryCollector(Collector):
    """Reads device memory at scrape time, so the request path pays nothing for it."""

    def __init__(self, devices: list[str], pinned: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._devices = devices
        self._pinned = pinned

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
        pinned = GaugeMetricFamily(
            "attnserve_pinned_host_bytes",
            "Page-locked host memory a model's CUDA worker holds for staging inputs and reading outputs back.",
            labels=["model", "device"],
        )
        for device in self._devices:
            allocated.add_metric([device], torch.cuda.memory_allocated(device))
            reserved.add_metric([device], torch.cuda.memory_reserved(device))
        for model, per_device in self._pinned().items():
            for device, nbytes in per_device.items():
                if device != "cpu":
                    pinned.add_metric([model, device], nbytes)
        yield allocated
        yield reserved
        yield pinned


class _SharedMemoryCollector(Collector):
    def __init__(self, regions: Callable[[], dict[str, tuple[str, int, int]]]) -> None:
        self._regions = regions

    def collect(self) -> Iterator[Any]:
        table = self._regions()
        yield GaugeMetricFamily(
            "attnserve_shared_memory_regions",
            "System shared memory regions clients have registered (--allow-client-shm).",
            value=len(table),
        )
        yield GaugeMetricFamily(
            "attnserve_shared_memory_region_bytes",
            "The bytes of every registered system shared memory region, summed.",
            value=sum(size for _, _, size in table.values()),
        )
