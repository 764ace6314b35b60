"""Protobuf <-> domain conversion. Every rule a request breaks becomes INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from attnserve.v1 import attention_pb2 as pb
from attnserve_server.domain import AttentionRequest, ModelKind, ModelSpec
from attnserve_server.errors import InvalidArgument

_TORCH_DTYPE = {
    pb.DATA_TYPE_FP32: torch.float32,
    pb.DATA_TYPE_FP16: torch.float16,
    pb.DATA_TYPE_BF16: torch.bfloat16,
    pb.DATA_TYPE_BOOL: torch.bool,
    pb.DATA_TYPE_INT32: torch.int32,
    pb.DATA_TYPE_INT64: torch.int64,
}
_WIRE_DTYPE = {v: k for k, v in _TORCH_DTYPE.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _TORCH_DTYPE.items()}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LENGTH_DTYPES = (pb.DATA_TYPE_INT32, pb.DATA_TYPE_INT64)

# torch.frombuffer warns, once per process, that message bytes are read-only. Requests never
# write to their tensors (the worker copies them into its batch), so spend that warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0\0\0", dtype=torch.float32)


def dtype_name(wire: int) -> str:
    return pb.DataType.Name(wire).removeprefix("DATA_TYPE_") if wire in pb.DataType.values() else f"<{wire}>"


def wire_dtype(dtype: torch.dtype) -> int:
    return _WIRE_DTYPE[dtype]


def _decode(tensor: pb.Tensor, name: str, allowed: tuple[int, ...], ranks: tuple[int, ...], why: str) -> torch.Tensor:
    """Checks dtype, rank, dims and byte length, then views the bytes as a tensor (no copy)."""
    if tensor.dtype not in allowed:
        expected = " or ".join(dtype_name(d) for d in allowed)
        raise InvalidArgument(f"{name}.dtype: expected {expected}{why}, got {dtype_name(tensor.dtype)}")
    shape = list(tensor.shape)
    if len(shape) not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise InvalidArgument(f"{name}.shape: expected {expected} dimensions, got {shape}")
    if any(d <= 0 for d in shape):
        raise InvalidArgument(f"{name}.shape: dimensions must be positive, got {shape}")
    expected_bytes = math.prod(shape) * _ITEMSIZE[tensor.dtype]
    if len(tensor.data) != expected_bytes:
        raise InvalidArgument(
            f"{name}.data: expected {expected_bytes} bytes for shape {shape} {dtype_name(tensor.dtype)}, "
            f"got {len(tensor.data)}"
        )
    if tensor.dtype == pb.DATA_TYPE_BOOL and np.frombuffer(tensor.data, dtype=np.uint8).max() > 1:
        raise InvalidArgument(f"{name}.data: BOOL elements must be bytes 0 or 1")
    return torch.frombuffer(tensor.data, dtype=_TORCH_DTYPE[tensor.dtype]).view(shape)


def _sequence(msg: pb.AttendRequest, name: str, spec: ModelSpec, rank: int, width: int) -> torch.Tensor:
    """A float input of the model's dtype: [B, T, width] (or [T, width] when the query is unbatched)."""
    wire = wire_dtype(spec.dtype)
    why = f" (the dtype of model {spec.name!r})"
    t = _decode(getattr(msg, name), name, (wire,), (rank,), why)
    if t.shape[-1] != width:
        label = {"query": "embed_dim", "key": "kdim", "value": "vdim", "key_value": "kdim"}[name]
        raise InvalidArgument(f"{name}.shape[-1]: expected {label} {width}, got {t.shape[-1]} (shape {list(t.shape)})")
    return t if rank == 3 else t.unsqueeze(0)


def _key_padding(msg: pb.AttendRequest, batch: int, keys: int, unbatched: bool) -> torch.Tensor | None:
    has_mask, has_lengths = msg.HasField("key_padding_mask"), msg.HasField("key_lengths")
    if has_mask and has_lengths:
        raise InvalidArgument("key_padding_mask, key_lengths: send at most one of the two")
    if has_mask:
        expected = [keys] if unbatched else [batch, keys]
        mask = _decode(msg.key_padding_mask, "key_padding_mask", (pb.DATA_TYPE_BOOL,), (len(expected),), "")
        if list(mask.shape) != expected:
            form = "[S]" if unbatched else "[B, S]"
            raise InvalidArgument(f"key_padding_mask.shape: expected {form} = {expected}, got {list(mask.shape)}")
        return mask.view(batch, keys)
    if has_lengths:
        lengths = _decode(msg.key_lengths, "key_lengths", _LENGTH_DTYPES, (0, 1), "")
        if lengths.numel() != batch:
            raise InvalidArgument(
                f"key_lengths.shape: expected one length per sequence ([{batch}]), got {list(lengths.shape)}"
            )
        lengths = lengths.reshape(batch).to(torch.int64)
        low, high = int(lengths.min()), int(lengths.max())
        if low < 1 or high > keys:
            bad = low if low < 1 else high
            raise InvalidArgument(f"key_lengths: expected lengths in 1..{keys} (the key sequence length), got {bad}")
        return torch.arange(keys).unsqueeze(0) >= lengths.unsqueeze(1)
    return None


def request_from_proto(msg: pb.AttendRequest, spec: ModelSpec) -> AttentionRequest:
    """Validates a request against its model and returns it as domain values; raises InvalidArgument."""
    if not msg.HasField("query"):
        raise InvalidArgument("query: required ([L, E] or [B, L, E])")
    if msg.average_weights and not msg.need_weights:
        raise InvalidArgument("average_weights: only meaningful with need_weights=true")
    rank = len(msg.query.shape)
    if rank not in (2, 3):
        raise InvalidArgument(f"query.shape: expected [L, E] or [B, L, E], got {list(msg.query.shape)}")
    query = _sequence(msg, "query", spec, rank, spec.embed_dim)
    batch, length = query.shape[0], query.shape[1]
    if length > spec.max_query_len:
        raise InvalidArgument(
            f"query.shape: sequence length {length} exceeds model {spec.name!r} max_query_len {spec.max_query_len}"
        )
    if batch > spec.max_batch_size:
        raise InvalidArgument(
            f"query.shape: {batch} sequences exceed model {spec.name!r} max_batch_size {spec.max_batch_size}"
        )
    if batch * length > spec.max_batch_tokens:
        raise InvalidArgument(
            f"query.shape: {batch * length} tokens exceed model {spec.name!r} max_batch_tokens {spec.max_batch_tokens}"
        )

    has_kv, has_k, has_v = (msg.HasField(f) for f in ("key_value", "key", "value"))
    if spec.kind is ModelKind.SDPA:
        if has_kv:
            raise InvalidArgument(f"key_value: model {spec.name!r} is the bare operation (sdpa): send key and value")
        if not (has_k and has_v):
            missing = "key" if not has_k else "value"
            raise InvalidArgument(f"{missing}: required by model {spec.name!r} (sdpa takes query, key and value)")
    else:
        if has_kv and (has_k or has_v):
            raise InvalidArgument("key_value: send either key_value or key and value, not both")
        if has_k != has_v:
            raise InvalidArgument(
                f"{'value' if has_k else 'key'}: key and value go together (or neither, for self attention)"
            )
        if not (has_kv or has_k) and not spec.self_attention:
            raise InvalidArgument(
                f"key, value: required by model {spec.name!r}: its kdim {spec.kdim} and vdim {spec.vdim} differ "
                f"from embed_dim {spec.embed_dim}, so the query cannot serve as key and value"
            )
        if has_kv and spec.kdim != spec.vdim:
            raise InvalidArgument(
                f"key_value: model {spec.name!r} has kdim {spec.kdim} != vdim {spec.vdim}; send key and value"
            )

    key = value = None
    if has_kv:
        key = value = _sequence(msg, "key_value", spec, rank, spec.kdim)
    elif has_k:
        key = _sequence(msg, "key", spec, rank, spec.kdim)
        value = _sequence(msg, "value", spec, rank, spec.vdim)
    keys = length
    if key is not None and value is not None:
        name = "key_value" if has_kv else "key"
        if key.shape[0] != batch:
            raise InvalidArgument(f"{name}.shape: expected {batch} sequences like query, got {key.shape[0]}")
        if value.shape[:2] != key.shape[:2]:
            raise InvalidArgument(
                f"value.shape: expected {list(key.shape[:2])} sequences and positions like key, "
                f"got {list(value.shape[:2])}"
            )
        keys = key.shape[1]
        if keys > spec.max_key_len:
            raise InvalidArgument(
                f"{name}.shape: key sequence length {keys} exceeds model {spec.name!r} max_key_len {spec.max_key_len}"
            )

    padding = _key_padding(msg, batch, keys, unbatched=rank == 2)
    if padding is not None:
        # A query row that sees no key would come out NaN: refuse it here.
        if bool(padding.all(dim=1).any()):
            seq = int(padding.all(dim=1).nonzero()[0])
            raise InvalidArgument(f"key_padding_mask: sequence {seq} masks every key; at least one must stay visible")
        if msg.causal and bool(padding[:, 0].any()):
            seq = int(padding[:, 0].nonzero()[0])
            raise InvalidArgument(
                f"key_padding_mask: with causal=true key 0 must stay visible (query 0 sees only key 0); "
                f"sequence {seq} masks it"
            )
    return AttentionRequest(
        query=query,
        key=key,
        value=value,
        key_padding=padding,
        causal=msg.causal,
        need_weights=msg.need_weights,
        average_weights=msg.average_weights,
        unbatched=rank == 2,
    )


def tensor_to_proto(t: torch.Tensor, out: pb.Tensor) -> None:
    out.dtype = _WIRE_DTYPE[t.dtype]
    out.shape[:] = t.shape
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    out.data = raw.numpy().tobytes()


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
