"""Shared fixtures: a real AttnServer on 127.0.0.1:0, driven from the test thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from attnserve_server import AttnServer
from attnserve_server.compute.staging import host_tensor
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.domain import Answer, AttentionRequest
from attnserve_server.metrics import Metrics
from attnserve_server.model import ServedModel
from attnserve_server.runtime.eventloop import loop_factory
from attnserve_server.settings import BatchingSettings, ModelSettings, ServerSettings


@dataclass
class Running:
    server: AttnServer
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def call(self, coro: Any, timeout_s: float = 60) -> Any:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def loop_thread_name(self) -> str:
        """The name of the thread the server's event loop runs on."""

        async def name() -> str:
            return threading.current_thread().name

        return self.call(name())

    def metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def sample(self, name: str, **labels: str) -> float:
        """The value of one sample from a real scrape (0 if absent)."""
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 20) -> None:
        """Polls a condition (a scrape, usually); fails the test if it does not hold in time."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.01)


class FailingWorker(DeviceWorker):
    """Fails any batch holding an FP32 query whose first element is 1234 (a fault injected for the test)."""

    def run(self, requests):
        if any(np.frombuffer(r.query.data, dtype="<f4", count=1)[0] == 1234.0 for r in requests):
            raise RuntimeError("injected fault")
        return super().run(requests)


def request(query: np.ndarray, causal: bool = False, need_weights: bool = False) -> AttentionRequest:
    """A worker-level request for self attention on an FP32 query [B, L, E]."""
    return AttentionRequest(host_tensor(torch.from_numpy(query)), None, None, None, causal, need_weights, False, False)


def output_of(answer: Answer, dtype: str = "<f4") -> np.ndarray:
    return np.frombuffer(answer.output, dtype=dtype).reshape(answer.output_shape)


def weights_of(answer: Answer, dtype: str = "<f4") -> np.ndarray:
    assert answer.weights is not None and answer.weights_shape is not None
    return np.frombuffer(answer.weights, dtype=dtype).reshape(answer.weights_shape)


# The device of every model the tests configure: scripts/gpu_check.sh runs the suites on "cuda".
TEST_DEVICE = os.environ.get("ATTNSERVE_TEST_DEVICE", "cpu")


def model(name: str = "default", **fields: Any) -> ModelSettings:
    batching = {k: fields.pop(k) for k in list(fields) if k in BatchingSettings.__dataclass_fields__}
    fields.setdefault("device", (TEST_DEVICE,))
    # float32 unless a test asks: on CUDA `auto` would be bfloat16, and the suites compare with fp32.
    fields.setdefault("dtype", "float32")
    return replace(ModelSettings(name=name, **fields), batching=BatchingSettings(**batching))


# The gRPC front of every test server: in the test's process (1), or in N edge processes in front of it
# (`ATTNSERVE_TEST_EDGES=2 ./dev test`; .ci/run runs the server suites both ways).
TEST_EDGES = int(os.environ.get("ATTNSERVE_TEST_EDGES", "1"))
if TEST_EDGES > 1:  # and every `attnserve serve` a test starts
    os.environ.setdefault("ATTNSERVE_EDGE_PROCESSES", str(TEST_EDGES))
# The event loop of every test server: the server's own choice (uvloop when installed), or asyncio's
# (`ATTNSERVE_TEST_LOOP=asyncio`; .ci/run's second pass), for every `attnserve serve` a test starts too.
TEST_LOOP = os.environ.get("ATTNSERVE_TEST_LOOP", "auto")
if TEST_LOOP != "auto":
    os.environ.setdefault("ATTNSERVE_EVENT_LOOP", TEST_LOOP)


def small_cpu_model(**kwargs: Any) -> ServedModel:
    """A served model (E=16, 2 heads) on the CPU, outside any server: `await load()`, then `close()`."""
    model_settings = ModelSettings(embed_dim=16, num_heads=2, device=("cpu",))
    metrics = Metrics(CollectorRegistry()).for_model(model_settings.name)
    return ServedModel(model_settings, metrics, DeviceWorker, **kwargs)


def settings(*models: ModelSettings, **fields: Any) -> ServerSettings:
    fields.setdefault("edge_processes", TEST_EDGES)
    fields.setdefault("event_loop", TEST_LOOP)
    return ServerSettings(host="127.0.0.1", port=0, metrics_port=0, grace_s=5.0, models=models or (model(),), **fields)


@contextlib.contextmanager
def running(server_settings: ServerSettings, **kwargs: Any) -> Iterator[Running]:
    """Starts a real server on its own event loop thread; stops it gracefully afterwards."""
    loop = loop_factory(server_settings.event_loop)[1]()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = AttnServer(server_settings, **kwargs)
    handle = Running(server, loop)
    try:
        handle.call(server.start())
        yield handle
    finally:
        handle.call(server.stop(2.0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def run_cli(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    """`python -m attnserve_server ARGS`, its output captured. One that outlives `timeout` (below pytest's
    120 s, so that this reports it) gets SIGABRT with its process group: it and the client processes it
    spawned (faulthandler is on in all of them) print every thread's stack, and the test fails with them."""
    command = [sys.executable, "-X", "faulthandler", "-m", "attnserve_server", *args]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGABRT)
            out, err = proc.communicate(timeout=15)
            pytest.fail(f"{args[0]} ran past {timeout:.0f} s; its stacks:\n{err[-12000:]}\n{out[-2000:]}")
        return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture(scope="session")
def default_server() -> Iterator[Running]:
    """One shared server for tests that only read: models of both kinds and cross-attention widths."""
    models = (
        model("default", embed_dim=32, num_heads=4, max_query_len=128, max_key_len=96),
        model("bare", kind="sdpa", embed_dim=32, num_heads=4, vdim=16),
        model("cross", embed_dim=32, num_heads=4, kdim=24, vdim=40),
        model("half", embed_dim=32, num_heads=4, dtype="bfloat16"),
    )
    with running(settings(*models)) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _torch_determinism() -> None:
    torch.manual_seed(0)
