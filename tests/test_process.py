"""The command line and the process: SIGTERM drain, the torch-free client, infer, bench, codegen drift."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import queue
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from attnserve_bench.process import spawn_serve
from prometheus_client.parser import text_string_to_metric_families

from attnserve import AttnServeError, Client
from attnserve_server.runtime import openmp
from attnserve_server.solo import STREAK

from conftest import TEST_EDGES, TEST_LOOP, Running, run_cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


class ServerProcess:
    def __init__(self, *flags: str, preexec_fn: Callable[[], object] | None = None) -> None:
        server = spawn_serve(*flags, stderr=subprocess.PIPE, preexec_fn=preexec_fn)
        self.proc, self.target, self.metrics_port = server.proc, server.target, server.metrics_port

    def sample(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


@pytest.fixture
def server_process() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_sigterm_finishes_every_accepted_request_and_exits_zero(server_process) -> None:
    # Batches wait a minute for company, so the requests are still queued when SIGTERM lands.
    server = ServerProcess(
        "--embed-dim",
        "32",
        "--num-heads",
        "4",
        "--max-queue-delay-ms",
        "60000",
        "--grace-s",
        "20",
        "--device",
        "cpu",
    )
    server_process.append(server)
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    with Client(server.target, timeout_s=60) as c, concurrent.futures.ThreadPoolExecutor(6) as pool:
        accepted = [pool.submit(c.attend, x) for _ in range(6)]
        deadline = time.monotonic() + 60  # a cold CI machine is slow to connect six clients
        while server.sample("attnserve_queue_depth", model="default") < 6:
            assert time.monotonic() < deadline, "requests never queued"
            concurrent.futures.wait(accepted, timeout=0.05)
        server.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=60) for f in accepted]
        assert [r.output.shape for r in results] == [(5, 32)] * 6
        assert all(r.timing.batch_size == 6 for r in results)  # drained as one batch, at once
        assert server.proc.wait(timeout=30) == 0
        with pytest.raises(AttnServeError) as err:
            c.attend(x, timeout_s=2)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    log = server.proc.stderr.read()
    assert "shutting down" in log
    assert re.search(r"stopped in \d+\.\ds, every accepted request answered; exit 0", log)
    assert f"event loop: {'asyncio' if TEST_LOOP == 'asyncio' else 'uvloop'}" in log  # uvloop: the server extra's
    # serve's own OpenMP default, unless this environment chose one (openmp.py)
    chosen = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    assert f"OpenMP: {', '.join(chosen) or f'OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT={openmp.SPIN_COUNT}'}" in log
    # and its malloc settings, unless this environment chose (allocator.py)
    operator = any(k.startswith("MALLOC_") or k == "LD_PRELOAD" for k in os.environ)
    if not operator and "glibc.malloc." not in os.environ.get("GLIBC_TUNABLES", ""):
        assert "malloc: M_MMAP_MAX=0, M_TRIM_THRESHOLD=1073741824, M_TOP_PAD=67108864, M_ARENA_MAX=1" in log
    # and the heap it keeps, frozen out of later collections once it has started (pyheap.py)
    assert re.search(r"gc: \d+ startup objects frozen, young threshold 5000", log)


def test_a_stop_whose_grace_runs_out_says_so_and_fails_what_is_left_unavailable(server_process) -> None:
    # No grace at all, and a request held in the queue (its batch waits a minute for company).
    server = ServerProcess(
        *("--embed-dim", "32", "--num-heads", "4", "--device", "cpu"),
        *("--max-queue-delay-ms", "60000", "--grace-s", "0"),
    )
    server_process.append(server)
    with Client(server.target, timeout_s=60, retries=False) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(c.attend, np.ones((5, 32), np.float32))
        deadline = time.monotonic() + 60
        while server.sample("attnserve_queue_depth", model="default") < 1:
            assert time.monotonic() < deadline, "the request never queued"
            concurrent.futures.wait([held], timeout=0.05)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(AttnServeError) as err:
            held.result(timeout=60)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
    assert server.proc.wait(timeout=30) == 0
    log = server.proc.stderr.read()
    assert "shutdown grace of 0.0s ran out before every accepted request was answered" in log, log[-2000:]
    assert re.search(r"stopped in \d+\.\ds, NOT every accepted request answered; exit 0", log), log[-2000:]


def test_sigterm_under_load_answers_every_call_ok_or_unavailable_never_cancelled(server_process) -> None:
    # 16 clients keep the server busy; SIGTERM lands mid-stream. gRPC's own stop cancels calls it has
    # accepted but not yet handed over (CANCELLED, which no client retries): the server must answer
    # them UNAVAILABLE instead, and every accepted request OK.
    server = ServerProcess("--embed-dim", "64", "--num-heads", "4", "--device", "cpu")
    server_process.append(server)
    q = np.ones((16, 64), np.float32)
    codes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    warm = threading.Event()
    stop = threading.Event()

    def client() -> None:
        with Client(server.target, timeout_s=10) as c:
            while not stop.is_set():
                try:
                    c.attend(q)
                    code = "OK"
                except AttnServeError as exc:
                    code = exc.code.name
                with lock:
                    codes[code] += 1
                    if codes["OK"] >= 400:
                        warm.set()
                if code != "OK" and server.proc.poll() is not None:
                    return

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    assert warm.wait(120), f"the load never got going: {dict(codes)}"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    stop.set()
    for t in threads:
        t.join(60)
    assert set(codes) <= {"OK", "UNAVAILABLE"}, dict(codes)


def test_sigterm_does_not_wait_out_its_grace_for_a_client_that_keeps_its_connection_idle(server_process) -> None:
    # perf_analyzer keeps its connections open after the server's GOAWAY, and gRPC's own stop waits
    # for every connection to close: the server used to sit out its whole grace (here 60 s) before it
    # exited. This client speaks HTTP/2's preface and then ignores everything, as such a client does.
    server = ServerProcess("--embed-dim", "32", "--num-heads", "4", "--grace-s", "60", "--device", "cpu")
    server_process.append(server)
    host, port = server.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as idle:
        idle.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # preface, SETTINGS
        assert idle.recv(9)[3] == 4  # the server's SETTINGS: the connection is up
        # retries off: the first refusal is the server's own answer, not a reconnection's
        with Client(server.target, timeout_s=30, retries=False) as c:
            c.attend(np.ones((4, 32), np.float32))
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(AttnServeError) as late:
                while True:
                    c.attend(np.ones((4, 32), np.float32), timeout_s=5)
        assert late.value.code == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in late.value.message or "connect" in late.value.message, late.value.message
        assert server.proc.wait(timeout=12) == 0  # not after gRPC's own wait for the idle connection (20 s)
    log = server.proc.stderr.read()
    assert "grace of 60.0s ran out" not in log, log[-2000:]


def test_sigterm_ends_a_stream_its_client_keeps_open_unavailable_once_its_requests_are_answered(
    server_process,
) -> None:
    # A bidirectional stream left open (a client between requests) would hold a stopping server for
    # its whole grace, then end "Cancelling all calls". It ends once its requests are answered, with
    # UNAVAILABLE telling the client to open it again elsewhere.
    server = ServerProcess("--embed-dim", "32", "--num-heads", "4", "--grace-s", "60", "--device", "cpu")
    server_process.append(server)
    outgoing: queue.Queue = queue.Queue()

    def requests() -> Iterator[dict]:
        while (item := outgoing.get()) is not None:
            yield item

    with Client(server.target, timeout_s=30, retries=False) as c:
        answers = c.attend_stream(requests())
        outgoing.put({"query": np.ones((4, 32), np.float32)})
        first = next(answers)
        assert first.error is None and first.output.shape == (4, 32)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(AttnServeError) as ended:
            next(answers)
        outgoing.put(None)
    assert ended.value.code == grpc.StatusCode.UNAVAILABLE
    assert "open the stream again" in ended.value.message, ended.value.message
    assert server.proc.wait(timeout=12) == 0  # not at the end of its 60 s grace


def test_sigterm_ends_an_open_kserve_stream_unavailable_too(server_process) -> None:
    from tritonclient.grpc import service_pb2 as v2
    from tritonclient.grpc import service_pb2_grpc as v2_grpc

    server = ServerProcess("--embed-dim", "32", "--num-heads", "4", "--grace-s", "60", "--device", "cpu")
    server_process.append(server)
    outgoing: queue.Queue = queue.Queue()
    query = v2.ModelInferRequest.InferInputTensor(name="query", datatype="FP32", shape=[1, 4, 32])
    request = v2.ModelInferRequest(model_name="default", inputs=[query])
    request.raw_input_contents.append(np.ones((1, 4, 32), np.float32).tobytes())
    with grpc.insecure_channel(server.target) as channel:
        answers = v2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(outgoing.get, None), timeout=30)
        outgoing.put(request)
        first = next(answers)
        assert first.error_message == "" and first.infer_response.outputs[0].shape == [1, 4, 32]
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            next(answers)
        outgoing.put(None)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "open the stream again" in ended.value.details(), ended.value.details()
    assert server.proc.wait(timeout=12) == 0


BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import numpy as np
import attnserve
from attnserve import Client
with Client(sys.argv[1], timeout_s=30) as c:
    r = c.attend(np.ones((3, 32), np.float32), dtype="bfloat16", model="half")
assert "torch" not in sys.modules
print("ok", r.output.shape, r.output.dtype)
"""


def test_serve_raises_its_open_files_limit_so_that_more_clients_connect_than_it_started_with(server_process) -> None:
    # At a soft limit of 128 gRPC stopped accepting ("File descriptor limit reached. Retrying."), and the
    # 107th connection's call waited out its deadline (runtime/files.py).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit on open files here is {hard}")
    server = ServerProcess(
        "--embed-dim", "32", "--num-heads", "4", "--device", "cpu",
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard)),
    )  # fmt: skip
    server_process.append(server)
    x = np.ones((3, 32), np.float32)
    clients = []
    try:
        for _ in range(250):  # each its own connection, kept open
            clients.append(Client(server.target, timeout_s=10))
            assert clients[-1].attend(x).output.shape == (3, 32)
    finally:
        for c in clients:
            c.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    log = server.proc.stderr.read()
    assert "open files: at most " in log and " (raised from 128)" in log, log[:2000]
    assert "File descriptor limit reached" not in log


def test_the_client_imports_and_works_with_torch_blocked(default_server: Running) -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, default_server.target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok (3, 32) float32"


def test_health_exits_0_only_when_serving(default_server: Running) -> None:
    r = run_cli("health", "--target", default_server.target, "--service", "bare")
    assert (r.returncode, r.stdout.strip()) == (0, "SERVING")
    r = run_cli("health", "--target", default_server.target, "--service", "nope")
    assert r.returncode == 1 and "NOT_FOUND: the server has no health status named 'nope'" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there
    r = run_cli("health", "--target", f"127.0.0.1:{closed}", "--timeout-s", "1")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_infer_prints_shapes_timings_and_a_summary(default_server: Running, tmp_path: Path) -> None:
    out = tmp_path / "y.npy"
    r = run_cli(
        "infer",
        "--target",
        default_server.target,
        "--model",
        "cross",
        "--batch",
        "2",
        "--seq-len",
        "5",
        "--kv-len",
        "7",
        "--need-weights",
        "--key-lengths",
        "7,3",
        "--output",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "output: shape [2, 5, 32] float32" in r.stdout
    assert "attention_weights: shape [2, 4, 5, 7] float32" in r.stdout
    assert re.search(r"timing: queue [\d.]+ ms +compute [\d.]+ ms", r.stdout)
    assert np.load(out).shape == (2, 5, 32)
    bad = run_cli("infer", "--target", default_server.target, "--model", "nope")
    assert bad.returncode == 1 and "NOT_FOUND: model: no model named 'nope'" in bad.stderr


@pytest.mark.parametrize("edges", ["1", "2"])
def test_an_ipv6_host_is_served_and_shown_in_brackets(edges: str) -> None:
    # Before: --host ::1 did not start, gRPC reading "::1:50051" as a host name ("Misformatted domain name").
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    h = spawn_serve("--host", "::1", "--edge-processes", edges, "--embed-dim", "32", "--num-heads", "2")
    try:
        assert h.host == "[::1]" and h.target == f"[::1]:{h.port}"
        with Client(h.target, timeout_s=30) as c:
            assert c.attend(np.ones((3, 32), np.float32)).output.shape == (3, 32)
        with urllib.request.urlopen(f"http://[::1]:{h.metrics_port}/metrics", timeout=30) as r:
            assert b"attnserve_requests_total" in r.read()
    finally:
        h.proc.terminate()
        assert h.proc.wait(30) == 0


def test_edge_processes_past_what_the_host_runs_are_refused_in_one_line() -> None:
    # Before: --edge-processes 100000 started edge processes until the machine ran out of memory, and an
    # arena the host cannot map ended the start-up in a traceback (an edge process already started).
    serve = ("serve", "--port", "0", "--metrics-port", "-1", "--embed-dim", "32", "--num-heads", "2")
    cpus = len(os.sched_getaffinity(0))
    r = run_cli(*serve, "--edge-processes", str(4 * cpus + 1))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"attnserve: configuration error: edge_processes: expected auto or 1..{4 * cpus} (4 per CPU this process "
        f"may run on), got {4 * cpus + 1}"
    )
    if cpus < 2:
        return
    r = run_cli(*serve, "--edge-processes", "2", "--edge-arena-bytes", str(2**62))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"attnserve: configuration error: edge_arena_bytes: cannot map {2**62:,} bytes of shared memory for edge "
        "process 0 (Cannot allocate memory)"
    )


def test_user_mistakes_get_one_line_not_a_traceback(default_server: Running, tmp_path: Path) -> None:
    r = run_cli("infer", "--target", default_server.target, "--query", str(tmp_path / "q.npy"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"attnserve infer: {tmp_path / 'q.npy'}: No such file or directory"
    np.save(tmp_path / "q64.npy", np.ones((4, 32)))  # numpy's default float64
    r = run_cli("infer", "--target", default_server.target, "--query", str(tmp_path / "q64.npy"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unsupported dtype float64" in r.stderr and "pass dtype='float32'" in r.stderr
    (tmp_path / "garbage.npy").write_bytes(b"not an array")  # numpy said it held pickled data
    r = run_cli("infer", "--target", default_server.target, "--query", str(tmp_path / "garbage.npy"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"attnserve infer: {tmp_path / 'garbage.npy'}: not a .npy file (numpy.save writes one)"
    # Random data past what a message carries: a MemoryError's traceback (391 GiB), or minutes of generating.
    r = run_cli("infer", "--target", default_server.target, "--batch", "100000", "--seq-len", "4096")
    assert r.returncode == 2 and r.stderr.strip() == (
        "attnserve infer: random data: 100000 x 4096 x 32 float32 values take 50,000.0 MiB, more than a message"
        " carries (256.0 MiB): pass a smaller --batch, --seq-len or --kv-len"
    )
    for flag, value in (
        ("--key-lengths", "x"),
        ("--batch", "-1"),
        ("--seq-len", "0"),
        ("--timeout-s", "0"),
        ("--target", "http://127.0.0.1:50051"),  # before: a traceback
        ("--output", str(tmp_path / "missing" / "y.npy")),  # before: a traceback after the request
    ):
        r = run_cli("infer", "--target", default_server.target, flag, value)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"attnserve infer: error: argument {flag}: expected " in r.stderr and f"got '{value}'" in r.stderr
    # bench checks where it will write its results before it runs (before: a traceback after the run).
    missing = tmp_path / "missing" / "x.json"
    r = run_cli("bench", "--target", default_server.target, "--json", str(missing))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"attnserve bench: error: argument --json: expected a file in a directory that exists, got '{missing}' "
        f"({missing.parent} is not)"
    )
    # bench's own numbers, and a model the server it starts refuses (before: tracebacks, or no request measured).
    for flag, value in (
        ("--processes", "-1"),
        ("--warmup-s", "nan"),
        ("--inprocess-s", "-1"),
        ("--pa-modes", "x"),
        ("--perf-analyzer", str(tmp_path / "perf_analyzer")),  # before: a traceback once the servers had run
    ):
        r = run_cli("bench", "--target", default_server.target, flag, value)
        assert r.returncode == 2 and "Traceback" not in r.stderr and f"argument {flag}: expected " in r.stderr
    r = run_cli("bench", "--embed-dim", "30", "--duration-s", "0.5", "--no-inprocess")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-2:] == [
        "attnserve: configuration error: models[0] ('default').embed_dim: 30 is not divisible by num_heads 8",
        "attnserve bench: max_batch=64: the server it started exited with code 2",
    ]
    # serve and bench in a client-only install (torch absent) say which extra to install.
    serve = BLOCK_TORCH.split("import numpy")[0] + "from attnserve_server.cli import main\nsys.exit(main(['serve']))\n"
    r = subprocess.run([sys.executable, "-c", serve], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "attnserve serve: needs the server extra (missing: torch): pip install 'attnserve[server]'" in r.stderr


def test_bench_prints_a_table_with_the_in_process_ratio_and_the_floor(default_server: Running, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    short = ("--duration-s", "0.5", "--warmup-s", "0.2", "--processes", "2", "--inprocess-s", "0.3")
    r = run_cli(
        *("bench", "--target", default_server.target, "--model", "default", "--concurrency", "1,4"),
        *(*short, "--seq-len", "8", "--floor", "--json", str(out), "--plot", str(tmp_path / "bench.png")),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bench.png").read_bytes()[
        :8
    ] == b"\x89PNG\r\n\x1a\n" and f"plot: {tmp_path / 'bench.png'}" in r.stdout
    assert re.search(r"conc +req/s +p50 ms +p90 ms +p99 ms +batch +in-proc req/s +ratio", r.stdout)
    rows = json.loads(out.read_text())["rows"]
    served = [row for row in rows if row["server"] == default_server.target]
    floor = [row for row in rows if row["server"].startswith("grpc floor")]
    assert [row["concurrency"] for row in served] == [1, 4] and [row["concurrency"] for row in floor] == [1, 4]
    assert all(row["requests"] > 0 and row["errors"] == 0 for row in rows)
    assert all(row["ratio"] > 0 for row in served) and all(row["ratio"] is None for row in floor)


def test_bench_sends_mixed_lengths_in_turn(default_server: Running, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    tokens = default_server.sample("attnserve_tokens_total", model="default")
    sequences = default_server.sample("attnserve_batch_sequences_sum", model="default")
    r = run_cli(
        *("bench", "--target", default_server.target, "--model", "default", "--concurrency", "3"),
        *("--duration-s", "0.5", "--warmup-s", "0.2", "--processes", "1", "--inprocess-s", "0.2"),
        *("--seq-len", "8,2,5", "--json", str(out)),
    )
    assert r.returncode == 0, r.stderr
    assert "request: batch 1 x L=8,2,5" in r.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] > 0 and row["errors"] == 0 and row["ratio"] > 0
    # Every length was sent: the server computed 5 query tokens a sequence on average, not 8.
    mean = (default_server.sample("attnserve_tokens_total", model="default") - tokens) / (
        default_server.sample("attnserve_batch_sequences_sum", model="default") - sequences
    )
    assert 4 < mean < 6
    bad = run_cli("bench", "--target", default_server.target, "--seq-len", "8,0")
    assert bad.returncode == 2
    assert "--seq-len: expected a length or a comma list of them, each >= 1, got '8,0'" in bad.stderr
    # Before: int()'s traceback for --concurrency a,b; and a server not there was waited for a minute, silently.
    for flag, value, expected in (
        ("--concurrency", "a,b", "expected a number of requests or a comma list of them, each >= 1, got 'a,b'"),
        ("--duration-s", "-1", "expected a number of seconds > 0, got '-1'"),
    ):
        bad = run_cli("bench", "--target", default_server.target, flag, value)
        assert bad.returncode == 2 and f"argument {flag}: {expected}" in bad.stderr and "Traceback" not in bad.stderr
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # a port nothing listens on
        gone = f"127.0.0.1:{unused.getsockname()[1]}"
        bad = run_cli("bench", "--target", gone, "--concurrency", "1", "--no-inprocess")
    assert bad.returncode == 1 and bad.stderr.startswith(f"attnserve bench: {gone}: UNAVAILABLE: ")


def test_bench_rounds_measure_each_level_beside_its_own_limit(default_server: Running, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = run_cli(
        *("bench", "--target", default_server.target, "--model", "default", "--concurrency", "2", "--rounds", "2"),
        *("--duration-s", "0.4", "--warmup-s", "0.1", "--processes", "1", "--inprocess-s", "0.2"),
        *("--seq-len", "8", "--json", str(out)),
    )
    assert r.returncode == 0, r.stderr
    assert "medians of 2 rounds" in r.stdout and r.stderr.count("in-process: batches of") == 2
    assert "(round 1 of 2)" in r.stderr and "(round 2 of 2)" in r.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    first, second = result["rounds"]
    assert (first["round"], second["round"], row["rounds"], row["round"]) == (1, 2, 2, None)
    for one in (first, second):  # each round has its own limit and its own ratio
        assert one["requests"] > 0 and one["errors"] == 0
        assert one["ratio"] == pytest.approx(one["throughput_rps"] / one["inprocess_rps"])
    assert row["requests"] == first["requests"] + second["requests"]
    assert row["ratio"] == pytest.approx((first["ratio"] + second["ratio"]) / 2)
    bad = run_cli("bench", "--target", default_server.target, "--rounds", "0")
    assert bad.returncode == 2 and "--rounds: expected a whole number >= 1, got '0'" in bad.stderr


def test_the_in_process_limit_is_the_faster_of_whole_batches_and_two_side_by_side(
    default_server: Running, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnserve_bench import bench
    from attnserve_bench.bench import inprocess_throughput

    with Client(default_server.target) as client:
        info = client.model("default")
    rng = np.random.default_rng(0)

    def inputs(length: int) -> list[dict]:
        query = rng.standard_normal((1, length, info.embed_dim), dtype=np.float32)
        return [{"query": query, "model": info.name, "causal": False, "dtype": None}]

    # Two batches of 4 at L=1280 (E=32: 110 M multiply-adds a sequence) hold the work from which a CPU server
    # on two threads splits a batch (twice cpu_pair_macs, 400 M); it then computes batches of 4 two at a time
    # side by side (batching.py), each one execution of 4, so the batch of 4 is timed that way too.
    assert info.embed_dim == 32
    long = inputs(1280)
    rps = inprocess_throughput(info, long, 4, seconds=0.2, torch_threads=2)
    found = re.search(r"in-process: ([0-9.]+) req/s in whole batches of 4, ([0-9.]+) two at a time side by side",
                      err := capsys.readouterr().err)  # fmt: skip
    assert found is not None, err
    whole, paired = float(found[1]), float(found[2])
    assert whole > 0 and paired > 0 and rps == pytest.approx(max(whole, paired), abs=0.05)
    # Batches the server never splits (sequences of L=8 by fours, one of L=1280), and one thread.
    assert inprocess_throughput(info, inputs(8), 4, seconds=0.2, torch_threads=2) > 0
    assert inprocess_throughput(info, long, 1, seconds=0.2, torch_threads=2) > 0
    assert inprocess_throughput(info, long, 4, seconds=0.2, torch_threads=1) > 0
    assert "side by side" not in capsys.readouterr().err
    # Whichever is faster is the limit: two cycles of a batch of 4 in a microsecond make it 8 requests / µs.
    monkeypatch.setattr(bench, "_paired_cycle_s", lambda worker, cycle, seconds: 1e-6)
    assert inprocess_throughput(info, long, 4, seconds=0.2, torch_threads=2) == pytest.approx(8e6)


def test_serve_refuses_a_bad_configuration_with_a_clear_message(tmp_path: Path) -> None:
    r = run_cli("serve", "--num-heads", "3", "--metrics-port", "-1")
    assert r.returncode == 2 and "embed_dim: 256 is not divisible by num_heads 3" in r.stderr
    missing = tmp_path / "none.safetensors"
    r = run_cli("serve", "--weights", str(missing), "--port", "0", "--metrics-port", "-1", "--device", "cpu")
    assert r.returncode == 2 and f"weights file {missing}: cannot read" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_a_model_configured_for_cuda_refuses_to_start_without_a_gpu() -> None:
    # Never a silent CPU fallback that still reports SERVING (the GPU Helm values ask for cuda).
    r = run_cli("serve", "--device", "cuda", "--port", "0", "--metrics-port", "-1")
    assert r.returncode == 2, r.stderr
    assert "device 'cuda': 0 CUDA device(s) visible" in r.stderr and "use 'auto' or 'cpu'" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_every_setting_with_its_environment_variable() -> None:
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    for flag, env in (
        ("--max-queue-delay-ms", "ATTNSERVE_MAX_QUEUE_DELAY_MS"),
        ("--device", "ATTNSERVE_DEVICE"),
    ):
        assert flag in r.stdout and env in r.stdout


def test_generated_protobuf_code_matches_the_proto() -> None:
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_real_prometheus_scrapes_the_metrics_port(default_server: Running, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (./dev test installs it with apt-get)")
    with socket.socket() as s:  # a free port for Prometheus's own API
        s.bind(("127.0.0.1", 0))
        api_port = s.getsockname()[1]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: attnserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{default_server.server.metrics_port}']}}]\n"
    )
    with Client(default_server.target) as c:
        c.attend(np.ones((3, 32), np.float32), model="default")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{api_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    query = 'sum(attnserve_requests_total{model="default",method="Attend",code="OK"})'
    url = f"http://127.0.0.1:{api_port}/api/v1/query?query={urllib.parse.quote(query)}"
    try:
        deadline = time.monotonic() + 60
        while True:  # the first sample lands a scrape interval after start: poll
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
            except OSError:
                result = []
            if result:
                break
            assert time.monotonic() < deadline, "Prometheus never answered the query"
            time.sleep(0.2)
        assert float(result[0]["value"][1]) >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


PERF_ANALYZER = Path(__file__).resolve().parent.parent / ".cache" / "perf-venv" / "bin" / "perf_analyzer"


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(), reason="perf_analyzer not set up (scripts/perf_analyzer.sh --setup; .ci/run does it)"
)
def test_perf_analyzer_drives_the_kserve_api_and_reads_server_statistics(tmp_path: Path) -> None:
    out = tmp_path / "pa.json"
    r = run_cli(
        *("bench", "--perf-analyzer", str(PERF_ANALYZER), "--pa-modes", "sync,async", "--concurrency", "1,4"),
        *("--duration-s", "0.5", "--seq-len", "8,3", "--embed-dim", "64", "--num-heads", "4", "--causal"),
        # Windows of 0.5 s on a shared CI machine spread widely: this test is about the plumbing.
        *("--pa-stability", "1000", "--no-inprocess", "--json", str(out)),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["server"].split()[0], row["concurrency"]) for row in rows] == [
        ("pa-sync", 1),
        ("pa-sync", 4),
        ("pa-async", 1),
        ("pa-async", 4),
    ]
    # requests and errors are the server's own counts over each run (ModelStatistics), of both lengths in turn.
    assert all(row["requests"] > 0 and row["errors"] == 0 and row["throughput_rps"] > 0 for row in rows)
    assert "Server: " in r.stderr and "Successful request count" in r.stderr  # perf_analyzer read the statistics


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(), reason="perf_analyzer not set up (scripts/perf_analyzer.sh --setup; .ci/run does it)"
)
def test_perf_analyzer_sends_through_system_shared_memory(tmp_path: Path) -> None:
    """perf_analyzer --shared-memory system: the server bench starts takes no optional input (perf_analyzer
    refuses a model with any), and perf_analyzer reads a raw_output_contents entry for each output, even one
    in shared memory (without it, it crashed on the first answer)."""
    out = tmp_path / "pa.json"
    r = run_cli(
        *("bench", "--perf-analyzer", str(PERF_ANALYZER), "--shared-memory", "--pa-modes", "async"),
        *("--concurrency", "1,3", "--duration-s", "0.5", "--seq-len", "8,3", "--embed-dim", "64", "--num-heads", "4"),
        *("--pa-stability", "1000", "--no-inprocess", "--json", str(out)),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--shared-memory system --output-shared-memory-size 2048" in r.stderr  # 8 x 64 FP32
    rows = json.loads(out.read_text())["rows"]
    assert [row["concurrency"] for row in rows] == [1, 3]
    assert all(row["requests"] > 0 and row["errors"] == 0 for row in rows)


STUCK_SERVER = """
import asyncio, logging, os, sys, threading
import numpy as np
sys.path.insert(0, os.getcwd())  # tests/
from conftest import model, settings
from attnserve_server.app import AttnServer
from attnserve_server.compute.worker import DeviceWorker

class StuckWorker(DeviceWorker):
    def run(self, requests):  # a query whose first element is 777 never comes back: a fault injected
        if any(np.frombuffer(r.query.data, dtype="<f4", count=1)[0] == 777.0 for r in requests):
            threading.Event().wait()
        return super().run(requests)

async def main():
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    server = AttnServer(settings(model(embed_dim=32, num_heads=4), worker_stall_s=0.5), worker_factory=StuckWorker)
    await server.start()
    print("ready", server.port, server.metrics_port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize("on_the_loop", [False, True], ids=["worker-thread", "event-loop"])
def test_a_stuck_worker_ends_the_process_with_status_1_and_says_why(tmp_path: Path, on_the_loop: bool) -> None:
    # In a process of its own (the verdict is the process's end), built as `attnserve serve` builds it,
    # with a worker that never returns from one request. After a streak of lone requests on a quiet
    # server that request computes on the event loop itself (solo.py), which the watchdog does not need.
    script = tmp_path / "stuck_server.py"
    script.write_text(STUCK_SERVER)
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert ready[:1] == ["ready"], proc.stderr.read()  # type: ignore[union-attr]
        with Client(f"127.0.0.1:{ready[1]}", timeout_s=30) as c:
            if on_the_loop and TEST_EDGES == 1:
                for _ in range(STREAK + 8):  # one at a time: the quiet streak that turns solo runs on
                    c.attend(np.ones((3, 32), np.float32))
                solo = f"http://127.0.0.1:{ready[2]}/metrics"
                with urllib.request.urlopen(solo, timeout=10) as r:
                    assert re.search(r'^attnserve_solo_batches_total\{model="default"\} [1-9]', r.read().decode(), re.M)
            with pytest.raises(AttnServeError) as err:
                c.attend(np.full((3, 32), 777.0, np.float32))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=30) == 1
        log = proc.stderr.read()  # type: ignore[union-attr]
        assert re.search(r"'default': a batch has been computing for [\d.]+ s, over worker_stall_s \(0.5 s\)", log)
        assert "its worker is stuck; exiting now with status 1" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
