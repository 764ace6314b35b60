"""attnserve.v1.AttentionService: decode, submit to the model's batcher, encode; map errors to statuses."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve_server.domain import Answer, AttentionRequest
from attnserve_server.edge.convert import TENSOR_FIELDS, framed_response, model_metadata, request_from_proto
from attnserve_server.edge.dispatch import (
    Dispatcher,
    Encode,
    Servable,
    Timing,
    caller_status,
    unary_errors,
)
from attnserve_server.edge.framing import Frame
from attnserve_server.edge.payload import Received
from attnserve_server.edge.registration import Undecodable


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """The native API. An empty model name means the first configured model."""

    # The inference methods get their requests as payload.Received (registration.add_service).
    TENSOR_FIELDS = {"Attend": TENSOR_FIELDS, "AttendStream": TENSOR_FIELDS}
    REQUEST_ID = "request_id"  # each request may carry its own: payload.Parser lets it differ

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatch = dispatcher

    @staticmethod
    def _encode(msg: pb.AttendRequest) -> Encode[Frame]:
        def encode(served: Servable, request: AttentionRequest, answer: Answer, received: float) -> Frame:
            response = pb.AttendResponse(model=served.spec.name, request_id=msg.request_id)
            queue_ns, compute_ns, server_ns = Timing.of(answer, received)
            t = response.timing
            t.queue_ns, t.compute_ns, t.server_ns = queue_ns, compute_ns, server_ns
            t.batch_size, t.batch_sequences = answer.batch.requests, answer.batch.sequences
            return framed_response(response, served.spec, request, answer)

        return encode

    async def _answer(
        self,
        received: Received[pb.AttendRequest],
        method: str,
        deadline: float | None,
        context,
        stream_peer: str | None = None,
    ) -> Frame:
        msg = received.message

        def decode(served: Servable):
            return request_from_proto(received, served.spec), None

        encode = self._encode(msg)
        model = msg.model
        return await self._dispatch.handle(model, method, deadline, decode, encode, context, stream_peer=stream_peer)

    @unary_errors
    async def Attend(self, request: Received[pb.AttendRequest], context: grpc.aio.ServicerContext) -> Frame:
        return await self._answer(request, "Attend", self._dispatch.deadline(context), context)

    async def _answer_in_band(
        self, received: Received[pb.AttendRequest] | Undecodable, deadline: float | None, context, peer: str
    ):
        if isinstance(received, Undecodable):
            self._dispatch.undecodable(received, "AttendStream", peer)
            status = pb.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=received.status_message)
            return pb.AttendResponse(error=status)  # no request id to echo: the message did not parse
        try:
            return await self._answer(received, "AttendStream", deadline, context, peer)
        except Exception as exc:
            code, message = caller_status(exc, "AttendStream")
            return pb.AttendResponse(
                model=received.message.model,
                request_id=received.message.request_id,
                error=pb.Status(code=code.value[0], message=message),
            )

    async def AttendStream(
        self,
        request_iterator: AsyncIterator[Received[pb.AttendRequest] | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.AttendResponse | Frame]:
        deadline = self._dispatch.deadline(context)  # the stream's, for every message in it
        peer = context.peer()  # read while the call is alive: its messages' tasks may outlive it (dispatch.stream)
        answers = self._dispatch.stream(
            request_iterator, lambda m: self._answer_in_band(m, deadline, context, peer), context, peer
        )
        async for response in answers:
            yield response

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[self._metadata(m) for m in self._dispatch.models.values()])

    @unary_errors
    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext) -> pb.ModelMetadata:
        return self._metadata(self._dispatch.model(request.model))

    @staticmethod
    def _metadata(served: Servable) -> pb.ModelMetadata:
        return model_metadata(served.spec, served.settings.batching, served.devices, served.ready)
