"""attnserve.v1.AttentionService: decode, submit to the model's batcher, encode; map errors to statuses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc

from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve_server.edge.convert import fill_response, model_metadata, request_from_proto
from attnserve_server.errors import ModelNotFound, ServingError, status_of
from attnserve_server.metrics import ModelMetrics
from attnserve_server.model import ServedModel

log = logging.getLogger(__name__)
_END = object()


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """An empty model name means the first configured model."""

    def __init__(self, models: Mapping[str, ServedModel], unknown_model_metrics: ModelMetrics) -> None:
        self._models = models
        self._default = next(iter(models))
        self._unknown = unknown_model_metrics

    def _not_found(self, name: str) -> ModelNotFound:
        return ModelNotFound(f"model: no model named {name!r}; served: {', '.join(sorted(self._models))}")

    @staticmethod
    def _deadline(context: grpc.aio.ServicerContext) -> float | None:
        """The call's deadline on the event loop's clock (None: the caller set none)."""
        remaining = context.time_remaining()
        return None if remaining is None else asyncio.get_running_loop().time() + remaining

    async def _answer(self, msg: pb.AttendRequest, method: str, deadline: float | None) -> pb.AttendResponse:
        """One request, start to end, with its metrics; raises ServingError (or anything unexpected)."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        served = self._models.get(msg.model or self._default)
        metrics = served.metrics if served is not None else self._unknown
        metrics.inflight.inc()
        code = grpc.StatusCode.OK
        try:
            if served is None:
                raise self._not_found(msg.model)
            request = request_from_proto(msg, served.spec)
            answer = await served.submit(request, deadline)
            response = pb.AttendResponse(model=served.spec.name, request_id=msg.request_id)
            fill_response(response, answer.result.output, answer.result.weights, request.unbatched)
            t = response.timing
            t.queue_ns = int(answer.queue_s * 1e9)
            t.compute_ns = int(answer.compute_s * 1e9)
            t.batch_size = answer.batch_size
            t.batch_sequences = answer.batch_sequences
            t.server_ns = int((time.perf_counter() - start) * 1e9)
            return response
        except asyncio.CancelledError:
            expired = deadline is not None and loop.time() >= deadline
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except BaseException as exc:
            code, _ = status_of(exc)
            if not isinstance(exc, ServingError):
                log.exception("unexpected error in %s", method)
            raise
        finally:
            metrics.inflight.dec()
            metrics.request_done(method, code.name, time.perf_counter() - start)

    async def Attend(self, request: pb.AttendRequest, context: grpc.aio.ServicerContext) -> pb.AttendResponse:
        try:
            return await self._answer(request, "Attend", self._deadline(context))
        except Exception as exc:
            code, message = status_of(exc)
            await context.abort(code, message)
            raise  # unreachable: abort raises

    async def _answer_in_band(self, msg: pb.AttendRequest, deadline: float | None) -> pb.AttendResponse:
        try:
            return await self._answer(msg, "AttendStream", deadline)
        except Exception as exc:
            code, message = status_of(exc)
            return pb.AttendResponse(
                model=msg.model,
                request_id=msg.request_id,
                error=pb.Status(code=code.value[0], message=message),
            )

    async def AttendStream(
        self, request_iterator: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttendResponse]:
        # Requests of one stream run concurrently (and batch together); answers go out as they finish.
        answers: asyncio.Queue = asyncio.Queue()
        deadline = self._deadline(context)  # the stream's, for every message in it

        async def answer(msg: pb.AttendRequest) -> None:
            answers.put_nowait(await self._answer_in_band(msg, deadline))

        async def read() -> None:
            try:
                async with asyncio.TaskGroup() as group:
                    async for msg in request_iterator:
                        group.create_task(answer(msg))
            finally:
                answers.put_nowait(_END)

        reader = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not _END:
                yield item
            await reader
        finally:
            reader.cancel()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[self._metadata(m) for m in self._models.values()])

    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext) -> pb.ModelMetadata:
        served = self._models.get(request.model or self._default)
        if served is None:
            error = self._not_found(request.model)
            await context.abort(error.code, error.message)
        return self._metadata(served)

    @staticmethod
    def _metadata(served: ServedModel) -> pb.ModelMetadata:
        return model_metadata(served.spec, served.settings.batching, served.devices, served.ready)
