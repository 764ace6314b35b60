"""CUDA: the same server on a GPU. Skipped cleanly where torch sees no CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnserve import Client
from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.model import spec_from_settings

from conftest import model, output_of, request, running, settings, weights_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
E, H = 64, 8


def rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def reference(q: np.ndarray, lengths: list[int], causal: bool) -> np.ndarray:
    """torch.nn.MultiheadAttention on the CPU with the model's seeded weights (seed 0)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    t = torch.from_numpy(q)
    padding = torch.arange(q.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        return mha(t, t, t, key_padding_mask=padding, attn_mask=mask, need_weights=False)[0].numpy()


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("float16", 2e-2), ("bfloat16", 6e-2)])
def test_cuda_model_matches_the_cpu_reference(dtype: str, tol: float) -> None:
    m = model(embed_dim=E, num_heads=H, dtype=dtype, device=("cuda",))
    q = rand(3, 17, E)
    with running(settings(m)) as handle, Client(handle.target) as c:
        info = c.model()
        got = c.attend(q, key_lengths=[17, 9, 1], causal=True, dtype=None if dtype == "float32" else dtype)
        weights = c.attend(q, need_weights=True, dtype=None if dtype == "float32" else dtype).attention_weights
        memory = handle.sample("attnserve_device_memory_allocated_bytes", device="cuda:0")
    assert info.devices == ("cuda:0",)
    assert float(np.abs(got.output - reference(q, [17, 9, 1], True)).max()) <= tol
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=tol)
    assert memory > 0


def test_cuda_worker_pads_mixed_lengths_through_one_pinned_slab() -> None:
    spec = spec_from_settings(model(embed_dim=E, num_heads=H))
    worker = DeviceWorker(spec, random_projections(spec, 0), torch.device("cuda", 0))
    cpu = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
    requests = [request(rand(1, n, E), causal=True, need_weights=True) for n in (5, 12, 3)]
    first = worker.run(requests)
    second = worker.run(requests[::-1])  # the slabs are reused: the first answers must not change
    for req, answer in zip(requests, first, strict=True):
        alone = cpu.run([req])[0]
        assert answer.output_shape == alone.output_shape
        np.testing.assert_allclose(output_of(answer), output_of(alone), atol=1e-4)
        np.testing.assert_allclose(weights_of(answer), weights_of(alone), atol=1e-4)
    np.testing.assert_allclose(output_of(second[-1]), output_of(first[0]), atol=1e-6)
    worker.close()
    cpu.close()


def test_a_cuda_worker_runs_two_batches_at_once_and_they_agree_with_the_cpu() -> None:
    # Two lanes (threads, streams, pinned buffers): batch n+1 is staged and copied in while batch n
    # computes. Many batches at once through the executor must each match the CPU.
    spec = spec_from_settings(model(embed_dim=E, num_heads=H))
    worker = DeviceWorker(spec, random_projections(spec, 0), torch.device("cuda", 0))
    cpu = DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"))
    assert worker.lanes == 2 and worker.pinned_bytes() > 0  # sized from the limits at start-up
    batches = [[request(rand(2, n, E))] for n in range(3, 23)]
    futures = [worker.executor.submit(worker.run, b) for b in batches]
    for batch, future in zip(batches, futures, strict=True):
        np.testing.assert_allclose(output_of(future.result()[0]), output_of(cpu.run(batch)[0]), atol=1e-4)
    worker.close()
    cpu.close()


def test_auto_dtype_is_bfloat16_on_a_gpu_and_the_pinned_buffers_are_a_metric() -> None:
    m = model(embed_dim=E, num_heads=H, dtype="auto", device=("cuda",))
    with running(settings(m)) as handle, Client(handle.target) as c:
        assert c.model().dtype == "bfloat16"
        assert c.attend(rand(3, E), dtype="bfloat16").output.shape == (3, E)
        assert handle.sample("attnserve_pinned_host_bytes", model="default", device="cuda:0") > 0


def test_cuda_graphs_give_the_ordinary_path_s_answers_and_masked_batches_stay_ordinary() -> None:
    graphed_spec = spec_from_settings(model(embed_dim=E, num_heads=H, cuda_graphs=True, max_batch_size=16))
    plain_spec = spec_from_settings(model(embed_dim=E, num_heads=H, max_batch_size=16))
    graphed = DeviceWorker(graphed_spec, random_projections(graphed_spec, 0), torch.device("cuda", 0))
    plain = DeviceWorker(plain_spec, random_projections(plain_spec, 0), torch.device("cuda", 0))
    for n, length in [(1, 8), (3, 8), (5, 64), (16, 64), (3, 8)]:  # buckets 1, 4, 8, 16; then a replay
        batch = [request(rand(1, length, E) + i) for i in range(n)]
        for got, want in zip(graphed.run(batch), plain.run(batch), strict=True):
            np.testing.assert_allclose(output_of(got), output_of(want), atol=1e-5)
    masked = [request(rand(2, 8, E), causal=True, need_weights=True)]
    np.testing.assert_allclose(output_of(graphed.run(masked)[0]), output_of(plain.run(masked)[0]), atol=1e-5)
    graphed.close()
    plain.close()


def test_a_server_with_cuda_graphs_serves_and_matches_the_cpu_reference() -> None:
    m = model(embed_dim=E, num_heads=H, dtype="float32", device=("cuda",), cuda_graphs=True)
    q = rand(3, 17, E)
    with running(settings(m)) as handle, Client(handle.target) as c:
        got = c.attend(q)
    assert float(np.abs(got.output - reference(q, [17, 17, 17], False)).max()) <= 1e-4


def test_a_cuda_error_that_poisons_the_context_makes_the_worker_lost_and_out_of_memory_does_not() -> None:
    # In a process of its own: a device-side assert leaves that process's CUDA context unusable.
    import subprocess
    import sys

    script = """
import torch
from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.errors import DeviceOutOfMemory, WorkerLost
from attnserve_server.model import spec_from_settings
from attnserve_server.settings import ModelSettings
from conftest import request
import numpy as np
spec = spec_from_settings(ModelSettings(embed_dim=64, num_heads=8, device=("cuda",), dtype="float32"))
worker = DeviceWorker(spec, random_projections(spec, 0), torch.device("cuda", 0))
req = request(np.ones((1, 4, 64), np.float32))
real = worker._run
def out_of_memory(requests):
    raise torch.cuda.OutOfMemoryError("injected")
worker._run = out_of_memory
try:
    worker.run([req])
except WorkerLost:
    raise SystemExit("an out-of-memory error must leave the device usable")
except DeviceOutOfMemory:
    pass
worker._run = real
worker.run([req])  # still computes
def poison(requests):
    index = torch.tensor([10], device="cuda:0")
    torch.zeros(2, device="cuda:0")[index].item()  # a device-side assert
worker._run = poison
try:
    worker.run([req])
except WorkerLost as exc:
    print("lost:", exc, flush=True)
else:
    raise SystemExit("a poisoned context must make the worker lost")
# A poisoned context makes the tensors' destructors abort the interpreter's exit (as the server's
# cli._exit_unfinalized says): end without them.
import os
os._exit(0)
"""
    tests = str(__import__("pathlib").Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tests)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lost: cuda:0 can compute no more" in done.stdout
