"""payload.split: a message with its tensor bytes cut out, and those bytes, are the message protobuf parses."""

from __future__ import annotations

import re

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.edge import kserve, payload
from attnserve_server.edge.convert import TENSOR_FIELDS as NATIVE_FIELDS
from attnserve_server.edge.framing import varint
from attnserve_server.protocol import open_inference_pb2 as v2

INPUTS = ("query", "key_value", "key", "value", "key_padding_mask", "key_lengths")
blobs = st.binary(max_size=300)


def _unknown_field(number: int, data: bytes) -> bytes:
    """A length-delimited field no attnserve message defines (protobuf keeps it as unknown)."""
    return varint(number << 3 | 2) + varint(len(data)) + data


@st.composite
def infer_request_parts(draw) -> list[bytes]:
    """A ModelInferRequest as separately serialized pieces: their concatenation in any order is one
    message (protobuf merges), so its fields come in any order, raw entries between the others."""
    parts = [v2.ModelInferRequest(model_name=draw(st.text(max_size=8)), id=draw(st.text(max_size=8)))]
    for _ in range(draw(st.integers(0, 3))):
        part = v2.ModelInferRequest()
        tensor = part.inputs.add(name=draw(st.sampled_from(INPUTS)), datatype="FP32")
        tensor.shape.extend(draw(st.lists(st.integers(0, 9), max_size=3)))
        if draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32, allow_nan=False), max_size=4)))
        parts.append(part)
    for _ in range(draw(st.integers(0, 4))):
        parts.append(v2.ModelInferRequest(raw_input_contents=[draw(blobs)]))
    if draw(st.booleans()):
        part = v2.ModelInferRequest()
        part.parameters["causal"].bool_param = draw(st.booleans())
        part.outputs.add(name="output")
        parts.append(part)
    wire = [p.SerializeToString() for p in parts]
    if draw(st.booleans()):
        wire.append(_unknown_field(draw(st.integers(100, 2000)), draw(blobs)))
    return draw(st.permutations(wire))


@st.composite
def attend_request_parts(draw) -> list[bytes]:
    """An AttendRequest as pieces in any order: each input's Tensor once, its data anywhere in it."""
    parts = [pb.AttendRequest(model=draw(st.text(max_size=8)), causal=draw(st.booleans())).SerializeToString()]
    for name in draw(st.lists(st.sampled_from(INPUTS), unique=True, max_size=4)):
        fields = [pb.Tensor(dtype=draw(st.integers(0, 6))), pb.Tensor(shape=draw(st.lists(st.integers(0, 9))))]
        if draw(st.booleans()):
            fields.append(pb.Tensor(data=draw(blobs)))
        inner = b"".join(draw(st.permutations([f.SerializeToString() for f in fields])))
        number = pb.AttendRequest.DESCRIPTOR.fields_by_name[name].number
        parts.append(varint(number << 3 | 2) + varint(len(inner)) + inner)
    parts.append(pb.AttendRequest(request_id=draw(st.text(max_size=8))).SerializeToString())
    return draw(st.permutations(parts))


@settings(max_examples=200, deadline=None)
@given(infer_request_parts())
def test_a_kserve_request_split_is_the_message_protobuf_parses(parts: list[bytes]) -> None:
    data = b"".join(parts)
    rest, views = payload.split(data, kserve.TENSOR_FIELDS)
    rebuilt = v2.ModelInferRequest.FromString(rest)
    assert not rebuilt.raw_input_contents  # every entry was cut out...
    rebuilt.raw_input_contents.extend(bytes(v) for v in views.get(kserve.RAW_INPUT_CONTENTS, []))
    assert rebuilt == v2.ModelInferRequest.FromString(data)  # ...and comes back in order
    for v in views.get(kserve.RAW_INPUT_CONTENTS, []):
        assert v.obj is data  # views of the received bytes, not copies


@settings(max_examples=200, deadline=None)
@given(attend_request_parts())
def test_a_native_request_split_is_the_message_protobuf_parses(parts: list[bytes]) -> None:
    data = b"".join(parts)
    rest, views = payload.split(data, NATIVE_FIELDS)
    rebuilt = pb.AttendRequest.FromString(rest)
    expected = pb.AttendRequest.FromString(data)
    for name in INPUTS:
        number = pb.AttendRequest.DESCRIPTOR.fields_by_name[name].number
        if number in views:
            assert getattr(rebuilt, name).data == b""
            getattr(rebuilt, name).data = bytes(views[number][0])
    assert rebuilt == expected
    assert [name for name in INPUTS if rebuilt.HasField(name)] == [name for name in INPUTS if expected.HasField(name)]


def _large_infer() -> bytes:
    msg = v2.ModelInferRequest(model_name="default", id="big")
    msg.inputs.add(name="query", datatype="FP32", shape=[1, 256, 256])
    msg.raw_input_contents.append(bytes(range(256)) * 1024)  # 256 KiB
    return msg.SerializeToString()


def test_a_large_message_parses_with_its_tensor_bytes_as_views_others_whole() -> None:
    data = _large_infer()
    assert len(data) >= payload.LARGE_MESSAGE_BYTES
    received = payload.parse(v2.ModelInferRequest, data, kserve.TENSOR_FIELDS)
    (view,) = received.views[kserve.RAW_INPUT_CONTENTS]
    assert view.obj is data and view == bytes(range(256)) * 1024
    assert received.message.inputs[0].name == "query" and not received.message.raw_input_contents

    typed = v2.ModelInferRequest(model_name="m")
    typed.inputs.add(name="query", datatype="FP32").contents.fp32_contents.extend([0.5] * (1 << 16))
    data = typed.SerializeToString()
    assert len(data) >= payload.LARGE_MESSAGE_BYTES
    assert payload.split(data, kserve.TENSOR_FIELDS)[0] is data  # nothing to cut: not copied either
    assert payload.parse(v2.ModelInferRequest, data, kserve.TENSOR_FIELDS).message == typed

    small = v2.ModelInferRequest(model_name="m", raw_input_contents=[b"\x01\x02"]).SerializeToString()
    received = payload.parse(v2.ModelInferRequest, small, kserve.TENSOR_FIELDS)
    assert received.views == {} and received.message.raw_input_contents == [b"\x01\x02"]


def _tensor_field(name: str, tensor: pb.Tensor) -> bytes:
    inner = tensor.SerializeToString()
    number = pb.AttendRequest.DESCRIPTOR.fields_by_name[name].number
    return varint(number << 3 | 2) + varint(len(inner)) + inner


@pytest.mark.parametrize(
    "data",
    [
        # a Tensor sent twice: protobuf merges the two (shapes appended, the last data kept)
        _tensor_field("query", pb.Tensor(shape=[1], data=b"a")) + _tensor_field("query", pb.Tensor(data=b"b")),
        # a Tensor whose length runs past the end of the message
        _tensor_field("query", pb.Tensor(data=b"abc"))[:-1],
        # the tensor field with a varint where bytes belong
        varint(3 << 3 | 0) + varint(5),
    ],
    ids=["tensor-twice", "truncated-tensor", "wrong-wire-type"],
)
def test_what_the_scanner_does_not_expect_is_left_to_protobuf(data: bytes) -> None:
    assert payload.split(data, NATIVE_FIELDS) is None
    big = _unknown_field(1000, bytes(payload.LARGE_MESSAGE_BYTES)) + data  # large enough to be scanned
    try:
        expected = pb.AttendRequest.FromString(big)
    except DecodeError:
        with pytest.raises(DecodeError):
            payload.parse(pb.AttendRequest, big, NATIVE_FIELDS)
    else:
        received = payload.parse(pb.AttendRequest, big, NATIVE_FIELDS)
        assert received.views == {} and received.message == expected


def _many_fields(count: int) -> bytes:
    return b"".join(varint(1 << 3 | 2) + varint(1) + b"m" for _ in range(count))  # `model`, sent again and again


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (varint(3 << 3 | 3) + varint(3 << 3 | 4), "query: a group (wire type 3); no request has one"),
        (_many_fields(payload.MAX_SCANNED_FIELDS + 1), "more than 256 fields in one message"),
        # a shape of 20,000 dimensions: protobuf would parse a 190 MB one for 3.7 s
        (_tensor_field("query", pb.Tensor(shape=[1] * 20000, data=b"abcd")), "query: a tensor with 19.5 KiB besides"),
        (_tensor_field("key", pb.Tensor(shape=[1] * 20000)), "key: a tensor with 19.5 KiB besides its data"),
        # after something that would leave the message to protobuf, the rest is still checked
        (varint(3 << 3 | 0) + varint(5) + _tensor_field("value", pb.Tensor(shape=[1] * 20000)), "value: a tensor"),
        (_tensor_field("query", pb.Tensor(data=b"a")) * 2 + _many_fields(300), "more than 256 fields"),
    ],
    ids=["group", "too-many-fields", "long-shape", "long-shape-no-data", "after-wrong-wire-type", "after-twice"],
)
def test_what_no_request_can_be_is_refused_unparsed(data: bytes, says: str) -> None:
    pb.AttendRequest.FromString(data)  # protobuf would parse it all (a group as an unknown field)
    with pytest.raises(payload.Refused):  # its field by number: split does not know the message's type
        payload.split(data, NATIVE_FIELDS)
    with pytest.raises(DecodeError, match=re.escape(says)):
        payload.Parser(pb.AttendRequest, NATIVE_FIELDS, "request_id")(data)
    fits = _many_fields(payload.MAX_SCANNED_FIELDS) + _tensor_field("query", pb.Tensor(shape=[1] * 8, data=b"a"))
    assert payload.split(fits[len(_many_fields(1)) :], NATIVE_FIELDS) is not None


def test_data_twice_in_one_tensor_is_left_to_protobuf() -> None:
    inner = pb.Tensor(data=b"first").SerializeToString() + pb.Tensor(data=b"last").SerializeToString()
    data = varint(3 << 3 | 2) + varint(len(inner)) + inner
    assert payload.split(data, NATIVE_FIELDS) is None
    assert pb.AttendRequest.FromString(data).query.data == b"last"


@pytest.mark.parametrize("cut", [1, 2, 3, 10])
def test_a_truncated_large_message_is_undecodable_as_protobuf_says(cut: int) -> None:
    data = _large_infer()[:-cut]
    assert payload.split(data, kserve.TENSOR_FIELDS) is None
    with pytest.raises(DecodeError):
        payload.parse(v2.ModelInferRequest, data, kserve.TENSOR_FIELDS)


# -- payload.Parser: heads seen before are not parsed again ---------------------------------------

RAW = kserve.RAW_INPUT_CONTENTS


def _rebuilt(received: payload.Received) -> v2.ModelInferRequest:
    """The message a Received stands for: its message with the views put back as its entries."""
    msg = v2.ModelInferRequest()
    msg.CopyFrom(received.message)
    msg.raw_input_contents.extend(bytes(v) for v in received.views.get(RAW, []))
    return msg


# Request ids: none, short, long enough for a two-byte length, not ASCII, and bytes that are not UTF-8.
IDS = [b"", b"a", b"bb", b"x" * 130, "é".encode(), b"\xff\xfe"]


def _head(n: int, request_id: bytes = b"") -> bytes:
    """A request's fields but its tensors', its id among them (written by hand: it may not be UTF-8)."""
    msg = v2.ModelInferRequest(model_name="default", model_version="1")
    msg.inputs.add(name="query", datatype="FP32", shape=[1, n, 4])
    head = msg.SerializeToString()
    cut = len(v2.ModelInferRequest(model_name="default", model_version="1").SerializeToString())
    request_field = varint(3 << 3 | 2) + varint(len(request_id)) + request_id if request_id else b""
    return head[:cut] + request_field + head[cut:]  # in field order: model_name, model_version, id, inputs


@st.composite
def message_streams(draw) -> list[bytes]:
    """Requests from a few heads and entry lengths (so one Parser sees heads repeat, a head with
    other lengths, other heads of the same size), some with fields out of order, some cut short."""
    stream = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.integers(0, 5)) == 0:
            data = b"".join(draw(infer_request_parts()))
        else:
            lengths = draw(st.lists(st.sampled_from([0, 1, 3, 5, 130]), max_size=3))
            entries = [bytes([draw(st.integers(0, 255))]) * n for n in lengths]
            head = _head(draw(st.integers(1, 3)), draw(st.sampled_from(IDS)))
            data = head + v2.ModelInferRequest(raw_input_contents=entries).SerializeToString()
        if draw(st.integers(0, 7)) == 0:
            data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
        stream.append(data)
    return stream


@settings(max_examples=300, deadline=None)
@given(message_streams(), st.integers(1, 3), st.integers(0, 3), st.sampled_from([None, "id"]))
def test_a_parser_returns_the_message_protobuf_parses_whatever_it_saw_before(
    stream: list[bytes], capacity: int, back_off: int, request_id: str | None
) -> None:
    parser = payload.Parser(
        v2.ModelInferRequest, kserve.TENSOR_FIELDS, request_id, capacity=capacity, back_off=back_off
    )
    for data in stream:
        _parses_as_protobuf(parser, v2.ModelInferRequest, data, _rebuilt)


def _parses_as_protobuf(parser: payload.Parser, cls, data: bytes, rebuilt) -> None:
    """The parser answers `data` as protobuf does: the same message (`rebuilt` from what it returns,
    its tensor bytes views of `data`), or the same refusal."""
    try:
        expected = cls.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            parser(data)
        return
    received = parser(data)
    assert rebuilt(received) == expected
    assert all(v.obj is data for entries in received.views.values() for v in entries)


def test_a_repeated_head_is_parsed_once_and_other_lengths_are_not_mistaken_for_it() -> None:
    parser = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS)
    head = _head(3)
    first = parser(head + v2.ModelInferRequest(raw_input_contents=[b"a" * 3, b"b" * 5]).SerializeToString())
    data = head + v2.ModelInferRequest(raw_input_contents=[b"c" * 3, b"d" * 5]).SerializeToString()
    again = parser(data)
    assert again.repeat is first.repeat and again.message is first.message  # not parsed again
    assert first.repeat.match(data + b"\0") is None and first.repeat.match(data[:-1]) is None
    assert [bytes(v) for v in again.views[RAW]] == [b"c" * 3, b"d" * 5] and again.views[RAW][0].obj is data
    swapped = parser(head + v2.ModelInferRequest(raw_input_contents=[b"e" * 5, b"f" * 3]).SerializeToString())
    assert swapped.repeat is not first.repeat  # the same size, other lengths: a head of its own
    assert [bytes(v) for v in swapped.views[RAW]] == [b"e" * 5, b"f" * 3]

    native = payload.Parser(pb.AttendRequest, NATIVE_FIELDS)  # the native API's tensors, inside its Tensors

    def attend(data: bytes) -> bytes:
        return pb.AttendRequest(model="m", query=pb.Tensor(shape=[1], data=data), causal=True).SerializeToString()

    first = native(attend(b"abcd"))
    data = attend(b"wxyz")
    again = native(data)
    assert again.repeat is first.repeat and again.views == {3: [b"wxyz"]} and again.views[3][0].obj is data
    assert again.message.causal and not again.message.query.data


def _native_rebuilt(received: payload.Received) -> pb.AttendRequest:
    msg = pb.AttendRequest()
    msg.CopyFrom(received.message)
    for number, (view,) in received.views.items():
        getattr(msg, pb.AttendRequest.DESCRIPTOR.fields_by_number[number].name).data = bytes(view)
    return msg


@settings(max_examples=200, deadline=None)
@given(st.lists(attend_request_parts(), min_size=1, max_size=6), st.data())
def test_a_native_parser_returns_the_message_protobuf_parses_whatever_it_saw_before(streams, data) -> None:
    """Each message, then the same with other tensor bytes of the same lengths: a repeated head."""
    parser = payload.Parser(pb.AttendRequest, NATIVE_FIELDS, "request_id", capacity=2, back_off=1)
    request_id = pb.AttendRequest.DESCRIPTOR.fields_by_name["request_id"].number
    for parts in streams:
        wire = b"".join(parts)
        variants = [wire]
        cut = payload._cut(wire, NATIVE_FIELDS, request_id)
        if cut is not None:  # the same bytes but for the tensors', and then another id
            other = bytearray(wire)
            for _, start, end in cut[1]:
                other[start:end] = data.draw(st.binary(min_size=end - start, max_size=end - start))
            variants.append(bytes(other))
            if cut[2] is not None:
                at, _, end = cut[2]
                own = data.draw(st.sampled_from(IDS))
                variants.append(bytes(other[:at]) + varint(len(own)) + own + bytes(other[end:]))
        for message in variants:
            _parses_as_protobuf(parser, pb.AttendRequest, message, _native_rebuilt)


def test_a_parser_stops_remembering_heads_that_never_repeat_for_a_while() -> None:
    parser = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS, capacity=2, back_off=3)

    def request(request_id: str) -> bytes:
        return v2.ModelInferRequest(model_name="m", id=request_id, raw_input_contents=[b"abc"]).SerializeToString()

    assert parser(request("a")).repeat is not None and parser(request("b")).repeat is not None
    assert parser(request("c")).repeat is not None  # "a" forgotten unused (two heads at most)...
    assert parser(request("d")).repeat is not None  # ...and "b": two in a row...
    assert [parser(request(i)).repeat for i in "efg"] == [None] * 3  # ...so three are parsed plainly
    first = parser(request("h"))
    assert first.repeat is not None and parser(request("h")).repeat is first.repeat  # and it tries again


def test_a_head_whose_parameters_come_in_either_order_is_remembered_both_ways() -> None:
    """C++ and Go protobuf serialize a map in no fixed order: perf_analyzer sent its two parameters
    (causal and its own triton_enable_empty_final_response) in either order, request by request."""
    parser = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS)

    def parameter(name: str) -> bytes:
        msg = v2.ModelInferRequest()
        msg.parameters[name].bool_param = True
        return msg.SerializeToString()

    def request(names: tuple[str, str], fill: bytes) -> bytes:
        contents = v2.ModelInferRequest(raw_input_contents=[fill * 48]).SerializeToString()
        return _head(3) + parameter(names[0]) + parameter(names[1]) + contents

    orders = [("causal", "triton_enable_empty_final_response"), ("triton_enable_empty_final_response", "causal")]
    first = [parser(request(order, b"a")) for order in orders]
    assert len(request(orders[0], b"a")) == len(request(orders[1], b"a"))  # one length, two heads
    for i in range(6):
        data = request(orders[i % 2], bytes([i]))
        got = parser(data)
        assert got.repeat is first[i % 2].repeat and got.message is first[i % 2].message  # not parsed again
        assert _rebuilt(got) == v2.ModelInferRequest.FromString(data)
    assert first[0].repeat.hits == first[1].repeat.hits == 3

    few = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS)  # past HEADS_PER_LENGTH heads of one length
    names = [(f"p{i}", "causal") for i in range(payload.HEADS_PER_LENGTH + 1)]
    heads = [few(request(pair, b"x")).repeat for pair in names]
    assert few(request(names[1], b"y")).repeat is heads[1]  # still kept
    assert few(request(names[0], b"y")).repeat is not heads[0]  # the oldest of that length, forgotten


def test_requests_with_their_own_ids_share_a_head_and_keep_their_ids() -> None:
    parser = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS, "id")

    def request(request_id: bytes, fill: bytes) -> bytes:
        return _head(3, request_id) + v2.ModelInferRequest(raw_input_contents=[fill * 5]).SerializeToString()

    first = parser(request(b"a", b"1"))
    for request_id in (b"b", b"x" * 130, b"a"):  # other values, other lengths, a two-byte length
        data = request(request_id, b"2")
        got = parser(data)
        assert got.repeat is first.repeat and got.message.id == request_id.decode()
        assert got.views[RAW] == [b"2" * 5] and got.views[RAW][0].obj is data
    assert first.message.id == "a"  # the head's own message is never changed
    assert parser(request(b"", b"2")).repeat is not first.repeat  # no id at all: a head of its own
    assert parser(request(b"a", b"3")).message is first.message  # its own id: the shared message
    with pytest.raises(DecodeError):  # an id protobuf refuses is refused as protobuf refuses it
        parser(request(b"\xff", b"4"))


def test_a_large_head_is_parsed_but_not_remembered() -> None:
    """Typed contents beside a raw entry: the head itself is large; keeping it would pin it."""
    parser = payload.Parser(v2.ModelInferRequest, kserve.TENSOR_FIELDS)
    msg = v2.ModelInferRequest(model_name="m", raw_input_contents=[b"abc"])
    msg.inputs.add(name="key_value", datatype="FP32").contents.fp32_contents.extend([0.5] * 8192)  # 32 KiB
    data = msg.SerializeToString()
    for _ in range(2):
        received = parser(data)
        assert received.repeat is None and _rebuilt(received) == msg
        assert received.views[RAW][0].obj is data


def test_an_inputs_typed_varints_are_bounded_and_its_floats_are_not() -> None:
    def infer(**contents) -> bytes:
        msg = v2.ModelInferRequest(model_name="m")
        msg.inputs.add(name="key_padding_mask", datatype="BOOL", contents=contents)
        return msg.SerializeToString()

    most = payload.MAX_SLOW_BYTES
    # bool_contents packs one byte an element; 2 to 4 bytes of key and length precede them in the field
    fits = infer(bool_contents=[True] * (most - 8))
    assert payload.split(fits, kserve.TENSOR_FIELDS) is not None
    with pytest.raises(payload.Refused, match="of typed bool or integer contents, where an input takes at most"):
        payload.split(infer(bool_contents=[True] * most), kserve.TENSOR_FIELDS)
    with pytest.raises(payload.Refused):  # two kinds, counted together
        payload.split(infer(bool_contents=[True] * (most // 2), int_contents=[1] * (most // 2)), kserve.TENSOR_FIELDS)
    floats = infer(fp32_contents=[1.0] * most)  # four times the bytes, parsed as one copy
    assert payload.split(floats, kserve.TENSOR_FIELDS) is not None
