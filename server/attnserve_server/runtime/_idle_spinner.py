"""One idle-priority spinner: keeps its CPU from halting while the server is busy (idle_spin.py).

Started by `idle_spin.IdleSpin` as `python -I -S _idle_spinner.py WAKE_FD STATE_FD CPU`, so it imports
nothing but the standard library and shares no GIL with the server. It spins while the deadline in
the shared state is ahead of the clock, then marks itself asleep and blocks on the wake pipe until
the server writes to it. It exits when the server closes the pipe (or dies: the kernel closes it);
it ignores SIGINT, so that a terminal's Ctrl-C, which reaches the server's whole process group,
ends it only through the server.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import sys
import time

# The shared state, as idle_spin.py writes it: a float64 deadline (CLOCK_MONOTONIC seconds), then a
# byte that a spinner sets before it sleeps and the server clears when it wakes the spinners.
STATE = struct.Struct("=dB")
DEADLINE = struct.Struct("=d")
ASLEEP_AT = DEADLINE.size


def _quiet_and_low(cpu: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # not one of this process's CPUs any more: spin where the kernel puts it
        os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def main(argv: list[str]) -> int:
    wake_fd, state_fd, cpu = (int(a) for a in argv[1:4])
    _quiet_and_low(cpu)
    state = mmap.mmap(state_fd, STATE.size)
    os.close(state_fd)
    deadline = DEADLINE.unpack_from
    clock = time.monotonic
    while True:
        while clock() < deadline(state, 0)[0]:
            pass
        state[ASLEEP_AT] = 1  # the next request wakes us
        if clock() < deadline(state, 0)[0]:
            continue  # a request came between the check and the mark
        if not os.read(wake_fd, 1):
            return 0  # the server closed its end


if __name__ == "__main__":
    sys.exit(main(sys.argv))
