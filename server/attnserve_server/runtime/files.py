"""The process's limit on open files: raised at start-up from its soft value to its hard one, as Go's
runtime does for every Go server.

Every gRPC connection holds a file descriptor, as do shared memory regions and the edge processes' pipes.
The soft limit (RLIMIT_NOFILE) is only the default a process starts with, often 1024 (systemd's default,
and containerd 2's for containers); the hard limit is what the operator allows. Left at a low soft limit,
a server reached by more clients than it allows stops accepting: gRPC logs "File descriptor limit
reached. Retrying." once a second, and each new client waits out its deadline (measured: a server started
at 1024 let its 1,003rd client's call time out, at 128 its 107th; BENCHMARKS.md, fifty-seventh pass).
Nothing here selects on descriptors (gRPC and the event loop use epoll), so descriptors past 1024 are fine.
"""

from __future__ import annotations

import resource

NR_OPEN = "/proc/sys/fs/nr_open"  # the kernel's ceiling for one process, where the hard limit is "unlimited"
# Raised no higher than this, the kernel's default ceiling (and the limit Docker gave containers for years):
# where the hard limit is huge (systemd resolves "infinity" to 2^30), code that sizes a table by the limit, or
# walks every descriptor up to it, would pay for it.
MOST = 1 << 20


def raise_open_files_limit() -> str:
    """Raises the soft limit on open files to the hard limit, or to MOST (inherited by the edge processes);
    returns what it did, for the log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            return _describe(soft)
    target = min(target, MOST)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            return f"{_describe(soft)} (not raised to {target}: {exc})"
        return f"at most {target} (raised from {soft})"
    return _describe(soft)


def _describe(soft: int) -> str:
    return "unlimited" if soft == resource.RLIM_INFINITY else f"at most {soft}"
