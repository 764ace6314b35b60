"""When a lone request runs on the event loop itself instead of on its device worker's thread.

A request handed to the worker thread costs two thread hops: the loop wakes the worker, the worker
wakes the loop with the answer. On a quiet server each hop wakes an idle core, ~60 µs apiece on the
2-core VM of BENCHMARKS.md, a sixth of a W1 request's latency at concurrency 1. Under load the hops
are free (both threads are awake) and they are what lets the loop decode and answer requests while
a batch computes. So the batcher runs a request on the loop ("solo") only while the server is
quiet, and this policy says when that is:

- **Entering.** After `streak` requests in a row each found nothing queued and no batch computing.
  Any request that finds company resets the count.
- **Leaving.** Once solo, the loop itself is the only place requests compute, so company can no
  longer be seen in the queue: a second client's request waits in the socket until the loop is
  free. What shows it is the loop's own time. Between one solo run's end and the next request's
  admission a quiet loop waits for the client's round trip; a loop with requests waiting goes
  straight from one to the next, busy throughout. When the loop was idle for less than
  `idle_share` of that interval `pressed` times in a row, solo ends and batching resumes.

Entering needs many quiet requests and leaving only two busy ones, so a loaded server stays off
the loop, and a server that is quiet now and then does not flap between the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The largest request that may run on the loop, in multiply-adds (the server's --solo-macs): ~1 ms on
# the 2-core VM (W1 is 19 M). The hops are worth saving only where they are a visible share of the
# compute, and the loop answers nothing else while it computes. Only a request that runs on one
# intra-op thread runs there (model.py says why): with several threads, those under 8 M.
SOLO_MACS = 64_000_000
STREAK = 32  # quiet requests in a row before the loop computes
PRESSED = 2  # busy gaps in a row before it stops
# A gap in which the loop idled less than this share of the time is busy. With idle spin (idle_spin.py)
# no wake-up waits for a halted vCPU, and a W1 client at concurrency 1 leaves the loop idle for only
# ~20-30% of the gap: a quarter made solo stop for 28% of its requests (p50 +30-50 µs); at concurrency
# 2 the loop idles for almost none of it (BENCHMARKS.md, thirteenth pass).
IDLE_SHARE = 0.1


class SoloPolicy:
    """Decides, per admission on the event loop, whether the request runs on the loop (True)."""

    def __init__(
        self,
        *,
        streak: int = STREAK,
        pressed: int = PRESSED,
        idle_share: float = IDLE_SHARE,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self._streak_needed = streak
        self._pressed_limit = pressed
        self._idle_share = idle_share
        self._clock = clock
        self._cpu_clock = cpu_clock  # the calling thread's CPU time: call on the loop only
        self.active = False
        self._quiet = 0  # quiet admissions in a row, while not active
        self._pressed = 0  # busy gaps in a row, while active
        self._last: tuple[float, float] | None = None  # (wall, loop CPU) when the last solo run ended

    def admit(self, idle: bool) -> bool:
        """One admission; `idle`: nothing queued and no batch computing. True: run it on the loop."""
        if not idle:
            self._stop()
            return False
        if not self.active:
            self._quiet += 1
            if self._quiet >= self._streak_needed:
                self.active, self._pressed, self._last = True, 0, None
            return False
        if self._last is not None:
            wall = self._clock() - self._last[0]
            busy = self._cpu_clock() - self._last[1]
            self._pressed = self._pressed + 1 if wall - busy < self._idle_share * wall else 0
            if self._pressed >= self._pressed_limit:
                self._stop()
                return False
        return True

    def ran(self) -> None:
        """A solo run just ended (on the loop)."""
        self._last = (self._clock(), self._cpu_clock())

    def _stop(self) -> None:
        self.active = False
        self._quiet = 0
