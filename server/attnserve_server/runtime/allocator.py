"""glibc's malloc set for a server that allocates the same large buffers batch after batch.

By default glibc serves a large allocation (over a threshold that starts at 128 KiB and adapts up to
32 MiB) with a fresh mmap, and gives it back to the kernel when it is freed; memory freed at the top
of the heap goes back too. A forward pass allocates its activations anew every batch, so every batch
faulted its pages in again, one at a time: W1's width at L=256, in batches of 1-24 sequences, took
1925 µs per sequence with 553,000 page faults, and 1425 µs with 13,000 with the settings below
(scripts/malloc_batches.py). Request and answer buffers of 128 KiB and more take the same path on the
event loop (not measured apart).
`serve` (and `bench`, so that the in-process limit is measured the same way) turns mmap off for
malloc (M_MMAP_MAX=0), keeps up to 1 GiB free at the heap's top (M_TRIM_THRESHOLD), grows it 64 MiB
beyond each need (M_TOP_PAD), and keeps every thread on the main arena (M_ARENA_MAX=1): freed memory
stays in the process for the next batch. The cost: the heap keeps about its peak size, which the
batch limits bound (`max_batch_memory_bytes`; WL's peak: 720 -> 980 MiB).

Why one arena: any other thread gets an arena of its own, built from heaps of at most 64 MiB, and
glibc serves an allocation that no such heap can hold with mmap whatever M_MMAP_MAX says. The device
worker's thread faulted a 64 MiB attention matrix in again every batch (E=256, 8 heads, L=512,
batches of 8 and 16: 16,385 and 32,769 faults a batch, 5.9 ms a sequence against 3.9 on the main
arena). The main arena grows with brk and has no such limit; threads contend for its lock only
above tcache's small sizes, and Python's small objects never reach malloc. Why 1 GiB: at L=512 a
batch of 24 frees more than the 256 MiB kept before, and the next batch faulted it in again.
Over batches of 1-24 (scripts/malloc_batches.py, µs per sequence, page faults):

| shape | before (256 MiB, arenas per thread) | now |
| --- | --- | --- |
| W1's width, L=256 | 1486, 16,899 | 1345, 7,680 |
| W1's width, L=512 | 5923, 1,552,177 | 4026-4230, 37,888-67,586 |
| WL (E=1024, 16 heads, L=256) | 13,915, 1,537,880 | 13,053, 92,161 |

An operator's own choice wins: any MALLOC_* variable, malloc tunables in GLIBC_TUNABLES, or another
allocator preloaded (LD_PRELOAD). Edge processes inherit the setting through the environment.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import MutableMapping

TRIM_THRESHOLD = 1 << 30
# What the heap grows by beyond each need. Without it (one arena, the settings above) batches of 1-24
# at L=512 for W1's width faulted twice as often and peaked at 1086 MiB instead of 710-807: the heap
# grew in many small steps, and fragmented.
TOP_PAD = 64 << 20
# (mallopt(3)'s name and number for the parameter, the environment variable that sets it when a
# process starts, the value)
_SETTINGS = (
    ("M_MMAP_MAX", -4, "MALLOC_MMAP_MAX_", 0),
    ("M_TRIM_THRESHOLD", -1, "MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
    ("M_TOP_PAD", -2, "MALLOC_TOP_PAD_", TOP_PAD),
    ("M_ARENA_MAX", -8, "MALLOC_ARENA_MAX", 1),
)


def _operator_choice(environ: MutableMapping[str, str]) -> str | None:
    chosen = sorted(name for name in environ if name.startswith("MALLOC_"))
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if environ.get("LD_PRELOAD"):
        chosen.append("LD_PRELOAD")
    return ", ".join(chosen) or None


def set_defaults(environ: MutableMapping[str, str]) -> str:
    """Sets malloc up for this process (mallopt) and for the processes it starts (`environ`), unless
    the operator chose; returns what is in effect, for the log."""
    chosen = _operator_choice(environ)
    if chosen is not None:
        return f"left as set ({chosen})"
    if platform.libc_ver()[0] != "glibc":
        return "left as is (not glibc)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = []
    for name, param, variable, value in _SETTINGS:
        if mallopt(param, value) != 1:
            return ", ".join([*applied, f"mallopt refused {name}={value}"])
        environ[variable] = str(value)
        applied.append(f"{name}={value}")
    return ", ".join(applied)
