"""Plain values the client hands to and gets back from the server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnserve._errors import AttnServeError


@dataclass(frozen=True)
class Request:
    """One attention request; `Client.attend` takes the same fields as keyword arguments.

    Arrays are numpy; float inputs may be cast on the way out with `dtype`
    ("float32", "float16" or "bfloat16"). Key padding follows torch: True masks a key.
    """

    query: Any
    key_value: Any = None
    key: Any = None
    value: Any = None
    model: str = ""  # empty: the server's first configured model
    causal: bool = False
    key_padding_mask: Any = None
    key_lengths: Any = None
    need_weights: bool = False
    average_weights: bool = True
    dtype: str | None = None
    request_id: str = ""


@dataclass(frozen=True)
class Timing:
    """Where the server spent the request's time, in seconds."""

    queue_s: float = 0.0
    compute_s: float = 0.0
    server_s: float = 0.0
    batch_size: int = 0
    batch_sequences: int = 0


@dataclass(frozen=True)
class AttendResult:
    """The output Y, the attention weights when asked for, and the server's timing.

    BF16 tensors come back as float32 (exact: every bf16 value is a float32).
    In a stream, a failed request has `error` set and no output.
    """

    output: np.ndarray | None
    attention_weights: np.ndarray | None = None
    request_id: str = ""
    model: str = ""
    timing: Timing = field(default_factory=Timing)
    error: AttnServeError | None = None

    def raise_for_error(self) -> AttendResult:
        if self.error is not None:
            raise self.error
        return self


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    output_dim: int
    bias: bool
    dtype: str
    devices: tuple[str, ...]
    max_batch_size: int
    max_batch_tokens: int
    max_queue_delay_ms: float
    max_queue_size: int
    max_query_len: int
    max_key_len: int
    ready: bool
    # The inputs a request may carry (query, key_value, key, value, key_padding_mask, key_lengths; a model
    # may refuse some); empty from a server older than this field.
    inputs: tuple[str, ...] = ()
