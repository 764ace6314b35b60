"""A device worker: owns one device and one model's weights; runs padded batches synchronously."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from attnserve_server.compute.attention import AttentionCompute
from attnserve_server.compute.weights import Projections
from attnserve_server.domain import AttentionRequest, AttentionResult, BatchReport, ModelKind, ModelSpec


class _PinnedArena:
    """Grow-only page-locked host buffers, one per role, reused batch after batch.

    Safe to reuse because a worker runs one batch at a time and synchronizes its
    stream before the next batch is staged.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get(role)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)
            self._buffers[role] = buf
        return buf[:numel].view(shape)


class _CudaPhases:
    """CUDA events at the batch's phase boundaries on the worker's stream.

    Kernels run asynchronously, so host clocks cannot split a batch: the GPU's own
    timestamps say how long the attention kernels and the copies back took.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def mark(self, boundary: int) -> None:
        """0: inputs staged; 1: attention queued; 2: copies back queued."""
        self._events[boundary].record(self._stream)

    def seconds(self) -> tuple[float, float]:
        """(attention, copies back) on the GPU; valid once the stream has synchronized."""
        e = self._events
        return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3


class DeviceWorker:
    """Runs `run(requests) -> BatchReport` on one device, on its own thread (see `executor`)."""

    def __init__(
        self, spec: ModelSpec, params: Projections | None, device: torch.device, torch_threads: int | None = None
    ) -> None:
        self.spec = spec
        self.device = device
        self.name = str(device)
        self._cuda = device.type == "cuda"
        # One thread per device: torch releases the GIL in its kernels, and the event loop stays free.
        # OpenMP keeps its thread count per calling thread, so it is set on the worker's own thread.
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"attn-{spec.name}-{device}",
            initializer=torch.set_num_threads if torch_threads else None,
            initargs=(torch_threads,) if torch_threads else (),
        )
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._arena = _PinnedArena() if self._cuda else None
        on_device = None if params is None else params.to(device, spec.dtype)
        self._compute = AttentionCompute(spec, on_device)

    # -- staging: requests -> padded device tensors ------------------------------------------

    def _host(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._arena is not None:
            return self._arena.take(role, shape, dtype)
        return torch.empty(shape, dtype=dtype)

    def _stage(self, role: str, parts: list[torch.Tensor], length: int) -> torch.Tensor:
        """Stacks [B_i, T_i, D] parts into [sum B_i, length, D], zero padded, on the device."""
        n = sum(p.shape[0] for p in parts)
        width = parts[0].shape[2]
        host = self._host(role, (n, length, width), parts[0].dtype)
        offset = 0
        for part in parts:
            b, t = part.shape[0], part.shape[1]
            host[offset : offset + b, :t].copy_(part)
            if t < length:
                host[offset : offset + b, t:].zero_()
            offset += b
        return host.to(self.device, non_blocking=True) if self._cuda else host

    def _key_padding(self, requests: list[AttentionRequest], n: int, s: int) -> torch.Tensor | None:
        """[N, S] bool, True for keys to ignore: the requests' own padding and the batch's."""
        if all(r.key_padding is None and r.key_len == s for r in requests):
            return None
        mask = self._host("key_padding", (n, s), torch.bool)
        offset = 0
        for r in requests:
            b, length = r.sequences, r.key_len
            rows = mask[offset : offset + b]
            if r.key_padding is None:
                rows[:, :length] = False
            else:
                rows[:, :length].copy_(r.key_padding)
            rows[:, length:] = True
            offset += b
        return mask.to(self.device, non_blocking=True) if self._cuda else mask

    def _to_host(self, role: str, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not self._cuda:
            return t
        host = self._host(role, tuple(t.shape), t.dtype)
        host.copy_(t, non_blocking=True)
        return host

    # -- the batch -------------------------------------------------------------------------

    def run(self, requests: list[AttentionRequest]) -> BatchReport:
        """Pads, computes and splits one batch. Requests share a BatchKey (the batcher ensures it)."""
        start = time.perf_counter()
        timer = _CudaPhases(self._stream) if self._stream is not None else None
        first = requests[0]
        n = sum(r.sequences for r in requests)
        length = max(r.query_len for r in requests)
        s = max(r.key_len for r in requests)
        stream = torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()
        with torch.inference_mode(), stream:
            # 1. stage inputs, padded to the batch's longest query and key
            query = self._stage("query", [r.query for r in requests], length)
            key = value = None
            if first.key is not None:
                key = self._stage("key", [r.key for r in requests], s)  # type: ignore[misc]
                # key_value sends one X' for both: stage (and copy to the device) once.
                shared = all(r.value is r.key for r in requests)
                value = key if shared else self._stage("value", [r.value for r in requests], s)  # type: ignore[misc]
            padding = self._key_padding(requests, n, s)
            if timer is not None:
                timer.mark(0)
            staged = time.perf_counter()
            # 2. compute
            out, weights = self._compute(
                query, key, value, padding, first.causal, first.need_weights, first.average_weights
            )
            if timer is not None:
                timer.mark(1)
            computed = time.perf_counter()
            # 3. bring results back; the host buffers are reused next batch, so copy out per request
            out_host = self._to_host("output", out)
            weights_host = self._to_host("weights", weights)
            if self._stream is not None:
                timer.mark(2)  # type: ignore[union-attr]
                self._stream.synchronize()
            synced = time.perf_counter()
            results = []
            offset = 0
            for r in requests:
                rows = slice(offset, offset + r.sequences)
                y = out_host[rows, : r.query_len]  # type: ignore[index]
                w = None
                if weights_host is not None:
                    w = weights_host[rows, ..., : r.query_len, : r.key_len]
                    w = w.clone() if self._cuda else w.contiguous()
                results.append(AttentionResult(y.clone() if self._cuda else y.contiguous(), w))
                offset += r.sequences
        end = time.perf_counter()
        total = end - start
        if timer is None:
            input_s, infer_s, output_s = staged - start, computed - staged, end - computed
        else:
            infer_s, copy_back_s = timer.seconds()
            output_s = copy_back_s + (end - synced)
            input_s = max(0.0, total - infer_s - output_s)  # host staging, copies in, launch latency
        real = sum(r.sequences * (r.query_len + r.key_len) for r in requests)
        return BatchReport(
            results=results,
            compute_s=total,
            input_s=input_s,
            infer_s=infer_s,
            output_s=output_s,
            sequences=n,
            tokens=sum(r.sequences * r.query_len for r in requests),
            padding_fraction=1.0 - real / (n * (length + s)),
        )

    def example_request(self, length: int, need_weights: bool = False) -> AttentionRequest:
        """A request of random data shaped for this model (warm-up and in-process benchmarks)."""
        spec = self.spec
        query = torch.randn(1, length, spec.embed_dim).to(spec.dtype)
        key = value = None
        if spec.kind is ModelKind.SDPA or not spec.self_attention:
            key = torch.randn(1, length, spec.kdim).to(spec.dtype)
            value = torch.randn(1, length, spec.vdim).to(spec.dtype)
        return AttentionRequest(query, key, value, None, False, need_weights, False, unbatched=False)

    def warmup(self) -> None:
        """Runs both paths (fused attention and explicit weights) once, so the first request is not slow."""
        length = min(64, self.spec.max_query_len, self.spec.max_key_len)
        for need_weights in (False, True):
            self.run([self.example_request(length, need_weights)])

    def close(self) -> None:
        self.executor.shutdown(wait=True)
