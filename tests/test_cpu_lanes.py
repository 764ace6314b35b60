"""`cpu_lanes`: a CPU worker computing several batches at once, each on a thread of its own."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from attnserve import Client
from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DEFAULT_THREADS, DeviceWorker
from attnserve_server.errors import ConfigError
from attnserve_server.model import spec_from_settings
from attnserve_server.settings import ModelSettings, validate

from conftest import model, running, settings

E, H = 16, 2
HELD_LEN = 50  # a batch with a query this long waits for HoldingWorker.release


class HoldingWorker(DeviceWorker):
    """The real worker; a batch holding a query of HELD_LEN says it started and waits for `release`."""

    started = threading.Event()
    release = threading.Event()
    ran_on: list[str] = []

    def run(self, requests):
        if any(r.query_len == HELD_LEN for r in requests):
            HoldingWorker.started.set()
            assert HoldingWorker.release.wait(20), "the test never released the held batch"
        HoldingWorker.ran_on.append(threading.current_thread().name)
        return super().run(requests)


def test_with_two_lanes_a_request_is_answered_while_the_other_lane_computes() -> None:
    HoldingWorker.started.clear()
    HoldingWorker.release.clear()
    HoldingWorker.ran_on = []
    rng = np.random.default_rng(0)
    config = settings(model(embed_dim=E, num_heads=H, device=("cpu",), cpu_lanes=2, max_queue_delay_ms=0))
    with running(config, worker_factory=HoldingWorker) as h, Client(h.target) as c:
        warm_up = len(HoldingWorker.ran_on)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(c.attend, rng.standard_normal((1, HELD_LEN, E), dtype=np.float32))
            try:
                assert HoldingWorker.started.wait(20)
                # One lane holds its batch; with one lane this call would wait for it.
                x = rng.standard_normal((1, 5, E), dtype=np.float32)
                assert c.attend(x).output.shape == (1, 5, E)
                assert HoldingWorker.ran_on[warm_up:] == HoldingWorker.ran_on[-1:]  # the held one has not run
            finally:
                HoldingWorker.release.set()
            assert held.result(timeout=20).output.shape == (1, HELD_LEN, E)
        lanes = set(HoldingWorker.ran_on[warm_up:])
        assert len(lanes) == 2  # each batch on a lane's own thread


def test_lanes_share_the_cores_unless_threads_are_configured() -> None:
    spec = spec_from_settings(ModelSettings(embed_dim=E, num_heads=H, device=("cpu",), cpu_lanes=2))
    worker = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
    try:
        assert worker.lanes == 2 and worker.team_size == max(1, DEFAULT_THREADS // 2)
    finally:
        worker.close()
    with pytest.raises(ConfigError, match=r"cpu_lanes: expected >= 1, got 0"):
        validate(settings(model(cpu_lanes=0)))
