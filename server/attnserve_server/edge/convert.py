"""attnserve.v1 protobuf <-> domain: requests become wire tensors for `wire.build_request`."""

from __future__ import annotations

import torch

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.domain import AttentionRequest, ModelKind, ModelSpec
from attnserve_server.edge.wire import DTYPE_NAMES, INPUT_NAMES, WireTensor, build_request, tensor_bytes

_WIRE_DTYPE = {
    torch.float32: pb.DATA_TYPE_FP32,
    torch.float16: pb.DATA_TYPE_FP16,
    torch.bfloat16: pb.DATA_TYPE_BF16,
    torch.bool: pb.DATA_TYPE_BOOL,
    torch.int32: pb.DATA_TYPE_INT32,
    torch.int64: pb.DATA_TYPE_INT64,
}
# attnserve.v1 DataType -> the wire name (DATA_TYPE_FP32 -> FP32); unknown numbers read as <n>.
_NAMES = {wire: DTYPE_NAMES[dtype] for dtype, wire in _WIRE_DTYPE.items()}


def dtype_name(wire: int) -> str:
    if wire in _NAMES:
        return _NAMES[wire]
    return pb.DataType.Name(wire).removeprefix("DATA_TYPE_") if wire in pb.DataType.values() else f"<{wire}>"


def request_from_proto(msg: pb.AttendRequest, spec: ModelSpec) -> AttentionRequest:
    """Validates a request against its model and returns it as domain values; raises InvalidArgument."""
    tensors = {}
    for name in INPUT_NAMES:
        if msg.HasField(name):
            t = getattr(msg, name)
            tensors[name] = WireTensor(dtype_name(t.dtype), tuple(t.shape), t.data, f"{name}.data")
    return build_request(
        spec, tensors, causal=msg.causal, need_weights=msg.need_weights, average_weights=msg.average_weights
    )


def tensor_to_proto(t: torch.Tensor, out: pb.Tensor) -> None:
    out.dtype = _WIRE_DTYPE[t.dtype]
    out.shape[:] = t.shape
    out.data = tensor_bytes(t)


def fill_response(
    response: pb.AttendResponse,
    output: torch.Tensor,
    weights: torch.Tensor | None,
    unbatched: bool,
) -> None:
    tensor_to_proto(output[0] if unbatched else output, response.output)
    if weights is not None:
        tensor_to_proto(weights[0] if unbatched else weights, response.attention_weights)


def model_metadata(spec: ModelSpec, settings_batching, devices: list[str], ready: bool) -> pb.ModelMetadata:
    return pb.ModelMetadata(
        name=spec.name,
        kind=pb.MODEL_KIND_MHA if spec.kind is ModelKind.MHA else pb.MODEL_KIND_SDPA,
        embed_dim=spec.embed_dim,
        num_heads=spec.num_heads,
        kdim=spec.kdim,
        vdim=spec.vdim,
        bias=spec.bias,
        dtype=_WIRE_DTYPE[spec.dtype],
        devices=devices,
        batching=pb.BatchingLimits(
            max_batch_size=settings_batching.max_batch_size,
            max_batch_tokens=settings_batching.max_batch_tokens,
            max_queue_delay_ms=settings_batching.max_queue_delay_ms,
            max_queue_size=settings_batching.max_queue_size,
        ),
        max_query_len=spec.max_query_len,
        max_key_len=spec.max_key_len,
        output_dim=spec.output_dim,
        ready=ready,
    )
