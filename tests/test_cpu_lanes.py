"""`cpu_lanes`: a CPU worker computing several batches at once, each on a thread of its own; and
`cpu_pair_macs`: one lane whose large batches split into two halves computing side by side (pairing)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from attnserve import Client
from attnserve_server.compute.threads import CpuThreads
from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DEFAULT_THREADS, DeviceWorker
from attnserve_server.errors import ConfigError
from attnserve_server.model import limits_from_settings, spec_from_settings
from attnserve_server.settings import ModelSettings, validate

from conftest import model, output_of, request, running, settings

E, H = 16, 2
HELD_LEN = 50  # a batch with a query this long waits for HoldingWorker.release


class HoldingWorker(DeviceWorker):
    """The real worker; a batch holding a query of HELD_LEN says it started and waits for `release`."""

    started = threading.Event()
    release = threading.Event()
    ran_on: list[str] = []

    @classmethod
    def reset(cls) -> None:
        cls.started.clear()
        cls.release.clear()
        cls.ran_on = []

    def run(self, requests):
        if any(r.query_len == HELD_LEN for r in requests):
            HoldingWorker.started.set()
            assert HoldingWorker.release.wait(20), "the test never released the held batch"
        HoldingWorker.ran_on.append(threading.current_thread().name)
        return super().run(requests)


class PairingWorker(HoldingWorker):
    """HoldingWorker whose shared batches each wait until two have started. A half of a few microseconds
    could otherwise end before the second runner wakes, and the first runner would take the rest itself."""

    halves = threading.Barrier(2, timeout=20)

    def run_shared(self, requests):
        PairingWorker.halves.wait()
        return super().run_shared(requests)


@contextlib.contextmanager
def held_batch(client: Client, pool: ThreadPoolExecutor, rng: np.random.Generator) -> Iterator[Future]:
    """Sends a request of HELD_LEN and yields its future once its batch runs; the batch ends with the block."""
    held = pool.submit(client.attend, rng.standard_normal((1, HELD_LEN, E), dtype=np.float32))
    try:
        assert HoldingWorker.started.wait(20)
        yield held
    finally:
        HoldingWorker.release.set()


def test_with_two_lanes_a_request_is_answered_while_the_other_lane_computes() -> None:
    HoldingWorker.reset()
    rng = np.random.default_rng(0)
    config = settings(model(embed_dim=E, num_heads=H, device=("cpu",), cpu_lanes=2, max_queue_delay_ms=0))
    with running(config, worker_factory=HoldingWorker) as h, Client(h.target) as c:
        warm_up = len(HoldingWorker.ran_on)
        with ThreadPoolExecutor(1) as pool:
            with held_batch(c, pool, rng) as held:
                # One lane holds its batch; with one lane this call would wait for it.
                x = rng.standard_normal((1, 5, E), dtype=np.float32)
                assert c.attend(x).output.shape == (1, 5, E)
                assert HoldingWorker.ran_on[warm_up:] == HoldingWorker.ran_on[-1:]  # the held one has not run
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
    with pytest.raises(ConfigError, match=r"cpu_lanes: expected 1\.\.\d+ \(the CPUs this process may run on\), got 0"):
        validate(settings(model(cpu_lanes=0)))


def test_pairing_gives_one_lane_of_several_threads_a_second_runner_on_half_of_them() -> None:
    def worker(threads: int | None, **fields: int) -> DeviceWorker:
        spec = spec_from_settings(ModelSettings(embed_dim=E, num_heads=H, device=("cpu",), **fields))
        return DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"), CpuThreads(threads))

    for threads, fields, runners in [
        (2, {"cpu_pair_macs": 1}, 2),
        (2, {"cpu_pair_macs": 0}, 1),  # off
        (1, {"cpu_pair_macs": 1}, 1),  # one thread: nothing to share
        (2, {"cpu_pair_macs": 1, "cpu_lanes": 2}, 2),  # two lanes, no pairing
    ]:
        w = worker(threads, **fields)
        try:
            assert (w.runners, w.pairs) == (runners, runners == 2 and w.lanes == 1), (threads, fields)
        finally:
            w.close()
    w = worker(2, cpu_pair_macs=1)
    try:
        rng = np.random.default_rng(1)
        batch = [request(rng.standard_normal((1, 7, E), dtype=np.float32)) for _ in range(3)]
        whole, shared = w.run(batch), w.run_shared(batch)
        for a, b in zip(whole, shared, strict=True):
            np.testing.assert_allclose(output_of(b), output_of(a), rtol=1e-5, atol=1e-6)
        assert not whole[0].batch.paired
        assert (shared[0].batch.threads, shared[0].batch.paired) == (1, True)
    finally:
        w.close()
    two_workers = ModelSettings(embed_dim=E, num_heads=H, device=("cpu", "cpu"), cpu_pair_macs=1)
    assert spec_from_settings(two_workers).cpu_pair_macs == 0 and limits_from_settings(two_workers).pair_work == 0
    with pytest.raises(ConfigError, match=r"cpu_pair_macs: expected >= 0, got -1"):
        validate(settings(model(cpu_pair_macs=-1)))


def test_pairing_computes_the_halves_of_a_large_batch_side_by_side_through_the_server() -> None:
    HoldingWorker.reset()
    PairingWorker.halves.reset()
    rng = np.random.default_rng(2)
    # Every batch of two or more requests splits (pair_work 1); no pipelining cap, so the four queued
    # below form one batch; no solo runs, which would hold the event loop itself.
    config = settings(
        model(embed_dim=E, num_heads=H, device=("cpu",), cpu_pair_macs=1, pipeline=False, max_queue_delay_ms=0),
        torch_threads=2,
        solo_macs=0,
    )
    xs = [rng.standard_normal((1, length, E), dtype=np.float32) for length in (5, 9, 5, 12)]  # mixed: padded
    with running(config, worker_factory=PairingWorker) as h, Client(h.target) as c:
        warm_up = len(HoldingWorker.ran_on)
        with ThreadPoolExecutor(5) as pool:
            with held_batch(c, pool, rng) as held:
                queued = [pool.submit(c.attend, x) for x in xs]
                h.wait_for(lambda: h.sample("attnserve_queue_depth", model="default") == 4)
            paired = [f.result(timeout=20).output for f in queued]
            held.result(timeout=20)
        served = HoldingWorker.ran_on[warm_up:]
        assert len(served) == 3 and len(set(served[1:])) == 2  # the held batch, then two halves on two threads
        assert h.sample("attnserve_cpu_paired_batches_total", model="default", device="cpu") == 2
        assert h.sample("attnserve_cpu_batches_total", model="default", device="cpu", threads="1") >= 2
        for x, out in zip(xs, paired, strict=True):  # each answer as the request alone gets it
            np.testing.assert_allclose(out, c.attend(x).output, rtol=1e-5, atol=1e-6)


class InterleavedWorker(DeviceWorker):
    """Once a thread has set its count for a batch, another thread sets two, as a first runner does."""

    def _set_cpu_threads(self, macs: int, requests: int):
        chosen = super()._set_cpu_threads(macs, requests)
        other = threading.Thread(target=torch.set_num_threads, args=(2,))
        other.start()
        other.join()
        return chosen


def test_a_paired_batch_keeps_its_own_thread_count_when_another_thread_sets_one_after_it() -> None:
    spec = spec_from_settings(ModelSettings(embed_dim=E, num_heads=H, device=("cpu",), cpu_pair_macs=1))
    w = InterleavedWorker(spec, random_projections(spec, 0), torch.device("cpu"), CpuThreads(2))
    seen: list[int] = []
    before = torch.get_num_threads()

    def fresh_thread() -> None:  # a thread that never ran torch: its first batch is a shared one
        batch = [request(np.ones((1, 7, E), dtype=np.float32)) for _ in range(2)]
        assert w.run_shared(batch)[0].batch.threads == 1
        seen.append(torch.get_num_threads())

    try:
        t = threading.Thread(target=fresh_thread)
        t.start()
        t.join(20)
        assert seen == [1]  # torch's lazy per-thread set-up did not take the other thread's two
    finally:
        w.close()
        torch.set_num_threads(before)
