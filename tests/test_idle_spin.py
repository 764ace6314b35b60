"""Idle spin: spinner processes at idle priority keep the CPUs awake for a moment after a request."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attnserve import Client
from attnserve_server.runtime.idle_spin import MAX_SPINNERS, QUIET_STREAK, IdleSpin, cpu_quota, spin_cpus, supported

from conftest import model, request, running, settings, small_cpu_model

needs_linux = pytest.mark.skipif(not supported(), reason="needs Linux's SCHED_IDLE and memfd_create")
WAIT_S = 20.0


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, user + system ticks) of a process, ("gone", 0) once it has exited."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone", 0
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


def _until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _gone(pid: int) -> bool:
    return _stat(pid)[0] in ("gone", "Z")


def _spins_after_touch(spin: IdleSpin, pid: int) -> None:
    """Touches until the spinner has used CPU time (each touch keeps it busy for its window)."""
    ticks = _stat(pid)[1]

    def busy() -> bool:
        spin.touch()
        return _stat(pid)[1] > ticks

    _until(busy, "the spinner to use CPU after touches")


def test_one_spinner_per_cpu_up_to_the_cap() -> None:
    assert spin_cpus({0, 1}, None) == ([0, 1], "")
    assert spin_cpus({3, 1, 2}, 3.0) == ([1, 2, 3], "")
    assert spin_cpus(set(range(64)), None)[0] == list(range(MAX_SPINNERS))


def test_off_on_one_cpu_and_under_a_quota_below_the_cpus() -> None:
    assert spin_cpus({0}, None) == ([], "one CPU")
    cpus, why = spin_cpus({0, 1, 2, 3}, 1.5)
    assert cpus == [] and why.startswith("a CPU quota of 1.5 CPUs for 4 CPUs")


def test_cpu_quota_reads_cgroup_v2_and_v1(tmp_path: Path) -> None:
    at_root = tmp_path / "self-root"
    at_root.write_text("0::/\n1:cpu,cpuacct:/\n")
    root = tmp_path / "cg"
    root.mkdir()
    assert cpu_quota(root, at_root) is None  # neither file
    (root / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(root, at_root) is None
    (root / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(root, at_root) == 1.5
    (root / "cpu.max").write_text("garbage\n")
    assert cpu_quota(root, at_root) is None
    (root / "cpu.max").unlink()
    v1 = root / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(root, at_root) is None
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    assert cpu_quota(root, at_root) == 2.0


def test_cpu_quota_is_the_tightest_on_the_process_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    # Outside a container, as a systemd service: the quota sits on the service's own cgroup.
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("0::/system.slice/attnserve.service\n")
    root = tmp_path / "cg"
    service = root / "system.slice" / "attnserve.service"
    service.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (service / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(root, self_cgroup) is None
    (service / "cpu.max").write_text("50000 100000\n")
    assert cpu_quota(root, self_cgroup) == 0.5
    (service / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("300000 100000\n")  # a parent's limit counts too
    assert cpu_quota(root, self_cgroup) == 3.0
    (service / "cpu.max").write_text("100000 100000\n")
    assert cpu_quota(root, self_cgroup) == 1.0  # the tightest
    self_cgroup.write_text("not a cgroup line\n0::/system.slice/attnserve.service\n")
    assert cpu_quota(root, self_cgroup) == 1.0  # a line it cannot read is skipped
    assert cpu_quota(root, tmp_path / "missing") is None  # no /proc/self/cgroup: the root only, no quota there


def test_zero_turns_it_off() -> None:
    assert IdleSpin.from_settings(0) is None


@needs_linux
def test_a_spinner_runs_at_idle_priority_only_after_a_touch_and_exits_on_close() -> None:
    cpu = min(os.sched_getaffinity(0))
    spin = IdleSpin(0.05, [cpu])
    spin.touch()  # before start: nothing to do
    spin.start()
    try:
        (pid,) = spin.pids
        _until(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE, "the spinner to take idle priority")
        assert os.sched_getaffinity(pid) == {cpu}
        # The server's session (so its autogroup): idle priority counts only within a group.
        assert os.getsid(pid) == os.getsid(0)
        _until(lambda: _stat(pid)[0] == "S", "the spinner to sleep before any request")
        _spins_after_touch(spin, pid)
        # Its window over, it sleeps on the wake pipe, using no CPU.
        _until(lambda: _stat(pid)[0] == "S", "the spinner to sleep once its window is over")
        _spins_after_touch(spin, pid)  # and wakes for the next request
    finally:
        spin.close()
    assert _gone(pid)
    spin.touch()  # after close: nothing to do
    spin.close()  # twice: nothing more


@needs_linux
def test_spinners_that_were_killed_turn_idle_spin_off_and_requests_go_on(caplog) -> None:
    spin = IdleSpin(0.01, [min(os.sched_getaffinity(0))] * 2)
    spin.start()
    pids = spin.pids
    try:
        # Asleep (their window over), so the next touch writes to the wake pipe, which nobody reads.
        _until(lambda: all(_stat(p)[0] == "S" for p in pids), "the spinners to sleep")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _until(lambda: all(_gone(p) for p in pids), "the spinners to die")
        spin.touch()  # no exception: the request that touches is served
        assert "idle spin off: its spinners are gone" in caplog.text
        assert spin.pids == []
        spin.touch()  # and later requests do nothing
    finally:
        spin.close()


@needs_linux
def test_a_spinner_killed_alone_is_named_and_reaped_and_the_others_spin_on(caplog) -> None:
    cpu = min(os.sched_getaffinity(0))
    spin = IdleSpin(0.01, [cpu, cpu])
    spin.start()
    killed, kept = spin.pids
    try:
        _until(lambda: _stat(killed)[0] == "S" and _stat(kept)[0] == "S", "the spinners to sleep")
        os.kill(killed, signal.SIGKILL)
        _until(lambda: _stat(killed)[0] == "Z", "the killed spinner to die")  # nobody has reaped it yet
        spin.touch()  # the next request after a quiet gap notices
        assert f"the spinner for CPU {cpu} (pid {killed}) exited unasked" in caplog.text
        assert _stat(killed)[0] == "gone"  # reaped, no zombie left behind
        assert spin.pids == [kept]
        assert "idle spin off" not in caplog.text
        _until(lambda: _stat(kept)[0] == "S", "the other spinner to sleep once its window is over")
        _spins_after_touch(spin, kept)  # and it still wakes for requests
    finally:
        spin.close()
    assert _gone(kept)


@needs_linux
def test_spinners_exit_when_the_server_process_is_killed() -> None:
    code = (
        "import sys; from attnserve_server.runtime.idle_spin import IdleSpin\n"
        "spin = IdleSpin(0.05, [0, 0]); spin.start(); spin.touch()\n"
        "print(*spin.pids, flush=True); sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for pid in pids:
        _until(lambda pid=pid: _gone(pid), f"spinner {pid} to exit after its server was killed")


@needs_linux
def test_a_server_spins_after_requests_and_its_spinners_stop_with_it() -> None:
    config = settings(model(embed_dim=16, num_heads=2), idle_spin_ms=50)
    with running(config) as r:
        spin = r.server.idle_spin
        if spin is None:
            pytest.skip("idle spin is off on this machine (one CPU, or a CPU quota)")
        pids = spin.pids
        assert len(pids) == len(spin.cpus)
        _until(lambda: all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids), "idle priority")
        # Asleep on the pipe, their start-up done: from here on only spinning uses CPU.
        _until(lambda: all(_stat(p)[0] == "S" for p in pids), "the spinners to sleep")
        with Client(r.target) as client:
            ticks = sum(_stat(p)[1] for p in pids)

            def spun() -> bool:  # past the quiet streak, a request makes the spinners spin
                client.attend(np.full((1, 4, 16), 0.5, np.float32))
                return sum(_stat(p)[1] for p in pids) > ticks

            _until(spun, "the spinners to use CPU after requests")
    assert all(_gone(p) for p in pids)


def test_idle_spin_ms_zero_starts_no_spinners() -> None:
    with running(settings(idle_spin_ms=0)) as r:
        assert r.server.idle_spin is None


def test_only_requests_after_a_quiet_streak_make_the_spinners_spin() -> None:
    touches: list[int] = []
    served = small_cpu_model(on_quiet=lambda: touches.append(1))
    q = np.ones((1, 3, 16), np.float32)

    async def main() -> None:
        await served.load()
        try:
            for _ in range(QUIET_STREAK - 1):  # each alone: quiet, but not yet a streak
                await served.submit(request(q))
            assert not touches
            await served.submit(request(q))
            assert len(touches) == 1
            # A burst: all but the first find company, and the streak starts again.
            await asyncio.gather(*(served.submit(request(q)) for _ in range(4)))
            after_burst = len(touches)
            for _ in range(QUIET_STREAK - 1):
                await served.submit(request(q))
            assert len(touches) == after_burst
            await served.submit(request(q))
            assert len(touches) == after_burst + 1
        finally:
            served.close()

    asyncio.run(main())


@needs_linux
def test_spinners_that_cannot_start_leave_the_server_serving_without_them(monkeypatch, caplog) -> None:
    from attnserve_server.runtime import idle_spin

    monkeypatch.setattr(idle_spin.sys, "executable", "/nonexistent/python")
    spin = IdleSpin(0.01, [0, 1])
    spin.start()  # logs, raises nothing
    assert "idle spin off: cannot start its spinners" in caplog.text
    assert spin.pids == []
    spin.touch()
    spin.close()
