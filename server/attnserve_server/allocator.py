"""glibc's malloc set for a server that allocates the same large buffers batch after batch.

By default glibc serves a large allocation (over a threshold that starts at 128 KiB and adapts up to
32 MiB) with a fresh mmap, and gives it back to the kernel when it is freed; memory freed at the top
of the heap goes back too. A forward pass allocates its activations anew every batch, so every batch
faulted its pages in again, one at a time: W1's width at L=256, in batches of 1-24 sequences, took
1925 µs per sequence with 553,000 page faults, and 1425 µs with 13,000 with the settings below
(scripts/malloc_batches.py). Request and answer buffers of 128 KiB and more take the same path on the
event loop (not measured apart).
`serve` (and `bench`, so that the in-process limit is measured the same way) turns mmap off for
malloc (M_MMAP_MAX=0), keeps up to 256 MiB free at a heap's top (M_TRIM_THRESHOLD) and 64 MiB spare
per arena (M_TOP_PAD): freed memory stays in the process for the next batch. The cost: the heap
keeps about its peak size, which the batch limits bound (WL's peak: 713 -> 873 MiB).

An operator's own choice wins: any MALLOC_* variable, malloc tunables in GLIBC_TUNABLES, or another
allocator preloaded (LD_PRELOAD). Edge processes inherit the setting through the environment.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import MutableMapping

TRIM_THRESHOLD = 256 << 20
# A thread's arena beyond the main one grows in heaps of up to 64 MiB; one that empties is unmapped
# unless the arena keeps this much spare. Without it, batches needing more than one heap (L=128 and
# up for W1's width) faulted their pages in every time despite the two settings above.
TOP_PAD = 64 << 20
# (mallopt(3)'s name and number for the parameter, the environment variable that sets it when a
# process starts, the value)
_SETTINGS = (
    ("M_MMAP_MAX", -4, "MALLOC_MMAP_MAX_", 0),
    ("M_TRIM_THRESHOLD", -1, "MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
    ("M_TOP_PAD", -2, "MALLOC_TOP_PAD_", TOP_PAD),
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
