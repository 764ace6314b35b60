"""scripts/profile_summary.py: how py-spy's stacks are charged (BENCHMARKS.md's profile tables come from it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "profile_summary.py"
_spec = importlib.util.spec_from_file_location("profile_summary", SCRIPT)
summary = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(summary)  # type: ignore[union-attr]

LOOP = "run_forever (loop.c:33397);uv_run (core.c:464);uv__io_poll (linux.c:1546);uv__stream_io (stream.c:1210)"


def frames(text: str) -> list[str]:
    return text.split(";")


def test_a_uvloop_callback_blocked_on_a_condition_is_waiting_for_the_gil_and_epoll_is_idle() -> None:
    taking = f"{LOOP};loop___uv_stream_on_read (loop.c:112977);pthread_cond_timedwait (libc.so.6);0x7fc2 (libc.so.6)"
    assert summary.categorise(frames(taking)) == "waiting for the GIL"
    idle = "run_forever (loop.c:33397);uv_run (core.c:464);uv__io_poll (linux.c:1452);epoll_pwait (libc.so.6)"
    assert summary.categorise(frames(idle)) == "idle (blocked)"
    # a condition wait in gRPC's core (its completion queue) is no GIL: idle
    core = (
        "_poll_wrapper (grpc/_cython/cygrpc.pyx:1);grpc_completion_queue_next (completion_queue.cc:1);"
        "gpr_cv_wait (sync.cc:1);pthread_cond_timedwait (libc.so.6)"
    )
    assert summary.categorise(frames(core)) == "idle (blocked)"
    python = "PyEval_RestoreThread (ceval_gil.c:1);take_gil (ceval_gil.c:1);pthread_cond_timedwait (libc.so.6)"
    assert summary.categorise(frames(python)) == "waiting for the GIL"


def test_a_torch_call_taking_the_gil_back_is_waiting_for_the_gil_and_a_worker_waiting_for_work_is_idle() -> None:
    call = (
        "DeviceWorker._run_group (attnserve_server/compute/worker.py:476);"
        "AttentionCompute.__call__ (attnserve_server/compute/attention.py:183)"
    )
    # the binding's gil_scoped_release, inlined, takes the GIL back as the fused kernel returns
    returns = (
        f"{call};torch::autograd::THPVariable__native_multi_head_attention (libtorch_python.so);"
        "pthread_cond_timedwait (libc.so.6);0x7f63 (libc.so.6)"
    )
    assert summary.categorise(frames(returns)) == "waiting for the GIL"
    # torch (2.10 on) takes the GIL inside an op to count a reference to a tensor Python owns
    inside = (
        f"{call};at::_ops::slice_Tensor::call (libtorch_cpu.so);c10::TensorImpl::incref_pyobject (libc10.so);"
        "torch::detail::(anonymous namespace)::ConcretePyInterpreterVTable::incref (libtorch_python.so);"
        "pybind11::gil_scoped_acquire::gil_scoped_acquire (libtorch_python.so);pthread_cond_timedwait (libc.so.6)"
    )
    assert summary.categorise(frames(inside)) == "waiting for the GIL"
    waiting = (
        "Batcher._take (attnserve_server/batching.py:603);Condition.wait (threading.py:331);"
        "lock_PyThread_acquire_lock (libpython3.11.so.1.0);pthread_cond_timedwait (libc.so.6)"
    )
    assert summary.categorise(frames(waiting)) == "idle (blocked)"
    assert (
        summary.categorise(frames(f"{call};mkl_blas_def_sgemm_kernel_0_zen (libtorch_cpu.so)")) == "worker: attention"
    )


def test_the_engine_link_is_its_own_category_but_not_the_edge_process_main() -> None:
    main = "main (attnserve_server/multiprocess/edge_process.py:333)"
    answer = f"{main};Edge._answer (attnserve_server/multiprocess/supervisor.py:191);0x7fb3d0b8bb75 (libc.so.6)"
    assert summary.categorise(frames(answer)) == "engine link"
    channel = f"{main};Channel.data_received (attnserve_server/multiprocess/link.py:84)"
    assert summary.categorise(frames(channel)) == "engine link"
    grpc = f"{main};_handle_call (grpc/_cython/cygrpc.pyx:1);grpc_core::Server::ChannelData (server.cc:1)"
    assert summary.categorise(frames(grpc)) == "gRPC core"


def test_subprocess_profiles_name_each_thread_with_its_process(tmp_path: Path) -> None:
    engine = 'process 820:"/x/python .venv/bin/attnserve serve --edge-processes 2"'
    edge = 'process 851:"/x/python -m attnserve_server.multiprocess.edge_process --index 1 --link 20"'
    busy = "Batcher.submit (attnserve_server/batching.py:327)"
    lines = [
        f"{engine};thread (820): MainThread;{busy} 3",
        f"{engine};{edge};thread (851): MainThread;epoll_wait (libc.so.6) 5",
        f"{engine};{edge};thread (851): MainThread;{busy} 5",
        f"thread (28396): MainThread;{busy} 2",  # recorded without --subprocesses
    ]
    path = tmp_path / "profile.txt"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--requests", "10"], capture_output=True, text=True, check=True
    ).stdout
    assert "### engine, MainThread: 3 samples, busy 100%" in out
    assert "### edge 1, MainThread: 10 samples, busy 50%" in out
    assert "### thread: MainThread: 2 samples, busy 100%" in out
    assert "| batcher | 50.0% | 5000 |" in out  # 5 samples of 10 ms over 10 requests
