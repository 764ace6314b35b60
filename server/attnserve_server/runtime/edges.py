"""How many gRPC edge processes `--edge-processes auto` (the default) runs, told before torch loads.

One Python process moves a request's bytes through gRPC on one interpreter lock: on the H200 machine
(16 CPUs) one edge served W1 at concurrency 32 at 2,224 req/s against an in-process limit of over
13,000, its event loop 73% busy and the device's lanes waiting for the lock 16-20% of their time;
four edges served 4,602, and eight no more than four (W1 3,751 against 3,576; WL 1,809 against
2,059) (BENCHMARKS.md, GPU). On a CPU the model's own threads need those cores: on two cores a
second edge added no throughput and cost 0.2-0.35 ms at concurrency 1. Hence: where a model may compute
on a GPU, one edge per four CPUs, at most four; otherwise one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from attnserve_server.runtime.idle_spin import cpu_quota
from attnserve_server.runtime.openmp import uses_gpu

CPUS_PER_EDGE = 4
MOST_EDGES = 4
# The most a setting may ask for: each edge is a Python process of its own (~100 MiB), more of them than
# CPUs only contend, and a mistyped 100000 started edges until the machine ran out of memory.
MOST_EDGES_PER_CPU = 4


def usable_cpus() -> int:
    """The CPUs this process may run on, fewer under a cgroup CPU quota (a container's limit)."""
    cpus = affinity_cpus()
    quota = cpu_quota()
    return max(1, min(cpus, int(quota)) if quota is not None else cpus)


def auto_edges(gpu: bool, cpus: int) -> int:
    """The measured rule above: with a GPU one edge per CPUS_PER_EDGE CPUs, 1 to MOST_EDGES; else 1."""
    return max(1, min(MOST_EDGES, cpus // CPUS_PER_EDGE)) if gpu else 1


def affinity_cpus() -> int:
    """The CPUs this process may run on, whatever its quota."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve(edge_processes: int | None, devices: Iterable[str], environ: Mapping[str, str]) -> tuple[int, str]:
    """The edge count to run, and why (for the log): the setting itself (settings.validate bounds it at
    MOST_EDGES_PER_CPU per CPU), or `auto`'s choice."""
    if edge_processes is not None:
        return edge_processes, "as set"
    gpu = uses_gpu(devices, environ)
    cpus = usable_cpus()
    return auto_edges(gpu, cpus), f"auto: {'a GPU model' if gpu else 'no GPU model'}, {cpus} CPUs"
