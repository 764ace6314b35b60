"""The OpenMP environment torch's CPU kernels run under in the server, set before torch loads.

torch's CPU wheels use GNU OpenMP (libgomp), which reads its environment once, when it loads. After
each parallel region its threads spin GOMP_SPINCOUNT pause loops before they sleep on a futex;
OMP_WAIT_POLICY=PASSIVE sleeps at once, and made two threads slower than one on a small batch.

The server keeps libgomp's own spin of 300,000 pauses (~4 ms on the Intel VM of BENCHMARKS.md, ~9 ms
on the AMD VM, where a pause takes 31 ns), set explicitly with OMP_WAIT_POLICY=ACTIVE. At concurrency
1 it keeps the worker's partner thread running through the gap between one request and the next:
on the AMD VM (twenty-first pass) W1 computed after a 3 ms pause in 1488 µs on two threads that
spun, and in 2928 on two threads that slept after 1000 pauses (the seventeenth to twentieth passes'
setting), 2117 on one. In paired runs against that short spin, W1 at concurrency 1 served with an
11% lower p50, and at concurrency 32 the same (1.000 over six pairs). Those pairs ran while
perf_analyzer also asked for the attention weights. Without them (thirty-sixth pass) the short spin's
p50 at concurrency 1 read 1.12x the long spin's over 8 pairs, but two identical servers read 1.13x in
the same hour, so that re-run tells nothing; WL (E=1024, L=256) at concurrency 32 served 0.985x the
long spin's requests (4 pairs, async).

A spin is long only in one pool. Every thread that runs a parallel region keeps a pool of its own,
and with more pool threads than CPUs libgomp cuts every spin to its "throttled" count: 100 pauses,
or 1000 under OMP_WAIT_POLICY=ACTIVE, which is why ACTIVE is set (at 100 a second pool doubled the
worker's batch time; scripts/omp_pools.py: 280 -> 591 µs, 284 -> 298 with ACTIVE). So the weights load
on a thread that ends before serving, and the event loop's solo runs take only requests that run on
one thread (model.py), which start no pool.

Only where every model computes on the CPU. With a GPU the CPU stages batches, and torch's copies run
parallel regions on every core (16 on the GPU machine): their threads would spin ~4 ms after each
batch, on cores that the edge processes need. There the spin stays at 1000 pauses (~15 µs on Intel).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

# libgomp's pause loops before a waiting thread sleeps: its own default, made explicit (the docstring
# says why). The seventeenth pass measured it against 1000 on the Intel VM while the event loop's solo
# runs kept a second pool, so throttled: L=256 at concurrency 1 p50 -10 to -22%, W1 at concurrency 32
# -3 to -15% req/s. With one pool, on the AMD VM: W1 concurrency 1 p50 -11%, concurrency 32 a tie.
SPIN_COUNT = "300000"
# Where a model may compute on a GPU (the docstring says why).
GPU_SPIN_COUNT = "1000"


_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def uses_gpu(devices: Iterable[str], environ: Mapping[str, str], nvidia: Path = Path("/dev/nvidiactl")) -> bool:
    """Whether any of the models' devices (settings: auto, cpu, cuda, cuda:N) may be a GPU, told before
    torch loads: `auto` is one where an NVIDIA driver's device node exists and CUDA_VISIBLE_DEVICES
    does not hide every GPU."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    return any(d.startswith("cuda") or (d == "auto" and not hidden and nvidia.exists()) for d in devices)


def set_defaults(environ: MutableMapping[str, str], gpu: bool = False) -> str:
    """libgomp's long spin with ACTIVE's throttled count (with `gpu`, a model that may compute on a GPU: a
    short spin), unless the operator chose a wait policy or a spin count; returns the setting in effect,
    for the log ("OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=300000")."""
    if not any(name in environ for name in _VARIABLES):
        environ["OMP_WAIT_POLICY"] = "ACTIVE"
        environ["GOMP_SPINCOUNT"] = GPU_SPIN_COUNT if gpu else SPIN_COUNT
    return ", ".join(f"{name}={environ[name]}" for name in _VARIABLES if name in environ)
