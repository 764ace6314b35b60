"""Solo runs: a lone request on a quiet server computes on the event loop, not on the worker thread."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from test_batcher import WAIT_S, FakeRunner, Recorder, limits, start, stop, submit, until

from attnserve import AsyncClient, AttnServeError, Client
from attnserve_server.batching import Batcher
from attnserve_server.compute.worker import DEFAULT_THREADS, DeviceWorker
from attnserve_server.errors import BatchFailed
from attnserve_server.solo import SOLO_MACS, STREAK, SoloPolicy

from conftest import Running, model, running, settings

E, H = 32, 4
CPU = ("cpu",)  # solo is the CPU worker's: these servers run there whatever ATTNSERVE_TEST_DEVICE says


class Clocks:
    """A wall clock and a loop-CPU clock the test moves by hand."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def gap(self, wall_s: float, busy_s: float) -> None:
        self.wall += wall_s
        self.cpu += busy_s


def policy(clocks: Clocks, streak: int = 3, pressed: int = 2) -> SoloPolicy:
    return SoloPolicy(streak=streak, pressed=pressed, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)


def test_the_loop_computes_only_after_a_streak_of_quiet_requests() -> None:
    clocks = Clocks()
    p = policy(clocks, streak=3)
    assert [p.admit(True), p.admit(True), p.admit(False), p.admit(True), p.admit(True)] == [False] * 5
    assert not p.active  # company reset the count: two quiet since
    assert p.admit(True) is False and p.active  # the third quiet in a row turns it on, for the next
    assert p.admit(True) is True


def test_a_loop_busy_through_two_gaps_in_a_row_hands_requests_back_to_the_worker() -> None:
    clocks = Clocks()
    p = policy(clocks, streak=1, pressed=2)
    p.admit(True)
    assert p.admit(True)
    p.ran()
    clocks.gap(400e-6, 150e-6)  # a client's round trip: the loop idled most of the gap
    assert p.admit(True)
    p.ran()
    clocks.gap(100e-6, 95e-6)  # the next request was already waiting
    assert p.admit(True)  # one busy gap is not enough
    p.ran()
    clocks.gap(400e-6, 100e-6)  # quiet again: the count starts over
    assert p.admit(True)
    p.ran()
    clocks.gap(100e-6, 95e-6)
    assert p.admit(True)
    p.ran()
    clocks.gap(80e-6, 78e-6)
    assert p.admit(True) is False and not p.active  # two busy gaps in a row
    assert p.admit(True) is False  # and a new streak is needed (streak=1: on again for the next)
    assert p.admit(True) is True


def test_a_request_that_finds_company_ends_solo_at_once() -> None:
    clocks = Clocks()
    p = policy(clocks, streak=1)
    p.admit(True)
    assert p.admit(True)
    assert p.admit(False) is False and not p.active


class ThreadRecorder(FakeRunner):
    """A runner whose batches run at once and remember the thread they ran on."""

    def __init__(self, fail_on: object = None) -> None:
        super().__init__(fail_on)
        self.gate.set()
        self.threads: list[str] = []

    def __call__(self, items: list[object]) -> list[object]:
        self.threads.append(threading.current_thread().name)
        return super().__call__(items)


def test_the_batcher_runs_quiet_requests_on_the_loop_and_reports_them_as_batches_of_one() -> None:
    async def main() -> None:
        recorder = Recorder()
        b = Batcher(limits(), recorder)
        runner = ThreadRecorder()
        threads = start(b, runner)
        reported: list[list[object]] = []
        b.allow_solo(runner, lambda items, results, error: reported.append(items), lambda item: item != "big")
        loop_thread = threading.current_thread().name
        for i in range(STREAK):
            assert await submit(b, i) == ("done", i)
        assert loop_thread not in runner.threads  # the streak ran on the runner's thread
        assert await submit(b, "solo") == ("done", "solo")
        assert runner.threads[-1] == loop_thread
        assert reported[-1] == ["solo"] and recorder.batches[-1] == 1
        assert await submit(b, "big") == ("done", "big")  # not eligible: the runner's, solo or not
        assert runner.threads[-1] != loop_thread
        await stop(b, threads)

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_request_arriving_while_a_batch_computes_queues_for_the_worker() -> None:
    class HoldingRunner(ThreadRecorder):
        """Holds only the batch with "held" in it, until the test opens `hold`."""

        def __init__(self) -> None:
            super().__init__()
            self.hold = threading.Event()

        def __call__(self, items: list[object]) -> list[object]:
            if "held" in items:
                self.running.set()
                assert self.hold.wait(WAIT_S * 4), "the test never released the held batch"
            return super().__call__(items)

    async def main() -> None:
        b = Batcher(limits())
        runner = HoldingRunner()
        threads = start(b, runner)
        policy = SoloPolicy(streak=1)
        b.allow_solo(runner, None, lambda item: item != "held", policy)
        loop_thread = threading.current_thread().name
        assert await submit(b, "a") == ("done", "a")  # the streak of one, on the runner
        assert policy.active
        runner.running.clear()
        held = submit(b, "held")  # not eligible: queued for the runner, which holds it
        await runner.started()
        late = submit(b, "b")  # eligible, but a batch is computing: company
        await until(lambda: b.depth == 1)  # queued, not run on the loop
        assert not policy.active
        runner.hold.set()
        assert await asyncio.gather(held, late) == [("done", "held"), ("done", "b")]
        assert runner.batches[-2:] == [["held"], ["b"]]
        assert loop_thread not in runner.threads
        await stop(b, threads)

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_failing_solo_run_fails_its_caller_and_the_next_request_is_served() -> None:
    async def main() -> None:
        b = Batcher(limits())
        runner = ThreadRecorder(fail_on="bad")
        threads = start(b, runner)
        b.allow_solo(runner, None, lambda item: True, SoloPolicy(streak=1))
        await submit(b, "a")
        with pytest.raises(BatchFailed, match="boom"):
            await submit(b, "bad")
        assert runner.threads[-1] == threading.current_thread().name
        assert await submit(b, "after") == ("done", "after")
        await stop(b, threads)

    asyncio.run(asyncio.wait_for(main(), 20))


HELD_LEN = 50  # a batch with a query this long waits for ThreadNamingWorker.release


class ThreadNamingWorker(DeviceWorker):
    """The real worker, remembering which thread ran each batch; one holding a query of HELD_LEN
    waits for the test to set `release`."""

    ran_on: list[str] = []
    release = threading.Event()

    def run(self, requests):
        ThreadNamingWorker.ran_on.append(threading.current_thread().name)
        if any(r.query_len == HELD_LEN for r in requests):
            assert ThreadNamingWorker.release.wait(20), "the test never released the held batch"
        return super().run(requests)


def one_thread_settings(**fields):
    """This suite's tiny model on one intra-op thread: every request then runs solo up to solo_macs (a
    solo run starts no OpenMP pool), on the same thread count as on the worker, so their answers match
    bit for bit."""
    return settings(model(embed_dim=E, num_heads=H, device=CPU), torch_threads=1, **fields)


@pytest.fixture()
def quiet_server():
    ThreadNamingWorker.ran_on = []
    ThreadNamingWorker.release.set()
    # compute_macs: x below (2 x 9 rows) 84 k, a query of HELD_LEN 365 k
    config = one_thread_settings(solo_macs=200_000)
    with running(config, worker_factory=ThreadNamingWorker) as handle:
        yield handle


def test_a_quiet_server_answers_from_the_loop_the_same_and_batches_again_under_load(quiet_server: Running) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 9, E), dtype=np.float32)
    warm_up = len(ThreadNamingWorker.ran_on)  # the worker's warm-up batches
    with Client(quiet_server.target) as c:
        for _ in range(STREAK - 1):
            c.attend(rng.standard_normal((1, 5, E), dtype=np.float32))
        on_worker = c.attend(x).output  # the streak's last
        worker_threads = set(ThreadNamingWorker.ran_on)
        solo = c.attend(x).output
        solo_thread = ThreadNamingWorker.ran_on[-1]
        assert solo_thread not in worker_threads
        assert solo_thread == quiet_server.loop_thread_name()  # it ran on the event loop's thread
        np.testing.assert_array_equal(solo, on_worker)  # the same computation, bit for bit
        with pytest.raises(AttnServeError) as err:  # bad input is refused as ever
            c.attend(rng.standard_normal((1, 5, E + 1), dtype=np.float32))
        assert err.value.code.name == "INVALID_ARGUMENT"
        assert c.attend(x).output is not None and ThreadNamingWorker.ran_on[-1] == solo_thread

    # A request too large for the loop runs on the worker (held there); requests that arrive while
    # it computes find company: solo ends, and they batch on the worker's thread behind it.
    ThreadNamingWorker.release.clear()
    before = len(ThreadNamingWorker.ran_on)

    async def company() -> list[np.ndarray]:
        async with AsyncClient(quiet_server.target) as ac:
            large = asyncio.ensure_future(ac.attend(np.ones((1, HELD_LEN, E), dtype=np.float32)))
            while len(ThreadNamingWorker.ran_on) == before:  # until the worker holds it
                await asyncio.sleep(0.001)
            small = [asyncio.ensure_future(ac.attend(x)) for _ in range(4)]
            while quiet_server.sample("attnserve_queue_depth", model="default") < 4:
                await asyncio.sleep(0.001)
            ThreadNamingWorker.release.set()
            await large
            return [r.output for r in await asyncio.gather(*small)]

    for out in asyncio.run(company()):
        np.testing.assert_array_equal(out, on_worker)
    ran = ThreadNamingWorker.ran_on[before:]
    assert ran[0] != solo_thread and solo_thread not in ran  # all on the worker
    # Lingering (batching.py): they arrived while the large one computed, and the four together are far
    # less work than linger_macs, so they run as one batch, not as pipelining's two batches of two.
    assert len(ran) == 2
    answered = quiet_server.sample("attnserve_requests_total", model="default", method="Attend", code="OK")
    assert answered == STREAK + 2 + 5
    batches_run = len(ThreadNamingWorker.ran_on) - warm_up
    assert quiet_server.sample("attnserve_batch_requests_count", model="default") == batches_run
    solo_runs = ThreadNamingWorker.ran_on.count(solo_thread)
    assert solo_runs == 2
    assert quiet_server.sample("attnserve_solo_batches_total", model="default") == solo_runs


def test_solo_macs_zero_keeps_every_request_on_the_worker() -> None:
    ThreadNamingWorker.ran_on = []
    config = one_thread_settings(solo_macs=0)
    with running(config, worker_factory=ThreadNamingWorker) as handle, Client(handle.target) as c:
        for _ in range(STREAK + 4):
            c.attend(np.ones((1, 3, E), dtype=np.float32))
        assert handle.loop_thread_name() not in ThreadNamingWorker.ran_on


def test_a_request_too_large_for_the_loop_runs_on_the_worker_even_when_quiet() -> None:
    ThreadNamingWorker.ran_on = []
    one_row = 2 * E * E + 2 * E * E + 2 * E  # compute_macs of one query row against one key row
    config = one_thread_settings(solo_macs=one_row * 4)
    with running(config, worker_factory=ThreadNamingWorker) as handle, Client(handle.target) as c:
        for _ in range(STREAK + 2):
            c.attend(np.ones((1, 1, E), dtype=np.float32))
        assert ThreadNamingWorker.ran_on[-1] == handle.loop_thread_name()
        c.attend(np.ones((1, 64, E), dtype=np.float32))
        assert ThreadNamingWorker.ran_on[-1] != handle.loop_thread_name()


def test_a_request_small_enough_for_one_thread_runs_solo_on_one_thread() -> None:
    # The default rule runs a lone request under ALONE_FLOOR_MACS on one thread (compute/threads.py),
    # solo too: it then wakes no other thread. This suite's model is far below it.
    ThreadNamingWorker.ran_on = []
    config = settings(model(embed_dim=E, num_heads=H, device=CPU), torch_threads=2)
    with running(config, worker_factory=ThreadNamingWorker) as handle, Client(handle.target) as c:
        one = handle.sample("attnserve_cpu_batches_total", model="default", device="cpu", threads="1")
        for _ in range(STREAK + 4):
            c.attend(np.ones((1, 8, E), dtype=np.float32))
        assert ThreadNamingWorker.ran_on[-4:] == [handle.loop_thread_name()] * 4
        solo = handle.sample("attnserve_solo_batches_total", model="default")
        assert solo == 4
        # every one of them on one thread, solo or not
        assert (
            handle.sample("attnserve_cpu_batches_total", model="default", device="cpu", threads="1") == one + STREAK + 4
        )
        assert handle.sample("attnserve_cpu_batches_total", model="default", device="cpu", threads="2") == 0


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="torch uses one intra-op thread here by default")
def test_a_lone_request_over_the_floor_runs_on_the_worker_on_every_thread_first_with_no_thread_count_configured() -> (
    None
):
    """A lone request that the size rule may run on several threads never runs solo: the event loop's
    thread would start an OpenMP pool beside the worker's, and libgomp then throttles both pools' spin
    (model.py). W1 at L=32 (8.9 M multiply-adds) is over the floor, so on the worker its thread count is
    measured, every thread first. With --torch-threads unset "every thread" is torch's default, read as
    the worker module loads: asked on a thread later, it was the count that thread set last (the worker's
    last warm-up batch, one small request, runs on one)."""
    ThreadNamingWorker.ran_on = []
    config = settings(model(embed_dim=256, num_heads=8, device=CPU))
    with running(config, worker_factory=ThreadNamingWorker) as handle, Client(handle.target) as c:
        for _ in range(STREAK + 1):  # under the floor, on one thread: the streak's, then one solo
            c.attend(np.ones((1, 1, 256), dtype=np.float32))
        assert ThreadNamingWorker.ran_on[-1] == handle.loop_thread_name()
        assert handle.sample("attnserve_solo_batches_total", model="default") == 1
        every = handle.sample(
            "attnserve_cpu_batches_total", model="default", device="cpu", threads=str(DEFAULT_THREADS)
        )
        c.attend(np.ones((1, 32, 256), dtype=np.float32))  # quiet, yet on the worker
        assert ThreadNamingWorker.ran_on[-1] != handle.loop_thread_name()
        assert handle.sample("attnserve_solo_batches_total", model="default") == 1
        assert (
            handle.sample("attnserve_cpu_batches_total", model="default", device="cpu", threads=str(DEFAULT_THREADS))
            == every + 1
        )


def test_every_kind_of_request_answers_the_same_solo_as_on_the_worker() -> None:
    models = (
        model("default", embed_dim=E, num_heads=H, device=CPU),
        model("cross", embed_dim=E, num_heads=H, kdim=24, vdim=40, device=CPU),
        model("bare", kind="sdpa", embed_dim=E, num_heads=H, vdim=16, device=CPU),
    )
    rng = np.random.default_rng(3)
    q, kv = rng.standard_normal((2, 7, E), dtype=np.float32), rng.standard_normal((2, 5, E), dtype=np.float32)
    kinds = [
        dict(query=q, causal=True),
        dict(query=q, need_weights=True, average_weights=False),
        dict(query=q, need_weights=True),
        dict(query=q, key_lengths=[7, 3]),
        dict(query=q, key_value=kv, key_lengths=[2, 5], need_weights=True),
        dict(query=q, model="cross", key=rng.standard_normal((2, 5, 24), dtype=np.float32),
             value=rng.standard_normal((2, 5, 40), dtype=np.float32), need_weights=True),
        dict(query=q, model="bare", key=rng.standard_normal((2, 5, E), dtype=np.float32),
             value=rng.standard_normal((2, 5, 16), dtype=np.float32), causal=True),
    ]  # fmt: skip

    def answers(solo_macs: int) -> tuple[list[tuple[np.ndarray, np.ndarray | None]], list[bool]]:
        ThreadNamingWorker.ran_on = []
        config = settings(*models, torch_threads=1, solo_macs=solo_macs)
        with running(config, worker_factory=ThreadNamingWorker) as handle, Client(handle.target) as c:
            for name in ("default", "cross", "bare"):  # each model's batcher its own quiet streak
                for _ in range(STREAK):
                    c.attend(**kinds[0 if name == "default" else 5 if name == "cross" else 6])
            first = len(ThreadNamingWorker.ran_on)
            results = [c.attend(**kind) for kind in kinds]
            loop = handle.loop_thread_name()
        return [(r.output, r.attention_weights) for r in results], [
            t == loop for t in ThreadNamingWorker.ran_on[first:]
        ]

    solo, on_loop = answers(SOLO_MACS)
    batched, on_worker_loop = answers(0)
    assert all(on_loop) and len(on_loop) == len(kinds)  # each of them ran on the event loop
    assert not any(on_worker_loop)
    for (y, w), (y_ref, w_ref) in zip(solo, batched, strict=True):
        np.testing.assert_array_equal(y, y_ref)
        if w_ref is None:
            assert w is None
        else:
            np.testing.assert_array_equal(w, w_ref)
