"""The request/response codec shared by the sync and asyncio clients: numpy <-> protobuf."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnserve._errors import AttnServeError, status_code_from_number
from attnserve._types import AttendResult, ModelInfo, Request, Timing
from attnserve.v1 import attention_pb2 as pb

# numpy dtype name -> wire dtype. "bfloat16" is ml_dtypes' name, if the caller uses it.
_WIRE_DTYPE = {
    "float32": pb.DATA_TYPE_FP32,
    "float16": pb.DATA_TYPE_FP16,
    "bfloat16": pb.DATA_TYPE_BF16,
    "bool": pb.DATA_TYPE_BOOL,
    "int32": pb.DATA_TYPE_INT32,
    "int64": pb.DATA_TYPE_INT64,
}
# wire dtype -> numpy dtype of the raw elements (BF16 travels as its 16 bits).
_RAW_NUMPY = {
    pb.DATA_TYPE_FP32: np.dtype("<f4"),
    pb.DATA_TYPE_FP16: np.dtype("<f2"),
    pb.DATA_TYPE_BF16: np.dtype("<u2"),
    pb.DATA_TYPE_BOOL: np.dtype("?"),
    pb.DATA_TYPE_INT32: np.dtype("<i4"),
    pb.DATA_TYPE_INT64: np.dtype("<i8"),
}
_CAST_TARGETS = ("float32", "float16", "bfloat16")


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Rounds float32 to bfloat16 (nearest, ties to even) and returns the 16-bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return np.where(np.isnan(values), np.uint32(0x7FC0), rounded).astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_tensor(array: Any, name: str, cast: str | None = None) -> pb.Tensor:
    """numpy array (or nested lists) -> Tensor; `cast` converts float arrays first."""
    tensor = pb.Tensor()
    fill_tensor(tensor, array, name, cast)
    return tensor


def fill_tensor(tensor: pb.Tensor, array: Any, name: str, cast: str | None = None) -> None:
    """Writes an array into a message's Tensor field in place: a Tensor built apart and then set or
    copied into its request costs one more copy of its bytes (2 ms of a WL request's 4.4 ms to encode)."""
    arr = np.asarray(array)
    kind = arr.dtype.name
    if cast is not None and arr.dtype.kind == "f":
        if cast not in _CAST_TARGETS:
            raise ValueError(f"dtype must be one of {_CAST_TARGETS}, got {cast!r}")
        if cast == "bfloat16":
            bits = arr.view(np.uint16) if kind == "bfloat16" else float32_to_bfloat16_bits(arr)
            _set(tensor, pb.DATA_TYPE_BF16, arr.shape, bits.tobytes())
            return
        if kind != cast:
            src = bfloat16_bits_to_float32(arr.view(np.uint16)) if kind == "bfloat16" else arr
            arr = src.astype(cast)
            kind = cast
    if kind not in _WIRE_DTYPE:
        hint = ""
        if arr.dtype.kind == "f":  # float64 is numpy's default; every model takes a narrower float
            hint = f" (pass dtype='float32', or the model's dtype, to cast it: {name}.astype(np.float32))"
        raise ValueError(f"{name}: unsupported dtype {arr.dtype}; use one of {sorted(_WIRE_DTYPE)}{hint}")
    wire = _WIRE_DTYPE[kind]
    raw = arr.view(np.uint16) if kind == "bfloat16" else arr.astype(_RAW_NUMPY[wire], copy=False)
    _set(tensor, wire, arr.shape, np.ascontiguousarray(raw).tobytes())


def _set(tensor: pb.Tensor, dtype: int, shape: tuple[int, ...], data: bytes) -> None:
    tensor.dtype = dtype  # type: ignore[assignment]
    del tensor.shape[:]
    tensor.shape.extend(shape)
    tensor.data = data


def decode_tensor(tensor: pb.Tensor, name: str = "tensor") -> np.ndarray:
    """Tensor -> numpy array (a read-only view of the message bytes; BF16 widened to float32)."""
    raw_dtype = _RAW_NUMPY.get(tensor.dtype)
    if raw_dtype is None:
        raise ValueError(f"{name}: unknown dtype {tensor.dtype}")
    shape = tuple(tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * raw_dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"{name}: expected {expected} bytes for shape {list(shape)}, got {len(tensor.data)}")
    arr = np.frombuffer(tensor.data, dtype=raw_dtype).reshape(shape)
    if tensor.dtype == pb.DATA_TYPE_BF16:
        return bfloat16_bits_to_float32(arr)
    return arr


def as_request(spec: Request | Mapping[str, Any]) -> Request:
    return spec if isinstance(spec, Request) else Request(**spec)


def encode_stream_request(index: int, spec: Request | Mapping[str, Any]) -> pb.AttendRequest:
    """The stream's `index`-th request. Answers come back as they complete, so each needs an id to be
    matched: one without gets its index."""
    msg = encode_request(as_request(spec))
    if not msg.request_id:
        msg.request_id = str(index)
    return msg


def _checked_fields(req: Request) -> None:
    """The plain fields' types, named: protobuf's own complaint names neither field nor type."""
    for name in ("model", "request_id"):
        value = getattr(req, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name}: expected a str, got {type(value).__name__} {value!r}")
    for name in ("causal", "need_weights", "average_weights"):
        value = getattr(req, name)
        if not isinstance(value, (bool, int, np.bool_, np.integer)):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def key_padding_mask(value: Any) -> np.ndarray:
    """The mask as booleans, True where a key is ignored (torch's boolean form). torch's float form is
    added to the scores; 0 and -inf, the boolean mask it stands for, are taken as such. Any other
    float (an additive bias) and integers are refused: 0/1 integers are ambiguous (a Hugging Face
    attention_mask is 1 where a key is seen, the opposite)."""
    arr = np.asarray(value)
    if arr.dtype.kind == "b":
        return arr
    if arr.dtype.kind == "f":
        hidden = np.isneginf(arr)
        other = ~hidden & (arr != 0)
        if not other.any():
            return hidden
        example = arr[other].flat[0].item()
        raise ValueError(
            "key_padding_mask: expected booleans (True: that key is ignored) or torch's float form of them "
            f"(0 or -inf), got {arr.dtype} values such as {example!r}: an additive bias is not supported"
        )
    hint = ""
    if arr.dtype.kind in "iu":
        hint = " (a Hugging Face attention_mask, 1 where a key is seen, is `attention_mask == 0` here)"
    raise ValueError(
        f"key_padding_mask: expected booleans (True: that key is ignored, as in torch), got {arr.dtype}{hint}"
    )


def key_lengths(value: Any) -> np.ndarray:
    """The lengths as int64, refusing what would change in the conversion (fractions, out of range)."""
    arr = np.asarray(value)
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"key_lengths: expected integers, got {arr.dtype} {arr.flat[0].item()!r}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"key_lengths: expected lengths below 2**63, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def encode_request(req: Request) -> pb.AttendRequest:
    _checked_fields(req)
    msg = pb.AttendRequest(
        model=req.model,
        request_id=req.request_id,
        causal=req.causal,
        need_weights=req.need_weights,
        # The server rejects average_weights without need_weights; torch's default is
        # True, so the client only sends it when weights are asked for.
        average_weights=req.need_weights and req.average_weights,
    )
    fill_tensor(msg.query, req.query, "query", req.dtype)  # in place: one copy of the bytes fewer
    for field_name in ("key_value", "key", "value"):
        value = getattr(req, field_name)
        if value is not None:
            fill_tensor(getattr(msg, field_name), value, field_name, req.dtype)
    if req.key_padding_mask is not None:
        fill_tensor(msg.key_padding_mask, key_padding_mask(req.key_padding_mask), "key_padding_mask")
    if req.key_lengths is not None:
        fill_tensor(msg.key_lengths, key_lengths(req.key_lengths), "key_lengths")
    return msg


def _timing(msg: pb.Timing) -> Timing:
    return Timing(
        queue_s=msg.queue_ns * 1e-9,
        compute_s=msg.compute_ns * 1e-9,
        server_s=msg.server_ns * 1e-9,
        batch_size=msg.batch_size,
        batch_sequences=msg.batch_sequences,
    )


def decode_response(msg: pb.AttendResponse) -> AttendResult:
    if msg.HasField("error") and msg.error.code != 0:
        error = AttnServeError(status_code_from_number(msg.error.code), msg.error.message, msg.request_id)
        return AttendResult(output=None, request_id=msg.request_id, model=msg.model, error=error)
    weights = decode_tensor(msg.attention_weights, "attention_weights") if msg.HasField("attention_weights") else None
    return AttendResult(
        output=decode_tensor(msg.output, "output"),
        attention_weights=weights,
        request_id=msg.request_id,
        model=msg.model,
        timing=_timing(msg.timing),
    )


_DTYPE_NAME = {
    pb.DATA_TYPE_FP32: "float32",
    pb.DATA_TYPE_FP16: "float16",
    pb.DATA_TYPE_BF16: "bfloat16",
}


def decode_model(msg: pb.ModelMetadata) -> ModelInfo:
    return ModelInfo(
        name=msg.name,
        kind=pb.ModelKind.Name(msg.kind).removeprefix("MODEL_KIND_").lower(),
        embed_dim=msg.embed_dim,
        num_heads=msg.num_heads,
        kdim=msg.kdim,
        vdim=msg.vdim,
        output_dim=msg.output_dim,
        bias=msg.bias,
        dtype=_DTYPE_NAME.get(msg.dtype, "unspecified"),
        devices=tuple(msg.devices),
        max_batch_size=msg.batching.max_batch_size,
        max_batch_tokens=msg.batching.max_batch_tokens,
        max_queue_delay_ms=msg.batching.max_queue_delay_ms,
        max_queue_size=msg.batching.max_queue_size,
        max_query_len=msg.max_query_len,
        max_key_len=msg.max_key_len,
        ready=msg.ready,
        inputs=tuple(msg.inputs),
    )
