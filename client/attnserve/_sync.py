"""The blocking client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    CallDefaults,
    channel_credentials,
    channel_options,
    resolve_target,
)
from attnserve._codec import decode_model, decode_response, encode_request
from attnserve._errors import AttnServeError, translate_errors
from attnserve._outgoing import StreamRequests
from attnserve._types import AttendResult, ModelInfo, Request
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class Client:
    """Blocking client: numpy in, numpy out. Use as a context manager or call close().

    `target` is "host:port", a gRPC target URI ("dns:///attnserve-headless:50051"), or several
    addresses (a list, or commas): calls go round-robin over every address, and a call refused
    UNAVAILABLE is retried on another. `timeout_s` is the default deadline per call, in seconds
    (None or infinity: no deadline; zero, negative or NaN: ValueError), each method's overrides it;
    `wait_for_ready` makes calls wait for the server instead of failing fast while it is unreachable;
    `retries` lets gRPC retry UNAVAILABLE with backoff (a service config, not a loop here).
    TLS: `tls=True` (the system's roots), `ca` (a PEM file to trust instead), `cert` and `key` (a
    client certificate, for mTLS), or any `grpc.ChannelCredentials` as `credentials`. `token` is
    sent as `authorization: Bearer <token>` with every call. `trace=True` sends the current
    OpenTelemetry context (`traceparent`), so the server's spans continue the caller's trace.
    `keepalive_s` (None: off) pings the server after that many seconds without data while a call is
    open, and fails the connection's calls UNAVAILABLE if a ping goes unanswered as long: a stream
    or a call without a deadline to a server whose host vanished ends instead of waiting forever.
    attnserve accepts pings every 10 s or more (the server's `--client-ping-min-s`).
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float | None = None,
        wait_for_ready: bool = False,
        retries: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token: str | None = None,
        trace: bool = False,
        keepalive_s: float | None = None,
    ) -> None:
        options = channel_options(max_message_bytes, retries, keepalive_s)
        credentials = channel_credentials(tls, ca, cert, key, credentials)
        target = resolve_target(target)
        self._channel = (
            grpc.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(target, options)
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._call_args = CallDefaults(timeout_s, wait_for_ready, token, trace)

    def attend(
        self, query: Any, key_value: Any = None, *, timeout_s: float | None = None, **fields: Any
    ) -> AttendResult:
        """Runs one attention request; keyword fields are those of `attnserve.Request`."""
        msg = encode_request(Request(query=query, key_value=key_value, **fields))
        with translate_errors():
            return decode_response(self._stub.Attend(msg, **self._call_args(timeout_s)))

    def attend_stream(
        self, requests: Iterable[Request | Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> Iterator[AttendResult]:
        """Sends requests over one bidirectional stream; yields results as they complete.

        A request that fails yields a result with `error` set; the stream goes on.
        Requests without a request_id get their index in `requests` as id. If `requests` raises, or
        one of its requests cannot be encoded, no more are sent: the answers to those already sent
        still come, then that exception is raised here.
        """
        outgoing = StreamRequests(requests)
        call = self._stub.AttendStream(outgoing, **self._call_args(timeout_s))
        try:
            try:
                for msg in call:
                    yield decode_response(msg)
            except grpc.RpcError as error:
                outgoing.raise_error()
                raise AttnServeError.from_rpc_error(error) from None
            outgoing.raise_error()
        finally:
            call.cancel()

    def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        with translate_errors():
            reply = self._stub.ListModels(pb.ListModelsRequest(), **self._call_args(timeout_s))
        return [decode_model(m) for m in reply.models]

    def model(self, name: str = "", *, timeout_s: float | None = None) -> ModelInfo:
        with translate_errors():
            reply = self._stub.GetModel(pb.GetModelRequest(model=name), **self._call_args(timeout_s))
        return decode_model(reply)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 status of the server ("") or of one model (its name): e.g. "SERVING"."""
        with translate_errors():
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), **self._call_args(timeout_s))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
