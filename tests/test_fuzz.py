"""Property-based fuzzing of both edges: whatever a client sends, the answer is OK or a precise status.

Arbitrary messages of the right type (random shapes, dtypes, byte lengths, names, parameters) go
through each edge's decoder directly (many examples, fast), then arbitrary messages and arbitrary
bytes through the real server. Never UNKNOWN or INTERNAL, and a valid request still works after.
Bounded: a few hundred examples, well under a minute.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnserve import Client
from attnserve.v1 import attention_pb2 as pb
from attnserve_server.edge import kserve
from attnserve_server.edge.convert import TENSOR_FIELDS as NATIVE_FIELDS
from attnserve_server.edge.convert import request_from_proto
from attnserve_server.edge.payload import Parser, Received
from attnserve_server.errors import ServingError
from attnserve_server.model import spec_from_settings
from attnserve_server.protocol import open_inference_pb2 as v2
from attnserve_server.settings import ModelSettings

from conftest import Running

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
SPEC = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, max_query_len=128, max_key_len=96))
INPUTS = ["query", "key_value", "key", "value", "key_padding_mask", "key_lengths"]
DATATYPES = ["FP32", "FP16", "BF16", "BOOL", "INT32", "INT64", "UINT8", "", "fp32", "BYTES"]

names = st.one_of(st.sampled_from(INPUTS), st.text(max_size=12))
dims = st.lists(st.integers(min_value=-2, max_value=40), max_size=5)
small_dims = st.lists(st.sampled_from([1, 2, 3, 4, 8, 32]), min_size=1, max_size=4)


@st.composite
def payload(draw, shape: list[int], itemsize: int) -> bytes:
    """Bytes of the size the shape asks for (usually), or of any size."""
    n = 1
    for d in shape:
        n *= max(d, 0)
    if n * itemsize <= 1 << 16 and draw(st.booleans()):
        return draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    return draw(st.binary(max_size=256))


@st.composite
def infer_requests(draw) -> v2.ModelInferRequest:
    msg = v2.ModelInferRequest(model_name=draw(st.sampled_from(["default", "", "nope"])), id=draw(st.text(max_size=8)))
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(st.one_of(small_dims, dims))
        datatype = draw(st.sampled_from(DATATYPES))
        tensor = msg.inputs.add(name=draw(names), datatype=datatype, shape=shape)
        if draw(st.booleans()):
            msg.raw_input_contents.append(draw(payload(shape, 4)))
        elif datatype == "FP32":
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=64)))
        elif datatype in ("INT64", "INT32"):
            tensor.contents.int64_contents.extend(draw(st.lists(st.integers(-5, 200), max_size=8)))
    for _ in range(draw(st.integers(0, 2))):
        name = draw(
            st.one_of(st.sampled_from(["causal", "need_weights", "average_weights", "timeout"]), st.text(max_size=8))
        )
        param = msg.parameters[name]
        kind = draw(st.sampled_from(["bool", "int", "string"]))
        if kind == "bool":
            param.bool_param = draw(st.booleans())
        elif kind == "int":
            param.int64_param = draw(st.integers(-(2**40), 2**40))
        else:
            param.string_param = draw(st.text(max_size=8))
    for _ in range(draw(st.integers(0, 2))):
        msg.outputs.add(name=draw(st.one_of(st.sampled_from(["output", "attention_weights"]), st.text(max_size=6))))
    return msg


@st.composite
def attend_requests(draw) -> pb.AttendRequest:
    msg = pb.AttendRequest(model=draw(st.sampled_from(["default", "", "nope"])))
    for name in draw(st.lists(st.sampled_from(INPUTS), max_size=3, unique=True)):
        shape = draw(st.one_of(small_dims, st.lists(st.integers(0, 40), max_size=5)))
        tensor = getattr(msg, name)
        tensor.dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 99]))
        tensor.shape[:] = shape
        tensor.data = draw(payload(shape, 4))
    msg.causal, msg.need_weights, msg.average_weights = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return msg


def _status_of_decode(decode) -> grpc.StatusCode:
    try:
        decode()
    except ServingError as exc:
        return grpc.StatusCode[exc.status]
    return grpc.StatusCode.OK


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(infer_requests())
def test_the_kserve_decoder_answers_every_message_with_a_precise_status(msg: v2.ModelInferRequest) -> None:
    assert _status_of_decode(lambda: kserve.decode(Received(msg), SPEC)) in ALLOWED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attend_requests())
def test_the_native_decoder_answers_every_message_with_a_precise_status(msg: pb.AttendRequest) -> None:
    assert _status_of_decode(lambda: request_from_proto(Received(msg), SPEC)) in ALLOWED


def _call(channel: grpc.Channel, method: str, body: bytes) -> grpc.StatusCode:
    try:
        channel.unary_unary(method, request_serializer=None, response_deserializer=None)(body, timeout=20)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def channel(default_server: Running):
    with grpc.insecure_channel(default_server.target) as ch:
        yield ch


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        infer_requests().map(lambda m: ("/inference.GRPCInferenceService/ModelInfer", m.SerializeToString())),
        attend_requests().map(lambda m: ("/attnserve.v1.AttentionService/Attend", m.SerializeToString())),
        st.tuples(
            st.sampled_from(["/inference.GRPCInferenceService/ModelInfer", "/attnserve.v1.AttentionService/Attend"]),
            st.binary(max_size=64),
        ),
    )
)
def test_the_server_answers_arbitrary_messages_and_bytes_with_a_precise_status(
    channel: grpc.Channel, call: tuple[str, bytes]
) -> None:
    method, body = call
    assert _call(channel, method, body) in ALLOWED


def test_the_server_still_answers_a_valid_request_after_the_fuzzing(default_server: Running) -> None:
    with Client(default_server.target, timeout_s=10) as c:
        assert c.attend(np.ones((3, 32), np.float32)).output.shape == (3, 32)


# -- a repeated head (payload.Parser) decodes as the whole message would ----------------------------


@st.composite
def request_pairs(draw) -> tuple[bytes, bytes]:
    """Two KServe requests with one head (names, datatypes, shapes, parameters, outputs) and other
    tensor bytes of the same lengths: mostly valid for SPEC, with masks and lengths that may not be."""
    b, length, keys = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["self", "key_value", "key and value"]))
    padding = draw(st.sampled_from([None, "key_padding_mask", "key_lengths"]))
    keys = length if kind == "self" else keys
    flags = {n: draw(st.sampled_from([None, False, True])) for n in ("causal", "need_weights", "average_weights")}
    outputs = draw(st.lists(st.sampled_from(["output", "attention_weights"]), unique=True, max_size=2))
    order = draw(st.permutations(range(4)))  # the inputs in any order
    ids = st.sampled_from(["r", "r2", "r" * 200])  # each request its own

    def message(seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        msg = v2.ModelInferRequest(model_name="default", id=draw(ids))
        inputs: list[tuple[str, str, list[int], bytes]] = []

        def add(name: str, datatype: str, shape: list[int], data: bytes) -> None:
            inputs.append((name, datatype, shape, data))

        add("query", "FP32", [b, length, 32], rng.standard_normal((b, length, 32)).astype("<f4").tobytes())
        for name in {"self": [], "key_value": ["key_value"], "key and value": ["key", "value"]}[kind]:
            add(name, "FP32", [b, keys, 32], rng.standard_normal((b, keys, 32)).astype("<f4").tobytes())
        if padding == "key_padding_mask":  # now and then a byte other than 0 or 1, a row all masked
            high = 2 if rng.random() < 0.8 else 3
            add(padding, "BOOL", [b, keys], rng.integers(0, high, (b, keys), np.uint8).tobytes())
        elif padding == "key_lengths":
            add(padding, "INT64", [b], rng.integers(0, keys + 2, b).astype("<i8").tobytes())
        for name, datatype, shape, data in sorted(inputs, key=lambda t: order[inputs.index(t)]):
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
            msg.raw_input_contents.append(data)
        for name, value in flags.items():
            if value is not None:
                msg.parameters[name].bool_param = value
        for name in outputs:
            msg.outputs.add(name=name)
        return msg.SerializeToString()

    first, second = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**32 - 1))
    return message(first), message(second)


def _outcome(decode) -> tuple:
    """A decode's result as comparable values: its status and message, or what it decoded."""
    try:
        d = decode()
    except ServingError as exc:
        return exc.status, str(exc)
    r = d.request

    def tensor(t):
        return None if t is None else (bytes(t.data), t.shape)

    padding = None if r.key_padding is None else r.key_padding.tolist()
    return (
        d.outputs,
        d.typed,
        d.timeout_s,
        tensor(r.query),
        tensor(r.key),
        tensor(r.value),
        r.key is r.value,
        padding,
        r.causal,
        r.need_weights,
        r.average_weights,
        r.unbatched,
        r.nbytes,
        r.memory_bytes,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_pairs())
def test_a_request_whose_head_repeats_decodes_as_the_whole_message_would(pair: tuple[bytes, bytes]) -> None:
    parser = Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS, "id")
    first, second = pair
    for _ in range(2):  # a head decoded twice is kept
        _outcome(lambda: kserve.decode(parser(first), SPEC))
    received = parser(second)
    assert received.repeat is not None and received.repeat is parser(first).repeat  # the one head
    whole = Received(v2.ModelInferRequest.FromString(second))  # no head remembered: validated whole
    assert _outcome(lambda: kserve.decode(received, SPEC)) == _outcome(lambda: kserve.decode(whole, SPEC))


def test_a_repeated_head_is_validated_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS)

    def request(fill: int, length: int = 4) -> bytes:
        msg = v2.ModelInferRequest(model_name="default")
        msg.inputs.add(name="query", datatype="FP32", shape=[1, length, 32])
        msg.raw_input_contents.append(bytes([fill]) * (length * 32 * 4))
        return msg.SerializeToString()

    kserve.decode(parser(request(1)), SPEC)
    kserve.decode(parser(request(1)), SPEC)  # a head decoded twice is kept
    validated = []
    whole = kserve._decode_whole
    monkeypatch.setattr(kserve, "_decode_whole", lambda *a: validated.append(a) or whole(*a))
    data = request(2)
    decoded = kserve.decode(parser(data), SPEC)
    assert not validated and decoded.request.query.data.obj is data  # not validated again; its own bytes
    short = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, max_query_len=3))
    with pytest.raises(ServingError, match="max_query_len 3"):  # another model validates it itself
        kserve.decode(parser(request(3)), short)
    assert len(validated) == 1


@st.composite
def attend_pairs(draw) -> tuple[bytes, bytes]:
    """Two native requests with one head and other tensor bytes of the same lengths (as `request_pairs`)."""
    b, length, keys = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["self", "key_value", "key and value"]))
    padding = draw(st.sampled_from([None, "key_padding_mask", "key_lengths"]))
    keys = length if kind == "self" else keys
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    fp32, boolean, int64 = pb.DATA_TYPE_FP32, pb.DATA_TYPE_BOOL, pb.DATA_TYPE_INT64

    ids = st.sampled_from(["0", "17", "x" * 200])  # each request its own

    def message(seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        msg = pb.AttendRequest(
            model="default", request_id=draw(ids), causal=flags[0], need_weights=flags[1], average_weights=flags[2]
        )
        msg.query.CopyFrom(
            pb.Tensor(dtype=fp32, shape=[b, length, 32], data=rng.random((b, length, 32), "f4").tobytes())
        )
        for name in {"self": [], "key_value": ["key_value"], "key and value": ["key", "value"]}[kind]:
            getattr(msg, name).CopyFrom(
                pb.Tensor(dtype=fp32, shape=[b, keys, 32], data=rng.random((b, keys, 32), "f4").tobytes())
            )
        if padding == "key_padding_mask":
            high = 2 if rng.random() < 0.8 else 3
            msg.key_padding_mask.CopyFrom(
                pb.Tensor(dtype=boolean, shape=[b, keys], data=rng.integers(0, high, (b, keys), np.uint8).tobytes())
            )
        elif padding == "key_lengths":
            msg.key_lengths.CopyFrom(
                pb.Tensor(dtype=int64, shape=[b], data=rng.integers(0, keys + 2, b).astype("<i8").tobytes())
            )
        return msg.SerializeToString()

    return message(draw(st.integers(0, 2**32 - 1))), message(draw(st.integers(0, 2**32 - 1)))


def _request_outcome(decode) -> tuple:
    return _outcome(lambda: kserve.Decoded(decode(), (), False, None))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attend_pairs())
def test_a_native_request_whose_head_repeats_decodes_as_the_whole_message_would(pair: tuple[bytes, bytes]) -> None:
    parser = Parser(pb.AttendRequest, NATIVE_FIELDS, "request_id")
    first, second = pair
    for _ in range(2):  # a head decoded twice is kept
        _request_outcome(lambda: request_from_proto(parser(first), SPEC))
    received = parser(second)
    assert received.repeat is not None and received.repeat is parser(first).repeat
    whole = Received(pb.AttendRequest.FromString(second))
    assert _request_outcome(lambda: request_from_proto(received, SPEC)) == _request_outcome(
        lambda: request_from_proto(whole, SPEC)
    )


def test_a_repeated_native_head_is_validated_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnserve_server.edge import convert

    parser = Parser(pb.AttendRequest, NATIVE_FIELDS)

    def request(fill: int) -> bytes:
        query = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[1, 4, 32], data=bytes([fill]) * (4 * 32 * 4))
        return pb.AttendRequest(model="default", query=query).SerializeToString()

    for _ in range(2):  # a head decoded twice is kept
        request_from_proto(parser(request(1)), SPEC)
    validated = []
    build = convert.build_request
    monkeypatch.setattr(convert, "build_request", lambda *a, **kw: validated.append(a) or build(*a, **kw))
    data = request(2)
    assert request_from_proto(parser(data), SPEC).query.data.obj is data and not validated
    short = spec_from_settings(ModelSettings(embed_dim=32, num_heads=4, max_query_len=3))
    with pytest.raises(ServingError, match="max_query_len 3"):
        request_from_proto(parser(request(3)), short)
    assert len(validated) == 1
