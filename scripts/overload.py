"""Shedding at overload: how fast a full queue refuses. Starts `attnserve serve` with a queue of
--queue requests whose batches wait a minute (so the queue stays full), fills it, then fires
--factor times as many W1 requests at once and reports the refusals' latency.

    python scripts/overload.py [--queue 16] [--factor 10] [--attnserve .venv/bin/attnserve]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np

from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


def request(e: int, seq: int) -> pb.AttendRequest:
    q = np.random.default_rng(0).standard_normal((seq, e)).astype("<f4")
    msg = pb.AttendRequest()
    msg.query.dtype, msg.query.data = pb.DATA_TYPE_FP32, q.tobytes()
    msg.query.shape[:] = q.shape
    return msg


async def main(args: argparse.Namespace) -> None:
    proc = subprocess.Popen(
        [args.attnserve, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--device", "cpu",
         "--max-queue-size", str(args.queue), "--max-queue-delay-ms", "60000", "--max-batch-size", "1024"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # "attnserve ready grpc=HOST:PORT ..."
        target = line.split("grpc=")[1].split()[0]
        msg = request(256, 64)
        channels = [grpc.aio.insecure_channel(target) for _ in range(2)]
        stubs = [pb_grpc.AttentionServiceStub(c) for c in channels]
        held = [asyncio.ensure_future(stubs[0].Attend(msg, timeout=120)) for _ in range(args.queue)]
        await asyncio.sleep(2)  # the queue fills (a setup step, not synchronisation under test)

        async def one(i: int) -> tuple[str, float]:
            t0 = time.perf_counter()
            try:
                await stubs[i % 2].Attend(msg, timeout=60)
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            return code, time.perf_counter() - t0

        results = await asyncio.gather(*(one(i) for i in range(args.queue * args.factor)))
        refused = sorted(t for code, t in results if code == "RESOURCE_EXHAUSTED")
        codes = {c: sum(1 for code, _ in results if code == c) for c in {code for code, _ in results}}
        p = lambda q: refused[min(len(refused) - 1, int(q * len(refused)))] * 1e3  # noqa: E731
        print(f"{len(results)} requests at once on a full queue of {args.queue}: {codes}")
        if refused:
            print(f"refusal latency ms: p50 {p(0.5):.2f}  p99 {p(0.99):.2f}  max {refused[-1] * 1e3:.2f}"
                  f"  mean {statistics.mean(refused) * 1e3:.2f}")  # fmt: skip
        for h in held:
            h.cancel()
        for c in channels:
            await c.close()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queue", type=int, default=16)
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--attnserve", default=".venv/bin/attnserve")
    asyncio.run(main(ap.parse_args()))
    sys.exit(0)
