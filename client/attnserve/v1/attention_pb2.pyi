from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FP32: _ClassVar[DataType]
    DATA_TYPE_FP16: _ClassVar[DataType]
    DATA_TYPE_BF16: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]

class ModelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_KIND_UNSPECIFIED: _ClassVar[ModelKind]
    MODEL_KIND_MHA: _ClassVar[ModelKind]
    MODEL_KIND_SDPA: _ClassVar[ModelKind]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FP32: DataType
DATA_TYPE_FP16: DataType
DATA_TYPE_BF16: DataType
DATA_TYPE_BOOL: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT64: DataType
MODEL_KIND_UNSPECIFIED: ModelKind
MODEL_KIND_MHA: ModelKind
MODEL_KIND_SDPA: ModelKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("model", "request_id", "query", "key_value", "key", "value", "key_padding_mask", "key_lengths", "causal", "need_weights", "average_weights")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    KEY_VALUE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    KEY_PADDING_MASK_FIELD_NUMBER: _ClassVar[int]
    KEY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    NEED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    query: Tensor
    key_value: Tensor
    key: Tensor
    value: Tensor
    key_padding_mask: Tensor
    key_lengths: Tensor
    causal: bool
    need_weights: bool
    average_weights: bool
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ..., key_value: _Optional[_Union[Tensor, _Mapping]] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ..., key_padding_mask: _Optional[_Union[Tensor, _Mapping]] = ..., key_lengths: _Optional[_Union[Tensor, _Mapping]] = ..., causal: bool = ..., need_weights: bool = ..., average_weights: bool = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ns", "compute_ns", "server_ns", "batch_size", "batch_sequences")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    SERVER_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    compute_ns: int
    server_ns: int
    batch_size: int
    batch_sequences: int
    def __init__(self, queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., server_ns: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_sequences: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("model", "request_id", "output", "attention_weights", "timing", "error")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    output: Tensor
    attention_weights: Tensor
    timing: Timing
    error: Status
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., attention_weights: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class BatchingLimits(_message.Message):
    __slots__ = ("max_batch_size", "max_batch_tokens", "max_queue_delay_ms", "max_queue_size")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_batch_tokens: int
    max_queue_delay_ms: float
    max_queue_size: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_queue_delay_ms: _Optional[float] = ..., max_queue_size: _Optional[int] = ...) -> None: ...

class ModelMetadata(_message.Message):
    __slots__ = ("name", "kind", "embed_dim", "num_heads", "kdim", "vdim", "bias", "dtype", "devices", "batching", "max_query_len", "max_key_len", "output_dim", "ready", "inputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EMBED_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    KDIM_FIELD_NUMBER: _ClassVar[int]
    VDIM_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_LEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIM_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ModelKind
    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    bias: bool
    dtype: DataType
    devices: _containers.RepeatedScalarFieldContainer[str]
    batching: BatchingLimits
    max_query_len: int
    max_key_len: int
    output_dim: int
    ready: bool
    inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ModelKind, str]] = ..., embed_dim: _Optional[int] = ..., num_heads: _Optional[int] = ..., kdim: _Optional[int] = ..., vdim: _Optional[int] = ..., bias: bool = ..., dtype: _Optional[_Union[DataType, str]] = ..., devices: _Optional[_Iterable[str]] = ..., batching: _Optional[_Union[BatchingLimits, _Mapping]] = ..., max_query_len: _Optional[int] = ..., max_key_len: _Optional[int] = ..., output_dim: _Optional[int] = ..., ready: bool = ..., inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelMetadata]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelMetadata, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...
