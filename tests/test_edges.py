"""`--edge-processes N`: gRPC edges in their own processes in front of one engine.

The whole suite also runs with every server in this mode (ATTNSERVE_TEST_EDGES=2, as .ci/run does);
these are the behaviours only this mode has: batches shared across edges, numbers summed across
processes, the arena and its fallback, and what happens when a process dies.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import pickle
import random
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from test_process import ServerProcess, server_process  # noqa: F401  (a fixture)

from attnserve import AttnServeError, Client
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.domain import AnswerRoom, BatchReport
from attnserve_server.multiprocess import link
from attnserve_server.multiprocess.link import ALIGN, Ring

from conftest import model, running, settings

EDGES = 2


def test_the_ring_never_hands_out_overlapping_regions_and_reuses_freed_space() -> None:
    rng = random.Random(0)
    ring = Ring(64 * 1024)
    live: dict[int, int] = {}  # start -> end
    taken = 0
    for _ in range(20_000):
        if live and (rng.random() < 0.5 or len(live) > 40):
            # mostly the oldest first, as requests finish; sometimes any
            start = min(live) if rng.random() < 0.7 else rng.choice(list(live))
            ring.free(start)
            del live[start]
        else:
            n = rng.randint(1, 5000)
            start = ring.take(n)
            if start is None:
                continue
            end = start + max(ALIGN, -(-n // ALIGN) * ALIGN)
            assert end <= ring.size and all(end <= a or start >= b for a, b in live.items())
            live[start] = end
            taken += 1
    assert taken > 5_000  # freed space came back: 64 KiB holds ~26 regions at a time
    for start in list(live):
        ring.free(start)
    assert ring.take(64 * 1024) == 0  # all of it, once everything is free


def test_a_batch_report_and_a_submission_cross_the_link_as_tuples_and_come_back_whole() -> None:
    report = BatchReport(12.5, 0.004, 0.001, 0.002, 0.001, 3, 5, 320, 384, 0.25, 2, True)
    submission = link.Submission((0, 512, (8, 16)), None, None, None, True, False, True, False, 512, 1024, 576, 640,
                                 (1, 2, 1), 99.5, False)  # fmt: skip
    for message in [
        (link.SUBMIT, 7, "default", tuple(submission)),
        (link.DONE, 7, (576, 512, (1, 8, 16)), None, link.report_fields(report)),
    ]:
        assert pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)) == message
    assert link.Submission._make(tuple(submission)) == submission
    assert BatchReport(*link.report_fields(report)) == report


def test_requests_from_every_edge_share_one_batch_and_every_number_is_summed() -> None:
    # 16 clients, each its own connection: the kernel spreads connections over the edges. The batch
    # closes at 16 sequences (its delay is a minute), so all 16 run together.
    served = settings(model(embed_dim=32, num_heads=4, max_batch_size=16, max_queue_delay_ms=60_000), edge_processes=2)
    x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    with running(served) as handle:

        def one(_: int):
            with Client(handle.target, timeout_s=60) as c:
                return c.attend(x)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        assert all(r.timing.batch_size == 16 for r in results)
        assert handle.server.edges is not None
        per_edge = [
            sum(s.requests.get(("Attend", "OK"), 0) for s in e.snapshot().models) for e in handle.server.edges.edges
        ]
        assert sum(per_edge) == 16 and all(n > 0 for n in per_edge), per_edge  # both edges served, one batch
        # Prometheus and KServe statistics count every process's requests.
        assert handle.sample("attnserve_requests_total", model="default", method="Attend", code="OK") == 16
        with triton.InferenceServerClient(handle.target) as kc:
            stats = kc.get_inference_statistics("default", as_json=True)["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) == 16
        assert int(stats["execution_count"]) == 1 and int(stats["inference_count"]) == 16


def test_a_request_larger_than_the_arena_travels_in_the_message() -> None:
    # 1 MiB of arena: a [2, 512, 256] FP32 request (1 MiB in, 1 MiB out) cannot have a region, one of
    # its sequences alone (512 KiB each way) can. Both paths give the same numbers.
    served = settings(model(embed_dim=256, num_heads=8, max_query_len=512), edge_processes=2, edge_arena_bytes=1 << 20)
    x = np.random.default_rng(1).standard_normal((2, 512, 256)).astype(np.float32)
    with running(served) as handle, Client(handle.target, timeout_s=60) as c:
        whole = c.attend(x).output
        parts = [c.attend(x[i]).output for i in range(2)]
    np.testing.assert_allclose(whole, np.stack(parts), rtol=1e-5, atol=1e-5)


HELD_LEN = 80  # a batch with a query this long waits for HoldingWorker.release


class HoldingWorker(DeviceWorker):
    """The real worker (in the engine); a batch holding a query of HELD_LEN keeps its requests' answer
    rooms, says it started and waits for `release`. Every batch's answers say if they were written in place."""

    started = threading.Event()
    release = threading.Event()
    finished = threading.Event()
    rooms: list[AnswerRoom | None] = []
    in_place: list[bool] = []

    def run(self, requests):
        held = any(r.query_len == HELD_LEN for r in requests)
        if held:
            HoldingWorker.rooms = [r.answer_into for r in requests]
            HoldingWorker.started.set()
            assert HoldingWorker.release.wait(20), "the test never released the held batch"
        answers = super().run(requests)
        HoldingWorker.in_place += [a.in_place for a in answers]
        if held:
            HoldingWorker.finished.set()
        return answers


def _closed(room: AnswerRoom) -> bool:
    with room as view:
        return view is None


def test_answers_are_written_into_the_arena_and_never_into_a_region_given_up() -> None:
    # The worker writes an edge's answer straight into the request's arena region. A request whose
    # caller goes away while its batch computes gets its region back only once the worker can no
    # longer write there: the edge may hand it to the next request at once.
    # (answers of at least link.IN_PLACE_BYTES: a [64, 256] FP32 output is 64 KiB)
    served = settings(
        model(embed_dim=256, num_heads=8, max_batch_size=1, max_queue_delay_ms=0), edge_processes=2, solo_macs=0
    )
    rng = np.random.default_rng(7)
    with running(served, worker_factory=HoldingWorker) as handle, Client(handle.target, timeout_s=30) as c:
        HoldingWorker.in_place.clear()  # the warm-up's batches had no rooms
        x = rng.standard_normal((64, 256)).astype(np.float32)
        assert c.attend(x).output.shape == (64, 256)
        small = rng.standard_normal((8, 256)).astype(np.float32)  # 8 KiB: copied, cheaper than a room
        assert c.attend(small).output.shape == (8, 256)
        assert HoldingWorker.in_place == [True, False]
        try:
            with pytest.raises(AttnServeError) as gave_up:
                c.attend(rng.standard_normal((HELD_LEN, 256)).astype(np.float32), timeout_s=1.0)
            assert gave_up.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and HoldingWorker.started.is_set()
            (room,) = HoldingWorker.rooms
            assert room is not None
            handle.wait_for(lambda: _closed(room))  # the engine took the room back when the edge cancelled
            before = bytes(room.view)
        finally:
            HoldingWorker.release.set()
        assert HoldingWorker.finished.wait(20)
        assert HoldingWorker.in_place[-1] is False and bytes(room.view) == before  # computed, not written
        y = c.attend(x).output  # the server serves on
        np.testing.assert_allclose(y, c.attend(x).output, rtol=1e-6)


class RoomWorker(DeviceWorker):
    """The real worker (in the engine), noting for each request whether it brought room for its answer."""

    rooms: list[bool] = []

    def run(self, requests):
        RoomWorker.rooms += [r.answer_into is not None for r in requests]
        return super().run(requests)


def test_answers_read_in_place_stay_intact_and_their_regions_come_back() -> None:
    # An edge reads an answer where the engine wrote it, in the request's arena region, and frees the
    # region only once the response has been serialized. A 512 KiB arena holds four of these requests'
    # regions (64 KiB in, 64 KiB out: answers this large are read in place, link.IN_PLACE_BYTES), so
    # under 16 callers regions are taken and freed all the time: an answer whose region went to the
    # next request too early would carry that request's bytes.
    served = settings(model(embed_dim=256, num_heads=8), edge_processes=2, edge_arena_bytes=512 << 10)
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((64, 256)).astype(np.float32) for _ in range(16)]
    with running(served, worker_factory=RoomWorker) as handle:
        with Client(handle.target, timeout_s=60) as c:
            expected = [c.attend(x).output for x in xs]
        RoomWorker.rooms.clear()

        def caller(i: int) -> list[np.ndarray]:
            with Client(handle.target, timeout_s=60) as c:
                return [c.attend(xs[(i + k) % 16]).output for k in range(12)]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(caller, range(16)))
        for i, outputs in enumerate(results):
            for k, y in enumerate(outputs):
                np.testing.assert_allclose(y, expected[(i + k) % 16], rtol=1e-4, atol=1e-5)
        assert sum(RoomWorker.rooms) > len(RoomWorker.rooms) // 4, RoomWorker.rooms.count(True)
        # Every region comes back: a request whose region needs nearly the whole arena (250 KiB in, 250
        # out) gets one again once the last responses are gone.
        big = rng.standard_normal((250, 256)).astype(np.float32)
        with Client(handle.target, timeout_s=60) as c:

            def in_the_arena() -> bool:
                RoomWorker.rooms.clear()
                c.attend(big)
                return RoomWorker.rooms == [True]

            handle.wait_for(in_the_arena)


def _children(pid: int, module: str = "attnserve_server.multiprocess.edge_process") -> list[int]:
    """The processes `pid` started running `module` (its edges, not its idle spinners)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(fields[1]) == pid and module.encode() in command:
                found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Load:
    """Clients on their own connections calling in a loop, counting status codes."""

    def __init__(self, target: str, clients: int = 8) -> None:
        self.codes: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.warm = threading.Event()
        # Daemons: a test that fails before stop() must not leave pytest waiting on them at exit.
        self._threads = [threading.Thread(target=self._run, args=(target,), daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, target: str) -> None:
        q = np.ones((16, 64), np.float32)
        with Client(target, timeout_s=10) as c:
            while not self._stop.is_set():
                try:
                    c.attend(q)
                    code = "OK"
                except AttnServeError as exc:
                    code = exc.code.name
                with self._lock:
                    self.codes[code] += 1
                    if self.codes["OK"] >= 200:
                        self.warm.set()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return dict(self.codes)


def _serve(server_process) -> ServerProcess:  # noqa: F811
    server = ServerProcess("--embed-dim", "64", "--num-heads", "4", "--device", "cpu", "--edge-processes", str(EDGES))
    server_process.append(server)
    return server


@pytest.mark.slow
def test_an_engine_that_dies_makes_every_edge_answer_unavailable_and_exit(server_process) -> None:  # noqa: F811
    server = _serve(server_process)
    edges = _children(server.proc.pid)
    assert len(edges) == EDGES
    load = Load(server.target)
    assert load.warm.wait(120), f"the load never got going: {dict(load.codes)}"
    server.proc.kill()  # SIGKILL: no drain, no goodbye
    server.proc.wait()
    assert _wait(lambda: all(_gone(pid) for pid in edges), 15), "an edge outlived its engine"
    codes = load.stop()
    # Never a hang (the clients' 10 s deadline would say DEADLINE_EXCEEDED) nor any other failure.
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    with Client(server.target, timeout_s=5) as c, pytest.raises(AttnServeError) as err:
        c.attend(np.ones((4, 64), np.float32))
    assert err.value.code.name == "UNAVAILABLE"


@pytest.mark.slow
def test_an_edge_that_dies_stops_the_server_with_a_non_zero_exit(server_process) -> None:  # noqa: F811
    server = _serve(server_process)
    edges = _children(server.proc.pid)
    load = Load(server.target)
    assert load.warm.wait(120), f"the load never got going: {dict(load.codes)}"
    os.kill(edges[0], signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1  # drained the other edge, then said so
    assert _wait(lambda: all(_gone(pid) for pid in edges), 15)
    codes = load.stop()
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    log = server.proc.stderr.read()
    assert "edge process 0 stopped unasked" in log
    # the dead edge is reported as such, not as a drain that ran out of time
    assert f"edge process 0 (pid {edges[0]}) exited with -9" in log
    assert "ran out before every accepted request was answered" not in log, log[-2000:]
    assert "; exit 1" in log.splitlines()[-1], log[-2000:]  # the last word: why the orchestrator restarts it


@pytest.mark.slow
def test_a_failed_server_exits_with_its_status_before_the_interpreter_finalizes() -> None:
    # A stand-in for torch's tensor destructors on a poisoned CUDA context, which abort the interpreter's
    # exit (seen on an H200): a server that failed must end with its status before any of that runs.
    import subprocess
    import sys

    script = "import atexit, os, sys\natexit.register(os.abort)\nfrom attnserve_server.cli import main\n"
    script += "sys.exit(main(sys.argv[1:]))\n"
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--embed-dim", "32", "--num-heads", "4"]
    flags += ["--device", "cpu", "--edge-processes", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and "attnserve ready" in proc.stdout.readline()
        edges = _children(proc.pid)
        os.kill(edges[0], signal.SIGKILL)  # the server fails: it drains the other edge and stops
        assert proc.wait(timeout=60) == 1, proc.stderr.read()[-2000:] if proc.stderr else ""
        assert "; exit 1" in proc.stderr.read().splitlines()[-1]  # its logs flushed first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_edge_process_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, attnserve_server.multiprocess.edge_process; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_engine_side_layers_import_no_grpc() -> None:
    # Batching, compute and the domain (its errors too: they carry status names) know no protocol.
    import subprocess
    import sys

    modules = ["errors", "domain", "batching", "compute.worker", "compute.devices", "compute.weights", "compute.graphs"]
    imports = "".join(f"import attnserve_server.{m}\n" for m in modules)
    code = f"import sys\n{imports}print(sorted(m for m in sys.modules if 'grpc' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_more_edges_than_the_default_thread_pool_has_threads() -> None:
    # Nothing waits on an edge process in a thread (a pidfd tells its exit): with 8 edges on a small
    # machine asyncio's default pool (cores + 4 threads) still runs statistics and shutdown.
    with running(settings(model(embed_dim=32, num_heads=4), edge_processes=8)) as handle:
        with Client(handle.target) as c:
            for _ in range(5):
                c.attend(np.ones((4, 32), np.float32))
        with triton.InferenceServerClient(handle.target) as kc:
            stats = kc.get_inference_statistics("default", as_json=True)["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) == 5
        assert handle.sample("attnserve_requests_total", model="default", method="Attend", code="OK") == 5
