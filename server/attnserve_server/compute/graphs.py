"""CUDA graphs for small self-attention batches (`cuda_graphs: true`): one launch instead of many.

A W1 batch (E=256, L=64) on a GPU is a handful of small kernels, each a launch from Python; a CUDA
graph replays them all with one. Graphs have fixed shapes, so a lane keeps one per (batch bucket,
query length): a batch of B sequences runs in the graph of the smallest bucket >= B, its rows copied
into the graph's input and the first B rows of its output read back (rows beyond B hold stale data
and are never read: without a mask each sequence is computed alone). Only the plain case is graphed:
self attention on the fused kernel, no key mask, not causal, no weights returned; anything else
takes the ordinary path. Each lane owns its graphs and their memory pool, and replays them on its
own stream, one batch at a time, so a graph's buffers are never shared between batches in flight.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from attnserve_server.compute.attention import AttentionCompute

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPHS = 32  # per lane; the least recently used goes first


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, static_in: torch.Tensor, static_out: torch.Tensor) -> None:
        self.graph = graph
        self.static_in = static_in
        self.static_out = static_out


class GraphedAttention:
    """One lane's graphs over `compute`; call it inside the lane's stream and inference mode."""

    def __init__(
        self,
        compute: AttentionCompute,
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int,
        capture_lock: threading.Lock,
    ) -> None:
        self._compute = compute
        # One capture at a time per device worker (its lanes capture on threads of their own), each on
        # this lane's own capture stream: torch.cuda.graph would otherwise share one among all graphs.
        self._capture_lock = capture_lock
        self._capture_stream = torch.cuda.Stream(device)
        self._device = device
        self._dtype = dtype
        self._max_bucket = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self._pool = None  # the lane's graphs share one memory pool: they replay one at a time
        self._broken = False

    def takes(
        self, query: torch.Tensor, key: torch.Tensor | None, padding: torch.Tensor | None, causal: bool, weights: bool
    ) -> bool:
        """Whether this batch runs as a graph."""
        return (
            not self._broken
            and self._compute.fused
            and key is None
            and padding is None
            and not causal
            and not weights
            and query.shape[0] <= self._max_bucket
        )

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        """The output [B, L, E] of query [B, L, E]: a view valid until this lane's next batch."""
        n, length, _ = query.shape
        bucket = next(b for b in BUCKETS if b >= n)
        entry = self._graphs.get((bucket, length))
        if entry is None:
            entry = self._capture(bucket, length)
        else:
            self._graphs.move_to_end((bucket, length))
        entry.static_in[:n].copy_(query)
        entry.graph.replay()
        return entry.static_out[:n]

    def _run(self, query: torch.Tensor) -> torch.Tensor:
        return self._compute(query, None, None, None, False, False, False)[0]

    def _capture(self, bucket: int, length: int) -> _Graph:
        with self._capture_lock:
            return self._capture_locked(bucket, length)

    def _capture_locked(self, bucket: int, length: int) -> _Graph:
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        static_in = torch.zeros(bucket, length, self._compute.spec.embed_dim, dtype=self._dtype, device=self._device)
        # As torch's documentation asks: a few eager runs on a side stream first (library handles,
        # workspaces), then the capture.
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(static_in)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the other lane's thread keeps launching and allocating while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"):
            static_out = self._run(static_in)
        entry = self._graphs[(bucket, length)] = _Graph(graph, static_in, static_out)
        log.debug("captured a CUDA graph for %d x %d on %s", bucket, length, self._device)
        return entry

    def buckets(self) -> list[int]:
        """The batch sizes graphs are made for, up to the model's largest batch."""
        return [b for b in BUCKETS if b <= self._max_bucket]

    def disable(self, exc: BaseException) -> None:
        """Stops graphing on this lane after a capture failed (the ordinary path serves instead)."""
        self._broken = True
        self._graphs.clear()
        log.warning("CUDA graphs off on %s after a failed capture: %r", self._device, exc)
