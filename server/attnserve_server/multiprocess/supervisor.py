"""The engine's side of `--edge-processes N`: starts the edges, serves their requests, watches them.

The engine owns the models (batchers and device workers); each edge process owns a gRPC front on
the one port. A request crosses as a descriptor over the edge's socket, its tensors in the edge's
arena; requests from every edge meet in the same batchers. An edge that dies takes the server
down (it drains the others and exits non-zero, for the orchestrator to restart it): health says
SERVING only while the engine and every edge are up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping

from attnserve_server.domain import AnswerRoom, AttentionRequest, HostTensor
from attnserve_server.edge.shared_memory import SharedMemoryRegistry
from attnserve_server.errors import ConfigError, PortUnavailable, ServingError, status_of
from attnserve_server.metrics import Duration, InferenceStats, ProcessSnapshot, merge_snapshots
from attnserve_server.model import ServedModel
from attnserve_server.multiprocess import link
from attnserve_server.multiprocess.edge_process import ModelInfo
from attnserve_server.settings import ServerSettings, host_port
from attnserve_server.tracing import Tracing

log = logging.getLogger(__name__)
_FATAL_KINDS = {"PortUnavailable": PortUnavailable}
START_TIMEOUT_S = 60.0
SHM_ACK_TIMEOUT_S = 30.0  # for every edge to take a new table of shared memory regions


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Claims the port for this server's edges: fails if anything holds it (port 0 picks one), then
    keeps a bound, non-listening SO_REUSEPORT socket on it, which takes no connections but keeps
    processes that do not ask to share from binding it while the edges serve."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
    try:
        probe.bind((host, port))
    except OSError as exc:
        probe.close()
        raise PortUnavailable(f"gRPC port {host_port(host, port)}: cannot bind ({exc.strerror})") from None
    port = probe.getsockname()[1]
    probe.close()
    keep = socket.socket(family, socket.SOCK_STREAM)
    keep.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    keep.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        keep.bind((host, port))
    except OSError as exc:
        keep.close()
        raise PortUnavailable(f"gRPC port {host_port(host, port)}: cannot bind ({exc.strerror})") from None
    return keep, port


class Edge:
    """One edge process as the engine sees it: its process, link, arena and requests in flight."""

    def __init__(self, index: int, supervisor: EdgeSupervisor) -> None:
        self.index = index
        self._sup = supervisor
        self._tasks: dict[int, asyncio.Task] = {}  # requests being served, by id
        self._background: set[asyncio.Task] = set()
        self._snapshot_lock = threading.Lock()
        # (asyncio.get_running_loop costs a getpid() in Python 3.11: a syscall per request on the link)
        self._loop = loop = asyncio.get_running_loop()
        self.ready: asyncio.Future = loop.create_future()
        self.exited: asyncio.Future = loop.create_future()
        size = supervisor.settings.edge_arena_bytes
        try:  # mapped before the process starts: a size this host cannot map stops the start-up here
            arena_fd = link.Arena.create(size, f"attnserve-edge{index}")
            try:
                self.arena = link.Arena(arena_fd, size)
            except BaseException:
                os.close(arena_fd)
                raise
        except OSError as exc:
            raise ConfigError(
                f"edge_arena_bytes: cannot map {size:,} bytes of shared memory for edge process {index} "
                f"({exc.strerror})"
            ) from None
        link_engine, link_edge = socket.socketpair()
        self._snapshots, snapshots_edge = socket.socketpair()
        self._snapshots.settimeout(5.0)
        fds = (link_edge.fileno(), snapshots_edge.fileno(), arena_fd, supervisor.board_fd)
        command = [sys.executable, "-m", "attnserve_server.multiprocess.edge_process", "--index", str(index)]
        for flag, value in zip(("--link", "--snapshots", "--arena", "--board"), fds, strict=True):
            command += [flag, str(value)]
        command += ["--arena-bytes", str(size), "--event-loop", supervisor.settings.event_loop]
        # In the engine's process group (a group kill reaches it), but it ignores SIGINT and SIGTERM:
        # the engine drains it (see edge_process.main).
        self.process = subprocess.Popen(command, pass_fds=fds)
        link_edge.close()
        snapshots_edge.close()
        os.close(arena_fd)  # the mapping holds the memory
        self._link_socket = link_engine
        self.channel: link.Channel | None = None

    async def connect(self) -> None:
        self.channel = await link.Channel.connect(self._link_socket, self._on_message, self._on_lost)
        s = self._sup
        infos = [ModelInfo(m.settings, m.spec, m.devices, m.limits, i) for i, m in enumerate(s.models.values())]
        self.channel.send((link.HELLO, s.settings, infos, s.port))

    def send(self, message: tuple) -> None:
        if self.channel is not None:
            self.channel.send(message)

    def snapshot(self) -> ProcessSnapshot | None:
        """The edge's request-path numbers (from the metrics thread or a worker thread); None once it
        cannot answer."""
        with self._snapshot_lock:
            if self._snapshots.fileno() < 0:
                return None
            try:
                self._snapshots.sendall(b"s")
                return link.receive_blocking(self._snapshots)
            except (OSError, EOFError) as exc:
                # A dead edge counts nothing more (the server is stopping); one that does not answer
                # within the timeout is not asked again: a late answer would be read as the next one.
                if isinstance(exc, TimeoutError):
                    log.error("edge process %d did not answer a metrics scrape in time", self.index)
                self._snapshots.close()
                return None

    # -- messages from the edge ------------------------------------------------------------

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == link.SUBMIT:
            _, rid, model, fields = message
            submission = link.Submission._make(fields)
            at, size = submission.answer_at, submission.answer_room
            room = AnswerRoom(self.arena.view[at : at + size]) if at >= 0 and size >= link.IN_PLACE_BYTES else None
            task = self._loop.create_task(self._answer(rid, model, submission, room))
            self._tasks[rid] = task
            task.add_done_callback(functools.partial(self._answered, rid, room))
        elif kind == link.CANCEL:
            task = self._tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == link.STATS:
            task = self._loop.create_task(self._statistics(message[1], message[2]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif kind == link.SHM:
            _, rid, op, args = message
            task = self._loop.create_task(self._sup.shared_memory_call(self, rid, op, args))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif kind == link.SHM_ACK:
            self._sup.table_acked(self, message[1])
        elif kind == link.READY:
            if not self.ready.done():
                self.ready.set_result(None)
        elif kind == link.FATAL:
            _, error, text = message
            if not self.ready.done():
                self.ready.set_exception(_FATAL_KINDS.get(error, ConfigError)(text))

    def _on_lost(self) -> None:
        self.channel = None
        self._sup.table_acked(self, None)  # nothing more to wait for from it
        for task in self._tasks.values():
            task.cancel()  # nobody is left to answer
        if not self.ready.done():
            self.ready.set_exception(ConfigError(f"edge process {self.index} exited while starting"))
        self._sup.edge_lost(self)

    def _tensor(self, ref: link.TensorRef) -> HostTensor:
        where, n, shape = ref
        return HostTensor(where if isinstance(where, bytes) else self.arena.view[where : where + n], shape)

    async def _answer(self, rid: int, model: str, sub: link.Submission, into: AnswerRoom | None) -> None:
        at, room = sub.answer_at, sub.answer_room
        try:
            served = self._sup.models[model]  # the edge found it among the models the engine sent
            served.check_admission()
            key = None if sub.key is None else self._tensor(sub.key)
            tracing = self._sup.tracing
            request = AttentionRequest(
                self._tensor(sub.query), key, key if sub.value is None else self._tensor(sub.value),
                sub.key_padding, sub.causal, sub.need_weights, sub.average_weights, sub.unbatched,
                sub.nbytes, sub.memory_bytes,
                None if sub.trace is None or tracing is None else tracing.remote_span(sub.trace),
                into,  # the worker writes the answer straight into the room the edge left for it
            )  # fmt: skip
            answer = await served.submit(request, sub.deadline, expire=sub.expire)
        except Exception as exc:
            if not isinstance(exc, ServingError):
                log.error("unexpected error serving a request from edge %d", self.index, exc_info=exc)
            status, text = status_of(exc)
            self.send((link.FAILED, rid, status, text))
            return
        output, weights = answer.output, answer.weights
        view = self.arena.view
        w_at = at + link.aligned(len(output))
        if answer.in_place:  # already in the region, where the layout below would put it
            out_ref: link.TensorRef = (at, len(output), answer.output_shape)
            w_ref = None if weights is None else (w_at, len(weights), answer.weights_shape)
        elif at >= 0 and w_at - at + (0 if weights is None else len(weights)) <= room:
            view[at : at + len(output)] = output
            out_ref = (at, len(output), answer.output_shape)
            w_ref = None
            if weights is not None:
                view[w_at : w_at + len(weights)] = weights
                w_ref = (w_at, len(weights), answer.weights_shape)
        else:  # no room in the arena: the answer travels in the message
            out_ref = (bytes(output), len(output), answer.output_shape)
            w_ref = None if weights is None else (bytes(weights), len(weights), answer.weights_shape)
        self.send((link.DONE, rid, out_ref, w_ref, link.report_fields(answer.batch)))

    def _answered(self, rid: int, into: AnswerRoom | None, task: asyncio.Task) -> None:
        del self._tasks[rid]
        if task.cancelled():  # as the edge asked (even before it started): its region is free
            if into is not None:
                # once its worker can write there no more (a batch that took the request computes on)
                into.close()
            self.send((link.CANCELLED, rid))

    async def _statistics(self, rid: int, names: list[str]) -> None:
        processes = await asyncio.to_thread(self._sup.snapshots)
        remote = merge_snapshots(snap for process in processes for snap in process.models)
        stats: dict[str, InferenceStats] = {}
        for name in names:
            served = self._sup.models[name]
            counted = remote.get(name)
            stats[name] = dataclasses.replace(
                served.metrics.stats,
                success=counted.success if counted else Duration(),
                fail=counted.fail if counted else Duration(),
            )
        self.send((link.STATS_REPLY, rid, stats))


class EdgeSupervisor:
    """Starts `settings.edge_processes` edges on one port and runs the engine's side of each link."""

    def __init__(
        self,
        settings: ServerSettings,
        models: Mapping[str, ServedModel],
        tracing: Tracing | None,
        failed: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.models = models
        self.tracing = tracing
        self.port = 0
        self.edges: list[Edge] = []
        self.failed = failed  # set when an edge dies while serving
        self._stopping = False
        self._reserved: socket.socket | None = None
        # Clients' shared memory regions: the one table, checked here and sent to every edge.
        self.shared_memory = SharedMemoryRegistry(settings.allow_client_shm)
        self._shm_lock = asyncio.Lock()  # one change at a time, each one in every edge before the next
        self._shm_version = 0
        self._shm_acks: dict[Edge, asyncio.Future] = {}  # while a table is on its way

    def reserve(self) -> int:
        """Claims the port (before the models load: a taken port fails at once) and returns it."""
        self._reserved, self.port = reserve_port(self.settings.host, self.settings.port)
        return self.port

    async def start(self) -> None:
        """Starts every edge once the models are loaded; returns once all serve the port."""
        s = self.settings
        self.board_fd = link.Arena.create(link.Board.bytes_for(len(self.models)), "attnserve-board")
        board = link.Board(self.board_fd, len(self.models))
        for i, served in enumerate(self.models.values()):
            served.watch_queue(functools.partial(board.write, i))
        loop = asyncio.get_running_loop()
        for index in range(s.edge_processes):
            edge = Edge(index, self)
            self.edges.append(edge)
            self._watch(edge, loop)
            await edge.connect()
        os.close(self.board_fd)  # every edge has it now; the mappings hold the memory
        await asyncio.wait_for(asyncio.gather(*(e.ready for e in self.edges)), START_TIMEOUT_S)
        pids = ", ".join(str(e.process.pid) for e in self.edges)
        log.info("%d edge processes (pids %s) serving port %d", len(self.edges), pids, self.port)

    def _watch(self, edge: Edge, loop: asyncio.AbstractEventLoop) -> None:
        """Sets `edge.exited` when its process ends: a pidfd turns readable (no thread waits on it)."""
        pidfd = os.pidfd_open(edge.process.pid)

        def exited() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            code = edge.process.wait()
            edge.exited.set_result(code)
            if code not in (0, link.EXIT_GRACE_RAN_OUT) or not self._stopping:  # as asked to stop: 0, or 3
                log.error("edge process %d (pid %d) exited with %d", edge.index, edge.process.pid, code)

        loop.add_reader(pidfd, exited)

    def edge_lost(self, edge: Edge) -> None:
        if self._stopping:
            return
        log.critical("edge process %d stopped unasked: stopping the server (exit 1)", edge.index)
        self.failed.set()

    async def shared_memory_call(self, edge: Edge, rid: int, op: str, args: tuple) -> None:
        """An edge's client registers or unregisters a region: the change is checked and made here,
        then the new table goes to every edge, and `edge` is answered once all of them hold it."""
        async with self._shm_lock:
            try:
                if op == "register":
                    self.shared_memory.add(*args)
                else:
                    self.shared_memory.remove(*args)
            except ServingError as exc:
                edge.send((link.SHM_REPLY, rid, (exc.status, exc.message)))
                return
            self._shm_version += 1
            loop = asyncio.get_running_loop()
            self._shm_acks = {e: loop.create_future() for e in self.edges if e.channel is not None}
            table = self.shared_memory.table()
            for e in self._shm_acks:
                e.send((link.SHM_TABLE, self._shm_version, table))
            try:
                await asyncio.wait_for(asyncio.gather(*self._shm_acks.values()), SHM_ACK_TIMEOUT_S)
            except TimeoutError:
                late = ", ".join(str(e.index) for e, f in self._shm_acks.items() if f.cancelled() or not f.done())
                log.error("edge process(es) %s did not take the shared memory table in time", late)
                edge.send((link.SHM_REPLY, rid, ("UNAVAILABLE", f"edge process(es) {late} did not answer in time")))
                return
            finally:
                self._shm_acks = {}
        edge.send((link.SHM_REPLY, rid, None))

    def table_acked(self, edge: Edge, version: int | None) -> None:
        """`edge` holds table `version` (None: it is gone)."""
        future = self._shm_acks.get(edge)
        if future is not None and not future.done() and (version is None or version == self._shm_version):
            future.set_result(None)

    def snapshots(self) -> list[ProcessSnapshot]:
        """Every edge's request-path numbers, of those that answer; blocking, so called from a thread."""
        return [snap for edge in self.edges if (snap := edge.snapshot()) is not None]

    def reload_tls(self) -> None:
        """Passes SIGHUP on: each edge reads its TLS files again at the next handshake."""
        for edge in self.edges:
            if edge.process.poll() is None:
                edge.process.send_signal(signal.SIGHUP)

    def set_state(self, serving: bool) -> None:
        ready = {name: serving and m.ready for name, m in self.models.items()}
        for edge in self.edges:
            edge.send((link.STATE, ready, serving))

    async def stop(self, deadline: float) -> bool:
        """Tells every edge to stop serving by `deadline` (loop clock) and waits for them to exit;
        True if all did in time (a late one is killed), each with every call it had taken ended and every
        answer sent (exit 0, not EXIT_GRACE_RAN_OUT). Another exit status is logged when it happens
        (`_watch`), not reported here as a grace that ran out."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for edge in self.edges:
            edge.send((link.STOP, max(0.0, deadline - loop.time())))
        exits = [e.exited for e in self.edges]
        _, late = await asyncio.wait(exits, timeout=max(0.0, deadline - loop.time()) + 1.0) if exits else ((), ())
        for edge in self.edges:
            if not edge.exited.done():
                log.warning("edge process %d did not stop in time: killed", edge.index)
                edge.process.kill()
        if late:
            await asyncio.wait(late)
        if self._reserved is not None:
            self._reserved.close()
        self.shared_memory.close()
        return not late and all(e.exited.result() != link.EXIT_GRACE_RAN_OUT for e in self.edges)
