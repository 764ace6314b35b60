"""The client's codec: numpy <-> protobuf tensors and requests, without a server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnserve import Request, decode_tensor, encode_tensor
from attnserve._codec import (
    bfloat16_bits_to_float32,
    decode_response,
    encode_request,
    float32_to_bfloat16_bits,
)
from attnserve.v1 import attention_pb2 as pb


@pytest.mark.parametrize(
    ("array", "wire"),
    [
        (np.arange(12, dtype=np.float32).reshape(3, 4), pb.DATA_TYPE_FP32),
        (np.arange(6, dtype=np.float16).reshape(2, 3), pb.DATA_TYPE_FP16),
        (np.array([[True, False, True]]), pb.DATA_TYPE_BOOL),
        (np.array([1, -2, 3], dtype=np.int32), pb.DATA_TYPE_INT32),
        (np.array([2**40, -1], dtype=np.int64), pb.DATA_TYPE_INT64),
    ],
)
def test_tensors_round_trip_with_dtype_shape_and_little_endian_bytes(array: np.ndarray, wire: int) -> None:
    t = encode_tensor(array, "x")
    assert t.dtype == wire
    assert list(t.shape) == list(array.shape)
    assert t.data == array.astype(array.dtype.newbyteorder("<")).tobytes()
    np.testing.assert_array_equal(decode_tensor(t), array)


def test_big_endian_input_is_sent_little_endian() -> None:
    array = np.arange(4, dtype=">f4")
    t = encode_tensor(array, "x")
    np.testing.assert_array_equal(np.frombuffer(t.data, "<f4"), array)


def test_bfloat16_rounds_like_torch_and_decodes_exactly() -> None:
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    values[:4] = [0.0, -0.0, np.inf, -np.inf]
    bits = float32_to_bfloat16_bits(values)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, expected)
    t = encode_tensor(values, "x", cast="bfloat16")
    assert t.dtype == pb.DATA_TYPE_BF16 and len(t.data) == 2 * values.size
    np.testing.assert_array_equal(decode_tensor(t), bfloat16_bits_to_float32(expected))
    assert np.isnan(bfloat16_bits_to_float32(float32_to_bfloat16_bits(np.array([np.nan], np.float32))))[0]


def test_cast_to_float16() -> None:
    t = encode_tensor(np.ones((2, 2)), "x", cast="float16")
    assert t.dtype == pb.DATA_TYPE_FP16
    np.testing.assert_array_equal(decode_tensor(t), np.ones((2, 2), np.float16))


def test_unsupported_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="query: unsupported dtype complex64"):
        encode_tensor(np.zeros(2, np.complex64), "query")


def test_decode_rejects_a_wrong_byte_length() -> None:
    t = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[2, 2], data=b"\0" * 12)
    with pytest.raises(ValueError, match="expected 16 bytes for shape \\[2, 2\\], got 12"):
        decode_tensor(t, "output")


def test_request_encoding_sends_average_weights_only_with_need_weights() -> None:
    q = np.zeros((3, 4), np.float32)
    assert encode_request(Request(query=q)).average_weights is False
    msg = encode_request(Request(query=q, need_weights=True, key_lengths=[2], causal=True, request_id="r1"))
    assert msg.average_weights and msg.need_weights and msg.causal and msg.request_id == "r1"
    assert msg.key_lengths.dtype == pb.DATA_TYPE_INT64 and not msg.HasField("key_padding_mask")


def test_masks_and_lengths_that_would_change_in_conversion_are_refused_naming_the_field() -> None:
    # Before, np.asarray(..., dtype=bool) and (..., dtype=np.int64) took them silently: a float mask of
    # 0.5 (torch: add 0.5 to the scores) hid its key, a 0/1 integer mask (1 = seen, Hugging Face's sense)
    # hid the keys meant to be seen, and a length of 2.5 became 2.
    q = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"key_padding_mask: .* got float32 values such as 0\.5: an additive bias"):
        encode_request(Request(query=q, key_padding_mask=np.array([0, 0.5, 0], np.float32)))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected booleans .* got int64 .*attention_mask == 0"):
        encode_request(Request(query=q, key_padding_mask=np.array([0, 1, 1])))
    with pytest.raises(ValueError, match=r"key_lengths: expected integers, got float64 2\.5"):
        encode_request(Request(query=q, key_lengths=[2.5]))
    with pytest.raises(ValueError, match="key_lengths: expected lengths below 2\\*\\*63"):
        encode_request(Request(query=q, key_lengths=np.array([2**64 - 1], np.uint64)))
    with pytest.raises(TypeError, match="request_id: expected a str, got int 5"):
        encode_request(Request(query=q, request_id=5))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="causal: expected a bool, got str 'yes'"):
        encode_request(Request(query=q, causal="yes"))  # type: ignore[arg-type]
    # torch's float form of a boolean mask, and booleans as lists, are taken
    msg = encode_request(Request(query=q, key_padding_mask=[0, -np.inf, 0], key_lengths=np.array([2], np.uint8)))
    assert decode_tensor(msg.key_padding_mask).tolist() == [False, True, False]
    assert decode_tensor(msg.key_lengths).tolist() == [2] and msg.key_lengths.dtype == pb.DATA_TYPE_INT64
    listed = encode_request(Request(query=q, key_padding_mask=[True, False])).key_padding_mask
    assert decode_tensor(listed).dtype == bool


def test_in_band_stream_errors_decode_to_an_error_result() -> None:
    msg = pb.AttendResponse(request_id="7", error=pb.Status(code=3, message="query.shape: bad"))
    result = decode_response(msg)
    assert result.output is None and result.request_id == "7"
    assert result.error is not None and result.error.code.name == "INVALID_ARGUMENT"
    with pytest.raises(type(result.error)):
        result.raise_for_error()


def test_a_request_carries_each_tensor_as_encode_tensor_writes_it() -> None:
    """encode_request fills its tensor fields in place (one copy fewer): the same bytes as built apart."""
    rng = np.random.default_rng(0)
    query, key = rng.standard_normal((2, 5, 8), dtype=np.float32), rng.standard_normal((2, 3, 8), dtype=np.float32)
    mask = np.array([[False, False, True], [False, True, True]])
    msg = encode_request(Request(query=query, key_value=key, key_padding_mask=mask, dtype="bfloat16"))
    assert msg.query == encode_tensor(query, "query", "bfloat16")
    assert msg.key_value == encode_tensor(key, "key_value", "bfloat16")
    assert msg.key_padding_mask == encode_tensor(mask, "key_padding_mask")
    assert not msg.HasField("key") and not msg.HasField("key_lengths")
    assert list(msg.query.shape) == [2, 5, 8] and msg.query.dtype == pb.DATA_TYPE_BF16
