"""Keeps the server's CPUs awake for a moment after each request, at idle priority.

On a VM whose idle vCPUs halt (no halt polling in the guest, as on the 2-vCPU Firecracker VMs of
BENCHMARKS.md), every wake of a thread on an idle vCPU costs ~300 µs, and a request at concurrency 1
wakes several: gRPC's threads, the event loop, the worker, its OpenMP partner, the client. The
inline peer server does not pay this: its OpenMP partner spins for milliseconds after each forward
pass (libgomp's default), at normal priority, which keeps a core awake and takes it from any other
work. attnserve's own OpenMP threads spin briefly (openmp.py) for that reason.

Instead, once QUIET_STREAK requests in a row have found the model quiet, for `window_s` after each
request one spinner process per CPU (up to MAX_SPINNERS) busy-waits at SCHED_IDLE priority: the
kernel runs it only when that CPU has nothing else to do, and any thread that wakes there takes the
CPU at once, from a running vCPU rather than a halted one. An idle server's spinners sleep on a pipe,
so they cost nothing; a loaded server never wakes them; a server at concurrency 1 spends its idle
CPU on them. W1 at concurrency 1: p50 -18% (BENCHMARKS.md, thirteenth
pass). The spinners are processes, not threads, so they share no GIL with the server. While the
quiet layout holds (cpu_layout.py) they rest: the serial path and the spinning OpenMP partner then
leave no CPU idle for them, and they only got in the way (app.py).

The CPU they use is idle time, but it is counted: to the container's CPU usage, and under a CPU
quota (a Kubernetes CPU limit, cgroup cpu.max) against the quota, where it would throttle the
server's own threads. So the spinners stay off where a quota allows fewer CPUs than the process may
run on, and where there is one CPU.
"""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

from attnserve_server.runtime import _idle_spinner

log = logging.getLogger(__name__)

# After each request admitted, how long the spinners keep every CPU awake (the server's --idle-spin-ms).
# W1's round trip at concurrency 1 is ~1.4 ms: one window covers a client that sends its next
# request as soon as it has the answer.
WINDOW_MS = 2.0
# Requests in a row that found the model quiet (nothing queued or computing) before the spinners spin
# for the next ones: under load they cost more than the wake-ups they spare (W1 at concurrency 8 and
# 32, spinning after every quiet request: -4% to -7% req/s; BENCHMARKS.md, thirteenth pass).
QUIET_STREAK = 8
# Spinners at most: one per CPU up to this many (each is a small Python process, ~10 MB).
MAX_SPINNERS = 8
_SCRIPT = Path(_idle_spinner.__file__)


def _cgroup_paths(self_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path by controller ("" for the v2 hierarchy), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _ancestry(root: Path, path: str) -> list[Path]:
    """The cgroup directory for `path` under `root` and each of its parents up to `root`."""
    here = root.joinpath(*[p for p in path.split("/") if p])
    out = [here]
    while here != root:
        here = here.parent
        out.append(here)
    return out


def _quota_v2(directory: Path) -> float | None:
    text = (directory / "cpu.max").read_text().split()
    return None if text[0] == "max" else int(text[0]) / int(text[1])


def _quota_v1(directory: Path) -> float | None:
    quota = int((directory / "cpu.cfs_quota_us").read_text())
    period = int((directory / "cpu.cfs_period_us").read_text())
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time this process may use: the tightest CPU quota (cgroup v2 cpu.max, else v1's
    cfs quota) on its cgroup or any ancestor, None where there is none. In a container the
    process's cgroup is the mount's root; under systemd it is the service's."""
    paths = _cgroup_paths(self_cgroup)
    hierarchies = [(root, paths.get("", "/"), _quota_v2), (root / "cpu", paths.get("cpu", "/"), _quota_v1)]
    for base, path, read in hierarchies:
        quotas: list[float] = []
        found = False
        for directory in _ancestry(base, path):
            try:
                quota = read(directory)
            except (OSError, ValueError, IndexError):
                continue
            found = True
            if quota is not None:
                quotas.append(quota)
        if found:
            return min(quotas) if quotas else None
    return None


def spin_cpus(allowed: set[int], quota: float | None) -> tuple[list[int], str]:
    """The CPUs to keep awake, and why none where none: one CPU, or a quota below the CPUs allowed."""
    if len(allowed) < 2:
        return [], "one CPU"
    if quota is not None and quota < len(allowed):
        return [], f"a CPU quota of {quota:g} CPUs for {len(allowed)} CPUs (the spinners would count against it)"
    return sorted(allowed)[:MAX_SPINNERS], ""


def supported() -> bool:
    """Linux's idle scheduling class and anonymous shared memory files."""
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "memfd_create") and hasattr(os, "sched_getaffinity")


class IdleSpin:
    """Spinner processes kept busy for `window_s` after each `touch()` (call it on the event loop).

    `start()` and `close()` are idempotent; a `touch()` before `start()` or after `close()` does nothing.
    """

    def __init__(self, window_s: float, cpus: list[int]) -> None:
        self.window_s = window_s
        self.cpus = list(cpus)
        self._state = None  # mmap, shared with the spinners
        self._wake_w: int | None = None
        self._processes: list[subprocess.Popen] = []
        self._wake_bytes = b"\0" * len(self.cpus)
        self._deadline = _idle_spinner.DEADLINE.pack_into
        self._clock = time.monotonic

    @classmethod
    def from_settings(cls, window_ms: float) -> IdleSpin | None:
        """The spinners `window_ms` asks for on this machine, or None (logged why): 0, one CPU, a CPU
        quota below the CPUs (spin_cpus), or a platform without SCHED_IDLE."""
        if window_ms <= 0:
            return None
        if not supported():
            log.info("idle spin off: this platform has no SCHED_IDLE scheduling class")
            return None
        cpus, why = spin_cpus(os.sched_getaffinity(0), cpu_quota())
        if not cpus:
            log.info("idle spin off: %s", why)
            return None
        return cls(window_ms / 1e3, cpus)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def start(self) -> None:
        """Starts the spinners; where they cannot start, logs why and serves without them."""
        if self._processes or not self.cpus:
            return
        try:
            self._start()
        except OSError as exc:
            log.warning("idle spin off: cannot start its spinners (%s)", exc)
            return
        log.info(
            "idle spin: %d spinner(s) at idle priority keep CPUs %s awake for %g ms after each request",
            len(self.cpus),
            ",".join(map(str, self.cpus)),
            self.window_s * 1e3,
        )

    def _start(self) -> None:
        state_fd = os.memfd_create("attnserve-idle-spin")
        wake_r, wake_w = os.pipe()
        try:
            os.ftruncate(state_fd, _idle_spinner.STATE.size)
            self._state = mmap.mmap(state_fd, _idle_spinner.STATE.size)
            os.set_blocking(wake_w, False)  # never block the loop
            for cpu in self.cpus:
                self._processes.append(
                    subprocess.Popen(
                        [sys.executable, "-I", "-S", str(_SCRIPT), str(wake_r), str(state_fd), str(cpu)],
                        pass_fds=(wake_r, state_fd),
                        stdin=subprocess.DEVNULL,
                        # In the server's session, so in its autogroup: CFS weighs idle priority only
                        # against tasks of the same group (in a session of its own a spinner got half
                        # of a CPU against the server: W1 at concurrency 1 took 3.4 ms instead of 1.4).
                    )
                )
        except BaseException:
            os.close(wake_w)
            self._reap()
            if self._state is not None:
                self._state.close()
                self._state = None
            raise
        finally:
            os.close(wake_r)
            os.close(state_fd)
        self._wake_w = wake_w

    def touch(self) -> None:
        """A request was admitted: spin until `window_s` from now; wake the spinners that sleep."""
        state = self._state
        if state is None:
            return
        self._deadline(state, 0, self._clock() + self.window_s)
        if state[_idle_spinner.ASLEEP_AT]:
            state[_idle_spinner.ASLEEP_AT] = 0
            # Only here, where spinners sleep (after a quiet gap, never under load): one waitpid each (a list,
            # so that every one is polled).
            if any([p.poll() is not None for p in self._processes]) and not self._drop_exited():
                return
            try:
                os.write(self._wake_w, self._wake_bytes)  # type: ignore[arg-type]
            except BlockingIOError:  # a full pipe: every spinner has a byte to wake to
                pass
            except OSError as exc:  # no spinner left to read it (killed): serve on without them
                log.warning("idle spin off: its spinners are gone (%s)", exc)
                self.close()

    def _drop_exited(self) -> bool:
        """Forgets the spinners that exited unasked (killed, say; already reaped by `poll`), saying so, and
        wakes one byte's worth fewer; False, and idle spin off, where none is left."""
        alive = []
        for cpu, p in zip(self.cpus, self._processes, strict=True):  # one spinner a CPU, in order
            if p.returncode is None:
                alive.append((cpu, p))
                continue
            log.warning(
                "idle spin: the spinner for CPU %d (pid %d) exited unasked (returncode %d); that CPU is no longer "
                "kept awake",
                cpu,
                p.pid,
                p.returncode,
            )
        self.cpus = [cpu for cpu, _ in alive]
        self._processes = [p for _, p in alive]
        self._wake_bytes = b"\0" * len(self._processes)
        if not self._processes:
            log.warning("idle spin off: its spinners are gone")
            self.close()
            return False
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stops the spinners (blocking, briefly): they exit once the wake pipe closes."""
        if self._wake_w is not None:
            self._deadline(self._state, 0, 0.0)  # type: ignore[arg-type]
            os.close(self._wake_w)
            self._wake_w = None
        self._reap(timeout_s)
        if self._state is not None:
            self._state.close()
            self._state = None

    def _reap(self, timeout_s: float = 2.0) -> None:
        end = time.monotonic() + timeout_s
        for p in self._processes:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._processes = []
