"""The stuck-worker watchdog: a batch that computes for longer than `worker_stall_s` ends the process.

A worker thread stuck in a kernel (a hung GPU, a deadlock in a library) cannot be interrupted from
Python, and neither its batch nor any later one will be answered: the queue fills, every caller times
out, and health would still say SERVING, so no orchestrator would restart the server. The watchdog is
a thread of its own, so it sees a stall even when the stuck computation holds the event loop (a lone
request computes there on a quiet server, solo.py). Its verdict cannot be a graceful stop: the stuck
thread would hold the exit forever (Python joins executor threads at exit). It logs which model's batch
has been computing for how long, and exits the process with status 1 at once; the callers whose
connections close get UNAVAILABLE (which clients retry), and the orchestrator restarts the server.
With edge processes the engine runs it, and the edges answer UNAVAILABLE and exit 1 when it goes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# (model name, seconds its oldest batch in flight has been computing; 0 if none)
Probe = Callable[[], tuple[str, float]]


def _exit_now(model: str, age_s: float) -> None:
    logging.shutdown()  # the log lines out first
    sys.stderr.flush()
    os._exit(1)


class Watchdog:
    """Checks `probes` every `limit_s / 4` (at most every 5 s); calls `on_stall(model, age_s)` once, for the
    first batch found computing longer than `limit_s`. `on_stall` exits the process by default."""

    def __init__(self, limit_s: float, probes: list[Probe], on_stall: Callable[[str, float], None] = _exit_now) -> None:
        self.limit_s = limit_s
        self._probes = probes
        self._on_stall = on_stall
        self._period_s = min(limit_s / 4, 5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="attn-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._period_s + 1)

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            for probe in self._probes:
                model, age_s = probe()
                if age_s > self.limit_s:
                    log.critical(
                        "model %r: a batch has been computing for %.3g s, over worker_stall_s (%g s): its worker is "
                        "stuck; exiting now with status 1, for the orchestrator to restart the server",
                        model,
                        age_s,
                        self.limit_s,
                    )
                    self._on_stall(model, age_s)
                    return
