"""Starting `attnserve serve` in a child process and knowing when it is ready (bench and the tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# `serve` prints this line once it is ready; spawn_serve() reads it.
_READY = re.compile(r"^attnserve ready grpc=(\S+):(\d+) metrics=(?:\S+:(\d+)|off)")


class ServeExited(RuntimeError):
    """`attnserve serve` ended before it was ready (its own error is on its stderr)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"attnserve serve exited with code {code} before it was ready")
        self.code = code


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int | None
    host: str = "127.0.0.1"  # as the ready line shows it: an IPv6 address in brackets

    @property
    def target(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(self.host, self.host)  # a wildcard: this host
        return f"{host}:{self.port}"


def spawn_serve(*flags: str, stderr: Any = None, preexec_fn: Callable[[], object] | None = None) -> ServeProcess:
    """Starts `attnserve serve` in a child process on 127.0.0.1 with free ports; returns once it is ready.
    `preexec_fn` runs in the child before it starts (a test's resource limits)."""
    cmd = [sys.executable, "-m", "attnserve_server", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--metrics-port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=preexec_fn)
    assert proc.stdout is not None
    for line in proc.stdout:
        if match := _READY.match(line):
            metrics = int(match.group(3)) if match.group(3) else None
            return ServeProcess(proc, int(match.group(2)), metrics, match.group(1))
    raise ServeExited(proc.wait())
