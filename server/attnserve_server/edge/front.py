"""The gRPC front: one grpc.aio server with every service attnserve answers on its port.

Built the same way in a single-process server (over the models themselves) and in each edge
process (over `multiprocess.edge_process.RemoteModel`s): the native API, KServe v2, health and
reflection, each behind the bearer-token check where configured. Imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc
import grpc.aio
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.edge import kserve_servicer
from attnserve_server.edge.dispatch import Dispatcher, Servable
from attnserve_server.edge.health import HealthServicer
from attnserve_server.edge.outbox import Outbox
from attnserve_server.edge.registration import CallsInFlight, OpenStreams, add_service
from attnserve_server.edge.servicer import AttentionServicer
from attnserve_server.edge.shared_memory import SharedMemoryRegistry
from attnserve_server.errors import PortUnavailable
from attnserve_server.metrics import FrontLoad, ModelMetrics
from attnserve_server.protocol import open_inference_pb2
from attnserve_server.security import ReloadingTLS, token_auth
from attnserve_server.settings import ServerSettings, compression_bitset, host_port
from attnserve_server.tracing import Tracing

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
# Health names besides "" and the models': each API's service name.
HEALTH_SERVICES = (SERVICE_NAME, kserve_servicer.SERVICE_NAME)
# HTTP/2 lets a peer send this much on a stream before the receiver acknowledges it: with gRPC's
# default (64 KiB) a megabyte request takes several round trips (measured: 1 MiB each way, 12.7 ms at
# the default, 8.6 ms at 16 MiB). The client sets the same for its answers.
STREAM_LOOKAHEAD_BYTES = 16 * 1024 * 1024
# How long a new connection may take to finish its handshake (TLS, and the HTTP/2 preface) before it is
# closed: gRPC's default is 120 s, for which a client that connected and sent nothing held a descriptor
# and, under max_connections, a connection's place.
HANDSHAKE_TIMEOUT_S = 10.0
# After the models have drained, how long late calls are still answered UNAVAILABLE before gRPC stops.
SHUTDOWN_LINGER_S = 0.25
# Once every inference call the front took is answered, how long gRPC may still take to send the last
# answers before it closes the connections that remain (clients that ignore GOAWAY keep theirs).
CLOSE_GRACE_S = 1.0


class EndedCallLog(logging.Filter):
    """grpc.aio logs an operation it could not run on a call that had already ended, its answer or status
    (the client's deadline passed just then, or it cancelled, or its connection went), as an ERROR with a
    traceback: "ExecuteBatchError raised in core by servicer method [...]". Under load with short deadlines
    that is ordinary (ten in twelve seconds of 64 callers with deadlines of 0.5 ms to 1 s, against thousands
    answered in time); the call is counted under the status the server gave it. Such a record becomes one
    line at DEBUG, shown only where DEBUG is on. Installed once on grpc's logger (`install`)."""

    LOGGER = "grpc._cython.cygrpc"
    _PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(self._PREFIX)):
            return True
        method = record.getMessage()[len(self._PREFIX) :].strip()  # "[/package.Service/Method]"
        record.msg = "an answer for %s was not sent: its call had already ended (deadline, cancel or disconnect)"
        record.args = (method,)
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def connection_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """The gRPC options that bound a server's connections: how many it holds (max_connections; past it a
    new one is closed as it connects) and how long each may take to shake hands (HANDSHAKE_TIMEOUT_S)."""
    options = [("grpc.server_handshake_timeout_ms", round(HANDSHAKE_TIMEOUT_S * 1000))]
    if settings.max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", settings.max_connections))
    return options


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """One pool holding every service served: the KServe v2 messages live in a private pool of
    their own (see scripts/gen_proto.sh), so reflection gets a pool built from each file."""
    pool = descriptor_pool.DescriptorPool()
    for module in (pb, open_inference_pb2, health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


async def set_health(servicer: HealthServicer, names: tuple[str, ...], status: int) -> None:
    for name in ("", *HEALTH_SERVICES, *names):
        await servicer.set(name, status)


class GrpcFront:
    """The port's gRPC server over `models`. `share_port`: several edge processes bind one port
    (SO_REUSEPORT, which the engine reserved for them); otherwise a taken port fails to bind."""

    def __init__(
        self,
        settings: ServerSettings,
        models: Mapping[str, Servable],
        unknown_model_metrics: ModelMetrics,
        health_servicer: HealthServicer,
        tracing: Tracing | None = None,
        *,
        port: int | None = None,
        share_port: bool = False,
    ) -> None:
        s = settings
        self._settings = settings
        self._port = s.port if port is None else port
        self._tls: ReloadingTLS | None = None
        self.port: int | None = None
        options: list[tuple[str, int]] = [
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_receive_message_length", s.max_message_bytes),
            # Large requests arrive without waiting on 64 KiB flow-control windows.
            ("grpc.http2.lookahead_bytes", min(s.max_message_bytes, STREAM_LOOKAHEAD_BYTES)),
            # gRPC shares a port with any process by default: a second server on a taken port
            # would start and silently take part of the traffic. Off, it fails to bind; on only
            # for the edge processes of one server, on the port their engine reserved.
            ("grpc.so_reuseport", 1 if share_port else 0),
            *connection_options(s),
            # Clients' keepalive pings are welcome every client_ping_min_s, with or without calls.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", round(s.client_ping_min_s * 1000)),
            # Uncompressed messages always; compressed ones only as accept_compression names.
            ("grpc.compression_enabled_algorithms_bitset", compression_bitset(s.accept_compression)),
        ]
        if s.keepalive_s > 0:
            # The server's own pings, as long as a connection lives (gRPC stops after two without data).
            options.append(("grpc.keepalive_time_ms", round(s.keepalive_s * 1000)))
            options.append(("grpc.http2.max_pings_without_data", 0))
        if s.max_connection_age_s > 0:
            # A GOAWAY after the age (gRPC adds +-10% jitter); the grace stays gRPC's default, unlimited,
            # so calls in progress and open streams finish on the old connection.
            options.append(("grpc.max_connection_age_ms", round(s.max_connection_age_s * 1000)))
        self.server = grpc.aio.server(options=options)
        EndedCallLog.install()
        outbox = Outbox(s.max_unsent_bytes)
        self._dispatcher = dispatcher = Dispatcher(models, unknown_model_metrics, tracing, s.stream_window, outbox)
        self.calls = CallsInFlight()  # the two inference APIs' calls (health watches never end)
        self.streams = streams = OpenStreams(s.max_open_streams)  # every service's, health watches included
        # Tokens guard both APIs; health and reflection are registered apart and stay open, so
        # orchestrators' probes and grpcurl's listing work without one (README: Security).
        auth = token_auth(s.auth_tokens_file, s.auth_tokens)
        native = pb.DESCRIPTOR.services_by_name["AttentionService"]
        # Requests that do not parse count in the request series (model "", INVALID_ARGUMENT).
        add_service(
            self.server, AttentionServicer(dispatcher), native, auth, self.calls, dispatcher.undecodable, streams
        )
        # Regions clients register (--allow-client-shm), for the KServe API's tensors.
        self.shared_memory = SharedMemoryRegistry(s.allow_client_shm)
        add_service(
            self.server,
            kserve_servicer.InferenceServicer(dispatcher, self.shared_memory),
            kserve_servicer.SERVICE,
            auth,
            self.calls,
            dispatcher.undecodable,
            streams,
        )
        open_services = {name.strip() for name in s.auth_open.split(",")}
        health_auth = None if "health" in open_services else auth
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
        add_service(self.server, health_servicer, health_service, health_auth, streams=streams)
        services = (SERVICE_NAME, kserve_servicer.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        # The asyncio servicer that enable_server_reflection() installs on an aio server, registered
        # through add_service instead, so that tokens can guard it too (auth_open).
        reflector = ReflectionServicer(services, pool=_reflection_pool())
        reflection_service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
        reflection_auth = None if "reflection" in open_services else auth
        add_service(self.server, reflector, reflection_service, reflection_auth, streams=streams)

    def load(self) -> FrontLoad:
        """What the server holds now: answers owed to clients (edge/outbox.py) and streams (integers, read
        from any thread)."""
        return FrontLoad(self._dispatcher.outbox.total, self.streams.count, self.streams.refused)

    def reload_tls(self) -> None:
        """Reads the TLS files again for the next handshake (SIGHUP); open connections stay."""
        if self._tls is not None:
            self._tls.reload()
            log.info("TLS certificate files will be read again at the next handshake")

    async def start(self) -> int:
        """Binds the port and starts serving; returns the port (PortUnavailable if it cannot bind)."""
        s = self._settings
        address = host_port(s.host, self._port)
        try:
            if s.tls_cert is not None and s.tls_key is not None:
                self._tls = ReloadingTLS(s.tls_cert, s.tls_key, s.tls_client_ca)
                self.port = self.server.add_secure_port(address, self._tls.credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise PortUnavailable(f"gRPC port {address}: cannot bind (in use, or not an address of this host)")
        await self.server.start()
        return self.port

    async def stop(self, deadline: float) -> bool:
        """A moment more of UNAVAILABLE answers for calls already on their way (the models have
        drained), then the calls still running and the answers not yet sent until `deadline` (loop
        clock) at most (open streams end UNAVAILABLE once their requests are answered), then gRPC
        stops, cancelling what is left within CLOSE_GRACE_S. Whether every call ended and every answer
        went out in time (False: a client that does not read its answers, or keeps a stream busy).

        gRPC's own grace would also wait for every client to close its connection, which a client
        that ignores GOAWAY never does: the server would always take its whole grace to exit."""
        loop = asyncio.get_running_loop()
        self._dispatcher.closing.set()  # open streams end once their requests are answered
        await asyncio.sleep(min(SHUTDOWN_LINGER_S, max(0.0, deadline - loop.time())))
        settled = await self.calls.settled(deadline - loop.time())
        outbox = self._dispatcher.outbox
        sent = await outbox.sent(deadline - loop.time())  # answers computed go out to clients that read
        if not (settled and sent):
            log.warning(
                "the grace period ran out with %d calls still in their handlers and %d bytes of answers not yet "
                "read by %d connections: gRPC cancels them",
                self.calls.count, outbox.total, outbox.connections,
            )  # fmt: skip
        await self.server.stop(min(CLOSE_GRACE_S, max(0.0, deadline - loop.time())))
        self.shared_memory.close()
        return settled and sent
