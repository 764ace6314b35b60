"""The quiet layout: while the server is quiet, the request path's threads on one CPU and the worker's
OpenMP partners apart; under load every thread free (runtime/cpu_layout.py)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import subprocess
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from attnserve_bench.process import spawn_serve

from attnserve import Client
from attnserve_server.runtime.cpu_layout import QuietLayout, supported, why_off
from attnserve_server.runtime.idle_spin import QUIET_STREAK

from conftest import model, request, running, settings, small_cpu_model

LOOP, WORKER, PARTNER, TIMER, ENGINE, POLLER, OTHER, ELSEWHERE, STRANGER = 10, 11, 12, 13, 14, 15, 16, 17, 18


class FakeThreads:
    """A process's threads for QuietLayout: names, affinities, and the calls made."""

    def __init__(self, cpus: set[int]) -> None:
        self.allowed = set(cpus)
        self.names = {
            LOOP: "attnserve",
            WORKER: "attn-cpu",
            PARTNER: "attn-cpu",
            TIMER: "grpc_global_tim",
            ENGINE: "event_engine",
            POLLER: "attnserve",
            OTHER: "attnserve",  # e.g. the metrics endpoint's thread
            ELSEWHERE: "someone-else",  # pinned by someone else to one CPU
            STRANGER: "attn-cpu",  # another server's worker in the same process (tests)
        }
        self.affinity = {tid: set(cpus) for tid in self.names}
        self.affinity[ELSEWHERE] = {max(cpus)}
        self.fail: OSError | None = None
        self.team = [PARTNER]  # the worker's OpenMP threads, as the worker reports them

    def set(self, tid: int, cpus: set[int]) -> None:
        if self.fail is not None:
            raise self.fail
        if tid not in self.names:
            raise ProcessLookupError(errno.ESRCH, "No such process")
        self.affinity[tid] = set(cpus)

    def layout(self, cpus: list[int]) -> QuietLayout:
        return QuietLayout(
            cpus,
            self.allowed,
            WORKER,
            lambda: list(self.team),
            loop_tid=LOOP,
            tasks=lambda: list(self.names),
            comm=lambda tid: self.names.get(tid, ""),
            pollers=lambda: [POLLER, 999],  # 999: a poller of another process's listing, ignored
            set_affinity=self.set,
            get_affinity=lambda tid: set(self.affinity[tid]),
        )


def test_quiet_pins_the_partner_apart_and_the_request_path_beside_the_worker() -> None:
    t = FakeThreads({0, 1})
    layout = t.layout([0, 1])
    layout.quiet()
    assert layout.applied and layout.switches == 1
    for tid in (LOOP, WORKER, TIMER, ENGINE, POLLER):
        assert t.affinity[tid] == {0}, t.names[tid]
    assert t.affinity[PARTNER] == {1}
    assert t.affinity[OTHER] == {0, 1}  # not on a lone request's path: left alone
    assert t.affinity[STRANGER] == {0, 1}  # named like the worker, but not its partner
    assert t.affinity[ELSEWHERE] == {1}
    layout.quiet()  # already in place: nothing to do
    assert layout.switches == 1


def test_busy_frees_what_it_pinned_and_threads_started_from_them() -> None:
    t = FakeThreads({0, 1, 2, 3})
    layout = t.layout([2, 3])
    layout.quiet()
    assert t.affinity[WORKER] == {2} and t.affinity[PARTNER] == {3}
    t.names[20] = "event_engine"  # gRPC grew its pool from a pinned thread: it inherited the home CPU
    t.affinity[20] = {2}
    layout.busy()
    assert not layout.applied
    for tid in (LOOP, WORKER, PARTNER, TIMER, ENGINE, POLLER, OTHER, STRANGER, 20):
        assert t.affinity[tid] == {0, 1, 2, 3}, t.names[tid]
    assert t.affinity[ELSEWHERE] == {3}  # never one of ours
    layout.busy()  # already free: nothing to do
    layout.quiet()
    assert layout.applied and layout.switches == 2


def test_nothing_is_pinned_until_the_team_has_started() -> None:
    t = FakeThreads({0, 1})
    t.team = []  # every batch so far ran on one thread: no OpenMP pool yet
    layout = t.layout([0, 1])
    layout.quiet()
    assert not layout.applied and t.affinity[LOOP] == {0, 1}
    t.team = [PARTNER]
    layout.quiet()
    assert layout.applied and t.affinity[PARTNER] == {1}


def test_a_partner_that_has_ended_is_skipped_and_a_stopped_worker_pins_nothing() -> None:
    t = FakeThreads({0, 1})
    del t.names[PARTNER]
    layout = t.layout([0, 1])
    layout.quiet()
    assert layout.applied and t.affinity[WORKER] == {0}
    layout.busy()
    del t.names[WORKER]
    layout.quiet()
    assert not layout.applied and t.affinity[LOOP] == {0, 1}


def test_a_team_larger_than_its_cpus_turns_the_layout_off(caplog) -> None:
    t = FakeThreads({0, 1})
    t.team = [PARTNER, 30]
    layout = t.layout([0, 1])
    layout.quiet()
    assert layout.off and not layout.applied
    assert "quiet layout off: 3 threads in the worker's team, CPUs for 2" in caplog.text
    assert all(cpus == {0, 1} for tid, cpus in t.affinity.items() if tid != ELSEWHERE)


def test_a_pin_refused_turns_the_layout_off_and_frees_every_thread(caplog) -> None:
    t = FakeThreads({0, 1})
    real_set = t.set
    calls = []

    def refuse_the_third(tid: int, cpus: set[int]) -> None:
        calls.append(tid)
        if len(calls) == 3 and cpus != t.allowed:  # the CPUs allowed changed under the server
            raise OSError(errno.EINVAL, "Invalid argument")
        real_set(tid, cpus)

    t.set = refuse_the_third  # type: ignore[method-assign]
    layout = t.layout([0, 1])
    layout.quiet()
    assert layout.off and not layout.applied
    assert "quiet layout off: cannot pin a thread (Invalid argument)" in caplog.text
    assert all(cpus == {0, 1} for tid, cpus in t.affinity.items() if tid != ELSEWHERE)
    layout.quiet()
    assert not layout.applied


def test_off_where_it_cannot_help_or_libgomp_binds() -> None:
    if not supported():
        assert why_off(2, {0, 1}, {}) == "this platform has no sched_setaffinity"
        return
    assert why_off(2, {0, 1}, {}) == ""
    assert why_off(1, {0, 1}, {}) == "the worker computes on one intra-op thread"
    assert why_off(4, {0, 1}, {}) == "2 CPU(s) for a team of 4 intra-op threads"
    assert why_off(2, {0, 1}, {"OMP_PROC_BIND": "spread"}) == "OpenMP binds its threads itself (OMP_PROC_BIND set)"
    assert QuietLayout.for_worker(1, lambda: [2], 2, {"GOMP_CPU_AFFINITY": "0-1"}) is None


def test_only_a_request_that_finds_company_after_a_quiet_streak_is_busy() -> None:
    events: list[str] = []
    served = small_cpu_model(on_quiet=lambda: events.append("quiet"), on_busy=lambda: events.append("busy"))
    q = np.ones((1, 3, 16), np.float32)

    async def main() -> None:
        await served.load()
        try:
            await asyncio.gather(*(served.submit(request(q)) for _ in range(4)))
            assert events == []  # company, but no streak before it
            for _ in range(QUIET_STREAK):
                await served.submit(request(q))
            assert events == ["quiet"]
            await asyncio.gather(*(served.submit(request(q)) for _ in range(4)))
            assert events[:3] == ["quiet", "quiet", "busy"]  # the burst's first is quiet, its second busy
            assert events.count("busy") == 1
        finally:
            served.close()

    asyncio.run(main())


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def _named(name: str) -> list[int]:
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                out.append(int(task.name))
        except OSError:
            continue
    return out


needs_two_cpus = pytest.mark.skipif(
    not supported() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and two CPUs for a team of two"
)


@needs_two_cpus
def test_a_quiet_server_pins_its_threads_and_a_busy_one_frees_them(default_server) -> None:
    # `default_server`: another server in this process, whose workers bear the same thread name.
    # W1's size runs on both intra-op threads (every thread, whatever they measure), so the team starts.
    # One process: with edge processes the loop and gRPC live apart from the worker, and it is off.
    config = settings(
        model(embed_dim=256, num_heads=8), torch_threads=2, min_parallel_speedup=0, solo_macs=0, edge_processes=1
    )
    allowed = os.sched_getaffinity(0)
    x = np.random.default_rng(0).random((64, 256), dtype=np.float32)
    with running(config) as r:
        layout = r.server.layout
        assert layout is not None
        home, partner_cpu = sorted(allowed)[:2]
        loop_tid = r.call(_loop_thread_id())
        with Client(r.target) as client:
            for _ in range(QUIET_STREAK + 2):
                client.attend(x)
            assert layout.applied
            assert _affinity(layout.worker_tid) == {home}
            assert _affinity(loop_tid) == {home}
            assert all(_affinity(t) == {home} for t in _named("grpc_global_tim"))
            partners = list(layout.partners)
            assert partners and all(_affinity(t) == {partner_cpu} for t in partners)
            strangers = set(_named("attn-cpu")) - {layout.worker_tid, *partners}
            assert strangers and all(_affinity(t) == allowed for t in strangers)
            assert _affinity(threading.get_native_id()) == allowed  # the test's own thread: not ours
            assert r.sample("attnserve_quiet_layout") == 1
            assert r.sample("attnserve_quiet_layout_pinned_total") == 1
            spin = r.server.idle_spin
            if spin is not None:  # beside the layout the idle spinners rest: nothing wakes them
                touches: list[int] = []
                touch = spin.touch
                spin.touch = lambda: (touches.append(1), touch())  # type: ignore[method-assign]
                for _ in range(QUIET_STREAK + 2):
                    client.attend(x)
                assert touches == []

            with Client(r.target) as other:
                # Bursts from two threads at once, until a request finds another queued or computing.
                for _ in range(20):
                    side = threading.Thread(target=lambda: [other.attend(x) for _ in range(8)])
                    side.start()
                    for _ in range(8):
                        client.attend(x)
                    side.join()
                    if not layout.applied:
                        break
            assert not layout.applied
            assert _affinity(layout.worker_tid) == allowed and _affinity(loop_tid) == allowed
            assert all(_affinity(t) == allowed for t in partners)
            assert r.sample("attnserve_quiet_layout") == 0
            pinned = r.sample("attnserve_quiet_layout_pinned_total")  # a burst may pin and free again
            for _ in range(QUIET_STREAK + 2):
                client.attend(x)
            assert layout.applied
            assert r.sample("attnserve_quiet_layout_pinned_total") == pinned + 1
            r.call(r.server.stop(2.0))  # stopping frees every thread
            assert not layout.applied and layout.off
            assert _affinity(loop_tid) == allowed


@needs_two_cpus
@pytest.mark.slow
@pytest.mark.parametrize("torch_threads", ["2", None], ids=["torch-threads-2", "automatic"])
def test_a_server_alone_in_its_process_finds_its_team(torch_threads: str | None) -> None:
    # In a process of its own: torch keeps one process-wide pthreadpool, made by the first thread that sets a
    # thread count, and named after it. Here no other server made it first, so the worker's own set-up does,
    # and the layout must not take that idle thread for one of the worker's OpenMP team.
    flags = ["--edge-processes", "1", "--min-parallel-speedup", "0", "--solo-macs", "0"]
    flags += ["--torch-threads", torch_threads] if torch_threads else []
    server = spawn_serve(*flags, stderr=subprocess.PIPE)
    try:
        x = np.random.default_rng(0).random((64, 256), dtype=np.float32)
        with Client(server.target) as client:
            for _ in range(QUIET_STREAK + 2):
                client.attend(x)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            metrics = answer.read().decode()
        assert re.search(r"^attnserve_quiet_layout 1\.0$", metrics, re.M), metrics
    finally:
        server.proc.kill()
        _, log = server.proc.communicate(timeout=30)
    assert "quiet layout off" not in log, log


async def _loop_thread_id() -> int:
    return threading.get_native_id()


def test_off_by_setting_for_several_models_and_with_edge_processes() -> None:
    with running(settings(quiet_layout=False, edge_processes=1)) as r:
        assert r.server.layout is None
    with running(settings(model("a"), model("b"), edge_processes=1)) as r:
        assert r.server.layout is None
    with running(settings(edge_processes=2)) as r:
        assert r.server.layout is None
