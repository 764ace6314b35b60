"""The attnserve command line: serve, infer, bench."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from typing import Any, NoReturn

from attnserve_server.connect import (
    Refused,
    add_connection_flags,
    connection_from,
    lengths,
    output_file,
    seconds,
    target,
    whole_number,
)
from attnserve_server.runtime import allocator, files, openmp, pyheap
from attnserve_server.settings import OPTIONS

_DESCRIPTION = "attnserve: multi-head attention served over gRPC."


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the server",
        description="Run the server. With no config it serves one model, 'default' (MHA, E=256, 8 heads, "
        "float32). Every flag can also be set as ATTNSERVE_<FLAG> (e.g. ATTNSERVE_MAX_BATCH_SIZE=32); "
        "flags win over the environment, which wins over the config file. Model flags apply to every model.",
    )
    p.add_argument("--config", help="YAML or TOML config file (env ATTNSERVE_CONFIG)")
    for opt in OPTIONS:
        kind = str if opt.type is bool else opt.type
        p.add_argument(f"--{opt.flag}", dest=opt.dest, type=kind, default=None, help=f"{opt.help} [{opt.env}]")


def _add_infer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="send one request (random data or .npy files) and summarize the answer",
        description="Send one attention request. Inputs are .npy files, or random data shaped from the "
        "model's metadata.",
    )
    p.add_argument("--target", type=target, default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--model", default="", help="model name (default: the server's first model)")
    p.add_argument("--query", help=".npy file: [L, E] or [B, L, E]")
    p.add_argument("--key-value", help=".npy file: X' for cross attention")
    p.add_argument("--key", help=".npy file: K (bare operation) or key input (MHA with kdim)")
    p.add_argument("--value", help=".npy file: V (bare operation) or value input (MHA with vdim)")
    p.add_argument("--batch", type=whole_number, default=1, help="random data: sequences (default 1)")
    p.add_argument("--seq-len", type=whole_number, default=64, help="random data: query length L (default 64)")
    p.add_argument("--kv-len", type=whole_number, help="random data: key length S; cross attention when given")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--key-lengths", type=lengths, help="comma list of key lengths, one per sequence")
    p.add_argument("--need-weights", action="store_true", help="also return the attention matrix")
    p.add_argument("--average-weights", action="store_true", help="average the matrix over heads")
    p.add_argument("--seed", type=int, default=0, help="random data seed (default 0)")
    p.add_argument("--output", type=output_file, help="save Y to this .npy file (numpy adds .npy if it is missing)")
    p.add_argument("--timeout-s", type=seconds, default=30.0, help="deadline (default 30)")
    add_connection_flags(p)


def _add_health(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "health",
        help="ask a server's grpc.health.v1 service; exit 0 when SERVING (container and probe checks)",
        description="Check a server's health over grpc.health.v1. Prints the status; exits 0 when it is "
        "SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable).",
    )
    # In the server's container: its plaintext health port when it has one (TLS on), else its gRPC port.
    health_port = os.environ.get("ATTNSERVE_HEALTH_PORT", "")
    port = health_port if health_port.isdigit() else os.environ.get("ATTNSERVE_PORT", "50051")
    p.add_argument(
        "--target",
        type=target,
        default=f"127.0.0.1:{port}",
        help="server address (default 127.0.0.1 and $ATTNSERVE_HEALTH_PORT, $ATTNSERVE_PORT or 50051: "
        "the server's own port in its container)",
    )
    p.add_argument("--service", default="", help="'' for the server (default), a service or a model name")
    p.add_argument("--timeout-s", type=seconds, default=3.0, help="deadline (default 3)")
    add_connection_flags(p)


def cmd_health(args: argparse.Namespace) -> int:
    from attnserve import AttnServeError, Client

    try:
        connection = connection_from(args)
    except Refused as exc:
        print(f"attnserve health: {exc}", file=sys.stderr)
        return 2
    with Client(args.target, timeout_s=args.timeout_s, retries=False, **connection) as client:
        try:
            status = client.health(args.service)
        except AttnServeError as exc:
            detail = exc.message or (
                f"the server has no health status named {args.service!r}" if exc.code.name == "NOT_FOUND" else ""
            )
            print(f"{exc.code.name}: {detail}", file=sys.stderr)
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_infer(sub)
    _add_health(sub)
    from attnserve_bench.bench import add_parser as add_bench  # the load generator, apart from the server

    add_bench(sub)
    return parser


async def _serve(settings: Any) -> int:
    from attnserve_server.app import AttnServer
    from attnserve_server.settings import host_port

    server = AttnServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_tls)
    await server.start()
    # Everything the server keeps is loaded: later collections leave it alone (pyheap.py).
    logging.getLogger("attnserve").info("gc: %s", pyheap.settle())
    metrics_host = settings.metrics_host or settings.host
    metrics = host_port(metrics_host, server.metrics_port) if server.metrics_port is not None else "off"
    # One line on stdout for scripts (and tests) that start the server: its real ports.
    print(
        f"attnserve ready grpc={host_port(settings.host, server.port)} metrics={metrics} "
        f"models={','.join(server.models)}",
        flush=True,
    )
    signalled = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(server.failed.wait())
    await asyncio.wait((signalled, failed), return_when=asyncio.FIRST_COMPLETED)
    log = logging.getLogger("attnserve")
    log.info("shutting down: finishing accepted requests (grace %.1fs)", settings.grace_s)
    began = loop.time()
    drained = await server.stop()
    signalled.cancel()
    failed.cancel()
    code = 1 if server.failed.is_set() else 0
    answered = "every accepted request answered" if drained else "NOT every accepted request answered"
    log.info("stopped in %.1fs, %s; exit %d", loop.time() - began, answered, code)
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    from attnserve_server.errors import ConfigError
    from attnserve_server.runtime.eventloop import loop_factory
    from attnserve_server.settings import load_settings, misspelt_variables

    try:
        settings = load_settings(args.config, os.environ, vars(args))
    except ConfigError as exc:
        print(f"attnserve: configuration error: {exc}", file=sys.stderr)
        return 2
    for warning in misspelt_variables(os.environ):
        print(f"attnserve: warning: {warning}", file=sys.stderr)
    # Before torch loads (openmp.py says why), and before the edge processes start (allocator.py).
    devices = [device for model in settings.models for device in model.device]
    omp = openmp.set_defaults(os.environ, gpu=openmp.uses_gpu(devices, os.environ))
    malloc = allocator.set_defaults(os.environ)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("attnserve").info("OpenMP: %s; malloc: %s", omp, malloc)
    # Before the edge processes start, which inherit it (files.py).
    logging.getLogger("attnserve").info("open files: %s", files.raise_open_files_limit())
    try:
        name, factory = loop_factory(settings.event_loop)
        logging.getLogger("attnserve").info("event loop: %s", name)
        with asyncio.Runner(loop_factory=factory) as runner:
            code = runner.run(_serve(settings))
    except ConfigError as exc:  # weights that do not fit the config surface while loading
        print(f"attnserve: configuration error: {exc}", file=sys.stderr)
        return 2
    if code != 0:
        _exit_unfinalized(code)
    return code


def _exit_unfinalized(code: int) -> NoReturn:
    """Ends a server that failed (a model that can serve no more, an edge process that died) at once,
    its logs and output flushed. A lost model's CUDA context may be poisoned (a device-side assert, an
    illegal address, a lost GPU): then torch's tensor destructors abort the interpreter's exit (SIGABRT
    and a C++ trace, seen on an H200), and the orchestrator would read a crash instead of the exit
    status that says the server stopped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _summary(name: str, arr: Any) -> str:
    return (
        f"{name}: shape {list(arr.shape)} {arr.dtype}  mean {arr.mean():+.6f}  std {arr.std():.6f}  "
        f"min {arr.min():+.6f}  max {arr.max():+.6f}"
    )


# What every .npy file starts with (numpy.lib.format).
NPY_MAGIC = b"\x93NUMPY"


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from attnserve import AttnServeError, Client
    from attnserve._channel import DEFAULT_MAX_MESSAGE_BYTES
    from attnserve_server.errors import size_text

    rng = np.random.default_rng(args.seed)
    try:
        connection = connection_from(args)
    except Refused as exc:
        print(f"attnserve infer: {exc}", file=sys.stderr)
        return 2
    with Client(args.target, timeout_s=args.timeout_s, **connection) as client:
        try:
            info = client.model(args.model)
            dtype = None if info.dtype == "float32" else info.dtype

            def load(path: str) -> Any:
                try:
                    with open(path, "rb") as f:
                        if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
                            raise Refused(f"{path}: not a .npy file (numpy.save writes one)")
                    return np.load(path)
                except (OSError, ValueError) as exc:  # missing, unreadable, or a .npy file that is not whole
                    raise Refused(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None

            def data(path: str | None, length: int | None, width: int) -> Any:
                if path:
                    return load(path)
                if length is None:
                    return None
                nbytes = args.batch * length * width * 4
                if nbytes > DEFAULT_MAX_MESSAGE_BYTES:
                    raise Refused(
                        f"random data: {args.batch} x {length} x {width} float32 values take {size_text(nbytes)}, "
                        f"more than a message carries ({size_text(DEFAULT_MAX_MESSAGE_BYTES)}): pass a smaller "
                        "--batch, --seq-len or --kv-len"
                    )
                return rng.standard_normal((args.batch, length, width), dtype=np.float32)

            query = data(args.query, args.seq_len, info.embed_dim)
            kv_len = args.kv_len if args.kv_len is not None else (args.seq_len if info.kind == "sdpa" else None)
            fields: dict[str, Any] = {}
            if args.key_value:
                fields["key_value"] = load(args.key_value)
            elif info.kind == "sdpa" or info.kdim != info.vdim or args.key or args.value:
                fields["key"] = data(args.key, kv_len, info.kdim)
                fields["value"] = data(args.value, kv_len, info.vdim)
            elif kv_len is not None:
                fields["key_value"] = data(None, kv_len, info.kdim)
            if args.key_lengths:
                fields["key_lengths"] = list(args.key_lengths)
            result = client.attend(
                query,
                model=args.model,
                causal=args.causal,
                need_weights=args.need_weights,
                average_weights=args.average_weights,
                dtype=dtype,
                **fields,
            )
        except AttnServeError as exc:
            print(f"attnserve infer: {exc.code.name}: {exc.message}", file=sys.stderr)
            return 1
        except (Refused, ValueError) as exc:  # a file that cannot be read, an array the client cannot send
            print(f"attnserve infer: {exc}", file=sys.stderr)
            return 2
    t = result.timing
    print(f"model {result.model} ({info.kind}, E={info.embed_dim}, heads={info.num_heads}, {info.dtype})")
    print(_summary("query", np.asarray(query)))
    print(_summary("output", result.output))
    if result.attention_weights is not None:
        print(_summary("attention_weights", result.attention_weights))
    print(
        f"timing: queue {t.queue_s * 1e3:.3f} ms  compute {t.compute_s * 1e3:.3f} ms  "
        f"server {t.server_s * 1e3:.3f} ms  "
        f"batch {t.batch_size} request(s), {t.batch_sequences} sequence(s)"
    )
    if args.output:
        path = args.output if args.output.endswith(".npy") else f"{args.output}.npy"  # as np.save names it
        try:
            np.save(path, result.output)
        except OSError as exc:
            print(f"attnserve infer: --output {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"saved output to {path}")
    return 0


def _server_extra_present(command: str) -> bool:
    """`serve` and `bench` need the server extra; a client-only install says so in one line."""

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ImportError:
            return True

    missing = [m for m in ("torch", "grpc_reflection", "prometheus_client") if absent(m)]
    if missing:
        print(
            f"attnserve {command}: needs the server extra (missing: {', '.join(missing)}): "
            "pip install 'attnserve[server]'",
            file=sys.stderr,
        )
    return not missing


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "bench") and not _server_extra_present(args.command):
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "infer":
        return cmd_infer(args)
    if args.command == "health":
        return cmd_health(args)
    from attnserve_bench.bench import run as run_bench

    return run_bench(args)
