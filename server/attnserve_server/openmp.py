"""The OpenMP environment torch's CPU kernels run under in the server, set before torch loads.

torch's CPU wheels use GNU OpenMP (libgomp), which reads its environment once, when it loads.
By default its threads spin for a long while (GOMP_SPINCOUNT 300,000 pause loops) after every
parallel region: in a server they would spin against the gRPC and event-loop threads. Sleeping at
once (OMP_WAIT_POLICY=PASSIVE) costs a wake-up at every region instead, which made two threads
slower than one on a small batch. A short spin keeps a forward pass's threads awake from one region
to the next and lets them sleep between batches. Measured on W1, 2 cores (BENCHMARKS.md): one
sequence 344 us on 2 threads against 529 passive and 405 on one thread; 4 sequences 1041 against
1263; concurrency-1 p50 0.96 ms against 1.13, concurrency 32 unchanged.

Every thread that runs a parallel region keeps a pool of its own (the worker's, and the event loop's
once it computes a solo request: solo.py). With more pool threads than CPUs libgomp cuts every
spin to its "throttled" count, 100 pauses unless OMP_WAIT_POLICY=ACTIVE makes it 1000, and then
a second pool doubled the worker's batch time (scripts/omp_pools.py: 280 -> 591 µs). ACTIVE with an
explicit GOMP_SPINCOUNT of 1000 keeps the same short spin in both cases (284 -> 298 µs): ACTIVE
changes nothing else here, as the explicit count replaces its endless spin.
"""

from __future__ import annotations

from collections.abc import MutableMapping

# libgomp's pause loops before a waiting thread sleeps: ~15 us on the Intel VM of BENCHMARKS.md's later
# passes (a pause takes 13-17 ns there), longer where a pause is slower. libgomp's own 300,000 served
# one long request at a time faster there (L=256 at concurrency 1: p50 -10 to -22%) and W1 at
# concurrency 32 slower (-3 to -15%): the seventeenth pass.
SPIN_COUNT = "1000"


_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_defaults(environ: MutableMapping[str, str]) -> str:
    """A short spin, throttled or not, unless the operator chose a wait policy or a spin count;
    returns the setting in effect, for the log ("OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=1000")."""
    if not any(name in environ for name in _VARIABLES):
        environ["OMP_WAIT_POLICY"] = "ACTIVE"
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return ", ".join(f"{name}={environ[name]}" for name in _VARIABLES if name in environ)
