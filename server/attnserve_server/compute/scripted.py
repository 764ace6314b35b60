"""Attention's three paths (torch's fused kernel, the tiled path, the explicit path) for one batch or several,
as one call into torch on the CPU, and the GIL taken back once a batch; elsewhere, and where one call does not
pay, the same functions run op by op by Python.

Under load the event loop holds the GIL most of the time, and a worker thread must take it back after
every call into torch that gave it up: where the loop is busy (right after a batch, answering it and
reading the next requests), each such wait lasts until the loop lets go. The fused kernel computes a
batch in one call, so its worker waits once, at the batch's end, when the loop has gone quiet; the tiled
path (attention.py: a projection, scaled_dot_product_attention, a projection) called from Python waits
after each of its calls, in the loop's busy phase. Causal W1 at concurrency 32 (perf_analyzer, AMD EPYC
Zen 3): the worker computed 99% of the time but ran on a CPU for 66% of it and waited for the GIL
~18% (BENCHMARKS.md, sixty-seventh pass).

So `_batches`, one TorchScript function, computes a list of batches, each on its path, and gives up the GIL
once for all of them: a batch of several sequences on the tiled path or the explicit path (cross attention
of other lengths, the bare operation, odd head counts, and the weights of a batch that the fused kernel does
not compute), and a batch of mixed lengths, whose length groups (groups.py) each compute as a batch of its
own; one sequence alone and one batch on the fused kernel compute op by op (attention.py says why).
That alone is not enough with torch 2.10 and later: a tensor that Python owns keeps its Python object
alive through C++ references to it, and when such a tensor's last C++ reference but Python's goes, torch
releases the object, taking the GIL to do so. A scripted function drops each op's arguments after the
op, so a weight or an input passed in from Python took the GIL inside the call, op after op (py-spy:
`decref_pyobject` -> `gil_scoped_acquire` under the interpreter), and scripting the path as it was served
causal W1 0.992x the eager path. Here every tensor from Python travels in one list that the function
hands back with its result: the list holds a reference to each until the call has returned and the GIL
is held again. Served causal W1 1.19x the eager path then (in pairs, 4 of 4), W1's query with a key_value
of 32 tokens 1.30x, of 256 tokens 1.06x (BENCHMARKS.md, sixty-seventh pass); with the averaged weights 1.29x
and 1.06x, and W1 of six mixed lengths (1-128 tokens), whose batches' groups had each been a call, 1.20x
(sixty-eighth pass).

TorchScript is deprecated from torch 2.13 on (`torch.jit.script` warns at every compile; this module
compiles once, at import, with that warning silenced). Where this torch cannot script the functions,
`SCRIPTED` is None (`UNSCRIPTED` says why, and the worker logs it) and attention.py computes op by op, as it
does with `cpu_scripted: false`; where a scripted call fails and op by op computes the batch, attention.py
turns the scripted paths off for the model (`_scripted_else`). The scripted functions run as written
(`torch.jit.optimized_execution(False)`, per thread), so they compute what the eager paths compute, op for op,
without the profiling executor's specialisation by shape.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """x W^T + b, on oneDNN with a packed weight (`onednn`) or on torch's F.linear (linear.py)."""
    if onednn:
        scalars: list[int | float | complex | None] = []  # the op's Scalar?[]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, "")
    return F.linear(x, weight, bias)


def _fused(tensors: list[torch.Tensor | None], flags: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's fused MHA kernel (attention.py). tensors: the query [N, L, E], the key_value [N, L, E] (None:
    self attention), the packed [W_Q; W_K; W_V] and its bias, W_O and its bias, and the kernel's additive mask
    (None or float). flags: E, the heads, need_weights, average_weights, and the mask's type (-1: no mask)."""
    x = tensors[0]
    kv = tensors[1]
    w_in, b_in, w_out, b_out = tensors[2], tensors[3], tensors[4], tensors[5]
    assert x is not None and w_in is not None and b_in is not None and w_out is not None and b_out is not None
    kv = x if kv is None else kv
    need = flags[2] != 0
    mask_type: int | None = None if flags[4] < 0 else flags[4]
    y, w = torch._native_multi_head_attention(
        x, kv, kv, flags[0], flags[1], w_in, b_in, w_out, b_out, tensors[6], need, flags[3] != 0, mask_type
    )
    if need:
        return y, w
    return y, None


def _tiled(tensors: list[torch.Tensor | None], flags: list[int]) -> torch.Tensor:
    """Packed self attention on scaled_dot_product_attention. tensors: the query [N, L, E], the packed
    [W_Q; W_K; W_V] and its bias, W_O and its bias, and the visibility mask (None, or bool [N, 1, 1|L, L],
    True where a query may attend a key). flags: the heads, causal, and whether each projection (in, out)
    multiplies on oneDNN. Returns the output [N, L, E]."""
    x = tensors[0]
    w_in = tensors[1]
    w_out = tensors[3]
    mask = tensors[5]
    assert x is not None and w_in is not None and w_out is not None
    n, length, e = x.shape
    heads = flags[0]
    qkv = _linear(x, w_in, tensors[2], flags[2] != 0).view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    if mask is None:
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=flags[1] != 0)
    else:
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
    return _linear(y.transpose(1, 2).reshape(n, length, e), w_out, tensors[4], flags[3] != 0)


# How `_explicit` projects its inputs (flags[0]; TorchScript reads no module's ints, so the function compares
# with the numbers themselves).
BARE, PACKED, KEY_VALUE, APART = 0, 1, 2, 3
# Which attention matrix `_explicit` returns beside the output (flags[3]).
NO_WEIGHTS, PER_HEAD, AVERAGED = 0, 1, 2


def _explicit(tensors: list[torch.Tensor | None], flags: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tensors: the query [N, L, *], the key [N, S, *] and the value [N, S, *] (None where no projection
    needs them), three weights and their biases, W_O and its bias (None: no output projection), and the
    visibility mask (None, or bool [N, 1, 1|L, S], True where a query may attend a key; with weights it
    carries the causal cut too). flags: the projections, the heads, causal, the weights, and for the three
    weights and W_O in turn whether on oneDNN. The projections: BARE (the inputs are Q, K and V), PACKED (the
    query by the packed [W_Q; W_K; W_V], the first weight), KEY_VALUE (the query by W_Q, the key by
    [W_K; W_V]) or APART (the query, the key and the value each by its own). The weights: NO_WEIGHTS,
    PER_HEAD or AVERAGED, the attention matrix to return beside the output. Returns the output [N, L, *] and
    the weights ([N, h, L, S], [N, L, S] averaged, or None)."""
    projections, heads, causal, weights = flags[0], flags[1], flags[2] != 0, flags[3]
    x = tensors[0]
    assert x is not None
    if projections == 0:  # BARE
        q, k, v = x, tensors[1], tensors[2]
    else:
        w = tensors[3]
        assert w is not None
        q = _linear(x, w, tensors[4], flags[4] != 0)
        if projections == 1:  # PACKED
            parts = q.chunk(3, -1)
            q, k, v = parts[0], parts[1], parts[2]
        else:
            key, w_k = tensors[1], tensors[5]
            assert key is not None and w_k is not None
            k = _linear(key, w_k, tensors[6], flags[5] != 0)
            if projections == 2:  # KEY_VALUE
                parts = k.chunk(2, -1)
                k, v = parts[0], parts[1]
            else:
                value, w_v = tensors[2], tensors[7]
                assert value is not None and w_v is not None
                v = _linear(value, w_v, tensors[8], flags[6] != 0)
    assert k is not None and v is not None
    # [N, T, h*d] -> [N, h, T, d]
    q = q.unflatten(-1, [heads, -1]).transpose(1, 2)
    k = k.unflatten(-1, [heads, -1]).transpose(1, 2)
    v = v.unflatten(-1, [heads, -1]).transpose(1, 2)
    mask = tensors[11]
    attn: torch.Tensor | None = None
    if weights == 0:  # NO_WEIGHTS
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:  # the scores materialised, as torch.nn.MultiheadAttention's own path does for its weights
        scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(attn, v)
        if weights == 2:  # AVERAGED
            attn = attn.mean(dim=1)
    y = y.transpose(1, 2).flatten(2)
    w_out = tensors[9]
    if w_out is not None:
        y = _linear(y, w_out, tensors[10], flags[7] != 0)
    return y, attn


# A batch's path (the first of `_batches`' lists).
FUSED, TILED, EXPLICIT = 0, 1, 2


def _batch(path: int, tensors: list[torch.Tensor | None], flags: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One batch on its path (FUSED: `_fused`, TILED: `_tiled`, EXPLICIT: `_explicit`) with its tensors and
    flags: its output and weights (or None)."""
    if path == 0:  # FUSED
        return _fused(tensors, flags)
    if path == 1:  # TILED
        return _tiled(tensors, flags), None
    return _explicit(tensors, flags)


def _batches(
    paths: list[int], tensors: list[list[torch.Tensor | None]], flags: list[list[int]]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[list[torch.Tensor | None]]]:
    """Batches in turn (`_batch`): each one's output and weights (or None), and `tensors` as they came (the
    module docstring says why)."""
    outputs: list[torch.Tensor] = []
    weights: list[torch.Tensor | None] = []
    for i in range(len(paths)):
        y, w = _batch(paths[i], tensors[i], flags[i])
        outputs.append(y)
        weights.append(w)
    return outputs, weights, tensors


def _script() -> tuple[torch.jit.ScriptFunction | None, str | None]:
    """`_batches` scripted, or None and why this torch cannot script it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            return torch.jit.script(_batches), None
    except Exception as exc:  # a torch without TorchScript, or one whose ops' schemas differ
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# The worker logs UNSCRIPTED at start-up, where it computes op by op for want of SCRIPTED.
SCRIPTED, UNSCRIPTED = _script()


def run(
    plans: list[tuple[int, list[torch.Tensor | None], list[int]]], one_call: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Batches, each (path, tensors, flags), on their paths: in one call into torch (`_batches` scripted;
    `one_call`: SCRIPTED must not be None), else op by op, the same functions run by Python. Returns each
    batch's output and weights (or None)."""
    if not one_call:
        return [_batch(path, tensors, flags) for path, tensors, flags in plans]
    assert SCRIPTED is not None
    paths = [path for path, _, _ in plans]
    tensors = [t for _, t, _ in plans]
    flags = [f for _, _, f in plans]
    with torch.jit.optimized_execution(False):
        outputs, weights, _ = SCRIPTED(paths, tensors, flags)
    return list(zip(outputs, weights, strict=True))
