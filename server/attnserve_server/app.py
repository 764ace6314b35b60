"""The composition root: settings -> metrics, models, the gRPC front (in this process, or in edge
processes in front of it), health and the metrics endpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl

import grpc.aio
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from attnserve_server import metrics_http
from attnserve_server.compute.threads import CpuThreads
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.edge.front import GrpcFront, connection_options, set_health
from attnserve_server.edge.health import NOT_SERVING, SERVING, HealthServicer
from attnserve_server.edge.registration import OpenStreams, add_service
from attnserve_server.errors import ConfigError, PortUnavailable
from attnserve_server.metrics import FrontLoad, Metrics
from attnserve_server.model import ServedModel, WorkerFactory
from attnserve_server.multiprocess.supervisor import EdgeSupervisor
from attnserve_server.runtime.cpu_layout import QuietLayout
from attnserve_server.runtime.edges import resolve as resolve_edges
from attnserve_server.runtime.idle_spin import IdleSpin
from attnserve_server.runtime.watchdog import Watchdog
from attnserve_server.settings import ServerSettings, host_port
from attnserve_server.tracing import Tracing
from attnserve_server.tracing import from_environment as tracing_from_environment

log = logging.getLogger(__name__)


class AttnServer:
    """One attnserve server. `await start()` returns once every model is warm and serving.

    With `edge_processes` 1 the gRPC front runs on this process's event loop; with N > 1 this is
    the engine process and N edge processes serve the port (multiprocess/). Health: "" (the
    server), each service's name, and each model's name. They report NOT_SERVING while models load
    and from the moment shutdown begins. `failed` is set if an edge process dies, or a model's
    batcher stops for good (its worker's device lost, or a runner dead): the caller stops the server
    and exits non-zero, for the orchestrator to restart it.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        registry: CollectorRegistry | None = None,
        worker_factory: WorkerFactory = DeviceWorker,
        tracer_provider: object | None = None,
    ) -> None:
        edges, why = resolve_edges(settings.edge_processes, [d for m in settings.models for d in m.device], os.environ)
        log.info("edge processes: %d (%s)", edges, why)
        self.settings = settings = dataclasses.replace(settings, edge_processes=edges)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.metrics.watch_front(self._front_load)
        # Tracing from a provider given (tests), else from OTEL_* (the `otel` extra), else off.
        self._owns_tracing = tracer_provider is None
        self.tracing = Tracing(tracer_provider) if tracer_provider is not None else tracing_from_environment()
        # Spinners that keep the CPUs awake after each request (idle_spin.py); None: off here.
        self.idle_spin = IdleSpin.from_settings(settings.idle_spin_ms)
        # The quiet layout (cpu_layout.py), made once the model's worker has started: only for one model
        # served in this process, since it pins this process's loop and gRPC beside that model's worker.
        self.layout: QuietLayout | None = None
        self._layout_wanted = settings.quiet_layout and settings.edge_processes == 1 and len(settings.models) == 1
        watching = self.idle_spin is not None or self._layout_wanted
        self.models = {
            m.name: ServedModel(
                m,
                self.metrics.for_model(m.name),
                worker_factory,
                CpuThreads(settings.torch_threads, settings.small_batch_macs, settings.min_parallel_speedup),
                settings.max_message_bytes,
                self.tracing,
                solo_macs=settings.solo_macs,
                on_quiet=self._on_quiet if watching else None,
                on_busy=self._on_busy if self._layout_wanted else None,
                on_broken=self._model_broken,
            )
            for m in settings.models
        }
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._health = HealthServicer()
        self._front: GrpcFront | None = None
        self.edges: EdgeSupervisor | None = None  # with edge_processes > 1
        self._metrics_http = None
        self._stopped = False
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.failed = asyncio.Event()
        self._health_streams: OpenStreams | None = None  # the plaintext health port's, with one
        self._watchdog: Watchdog | None = None  # from start, with worker_stall_s > 0
        self._health_updates: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    def _front_load(self) -> FrontLoad:
        """What this process's gRPC servers hold now (the edges' own come in their snapshots)."""
        load = self._front.load() if self._front is not None else FrontLoad()
        if (health := self._health_streams) is not None:
            load += FrontLoad(0, health.count, health.refused)
        return load

    def _on_quiet(self) -> None:
        """A request admitted after QUIET_STREAK in a row found the model quiet (on the loop). While the
        quiet layout is in place the spinners rest: beside it they cost the lone request more than the
        wake-ups they spare (W1 at c=1 in pairs: req/s 1.014 and 1.058, p99 -13%; BENCHMARKS.md, twenty-fifth pass)."""
        layout = self.layout
        if layout is not None:
            layout.quiet()
            if layout.applied:
                return
        if self.idle_spin is not None:
            self.idle_spin.touch()

    def _model_broken(self, model: str, exc: BaseException) -> None:
        """A model can serve no more (on the loop): its health turns NOT_SERVING and the server stops."""
        log.critical("model %r can serve no more (%s): stopping, to exit non-zero", model, exc)
        update = asyncio.get_running_loop().create_task(self._health.set(model, NOT_SERVING))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)
        self.failed.set()

    def _on_busy(self) -> None:
        """The first request after such a streak that found company (on the loop)."""
        if self.layout is not None:
            self.layout.busy()

    def reload_tls(self) -> None:
        """Reads the TLS files again for the next handshake (SIGHUP); open connections stay."""
        if self._front is not None:
            self._front.reload_tls()
        if self.edges is not None:
            self.edges.reload_tls()

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            # A model that fails to load must not leave the port bound or threads running.
            await self.stop(0)
            raise

    async def _start(self) -> None:
        s = self.settings
        if s.allow_tf32:
            import torch

            torch.backends.cuda.matmul.allow_tf32 = True  # process-wide: every float32 model on CUDA
            log.info("TF32 on for float32 matrix products on CUDA (allow_tf32)")
        await set_health(self._health, tuple(self.models), NOT_SERVING)
        if s.edge_processes == 1:
            # The port answers (NOT_SERVING) while the models load.
            self._front = GrpcFront(s, self.models, self.metrics.for_unknown_models(), self._health, self.tracing)
            self.port = await self._front.start()
        else:
            # The port is claimed now; the edges serve it once the models are ready.
            self.edges = EdgeSupervisor(s, self.models, self.tracing, self.failed)
            self.port = self.edges.reserve()
        if s.health_port >= 0:
            # Kubernetes' gRPC probe speaks no TLS: with TLS on, probes ask this plaintext port, which
            # serves the same health statuses and nothing else.
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *connection_options(s)])
            health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
            self._health_streams = OpenStreams(s.max_open_streams)
            add_service(self._health_server, self._health, health_service, streams=self._health_streams)
            try:
                self.health_port = self._health_server.add_insecure_port(host_port(s.host, s.health_port))
            except RuntimeError:
                self.health_port = 0
            if self.health_port == 0:
                address = host_port(s.host, s.health_port)
                raise PortUnavailable(f"health port {address}: cannot bind (in use, or not this host's)")
            await self._health_server.start()
        if s.metrics_port >= 0:
            host = s.metrics_host or s.host
            try:
                self._metrics_http = metrics_http.serve(
                    self.metrics.registry,
                    host,
                    s.metrics_port,
                    s.metrics_tls_cert,
                    s.metrics_tls_key,
                    s.metrics_tls_client_ca,
                )
            except ssl.SSLError as exc:
                why = exc.reason or exc.strerror or exc
                raise ConfigError(f"metrics_tls_cert, metrics_tls_key: cannot load them ({why})") from None
            except OSError as exc:
                address = host_port(host, s.metrics_port)
                raise PortUnavailable(f"metrics port {address}: cannot bind ({exc.strerror})") from None
            self.metrics_port = self._metrics_http.server_port
        # Health answers (NOT_SERVING) while the models load and warm up.
        for served in self.models.values():
            await served.load()
            await self._health.set(served.spec.name, SERVING)
        self.metrics.watch_cuda_memory(
            sorted({d for m in self.models.values() for d in m.devices if d != "cpu"}),
            lambda: {name: m.pinned_bytes() for name, m in self.models.items()},
        )
        if self.idle_spin is not None:
            self.idle_spin.start()
        if s.worker_stall_s > 0:
            self._watchdog = Watchdog(s.worker_stall_s, [m.computing_s for m in self.models.values()])
            self._watchdog.start()
        if self._layout_wanted:
            (served,) = self.models.values()
            team = served.cpu_team()
            if team is None:
                log.info("quiet layout off: the model is not served by one CPU worker")
            else:
                self.layout = QuietLayout.for_worker(*team, on_change=self.metrics.quiet_layout_changed)
        if self.edges is not None:
            # The edges start once the models are ready: each learns of them as they will serve.
            await self.edges.start()
            self.metrics.add_remote(self.edges.snapshots)
            self.edges.set_state(serving=True)
        if s.allow_client_shm:  # the one table: the front's, or the engine's that every edge holds
            memory = self._front.shared_memory if self._front is not None else self.edges.shared_memory  # type: ignore[union-attr]
            self.metrics.watch_shared_memory(memory.table)
        await set_health(self._health, (), SERVING)
        log.info("attnserve serving %s on port %d", ", ".join(self.models), self.port)

    async def stop(self, grace_s: float | None = None) -> bool:
        """Graceful stop: NOT_SERVING, refuse new calls, finish accepted requests within grace_s.
        Whether every accepted request was answered (False: the grace ran out, or the drain failed)."""
        if self._stopped:
            return True
        grace = self.settings.grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self._health.enter_graceful_shutdown()
        # 1. The models stop admitting and run what they accepted, while gRPC keeps accepting calls:
        #    a late call is answered UNAVAILABLE by the edge, which clients retry. gRPC's own stop
        #    would cancel the calls it has accepted but not yet handed to a handler: CANCELLED, which
        #    clients do not retry (grpc/grpc#41785; ours does, for a call that still meets it).
        #    With edge processes, each edge reports NOT_SERVING and forwards late calls, which the
        #    draining models refuse.
        if self.edges is not None:
            self.edges.set_state(serving=False)
        results = await asyncio.gather(*(m.drain(grace) for m in self.models.values()), return_exceptions=True)
        # 2. A moment more of UNAVAILABLE answers for calls already on their way, then gRPC stops:
        #    the answers in flight go out within what is left of the grace period.
        if self._front is not None:
            results.append(await self._front.stop(deadline))
        if self.edges is not None:
            results.append(await self.edges.stop(deadline))
        drained = True
        for result in results:
            if result is False:
                log.warning("shutdown grace of %.1fs ran out before every accepted request was answered", grace)
                drained = False
            elif isinstance(result, BaseException):
                log.error("error during shutdown: %r", result)
                drained = False
        if self._health_server is not None:  # last: probes see NOT_SERVING for the whole drain
            await self._health_server.stop(0)
        if self.layout is not None:
            self.layout.close()  # every thread free again
        for served in self.models.values():
            await asyncio.to_thread(served.close)
        if self._watchdog is not None:  # last: a worker stuck while closing still ends the process
            self._watchdog.close()
        if self.idle_spin is not None:
            await asyncio.to_thread(self.idle_spin.close)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.tracing is not None and self._owns_tracing:
            self.tracing.shutdown()  # sends the spans still buffered
        self._stopped = True
        return drained
