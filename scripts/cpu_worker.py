"""The device worker as the measurement scripts use it: built and run on one thread of its own.

Torch must not compute on the main thread beside it (scripts/omp_pools.py says why), so the weights
load and the worker is built on the thread that later runs its batches.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def cpu_worker(settings):  # -> (the worker's thread, DeviceWorker)
    import torch

    from attnserve_server.compute.weights import load_projections
    from attnserve_server.compute.worker import DeviceWorker
    from attnserve_server.model import spec_from_settings

    spec = spec_from_settings(settings)
    thread = ThreadPoolExecutor(1)
    worker = thread.submit(
        lambda: DeviceWorker(spec, load_projections(spec, settings.weights), torch.device("cpu"))
    ).result()
    return thread, worker
