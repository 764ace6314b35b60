"""An edge process: the gRPC front on the shared port, its models reached through the engine.

Started by the engine (`supervisor.EdgeSupervisor`) with four inherited descriptors: the message
socket, the metrics-snapshot socket, the payload arena and the admission board. Imports no torch. It serves until the
engine says STOP (a graceful drain: exit 0) or until the engine goes away (every request waiting
on it is answered UNAVAILABLE at once, then exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import sys
import threading
import weakref
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry

from attnserve_server.batching import BatchLimits, refusal
from attnserve_server.domain import Answer, AttentionRequest, BatchReport, ModelSpec, answer_bytes, weight_heads
from attnserve_server.edge.front import GrpcFront, set_health
from attnserve_server.edge.health import NOT_SERVING, SERVING, HealthServicer
from attnserve_server.edge.shared_memory import SharedMemoryRegistry
from attnserve_server.errors import ConfigError, ServingError, ShuttingDown
from attnserve_server.metrics import InferenceStats, Metrics, ModelMetrics
from attnserve_server.multiprocess import link
from attnserve_server.runtime import pyheap
from attnserve_server.runtime.eventloop import CHOICES, loop_factory
from attnserve_server.settings import ModelSettings, ServerSettings
from attnserve_server.tracing import Tracing
from attnserve_server.tracing import from_environment as tracing_from_environment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What an edge knows of a model: its configuration, where the engine runs it, its queue's
    limits and its place on the admission board."""

    settings: ModelSettings
    spec: ModelSpec
    devices: list[str]
    limits: BatchLimits
    board_index: int


class EngineFailure(ServingError):
    """The engine answered with an error status, or is gone."""

    def __init__(self, code_name: str, message: str) -> None:
        super().__init__(message)
        self.status = code_name


ENGINE_LOST = "the server's engine process stopped; retry (another replica, or this one once restarted)"


class EngineLink:
    """The edge's end of the link: sends requests, matches answers to callers, frees their regions."""

    def __init__(self, arena: link.Arena, tracing: Tracing | None) -> None:
        self._arena = arena
        self._ring = link.Ring(arena.size)
        # (asyncio.get_running_loop costs a getpid() in Python 3.11: a syscall per request on the link)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tracing = tracing
        self._ids = itertools.count()
        self._pending: dict[int, list] = {}  # id -> [future (None once its caller left), region or None]
        self.channel: link.Channel | None = None
        self.hello: asyncio.Future = self._loop.create_future()
        self.stopping: asyncio.Future = self._loop.create_future()  # grace seconds, None: lost
        self.ready: dict[str, bool] = {}
        self.health: HealthServicer | None = None
        self.shared_memory: SharedMemoryRegistry | None = None  # this edge's copy of the regions
        self.lost = False
        self._health_update: asyncio.Task | None = None

    async def connect(self, sock: socket.socket) -> None:
        self.channel = await link.Channel.connect(sock, self._on_message, self._on_lost)

    def send(self, message: tuple) -> None:
        assert self.channel is not None
        self.channel.send(message)

    def check(self) -> None:
        if self.lost:
            raise EngineFailure("UNAVAILABLE", ENGINE_LOST)

    async def submit(self, spec: ModelSpec, request: AttentionRequest, deadline: float | None, expire: bool) -> Answer:
        self.check()
        shared_kv = request.key is not None and request.key is request.value
        tensors = [request.query, request.key, None if shared_kv else request.value]
        sizes = [0 if t is None else memoryview(t.data).nbytes for t in tensors]
        heads = weight_heads(spec, request.need_weights, request.average_weights)
        room = answer_bytes(spec, request.sequences, request.query_len, request.key_len, heads) + link.ALIGN
        start = self._ring.take(sum(link.aligned(n) for n in sizes) + room)
        refs: list[link.TensorRef | None] = []
        at = start
        for t, n in zip(tensors, sizes, strict=True):
            if t is None:
                refs.append(None)
            elif at is None:  # the arena is full: this request's bytes travel in the message
                refs.append((bytes(t.data), n, t.shape))
            else:
                self._arena.view[at : at + n] = t.data
                refs.append((at, n, t.shape))
                at += link.aligned(n)
        trace = self._tracing.context_of(request.trace) if self._tracing and request.trace is not None else None
        submission = link.Submission(
            refs[0], refs[1], refs[2], request.key_padding, request.causal, request.need_weights,
            request.average_weights, request.unbatched, request.nbytes, request.memory_bytes,
            -1 if at is None else at, room, trace, deadline, expire,
        )  # fmt: skip
        rid = next(self._ids)
        future = self._loop.create_future()
        self._pending[rid] = [future, start]
        self.send((link.SUBMIT, rid, spec.name, tuple(submission)))
        try:
            return await future
        except asyncio.CancelledError:
            if rid in self._pending:  # the engine drops it; its region is freed when it says so
                self._pending[rid][0] = None
                self.send((link.CANCEL, rid))
            raise

    async def forward_shared_memory(self, op: str, args: tuple) -> None:
        """A client's register or unregister, through the engine: answered once every edge has the
        regions' new table (this one included), or with the engine's refusal."""
        self.check()
        rid = next(self._ids)
        future = self._loop.create_future()
        self._pending[rid] = [future, None]
        self.send((link.SHM, rid, op, args))
        await future

    async def statistics(self, name: str) -> InferenceStats:
        self.check()
        rid = next(self._ids)
        future = self._loop.create_future()
        self._pending[rid] = [future, None]
        self.send((link.STATS, rid, [name]))
        return (await future)[name]

    def _settle(self, rid: int, keep: bool = False) -> asyncio.Future | None:
        """The caller's future for `rid` (None if it left), its region freed unless `keep`."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            return None
        future, region = entry
        if region is not None and not keep:
            self._ring.free(region)
        return None if future is None or future.done() else future

    def _answer(
        self, region: int | None, refs: tuple[link.TensorRef, link.TensorRef | None], batch: BatchReport
    ) -> tuple[Answer, bool]:
        """The caller's answer, and whether it holds its region. Tensors the engine wrote into the arena
        are views of it, uncopied (at least link.IN_PLACE_BYTES of them; smaller ones are copied): the
        response's frame copies them once (edge/framing.py), when gRPC serializes it, after the call's
        handler has returned. So the region is freed only when the last view of it is gone: a finalizer
        on the array they all view, which frees it on the loop."""
        held = None
        arena = all(ref is None or not isinstance(ref[0], bytes) for ref in refs)
        if region is not None and arena and sum(ref[1] for ref in refs if ref is not None) >= link.IN_PLACE_BYTES:
            end = max(ref[0] + ref[1] for ref in refs if ref is not None)
            held = np.frombuffer(self._arena.view, np.uint8, count=end - region, offset=region)
            weakref.finalize(held, self._free_soon, region).atexit = False  # nothing to free at exit
        tensors: list = []
        for ref in refs:
            if ref is None:
                tensors += (None, None)
            elif held is not None:
                tensors += (memoryview(held[ref[0] - region : ref[0] - region + ref[1]]), ref[2])
            else:
                tensors += (self._read(ref), ref[2])
        return Answer(*tensors, batch), held is not None

    def _free_soon(self, region: int) -> None:
        """Frees a region, on the loop's next turn: a finalizer runs wherever its object's last reference
        goes, which may be in the middle of the ring's own code (a garbage collection) or another thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the process is exiting
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self._ring.free, region)
            else:
                self._loop.call_soon_threadsafe(self._ring.free, region)

    def _read(self, ref: link.TensorRef) -> bytes:
        where, n, _ = ref
        return where if isinstance(where, bytes) else bytes(self._arena.view[where : where + n])

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == link.DONE:
            _, rid, output, weights, batch = message
            entry = self._pending.get(rid)
            if entry is not None and entry[0] is not None and not entry[0].done():
                answer, holds = self._answer(entry[1], (output, weights), BatchReport(*batch))
                self._settle(rid, keep=holds).set_result(answer)  # type: ignore[union-attr]
            else:
                self._settle(rid)
        elif kind == link.FAILED:
            _, rid, code, text = message
            if (future := self._settle(rid)) is not None:
                future.set_exception(EngineFailure(code, text))
        elif kind == link.CANCELLED:
            self._settle(message[1])
        elif kind == link.STATS_REPLY:
            if (future := self._settle(message[1])) is not None:
                future.set_result(message[2])
        elif kind == link.SHM_TABLE:
            _, version, table = message
            if self.shared_memory is not None:
                self.shared_memory.apply(table)
            self.send((link.SHM_ACK, version))
        elif kind == link.SHM_REPLY:
            _, rid, refusal = message
            if (future := self._settle(rid)) is not None:
                if refusal is None:
                    future.set_result(None)
                else:
                    future.set_exception(EngineFailure(*refusal))
        elif kind == link.STATE:
            _, self.ready, serving = message
            if self.health is not None:
                self._health_update = self._loop.create_task(self._set_health(serving))
        elif kind == link.STOP:
            if not self.stopping.done():
                self.stopping.set_result(message[1])
        elif kind == link.HELLO:
            self.hello.set_result(message[1:])

    async def _set_health(self, serving: bool) -> None:
        assert self.health is not None
        if serving:
            await set_health(self.health, tuple(n for n, r in self.ready.items() if r), SERVING)
        else:
            await self.health.enter_graceful_shutdown()

    def _on_lost(self) -> None:
        """The engine is gone: every caller waiting on it is answered UNAVAILABLE now."""
        if self.stopping.done() and self.stopping.result() is not None:
            return  # the engine stopped us and closed its end: expected
        self.lost = True
        for rid in list(self._pending):
            if (future := self._settle(rid)) is not None:
                future.set_exception(EngineFailure("UNAVAILABLE", ENGINE_LOST))
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("the engine closed the link before its hello"))
        if not self.stopping.done():
            self.stopping.set_result(None)


class RemoteModel:
    """A model served by the engine, as the edge's dispatcher sees it (edge.dispatch.Servable)."""

    def __init__(self, info: ModelInfo, metrics: ModelMetrics, engine: EngineLink, board: link.Board) -> None:
        self.spec = info.spec
        self.settings = info.settings
        self.devices = info.devices
        self.metrics = metrics
        self._engine = engine
        self._limits = info.limits
        self._board = board
        self._index = info.board_index

    @property
    def ready(self) -> bool:
        return not self._engine.lost and self._engine.ready.get(self.spec.name, False)

    def check_admission(self) -> None:
        """Refuses as the engine's batcher would now (full queue, draining), or if the engine is gone."""
        self._engine.check()
        refused = refusal(self._limits, *self._board.read(self._index))
        if refused is not None:
            reason, error = refused
            self.metrics.dropped(reason)
            # the batcher knows no model's name: a drain's refusal reads as the model's own in one process
            raise ShuttingDown.of_model(self.spec.name) if reason == "shutting_down" else error

    async def submit(self, request: AttentionRequest, deadline: float | None = None, *, expire: bool = True) -> Answer:
        return await self._engine.submit(self.spec, request, deadline, expire)

    async def statistics(self) -> InferenceStats:
        return await self._engine.statistics(self.spec.name)


def _serve_snapshots(sock: socket.socket, metrics: Metrics) -> None:
    """Answers the engine's scrapes from a thread of its own: the event loop is never asked."""
    while True:
        try:
            if not sock.recv(1):
                return
            link.send_blocking(sock, metrics.snapshot())
        except OSError:
            return


async def run(link_fd: int, snapshot_fd: int, arena_fd: int, arena_bytes: int, board_fd: int, index: int) -> int:
    arena = link.Arena(arena_fd, arena_bytes)
    tracing = tracing_from_environment()
    engine = EngineLink(arena, tracing)
    await engine.connect(socket.socket(fileno=link_fd))
    settings: ServerSettings
    settings, infos, port = await engine.hello
    logging.getLogger().setLevel(settings.log_level.upper())
    metrics = Metrics(CollectorRegistry())
    board = link.Board(board_fd, len(infos))
    models = {i.spec.name: RemoteModel(i, metrics.for_model(i.spec.name), engine, board) for i in infos}
    threading.Thread(
        target=_serve_snapshots, args=(socket.socket(fileno=snapshot_fd), metrics), name="snapshots", daemon=True
    ).start()
    servicer = HealthServicer()
    await set_health(servicer, tuple(models), NOT_SERVING)
    engine.health = servicer
    front = GrpcFront(settings, models, metrics.for_unknown_models(), servicer, tracing, port=port, share_port=True)
    metrics.watch_front(front.load)
    front.shared_memory.forward = engine.forward_shared_memory  # registrations go through the engine to every edge
    engine.shared_memory = front.shared_memory
    try:
        await front.start()
    except ConfigError as exc:
        engine.send((link.FATAL, type(exc).__name__, str(exc)))
        engine.channel.close()  # type: ignore[union-attr]
        return 2
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, front.reload_tls)
    heap = pyheap.settle()  # everything the edge keeps is loaded (pyheap.py)
    engine.send((link.READY,))
    log.debug("edge %d serving port %d; gc: %s", index, port, heap)
    grace_s = await engine.stopping
    if grace_s is None:
        log.error("edge %d: %s; stopping", index, ENGINE_LOST)
        await servicer.enter_graceful_shutdown()
        await front.server.stop(1.0)  # the UNAVAILABLE answers go out, then the port is let go
        return 1
    done = await front.stop(loop.time() + grace_s)
    if tracing is not None:
        tracing.shutdown()
    engine.channel.close()  # type: ignore[union-attr]
    return 0 if done else link.EXIT_GRACE_RAN_OUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an attnserve edge process (started by `attnserve serve`)")
    for name in ("link", "snapshots", "arena", "arena-bytes", "board", "index"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--event-loop", default="auto", choices=CHOICES)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s edge{args.index} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # A terminal's Ctrl-C or a SIGTERM to the whole process group reaches the engine too, which
    # drains the edges: an edge stops when its engine tells it to, or when its engine is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the front can reload its TLS files on it
    _, factory = loop_factory(args.event_loop)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run(args.link, args.snapshots, args.arena, args.arena_bytes, args.board, args.index))


if __name__ == "__main__":
    sys.exit(main())
