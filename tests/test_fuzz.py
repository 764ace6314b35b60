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
from attnserve_server.edge.convert import request_from_proto
from attnserve_server.edge.payload import Received
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
