"""The device worker on its own: thread settings and what it reports for a batch."""

from __future__ import annotations

import numpy as np
import torch

from attnserve_server.compute.weights import random_projections
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.model import spec_from_settings
from attnserve_server.settings import ModelSettings

from conftest import output_of, request


def worker(torch_threads: int | None = None) -> DeviceWorker:
    spec = spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, device=("cpu",)))
    return DeviceWorker(spec, random_projections(spec, 0), torch.device("cpu"), torch_threads)


def test_torch_threads_apply_on_the_worker_thread_itself() -> None:
    # OpenMP keeps the count per calling thread: setting it elsewhere would not reach the worker.
    w = worker(torch_threads=1)
    try:
        assert w.executor.submit(torch.get_num_threads).result() == 1
    finally:
        w.close()


def test_a_batch_report_counts_tokens_and_padding() -> None:
    w = worker()
    try:
        requests = [
            request(np.random.randn(2, 3, 16).astype(np.float32)),
            request(np.random.randn(1, 5, 16).astype(np.float32)),
        ]
        answers = w.run(requests)
    finally:
        w.close()
    report = answers[0].batch
    assert all(a.batch is report for a in answers)  # one report, shared by the batch
    assert report.requests == 2 and report.sequences == 3 and report.tokens == 2 * 3 + 5
    # Real positions: 2 x (3 + 3) + 1 x (5 + 5) = 22 of 3 x (5 + 5) = 30 padded.
    assert abs(report.padding_fraction - (1 - 22 / 30)) < 1e-9
    assert [a.output_shape for a in answers] == [(2, 3, 16), (1, 5, 16)]
    assert [output_of(a).shape for a in answers] == [(2, 3, 16), (1, 5, 16)]
