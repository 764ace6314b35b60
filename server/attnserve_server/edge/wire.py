"""Protocol-neutral request validation: named wire tensors -> an AttentionRequest.

Both edges (the native attnserve.v1 API and KServe v2) turn their messages into
`WireTensor`s named as the model's inputs (query, key_value, key, value,
key_padding_mask, key_lengths) and call `build_request`, so every rule and every
INVALID_ARGUMENT message is the same whichever protocol a request came in by.
Datatypes are named as KServe v2 names them: FP32, FP16, BF16, BOOL, INT32, INT64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from attnserve_server import dtypes
from attnserve_server.domain import (
    ANSWER_OVERHEAD_BYTES,
    INPUT_NAMES,
    AttentionRequest,
    HostTensor,
    ModelKind,
    ModelSpec,
    answer_bytes,
    compute_bytes,
    weight_heads,
)
from attnserve_server.errors import InvalidArgument, clip, shape_text, size_text

_WIDTH_LABEL = {"query": "embed_dim", "key": "kdim", "value": "vdim", "key_value": "kdim"}
# No input has more than 3 dimensions (query [B, L, E]); a shape of up to 8 is still read, so that a
# plausible mistake ([1, B, L, E]) gets the input's own message. Past that the dims are not read at all:
# a 20 MB message of one shape's dims took the event loop a second to copy and print.
MAX_READ_DIMS = 8


def read_shape(shape: Sequence[int], where: str) -> tuple[int, ...]:
    """A message's repeated shape field as a tuple; refuses a shape longer than MAX_READ_DIMS unread."""
    if len(shape) > MAX_READ_DIMS:
        raise InvalidArgument(f"{where}: expected at most 3 dimensions, got {shape_text(shape)}")
    return tuple(shape)


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A tensor as a request carried it: not yet checked against anything."""

    dtype: str  # a KServe v2 datatype name; anything else is refused with this name in the message
    shape: tuple[int, ...]
    data: bytes | memoryview  # little-endian, row-major
    data_field: str  # where the bytes were, for messages: "query.data", "raw_input_contents[0]"


def _check(tensor: WireTensor, name: str, allowed: tuple[str, ...], ranks: tuple[int, ...], why: str) -> list[int]:
    """Checks dtype, rank, dims and byte length as integers; returns the shape. Reads no element."""
    if tensor.dtype not in allowed:
        got = clip(tensor.dtype, 16, quote=False)
        raise InvalidArgument(f"{name}.dtype: expected {' or '.join(allowed)}{why}, got {got}")
    shape = list(tensor.shape)
    if len(shape) not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise InvalidArgument(f"{name}.shape: expected {expected} dimensions, got {shape_text(shape)}")
    if any(d <= 0 for d in shape):
        raise InvalidArgument(f"{name}.shape: dimensions must be positive, got {shape}")
    expected_bytes = math.prod(shape) * dtypes.BY_NAME[tensor.dtype].itemsize
    if len(tensor.data) != expected_bytes:
        raise InvalidArgument(
            f"{tensor.data_field}: expected {expected_bytes} bytes for shape {shape} {tensor.dtype}, "
            f"got {len(tensor.data)}"
        )
    return shape


def _array(tensor: WireTensor, shape: list[int]) -> np.ndarray:
    """A small checked input (a mask, lengths) as a numpy view of its bytes."""
    return np.frombuffer(tensor.data, dtype=dtypes.BY_NAME[tensor.dtype].storage).reshape(shape)


def _sequence(tensors: Mapping[str, WireTensor], name: str, spec: ModelSpec, rank: int, width: int) -> HostTensor:
    """A float input of the model's dtype: [B, T, width] (or [T, width] when the query is unbatched)."""
    why = f" (the dtype of model {spec.name!r})"
    tensor = tensors[name]
    shape = _check(tensor, name, (spec.dtype.name,), (rank,), why)
    if shape[-1] != width:
        raise InvalidArgument(
            f"{name}.shape[-1]: expected {_WIDTH_LABEL[name]} {width}, got {shape[-1]} (shape {shape})"
        )
    b, t, d = shape if rank == 3 else (1, *shape)
    return HostTensor(tensor.data, (b, t, d))


def _key_padding(tensors: Mapping[str, WireTensor], batch: int, keys: int, unbatched: bool) -> np.ndarray | None:
    mask_in, lengths_in = tensors.get("key_padding_mask"), tensors.get("key_lengths")
    if mask_in is not None and lengths_in is not None:
        raise InvalidArgument("key_padding_mask, key_lengths: send at most one of the two")
    if mask_in is not None:
        expected = [keys] if unbatched else [batch, keys]
        shape = _check(mask_in, "key_padding_mask", ("BOOL",), (len(expected),), "")
        if shape != expected:
            form = "[S]" if unbatched else "[B, S]"
            raise InvalidArgument(f"key_padding_mask.shape: expected {form} = {expected}, got {shape}")
        if np.frombuffer(mask_in.data, dtype=np.uint8).max() > 1:
            raise InvalidArgument(f"{mask_in.data_field}: BOOL elements must be bytes 0 or 1")
        return _array(mask_in, shape).reshape(batch, keys)
    if lengths_in is not None:
        shape = _check(lengths_in, "key_lengths", dtypes.LENGTH_TYPES, (0, 1), "")
        if math.prod(shape) != batch:
            raise InvalidArgument(f"key_lengths.shape: expected one length per sequence ([{batch}]), got {shape}")
        lengths = _array(lengths_in, shape).reshape(batch).astype(np.int64)
        low, high = int(lengths.min()), int(lengths.max())
        if low < 1 or high > keys:
            bad = low if low < 1 else high
            raise InvalidArgument(f"key_lengths: expected lengths in 1..{keys} (the key sequence length), got {bad}")
        return np.arange(keys)[None, :] >= lengths[:, None]
    return None


def _check_kv_presence(spec: ModelSpec, has_kv: bool, has_k: bool, has_v: bool) -> None:
    if spec.kind is ModelKind.SDPA:
        if has_kv:
            raise InvalidArgument(f"key_value: model {spec.name!r} is the bare operation (sdpa): send key and value")
        if not (has_k and has_v):
            missing = "key" if not has_k else "value"
            raise InvalidArgument(f"{missing}: required by model {spec.name!r} (sdpa takes query, key and value)")
        return
    if has_kv and (has_k or has_v):
        raise InvalidArgument("key_value: send either key_value or key and value, not both")
    if has_k != has_v:
        missing = "value" if has_k else "key"
        raise InvalidArgument(f"{missing}: key and value go together (or neither, for self attention)")
    if not (has_kv or has_k) and not spec.self_attention:
        raise InvalidArgument(
            f"key, value: required by model {spec.name!r}: its kdim {spec.kdim} and vdim {spec.vdim} differ "
            f"from embed_dim {spec.embed_dim}, so the query cannot serve as key and value"
        )
    if has_kv and spec.kdim != spec.vdim:
        raise InvalidArgument(
            f"key_value: model {spec.name!r} has kdim {spec.kdim} != vdim {spec.vdim}; send key and value"
        )


def build_request(
    spec: ModelSpec,
    tensors: Mapping[str, WireTensor],
    *,
    causal: bool,
    need_weights: bool,
    average_weights: bool,
) -> AttentionRequest:
    """Validates a request against its model and returns it as domain values; raises InvalidArgument."""
    unknown = sorted(set(tensors) - set(INPUT_NAMES))
    if unknown:
        inputs = ", ".join(INPUT_NAMES)
        raise InvalidArgument(f"{clip(unknown[0], quote=False)}: not an input of model {spec.name!r}; inputs: {inputs}")
    if spec.optional_inputs is not None:
        for name in tensors:
            if not spec.takes(name):
                kept = ", ".join(spec.optional_inputs) or "none"
                raise InvalidArgument(f"{name}: model {spec.name!r} does not take it (its optional_inputs: {kept})")
    if "query" not in tensors:
        raise InvalidArgument("query: required ([L, E] or [B, L, E])")
    if average_weights and not need_weights:
        raise InvalidArgument("average_weights: only meaningful with need_weights=true")
    rank = len(tensors["query"].shape)
    if rank not in (2, 3):
        raise InvalidArgument(f"query.shape: expected [L, E] or [B, L, E], got {shape_text(tensors['query'].shape)}")
    query = _sequence(tensors, "query", spec, rank, spec.embed_dim)
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

    has_kv, has_k, has_v = ("key_value" in tensors), ("key" in tensors), ("value" in tensors)
    _check_kv_presence(spec, has_kv, has_k, has_v)
    key = value = None
    if has_kv:
        key = value = _sequence(tensors, "key_value", spec, rank, spec.kdim)
    elif has_k:
        key = _sequence(tensors, "key", spec, rank, spec.kdim)
        value = _sequence(tensors, "value", spec, rank, spec.vdim)
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

    padding = _key_padding(tensors, batch, keys, unbatched=rank == 2)
    if padding is not None:
        # A query row that sees no key would come out NaN: refuse it here.
        if padding.all(axis=1).any():
            seq = int(padding.all(axis=1).argmax())
            raise InvalidArgument(f"key_padding_mask: sequence {seq} masks every key; at least one must stay visible")
        if causal and padding[:, 0].any():
            seq = int(padding[:, 0].argmax())
            raise InvalidArgument(
                f"key_padding_mask: with causal=true key 0 must stay visible (query 0 sees only key 0); "
                f"sequence {seq} masks it"
            )
    memory, answer = _check_memory(spec, batch, length, keys, need_weights, average_weights)
    nbytes = len(query.data) + (0 if padding is None else padding.size)
    if key is not None:
        nbytes += len(key.data) + (0 if value is key or value is None else len(value.data))
    return AttentionRequest(
        query=query,
        key=key,
        value=value,
        key_padding=padding,
        causal=causal,
        need_weights=need_weights,
        average_weights=average_weights,
        unbatched=rank == 2,
        nbytes=nbytes,
        memory_bytes=memory,
        answer_bytes=answer,
    )


# Where a tensor's bytes are in a received message's views (edge/payload.py): (field number, entry).
Where = tuple[int, int]


class Known:
    """A request `build_request` accepted, kept for the next with the same head (edge/payload.py's
    `Repeat`). Such a request differs only in its tensors' bytes, of the same lengths, and every rule
    here reads the head and the byte lengths, so it is as valid. A request whose values are checked
    (key_padding_mask, key_lengths) is not kept: `of` returns None."""

    __slots__ = ("_key", "_query", "_template", "_value", "spec")

    def __init__(
        self, spec: ModelSpec, request: AttentionRequest, query: Where, key: Where | None, value: Where | None
    ):
        self.spec = spec  # the model it was validated against
        self._template = request.with_data(b"", b"", b"")  # holding no request's bytes
        self._query, self._key, self._value = query, key, value

    @classmethod
    def of(cls, spec: ModelSpec, request: AttentionRequest, where: Mapping[str, Where]) -> Known | None:
        """`request`, validated against `spec`, with where each of its inputs' bytes are."""
        if request.key_padding is not None:
            return None
        both = where.get("key_value")
        return cls(spec, request, where["query"], both or where.get("key"), both or where.get("value"))

    def request(self, views: Mapping[int, list[memoryview]]) -> AttentionRequest:
        """The request a message with this head and these tensor bytes carries."""
        q, k, v = self._query, self._key, self._value
        return self._template.with_data(
            views[q[0]][q[1]],
            None if k is None else views[k[0]][k[1]],
            None if v is None else views[v[0]][v[1]],
        )


def _check_memory(
    spec: ModelSpec, batch: int, length: int, keys: int, need_weights: bool, average: bool
) -> tuple[int, int]:
    """Refuses, before any compute, a request whose answer cannot be sent or whose computation would
    not fit the model's batch memory budget; returns its compute memory estimate and its answer's bytes."""
    heads = weight_heads(spec, need_weights, average)
    answer = answer_bytes(spec, batch, length, keys, heads)
    if answer + ANSWER_OVERHEAD_BYTES > spec.max_answer_bytes:
        weights = answer - answer_bytes(spec, batch, length, keys, 0)
        hint = "; ask for averaged weights, or send fewer or shorter sequences" if heads else ""
        raise InvalidArgument(
            f"query.shape: the answer would be {size_text(answer)} (weights {size_text(weights)}) and up to "
            f"{size_text(ANSWER_OVERHEAD_BYTES)} of names, shapes and framing, over the server's max_message_bytes "
            f"{size_text(spec.max_answer_bytes)}{hint}"
        )
    memory = compute_bytes(spec, batch, length, keys, need_weights)
    if memory > spec.max_batch_memory_bytes:
        raise InvalidArgument(
            f"query.shape: computing {batch} x {length} queries against {keys} keys"
            f"{' with weights' if need_weights else ''} takes about {size_text(memory)}, over model {spec.name!r} "
            f"max_batch_memory_bytes {size_text(spec.max_batch_memory_bytes)}"
        )
    return memory, answer
