"""A device worker: owns one device and one model's weights; runs padded batches synchronously."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from attnserve_server.compute import scripted as scripted_path
from attnserve_server.compute.attention import AttentionCompute
from attnserve_server.compute.graphs import GraphedAttention
from attnserve_server.compute.groups import length_groups
from attnserve_server.compute.staging import (
    Slab,
    Stager,
    answer_bytes,
    answers_of,
    host_tensor,
    key_mask,
    over_bytes,
    to_numpy,
    write_into,
)
from attnserve_server.compute.threads import CpuThreads, ThreadChooser
from attnserve_server.compute.weights import Projections
from attnserve_server.domain import (
    Answer,
    AttentionRequest,
    BatchReport,
    HostTensor,
    ModelKind,
    ModelSpec,
    compute_macs,
)
from attnserve_server.errors import DeviceOutOfMemory, WorkerLost
from attnserve_server.runtime.os_threads import name_os_thread, named_threads

log = logging.getLogger(__name__)


def _padded(requests: list[AttentionRequest]) -> tuple[int, int, int]:
    """(sequences, longest query, longest key): the padded batch that requests run as together."""
    return (
        sum(r.sequences for r in requests),
        max(r.query_len for r in requests),
        max(r.key_len for r in requests),
    )


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


# torch's intra-op thread count as it stands when this module loads, before any thread sets its own: a
# CPU worker's "every thread" where none is configured. It cannot be asked later. Each thread's count is
# what it last set, and a thread that computes for the first time (the event loop's, at its first solo
# run) starts from whatever any thread set last (at::init_num_threads): the server's loop read 1 there,
# after the worker's warm-up had run small batches on one thread, and ran every solo request on one.
DEFAULT_THREADS = torch.get_num_threads()
# On CUDA a worker runs this many batches at once, each on a lane of its own (a thread, a stream and
# pinned buffers): while one batch computes, the next is staged and copied in (double buffering).
CUDA_LANES = 2
# Pinned buffers are sized at start-up for a batch of max_batch_tokens tokens, up to this much each;
# a larger batch grows them (attnserve_pinned_host_bytes shows what they hold).
PINNED_PRESIZE_CAP = 256 << 20


class _Lane:
    """What one in-flight batch needs on the worker: its stream, its staging slab and its output slabs."""

    def __init__(self, device: torch.device, dtype: torch.dtype, second: bool = False) -> None:
        cuda = device.type == "cuda"
        self.second = second  # a CPU worker's second runner: shared batches only, on its share of threads
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.stager = Stager(device, dtype)
        self.out = Slab(pinned=True) if cuda else None
        self.weights_out = Slab(pinned=True) if cuda else None
        self.graphs: GraphedAttention | None = None  # with cuda_graphs, on CUDA

    def presize(self, inputs: int, outputs: int) -> None:
        if self.stager.slab is not None and self.out is not None:
            self.stager.slab.take(min(inputs, PINNED_PRESIZE_CAP))
            self.out.take(min(outputs, PINNED_PRESIZE_CAP))

    def pinned_bytes(self) -> int:
        slabs = (self.stager.slab, self.out, self.weights_out)
        return sum(slab.capacity for slab in slabs if slab is not None)


# Warm-up runs the CPU's unmasked tiled path (a first call costs ~2 ms more: W1, 8 sequences) only where a
# batch of at most this many sequences reaches it (W1 8, in bfloat16 16): a model of few heads reaches it
# only with batches whose compute would lengthen the start far more than it spares one batch.
WARM_TILED_MAX_SEQUENCES = 16


class DeviceWorker:
    """Runs `run(requests) -> [Answer]` on one device, on threads of its own (see `executor`):
    `lanes` batches at once (on the CPU `cpu_lanes`, by default one; CUDA_LANES on a GPU).

    Several CPU lanes trade batch size for independence: each lane computes whole batches on its own
    thread, so no lane's thread waits at another's OpenMP barriers when the loop or a client preempts
    it. On 2 cores (BENCHMARKS.md, thirty-fourth pass, perf_analyzer then asking for the attention
    weights too) two lanes of one thread served WL at concurrency 32 7-8% more than one lane of two, and
    W1 0.90x, its batches half the size; with the output alone (thirty-fifth pass, single runs) WL
    reached 0.89 of the in-process limit on two lanes against 0.81-0.82 on one, and in pairs served
    1.062x one lane (thirty-sixth pass, perf_analyzer async, 4 of 4).

    Pairing (`cpu_pair_macs`, batching.py) gets that gain without the lanes' costs: one CPU lane of
    several threads gets a second runner (`runners` 2), which computes only while the first computes a
    shared batch, each on half the threads; a lone request and a small batch keep every thread. The
    second runner's batches always run on its share, so it never starts an OpenMP pool of its own (a
    second pool would cut the first's spin, model.py), and its thread is not one of the team that the
    quiet layout pins."""

    def __init__(
        self, spec: ModelSpec, params: Projections | None, device: torch.device, threads: CpuThreads | None = None
    ) -> None:
        self.spec = spec
        self.device = device
        self.name = str(device)
        self.dtype: torch.dtype = getattr(torch, spec.dtype.setting)
        self._cuda = device.type == "cuda"
        self.lanes = CUDA_LANES if self._cuda else spec.cpu_lanes
        self._threads = threads if threads is not None else CpuThreads()
        # A CPU batch's "every thread": what is configured, else the cores shared among the CPU lanes.
        self._most_threads = self._threads.count or max(1, DEFAULT_THREADS // (1 if self._cuda else self.lanes))
        # Pairing (class docstring): one CPU lane of several threads gets a second runner.
        self.pairs = not self._cuda and self.lanes == 1 and spec.cpu_pair_macs > 0 and self._most_threads > 1
        self.runners = self.lanes + self.pairs  # threads that take batches
        self._lanes = [_Lane(device, self.dtype, second=i >= self.lanes) for i in range(self.runners)]
        self._free_lanes = list(reversed(self._lanes))  # the first thread to start takes the first lane
        # What the OS calls the lanes' threads, and their OpenMP threads, which inherit the name.
        self.os_thread_name = f"attn-{self.name}"[:15]  # attn-cpu, attn-cuda:0
        self.thread_ids: list[int] = []  # the runners' threads' native ids: the first lane's first
        # On the CPU, the OpenMP threads of the lane's thread (its partners), once a batch has run on
        # several threads: those of its name that appeared since it started (runtime/cpu_layout.py
        # pins them apart while the server is quiet). Empty while every batch has run on one.
        self.partner_ids: list[int] = []
        self._named_at_start: set[int] = set()
        self._team_looks = 16  # batches on several threads that may still look for them (~100 µs each)
        self._local = threading.local()
        if self._cuda:
            itemsize = spec.dtype.itemsize
            tokens = spec.max_batch_tokens
            widths = spec.embed_dim + (0 if spec.self_attention else spec.kdim + spec.vdim)
            for lane in self._lanes:
                lane.presize(tokens * widths * itemsize, tokens * spec.output_dim * itemsize)
        # A thread per lane: torch releases the GIL in its kernels, and the event loop stays free.
        # OpenMP keeps its thread count per calling thread, so it is set on the worker's own thread
        # (and, on the CPU, per batch: compute/threads.py).
        self.executor = ThreadPoolExecutor(
            max_workers=self.runners, thread_name_prefix=f"attn-{spec.name}-{device}", initializer=self._start_thread
        )
        on_device = None if params is None else params.to(device, self.dtype)
        self._compute = AttentionCompute(
            spec, on_device, cpu_matmul=spec.cpu_matmul, fused_bound=spec.cpu_fused_bound, scripted=spec.cpu_scripted
        )
        if device.type == "cpu" and self._compute.fused and self._compute.tiled:
            max_macs = self._compute.sequence_max_macs
            log.info(
                "model %r on the CPU: the fused kernel's 1 MiB bound on scores applies to each %s%s "
                "(cpu_fused_bound: %s)",
                spec.name,
                self._compute.fused_bound,
                "" if max_macs is None else f", to each batch from {max_macs / 1e6:g} M multiply-adds a sequence",
                spec.cpu_fused_bound,
            )
        if device.type == "cpu" and params is not None:
            log.info(
                "model %r on the CPU: the projections multiply on %s (cpu_matmul: %s)",
                spec.name,
                "oneDNN, weights packed once" if self._compute.cpu_matmul == "onednn" else "torch's F.linear",
                spec.cpu_matmul,
            )
        if device.type == "cpu" and spec.cpu_scripted and not self._compute.scripted:
            log.warning(
                "model %r on the CPU: the tiled and explicit paths, and a batch's length groups, compute op by op, "
                "as this torch cannot script them (%s)",
                spec.name,
                scripted_path.UNSCRIPTED,
            )
        if self._cuda:
            # The weights and biases were made on the device's default stream; the lanes' streams
            # do not wait for it.
            torch.cuda.synchronize(device)
        if self._cuda and spec.cuda_graphs:
            capture_lock = threading.Lock()
            for lane in self._lanes:
                lane.graphs = GraphedAttention(self._compute, device, self.dtype, spec.max_batch_size, capture_lock)

    def _start_thread(self) -> None:
        """Each executor thread takes a lane of its own for good, and computes without autograd."""
        lane = self._local.lane = self._free_lanes.pop()
        name_os_thread(self.os_thread_name)  # its OpenMP threads too
        self._local.lane_thread = True
        torch.set_grad_enabled(False)  # thread-local; `serve` and `warmup` add inference mode (`run`)
        # Set a count now, even the one the thread would take anyway: torch's one pthreadpool per process
        # (XNNPACK's, idle here) is made by the first thread that sets a count, with that many threads, named
        # after it. Made here, before the look below, it is not taken for one of this lane's OpenMP team.
        torch.set_num_threads(self._threads.count or torch.get_num_threads())
        if lane is self._lanes[0]:
            self.thread_ids.insert(0, threading.get_native_id())
            if not self._cuda:  # the first lane's OpenMP pool not yet started (a second runner's never starts)
                self._named_at_start = named_threads(self.os_thread_name)
        else:
            self.thread_ids.append(threading.get_native_id())

    def _set_cpu_threads(self, macs: int, requests: int) -> tuple[int, ThreadChooser | None]:
        """Sets this thread's intra-op threads for a CPU batch (compute/threads.py says why). Returns the
        threads set, and the thread's chooser if it learns from this batch's time (else None)."""
        local = self._local
        if not hasattr(local, "chooser"):  # this thread's first batch: what it may use at most
            local.chooser = self._threads.chooser(self._most_threads)
            local.current = None  # a thread the executor did not start (the event loop's) is not set yet
            # torch sets a thread's OpenMP count up lazily, when the thread first asks for it or runs a
            # parallel loop, to the count that any thread set last: a second runner that set one thread
            # then computed on the two its first runner had just set. Asking now does that set-up before
            # this thread sets its own count below, so its own count stands.
            torch.get_num_threads()
        chooser: ThreadChooser = local.chooser
        if local.current and local.current > 1 and self._team_looks and getattr(local, "lane_thread", False):
            # The last batch ran on several threads, so the pool has likely started: which threads are its.
            ours = named_threads(self.os_thread_name) - self._named_at_start - set(self.thread_ids)
            self.partner_ids = sorted(ours)
            self._team_looks = 0 if self.partner_ids else self._team_looks - 1
        if self._paired():
            wanted, measured = max(1, self._most_threads // 2), False  # its share of the threads
        else:
            wanted, measured = chooser.pick(macs, requests)
        if wanted != local.current:
            torch.set_num_threads(wanted)
            local.current = wanted
        return wanted, chooser if measured else None

    def _paired(self) -> bool:
        """Whether the calling thread computes a paired batch: beside another, on a share of the threads."""
        local = self._local
        lane: _Lane | None = getattr(local, "lane", None)
        return getattr(local, "shared", False) or (lane is not None and lane.second)

    @property
    def team_size(self) -> int:
        """Threads a CPU batch computes on at most: the lane's thread and its OpenMP partners."""
        return self._most_threads

    def one_thread_alone(self, macs: int) -> bool:
        """Whether a lone request of `macs` multiply-adds runs on one intra-op thread by size alone (on the
        CPU: compute/threads.py), so that computing it starts no OpenMP pool on the calling thread."""
        return self._threads.for_batch(self._most_threads, macs, 1) == 1

    def pinned_bytes(self) -> int:
        """Page-locked host memory the worker holds (0 on the CPU)."""
        return sum(lane.pinned_bytes() for lane in self._lanes)

    def _to_host(self, slab: Slab | None, t: torch.Tensor | None) -> np.ndarray | None:
        """The batch's result on the host as numpy: one device-to-host copy into a reused pinned slab."""
        if t is None:
            return None
        if slab is None:
            return to_numpy(t)  # numpy takes any strides; split copies each answer out
        host = slab.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return to_numpy(host)

    def run(self, requests: list[AttentionRequest]) -> list[Answer]:
        """Stages, computes and splits one batch. Requests share a BatchKey (the batcher ensures it).

        On the CPU a batch of mixed lengths runs as groups of similar length (compute/groups.py)."""
        # Nothing here needs autograd (no weight or input requires grad). The worker's threads compute in
        # inference mode for good (`serve`, `warmup`): no op does autograd's bookkeeping, and a view keeps
        # no reference to its base, which since torch 2.10 takes the GIL inside the op when Python owns
        # the base (on the CPU a tie in pairs, W1 and WL: BENCHMARKS.md, fifty-fourth pass). The event
        # loop's thread, which computes solo runs, has autograd off for good (model.py) and computes as
        # it is: an inference_mode context per run took ~20 µs of a lone request on a cache-cold CPU
        # (fourteenth pass). Any other caller (tests, the in-process benchmark) computes in inference
        # mode for the batch, as does every caller on CUDA: a lane's reused buffers (pinned slabs, CUDA
        # graphs' inputs), made in inference mode, take writes only in it.
        if not torch.is_inference_mode_enabled() and (self._cuda or torch.is_grad_enabled()):
            with torch.inference_mode():
                return self._run_guarded(requests)
        return self._run_guarded(requests)

    def _run_guarded(self, requests: list[AttentionRequest]) -> list[Answer]:
        """`_run`, with a device's failures told apart from a batch's."""
        try:
            return self._run(requests)
        except torch.cuda.OutOfMemoryError as exc:  # the device serves on: a smaller batch may fit
            # (torch.cuda's name for it: torch.OutOfMemoryError, the same class, is new in torch 2.5; either
            # works at the floor, 2.6)
            sequences = sum(r.sequences for r in requests)
            raise DeviceOutOfMemory(
                f"{self.name} ran out of memory for a batch of {len(requests)} request(s), {sequences} sequence(s): "
                f"{str(exc).splitlines()[0] if str(exc) else 'out of memory'}"
            ) from exc
        except Exception as exc:
            if self._cuda and not self._device_usable():
                raise WorkerLost(f"{self.name} can compute no more: {type(exc).__name__}: {exc}") from exc
            raise  # the batch's failure: the device serves on

    def _device_usable(self) -> bool:
        """Whether the CUDA device still computes after a batch failed. Most errors (out of memory, a bad
        shape) leave it usable; an illegal address, a device-side assert or a lost GPU poison the
        process's CUDA context, and every later call fails: only a new process recovers."""
        try:
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()
                return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:
            return False

    def run_shared(self, requests: list[AttentionRequest]) -> list[Answer]:
        """`run`, on this runner's share of the threads: another batch computes beside it (pairing)."""
        local = self._local
        local.shared = True
        try:
            return self.run(requests)
        finally:
            local.shared = False

    def serve(self, serve: Callable[..., None], done: Callable[..., None]) -> None:
        """Serves a batcher on the calling executor thread for good: `serve(run, done, shared=, second=)`
        (Batcher.serve), this thread's lane the first or, with pairing, the second runner."""
        lane: _Lane = self._local.lane
        with torch.inference_mode():  # for good on this thread (`run` says why)
            serve(self.run, done, shared=self.run_shared if self.pairs else None, second=lane.second)

    def _run(self, requests: list[AttentionRequest]) -> list[Answer]:
        if len(requests) == 1 and not self._cuda:
            return [self._run_alone(requests[0])]
        start = time.perf_counter()
        # A call from outside the executor (the event loop's solo runs while the lane's thread is idle,
        # tests, the in-process benchmark) runs on the first lane.
        lane: _Lane = getattr(self._local, "lane", self._lanes[0])
        groups = [requests] if self._cuda else length_groups(self.spec, requests)
        shapes = [_padded(group) for group in groups]
        chooser = None
        threads = 0
        if not self._cuda:
            macs = sum(compute_macs(self.spec, *shape) for shape in shapes)
            threads, chooser = self._set_cpu_threads(macs, len(requests))
        staged_s = computed_s = 0.0
        gpu_s = None
        parts: list[tuple[bytes | memoryview, bytes | memoryview | None, bool]] = []  # (output, weights, in place)
        heads: tuple[int, ...] = ()
        # On the CPU the output is a tensor of this batch's own, so answers may be views of it; on
        # CUDA it lies in the lane's pinned slab, which the next batch overwrites: answers copy out.
        # A request that brought room for its answer (an edge process's arena) has it written there.
        fresh = lane.out is None
        # What the batch's thread spends on a CPU, for its chooser: a core it waits for (or the GIL)
        # is one the event loop wants (compute/threads.py).
        cpu_start, wall_start = (time.thread_time(), time.perf_counter()) if chooser is not None else (0.0, 0.0)
        if len(groups) == 1:
            out_host, weights_host, (staged_s, computed_s, gpu_s) = self._run_group(lane, groups[0], shapes[0])
            results = [(out_host, weights_host)]
        else:
            results, (staged_s, computed_s) = self._run_groups(lane, groups, shapes)
        for group, (out_host, weights_host) in zip(groups, results, strict=True):
            parts += answers_of(out_host, weights_host, group, views=fresh)
            if weights_host is not None:
                heads = () if weights_host.ndim == 3 else (weights_host.shape[1],)
        if chooser is not None:
            # A share: the two clocks tick apart, so on a short batch the ratio can read a little over 1.
            on_cpu = min((time.thread_time() - cpu_start) / max(time.perf_counter() - wall_start, 1e-9), 1.0)
            chooser.record(threads, macs, computed_s, len(requests), on_cpu)
        width = out_host.shape[-1]
        if groups[0] is not requests:  # grouped by length: back in the batch's order
            order = {id(r): i for i, r in enumerate(r for group in groups for r in group)}
            parts = [parts[order[id(r)]] for r in requests]
        end = time.perf_counter()
        total = end - start
        if gpu_s is None:
            input_s, infer_s, output_s = staged_s, computed_s, total - staged_s - computed_s
        else:  # one group on CUDA: the GPU's own clocks
            infer_s, output_s = gpu_s
            input_s = max(0.0, total - infer_s - output_s)  # host staging, copies in, launch latency
        real = sum(r.sequences * (r.query_len + r.key_len) for r in requests)
        report = BatchReport(
            started=start,
            compute_s=total,
            input_s=input_s,
            infer_s=infer_s,
            output_s=output_s,
            requests=len(requests),
            sequences=sum(n for n, _, _ in shapes),
            tokens=sum(r.sequences * r.query_len for r in requests),
            padded_tokens=sum(n * length for n, length, _ in shapes),
            padding_fraction=1.0 - real / sum(n * (length + s) for n, length, s in shapes),
            threads=threads,
            paired=not self._cuda and self._paired(),
        )
        answers = []
        for r, (output, weights, in_place) in zip(requests, parts, strict=True):
            answers.append(
                Answer(
                    output=output,
                    output_shape=(r.sequences, r.query_len, width),
                    weights=weights,
                    weights_shape=None if weights is None else (r.sequences, *heads, r.query_len, r.key_len),
                    batch=report,
                    in_place=in_place,
                )
            )
        return answers

    def _run_alone(self, r: AttentionRequest) -> Answer:
        """A lone request on the CPU: the batch path without its batch work. Its inputs' bytes are its
        tensors, with no padding, no mask but its own and nothing to pack (the one-part case of
        `Stager`), and its output is its answer, with nothing to cut (the one-request case of `split`).
        At concurrency 1 every request takes it. In-process, the batch path's Python around a W1
        request's forward pass (grouping, staging, splitting, the report's sums) took ~200 µs, this
        path's ~120 (BENCHMARKS.md, twenty-eighth pass)."""
        start = time.perf_counter()
        n, length, s = r.sequences, r.query_len, r.key_len
        macs = compute_macs(self.spec, n, length, s)
        threads, chooser = self._set_cpu_threads(macs, 1)
        query = over_bytes(r.query, self.dtype)
        key = value = None
        if r.key is not None:
            key = over_bytes(r.key, self.dtype)
            value = key if r.value is r.key else over_bytes(r.value, self.dtype)  # type: ignore[arg-type]
        padding = None if r.key_padding is None else torch.from_numpy(np.ascontiguousarray(r.key_padding, np.bool_))
        staged = time.perf_counter()
        out, weights = self._compute(query, key, value, padding, r.causal, r.need_weights, r.average_weights)
        computed = time.perf_counter()
        if chooser is not None:
            chooser.record(threads, macs, computed - staged, 1)
        output = to_numpy(out)
        weights_host = None if weights is None else to_numpy(weights)
        placed = None if r.answer_into is None else write_into(r.answer_into, output, weights_host)
        end = time.perf_counter()
        report = BatchReport(
            started=start,
            compute_s=end - start,
            input_s=staged - start,
            infer_s=computed - staged,
            output_s=end - computed,
            requests=1,
            sequences=n,
            tokens=n * length,
            padded_tokens=n * length,
            padding_fraction=0.0,
            threads=threads,
            paired=not self._cuda and self._paired(),
        )
        if placed is not None:
            answer_out, answer_weights = placed
        else:
            answer_out = answer_bytes(output, view=True)
            answer_weights = None if weights_host is None else answer_bytes(weights_host, view=True)
        return Answer(
            output=answer_out,
            output_shape=(n, length, output.shape[-1]),
            weights=answer_weights,
            weights_shape=None if weights_host is None else (n, *weights_host.shape[1:-2], length, s),
            batch=report,
            in_place=placed is not None,
        )

    @staticmethod
    def _stage(
        lane: _Lane, requests: list[AttentionRequest], shape: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The requests' inputs as one batch of `shape` (sequences, longest query, longest key), padded:
        the query, the key and the value (None for self attention), and the key padding mask (or None)."""
        first = requests[0]
        n, length, s = shape
        roles = [([r.query for r in requests], length)]
        if first.key is not None:
            roles.append(([r.key for r in requests], s))  # type: ignore[misc]
            # key_value sends one X' for both: stage (and copy to the device) once.
            if not all(r.value is r.key for r in requests):
                roles.append(([r.value for r in requests], s))  # type: ignore[misc]
        tensors, padding = lane.stager.stage(roles, key_mask(requests, n, s))
        if first.key is None:
            return tensors[0], None, None, padding
        return tensors[0], tensors[1], tensors[1] if len(tensors) == 2 else tensors[2], padding

    def _run_groups(
        self, lane: _Lane, groups: list[list[AttentionRequest]], shapes: list[tuple[int, int, int]]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray | None]], tuple[float, float]]:
        """A CPU batch's length groups, each run as one padded batch: all staged, then all computed in one
        call into torch where it pays (AttentionCompute.compute: each call gives up the GIL and must take it
        back, and a batch of mixed lengths at concurrency 32 waited ~20% of its time so, group after group;
        BENCHMARKS.md, sixty-eighth pass). Returns each group's output (and weights) as numpy, and the
        seconds spent staging and computing. The CPU's staged tensors are each group's own (no reused slab),
        so every group's inputs live until the call ends."""
        assert lane.stager.slab is None, "a reused slab would hold one group's inputs at a time"
        start = time.perf_counter()
        plans = []
        for group, shape in zip(groups, shapes, strict=True):
            query, key, value, padding = self._stage(lane, group, shape)
            first = group[0]
            plans.append(
                self._compute.plan(query, key, value, padding, first.causal, first.need_weights, first.average_weights)
            )
        staged = time.perf_counter()
        results = self._compute.compute(plans)
        computed = time.perf_counter()
        hosts = [(to_numpy(y), None if w is None else to_numpy(w)) for y, w in results]
        return hosts, (staged - start, computed - staged)

    def _run_group(
        self, lane: _Lane, requests: list[AttentionRequest], shape: tuple[int, int, int]
    ) -> tuple[np.ndarray, np.ndarray | None, tuple[float, float, tuple[float, float] | None]]:
        """Runs requests as one batch of `shape` (sequences, longest query, longest key). Returns the
        output (and weights) on the host, and the seconds spent staging and computing, with on CUDA
        the GPU's own (attention, copies back)."""
        start = time.perf_counter()
        timer = _CudaPhases(lane.stream) if lane.stream is not None else None
        first = requests[0]
        stream = torch.cuda.stream(lane.stream) if lane.stream is not None else contextlib.nullcontext()
        with stream:
            # 1. stage inputs, padded to the longest query and key
            query, key, value, padding = self._stage(lane, requests, shape)
            if timer is not None:
                timer.mark(0)
            staged = time.perf_counter()
            # 2. compute
            graphs = lane.graphs
            out = None
            if graphs is not None and graphs.takes(query, key, padding, first.causal, first.need_weights):
                try:
                    out, weights = graphs(query), None
                except RuntimeError as exc:  # a capture that failed: the ordinary path from now on
                    graphs.disable(exc)
            if out is None:
                out, weights = self._compute(
                    query, key, value, padding, first.causal, first.need_weights, first.average_weights
                )
            if timer is not None:
                timer.mark(1)
            computed = time.perf_counter()
            # 3. results to the host once (one copy each on CUDA)
            out_host = self._to_host(lane.out, out)
            weights_host = self._to_host(lane.weights_out, weights)
            gpu_s = None
            if timer is not None:
                timer.mark(2)
                lane.stream.synchronize()  # type: ignore[union-attr]
                gpu_s = timer.seconds()
        return out_host, weights_host, (staged - start, computed - staged, gpu_s)  # type: ignore[return-value]

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
        """Runs every kernel kind (fused, the CPU's tiled path unmasked where a batch reaches it, masked and
        causal, explicit weights) at two sizes, so no request pays for a first call; mixed lengths exercise
        padding. In inference mode, as `serve` computes: what it makes and keeps (CUDA graphs' buffers,
        packed weights) is made so."""
        with torch.inference_mode():
            self._warmup()

    def _warmup(self) -> None:
        top = min(64, self.spec.max_query_len, self.spec.max_key_len)
        for length in sorted({max(1, top // 8), top}):
            self.run([self.example_request(length)])
            tiled = self._smallest_unmasked_tiled_batch(length)
            if tiled:
                self.run([self.example_request(length) for _ in range(tiled)])
            self.run(
                [self.example_request(length, causal=True), self.example_request(max(1, length // 2), causal=True)]
            )
            self.run([self.example_request(length, key_lengths=max(1, length // 2))])
            self.run([self.example_request(length, need_weights=True)])
            graphs = getattr(self._local, "lane", self._lanes[0]).graphs
            if graphs is not None and self._compute.fused and self.spec.self_attention:
                # this lane's graphs for every batch bucket at this length
                for bucket in graphs.buckets():
                    self.run([self.example_request(length) for _ in range(bucket)])
        # What this thread's chooser timed here misleads it: warm-up batches run cold and at other sizes
        # than the requests' (one at WL, 3-5x its usual cost on two threads, kept it on one thread for
        # 20-40 s under load; BENCHMARKS.md, fifteenth pass). The first served batches start it afresh.
        self._local.__dict__.pop("chooser", None)

    def _smallest_unmasked_tiled_batch(self, length: int) -> int:
        """On the CPU, the fewest unmasked sequences of this length that make a batch on the tiled path
        (compute/attention.py), where that is more than one, fits the batch limits and is cheap enough to
        warm up (at most WARM_TILED_MAX_SEQUENCES); else 0."""
        if self._cuda or not self._compute.fused or not self.spec.self_attention:
            return 0
        n = self._compute.smallest_tiled_batch(length, self.dtype.itemsize)
        if n is None:
            return 0
        fits = n <= min(WARM_TILED_MAX_SEQUENCES, self.spec.max_batch_size) and n * length <= self.spec.max_batch_tokens
        return n if n > 1 and fits else 0

    def close(self) -> None:
        self.executor.shutdown(wait=True)
