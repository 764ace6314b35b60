"""The composition root: settings -> metrics, models, gRPC server, health, reflection."""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc
import grpc.aio
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from prometheus_client import CollectorRegistry

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.edge import kserve_servicer
from attnserve_server.edge.dispatch import Dispatcher
from attnserve_server.edge.registration import add_service
from attnserve_server.edge.servicer import AttentionServicer
from attnserve_server.errors import ConfigError, PortUnavailable
from attnserve_server.metrics import Metrics
from attnserve_server.model import ServedModel, WorkerFactory
from attnserve_server.protocol import open_inference_pb2
from attnserve_server.security import ReloadingTLS, token_auth
from attnserve_server.settings import ServerSettings
from attnserve_server.tracing import Tracing
from attnserve_server.tracing import from_environment as tracing_from_environment

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
_HEALTH_SERVICES = (SERVICE_NAME, kserve_servicer.SERVICE_NAME)
_SERVING = health_pb2.HealthCheckResponse.SERVING
# HTTP/2 lets a peer send this much on a stream before the receiver acknowledges it: with gRPC's
# default (64 KiB) a megabyte request takes several round trips (measured: 1 MiB each way, 12.7 ms at
# the default, 8.6 ms at 16 MiB). The client sets the same for its answers.
STREAM_LOOKAHEAD_BYTES = 16 * 1024 * 1024
# After the models have drained, how long late calls are still answered UNAVAILABLE before gRPC stops.
SHUTDOWN_LINGER_S = 0.25
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """One pool holding every service served: the KServe v2 messages live in a private pool of
    their own (see scripts/gen_proto.sh), so reflection gets a pool built from each file."""
    pool = descriptor_pool.DescriptorPool()
    for module in (pb, open_inference_pb2, health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


class AttnServer:
    """One attnserve process. `await start()` returns once every model is warm and serving.

    Health: "" (the server), each service's name, and each model's name. They report
    NOT_SERVING while models load and from the moment shutdown begins.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        registry: CollectorRegistry | None = None,
        worker_factory: WorkerFactory = DeviceWorker,
        tracer_provider: object | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        # Tracing from a provider given (tests), else from OTEL_* (the `otel` extra), else off.
        self._owns_tracing = tracer_provider is None
        self.tracing = Tracing(tracer_provider) if tracer_provider is not None else tracing_from_environment()
        self.models = {
            m.name: ServedModel(
                m,
                self.metrics.for_model(m.name),
                worker_factory,
                settings.torch_threads,
                settings.max_message_bytes,
                self.tracing,
            )
            for m in settings.models
        }
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self._stopped = False
        self._tls: ReloadingTLS | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None

    def reload_tls(self) -> None:
        """Reads the TLS files again for the next handshake (SIGHUP); open connections stay."""
        if self._tls is not None:
            self._tls.reload()
            log.info("TLS certificate files will be read again at the next handshake")

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            # A model that fails to load must not leave the port bound or threads running.
            await self.stop(0)
            raise

    async def _start(self) -> None:
        s = self.settings
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.max_receive_message_length", s.max_message_bytes),
                # Large requests arrive without waiting on 64 KiB flow-control windows.
                ("grpc.http2.lookahead_bytes", min(s.max_message_bytes, STREAM_LOOKAHEAD_BYTES)),
                # gRPC shares a port with any process by default: a second server on a taken port
                # would start and silently take part of the traffic. Off, it fails to bind.
                ("grpc.so_reuseport", 0),
            ]
        )
        dispatcher = Dispatcher(self.models, self.metrics.for_model(""), self.tracing)
        # Tokens guard both APIs; health and reflection are registered apart and stay open, so
        # orchestrators' probes and grpcurl's listing work without one (README: Security).
        auth = token_auth(s.auth_tokens_file, s.auth_tokens)
        native = pb.DESCRIPTOR.services_by_name["AttentionService"]
        add_service(self._server, AttentionServicer(dispatcher), native, auth)
        add_service(self._server, kserve_servicer.InferenceServicer(dispatcher), kserve_servicer.SERVICE, auth)
        open_services = {name.strip() for name in s.auth_open.split(",")}
        health_auth = None if "health" in open_services else auth
        add_service(self._server, self._health, health_pb2.DESCRIPTOR.services_by_name["Health"], health_auth)
        services = (SERVICE_NAME, kserve_servicer.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        # The asyncio servicer that enable_server_reflection() installs on an aio server, registered
        # through add_service instead, so that tokens can guard it too (auth_open).
        reflector = ReflectionServicer(services, pool=_reflection_pool())
        reflection_service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
        add_service(self._server, reflector, reflection_service, None if "reflection" in open_services else auth)
        for name in ("", *_HEALTH_SERVICES, *self.models):
            await self._health.set(name, _NOT_SERVING)
        address = f"{s.host}:{s.port}"
        try:
            if s.tls_cert is not None and s.tls_key is not None:
                self._tls = ReloadingTLS(s.tls_cert, s.tls_key, s.tls_client_ca)
                self.port = self._server.add_secure_port(address, self._tls.credentials)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise PortUnavailable(f"gRPC port {s.host}:{s.port}: cannot bind (in use, or not an address of this host)")
        await self._server.start()
        if s.health_port >= 0:
            # Kubernetes' gRPC probe speaks no TLS: with TLS on, probes ask this plaintext port, which
            # serves the same health statuses and nothing else.
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            try:
                self.health_port = self._health_server.add_insecure_port(f"{s.host}:{s.health_port}")
            except RuntimeError:
                self.health_port = 0
            if self.health_port == 0:
                raise PortUnavailable(f"health port {s.host}:{s.health_port}: cannot bind (in use, or not this host's)")
            await self._health_server.start()
        if s.metrics_port >= 0:
            host = s.metrics_host or s.host
            try:
                self._metrics_http = self.metrics.serve_http(
                    host, s.metrics_port, s.metrics_tls_cert, s.metrics_tls_key, s.metrics_tls_client_ca
                )
            except ssl.SSLError as exc:
                raise ConfigError(f"metrics_tls_cert, metrics_tls_key: cannot load them ({exc.reason})") from None
            except OSError as exc:
                raise PortUnavailable(f"metrics port {host}:{s.metrics_port}: cannot bind ({exc.strerror})") from None
            self.metrics_port = self._metrics_http.server_port
        # Health answers (NOT_SERVING) while the models load and warm up.
        for served in self.models.values():
            await served.load()
            await self._health.set(served.spec.name, _SERVING)
        self.metrics.watch_cuda_memory(sorted({d for m in self.models.values() for d in m.devices if d != "cpu"}))
        for name in ("", *_HEALTH_SERVICES):
            await self._health.set(name, _SERVING)
        log.info("attnserve serving %s on port %d", ", ".join(self.models), self.port)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, refuse new calls, finish accepted requests within grace_s."""
        if self._stopped:
            return
        grace = self.settings.grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self._health.enter_graceful_shutdown()
        # 1. The models stop admitting and run what they accepted, while gRPC keeps accepting calls:
        #    a late call is answered UNAVAILABLE by the edge, which clients retry. gRPC's own stop
        #    would cancel the calls it has accepted but not yet handed to a handler: CANCELLED, which
        #    no client retries (grpc/grpc#41785).
        results = await asyncio.gather(*(m.drain(grace) for m in self.models.values()), return_exceptions=True)
        if self._server is not None:
            # 2. A moment more of UNAVAILABLE answers for calls already on their way, then gRPC stops:
            #    the answers in flight go out within what is left of the grace period.
            await asyncio.sleep(min(SHUTDOWN_LINGER_S, max(0.0, deadline - loop.time())))
            results.append(await self._server.stop(max(0.0, deadline - loop.time())))
        for result in results:
            if result is False:
                log.warning("shutdown grace of %.1fs ran out before every accepted request was answered", grace)
            elif isinstance(result, BaseException):
                log.error("error during shutdown: %r", result)
        if self._health_server is not None:  # last: probes see NOT_SERVING for the whole drain
            await self._health_server.stop(0)
        for served in self.models.values():
            await asyncio.to_thread(served.close)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.tracing is not None and self._owns_tracing:
            self.tracing.shutdown()  # sends the spans still buffered
        self._stopped = True
