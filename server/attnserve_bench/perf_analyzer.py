"""`attnserve bench --perf-analyzer`: Triton's perf_analyzer as the load generator, over KServe v2.

perf_analyzer is NVIDIA's C++ load generator; it speaks KServe v2 with `--service-kind=triton`,
reads the model's metadata and config, and reports the server-side statistics it reads from
ModelStatistics. Each level runs one perf_analyzer process; its own report goes to stderr, and
the CSV it writes becomes one bench row. The mean batch comes from the server's statistics.
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from attnserve._codec import float32_to_bfloat16_bits
from attnserve_bench.results import Row
from attnserve_server import dtypes
from attnserve_server.protocol import open_inference_pb2 as v2
from attnserve_server.protocol import open_inference_pb2_grpc as v2_grpc

_INPUTS = ("query", "key_value", "key", "value")


def input_data(inputs: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """perf_analyzer's --input-data JSON: an entry per request's inputs (perf_analyzer takes them in
    turn), one sequence per input (it adds the batch dim, -b), as raw b64."""
    data = []
    for request in inputs:
        entry = {}
        for name in _INPUTS:
            array = request.get(name)
            if array is None:
                continue
            one = np.ascontiguousarray(array[0], dtype=np.float32)
            raw = float32_to_bfloat16_bits(one).tobytes() if dtype == "bfloat16" else one.astype(dtype).tobytes()
            entry[name] = {"b64": base64.b64encode(raw).decode(), "shape": list(one.shape)}
        data.append(entry)
    return {"data": data}


def _env(binary: str) -> dict[str, str]:
    """perf_analyzer links the CUDA runtime even on a CPU machine: nvidia-cuda-runtime-cu12 in its venv."""
    env = dict(os.environ)
    venv = Path(binary).resolve().parent.parent
    libs = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"))
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


def model_statistics(target: str, model: str, timeout_s: float = 30.0) -> v2.ModelStatistics:
    """A server's KServe v2 statistics of one model since it started (also scripts/batch_stats.py's)."""
    with grpc.insecure_channel(target) as channel:
        stub = v2_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelStatistics(v2.ModelStatisticsRequest(name=model), timeout=timeout_s).model_stats[0]


def output_bytes(inputs: list[dict[str, Any]], output_dim: int, dtype: str) -> int:
    """The largest output of the requests: what perf_analyzer's --output-shared-memory-size must hold."""
    itemsize = dtypes.FLOATS[dtype].itemsize
    return max(math.prod(request["query"].shape[:2]) for request in inputs) * output_dim * itemsize


def command(
    binary: str,
    target: str,
    model: str,
    data_path: str,
    csv_path: str,
    concurrency: int,
    mode: str,
    args,
    output_bytes: int = 0,
) -> list[str]:
    cmd = [
        binary,
        *("-m", model, "-u", target, "-i", "grpc", "--service-kind=triton"),
        *("--input-data", data_path, "-b", str(args.batch)),
        *("--concurrency-range", f"{concurrency}:{concurrency}"),
        *("--measurement-interval", str(int(args.duration_s * 1000))),
        # A noisy machine: accept a wide spread between windows (--pa-stability), and stop after 5 tries.
        *("--stability-percentage", f"{args.pa_stability:g}", "--max-trials", "5", "-f", csv_path),
    ]
    if mode == "async":
        cmd.append("--async")
    elif mode == "streaming":
        cmd.append("--streaming")
    elif mode != "sync":
        raise ValueError(f"--pa-modes: expected sync, async or streaming, got {mode!r}")
    if args.causal:
        cmd += ["--request-parameter", "causal:true:bool"]
    if args.shared_memory:  # every input and output in shared memory: perf_analyzer sizes the outputs' room
        cmd += ["--shared-memory", "system", "--output-shared-memory-size", str(output_bytes)]
    return cmd


def run_level(
    target: str,
    data: dict[str, Any],
    inputs: list[dict[str, Any]],
    concurrency: int,
    mode: str,
    args: argparse.Namespace,
    label: str,
    output_bytes: int = 0,
):

    model = inputs[0]["model"]
    with tempfile.TemporaryDirectory(prefix="attnserve-pa-") as tmp:
        data_path, csv_path = os.path.join(tmp, "input.json"), os.path.join(tmp, "report.csv")
        with open(data_path, "w") as f:
            json.dump(data, f)
        before = model_statistics(target, model)
        cmd = command(args.perf_analyzer, target, model, data_path, csv_path, concurrency, mode, args, output_bytes)
        print(f"  $ {' '.join(cmd)}", file=sys.stderr)
        done = subprocess.run(cmd, env=_env(args.perf_analyzer), capture_output=True, text=True)
        sys.stderr.write(done.stdout)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        after = model_statistics(target, model)
        with open(csv_path) as f:
            row = next(csv.DictReader(f))
    ok = after.inference_stats.success.count - before.inference_stats.success.count
    failed = after.inference_stats.fail.count - before.inference_stats.fail.count
    executions = after.execution_count - before.execution_count
    per_second = float(row["Inferences/Second"]) / args.batch  # perf_analyzer counts sequences
    return Row(
        server=f"pa-{mode} {label}",
        concurrency=concurrency,
        requests=ok,
        errors=failed,
        throughput_rps=per_second,
        p50_ms=float(row["p50 latency"]) / 1e3,
        p90_ms=float(row["p90 latency"]) / 1e3,
        p99_ms=float(row["p99 latency"]) / 1e3,
        mean_batch=ok / executions if executions else 0.0,
    )
