"""framing.Frame: the wire bytes it joins parse to the message protobuf would have built."""

from __future__ import annotations

import numpy as np
import pytest

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.edge.framing import Frame, varint
from attnserve_server.protocol import open_inference_pb2 as v2


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**31 - 1, 2**40 + 5])
def test_varint_matches_protobuf(value):
    # a uint64 field's encoding is its key (field 1, varint: 0x08) and the value's varint
    msg = v2.InferParameter(uint64_param=value)
    key = msg.SerializeToString()[:1]
    assert key + varint(value) == msg.SerializeToString()


def _payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(n).astype("<f4").tobytes()


def _expected_infer(output: bytes, weights: bytes | None) -> v2.ModelInferResponse:
    response = v2.ModelInferResponse(model_name="m", model_version="1", id="req-7")
    response.parameters["queue_ns"].int64_param = 1234
    response.outputs.add(name="output", datatype="FP32", shape=[1, 64, 256])
    if weights is not None:
        response.outputs.add(name="attention_weights", datatype="FP32", shape=[1, 1, 64, 64])
    return response


@pytest.mark.parametrize("with_weights", [False, True])
def test_infer_response_frame_parses_as_protobufs_own(with_weights):
    output = _payload(64 * 256, 0)  # 64 KiB: a length of three varint bytes
    weights = _payload(64 * 64, 1) if with_weights else None
    head = _expected_infer(output, weights)
    field = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
    frame = Frame(head.SerializeToString()).add_bytes(field, output)
    if weights is not None:
        frame.add_bytes(field, memoryview(weights))  # any buffer, uncopied
    expected = _expected_infer(output, weights)
    expected.raw_output_contents.append(output)
    if weights is not None:
        expected.raw_output_contents.append(weights)
    data = frame.join()
    assert frame.size == len(data)
    assert v2.ModelInferResponse.FromString(data) == expected
    # raw_output_contents is the message's last field: the bytes are protobuf's own, byte for byte
    assert data == expected.SerializeToString()


def test_nested_frames_parse_as_protobufs_own():
    """A stream's response holds the infer response as a nested message; the native response holds
    tensors, each with its bytes in `data`."""
    output = _payload(300, 2)
    infer_field = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
    inner = Frame(v2.ModelInferResponse(id="a").SerializeToString()).add_bytes(infer_field, output)
    stream_field = v2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number
    outer = Frame().add_message(stream_field, inner)
    parsed = v2.ModelStreamInferResponse.FromString(outer.join())
    assert parsed.infer_response.id == "a" and parsed.infer_response.raw_output_contents == [output]
    assert not parsed.error_message and outer.size == len(outer.join())

    data_field = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
    tensor = Frame(pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[75, 1]).SerializeToString()).add_bytes(data_field, output)
    head = pb.AttendResponse(model="m", request_id="r", timing=pb.Timing(queue_ns=5, batch_size=2))
    native = Frame(head.SerializeToString()).add_message(
        pb.AttendResponse.DESCRIPTOR.fields_by_name["output"].number, tensor
    )
    expected = pb.AttendResponse()
    expected.CopyFrom(head)
    expected.output.CopyFrom(pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[75, 1], data=output))
    assert pb.AttendResponse.FromString(native.join()) == expected


def test_empty_payload():
    field = v2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
    data = Frame().add_bytes(field, b"").join()
    assert v2.ModelInferResponse.FromString(data).raw_output_contents == [b""]


@pytest.mark.parametrize("request_id", ["", "req-7"])
@pytest.mark.parametrize("weights_shape", [None, (2, 64, 48), (2, 8, 64, 48)])
def test_kserves_framed_response_parses_as_the_message_protobuf_builds(request_id, weights_shape):
    """kserve.encode: a response framed with its tensors uncopied parses as protobuf would build it."""
    from attnserve_server.domain import Answer
    from attnserve_server.edge import kserve
    from attnserve_server.model import spec_from_settings
    from attnserve_server.settings import ModelSettings

    spec = spec_from_settings(ModelSettings(name="m", device=("cpu",)))
    output = _payload(2 * 64 * 256, 0)
    weights = None if weights_shape is None else _payload(int(np.prod(weights_shape)), 1)
    answer = Answer(output, (2, 64, 256), weights, weights_shape, None)  # type: ignore[arg-type]
    names = ("attention_weights", "output") if weights_shape else ("output",)  # the order the client asked for
    decoded = kserve.Decoded(None, names, False, None)  # type: ignore[arg-type]
    timing = {"queue_ns": 0, "compute_ns": 2**40 + 5, "batch_size": 3, "odd": -5}
    msg = v2.ModelInferRequest(model_name="m", id=request_id)

    expected = v2.ModelInferResponse(model_name="m", model_version="1", id=request_id)
    for key, value in timing.items():
        expected.parameters[key].int64_param = value
    for name in names:
        if name == "output":
            expected.outputs.add(name=name, datatype="FP32", shape=[2, 64, 256])
            expected.raw_output_contents.append(output)
        else:
            shape = weights_shape if len(weights_shape) == 4 else (2, 1, 64, 48)  # averaged: one head
            expected.outputs.add(name=name, datatype="FP32", shape=shape)
            expected.raw_output_contents.append(weights)
    frame = kserve.encode(spec, msg, decoded, answer, timing)
    assert isinstance(frame, Frame)
    assert v2.ModelInferResponse.FromString(frame.join()) == expected


def test_take_gives_the_bytes_and_lets_go_of_the_parts_while_the_frame_lives_on() -> None:
    # gRPC keeps a unary call's response until its bytes have left: a frame that kept its parts kept every
    # answer's tensors alive beside their joined copy for as long as a slow client took to read it.
    import gc
    import weakref

    tensor = np.arange(4096, dtype=np.float32)
    alive = weakref.ref(tensor)
    frame = Frame(b"\x0a\x01x").add_bytes(5, memoryview(tensor).cast("B"))
    expected = frame.join()
    del tensor
    gc.collect()
    assert alive() is not None  # the frame holds it
    assert frame.take() == expected
    gc.collect()
    assert alive() is None and frame.size == len(expected)
