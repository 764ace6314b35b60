"""The batcher on its own: a fake runner gated by asyncio.Event, no sockets, no torch."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from attnserve_server.batching import Batcher, BatchLimits
from attnserve_server.errors import BatchFailed, DeadlineExpired, QueueFull, ServingError, ShuttingDown


class FakeRunner:
    """Records each batch; each run waits until the test opens the gate."""

    def __init__(self, fail_on: object = None) -> None:
        self.batches: list[list[object]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail_on = fail_on

    async def __call__(self, items: list[object]) -> list[object]:
        self.batches.append(list(items))
        self.started.set()
        await self.gate.wait()
        if self.fail_on in items:
            raise RuntimeError("boom")
        return [("done", item) for item in items]


class Recorder:
    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()
        self.depths: list[int] = []
        self.batches: list[int] = []

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def dropped(self, reason: str) -> None:
        self.drops[reason] += 1

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
        assert len(queue_waits_s) == requests and all(w >= 0 for w in queue_waits_s)
        self.batches.append(requests)


def limits(**kw: float) -> BatchLimits:
    base = {"max_batch_size": 8, "max_batch_tokens": 10_000, "max_queue_delay_s": 0.0, "max_queue_size": 100}
    base.update(kw)
    return BatchLimits(**base)  # type: ignore[arg-type]


async def until(condition, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def submit(b: Batcher, item: object, sequences: int = 1, length: int = 1, group: object = "g", deadline=None, **kw):
    return asyncio.ensure_future(
        b.submit(item, sequences=sequences, length=length, group=group, deadline=deadline, **kw)
    )


async def occupy(b: Batcher, runner: FakeRunner) -> asyncio.Future:
    """Starts the batcher and keeps its runner busy with "block" until the test opens the gate."""
    b.start()
    blocker = submit(b, "block")
    await runner.started.wait()
    return blocker


def test_requests_queue_while_the_runner_is_busy_and_then_run_as_one_batch() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher([runner], limits())
        b.start()
        first = submit(b, "a")
        await runner.started.wait()
        rest = [submit(b, x) for x in "bcd"]
        await until(lambda: b.depth == 3)
        runner.gate.set()
        results = await asyncio.gather(first, *rest)
        assert runner.batches == [["a"], ["b", "c", "d"]]
        assert results == [("done", x) for x in "abcd"]  # each caller gets the runner's own result
        await b.close()

    run(main())


def test_the_next_batch_reaches_the_runner_before_the_last_batchs_callers_wake() -> None:
    # The device must not idle while the loop answers a finished batch: the runner is handed the
    # queued requests first, and only then do the finished batch's callers resume.
    events: list[str] = []

    class Recording(FakeRunner):
        def __call__(self, items: list[object]):
            events.append(f"run {items}")
            return super().__call__(items)

    async def main() -> None:
        runner = Recording()
        b = Batcher([runner], limits())
        b.start()

        async def caller(item: str) -> None:
            await b.submit(item, sequences=1, length=1, group="g")
            events.append(f"answered {item}")

        first = asyncio.ensure_future(caller("a"))
        await runner.started.wait()
        rest = [asyncio.ensure_future(caller(x)) for x in "bc"]
        await until(lambda: b.depth == 2)
        runner.gate.set()
        await asyncio.gather(first, *rest)
        assert events[:3] == ["run ['a']", "run ['b', 'c']", "answered a"]
        await b.close()

    run(main())


def test_a_request_that_finds_a_runner_free_reaches_it_in_its_own_step() -> None:
    # No batching task to wake: with no delay, the caller's own step hands the batch to the runner,
    # so an idle server adds no loop iteration between receipt and compute.
    called: list[list[object]] = []

    async def runner(items: list[object]) -> list[object]:
        return items

    def recording(items: list[object]):
        called.append(list(items))
        return runner(items)

    async def main() -> None:
        b = Batcher([recording], limits())
        b.start()
        pending = submit(b, "a")
        await asyncio.sleep(0)  # one loop iteration: the submit task runs its first step
        assert called == [["a"]] and b.depth == 0
        assert await pending == "a"
        await b.close()

    run(main())


def test_a_batch_closes_before_its_memory_estimate_passes_the_budget() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        # A long delay: only the limits can close these batches.
        b = Batcher([runner], limits(max_queue_delay_s=60, max_batch_memory_bytes=100))
        b.start()
        memory = (60, 30, 50, 100)
        futures = [submit(b, i, memory=m) for i, m in enumerate(memory)]
        # 60+30 fits and +50 would not; 50 alone, as +100 would not fit. The last waits for company.
        await until(lambda: len(runner.batches) == 2)
        assert runner.batches == [[0, 1], [2]] and b.depth == 1
        assert await b.drain(5) is True
        assert runner.batches == [[0, 1], [2], [3]]
        assert [f.result() for f in futures] == [("done", i) for i in range(4)]

    run(main())


def test_the_queue_refuses_past_its_byte_budget() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher([runner], limits(max_queue_bytes=100))
        blocker = await occupy(b, runner)
        queued = submit(b, "a", nbytes=80)
        await until(lambda: b.depth == 1)
        with pytest.raises(QueueFull, match="max_queue_bytes 100"):
            await b.submit("b", sequences=1, length=1, group="g", nbytes=30)
        runner.gate.set()
        assert await queued == ("done", "a") and await blocker == ("done", "block")
        # Its bytes left the queue with it: the same request is admitted now.
        assert await b.submit("c", sequences=1, length=1, group="g", nbytes=30) == ("done", "c")
        await b.close()

    run(main())


def test_a_batch_closes_at_max_batch_size_counted_in_sequences() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        # A long delay: only the size limit can close these batches.
        b = Batcher([runner], limits(max_batch_size=4, max_queue_delay_s=60))
        b.start()
        futures = [submit(b, i, sequences=2) for i in range(4)]
        results = await asyncio.gather(*futures)
        assert runner.batches == [[0, 1], [2, 3]]
        assert results == [("done", i) for i in range(4)]
        await b.close()

    run(main())


def test_a_batch_closes_at_max_batch_tokens_of_padded_length() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher([runner], limits(max_batch_tokens=100, max_queue_delay_s=60))
        b.start()
        # 2 sequences x longest 40 = 80 fits; a third (3 x 50 = 150) does not.
        futures = [submit(b, "x", length=40), submit(b, "y", length=30), submit(b, "z", length=50)]
        await until(lambda: len(runner.batches) == 1)
        assert runner.batches == [["x", "y"]]
        await b.drain(5)  # drain runs what is left at once
        assert runner.batches == [["x", "y"], ["z"]]
        assert all(f.done() for f in futures)

    run(main())


def test_the_delay_is_counted_from_the_first_request_of_the_batch() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher([runner], limits(max_queue_delay_s=0.05))
        b.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = submit(b, "a")
        await asyncio.sleep(0.02)
        second = submit(b, "b")
        await asyncio.gather(first, second)
        elapsed = loop.time() - t0
        assert runner.batches == [["a", "b"]]
        # Closed by the first request's timer, not restarted by the second.
        assert 0.05 <= elapsed < 0.05 + 0.02 + 0.5
        await b.close()

    run(main())


def test_only_requests_of_the_same_group_share_a_batch_and_the_oldest_goes_first() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher([runner], limits())
        blocker = await occupy(b, runner)
        futures = [
            submit(b, "s1", group="self"),
            submit(b, "c1", group="cross"),
            submit(b, "s2", group="self"),
        ]
        await until(lambda: b.depth == 3)
        runner.gate.set()
        await asyncio.gather(blocker, *futures)
        assert runner.batches == [["block"], ["s1", "s2"], ["c1"]]
        await b.close()

    run(main())


def test_a_full_queue_refuses_at_once() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher([runner], limits(max_queue_size=2), rec)
        b.start()
        running = submit(b, "r")
        await runner.started.wait()
        waiting = [submit(b, "w1"), submit(b, "w2")]
        await until(lambda: b.depth == 2)
        with pytest.raises(QueueFull, match="queue is full"):
            await b.submit("over", sequences=1, length=1, group="g")
        assert rec.drops["queue_full"] == 1
        runner.gate.set()
        await asyncio.gather(running, *waiting)
        await b.close()

    run(main())


def test_a_cancelled_request_is_dropped_before_compute() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher([runner], limits(), rec)
        blocker = await occupy(b, runner)
        keep, gone = submit(b, "keep"), submit(b, "gone")
        await until(lambda: b.depth == 2)
        gone.cancel()
        await until(lambda: b.depth == 1)
        runner.gate.set()
        await asyncio.gather(blocker, keep)
        assert runner.batches == [["block"], ["keep"]]
        assert rec.drops["cancelled"] == 1
        await b.close()

    run(main())


def test_a_request_whose_deadline_passed_in_the_queue_is_not_computed() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher([runner], limits(), rec)
        loop = asyncio.get_running_loop()
        blocker = await occupy(b, runner)
        expired = submit(b, "late", deadline=loop.time() - 1)  # already past when its batch forms
        fresh = submit(b, "fresh", deadline=loop.time() + 60)
        await until(lambda: b.depth == 2)
        runner.gate.set()
        await asyncio.gather(blocker, fresh)
        with pytest.raises(DeadlineExpired):
            await expired
        assert runner.batches == [["block"], ["fresh"]]
        assert rec.drops["deadline_exceeded"] == 1
        await b.close()

    run(main())


def test_a_failing_batch_fails_only_its_own_requests_and_the_runner_keeps_serving() -> None:
    async def main() -> None:
        runner = FakeRunner(fail_on="bad")
        runner.gate.set()
        b = Batcher([runner], limits(max_batch_size=1))
        b.start()
        with pytest.raises(BatchFailed, match="RuntimeError: boom"):
            await b.submit("bad", sequences=1, length=1, group="g")
        ok = await b.submit("good", sequences=1, length=1, group="g")
        assert ok == ("done", "good")
        await b.close()

    run(main())


def test_a_runner_returning_the_wrong_number_of_results_fails_the_batch() -> None:
    async def main() -> None:
        async def short(items: list[object]) -> list[object]:
            return items[:-1]

        b = Batcher([short], limits())
        b.start()
        with pytest.raises(BatchFailed, match="0 results for 1 requests"):
            await b.submit("x", sequences=1, length=1, group="g")
        await b.close()

    run(main())


def test_two_runners_compute_two_batches_at_once() -> None:
    async def main() -> None:
        r1, r2 = FakeRunner(), FakeRunner()
        b = Batcher([r1, r2], limits(max_batch_size=1))
        b.start()
        f1, f2 = submit(b, 1), submit(b, 2)
        await r1.started.wait()
        await r2.started.wait()  # both busy at the same time
        r1.gate.set()
        r2.gate.set()
        await asyncio.gather(f1, f2)
        assert sorted(r1.batches + r2.batches) == [[1], [2]]
        await b.close()

    run(main())


def test_drain_runs_queued_work_at_once_and_then_refuses_new_requests() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher([runner], limits(max_queue_delay_s=3600))
        b.start()
        queued = [submit(b, i) for i in range(3)]
        await until(lambda: b.depth == 3)
        assert await b.drain(5) is True
        assert [f.result() for f in queued] == [("done", i) for i in range(3)]
        with pytest.raises(ShuttingDown):
            await b.submit("late", sequences=1, length=1, group="g")

    run(main())


def test_drain_that_runs_out_of_time_fails_what_is_left_unavailable() -> None:
    async def main() -> None:
        runner = FakeRunner()  # never opens
        b = Batcher([runner], limits(max_batch_size=1))
        b.start()
        stuck, waiting = submit(b, "stuck"), submit(b, "waiting")
        await runner.started.wait()
        assert await b.drain(0.05) is False
        for f in (stuck, waiting):
            with pytest.raises(ShuttingDown):
                await f

    run(main())


@pytest.mark.parametrize("report", ["queue_depth", "batch_started"])
def test_a_bug_while_a_batch_forms_fails_the_waiting_callers_instead_of_stranding_them(report: str) -> None:
    # An observer that raises stands for any bug while a batch forms: the batcher stops, and every
    # caller, waiting or later, gets an error instead of waiting forever.
    class BrokenObserver(Recorder):
        armed = False

        def _check(self, name: str) -> None:
            if self.armed and name == report:
                raise RuntimeError("observer bug")

        def queue_depth(self, depth: int) -> None:
            self._check("queue_depth")
            super().queue_depth(depth)

        def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
            self._check("batch_started")
            super().batch_started(requests, queue_waits_s)

    async def main() -> None:
        runner = FakeRunner()
        observer = BrokenObserver()
        b = Batcher([runner], limits(), observer)
        blocker = await occupy(b, runner)
        waiting = submit(b, "waiting")
        await until(lambda: b.depth == 1)
        observer.armed = True  # the batch that would take "waiting" fails to report
        runner.gate.set()
        await blocker
        with pytest.raises(ServingError, match="batcher stopped"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(ServingError, match="batcher stopped"):
            await b.submit("after", sequences=1, length=1, group="g")
        assert runner.batches == [["block"]]
        observer.armed = False
        await b.close()

    run(main())


def test_a_queued_request_expires_at_its_deadline_while_every_runner_is_busy() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher([runner], limits(), rec)
        loop = asyncio.get_running_loop()
        blocker = await occupy(b, runner)
        late = submit(b, "late", deadline=loop.time() + 0.05)
        with pytest.raises(DeadlineExpired):
            await late  # the runner is still held: no batch forms, the deadline alone ends it
        assert b.depth == 0 and rec.drops["deadline_exceeded"] == 1
        runner.gate.set()
        await blocker
        assert runner.batches == [["block"]]
        await b.close()

    run(main())
