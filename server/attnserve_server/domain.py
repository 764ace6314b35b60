"""Typed values passed between the edge, the batcher and the compute layer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class ModelKind(StrEnum):
    MHA = "mha"  # learned projections, torch.nn.MultiheadAttention
    SDPA = "sdpa"  # the bare operation on client-supplied Q, K, V


@dataclass(frozen=True)
class ModelSpec:
    """What a request is validated against: a model's shape, dtype and limits."""

    name: str
    kind: ModelKind
    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    bias: bool
    dtype: torch.dtype
    max_query_len: int
    max_key_len: int
    max_batch_size: int
    max_batch_tokens: int

    @property
    def self_attention(self) -> bool:
        """Whether the query can serve as key and value (torch's rule: kdim == vdim == embed_dim)."""
        return self.kind is ModelKind.MHA and self.kdim == self.embed_dim and self.vdim == self.embed_dim

    @property
    def output_dim(self) -> int:
        # MHA projects back to embed_dim; the bare operation returns V's width.
        return self.embed_dim if self.kind is ModelKind.MHA else self.vdim


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Requests batch together only when they run the same computation."""

    cross: bool
    causal: bool
    need_weights: bool
    average_weights: bool


@dataclass(frozen=True, slots=True, eq=False)
class AttentionRequest:
    """A validated request. Tensors are on the CPU, in the model's dtype, always batched.

    key/value are None for MHA self attention (they are the query).
    key_padding is bool [B, S], True where a key is ignored.
    """

    query: torch.Tensor  # [B, L, E]
    key: torch.Tensor | None  # [B, S, kdim]
    value: torch.Tensor | None  # [B, S, vdim]
    key_padding: torch.Tensor | None
    causal: bool
    need_weights: bool
    average_weights: bool
    unbatched: bool  # the query came as [L, E]: answers drop the batch dim

    @property
    def sequences(self) -> int:
        return self.query.shape[0]

    @property
    def query_len(self) -> int:
        return self.query.shape[1]

    @property
    def key_len(self) -> int:
        return self.query_len if self.key is None else self.key.shape[1]

    @property
    def batch_key(self) -> BatchKey:
        return BatchKey(self.key is not None, self.causal, self.need_weights, self.average_weights)


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """One request's answer from the worker: CPU tensors, batch dim kept."""

    output: torch.Tensor  # [B, L, E_out]
    weights: torch.Tensor | None  # [B, H, L, S] or [B, L, S]


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What a worker returns for a batch: per-request results and what it cost."""

    results: list[AttentionResult]
    compute_s: float  # the whole batch, wall clock: input_s + infer_s + output_s
    input_s: float  # padding and staging the inputs (host-to-device copies included)
    infer_s: float  # the attention itself
    output_s: float  # results back to the host and split per request
    sequences: int
    tokens: int  # real query tokens
    padding_fraction: float  # share of padded query and key positions
