"""attnserve.v1 protobuf <-> domain: requests become wire tensors for `wire.build_request`."""

from __future__ import annotations

from attnserve.v1 import attention_pb2 as pb
from attnserve_server import dtypes
from attnserve_server.domain import Answer, AttentionRequest, ModelKind, ModelSpec
from attnserve_server.edge.framing import Frame
from attnserve_server.edge.payload import Fields, Received
from attnserve_server.edge.wire import INPUT_NAMES, Known, WireTensor, build_request, read_shape

# attnserve.v1 DataType <-> the wire name (DATA_TYPE_FP32 <-> FP32); unknown numbers read as <n>.
_NAMES = {v: pb.DataType.Name(v).removeprefix("DATA_TYPE_") for v in pb.DataType.values()}
_ENUM = {name: v for v, name in _NAMES.items() if name in dtypes.BY_NAME}


def dtype_name(wire: int) -> str:
    return _NAMES.get(wire, f"<{wire}>")


_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_INPUT_FIELDS = {name: pb.AttendRequest.DESCRIPTOR.fields_by_name[name].number for name in INPUT_NAMES}
# A request's tensor bytes, for edge/payload.py: each input's Tensor.data.
TENSOR_FIELDS: Fields = {number: _DATA for number in _INPUT_FIELDS.values()}


def request_from_proto(received: Received[pb.AttendRequest], spec: ModelSpec) -> AttentionRequest:
    """Validates a request against its model and returns it as domain values; raises InvalidArgument.
    A request whose head repeats one this model accepted before is not validated again (`wire.Known`)."""
    repeat = received.repeat
    if repeat is not None:
        known = repeat.decoded
        if type(known) is Known and known.spec is spec:
            return known.request(received.views)
    msg, views = received.message, received.views
    tensors = {}
    for name, number in _INPUT_FIELDS.items():
        if msg.HasField(name):
            t = getattr(msg, name)
            data = views[number][0] if number in views else t.data
            tensors[name] = WireTensor(dtype_name(t.dtype), read_shape(t.shape, f"{name}.shape"), data, f"{name}.data")
    request = build_request(
        spec, tensors, causal=msg.causal, need_weights=msg.need_weights, average_weights=msg.average_weights
    )
    if repeat is not None and repeat.hits:  # kept once the head has come twice
        repeat.decoded = Known.of(spec, request, {name: (_INPUT_FIELDS[name], 0) for name in tensors})
    return request


_OUTPUT = pb.AttendResponse.DESCRIPTOR.fields_by_name["output"].number
_WEIGHTS = pb.AttendResponse.DESCRIPTOR.fields_by_name["attention_weights"].number


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes | memoryview, unbatched: bool) -> Frame:
    head = pb.Tensor(dtype=_ENUM[dtype], shape=shape[1:] if unbatched else shape).SerializeToString()
    return Frame(head).add_bytes(_DATA, data)


def framed_response(response: pb.AttendResponse, spec: ModelSpec, request: AttentionRequest, answer: Answer) -> Frame:
    """`response` (its other fields set) with the answer's tensors, their bytes uncopied (framing.py)."""
    dtype = spec.dtype.name
    frame = Frame(response.SerializeToString())
    frame.add_message(_OUTPUT, _tensor(dtype, answer.output_shape, answer.output, request.unbatched))
    if answer.weights is not None:
        frame.add_message(_WEIGHTS, _tensor(dtype, answer.weights_shape, answer.weights, request.unbatched))
    return frame


def model_metadata(spec: ModelSpec, settings_batching, devices: list[str], ready: bool) -> pb.ModelMetadata:
    return pb.ModelMetadata(
        name=spec.name,
        kind=pb.MODEL_KIND_MHA if spec.kind is ModelKind.MHA else pb.MODEL_KIND_SDPA,
        embed_dim=spec.embed_dim,
        num_heads=spec.num_heads,
        kdim=spec.kdim,
        vdim=spec.vdim,
        bias=spec.bias,
        dtype=_ENUM[spec.dtype.name],
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
        inputs=spec.inputs,
    )
