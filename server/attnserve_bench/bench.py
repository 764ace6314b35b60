"""attnserve bench: closed-loop load from several processes, a concurrency sweep, and the in-process limit.

Each client process runs an asyncio client with its share of the concurrency; every
in-flight slot sends its next request as soon as the previous one answers. After the
sweep, the same model runs in this process, without gRPC, at the batch size the server
reached, and each row shows the server's throughput as a ratio of that limit. With
--rounds N the sweep runs N times, each level followed at once by its own limit, and the
table gives medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import numpy as np

from attnserve_bench.process import ServeExited, spawn_serve
from attnserve_bench.results import Row, medians, plot, table
from attnserve_server.connect import (
    Refused,
    add_connection_flags,
    comma_list,
    connection_from,
    lengths,
    output_file,
    positive_number,
    seconds,
    seconds_or_zero,
    target,
    whole_number,
)
from attnserve_server.runtime import allocator, openmp


def _pa_modes(text: str) -> tuple[str, ...]:
    """--pa-modes: perf_analyzer's modes, checked before anything starts."""
    modes = tuple(mode.strip() for mode in text.split(","))
    if not all(mode in ("sync", "async", "streaming") for mode in modes):
        raise argparse.ArgumentTypeError(f"expected sync, async, streaming or a comma list of them, got {text!r}")
    return modes


def _executable(text: str) -> str:
    """--perf-analyzer: a binary that exists and may be run (a path, or a name on PATH), checked before
    anything starts; before, a wrong path was a traceback after the servers had started."""
    found = shutil.which(text)
    if found is None:
        why = "not executable" if os.path.isfile(text) else "no such file, nor a command on PATH"
        raise argparse.ArgumentTypeError(
            f"expected perf_analyzer's binary (scripts/perf_analyzer.sh --setup prints its path), got {text!r} ({why})"
        )
    return os.path.abspath(found)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="closed-loop load generator: concurrency sweep, latency percentiles, in-process ratio",
        description="Closed-loop benchmark. Without --target it starts its own server (one per "
        "--max-batch-size value) with the model flags given here, on 127.0.0.1.",
    )
    p.add_argument("--target", type=target, help="benchmark a running server instead of starting one")
    add_connection_flags(p)  # for --target: the servers bench starts itself are plaintext
    p.add_argument("--model", default="default", help="model name (default 'default')")
    p.add_argument(
        "--concurrency",
        type=comma_list("a number of requests"),
        default=(1, 8, 32, 64),
        help="comma list of in-flight requests (default 1,8,32,64)",
    )
    p.add_argument("--duration-s", type=seconds, default=8.0, help="measured seconds per level (default 8)")
    p.add_argument(
        "--warmup-s", type=seconds_or_zero, default=2.0, help="unmeasured seconds before each level (default 2)"
    )
    p.add_argument("--processes", type=whole_number, help="client processes (default: min(concurrency, cores))")
    p.add_argument("--batch", type=whole_number, default=1, help="sequences per request (default 1)")
    p.add_argument(
        "--seq-len",
        type=lengths,
        default=(64,),
        help="query length L, or a comma list of lengths the requests take in turn: mixed lengths, "
        "one per request (default 64)",
    )
    p.add_argument("--kv-len", type=whole_number, help="key length S: cross attention (MHA) or K/V length (sdpa)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--json", type=output_file, help="also write the results to this JSON file")
    p.add_argument(
        "--plot",
        type=output_file,
        help="also draw throughput against p50 and p99 latency, one line per server, to this image file "
        "(needs matplotlib: pip install 'attnserve[plot]')",
    )
    p.add_argument(
        "--shared-memory",
        action="store_true",
        help="send over the KServe v2 API with every tensor in Triton's system shared memory: each client process "
        "registers one region for its inputs and its slots' outputs, and the messages carry none of their bytes "
        "(the server needs --allow-client-shm, which the servers bench starts get). With --perf-analyzer, its "
        "--shared-memory system, which takes only a model without optional inputs: the servers bench starts get "
        "--optional-inputs none (MHA self attention or sdpa only, no --kv-len with mha)",
    )
    p.add_argument("--no-inprocess", action="store_true", help="skip the in-process limit")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also load a bare gRPC server that echoes the query (no queue, no compute): the transport floor",
    )
    p.add_argument(
        "--inprocess-s",
        type=seconds,
        default=3.0,
        help="seconds per in-process measurement; a CPU worker that pairs is timed both ways, whole batches "
        "and two batches side by side, and the faster is the limit (default 3)",
    )
    p.add_argument(
        "--rounds",
        type=whole_number,
        default=1,
        help="measure every level this many times in turn, each followed at once by its own in-process "
        "limit (the server idle meanwhile), and print medians: the ratio is the median of the rounds' "
        "ratios, so a machine whose speed drifts between measurements skews it less (default 1: the "
        "limit is measured once per batch size, after the servers stop)",
    )
    p.add_argument(
        "--perf-analyzer",
        metavar="PATH",
        type=_executable,
        help="drive the load with Triton's perf_analyzer (this binary) over the KServe v2 API instead of the "
        "built-in client; it reports the server-side statistics too (scripts/perf_analyzer.sh sets it up)",
    )
    p.add_argument(
        "--pa-modes",
        type=_pa_modes,
        default="sync,async",
        help="with --perf-analyzer: comma list of sync, async, streaming (default sync,async)",
    )
    p.add_argument(
        "--pa-stability",
        type=positive_number,
        default=50.0,
        metavar="PERCENT",
        help="with --perf-analyzer: the spread its windows may show and still count as stable, in per cent "
        "(default 50: a noisy machine); it tries 5 windows, then fails the level",
    )
    g = p.add_argument_group("server started by bench (ignored with --target)")
    g.add_argument("--kind", default="mha")
    g.add_argument("--embed-dim", type=int, default=256)
    g.add_argument("--num-heads", type=int, default=8)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--device", default="auto")
    g.add_argument("--max-batch-size", default="64", help="comma list: one server (and sweep) per value")
    g.add_argument(
        "--edge-processes",
        default="auto",
        help="comma list: gRPC edge processes (a count, or auto: the server's default), one server (and sweep) each",
    )
    g.add_argument("--max-batch-tokens", type=int, default=65536)
    g.add_argument("--max-queue-delay-ms", type=float, default=0.0)
    g.add_argument("--torch-threads", type=int)


FLOOR = "grpc floor (echo)"
READY_TIMEOUT_S = 120.0  # for the spawned client processes to import the client and connect
EXIT_GRACE_S = 20.0  # for a client process to exit once it has put its results


# -- client processes -----------------------------------------------------------------------


def _client_process(
    target: str,
    connection: dict[str, Any],
    requests: list[bytes] | SharedMemoryLoad,
    concurrency: int,
    start: StartLine,
    warmup_s: float,
    duration_s: float,
    progress: Any,
    slot: int,
    results: Any,
) -> None:
    # Like perf_analyzer: the request is encoded once, sent through the generated stub with the
    # client's channel options, and only the answer's timing is read, so the load generator spends
    # as little of the machine's CPU as Python allows. (The client's codec is tested, not timed here.)
    import grpc
    import grpc.aio

    from attnserve._channel import DEFAULT_MAX_MESSAGE_BYTES, channel_credentials, channel_options
    from attnserve.v1 import attention_pb2 as pb

    token = connection.get("token")
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    credentials = channel_credentials(connection["tls"], connection["ca"], connection["cert"], connection["key"], None)

    async def main() -> Window:
        options = channel_options(DEFAULT_MAX_MESSAGE_BYTES, retries=False)
        channel = (
            grpc.aio.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options)
        )
        async with channel:
            per_slot: list[list[bytes]] = []
            if isinstance(requests, SharedMemoryLoad):
                from attnserve_server.protocol import open_inference_pb2 as v2

                infer = channel.unary_unary(
                    "/inference.GRPCInferenceService/ModelInfer",
                    request_serializer=None,
                    response_deserializer=v2.ModelInferResponse.FromString,
                )

                async def send(request: bytes) -> int:
                    reply = await infer(request, timeout=30, wait_for_ready=True, metadata=metadata)
                    return reply.parameters["batch_size"].int64_param

                per_slot = await requests.register(channel, metadata, concurrency)
            else:
                attend = channel.unary_unary(
                    "/attnserve.v1.AttentionService/Attend",
                    request_serializer=None,  # already bytes
                    response_deserializer=pb.AttendResponse.FromString,
                )

                async def send(request: bytes) -> int:
                    reply = await attend(request, timeout=30, wait_for_ready=True, metadata=metadata)
                    return reply.timing.batch_size

                per_slot = [requests] * concurrency  # type: ignore[list-item]

            def measured() -> None:
                progress[slot] += 1

            try:
                await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(f"could not connect to {target} within {READY_TIMEOUT_S:.0f} s") from None
            start_at = await asyncio.to_thread(start.ready_and_wait)
            window = Window(start_at + warmup_s, start_at + warmup_s + duration_s)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            try:
                await asyncio.gather(
                    *(
                        closed_loop(send, per_slot[i], slot * concurrency + i, window, grpc.aio.AioRpcError, measured)
                        for i in range(concurrency)
                    )
                )
            finally:
                if isinstance(requests, SharedMemoryLoad):
                    await requests.unregister(channel, metadata)
            return window

    window = asyncio.run(main())
    results.put((window.latencies, window.batches, window.errors))


class SharedMemoryLoad:
    """A client process's requests with their tensors in Triton's system shared memory: one POSIX shared
    memory object per process holds every request's inputs, then one output slot per in-flight request,
    registered as one region; each slot's requests name its own output place, so answers in flight never
    overwrite each other. The request messages carry names, shapes and places, and no tensor bytes."""

    ALIGN = 64

    def __init__(self, model: str, datatype: str, inputs: list[dict[str, Any]], output_bytes: list[int]) -> None:
        from attnserve._codec import float32_to_bfloat16_bits

        self.model = model
        self.datatype = datatype  # KServe's name of the model's float type: FP32, FP16 or BF16
        cast = {
            "FP32": lambda a: a.astype("<f4"),
            "FP16": lambda a: a.astype("<f2"),
            "BF16": lambda a: float32_to_bfloat16_bits(a.astype("<f4")),
        }[self.datatype]
        # The float inputs in the model's dtype, as the bytes the region will hold.
        self.inputs = [{k: cast(v) for k, v in one.items() if isinstance(v, np.ndarray)} for one in inputs]
        self.output_bytes = output_bytes  # per request, in the order of `inputs`
        self._memory: Any = None
        self._region = ""

    def _aligned(self, n: int) -> int:
        return -(-n // self.ALIGN) * self.ALIGN

    async def register(self, channel: Any, metadata: Any, slots: int) -> list[list[bytes]]:
        """Creates and fills the object, registers its region, and returns each slot's requests."""
        from multiprocessing import shared_memory

        from attnserve_server.protocol import open_inference_pb2 as v2

        placed: list[list[tuple[str, tuple[int, ...], int, int]]] = []
        at = 0
        for one in self.inputs:
            tensors = []
            for name, array in one.items():
                tensors.append((name, array.shape, at, array.nbytes))
                at += self._aligned(array.nbytes)
            placed.append(tensors)
        room = self._aligned(max(self.output_bytes))
        outputs_at = at
        size = outputs_at + slots * room
        self._memory = memory = shared_memory.SharedMemory(create=True, size=size)
        for one, tensors in zip(self.inputs, placed, strict=True):
            for name, _, offset, nbytes in tensors:
                memory.buf[offset : offset + nbytes] = one[name].tobytes()
        self._region = f"bench-{os.getpid()}"
        register = channel.unary_unary(
            "/inference.GRPCInferenceService/SystemSharedMemoryRegister",
            request_serializer=v2.SystemSharedMemoryRegisterRequest.SerializeToString,
            response_deserializer=v2.SystemSharedMemoryRegisterResponse.FromString,
        )
        await register(
            v2.SystemSharedMemoryRegisterRequest(name=self._region, key="/" + memory.name, byte_size=size),
            timeout=30,
            metadata=metadata,
        )
        per_slot = []
        for slot in range(slots):
            requests = []
            for tensors, out_bytes in zip(placed, self.output_bytes, strict=True):
                msg = v2.ModelInferRequest(model_name=self.model)
                for name, shape, offset, nbytes in tensors:
                    t = msg.inputs.add(name=name, datatype=self.datatype, shape=shape)
                    t.parameters["shared_memory_region"].string_param = self._region
                    t.parameters["shared_memory_offset"].int64_param = offset
                    t.parameters["shared_memory_byte_size"].int64_param = nbytes
                out = msg.outputs.add(name="output")
                out.parameters["shared_memory_region"].string_param = self._region
                out.parameters["shared_memory_offset"].int64_param = outputs_at + slot * room
                out.parameters["shared_memory_byte_size"].int64_param = out_bytes
                requests.append(msg.SerializeToString())
            per_slot.append(requests)
        return per_slot

    async def unregister(self, channel: Any, metadata: Any) -> None:
        from attnserve_server.protocol import open_inference_pb2 as v2

        unregister = channel.unary_unary(
            "/inference.GRPCInferenceService/SystemSharedMemoryUnregister",
            request_serializer=v2.SystemSharedMemoryUnregisterRequest.SerializeToString,
            response_deserializer=v2.SystemSharedMemoryUnregisterResponse.FromString,
        )
        try:
            await unregister(v2.SystemSharedMemoryUnregisterRequest(name=self._region), timeout=30, metadata=metadata)
        finally:
            self._memory.close()
            self._memory.unlink()


def _reap(workers: list[Any], grace_s: float) -> None:
    """Joins client processes whose results are in; one still running `grace_s` later (stuck in its
    interpreter's exit: gRPC's threads have hung a process's exit before) is killed, with a warning,
    so that a measurement already made is never held hostage by a process that should be gone."""
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            print(f"warning: client process {w.pid} had not exited {grace_s:g} s after its results: killed",
                  file=sys.stderr)  # fmt: skip
            w.kill()
            w.join()


class StartLine:
    """Starts the client processes' clocks together once every one of them has imported the client and
    connected, however long the spawned interpreters take (seconds on a loaded 2-core CI machine), so a
    short window is never over before its clients exist."""

    LEAD_S = 0.1  # from the last one ready to the common start

    def __init__(self, ctx: Any) -> None:
        self._ready = ctx.Semaphore(0)
        self._go = ctx.Event()
        self._at = ctx.Value("d", 0.0, lock=False)

    def ready_and_wait(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """In a client process: report ready, wait for the start, return its wall-clock time."""
        self._ready.release()
        if not self._go.wait(timeout_s):  # the parent gave up on a sibling, or died
            raise RuntimeError(f"no start within {timeout_s:.0f} s of this client being ready")
        return float(self._at.value)

    def start_when_ready(self, processes: list[Any], timeout_s: float) -> None:
        """In the parent: wait until every process is ready, then set the common start."""
        deadline = time.monotonic() + timeout_s
        for _ in processes:
            while not self._ready.acquire(timeout=0.5):
                if not all(p.is_alive() for p in processes):
                    raise RuntimeError("a client process died before the start; see its traceback above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the client processes were not ready within {timeout_s:.0f} s")
        self._at.value = time.time() + self.LEAD_S
        self._go.set()


class Window:
    """What one client process measured: the answers that arrived between `start` and `end` (wall
    clock), whenever their requests were sent. A closed loop's throughput is the answers a window
    receives over its length, as perf_analyzer counts it; counting only requests both sent and answered
    within it would leave out the `concurrency` requests in flight as it opens (at WL, c=32 and an 8 s
    window, 7% of the answers)."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.latencies: list[float] = []
        self.batches: list[int] = []
        self.errors: list[str] = []

    def answered(self, at: float, latency_s: float, batch: int) -> bool:
        """Records an answer that arrived `at`; whether the window counts it."""
        if not self.start <= at <= self.end:
            return False
        self.latencies.append(latency_s)
        self.batches.append(batch)
        return True

    def failed(self, at: float, error: str) -> None:
        if self.start <= at <= self.end:
            self.errors.append(error)


async def closed_loop(
    send: Callable[[bytes], Awaitable[int]],
    requests: list[bytes],
    turn: int,
    window: Window,
    failure: type[BaseException],
    measured: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.time,
) -> None:
    """One in-flight slot: sends the next request as soon as the last is answered, until the window
    ends, taking `requests` in turn from its own (mixed lengths). `send` returns the answer's batch
    size or raises `failure` (whose code and details are recorded); `measured()` is told of each answer
    the window counts."""
    while clock() < window.end:
        request = requests[turn % len(requests)]
        turn += 1
        t0 = clock()
        try:
            batch = await send(request)
        except failure as exc:
            window.failed(clock(), f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
            continue
        done = clock()
        if window.answered(done, done - t0, batch):
            measured()


class _NoProgress:
    n = 0

    def update(self, n: int) -> None:
        self.n += n

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(label: str) -> Any:
    """A progress bar on stderr (requests measured so far), or nothing where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(desc=f"  {label}", unit=" req", file=sys.stderr, leave=False, dynamic_ncols=True)


def _inputs(info: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One request's inputs per --seq-len length, in its order."""
    rng = np.random.default_rng(0)
    return [_request_inputs(info, args, length, rng) for length in args.seq_len]


def _request_inputs(info: Any, args: argparse.Namespace, seq_len: int, rng: np.random.Generator) -> dict[str, Any]:
    shape = (args.batch, seq_len, info.embed_dim)
    inputs: dict[str, Any] = {
        "query": rng.standard_normal(shape, dtype=np.float32),
        "model": info.name,
        "causal": args.causal,
        "dtype": None if info.dtype == "float32" else info.dtype,
    }
    kv_len = args.kv_len or (seq_len if info.kind == "sdpa" else None)
    if kv_len is not None and info.kind == "mha" and info.kdim == info.vdim:
        # One X' for key and value, as a cross-attention user sends it.
        inputs["key_value"] = rng.standard_normal((args.batch, kv_len, info.kdim), dtype=np.float32)
    elif kv_len is not None:
        inputs["key"] = rng.standard_normal((args.batch, kv_len, info.kdim), dtype=np.float32)
        inputs["value"] = rng.standard_normal((args.batch, kv_len, info.vdim), dtype=np.float32)
    return inputs


def _run_level(
    target: str,
    inputs: list[dict[str, Any]],
    concurrency: int,
    args: argparse.Namespace,
    label: str,
    info: Any = None,
) -> Row:
    from attnserve import Request
    from attnserve._codec import encode_request

    requests: list[bytes] | SharedMemoryLoad
    if args.shared_memory and info is not None:  # (the echo floor has no KServe API: messages there)
        from attnserve_server.dtypes import FLOATS

        dtype = FLOATS[info.dtype]
        output_bytes = [
            one["query"].shape[0] * one["query"].shape[1] * info.output_dim * dtype.itemsize for one in inputs
        ]
        requests = SharedMemoryLoad(info.name, dtype.name, inputs, output_bytes)
    else:
        requests = [encode_request(Request(**one)).SerializeToString() for one in inputs]
    ctx = mp.get_context("spawn")  # no fork after gRPC has started threads
    procs = min(concurrency, args.processes or os.cpu_count() or 1)
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    progress = ctx.Array("q", procs, lock=False)
    results = ctx.Queue()
    start = StartLine(ctx)
    workers = [
        ctx.Process(
            target=_client_process,
            args=(
                target,
                args.connection,
                requests,
                share,
                start,
                args.warmup_s,
                args.duration_s,
                progress,
                i,
                results,
            ),
        )
        for i, share in enumerate(shares)
    ]
    for w in workers:
        w.start()
    try:
        start.start_when_ready(workers, timeout_s=READY_TIMEOUT_S)
    except RuntimeError:
        for w in workers:  # a client still connecting (or waiting for the start) would outlive us
            w.terminate()
        raise
    gathered = []
    with _progress(f"{label} c={concurrency}") as bar:
        while len(gathered) < procs:
            try:
                gathered.append(results.get(timeout=1.0))
            except Exception:  # queue.Empty: report progress while we wait
                bar.update(sum(progress) - bar.n)
                if not any(w.is_alive() for w in workers) and results.empty():
                    raise RuntimeError("a client process died; see its traceback above") from None
    _reap(workers, EXIT_GRACE_S)
    lat = np.array([x for g in gathered for x in g[0]])
    batches = [x for g in gathered for x in g[1]]
    errors = [x for g in gathered for x in g[2]]
    if lat.size == 0:
        raise NoAnswers(f"no request completed at concurrency {concurrency}: {'; '.join(sorted(set(errors))[:3])}")
    p50, p90, p99 = np.percentile(lat, [50, 90, 99]) * 1e3
    return Row(
        server=label,
        concurrency=concurrency,
        requests=int(lat.size),
        errors=len(errors),
        throughput_rps=lat.size / args.duration_s,
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        mean_batch=float(np.mean(batches)),
        error_samples=sorted(set(errors))[:3],
    )


class NoAnswers(Exception):
    """Every request of a level failed: nothing to measure."""


# -- servers started by bench ---------------------------------------------------------------


def _start_server(args: argparse.Namespace, max_batch_size: str, edges: str) -> tuple[subprocess.Popen, str]:

    flags = [
        *("--metrics-port", "-1", "--kind", args.kind, "--embed-dim", str(args.embed_dim)),
        *("--num-heads", str(args.num_heads), "--dtype", args.dtype, "--device", args.device),
        *("--max-batch-size", max_batch_size, "--max-batch-tokens", str(args.max_batch_tokens)),
        *("--max-queue-delay-ms", str(args.max_queue_delay_ms), "--model-name", args.model or "default"),
        *("--max-queue-size", "4096", "--edge-processes", edges),
        *(("--torch-threads", str(args.torch_threads)) if args.torch_threads else ()),
        *(("--allow-client-shm", "true") if args.shared_memory else ()),
        *(("--optional-inputs", "none") if args.shared_memory and args.perf_analyzer else ()),
    ]
    server = spawn_serve(*flags)
    return server.proc, server.target


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


# -- the transport floor --------------------------------------------------------------------


def _echo_server(metadata: bytes, ports: Any) -> None:
    """A bare grpc.aio server: Attend answers with the query as output; GetModel with `metadata`."""
    import grpc.aio

    from attnserve._channel import DEFAULT_MAX_MESSAGE_BYTES, STREAM_LOOKAHEAD_BYTES
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc

    class Echo(pb_grpc.AttentionServiceServicer):
        async def Attend(self, request: pb.AttendRequest, context: Any) -> pb.AttendResponse:
            return pb.AttendResponse(output=request.query, timing=pb.Timing(batch_size=1, batch_sequences=1))

        async def GetModel(self, request: pb.GetModelRequest, context: Any) -> pb.ModelMetadata:
            return pb.ModelMetadata.FromString(metadata)

    async def main() -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                ("grpc.http2.lookahead_bytes", STREAM_LOOKAHEAD_BYTES),
            ]
        )
        pb_grpc.add_AttentionServiceServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _start_echo(target: str, model: str) -> tuple[Any, str]:
    import grpc

    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        metadata = pb_grpc.AttentionServiceStub(channel).GetModel(pb.GetModelRequest(model=model), timeout=60)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(metadata.SerializeToString(), ports), daemon=True)
    proc.start()
    return proc, f"127.0.0.1:{ports.get(timeout=60)}"


# -- the in-process limit -------------------------------------------------------------------


def inprocess_throughput(
    info: Any, inputs: list[dict[str, Any]], batch_requests: int, seconds: float = 3.0, torch_threads: int | None = None
) -> float:
    """Requests/s of the model computed directly on a device worker, batch_requests at a time (taking
    the inputs in turn when there are several). On a CPU worker that pairs (batching.py), where two such
    batches together hold the work at which the server splits a batch, the faster of whole batches on
    every thread and two batches side by side, each on one runner's share of the threads, as the server
    then runs them: its batch sizes count each of the two (each is one execution)."""
    import torch

    from attnserve_server.compute.staging import host_tensor
    from attnserve_server.compute.threads import CpuThreads
    from attnserve_server.compute.weights import random_projections
    from attnserve_server.compute.worker import DeviceWorker
    from attnserve_server.domain import AttentionRequest
    from attnserve_server.model import spec_from_settings
    from attnserve_server.settings import BatchingSettings, ModelSettings

    settings = ModelSettings(
        name=info.name,
        kind=info.kind,
        embed_dim=info.embed_dim,
        num_heads=info.num_heads,
        kdim=info.kdim,
        vdim=info.vdim,
        bias=info.bias,
        dtype=info.dtype,
        device=(info.devices[0],),
        batching=BatchingSettings(max_batch_size=max(info.max_batch_size, batch_requests)),
    )
    spec = spec_from_settings(settings)

    def build() -> tuple[DeviceWorker, list[list[AttentionRequest]]]:
        params = None if info.kind == "sdpa" else random_projections(spec, 0)
        # the machine to itself: a large batch on every thread, not measured
        worker = DeviceWorker(spec, params, torch.device(info.devices[0]), CpuThreads(torch_threads, min_speedup=0))

        def request(one: dict[str, Any]) -> AttentionRequest:
            def tensor(name: str):
                if one.get(name) is None:
                    return None
                t = torch.from_numpy(one[name]).to(worker.dtype)
                return host_tensor(t if t.dim() == 3 else t.unsqueeze(0))

            shared = tensor("key_value")  # as the edge does: one tensor serves as key and value
            key, value = (shared, shared) if shared is not None else (tensor("key"), tensor("value"))
            return AttentionRequest(tensor("query"), key, value, None, one["causal"], False, False, unbatched=False)

        # One cycle: as many batches as there are inputs, so that each input is in the cycle's batches
        # batch_requests times (a single input: one batch of it).
        requests = [request(one) for one in inputs]
        n = len(requests)
        return worker, [[requests[(j * batch_requests + i) % n] for i in range(batch_requests)] for j in range(n)]

    # Built on a thread that ends here, as the server loads its models: a thread that ran torch keeps
    # an OpenMP pool while it lives, and one beside the worker's slows it (scripts/omp_pools.py).
    with ThreadPoolExecutor(1) as loader:
        worker, cycle = loader.submit(build).result()

    def measure() -> float:
        worker.warmup()
        for batch in cycle if len(cycle) >= 3 else cycle * 3:
            worker.run(batch)
        # The median cycle time: this machine's neighbours come and go, and one slow cycle is not the limit.
        times: list[float] = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 5:
            t0 = time.perf_counter()
            for batch in cycle:
                worker.run(batch)
            times.append(time.perf_counter() - t0)
        whole = batch_requests * len(cycle) / float(np.median(times))
        if not (worker.pairs and _two_split(spec, cycle)):
            return whole
        paired = 2 * batch_requests * len(cycle) / _paired_cycle_s(worker, cycle, seconds)
        print(
            f"  in-process: {whole:.1f} req/s in whole batches of {batch_requests},"
            f" {paired:.1f} two at a time side by side",
            file=sys.stderr,
        )
        return max(whole, paired)

    try:
        # On the worker's own thread, as in the server.
        return worker.executor.submit(measure).result()
    finally:
        worker.close()


def _two_split(spec: Any, cycle: list[list[Any]]) -> bool:
    """Whether two of the cycle's batches together hold, on average, the work (multiply-adds) from which a
    pairing CPU server splits a batch in two (batching.py: twice the model's cpu_pair_macs)."""
    from attnserve_server.domain import compute_macs

    work = sum(compute_macs(spec, r.sequences, r.query_len, r.key_len) for batch in cycle for r in batch)
    return 0 < spec.cpu_pair_macs * len(cycle) <= work


def _paired_cycle_s(worker: Any, cycle: list[list[Any]], seconds: float) -> float:
    """The median time of two cycles computed side by side, as a CPU server with pairing computes under
    load: the two runners each take a batch and compute it on their share of the threads (batching.py).
    Called on the first runner's thread; the second runner computes the other cycle, and the two meet after
    every cycle."""
    both = threading.Barrier(2, timeout=120)
    # The cycle after which both stop, set by the first runner before its last wait. The second reads it
    # against its own count: by the time it does, the first may already be in the next cycle.
    last_cycle = [-1]

    def partner() -> None:  # the second runner's lane computes on its share of the threads by itself
        try:
            both.wait()
            cycle_no = 0
            while True:
                for batch in cycle:
                    worker.run(batch)
                both.wait()
                if last_cycle[0] == cycle_no:
                    return
                cycle_no += 1
        except BaseException:
            both.abort()
            raise

    other = worker.executor.submit(partner)
    warm = 2  # cycles not measured: the second runner's first batches
    times: list[float] = []
    try:
        both.wait()
        last = start = time.perf_counter()
        while True:
            for batch in cycle:
                worker.run_shared(batch)
            done = len(times) >= warm + 5 and time.perf_counter() - start >= seconds
            if done:
                last_cycle[0] = len(times)  # this cycle's number: one time is appended a cycle
            both.wait()  # the other cycle is done too
            now = time.perf_counter()
            times.append(now - last)
            last = now
            if done:
                break
    except threading.BrokenBarrierError:
        other.result()  # the second runner's own error, if it had one
        raise
    except BaseException:
        both.abort()
        raise
    other.result()
    return float(np.median(times[warm:]))


# -- the command ----------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _levels(
    target: str, info: Any, inputs: list[dict[str, Any]], levels: list[int], args: argparse.Namespace, label: str
) -> list[Callable[[], Row]]:
    """One round's measurements against one server, in order: each concurrency level (under each
    perf_analyzer mode, with --perf-analyzer)."""
    if not args.perf_analyzer:
        return [lambda level=level: _run_level(target, inputs, level, args, label, info) for level in levels]
    from attnserve_bench import perf_analyzer

    data = perf_analyzer.input_data(inputs, info.dtype)
    room = perf_analyzer.output_bytes(inputs, info.output_dim, info.dtype) if args.shared_memory else 0
    return [
        lambda level=level, mode=mode: perf_analyzer.run_level(target, data, inputs, level, mode, args, label, room)
        for mode in args.pa_modes
        for level in levels
    ]


def _limit(
    row: Row, info: Any, inputs: list[dict[str, Any]], args: argparse.Namespace, cache: dict[int, float] | None = None
) -> None:
    """Sets the row's in-process limit, at the batch size its server reached, and its ratio; with a
    cache, once per batch size."""
    k = max(1, round(row.mean_batch))
    rps = cache.get(k) if cache is not None else None
    if rps is None:
        print(f"  in-process: batches of {k} request(s)", file=sys.stderr)
        rps = inprocess_throughput(info, inputs, k, args.inprocess_s, args.torch_threads)
        if cache is not None:
            cache[k] = rps
    row.inprocess_rps, row.inprocess_batch, row.ratio = rps, k, row.throughput_rps / rps


def _progress_line(row: Row, rounds: int) -> str:
    line = table([row]).splitlines()[-1]
    return f"{line}  (round {row.round} of {rounds})" if row.round is not None else line


def run(args: argparse.Namespace) -> int:
    from attnserve import AttnServeError, Client

    # The in-process limit runs under the OpenMP policy and the malloc settings the server runs
    # under (see cli.cmd_serve); set before torch loads in this process.
    openmp.set_defaults(os.environ, gpu=openmp.uses_gpu([args.device], os.environ))
    allocator.set_defaults(os.environ)

    # TLS and tokens reach a server given by --target; the servers bench starts are plaintext.
    plain = {"tls": False, "ca": None, "cert": None, "key": None, "token": None}
    try:
        args.connection = connection_from(args) if args.target else plain
    except Refused as exc:
        print(f"attnserve bench: {exc}", file=sys.stderr)
        return 2
    levels = list(args.concurrency)
    edge_counts = args.edge_processes.split(",")
    if args.shared_memory and args.perf_analyzer and args.kind == "mha" and args.kv_len:
        print(
            "attnserve bench: --shared-memory with --perf-analyzer: perf_analyzer takes shared memory only for a "
            "model without optional inputs, and cross attention's key_value is one; drop --kv-len",
            file=sys.stderr,
        )
        return 2
    variants: list[tuple[str, str] | None] = (
        [None] if args.target else [(b, e) for b in args.max_batch_size.split(",") for e in edge_counts]
    )
    rows: list[Row] = []  # every measurement, each round's apart
    info = inputs = echo = None
    rounds = args.rounds
    beside = rounds > 1 and not args.no_inprocess  # each level's own limit, measured right after it
    for variant in variants:
        proc = None
        target = args.target
        label = target
        if variant is not None:
            label = f"max_batch={variant[0]}" + (f" edges={variant[1]}" if edge_counts != ["auto"] else "")
            try:
                proc, target = _start_server(args, *variant)
            except ServeExited as exc:  # a model flag it refused, in one line above
                print(f"attnserve bench: {label}: the server it started exited with code {exc.code}", file=sys.stderr)
                return 2
        try:
            # A server bench started is ready (spawn_serve waited for it); one given by --target is either
            # there or named in one line at once, not waited for in silence.
            try:
                with Client(target, timeout_s=10, **args.connection) as client:
                    info = client.model(args.model)
            except AttnServeError as exc:
                print(f"attnserve bench: {label}: {exc.code.name}: {exc.message}", file=sys.stderr)
                return 1
            inputs = _inputs(info, args)
            if args.floor and echo is None:
                echo = _start_echo(target, args.model)
            for n in range(1, rounds + 1):
                for measure in _levels(target, info, inputs, levels, args, label):
                    try:
                        row = measure()
                    except NoAnswers as exc:
                        print(f"attnserve bench: {label}: {exc}", file=sys.stderr)
                        return 1
                    if rounds > 1:
                        row.round = n
                    if beside:
                        # The server is up and idle (its threads sleep): the limit shares this
                        # moment's machine with the level it is compared with.
                        _limit(row, info, inputs, args)
                    rows.append(row)
                    print(_progress_line(row, rounds), file=sys.stderr)
        finally:
            if proc is not None:
                _stop_server(proc)
    if echo is not None and inputs is not None:
        try:
            for level in levels:
                rows.append(_run_level(echo[1], inputs, level, args, FLOOR))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
        finally:
            echo[0].terminate()
    if not beside and not args.no_inprocess and info is not None and inputs is not None:
        # Measured after the servers stopped, on the model's device, at each batch size reached.
        cache: dict[int, float] = {}
        for row in rows:
            if row.server != FLOOR:
                _limit(row, info, inputs, args, cache)
    summary = medians(rows)
    command = "attnserve " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("attnserve") else " ".join(sys.argv)
    print(f"\n{command}\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC  {_machine()}")
    if info is not None:
        print(
            f"model {info.name}: {info.kind}, E={info.embed_dim}, heads={info.num_heads}, {info.dtype}, "
            f"on {','.join(info.devices)}; request: batch {args.batch} x L={','.join(map(str, args.seq_len))}"
            + (f", S={args.kv_len}" if args.kv_len else "")
            + (", causal" if args.causal else "")
        )
    if rounds > 1:
        print(
            f"medians of {rounds} rounds"
            + (
                "; each round's ratio against the limit measured right after it, the ratio their median"
                if beside
                else ""
            )
        )
    print(table(summary))
    if args.plot:
        try:
            plot(summary, args.plot, command)
        except ImportError:
            print("attnserve bench: --plot needs matplotlib: pip install 'attnserve[plot]'", file=sys.stderr)
            return 2
        except OSError as exc:  # checked before the run (output_file); a full disk, say
            print(f"attnserve bench: --plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"plot: {args.plot}")
    if args.json:
        results = {
            "command": command,
            "machine": _machine(),
            "date": datetime.now(UTC).isoformat(),
            "rows": [asdict(r) for r in summary],
            **({"rounds": [asdict(r) for r in rows]} if rounds > 1 else {}),
        }
        try:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        except OSError as exc:  # checked before the run (output_file); a full disk, say
            print(f"attnserve bench: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0
