"""inference.GRPCInferenceService (KServe v2 / Open Inference Protocol): the second edge.

Same dispatcher, batcher, workers, metrics and error messages as the native API;
only the message formats differ (edge/kserve.py converts them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib import metadata

import grpc

from attnserve_server.domain import Answer, AttentionRequest
from attnserve_server.edge import kserve
from attnserve_server.edge.dispatch import (
    Dispatcher,
    Servable,
    Timing,
    caller_status,
    unary_errors,
)
from attnserve_server.edge.framing import Frame
from attnserve_server.edge.payload import Received
from attnserve_server.edge.registration import Undecodable
from attnserve_server.edge.shared_memory import OFF, SharedMemoryRegistry
from attnserve_server.errors import NotFound, Unimplemented, clip
from attnserve_server.protocol import open_inference_pb2 as v2
from attnserve_server.protocol import open_inference_pb2_grpc as v2_grpc

SERVICE = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name
EXTENSIONS = ("model_configuration", "statistics", "parameters")
SHARED_MEMORY_EXTENSION = "system_shared_memory"  # with --allow-client-shm


def _server_version() -> str:
    try:
        return metadata.version("attnserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class InferenceServicer(v2_grpc.GRPCInferenceServiceServicer):
    # The inference methods get their requests as payload.Received (registration.add_service).
    TENSOR_FIELDS = {"ModelInfer": kserve.TENSOR_FIELDS, "ModelStreamInfer": kserve.TENSOR_FIELDS}
    REQUEST_ID = "id"  # each request may carry its own: payload.Parser lets it differ

    def __init__(self, dispatcher: Dispatcher, memory: SharedMemoryRegistry = OFF) -> None:
        self._dispatch = dispatcher
        self._version = _server_version()
        self._memory = memory
        self._extensions = EXTENSIONS + ((SHARED_MEMORY_EXTENSION,) if self._memory.enabled else ())

    def _model(self, name: str, version: str) -> Servable:
        served = self._dispatch.model(name)
        kserve.check_version(served.spec, version)
        return served

    # -- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, request: v2.ServerLiveRequest, context) -> v2.ServerLiveResponse:
        return v2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: v2.ServerReadyRequest, context) -> v2.ServerReadyResponse:
        return v2.ServerReadyResponse(ready=all(m.ready for m in self._dispatch.models.values()))

    @unary_errors
    async def ModelReady(self, request: v2.ModelReadyRequest, context) -> v2.ModelReadyResponse:
        return v2.ModelReadyResponse(ready=self._model(request.name, request.version).ready)

    async def ServerMetadata(self, request: v2.ServerMetadataRequest, context) -> v2.ServerMetadataResponse:
        return v2.ServerMetadataResponse(name="attnserve", version=self._version, extensions=self._extensions)

    @unary_errors
    async def ModelMetadata(self, request: v2.ModelMetadataRequest, context) -> v2.ModelMetadataResponse:
        return kserve.model_metadata(self._model(request.name, request.version).spec)

    @unary_errors
    async def ModelConfig(self, request: v2.ModelConfigRequest, context) -> v2.ModelConfigResponse:
        served = self._model(request.name, request.version)
        return v2.ModelConfigResponse(config=kserve.model_config(served.spec, served.settings, served.devices))

    @unary_errors
    async def ModelStatistics(self, request: v2.ModelStatisticsRequest, context) -> v2.ModelStatisticsResponse:
        models = [self._model(request.name, request.version)] if request.name else list(self._dispatch.models.values())
        return v2.ModelStatisticsResponse(
            model_stats=[kserve.model_statistics(m.spec, await m.statistics()) for m in models]
        )

    async def RepositoryIndex(self, request: v2.RepositoryIndexRequest, context) -> v2.RepositoryIndexResponse:
        response = v2.RepositoryIndexResponse()
        for served in self._dispatch.models.values():
            if served.ready or not request.ready:
                state = "READY" if served.ready else "UNAVAILABLE"
                response.models.add(name=served.spec.name, version=kserve.VERSION, state=state)
        return response

    # -- system shared memory (edge/shared_memory.py) ------------------------------------------

    @unary_errors
    async def SystemSharedMemoryStatus(
        self, request: v2.SystemSharedMemoryStatusRequest, context
    ) -> v2.SystemSharedMemoryStatusResponse:
        response = v2.SystemSharedMemoryStatusResponse()
        for r in self._memory.status(request.name):
            response.regions[r.name].MergeFrom(
                v2.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
            )
        return response

    @unary_errors
    async def SystemSharedMemoryRegister(
        self, request: v2.SystemSharedMemoryRegisterRequest, context
    ) -> v2.SystemSharedMemoryRegisterResponse:
        await self._memory.register(request.name, request.key, request.offset, request.byte_size)
        return v2.SystemSharedMemoryRegisterResponse()

    @unary_errors
    async def SystemSharedMemoryUnregister(
        self, request: v2.SystemSharedMemoryUnregisterRequest, context
    ) -> v2.SystemSharedMemoryUnregisterResponse:
        await self._memory.unregister(request.name)
        return v2.SystemSharedMemoryUnregisterResponse()

    # -- CUDA shared memory: not served (no region is ever held) ---------------------------------

    @unary_errors
    async def CudaSharedMemoryStatus(
        self, request: v2.CudaSharedMemoryStatusRequest, context
    ) -> v2.CudaSharedMemoryStatusResponse:
        if request.name:
            raise NotFound(f"name: no CUDA shared memory region named {clip(request.name)} is registered")
        return v2.CudaSharedMemoryStatusResponse()

    @unary_errors
    async def CudaSharedMemoryRegister(
        self, request: v2.CudaSharedMemoryRegisterRequest, context
    ) -> v2.CudaSharedMemoryRegisterResponse:
        raise Unimplemented(
            "CUDA shared memory is not served; system shared memory is, with the server's --allow-client-shm"
        )

    @unary_errors
    async def CudaSharedMemoryUnregister(
        self, request: v2.CudaSharedMemoryUnregisterRequest, context
    ) -> v2.CudaSharedMemoryUnregisterResponse:
        return v2.CudaSharedMemoryUnregisterResponse()  # none is held: nothing to do, by name or all

    # -- inference -------------------------------------------------------------------------

    async def _infer(
        self, incoming: Received[v2.ModelInferRequest], method: str, context, stream_peer: str | None = None
    ) -> v2.ModelInferResponse | Frame:
        msg = incoming.message
        decoded: kserve.Decoded | None = None

        def decode(served: Servable) -> tuple[AttentionRequest, float | None]:
            nonlocal decoded
            decoded = kserve.decode(incoming, served.spec, self._memory)
            return decoded.request, decoded.timeout_s

        def encode(served: Servable, request: AttentionRequest, answer: Answer, received: float):
            queue_ns, compute_ns, _ = Timing.of(answer, received)
            timing = {
                "queue_ns": queue_ns,
                "compute_ns": compute_ns,
                "batch_size": answer.batch.requests,
                "batch_sequences": answer.batch.sequences,
            }
            assert decoded is not None
            return kserve.encode(served.spec, msg, decoded, answer, timing)

        deadline = self._dispatch.deadline(context)
        model = msg.model_name
        return await self._dispatch.handle(model, method, deadline, decode, encode, context, stream_peer=stream_peer)

    @unary_errors
    async def ModelInfer(self, request: Received[v2.ModelInferRequest], context) -> v2.ModelInferResponse | Frame:
        return await self._infer(request, "ModelInfer", context)

    async def _infer_in_band(
        self, received: Received[v2.ModelInferRequest] | Undecodable, context, peer: str
    ) -> v2.ModelStreamInferResponse | Frame:
        if isinstance(received, Undecodable):
            self._dispatch.undecodable(received, "ModelStreamInfer", peer)
            failed = v2.ModelInferResponse()
            failed.parameters["error_code"].string_param = grpc.StatusCode.INVALID_ARGUMENT.name
            return v2.ModelStreamInferResponse(
                error_message=f"{received.status_message}; no id to echo", infer_response=failed
            )
        try:
            return kserve.stream_response(await self._infer(received, "ModelStreamInfer", context, peer))
        except Exception as exc:
            code, message = caller_status(exc, "ModelStreamInfer")
            msg = received.message
            failed = v2.ModelInferResponse(model_name=msg.model_name, model_version=msg.model_version, id=msg.id)
            failed.parameters["error_code"].string_param = code.name
            return v2.ModelStreamInferResponse(error_message=message, infer_response=failed)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[Received[v2.ModelInferRequest] | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[v2.ModelStreamInferResponse | Frame]:
        peer = context.peer()  # read while the call is alive: its messages' tasks may outlive it (dispatch.stream)
        answers = self._dispatch.stream(
            request_iterator, lambda m: self._infer_in_band(m, context, peer), context, peer
        )
        async for response in answers:
            yield response
