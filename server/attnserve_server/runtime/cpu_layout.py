"""While the server is quiet, a lone request's threads share one CPU and the worker's OpenMP partners
have CPUs of their own; under load every thread runs wherever the kernel puts it.

A CPU worker computes on its own thread and that thread's OpenMP partners (its team), which meet at a
barrier after every parallel loop of the forward pass. At concurrency 1 on the 2-vCPU VMs of
BENCHMARKS.md (twenty-fourth pass, `perf sched`), the kernel now and then put the worker thread and
its partner on one CPU while the other CPU idled: they ran by turns, a 3 to 4 ms slice each at every
barrier, and a batch of 0.6 ms took 10 to 25 ms. The kernel did not pull the waiting thread over to the
idle CPU. Those batches made the server's p99.9 (15 to 17 ms, against 6 to 7 for the inline peer).

So once QUIET_STREAK requests in a row have found the model quiet, `QuietLayout.quiet()` pins:
- each OpenMP partner of the worker to a CPU of its own, apart from the worker;
- the worker's thread, the event loop's and gRPC's (its C threads, found by the names gRPC gives them,
  and grpc.aio's completion-queue poller) to one CPU, the home CPU.
A lone request's path is serial (gRPC, the loop, the worker and back), so its threads never want the
home CPU at once, and the partner's CPU stays free for the partner. The first request that finds
company calls `busy()`, which gives every thread the CPUs it had: under load the loop needs a CPU of
its own (this layout cost 9% at concurrency 32 when libgomp's binding kept it under load).

The worker names its partners once a batch has run on several threads: the threads of its name that
appeared since it started (compute/worker.py), so a second server in the same process (tests) is not
taken for them. Until then (a model whose requests all run on one thread) nothing is pinned and idle
spin goes on as before. The layout is off (and says why, once) where it cannot help or could harm:
one intra-op thread (no team to part), fewer CPUs than the team's threads, libgomp binding its
threads itself (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY), or no `sched_setaffinity` (not Linux). Only CPUs the
process may use are named, so a cpuset (a Kubernetes CPU manager's exclusive CPUs) is respected, and
if the CPUs allowed change under it, a failed pin turns the layout off for good with every thread
freed. Only the server's own threads move: any other thread of the process stays where it is, unless
it started from a pinned one (it then inherited the home CPU, and `busy()` frees it too).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

from attnserve_server.runtime.os_threads import thread_ids, thread_name

log = logging.getLogger(__name__)

# gRPC C-core's own threads, as it names them for the OS (/proc/self/task/*/comm), by prefix.
GRPC_THREAD_NAMES = ("grpc_global_tim", "event_engine", "lifeguard")
# grpc.aio's completion-queue poller is a Python thread: "Thread-N (_poll_wrapper)" to `threading`.
GRPC_POLLER = "(_poll_wrapper)"
# libgomp's own binding: with any of these set, the team's places are its business.
BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity") and os.path.isdir("/proc/self/task")


def _poller_ids() -> list[int]:
    return [t.native_id for t in threading.enumerate() if GRPC_POLLER in t.name and t.native_id is not None]


def why_off(team_size: int, allowed: set[int], environ: dict[str, str] | os._Environ[str]) -> str:
    """Why the layout cannot apply here, or "" where it can: a team of `team_size` threads at most on
    the CPUs `allowed`."""
    if not supported():
        return "this platform has no sched_setaffinity"
    binding = [v for v in BINDING_VARIABLES if environ.get(v)]
    if binding:
        return f"OpenMP binds its threads itself ({', '.join(binding)} set)"
    if team_size < 2:
        return "the worker computes on one intra-op thread"
    if len(allowed) < team_size:
        return f"{len(allowed)} CPU(s) for a team of {team_size} intra-op threads"
    return ""


class QuietLayout:
    """Pins the request path's threads while the server is quiet (`quiet()`), frees them under load
    (`busy()`). Both run on the event loop's thread; each does nothing when already in its state.

    `cpus`: the home CPU first, then one per partner. `partners()`: the worker's OpenMP threads, none
    until its pool has started. `allowed`: what a freed thread gets. `on_change(pinned)` is told of
    each switch.
    """

    def __init__(
        self,
        cpus: list[int],
        allowed: set[int],
        worker_tid: int,
        partners: Callable[[], list[int]],
        *,
        loop_tid: int | None = None,
        tasks: Callable[[], Iterable[int]] = thread_ids,
        comm: Callable[[int], str] = thread_name,
        pollers: Callable[[], Iterable[int]] = _poller_ids,
        set_affinity: Callable[[int, set[int]], None] = os.sched_setaffinity,
        get_affinity: Callable[[int], set[int]] = os.sched_getaffinity,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.home = cpus[0]
        self.partner_cpus = list(cpus[1:])
        self.partners: dict[int, int] = {}  # the worker's OpenMP threads -> their CPUs, once known
        self._find_partners = partners
        self.allowed = set(allowed)
        self.worker_tid = worker_tid
        self.loop_tid = threading.get_native_id() if loop_tid is None else loop_tid
        self.applied = False
        self.off = False
        self.switches = 0  # times applied
        self._pinned: set[int] = set()
        self._tasks, self._comm, self._pollers = tasks, comm, pollers
        self._set, self._get = set_affinity, get_affinity
        self._on_change = on_change

    @classmethod
    def for_worker(
        cls,
        worker_tid: int,
        partners: Callable[[], list[int]],
        team_size: int,
        environ: dict[str, str] | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> QuietLayout | None:
        """The layout for a worker thread `worker_tid`, whose OpenMP threads `partners()` gives (once
        started) and whose batches compute on `team_size` threads at most; None (logged why) where it
        cannot apply. Call it on the event loop."""
        allowed = os.sched_getaffinity(0) if supported() else set()
        why = why_off(team_size, allowed, os.environ if environ is None else environ)
        if why:
            log.info("quiet layout off: %s", why)
            return None
        cpus = sorted(allowed)[:team_size]
        log.info(
            "quiet layout: while the server is quiet, the event loop, gRPC's threads and the worker on CPU %d, "
            "its OpenMP partners on CPU %s; every thread free under load",
            cpus[0],
            ",".join(map(str, cpus[1:])),
        )
        return cls(cpus, allowed, worker_tid, partners, on_change=on_change)

    def quiet(self) -> None:
        """Pins the team apart and the request path beside the worker, once the team has started."""
        if self.applied or self.off:
            return
        if not self.partners:
            found = self._find_partners()
            if not found:  # every batch so far ran on one thread: nothing to part
                return
            if len(found) > len(self.partner_cpus):
                self._turn_off(f"{len(found) + 1} threads in the worker's team, CPUs for {len(self.partner_cpus) + 1}")
                return
            self.partners = dict(zip(found, self.partner_cpus, strict=False))
        tids = list(self._tasks())
        present = set(tids)
        if self.worker_tid not in present:  # the worker has stopped: nothing to lay out
            return
        serial = {self.worker_tid, self.loop_tid}
        serial.update(t for t in tids if self._comm(t).startswith(GRPC_THREAD_NAMES))
        serial.update(t for t in self._pollers() if t in present)
        serial.difference_update(self.partners)
        try:
            for tid, cpu in self.partners.items():
                if tid in present:
                    self._pin(tid, {cpu})
            for tid in sorted(serial):
                self._pin(tid, {self.home})
        except OSError as exc:
            self._turn_off(f"cannot pin a thread ({exc.strerror})")
            return
        self.applied = True
        self.switches += 1
        log.debug("quiet layout applied (%d times)", self.switches)
        if self._on_change is not None:
            self._on_change(True)

    def busy(self) -> None:
        """Gives every thread the layout pinned, and any that started from one, the CPUs allowed."""
        if not self.applied:
            return
        self.applied = False
        self._free()
        log.debug("quiet layout freed")
        if self._on_change is not None:
            self._on_change(False)

    def close(self) -> None:
        self.busy()
        self.off = True

    def _pin(self, tid: int, cpus: set[int]) -> None:
        try:
            self._set(tid, cpus)
        except ProcessLookupError:  # the thread has ended
            return
        self._pinned.add(tid)

    def _free(self) -> None:
        # A thread started from one on the home CPU inherited that CPU (the partners start none).
        home = {self.home}
        for tid in self._tasks():
            try:
                if tid in self._pinned or self._get(tid) == home:
                    self._set(tid, self.allowed)
            except ProcessLookupError:
                continue
            except OSError as exc:  # the CPUs allowed changed under us: nothing more to pin
                self.off = True
                log.warning("quiet layout off: cannot free thread %d (%s)", tid, exc.strerror)
        self._pinned.clear()

    def _turn_off(self, why: str) -> None:
        log.warning("quiet layout off: %s", why)
        self.off = True
        self.applied = False
        self._free()
