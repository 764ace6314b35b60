"""Summarises a `py-spy record --threads --idle --native --format raw` profile: where each thread's time goes.

    python scripts/profile_summary.py profile.txt [--requests N]

A profile recorded with `--subprocesses` (the engine and its edge processes) names each thread with its
process: "engine", "edge 0", "edge 1", ...

Each sample is charged to one category. First by what the thread is blocked in, if anything: waiting
to take the GIL back (after a torch call or a C call that released it, or inside torch, which since 2.10
takes it to count a reference to a tensor that Python owns; also a Cython callback, such as uvloop's or
gRPC's, blocked on a condition as it enters Python), or idle (blocked in epoll, a lock or
a condition: no work). Then a sample whose stack passes through the project's own code (or
prometheus_client) goes to the deepest such frame's category, so library calls made by a step are
charged to that step (torch.frombuffer inside decoding is decoding). Otherwise the innermost frame
decides: protobuf, gRPC's core, OpenMP (torch's thread pool), asyncio. With --requests, the busy
columns are also given as CPU microseconds per request.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

# (category, pattern on one frame "function (file:line)"), checked from the leaf towards the root.
OWN = [
    ("metrics", r"prometheus_client|attnserve_server/metrics\.py"),
    ("encode", r"^(encode|_output|fill_response|_set_tensor|tensor_to_proto|tensor_bytes) \(.*attnserve_server/edge/"),
    ("decode + validate", r"attnserve_server/edge/(wire|kserve|convert)\.py"),
    ("batcher", r"attnserve_server/batching\.py"),
    ("dispatch + servicer", r"edge/dispatch\.py|edge/servicer\.py|edge/kserve_servicer\.py|attnserve_server/model\.py"),
    # between an edge process and the engine: messages, the arena's regions (both sides)
    ("engine link", r"multiprocess/link\.py|^(Edge|EngineLink|RemoteModel)\.\w+ \(.*attnserve_server/multiprocess/"),
    ("worker: staging + split", r"compute/worker\.py|compute/staging\.py"),
    ("worker: attention", r"compute/attention\.py"),
]
LIBRARY = [
    ("protobuf", r"google/protobuf|_message\.|upb|FromString|SerializeToString"),
    ("gRPC core", r"grpc/_cython|cygrpc|libgrpc|grpc_core|grpc::|absl::"),
    ("OpenMP (torch's threads: barriers, spinning)", r"libgomp|GOMP_"),
    ("torch (other)", r"libtorch|at::|c10::|mkl|dnnl|torch/"),
    ("asyncio", r"asyncio/"),
]
GIL = re.compile(
    r"take_gil|gil_scoped_release|gil_scoped_acquire|PyEval_RestoreThread|PyEval_AcquireThread|PyGILState_Ensure"
)
WAIT = re.compile(
    r"^(epoll_wait|epoll_pwait|poll|__poll|select|pthread_cond_wait|pthread_cond_timedwait|PyThread_acquire_lock"
    r"|sem_wait|sem_timedwait|do_futex_wait|__lll_lock_wait|nanosleep|clock_nanosleep|accept|recv|read )"
)
UNNAMED = re.compile(r"^0x[0-9a-f]+ \(")  # an address in a library without symbols (libc's futex, say)
# Cython-generated C (uvloop's loop.c, gRPC's cygrpc): a condition wait called straight from it is the
# callback taking the GIL to run Python (its PyGILState_Ensure has no frame of its own in py-spy).
CYTHON = re.compile(r"\((loop|cygrpc)\.c(pp)?:\d+\)|_cython/|cygrpc")
# torch's Python bindings: a condition wait called straight from one is the binding taking the GIL back as
# its call returns (pybind11's gil_scoped_release, inlined: no frame of its own), e.g.
# THPVariable__native_multi_head_attention after the fused kernel. torch's Python layer waits on no other
# condition.
TORCH_BINDING = re.compile(r"\(libtorch_python\.so\)")
GIL_WAIT = re.compile(r"^(pthread_cond_wait|pthread_cond_timedwait) ")
# A process frame of `py-spy record --subprocesses`: `process PID:"command line"`.
PROCESS = re.compile(r'^process (\d+):"(.*)"$')
_OWN = [(name, re.compile(p)) for name, p in OWN]
_LIB = [(name, re.compile(p)) for name, p in LIBRARY]


def categorise(frames: list[str]) -> str:
    named = [f for f in frames if not UNNAMED.match(f)]
    if named and WAIT.match(named[-1]):
        # Blocked: on the GIL if a GIL-taking frame is just above the wait, else idle.
        if any(GIL.search(f) for f in named[-4:]):
            return "waiting for the GIL"
        caller = named[-2] if len(named) > 1 else ""
        if GIL_WAIT.match(named[-1]) and (CYTHON.search(caller) or TORCH_BINDING.search(caller)):
            return "waiting for the GIL"
        return "idle (blocked)"
    if any(GIL.search(f) for f in named[-2:]):
        return "waiting for the GIL"
    for frame in reversed(frames):  # leaf first
        for name, pattern in _OWN:
            if pattern.search(frame):
                return name
    leaf = frames[-1] if frames else ""
    for name, pattern in _LIB:
        if pattern.search(leaf):
            return name
    for frame in reversed(frames):
        for name, pattern in _LIB:
            if pattern.search(frame):
                return name
    return "other"


def process_label(command: str) -> str:
    """A short name for a process of the server from its command line."""
    edge = re.search(r"edge_process .*--index (\d+)", command)
    if edge:
        return f"edge {edge.group(1)}"
    return "idle spinner" if "_idle_spinner" in command else "engine"


def thread_of(frames: list[str]) -> tuple[str, list[str]]:
    """The thread's label, and the stack's frames below it."""
    process = ""
    for i, frame in enumerate(frames):
        found = PROCESS.match(frame)
        if found:
            process = process_label(found.group(2))
            continue
        name = re.sub(r"\s*\(?0x[0-9a-f]+\)?|\s*\(\d+\)", "", frame).strip() or frame
        return (f"{process}, {name.removeprefix('thread: ')}" if process else name), frames[i + 1 :]
    return process or "?", []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--requests", type=int, default=0, help="requests answered while py-spy recorded")
    ap.add_argument("--duration-s", type=float, default=0.0, help="how long py-spy recorded")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's sampling rate (samples/s)")
    ap.add_argument("--min-share", type=float, default=0.01, help="hide threads with less of the samples")
    args = ap.parse_args()
    threads: dict[str, Counter] = defaultdict(Counter)
    with open(args.profile) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, frames = thread_of(stack.split(";"))
        threads[thread][categorise(frames)] += int(count)
    total = sum(sum(c.values()) for c in threads.values())
    per_request_us = 1e6 / args.rate / args.requests if args.requests else 0.0
    for thread, counts in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        samples = sum(counts.values())
        if samples < args.min_share * total:
            continue
        busy = samples - counts.get("idle (blocked)", 0)
        print(f"\n### {thread}: {samples} samples, busy {100 * busy / samples:.0f}%")
        print("| category | share of thread | CPU us / request |" if per_request_us else "| category | share |")
        print("| --- | ---: | ---: |" if per_request_us else "| --- | ---: |")
        for name, n in counts.most_common():
            share = f"{100 * n / samples:.1f}%"
            if per_request_us:
                us = "" if name.startswith("idle") else f"{n * per_request_us:.0f}"
                print(f"| {name} | {share} | {us} |")
            else:
                print(f"| {name} | {share} |")


if __name__ == "__main__":
    main()
