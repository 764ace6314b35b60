"""A device worker: owns one device and one model's weights; runs padded batches synchronously."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from attnserve_server.compute.attention import AttentionCompute
from attnserve_server.compute.staging import Slab, Stager, host_tensor, key_mask, split, to_numpy
from attnserve_server.compute.weights import Projections
from attnserve_server.domain import Answer, AttentionRequest, BatchReport, HostTensor, ModelKind, ModelSpec


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


# Below this much work (sequences x query length x embed_dim) a CPU batch runs on one intra-op thread:
# waking torch's other OpenMP threads costs more than they save. Measured on W1 (E=256, L=64, 2 cores,
# OMP_WAIT_POLICY=PASSIVE): 1 sequence 393 us on 1 thread vs 536 on 2; 2 sequences even (761 vs 750);
# 4 sequences 1509 vs 1235; 16 sequences 9036 vs 5467 (BENCHMARKS.md).
SMALL_BATCH_WORK = 2 * 64 * 256


class DeviceWorker:
    """Runs `run(requests) -> [Answer]` on one device, on its own thread (see `executor`)."""

    def __init__(
        self, spec: ModelSpec, params: Projections | None, device: torch.device, torch_threads: int | None = None
    ) -> None:
        self.spec = spec
        self.device = device
        self.name = str(device)
        self.dtype: torch.dtype = getattr(torch, spec.dtype.setting)
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
        self._stager = Stager(device, self.dtype)
        self._out = Slab(pinned=True) if self._cuda else None
        self._weights_out = Slab(pinned=True) if self._cuda else None
        on_device = None if params is None else params.to(device, self.dtype)
        self._compute = AttentionCompute(spec, on_device)
        self._threads: int | None = None  # the worker thread's intra-op threads, read on its first batch
        self._threads_now = 0

    def _fit_threads(self, work: int) -> None:
        """One intra-op thread for a small CPU batch, the configured count otherwise (0.1 us to switch)."""
        if self._threads is None:
            self._threads = torch.get_num_threads()
        wanted = 1 if work < SMALL_BATCH_WORK else self._threads
        if wanted != self._threads_now:
            torch.set_num_threads(wanted)
            self._threads_now = wanted

    def _to_host(self, slab: Slab | None, t: torch.Tensor | None) -> np.ndarray | None:
        """The batch's result on the host as numpy: one device-to-host copy into a reused pinned slab."""
        if t is None:
            return None
        if slab is None:
            return to_numpy(t.contiguous())
        host = slab.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return to_numpy(host)

    def run(self, requests: list[AttentionRequest]) -> list[Answer]:
        """Stages, computes and splits one batch. Requests share a BatchKey (the batcher ensures it)."""
        start = time.perf_counter()
        timer = _CudaPhases(self._stream) if self._stream is not None else None
        first = requests[0]
        n = sum(r.sequences for r in requests)
        length = max(r.query_len for r in requests)
        s = max(r.key_len for r in requests)
        if not self._cuda:
            self._fit_threads(n * length * self.spec.embed_dim)
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), stream:
            # 1. stage inputs, padded to the batch's longest query and key
            roles = [([r.query for r in requests], length)]
            if first.key is not None:
                roles.append(([r.key for r in requests], s))  # type: ignore[misc]
                # key_value sends one X' for both: stage (and copy to the device) once.
                shared = all(r.value is r.key for r in requests)
                if not shared:
                    roles.append(([r.value for r in requests], s))  # type: ignore[misc]
            tensors, padding = self._stager.stage(roles, key_mask(requests, n, s))
            query = tensors[0]
            key = value = None
            if first.key is not None:
                key = tensors[1]
                value = tensors[1] if len(tensors) == 2 else tensors[2]
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
            # 3. results to the host once (one copy each on CUDA), then one slice per request
            out_host = self._to_host(self._out, out)
            weights_host = self._to_host(self._weights_out, weights)
            if self._stream is not None:
                timer.mark(2)  # type: ignore[union-attr]
                self._stream.synchronize()
            synced = time.perf_counter()
            outputs = split(out_host, requests, key_axis=False)  # type: ignore[arg-type]
            weights_parts = split(weights_host, requests, key_axis=True) if weights_host is not None else None
        end = time.perf_counter()
        total = end - start
        if timer is None:
            input_s, infer_s, output_s = staged - start, computed - staged, end - computed
        else:
            infer_s, copy_back_s = timer.seconds()
            output_s = copy_back_s + (end - synced)
            input_s = max(0.0, total - infer_s - output_s)  # host staging, copies in, launch latency
        real = sum(r.sequences * (r.query_len + r.key_len) for r in requests)
        report = BatchReport(
            started=start,
            compute_s=total,
            input_s=input_s,
            infer_s=infer_s,
            output_s=output_s,
            requests=len(requests),
            sequences=n,
            tokens=sum(r.sequences * r.query_len for r in requests),
            padded_tokens=n * length,
            padding_fraction=1.0 - real / (n * (length + s)),
        )
        width = out_host.shape[-1]  # type: ignore[union-attr]
        heads = () if weights_host is None or weights_host.ndim == 3 else (weights_host.shape[1],)
        answers = []
        for i, r in enumerate(requests):
            answers.append(
                Answer(
                    output=outputs[i],
                    output_shape=(r.sequences, r.query_len, width),
                    weights=None if weights_parts is None else weights_parts[i],
                    weights_shape=None if weights_parts is None else (r.sequences, *heads, r.query_len, r.key_len),
                    batch=report,
                )
            )
        return answers

    def example_request(
        self, length: int, need_weights: bool = False, causal: bool = False, key_lengths: int | None = None
    ) -> AttentionRequest:
        """A request of random data shaped for this model (warm-up and in-process benchmarks)."""
        spec = self.spec

        def rand(width: int) -> HostTensor:
            return host_tensor(torch.randn(1, length, width).to(self.dtype))

        key = value = None
        if spec.kind is ModelKind.SDPA or not spec.self_attention:
            key, value = rand(spec.kdim), rand(spec.vdim)
        padding = None
        if key_lengths is not None:
            padding = np.arange(length)[None, :] >= key_lengths
        average = need_weights and spec.kind is ModelKind.MHA
        return AttentionRequest(rand(spec.embed_dim), key, value, padding, causal, need_weights, average, False)

    def warmup(self) -> None:
        """Runs every kernel kind (fused, masked, causal, explicit weights) at two sizes, so no request
        pays for a first call; mixed lengths exercise padding."""
        top = min(64, self.spec.max_query_len, self.spec.max_key_len)
        for length in sorted({max(1, top // 8), top}):
            self.run([self.example_request(length)])
            self.run(
                [self.example_request(length, causal=True), self.example_request(max(1, length // 2), causal=True)]
            )
            self.run([self.example_request(length, key_lengths=max(1, length // 2))])
            self.run([self.example_request(length, need_weights=True)])

    def close(self) -> None:
        self.executor.shutdown(wait=True)
