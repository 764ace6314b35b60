"""Typed values passed between the edge, the batcher and the compute layer. No torch, no grpc.

A request carries its tensors as the bytes the message brought and their shapes: the edge checks
them as integers and never copies or converts them; the worker stages a whole batch at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from attnserve_server.dtypes import DType


class ModelKind(StrEnum):
    MHA = "mha"  # learned projections, torch.nn.MultiheadAttention
    SDPA = "sdpa"  # the bare operation on client-supplied Q, K, V


# A request's inputs, as both protocols name them (edge/wire.py).
INPUT_NAMES = ("query", "key_value", "key", "value", "key_padding_mask", "key_lengths")


def optional_inputs(kind: ModelKind, kdim: int, vdim: int) -> tuple[str, ...]:
    """The inputs a model may go without, as Triton's config marks them `optional`: the masks always;
    key_value, key and value for MHA where key_value can stand for the pair (kdim == vdim). Whether a
    request may omit all three (self attention) is ModelSpec.self_attention."""
    masks = ("key_padding_mask", "key_lengths")
    if kind is ModelKind.MHA and kdim == vdim:
        return ("key_value", "key", "value", *masks)
    return masks


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
    dtype: DType
    max_query_len: int
    max_key_len: int
    max_batch_size: int
    max_batch_tokens: int
    max_batch_memory_bytes: int = 2 << 30  # a batch's estimated compute memory (see compute_bytes)
    max_answer_bytes: int = 256 << 20  # the largest response message the server may send
    cuda_graphs: bool = False  # replay small unmasked batches as CUDA graphs (compute/graphs.py)
    cpu_matmul: str = "auto"  # how the CPU multiplies the projections: auto, onednn or aten (compute/linear.py)
    cpu_fused_bound: str = "auto"  # what the fused kernel's bound on scores applies to (compute/attention.py)
    cpu_scripted: bool = True  # a CPU batch (or its length groups) in one call into torch (compute/scripted.py)
    cpu_lanes: int = 1  # batches a CPU worker computes at once (compute/worker.py)
    cpu_pair_macs: int = 0  # with one CPU lane: pairing's threshold (batching.py, compute/worker.py)
    # The optional inputs requests may carry (settings: optional_inputs); None: every one. The others
    # are refused, and KServe's metadata and config do not list them.
    optional_inputs: tuple[str, ...] | None = None

    @property
    def self_attention(self) -> bool:
        """Whether the query can serve as key and value (torch's rule: kdim == vdim == embed_dim)."""
        return self.kind is ModelKind.MHA and self.kdim == self.embed_dim and self.vdim == self.embed_dim

    def takes(self, name: str) -> bool:
        """Whether requests may carry input `name` (one of INPUT_NAMES)."""
        kept = self.optional_inputs
        return kept is None or name in kept or name not in optional_inputs(self.kind, self.kdim, self.vdim)

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every input requests may carry, in INPUT_NAMES' order (key_value only where it can stand for
        key and value: MHA with kdim == vdim)."""
        pair = self.kind is ModelKind.MHA and self.kdim == self.vdim
        return tuple(n for n in INPUT_NAMES if (pair or n != "key_value") and self.takes(n))

    @property
    def output_dim(self) -> int:
        # MHA projects back to embed_dim; the bare operation returns V's width.
        return self.embed_dim if self.kind is ModelKind.MHA else self.vdim


# Room left in a response for everything but the tensors (names, shapes, timing, framing).
ANSWER_OVERHEAD_BYTES = 64 << 10


def weight_heads(spec: ModelSpec, need_weights: bool, average: bool) -> int:
    """The heads of the weights an answer carries: num_heads per head, 1 averaged, 0 none."""
    return 0 if not need_weights else 1 if average else spec.num_heads


def answer_bytes(spec: ModelSpec, sequences: int, query_len: int, key_len: int, weight_heads: int) -> int:
    """The tensors of an answer: the output [B, L, E_out], and the weights [B, heads, L, S] when asked
    for (heads: num_heads per head, 1 averaged, 0 none), in the model's dtype."""
    elements = sequences * query_len * (spec.output_dim + weight_heads * key_len)
    return elements * spec.dtype.itemsize


# An edge process's arena regions, and the tensors in them, start at multiples of this many bytes; so
# do an answer's weights in its room (AnswerRoom), after its output.
ANSWER_ALIGN = 64


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ANSWER_ALIGN: where the next tensor starts after it."""
    return -(-nbytes // ANSWER_ALIGN) * ANSWER_ALIGN


class AnswerRoom:
    """Writable memory where a request's answer should end up (a region of an edge process's arena),
    which the worker writes the answer into (output first, weights from `aligned` after it) instead of making it
    bytes of its own. The room's owner takes it back with `close` before it hands the memory to anything
    else: a write in progress finishes first, and none starts after. A caller that gives up on a request
    its worker is computing would otherwise free memory that the worker then writes."""

    __slots__ = ("_lock", "_open", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view  # bytes ('B')
        self._lock = threading.Lock()
        self._open = True

    def __enter__(self) -> memoryview | None:
        """`with room as view:` the memory to write the answer into, None once closed; `close` waits
        until the block ends."""
        self._lock.acquire()
        return self.view if self._open else None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._open = False


def compute_bytes(spec: ModelSpec, sequences: int, query_len: int, key_len: int, need_weights: bool) -> int:
    """What computing a request may hold in memory at once, estimated as the README's "Memory limits"
    section explains: the projections and outputs, B·(4·L·E + 2·S·E) elements of the model's dtype,
    plus the attention scores B·H·L·S in float32, three copies of them when the weights are asked for
    (scores, their softmax, the weights returned)."""
    activations = sequences * (4 * query_len * spec.embed_dim + 2 * key_len * max(spec.kdim, spec.vdim))
    scores = sequences * spec.num_heads * query_len * key_len * 4 * (3 if need_weights else 1)
    return activations * spec.dtype.itemsize + scores


def compute_macs(spec: ModelSpec, sequences: int, query_len: int, key_len: int) -> int:
    """Multiply-adds of computing a (padded) batch: the projections of an MHA model (Q and the output
    per query position, K and V per key position) and the attention itself (Q·Kᵀ and A·V, whose
    values are V projected to embed_dim in an MHA model, V as given in the bare operation)."""
    e = spec.embed_dim
    if spec.kind is not ModelKind.MHA:
        return sequences * query_len * key_len * (e + spec.vdim)
    attention = sequences * query_len * key_len * 2 * e
    projections = sequences * (query_len * 2 * e * e + key_len * (spec.kdim + spec.vdim) * e)
    return projections + attention


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Requests batch together only when they run the same computation."""

    cross: bool
    causal: bool
    need_weights: bool
    average_weights: bool


@dataclass(frozen=True, slots=True)
class HostTensor:
    """A float input in the model's dtype: little-endian, row-major bytes, shape [B, T, D]."""

    data: bytes | memoryview
    shape: tuple[int, int, int]


@dataclass(frozen=True, slots=True, eq=False)
class AttentionRequest:
    """A validated request, always batched ([B, ...]).

    key/value are None for MHA self attention (they are the query); with key_value they are the
    same object. key_padding is bool [B, S], True where a key is ignored.
    """

    query: HostTensor  # [B, L, E]
    key: HostTensor | None  # [B, S, kdim]
    value: HostTensor | None  # [B, S, vdim]
    key_padding: np.ndarray | None
    causal: bool
    need_weights: bool
    average_weights: bool
    unbatched: bool  # the query came as [L, E]: answers drop the batch dim
    nbytes: int = 0  # the request's tensor bytes, as they wait in the queue
    memory_bytes: int = 0  # compute_bytes(): what computing it may take
    trace: object = None  # its tracing span when tracing is on (tracing.py), for its batch's links
    # Where its answer should end up (an edge process's arena): the worker writes it there when it fits
    # and the room is still open (Answer.in_place).
    answer_into: AnswerRoom | None = None
    answer_bytes: int = 0  # answer_bytes(): its answer's tensors, as the edge counts them (edge/outbox.py)

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

    def with_data(
        self, query: bytes | memoryview, key: bytes | memoryview | None, value: bytes | memoryview | None
    ) -> AttentionRequest:
        """This request with other tensor bytes of the same lengths: a request whose every other field
        repeats this one's, and so as valid. `key` and `value` are read only where this request has
        them; with one key_value (key and value the same) `key` is both."""
        k = None if self.key is None else HostTensor(key, self.key.shape)  # type: ignore[arg-type]
        v = k if self.value is self.key else HostTensor(value, self.value.shape)  # type: ignore[arg-type,union-attr]
        return AttentionRequest(
            HostTensor(query, self.query.shape),
            k,
            v,
            self.key_padding,
            self.causal,
            self.need_weights,
            self.average_weights,
            self.unbatched,
            self.nbytes,
            self.memory_bytes,
            self.trace,
            answer_bytes=self.answer_bytes,
        )


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What one batch cost; shared by every answer of the batch."""

    started: float  # time.perf_counter() when the worker began the batch
    compute_s: float  # the whole batch, wall clock: input_s + infer_s + output_s
    input_s: float  # staging the inputs (host-to-device copies included)
    infer_s: float  # the attention itself
    output_s: float  # results back to the host and split per request
    requests: int
    sequences: int
    tokens: int  # real query tokens
    padded_tokens: int  # query tokens computed, padding included (sequences x longest query)
    padding_fraction: float  # share of padded query and key positions
    threads: int = 0  # intra-op threads a CPU batch ran on (0: not a CPU batch)
    paired: bool = False  # a CPU batch computed beside another, on a share of the threads (pairing)


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's result from the worker: bytes in the model's dtype, batch dim kept.

    The only object made per request on the way back; `batch` is shared by the batch's answers.
    """

    output: bytes | memoryview  # [B, L, E_out]; a byte view of the batch's output on the CPU
    output_shape: tuple[int, ...]
    weights: bytes | memoryview | None  # [B, H, L, S], or [B, L, S] averaged
    weights_shape: tuple[int, ...] | None
    batch: BatchReport
    # output (and weights) are views of the request's answer_into, written there by the worker
    in_place: bool = False
