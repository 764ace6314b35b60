"""A served model: its spec, its device workers and the batcher in front of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnserve_server.batching import Batcher, BatchLimits
from attnserve_server.compute.devices import resolve_devices
from attnserve_server.compute.weights import Projections, load_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.domain import AttentionRequest, AttentionResult, ModelKind, ModelSpec
from attnserve_server.errors import ModelNotReady
from attnserve_server.metrics import ModelMetrics
from attnserve_server.settings import ModelSettings

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (spec, weights on the CPU, device, torch_threads) -> a worker with run(), warmup(), close(), executor, name.
WorkerFactory = Callable[[ModelSpec, Projections | None, torch.device, int | None], DeviceWorker]


def spec_from_settings(settings: ModelSettings) -> ModelSpec:
    e = settings.embed_dim
    return ModelSpec(
        name=settings.name,
        kind=ModelKind(settings.kind),
        embed_dim=e,
        num_heads=settings.num_heads,
        kdim=settings.kdim or e,
        vdim=settings.vdim or e,
        bias=settings.bias,
        dtype=_DTYPES[settings.dtype],
        max_query_len=settings.max_query_len,
        max_key_len=settings.max_key_len,
        max_batch_size=settings.batching.max_batch_size,
        max_batch_tokens=settings.batching.max_batch_tokens,
    )


@dataclass(frozen=True)
class Answer:
    result: AttentionResult
    queue_s: float
    compute_s: float
    batch_size: int
    batch_sequences: int


class ServedModel:
    def __init__(
        self,
        settings: ModelSettings,
        metrics: ModelMetrics,
        worker_factory: WorkerFactory,
        torch_threads: int | None = None,
    ) -> None:
        self.settings = settings
        self.spec = spec_from_settings(settings)
        self.metrics = metrics
        self.devices: list[str] = []
        self.ready = False
        self._worker_factory = worker_factory
        self._torch_threads = torch_threads
        self._workers: list[DeviceWorker] = []
        self._batcher: Batcher[AttentionRequest, tuple[AttentionResult, float]] | None = None

    async def load(self) -> None:
        """Loads weights, builds one worker per device and warms each up, off the event loop."""
        loop = asyncio.get_running_loop()
        devices = resolve_devices(self.settings.device)
        params = await asyncio.to_thread(load_projections, self.spec, self.settings.weights)
        for device in devices:
            worker = await asyncio.to_thread(self._worker_factory, self.spec, params, device, self._torch_threads)
            await loop.run_in_executor(worker.executor, worker.warmup)
            self._workers.append(worker)
        self.devices = [w.name for w in self._workers]
        b = self.settings.batching
        limits = BatchLimits(b.max_batch_size, b.max_batch_tokens, b.max_queue_delay_ms / 1e3, b.max_queue_size)
        self._batcher = Batcher([self._runner(w) for w in self._workers], limits, self.metrics)
        self._batcher.start()
        self.metrics.describe(
            queue_capacity=b.max_queue_size,
            kind=self.spec.kind.value,
            dtype=self.settings.dtype,
            devices=",".join(self.devices),
            embed_dim=str(self.spec.embed_dim),
            num_heads=str(self.spec.num_heads),
        )
        self.ready = True
        log.info("model %r ready on %s", self.spec.name, ", ".join(self.devices))

    def _runner(self, worker: DeviceWorker):
        loop = asyncio.get_running_loop()

        async def run(batch: list[AttentionRequest]) -> list[tuple[AttentionResult, float]]:
            try:
                report = await loop.run_in_executor(worker.executor, worker.run, batch)
            except Exception:
                self.metrics.batch_failed(worker.name)
                raise
            self.metrics.batch_computed(worker.name, report)
            return [(result, report.compute_s) for result in report.results]

        return run

    async def submit(self, request: AttentionRequest, deadline: float | None) -> Answer:
        if self._batcher is None or not self.ready:
            raise ModelNotReady(f"model {self.spec.name!r} is not ready yet")
        done = await self._batcher.submit(
            request,
            sequences=request.sequences,
            length=request.query_len,
            group=request.batch_key,
            deadline=deadline,
        )
        result, compute_s = done.result
        return Answer(result, done.queue_s, compute_s, done.batch_size, done.batch_sequences)

    async def drain(self, timeout_s: float) -> bool:
        self.ready = False
        return True if self._batcher is None else await self._batcher.drain(timeout_s)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
