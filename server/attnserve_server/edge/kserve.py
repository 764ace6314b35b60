"""KServe v2 / Open Inference Protocol messages <-> domain values.

A model's inputs are named as the native API names them (query, key_value or key
and value, key_padding_mask or key_lengths); the request parameters causal,
need_weights and average_weights are bools; outputs are `output` and, when asked (by name
or with need_weights; metadata lists only `output`: see `_outputs`), `attention_weights`.
Every model has max_batch_size > 0, so every tensor's first dim is the batch of sequences,
as Triton's tools expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from attnserve_server import dtypes
from attnserve_server.domain import (
    Answer,
    AttentionRequest,
    ModelSpec,
    answer_bytes,
    optional_inputs,
    weight_heads,
)
from attnserve_server.edge.framing import Frame
from attnserve_server.edge.payload import Fields, Kept, Received
from attnserve_server.edge.shared_memory import OFF, Region, SharedMemoryRegistry
from attnserve_server.edge.wire import INPUT_NAMES, Known, WireTensor, build_request, read_shape
from attnserve_server.errors import InvalidArgument, ModelNotFound, clip, shape_text
from attnserve_server.metrics import Duration, InferenceStats
from attnserve_server.protocol import open_inference_pb2 as v2
from attnserve_server.settings import ModelSettings

VERSION = "1"  # attnserve serves one version of each model
PLATFORM = "attnserve"
OUTPUT, WEIGHTS = "output", "attention_weights"
_OUTPUTS = (OUTPUT, WEIGHTS)
FLAGS = ("causal", "need_weights", "average_weights")
TIMEOUT = "timeout"  # Triton's per-request timeout, microseconds: a deadline
# Parameters Triton's clients send that change nothing here: one queue priority, and
# empty final responses, which only decoupled models send (perf_analyzer sets it on every request).
IGNORED = ("priority", "triton_enable_empty_final_response")
# Typed `contents` fields by datatype; FP16 and BF16 have none (raw only).
_TYPED = {"FP32": "fp32_contents", "BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents"}
_CONFIG_TYPE = {
    "FP32": v2.TYPE_FP32,
    "FP16": v2.TYPE_FP16,
    "BF16": v2.TYPE_BF16,
    "BOOL": v2.TYPE_BOOL,
    "INT32": v2.TYPE_INT32,
    "INT64": v2.TYPE_INT64,
}


def check_version(spec: ModelSpec, version: str) -> None:
    if version not in ("", VERSION):
        raise ModelNotFound(f"model_version: model {spec.name!r} has no version {clip(version)}; it serves {VERSION!r}")


@dataclass(frozen=True, slots=True)
class Decoded:
    request: AttentionRequest
    outputs: tuple[str, ...]  # in the order the response carries them
    typed: bool  # the inputs came as typed contents: answer the same way
    timeout_s: float | None  # Triton's `timeout` parameter
    # Outputs asked for in shared memory (shared_memory.py): name -> (region, offset within it).
    placed: dict[str, tuple[Region, int]] | None = None


def _bool_param(msg: v2.ModelInferRequest, name: str) -> bool | None:
    if name not in msg.parameters:
        return None
    param = msg.parameters[name]
    kind = param.WhichOneof("parameter_choice")
    if kind != "bool_param":
        raise InvalidArgument(f"parameters[{clip(name)}]: expected bool_param, got {kind or 'no value'}")
    return param.bool_param


def _timeout_s(msg: v2.ModelInferRequest) -> float | None:
    """Triton's `timeout` request parameter (microseconds), as seconds; None when absent."""
    if TIMEOUT not in msg.parameters:
        return None
    param = msg.parameters[TIMEOUT]
    kind = param.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidArgument(f"parameters['timeout']: expected int64_param (microseconds), got {kind or 'no value'}")
    micros = getattr(param, kind)
    if micros <= 0:
        raise InvalidArgument(f"parameters['timeout']: expected a positive number of microseconds, got {micros}")
    return micros / 1e6


_READ = (*FLAGS, TIMEOUT, *IGNORED)


def _check_counts(msg: v2.ModelInferRequest) -> None:
    """Refuses a request with more parameters, inputs or outputs than any request has, before reading
    any of them: one message of 20 MB holds two million empty inputs, which took the event loop (and
    every other request) seconds to read one by one."""
    for field, most, names in (
        ("parameters", len(_READ), _READ),
        ("inputs", len(INPUT_NAMES), INPUT_NAMES),
        ("outputs", len(_OUTPUTS), _OUTPUTS),
    ):
        count = len(getattr(msg, field))
        if count > most:
            raise InvalidArgument(f"{field}: expected at most {most} ({', '.join(names)}), got {count}")


def _check_parameters(msg: v2.ModelInferRequest) -> None:
    for name in msg.parameters:
        if name not in _READ:
            known = ", ".join(_READ)
            raise InvalidArgument(f"parameters[{clip(name)}]: not a parameter attnserve reads; it reads {known}")


# Triton's shared memory parameters of an input or a requested output (shared_memory.py).
SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
_SHM_PARAMS = (SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET)


@dataclass(frozen=True, slots=True)
class _Placement:
    region: str
    offset: int
    byte_size: int


def _placement(where: str, what: str, params) -> _Placement | None:
    """The shared memory parameters of an input or requested output (`what`), or None without them."""
    if len(params) > len(_SHM_PARAMS):
        raise InvalidArgument(
            f"{where}.parameters: expected at most {len(_SHM_PARAMS)} ({', '.join(_SHM_PARAMS)}), got {len(params)}"
        )
    for name in params:
        if name not in _SHM_PARAMS:
            raise InvalidArgument(
                f"{where}.parameters[{clip(name)}]: {what} takes no such parameter; only {', '.join(_SHM_PARAMS)}"
            )
    if not params:
        return None
    if SHM_REGION not in params or SHM_BYTE_SIZE not in params:
        raise InvalidArgument(
            f"{where}.parameters: {what} in shared memory needs both {SHM_REGION!r} and {SHM_BYTE_SIZE!r}"
        )
    region = params[SHM_REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise InvalidArgument(f"{where}.parameters[{SHM_REGION!r}]: expected string_param")

    def number(key: str) -> int:
        if key not in params:
            return 0
        kind = params[key].WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise InvalidArgument(f"{where}.parameters[{key!r}]: expected int64_param, got {kind or 'no value'}")
        value = getattr(params[key], kind)
        if value < 0:
            raise InvalidArgument(f"{where}.parameters[{key!r}]: expected >= 0, got {value}")
        return value

    return _Placement(region.string_param, number(SHM_OFFSET), number(SHM_BYTE_SIZE))


def _requested_outputs(msg: v2.ModelInferRequest) -> tuple[tuple[str, ...], dict[str, tuple[str, _Placement]]]:
    """The outputs asked for, in order, and those asked for in shared memory (name -> (field, placement))."""
    names: list[str] = []
    placed: dict[str, tuple[str, _Placement]] = {}
    for i, out in enumerate(msg.outputs):
        if out.name not in _OUTPUTS:
            raise InvalidArgument(f"outputs[{i}].name: expected {OUTPUT!r} or {WEIGHTS!r}, got {clip(out.name)}")
        if out.name in names:
            raise InvalidArgument(f"outputs[{i}].name: output {clip(out.name)} is requested twice")
        placement = _placement(f"outputs[{i}]", f"output {clip(out.name)}", out.parameters)
        if placement is not None:
            placed[out.name] = (f"outputs[{i}].parameters", placement)
        names.append(out.name)
    return tuple(names), placed


def _typed_bytes(i: int, tensor: v2.ModelInferRequest.InferInputTensor, shape: tuple[int, ...]) -> bytes:
    """The bytes of a tensor sent as typed contents, after checking the field and the element count."""
    name, datatype = tensor.name, tensor.datatype
    present = [f.name for f, _ in tensor.contents.ListFields()]
    where = f"inputs[{i}].contents"
    if datatype not in dtypes.BY_NAME:
        return b""  # build_request names the datatype it expected
    field = _TYPED.get(datatype)
    if field is None:
        raise InvalidArgument(
            f"{where}: {datatype} input {clip(name)} has no typed field; send it in raw_input_contents"
        )
    wrong = [f for f in present if f != field]
    if wrong:
        raise InvalidArgument(f"{where}: {datatype} input {clip(name)} goes in {field}, got {', '.join(wrong)}")
    values = getattr(tensor.contents, field)
    if all(d > 0 for d in shape) and len(values) != math.prod(shape):
        raise InvalidArgument(
            f"{where}.{field}: expected {math.prod(shape)} elements for input {clip(name)} "
            f"shape {shape_text(shape)}, got {len(values)}"
        )
    return np.asarray(values, dtype=dtypes.BY_NAME[datatype].storage).tobytes()


def _wire_tensors(
    msg: v2.ModelInferRequest, raw: Sequence[bytes | memoryview], memory: SharedMemoryRegistry
) -> tuple[dict[str, WireTensor], bool]:
    placements = [_placement(f"inputs[{i}]", f"input {clip(t.name)}", t.parameters) for i, t in enumerate(msg.inputs)]
    carried = sum(p is None for p in placements)  # inputs whose bytes the message carries
    if raw and len(raw) != carried:
        in_shm = len(msg.inputs) - carried
        raise InvalidArgument(
            f"raw_input_contents: expected one entry per input ({carried}"
            f"{f', the {in_shm} in shared memory apart' if in_shm else ''}), got {len(raw)}; "
            "send every input raw, or every input as typed contents"
        )
    tensors: dict[str, WireTensor] = {}
    next_raw = 0
    for i, tensor in enumerate(msg.inputs):
        name = tensor.name
        if name in tensors:
            raise InvalidArgument(f"inputs[{i}].name: input {clip(name)} appears twice")
        shape = read_shape(tensor.shape, f"inputs[{i}].shape (input {clip(name)})")
        has_contents = tensor.HasField("contents") and bool(tensor.contents.ListFields())
        placement = placements[i]
        if placement is not None:
            field = f"inputs[{i}].parameters (input {clip(name)}, shared memory region {clip(placement.region)})"
            if has_contents:
                raise InvalidArgument(f"inputs[{i}].contents: input {clip(name)} is in shared memory; send no contents")
            region = memory.place(f"inputs[{i}].parameters", placement.region, placement.offset, placement.byte_size)
            data: bytes | memoryview = memory.read(region, placement.offset, placement.byte_size, field)
        elif raw:
            if has_contents:
                raise InvalidArgument(
                    f"inputs[{i}].contents: input {clip(name)} has typed contents while the request uses "
                    "raw_input_contents; send every input one way"
                )
            data = raw[next_raw]
            field = f"raw_input_contents[{next_raw}] (input {clip(name)})"
            next_raw += 1
        else:
            data = _typed_bytes(i, tensor, shape)
            field = f"inputs[{i}].contents (input {clip(name)})"
        if name == "key_lengths" and len(shape) == 2 and shape[1] == 1:
            shape = shape[:1]  # [B, 1], the shape its config dims [1] give, or [B]
        tensors[name] = WireTensor(tensor.datatype, shape, data, field)
    return tensors, carried > 0 and not raw


RAW_INPUT_CONTENTS = v2.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
# For edge/payload.py: a request's tensor bytes, the entries of raw_input_contents, cut out; its inputs kept.
TENSOR_FIELDS: Fields = {
    RAW_INPUT_CONTENTS: None,
    # The inputs: their typed contents may be large; their names, shapes and parameters are bounded,
    # and so are their contents of bools and integers.
    v2.ModelInferRequest.DESCRIPTOR.fields_by_name["inputs"].number: Kept(
        v2.ModelInferRequest.InferInputTensor.DESCRIPTOR.fields_by_name["contents"].number,
        frozenset(
            v2.InferTensorContents.DESCRIPTOR.fields_by_name[name].number
            for name in ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents")
        ),
    ),
}


def decode(received: Received[v2.ModelInferRequest], spec: ModelSpec, memory: SharedMemoryRegistry = OFF) -> Decoded:
    """Validates a ModelInferRequest against its model; raises InvalidArgument (or ModelNotFound).
    Inputs in shared memory are read from `memory`'s regions, and outputs asked for there are checked
    to fit theirs.

    A request whose head repeats one this model decoded before (payload.Parser) is not validated
    again (`wire.Known`): only its tensor bytes differ. Requests whose values are checked (masks,
    lengths, typed contents) or that use shared memory are decoded whole each time."""
    repeat = received.repeat
    if repeat is not None:
        again = repeat.decoded
        if type(again) is _Again and again.known.spec is spec:
            return Decoded(again.known.request(received.views), again.outputs, False, again.timeout_s)
    decoded = _decode_whole(received, spec, memory)
    # Kept once the head has come twice: a head seen once (a request with its own id) costs nothing here.
    # A head that names shared memory is not: its tensors are not in the message, and its regions may change.
    uses_memory = decoded.placed is not None or any(t.parameters for t in received.message.inputs)
    if repeat is not None and repeat.hits and not decoded.typed and not uses_memory:
        where = {tensor.name: (RAW_INPUT_CONTENTS, i) for i, tensor in enumerate(received.message.inputs)}
        known = Known.of(spec, decoded.request, where)
        if known is not None:
            repeat.decoded = _Again(known, decoded.outputs, decoded.timeout_s)
    return decoded


class _Again:
    """What a model decoded of a head before: the request (`wire.Known`) and the response's form."""

    __slots__ = ("known", "outputs", "timeout_s")

    def __init__(self, known: Known, outputs: tuple[str, ...], timeout_s: float | None) -> None:
        self.known, self.outputs, self.timeout_s = known, outputs, timeout_s


def _decode_whole(received: Received[v2.ModelInferRequest], spec: ModelSpec, memory: SharedMemoryRegistry) -> Decoded:
    msg = received.message
    check_version(spec, msg.model_version)
    _check_counts(msg)
    _check_parameters(msg)
    timeout = _timeout_s(msg)
    outputs, placements = _requested_outputs(msg)
    need_weights = _bool_param(msg, "need_weights")
    if need_weights is False and WEIGHTS in outputs:
        raise InvalidArgument(f"outputs: {WEIGHTS!r} is requested but parameters['need_weights'] is false")
    if need_weights is None:
        need_weights = WEIGHTS in outputs
    if not outputs:
        outputs = (OUTPUT, WEIGHTS) if need_weights else (OUTPUT,)
    raw = received.views.get(RAW_INPUT_CONTENTS) or msg.raw_input_contents
    tensors, typed = _wire_tensors(msg, raw, memory)
    query = tensors.get("query")
    if query is not None and len(query.shape) != 3:
        raise InvalidArgument(
            f"query.shape: expected [B, L, E], the batch of sequences first (max_batch_size "
            f"{spec.max_batch_size}), got {shape_text(query.shape)}"
        )
    request = build_request(
        spec,
        tensors,
        causal=bool(_bool_param(msg, "causal")),
        need_weights=need_weights,
        # torch's default, and the native API's: weights are averaged over heads unless asked per head.
        average_weights=need_weights if (average := _bool_param(msg, "average_weights")) is None else average,
    )
    placed = _place_outputs(spec, request, placements, memory) if placements else None
    return Decoded(request, outputs, typed, timeout, placed)


def _place_outputs(
    spec: ModelSpec,
    request: AttentionRequest,
    placements: dict[str, tuple[str, _Placement]],
    memory: SharedMemoryRegistry,
) -> dict[str, tuple[Region, int]]:
    """The regions outputs go to, each checked to hold its output (before any compute)."""
    b, length, keys = request.sequences, request.query_len, request.key_len
    heads = weight_heads(spec, request.need_weights, request.average_weights)
    sizes = {
        OUTPUT: answer_bytes(spec, b, length, keys, 0),
        WEIGHTS: answer_bytes(spec, b, length, keys, heads) - answer_bytes(spec, b, length, keys, 0),
    }
    placed: dict[str, tuple[Region, int]] = {}
    for name, (where, p) in placements.items():
        if p.byte_size < sizes[name]:
            raise InvalidArgument(
                f"{where}[{SHM_BYTE_SIZE!r}]: output {name!r} takes {sizes[name]} bytes, got room for {p.byte_size}"
            )
        placed[name] = (memory.place(where, p.region, p.offset, sizes[name]), p.offset)
    return placed


RAW_OUTPUT_CONTENTS = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
STREAM_INFER_RESPONSE = v2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number


def _output(response: v2.ModelInferResponse, name: str, dtype: str, shape, data: bytes, typed: bool) -> bytes | None:
    """Adds output `name`; returns its bytes when they go in raw_output_contents (framing.py), else
    None (typed contents, set here)."""
    out = response.outputs.add(name=name, datatype=dtype, shape=shape)
    if typed and dtype in _TYPED:
        getattr(out.contents, _TYPED[dtype]).extend(np.frombuffer(data, dtype=dtypes.BY_NAME[dtype].storage).tolist())
        return None
    return data


def encode(
    spec: ModelSpec, msg: v2.ModelInferRequest, decoded: Decoded, answer: Answer, timing: dict[str, int]
) -> v2.ModelInferResponse | Frame:
    """The response; a Frame (framing.py) when it carries raw_output_contents. An output asked for in
    shared memory is written to its region here, and the response names it, its shape and its place.
    Unless the outputs go as typed contents, raw_output_contents holds one entry per output, empty for
    one in shared memory, as Triton sends them: raw_output_contents[i] is outputs[i]'s, and Triton's C++
    client (perf_analyzer's) reads an entry for every output, crashing on a response without them."""
    response = v2.ModelInferResponse(model_name=spec.name, model_version=VERSION, id=msg.id)
    for key, value in timing.items():
        response.parameters[key].int64_param = value
    dtype = spec.dtype.name
    raw: list[bytes] = []
    placed = decoded.placed or {}
    tensors = []
    for name in decoded.outputs:
        if name == OUTPUT:
            tensors.append((name, answer.output_shape, answer.output))
        elif answer.weights is not None:
            # Averaged weights [B, L, S] go out as [B, 1, L, S]: one rank for both forms.
            shape = answer.weights_shape
            if len(shape) == 3:
                shape = (shape[0], 1, *shape[1:])
            tensors.append((name, shape, answer.weights))
    for name, shape, data in tensors:
        if name not in placed:
            contents = _output(response, name, dtype, shape, data, decoded.typed)
            if contents is not None:
                raw.append(contents)
        else:
            region, offset = placed[name]
            SharedMemoryRegistry.write(region, offset, data)
            out = response.outputs.add(name=name, datatype=dtype, shape=shape)
            out.parameters[SHM_REGION].string_param = region.name
            out.parameters[SHM_BYTE_SIZE].int64_param = memoryview(data).nbytes
            if offset:
                out.parameters[SHM_OFFSET].int64_param = offset
            if not (decoded.typed and dtype in _TYPED):  # (as _output decides for the others)
                raw.append(b"")
    if not raw:
        return response
    frame = Frame(response.SerializeToString())
    for data in raw:
        frame.add_bytes(RAW_OUTPUT_CONTENTS, data)
    return frame


def stream_response(infer: v2.ModelInferResponse | Frame) -> v2.ModelStreamInferResponse | Frame:
    """A stream's answer to one request: the response `encode` made, as `infer_response`."""
    if isinstance(infer, Frame):
        return Frame().add_message(STREAM_INFER_RESPONSE, infer)
    return v2.ModelStreamInferResponse(infer_response=infer)


# -- metadata and configuration ------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False
    reshape: tuple[int, ...] | None = None


def _inputs(spec: ModelSpec) -> list[_Tensor]:
    """The inputs the model takes (spec.inputs), marked optional as domain.optional_inputs says."""
    dt = spec.dtype.name
    optional = optional_inputs(spec.kind, spec.kdim, spec.vdim)
    tensors = {
        "query": _Tensor("query", dt, (-1, spec.embed_dim)),
        "key_value": _Tensor("key_value", dt, (-1, spec.kdim)),
        "key": _Tensor("key", dt, (-1, spec.kdim)),
        "value": _Tensor("value", dt, (-1, spec.vdim)),
        "key_padding_mask": _Tensor("key_padding_mask", "BOOL", (-1,)),
        "key_lengths": _Tensor("key_lengths", "INT64", (1,), reshape=()),
    }
    return [replace(tensors[name], optional=name in optional) for name in spec.inputs]


def _outputs(spec: ModelSpec) -> list[_Tensor]:
    """The outputs that metadata and config list: those a request that names none gets, as KServe v2
    has it ("all outputs produced by the model"). attention_weights ([heads, L, S], heads = num_heads or
    1 when averaged) is not among them: it is an extra a request asks for by name or with need_weights
    (the config's `optional_outputs` parameter names it). Generic clients ask for every listed output in
    every request: perf_analyzer did, so every request it sent computed and carried the weights. Once
    it stopped (with compute/attention.py's choice of kernel made anew), it drove WL at concurrency 32
    21% and L=512 at concurrency 16 40% faster, in pairs (BENCHMARKS.md, thirty-fifth pass)."""
    return [_Tensor(OUTPUT, spec.dtype.name, (-1, spec.output_dim))]


# Outputs a request may name beyond _outputs, for the config's `optional_outputs` parameter.
OPTIONAL_OUTPUTS = (WEIGHTS,)


def model_metadata(spec: ModelSpec) -> v2.ModelMetadataResponse:
    def meta(t: _Tensor) -> v2.ModelMetadataResponse.TensorMetadata:
        return v2.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=(-1, *t.dims))

    return v2.ModelMetadataResponse(
        name=spec.name,
        versions=[VERSION],
        platform=PLATFORM,
        inputs=[meta(t) for t in _inputs(spec)],
        outputs=[meta(t) for t in _outputs(spec)],
    )


def model_config(spec: ModelSpec, settings: ModelSettings, devices: list[str]) -> v2.ModelConfig:
    b = settings.batching
    config = v2.ModelConfig(
        name=spec.name,
        platform=PLATFORM,
        backend=PLATFORM,
        max_batch_size=spec.max_batch_size,
        dynamic_batching=v2.ModelDynamicBatching(
            max_queue_delay_microseconds=round(b.max_queue_delay_ms * 1000),
            default_queue_policy=v2.ModelQueuePolicy(max_queue_size=b.max_queue_size),
        ),
        model_transaction_policy=v2.ModelTransactionPolicy(decoupled=False),
    )
    for t in _inputs(spec):
        config.input.add(name=t.name, data_type=_CONFIG_TYPE[t.datatype], dims=t.dims, optional=t.optional)
        if t.reshape is not None:
            config.input[-1].reshape.shape[:] = t.reshape
    for t in _outputs(spec):
        config.output.add(name=t.name, data_type=_CONFIG_TYPE[t.datatype], dims=t.dims)
    gpus = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    if gpus:
        config.instance_group.add(name=f"{spec.name}_gpu", kind=v2.ModelInstanceGroup.KIND_GPU, count=1, gpus=gpus)
    if "cpu" in devices:
        config.instance_group.add(name=f"{spec.name}_cpu", kind=v2.ModelInstanceGroup.KIND_CPU, count=1)
    params = {
        "kind": spec.kind.value,
        "embed_dim": spec.embed_dim,
        "num_heads": spec.num_heads,
        "kdim": spec.kdim,
        "vdim": spec.vdim,
        "dtype": spec.dtype.setting,
        "max_query_len": spec.max_query_len,
        "max_key_len": spec.max_key_len,
        "max_batch_tokens": spec.max_batch_tokens,
        "optional_outputs": ",".join(OPTIONAL_OUTPUTS),
    }
    for key, value in params.items():
        config.parameters[key].string_value = str(value)
    return config


def _duration(out: v2.StatisticDuration, d: Duration) -> None:
    out.count, out.ns = d.count, d.ns


def model_statistics(spec: ModelSpec, stats: InferenceStats) -> v2.ModelStatistics:
    out = v2.ModelStatistics(
        name=spec.name,
        version=VERSION,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
    )
    s = out.inference_stats
    _duration(s.success, stats.success)
    _duration(s.fail, stats.fail)
    _duration(s.queue, stats.queue)
    _duration(s.compute_input, stats.compute.input)
    _duration(s.compute_infer, stats.compute.infer)
    _duration(s.compute_output, stats.compute.output)
    for size in sorted(stats.by_batch_size):
        phases = stats.by_batch_size[size]
        b = out.batch_stats.add(batch_size=size)
        _duration(b.compute_input, phases.input)
        _duration(b.compute_infer, phases.infer)
        _duration(b.compute_output, phases.output)
    return out
