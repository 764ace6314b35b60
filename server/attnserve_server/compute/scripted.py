"""The tiled and explicit attention paths, as one call into torch on the CPU, and the GIL taken back once a
batch; elsewhere, and where one call does not pay, the same functions run op by op by Python.

Under load the event loop holds the GIL most of the time, and a worker thread must take it back after
every call into torch that gave it up: where the loop is busy (right after a batch, answering it and
reading the next requests), each such wait lasts until the loop lets go. The fused kernel computes a
batch in one call, so its worker waits once, at the batch's end, when the loop has gone quiet; the tiled
path (attention.py: a projection, scaled_dot_product_attention, a projection) called from Python waits
after each of its calls, in the loop's busy phase. Causal W1 at concurrency 32 (perf_analyzer, AMD EPYC
Zen 3): the worker computed 99% of the time but ran on a CPU for 66% of it and waited for the GIL
~18% (BENCHMARKS.md, sixty-seventh pass).

So the tiled path runs a batch of several sequences as one TorchScript function, which gives up the GIL
once for the whole batch (one sequence computes op by op: attention.py says why), and so does the explicit
path (cross attention of other lengths, the bare operation, odd head counts, and the weights of a batch that
the fused kernel does not compute).
That alone is not enough with torch 2.10 and later: a tensor that Python owns keeps its Python object
alive through C++ references to it, and when such a tensor's last C++ reference but Python's goes, torch
releases the object, taking the GIL to do so. A scripted function drops each op's arguments after the
op, so a weight or an input passed in from Python took the GIL inside the call, op after op (py-spy:
`decref_pyobject` -> `gil_scoped_acquire` under the interpreter), and scripting the path as it was served
causal W1 0.992x the eager path. Here every tensor from Python travels in one list that the function
hands back with its result: the list holds a reference to each until the call has returned and the GIL
is held again. Served causal W1 1.19x the eager path then (in pairs, 4 of 4), W1's query with a key_value
of 32 tokens 1.30x, of 256 tokens 1.06x.

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


def _tiled(
    tensors: list[torch.Tensor | None],
    heads: int,
    causal: bool,
    onednn_in: bool,
    onednn_out: bool,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """tensors: the query [N, L, E], the packed [W_Q; W_K; W_V] and its bias, W_O and its bias, and the
    visibility mask (None, or bool [N, 1, 1|L, L], True where a query may attend a key). Returns the
    output [N, L, E], and `tensors` as they came (the module docstring says why)."""
    x = tensors[0]
    w_in = tensors[1]
    w_out = tensors[3]
    mask = tensors[5]
    assert x is not None and w_in is not None and w_out is not None
    n, length, e = x.shape
    qkv = _linear(x, w_in, tensors[2], onednn_in).view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    if mask is None:
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
    else:
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
    return _linear(y.transpose(1, 2).reshape(n, length, e), w_out, tensors[4], onednn_out), tensors


# How `_explicit` projects its inputs (its `projections`; TorchScript reads no module's ints, so the function
# compares with the numbers themselves).
BARE, PACKED, KEY_VALUE, APART = 0, 1, 2, 3
# Which attention matrix `_explicit` returns beside the output (its `weights`).
NO_WEIGHTS, PER_HEAD, AVERAGED = 0, 1, 2


def _explicit(
    tensors: list[torch.Tensor | None],
    projections: int,
    heads: int,
    causal: bool,
    onednn: list[bool],
    weights: int,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """tensors: the query [N, L, *], the key [N, S, *] and the value [N, S, *] (None where no projection
    needs them), three weights and their biases, W_O and its bias (None: no output projection), and the
    visibility mask (None, or bool [N, 1, 1|L, S], True where a query may attend a key; with `weights` it
    carries the causal cut too). `projections`: BARE (the inputs are Q, K and V), PACKED (the query by the
    packed [W_Q; W_K; W_V], the first weight), KEY_VALUE (the query by W_Q, the key by [W_K; W_V]) or APART
    (the query, the key and the value each by its own). `onednn`: for the three weights and W_O in turn,
    whether on oneDNN. `weights`: NO_WEIGHTS, PER_HEAD or AVERAGED, the attention matrix to return beside
    the output. Returns the output [N, L, *], the weights ([N, h, L, S], [N, L, S] averaged, or None), and
    `tensors` as they came."""
    x = tensors[0]
    assert x is not None
    if projections == 0:  # BARE
        q, k, v = x, tensors[1], tensors[2]
    else:
        w = tensors[3]
        assert w is not None
        q = _linear(x, w, tensors[4], onednn[0])
        if projections == 1:  # PACKED
            parts = q.chunk(3, -1)
            q, k, v = parts[0], parts[1], parts[2]
        else:
            key, w_k = tensors[1], tensors[5]
            assert key is not None and w_k is not None
            k = _linear(key, w_k, tensors[6], onednn[1])
            if projections == 2:  # KEY_VALUE
                parts = k.chunk(2, -1)
                k, v = parts[0], parts[1]
            else:
                value, w_v = tensors[2], tensors[7]
                assert value is not None and w_v is not None
                v = _linear(value, w_v, tensors[8], onednn[2])
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
        y = _linear(y, w_out, tensors[10], onednn[3])
    return y, attn, tensors


def _script() -> tuple[tuple[torch.jit.ScriptFunction, torch.jit.ScriptFunction] | None, str | None]:
    """`_tiled` and `_explicit` scripted, or None and why this torch cannot script them."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            return (torch.jit.script(_tiled), torch.jit.script(_explicit)), None
    except Exception as exc:  # a torch without TorchScript, or one whose ops' schemas differ
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# The worker logs UNSCRIPTED at start-up, where it computes op by op for want of SCRIPTED.
SCRIPTED, UNSCRIPTED = _script()


def tiled(
    query: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    onednn_in: bool,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    onednn_out: bool,
    mask: torch.Tensor | None,
    heads: int,
    causal: bool,
    one_call: bool,
) -> torch.Tensor:
    """Packed self attention on the tiled path (`_tiled`): in one call into torch (`one_call`: SCRIPTED must
    not be None), else op by op, the same function run by Python."""
    tensors = [query, w_in, b_in, w_out, b_out, mask]
    if not one_call:
        return _tiled(tensors, heads, causal, onednn_in, onednn_out)[0]
    assert SCRIPTED is not None
    with torch.jit.optimized_execution(False):
        return SCRIPTED[0](tensors, heads, causal, onednn_in, onednn_out)[0]


def explicit(
    tensors: list[torch.Tensor | None],
    projections: int,
    heads: int,
    causal: bool,
    onednn: list[bool],
    weights: int,
    one_call: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention on the explicit path (`_explicit`), the output and the weights asked for: in one call into
    torch (`one_call`: SCRIPTED must not be None), else op by op, the same function run by Python."""
    if not one_call:
        y, attn, _ = _explicit(tensors, projections, heads, causal, onednn, weights)
        return y, attn
    assert SCRIPTED is not None
    with torch.jit.optimized_execution(False):
        y, attn, _ = SCRIPTED[1](tensors, projections, heads, causal, onednn, weights)
    return y, attn
