"""A served model: its spec, its device workers and the batcher in front of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from attnserve_server import dtypes
from attnserve_server.batching import BatchDone, Batcher, BatchLimits
from attnserve_server.compute.devices import (
    BFLOAT16_FLAG_SETS,
    FLOAT16_FLAGS,
    bfloat16_is_slow,
    cpu_flags,
    float16_is_slow,
    resolve_devices,
)
from attnserve_server.compute.threads import CpuThreads
from attnserve_server.compute.weights import Projections, load_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.domain import Answer, AttentionRequest, ModelKind, ModelSpec, compute_macs
from attnserve_server.errors import ModelNotReady, ServingError, ShuttingDown
from attnserve_server.metrics import InferenceStats, ModelMetrics
from attnserve_server.runtime.idle_spin import QUIET_STREAK
from attnserve_server.settings import ModelSettings, optional_inputs_kept
from attnserve_server.tracing import Tracing

log = logging.getLogger(__name__)

# (spec, weights on the CPU, device, CPU threads) -> a worker with run(), warmup(), close(), executor,
# name, lanes and pinned_bytes().
WorkerFactory = Callable[[ModelSpec, Projections | None, torch.device, CpuThreads | None], DeviceWorker]


def resolve_dtype(setting: str, devices: list[torch.device] | None = None) -> str:
    """`auto` is bfloat16 for a model on GPUs only (tensor cores, half the bytes to move), float32
    where any worker is a CPU (or the devices are not known yet)."""
    if setting != "auto":
        return setting
    return "bfloat16" if devices and all(d.type == "cuda" for d in devices) else "float32"


def spec_from_settings(
    settings: ModelSettings, max_message_bytes: int = 256 << 20, devices: list[torch.device] | None = None
) -> ModelSpec:
    e = settings.embed_dim
    return ModelSpec(
        name=settings.name,
        kind=ModelKind(settings.kind),
        embed_dim=e,
        num_heads=settings.num_heads,
        kdim=settings.kdim or e,
        vdim=settings.vdim or e,
        bias=settings.bias,
        dtype=dtypes.FLOATS[resolve_dtype(settings.dtype, devices)],
        max_query_len=settings.max_query_len,
        max_key_len=settings.max_key_len,
        max_batch_size=settings.batching.max_batch_size,
        max_batch_tokens=settings.batching.max_batch_tokens,
        max_batch_memory_bytes=settings.batching.max_batch_memory_bytes,
        max_answer_bytes=max_message_bytes,
        cuda_graphs=settings.cuda_graphs,
        cpu_matmul=settings.cpu_matmul,
        cpu_fused_bound=settings.cpu_fused_bound,
        cpu_scripted=settings.cpu_scripted,
        cpu_lanes=settings.cpu_lanes,
        cpu_pair_macs=_pair_macs(settings),
        optional_inputs=optional_inputs_kept(settings),
    )


def _pair_macs(settings: ModelSettings) -> int:
    """Pairing's bar (batching.py): a model of one worker only, whose threads the pair shares."""
    return settings.cpu_pair_macs if len(settings.device) == 1 else 0


def limits_from_settings(settings: ModelSettings, cpu: bool = True) -> BatchLimits:
    """The batcher's limits; `cpu`: every worker computes on the CPU (pipeline_macs bounds only CPU
    batches: a GPU computes a large batch in about the time of a small one)."""
    b = settings.batching
    return BatchLimits(
        b.max_batch_size,
        b.max_batch_tokens,
        b.max_queue_delay_ms / 1e3,
        b.max_queue_size,
        max_queue_bytes=b.max_queue_bytes,
        max_batch_memory_bytes=b.max_batch_memory_bytes,
        pipeline=b.pipeline,
        linger_work=b.linger_macs,
        max_linger_s=b.max_linger_ms / 1e3,
        pipeline_work=b.pipeline_macs if cpu else 0,
        pair_work=_pair_macs(settings) if cpu else 0,
    )


class ServedModel:
    def __init__(
        self,
        settings: ModelSettings,
        metrics: ModelMetrics,
        worker_factory: WorkerFactory,
        threads: CpuThreads | None = None,
        max_message_bytes: int = 256 << 20,
        tracing: Tracing | None = None,
        *,
        solo_macs: int = 0,
        on_quiet: Callable[[], None] | None = None,
        on_busy: Callable[[], None] | None = None,
        on_broken: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self._tracing = tracing
        # Told (name, exc) once the batcher stops for good: a worker's device lost, or a runner dead.
        self._on_broken = on_broken
        self._solo_macs = solo_macs
        # Told of each request admitted once QUIET_STREAK in a row have found the model quiet (idle_spin.py):
        # only a quiet server's spinners spin, since under load they cost more than the wake-ups they spare.
        # `on_busy`: told of the first request after such a streak that finds company (cpu_layout.py).
        self._on_quiet = on_quiet
        self._on_busy = on_busy
        self.settings = settings
        # Devices are resolved now: the dtype may depend on them, and a GPU asked for and missing
        # stops the server before anything starts.
        self._devices = resolve_devices(settings.device)
        self.spec = spec_from_settings(settings, max_message_bytes, self._devices)
        self.metrics = metrics
        self.devices: list[str] = []
        self.ready = False
        self._draining = False
        self._worker_factory = worker_factory
        self._threads = threads
        self._workers: list[DeviceWorker] = []
        self._batcher: Batcher[AttentionRequest, Answer] | None = None
        self.limits = limits_from_settings(settings, cpu=all(d.type == "cpu" for d in self._devices))

    async def load(self) -> None:
        """Loads weights, builds one worker per device and warms each up, off the event loop.

        Torch computes on the workers' threads, on a loading thread that ends before the model
        serves, and (`solo_macs`) on the event loop for a lone request while the server is quiet. A
        thread that ran a parallel region keeps an OpenMP pool while it lives; openmp.py sets the
        wait policy under which a second pool costs the first nothing (scripts/omp_pools.py).
        """
        loop = asyncio.get_running_loop()
        devices = self._devices
        loader = ThreadPoolExecutor(1, thread_name_prefix=f"attn-{self.spec.name}-load")
        try:
            params = await loop.run_in_executor(loader, load_projections, self.spec, self.settings.weights)
            for device in devices:
                worker = await loop.run_in_executor(
                    loader, self._worker_factory, self.spec, params, device, self._threads
                )
                self._workers.append(worker)
        finally:
            await asyncio.to_thread(loader.shutdown)  # the thread, and its pool, gone
        for worker in self._workers:
            # Every lane's thread warms up (submitted at once, each warm-up starts a thread of its own).
            await asyncio.gather(*(loop.run_in_executor(worker.executor, worker.warmup) for _ in range(worker.runners)))
        self.devices = [w.name for w in self._workers]
        b = self.settings.batching
        self._batcher = Batcher(self.limits, self.metrics)
        self._batcher.start()
        if self._on_broken is not None:
            self._batcher.on_broken(self._broken)
        self._allow_solo(self._batcher)
        if self._on_quiet is not None:
            self._batcher.watch_quiet(self._on_quiet, QUIET_STREAK, self._on_busy)
        # Each lane's thread serves the batcher for good, taking its next batch itself the moment it
        # is free: a CUDA worker takes its next batch while its last one computes.
        for w in self._workers:
            for _ in range(w.runners):
                w.executor.submit(w.serve, self._batcher.serve, self._reporter(w))
        self.metrics.describe(
            queue_capacity=b.max_queue_size,
            kind=self.spec.kind.value,
            dtype=self.spec.dtype.setting,
            devices=",".join(self.devices),
            embed_dim=str(self.spec.embed_dim),
            num_heads=str(self.spec.num_heads),
        )
        self.ready = True
        log.info("model %r ready on %s", self.spec.name, ", ".join(self.devices))
        if "cpu" in self.devices:
            self._warn_if_slow_on_this_cpu(cpu_flags())

    def _warn_if_slow_on_this_cpu(self, flags: frozenset[str]) -> None:
        """A reduced precision that this CPU has no matrix kernels for is slower than float32, not faster."""
        dtype = self.spec.dtype.setting
        if dtype == "float16" and float16_is_slow(flags):
            log.warning(
                "model %r: float16 on a CPU without float16 matrix instructions (%s) is slow in torch, "
                "~10x bfloat16 (README: Devices); bfloat16 or float32 serve faster here",
                self.spec.name,
                ", ".join(sorted(FLOAT16_FLAGS)),
            )
        elif dtype == "bfloat16" and bfloat16_is_slow(flags):
            log.warning(
                "model %r: bfloat16 on a CPU with none of %s is slow in torch, 3.7-6.3x float32's time "
                "(README: Devices); float32 serves faster here",
                self.spec.name,
                " or ".join("+".join(sorted(needed)) for needed in BFLOAT16_FLAG_SETS),
            )

    def computing_s(self) -> tuple[str, float]:
        """(name, how long its longest-running batch has been computing): the watchdog's probe (any thread)."""
        return self.spec.name, 0.0 if self._batcher is None else self._batcher.oldest_in_flight_s()

    def _broken(self, exc: BaseException) -> None:
        """The batcher stopped for good: later requests are refused UNAVAILABLE by it (BatcherStopped)."""
        if self._on_broken is not None:
            self._on_broken(self.spec.name, exc)

    def _allow_solo(self, batcher: Batcher[AttentionRequest, Answer]) -> None:
        """With one CPU worker of one lane, a lone request of at most `solo_macs` may run on the event
        loop while the server is quiet (solo.py): the worker's lane is idle then, and nothing else
        computes. Only a request that the size rule runs on one intra-op thread (compute/threads.py:
        under ALONE_FLOOR_MACS, or any where the worker has one thread) runs there, so the loop's thread
        never starts an OpenMP pool of its own. A second pool makes libgomp cut both pools' spin to its
        throttled count, and the worker's partner thread then sleeps between a quiet server's requests:
        on the AMD VM of BENCHMARKS.md (twenty-first pass) W1 alone computed in ~1.5 ms on two threads
        whose partner spun through the gap, ~2 ms on one, ~2.9 ms on two that slept. W1 (19 M) at
        concurrency 1 therefore runs on the worker's two threads: p50 -20% in pairs against the earlier
        solo runs on one thread under a short spin. Solo runs beside the long spin gained nothing: their
        pool throttled it (1.50x the inline peer's p50 in pairs, 1.20x on the worker)."""
        worker = self._single_cpu_worker()
        if self._solo_macs <= 0 or worker is None:
            return
        spec, most_macs = self.spec, self._solo_macs

        def eligible(r: AttentionRequest) -> bool:
            macs = compute_macs(spec, r.sequences, r.query_len, r.key_len)
            return macs <= most_macs and worker.one_thread_alone(macs)

        report = self._reporter(worker)

        def done(batch: list[AttentionRequest], answers: list[Answer] | None, error: BaseException | None) -> None:
            self.metrics.solo_ran()
            report(batch, answers, error)

        # The loop's thread computes solo runs, and nothing on it needs autograd: off for good there
        # (thread-local), so that each run need not turn it off and on again (compute/worker.py).
        torch.set_grad_enabled(False)
        batcher.allow_solo(worker.run, done, eligible)

    def _reporter(self, worker: DeviceWorker) -> BatchDone:
        """Metrics and traces for each batch the worker finishes (called on the event loop)."""

        def done(batch: list[AttentionRequest], answers: list[Answer] | None, error: BaseException | None) -> None:
            if error is not None:
                self.metrics.batch_failed(worker.name)
            elif answers:
                report = answers[0].batch
                self.metrics.batch_computed(worker.name, report)
                if self._tracing is not None:
                    spans = [r.trace for r in batch if r.trace is not None]
                    self._tracing.batch_done(self.spec.name, worker.name, report, spans)

        return done

    def check_admission(self) -> None:
        """Raises if a request would be refused now (not ready, queue full, shutting down)."""
        if self._batcher is None or not self.ready:
            raise self._unready()
        self._batcher.check_admission()

    async def submit(self, request: AttentionRequest, deadline: float | None = None, *, expire: bool = True) -> Answer:
        """Queues a request and returns its answer. `deadline` is on the loop's clock; `expire` arms a
        timer for it, needed only where the call does not enforce it (KServe's `timeout` parameter)."""
        if self._batcher is None or not self.ready:
            raise self._unready()
        return await self._batcher.submit(
            request,
            sequences=request.sequences,
            length=request.query_len,
            group=request.batch_key,
            deadline=deadline,
            expire=expire,
            nbytes=request.nbytes,
            memory=request.memory_bytes,
            work=compute_macs(self.spec, request.sequences, request.query_len, request.key_len),
        )

    def cpu_team(self) -> tuple[int, Callable[[], list[int]], int] | None:
        """With one CPU worker of one lane (once loaded): its thread's native id, a function that gives
        its OpenMP threads' (none until a batch has run on several threads), and how many threads a
        batch computes on at most; else None."""
        worker = self._single_cpu_worker()
        if worker is None or not worker.thread_ids:
            return None
        return worker.thread_ids[0], lambda: worker.partner_ids, worker.team_size

    def _single_cpu_worker(self) -> DeviceWorker | None:
        """The model's worker where it has one, on the CPU, of one lane: the case where solo runs and
        the quiet layout apply; else None."""
        workers = self._workers
        if len(workers) != 1 or workers[0].device.type != "cpu" or workers[0].lanes != 1:
            return None
        return workers[0]

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked host memory per device worker (CUDA staging and output buffers)."""
        return {w.name: w.pinned_bytes() for w in self._workers}

    def watch_queue(self, listener: Callable[[int, int, bool], None]) -> None:
        """`listener(depth, queued bytes, closing)` now and at every change (see Batcher.watch)."""
        assert self._batcher is not None, "load() first"
        self._batcher.watch(listener)

    async def statistics(self) -> InferenceStats:
        """Totals since start, for KServe's ModelStatistics."""
        return self.metrics.stats

    def _unready(self) -> ServingError:
        """Why a request is refused before it reaches the batcher (called once a request): while the
        server drains, a drop counted as the batcher counts its own refusals."""
        if self._draining:
            self.metrics.dropped("shutting_down")
            return ShuttingDown.of_model(self.spec.name)
        return ModelNotReady(f"model {self.spec.name!r} is not ready yet")

    async def drain(self, timeout_s: float) -> bool:
        self.ready = False
        self._draining = True
        return True if self._batcher is None else await self._batcher.drain(timeout_s)

    def close(self) -> None:
        """Stops the workers (blocking: call it off the loop, after `drain`)."""
        if self._batcher is not None:
            self._batcher.halt()  # each lane's thread returns after its current batch
        for worker in self._workers:
            worker.close()
