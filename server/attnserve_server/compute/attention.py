"""Multi-head attention on padded batches: torch.nn.MultiheadAttention's semantics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnserve_server.compute.weights import Projections
from attnserve_server.domain import ModelKind, ModelSpec


def visibility_mask(
    key_padding: torch.Tensor | None, causal: bool, query_len: int, key_len: int, device: torch.device
) -> torch.Tensor | None:
    """Bool mask, True where a query may attend a key: [N, 1, 1|L, S], or None if all may."""
    allowed = None if key_padding is None else ~key_padding[:, None, None, :]
    if causal:
        tril = torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril()
        allowed = tril if allowed is None else allowed & tril
    return allowed


class AttentionCompute:
    """Y = concat_h(softmax(Q K^T / sqrt(d)) V) W_O for one model on one device."""

    def __init__(self, spec: ModelSpec, params: Projections | None) -> None:
        if (spec.kind is ModelKind.MHA) != (params is not None):
            raise ValueError("MHA models need projections; the bare operation has none")
        self.spec = spec
        self.params = params
        self.heads = spec.num_heads
        self.scale = 1.0 / math.sqrt(spec.embed_dim // spec.num_heads)

    def _project(
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        if p is None:
            assert key is not None and value is not None
            return query, key, value
        if key is None and p.packed is not None:
            return F.linear(query, p.packed, p.packed_bias).chunk(3, dim=-1)
        key = query if key is None else key
        value = query if value is None else value
        return (
            F.linear(query, p.q_weight, p.q_bias),
            F.linear(key, p.k_weight, p.k_bias),
            F.linear(value, p.v_weight, p.v_bias),
        )

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        key_padding: torch.Tensor | None,
        causal: bool,
        need_weights: bool,
        average_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """query [N, L, E]; key/value [N, S, *] or None (self attention); key_padding [N, S], True = ignore."""
        q, k, v = self._project(query, key, value)
        length = q.shape[1]
        s = k.shape[1]
        # [N, T, h*d] -> [N, h, T, d]
        q = q.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k = k.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        v = v.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        weights = None
        if need_weights:
            allowed = visibility_mask(key_padding, causal, length, s, q.device)
            scores = torch.matmul(q * self.scale, k.transpose(-2, -1))
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            y = torch.matmul(attn, v)
            weights = attn.mean(dim=1) if average_weights else attn
        elif key_padding is None:
            # No mask tensor: lets CUDA pick its flash or memory-efficient kernels.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            allowed = visibility_mask(key_padding, causal, length, s, q.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = y.transpose(1, 2).flatten(2)
        if self.params is not None:
            y = F.linear(y, self.params.out_weight, self.params.out_bias)
        return y, weights
