"""Typed settings: built-in defaults < config file (YAML/TOML) < ATTNSERVE_* environment < flags."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnserve_server.compute.threads import ALONE_FLOOR_MACS, MIN_SPEEDUP, SMALL_BATCH_MACS
from attnserve_server.domain import ModelKind, optional_inputs
from attnserve_server.dtypes import FLOATS
from attnserve_server.errors import ConfigError
from attnserve_server.runtime.edges import MOST_EDGES_PER_CPU, affinity_cpus
from attnserve_server.runtime.eventloop import CHOICES as EVENT_LOOPS
from attnserve_server.runtime.idle_spin import WINDOW_MS
from attnserve_server.solo import SOLO_MACS

ENV_PREFIX = "ATTNSERVE_"
# The accepted names come from the tables the server uses them with: one list of each.
DTYPES = ("auto", *FLOATS)
KINDS = tuple(kind.value for kind in ModelKind)
WEIGHT_FORMATS = ("random", "torch", "bert")
CPU_MATMULS = ("auto", "onednn", "aten")  # compute/linear.py
CPU_FUSED_BOUNDS = ("auto", "batch", "sequence")  # compute/attention.py
# Lingering's defaults (batching.py says what it is; BENCHMARKS.md, twenty-third and forty-fifth passes,
# how they were chosen).
LINGER_MACS = 16_000_000
MAX_LINGER_MS = 3.0
# With pipelining, a CPU batch of several may close at this many multiply-adds once it holds 4
# sequences (batching.py). Off by default: 400 M served L=256 at concurrency 32 1.12x more, W1 the
# same and WL 0.93-0.98x (BENCHMARKS.md, thirty-first pass).
PIPELINE_MACS = 0
# Pairing (batching.py): a CPU batch of at least twice this many multiply-adds, taken while no other
# computes, splits into two halves computing side by side on half the threads each. 400 M: W1's batches
# at concurrency 32 (~300 M) stay whole, where 100 M served 0.965x in pairs; L=256's (~1.6 G) split, 1.164x
# (BENCHMARKS.md, thirty-seventh pass).
CPU_PAIR_MACS = 400_000_000


def host_port(host: str, port: int) -> str:
    """host:port as gRPC takes it and logs show it: an IPv6 address in brackets ("[::]:50051")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# gRPC takes its channel arguments (sizes, counts, milliseconds) as C ints.
GRPC_INT_MAX = 2**31 - 1
# The longest a batch may wait for more requests (max_queue_delay_ms, max_linger_ms): a larger one made
# the first request's timer overflow and stopped the server.
MOST_WAIT_MS = 60_000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True)
class BatchingSettings:
    max_batch_size: int = 64
    max_batch_tokens: int = 65536
    max_queue_delay_ms: float = 0.0
    max_queue_size: int = 1024
    # Bytes of request tensors waiting in the queue, beside the count (README: "Memory limits").
    max_queue_bytes: int = 1 << 30
    # What one batch may take while it computes: activations and attention scores (README: "Memory limits").
    max_batch_memory_bytes: int = 2 << 30
    # A batch takes at most half the requests in play, so the loop answers one half while the worker
    # computes the other (batching.py).
    pipeline: bool = True
    # With pipelining, a CPU batch of several closes once it holds this many multiply-adds and at least
    # 4 sequences (batching.py); 0: off (the default). CUDA workers: always off.
    pipeline_macs: int = PIPELINE_MACS
    # Under load a batch of fewer multiply-adds than this waits up to max_linger_ms after its first
    # request for more (batching.py: lingering); 0 turns it off.
    linger_macs: int = LINGER_MACS
    max_linger_ms: float = MAX_LINGER_MS


@dataclass(frozen=True)
class WeightsSettings:
    # random: seeded, reproducible; torch: a torch.nn.MultiheadAttention state_dict in a
    # safetensors file; bert: a Hugging Face BERT attention block found under `prefix`.
    format: str = "random"
    path: str | None = None
    prefix: str = ""
    seed: int = 0


@dataclass(frozen=True)
class ModelSettings:
    name: str = "default"
    kind: str = "mha"
    embed_dim: int = 256
    num_heads: int = 8
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    # auto: bfloat16 where the model runs on GPUs only, float32 on the CPU (model.resolve_dtype).
    dtype: str = "auto"
    # auto: every visible GPU, else the CPU. One worker per device listed.
    device: tuple[str, ...] = ("auto",)
    max_query_len: int = 4096
    max_key_len: int = 4096
    # CUDA graphs for small unmasked self-attention batches (compute/graphs.py); ignored on the CPU.
    cuda_graphs: bool = False
    # How the CPU multiplies the projections: onednn (weights packed once), aten (torch's F.linear), or auto
    # (aten on AMD's family 25 where torch computes with AVX2 and not AVX-512, the Zen 3; onednn elsewhere):
    # compute/linear.py. Ignored on CUDA.
    cpu_matmul: str = "auto"
    # What the fused kernel's 1 MiB bound on scores applies to in an unmasked CPU self-attention batch:
    # batch (the whole batch's; larger batches take the tiled path), sequence (each sequence's alone, at
    # any batch size), or auto (batch on AMD's family 23, the Zen 2; sequence on other CPUs where torch computes
    # with AVX2 and not AVX-512; elsewhere sequence for sequences of under 48 M multiply-adds, batch for
    # larger): compute/attention.py. Ignored on CUDA.
    cpu_fused_bound: str = "auto"
    # The CPU's tiled path (masked, causal or large self-attention batches) and its explicit path (cross
    # attention, the bare operation; with or without weights) in one call into torch for a batch of several
    # sequences, and a batch's length groups in one call, a TorchScript function (compute/scripted.py);
    # false: op by op. Ignored on CUDA.
    cpu_scripted: bool = True
    # Batches a CPU worker computes at once, each on a thread of its own (Triton's instance count); with
    # more than one, each lane's batches run on cores / lanes intra-op threads unless torch_threads says.
    cpu_lanes: int = 1
    # With one CPU lane of several threads: a batch of at least twice this many multiply-adds, taken while
    # no other computes, splits in two that compute side by side, each on half the threads (batching.py,
    # pairing). 0: never.
    cpu_pair_macs: int = CPU_PAIR_MACS
    # The optional inputs requests may carry: all, none, or names among key_value, key, value,
    # key_padding_mask and key_lengths (those the kind may go without: domain.optional_inputs). The others
    # are refused and left out of KServe's metadata and config (perf_analyzer's --shared-memory takes
    # only a model without optional inputs).
    optional_inputs: tuple[str, ...] = ("all",)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    weights: WeightsSettings = field(default_factory=WeightsSettings)


# Requests one stream may have read and not yet answered and sent (edge/dispatch.py): two default
# batches (64 sequences), so that one stream alone still fills them back to back.
STREAM_WINDOW = 128


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 50051
    # 0 picks a free port; a negative port turns the metrics endpoint off.
    metrics_port: int = 9095
    metrics_host: str | None = None  # default: `host`
    # A plaintext port serving grpc.health.v1 only, for probes that speak no TLS; negative: off.
    health_port: int = -1
    metrics_tls_cert: str | None = None  # TLS on the metrics port: both files, or neither
    metrics_tls_key: str | None = None
    metrics_tls_client_ca: str | None = None  # scrapers must present a certificate it signed
    grace_s: float = 10.0
    # A batch computing longer than this means its worker is stuck: the server exits 1 at once
    # (runtime/watchdog.py); 0: never.
    worker_stall_s: float = 600.0
    max_message_bytes: int = 256 * 1024 * 1024
    # Answers owed, from admission until they have gone out, per gRPC process: past it, the connections
    # owed the most get RESOURCE_EXHAUSTED for new requests (edge/outbox.py); 0: no limit.
    max_unsent_bytes: int = 1 << 30
    # Compressed requests gRPC may take: "" (none), or a comma list of gzip and deflate. gRPC inflates a
    # message whole before the server sees it, so each compressed one may cost max_message_bytes of memory
    # for a thousandth of it on the wire.
    accept_compression: str = ""
    # Client connections a gRPC process holds at once (each idle one about 14 KiB); one past it is closed
    # as it connects (its client sees UNAVAILABLE); 0: no limit.
    max_connections: int = 10_000
    # Streams a gRPC process keeps open at once, of every service (health watches and reflection too): each
    # holds about 30 KiB while it is open; one past it is refused RESOURCE_EXHAUSTED; 0: no limit.
    max_open_streams: int = 4096
    # A stream is not read further while this many of its requests await their answers' sending.
    stream_window: int = STREAM_WINDOW
    # Each client connection is closed after about this long (gRPC's GOAWAY; calls in progress finish),
    # so that clients reconnect and reach pods added since; 0: never.
    max_connection_age_s: float = 0.0
    # The server pings a connection after this long without data, and closes it if no answer comes in 20 s:
    # it finds clients that vanished, and keeps idle connections open through NATs and load balancers.
    keepalive_s: float = 60.0
    # Clients may ping this often. gRPC's own floor is 5 minutes: a client that pings more often (many
    # keepalive guides say 10-30 s) has its connection closed, "too_many_pings", its streams with it.
    client_ping_min_s: float = 10.0
    torch_threads: int | None = None
    small_batch_macs: int = SMALL_BATCH_MACS
    # A larger CPU batch of several requests, or a lone request over ALONE_FLOOR_MACS, runs on every
    # intra-op thread only while they measure this much faster than one (compute/threads.py); 0: always.
    min_parallel_speedup: float = MIN_SPEEDUP
    # On a quiet CPU server a lone request up to this many multiply-adds runs on the event loop (solo.py).
    solo_macs: int = SOLO_MACS
    # For this long after each request, idle-priority spinners keep the CPUs from halting (idle_spin.py); 0: off.
    idle_spin_ms: float = WINDOW_MS
    # While a one-model CPU server is quiet, the loop, gRPC and the worker share a CPU, its OpenMP partners
    # have their own (cpu_layout.py); false: the kernel places every thread.
    quiet_layout: bool = True
    log_level: str = "INFO"
    # TLS on the gRPC port: both files, or neither (plaintext); a client CA requires client certificates.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Bearer tokens (README: Security): hashes in a file and/or inline; none set means no token needed.
    auth_tokens_file: str | None = None
    auth_tokens: str | None = None
    # What stays open on the gRPC port while tokens are required: health (probes), reflection (grpcurl).
    auth_open: str = "health,reflection"
    # gRPC edge processes on the one port in front of the engine process (README: Edge processes);
    # 1 serves gRPC in the engine's own process; None ("auto"): chosen at start-up (runtime/edges.py).
    edge_processes: int | None = None
    # Triton's system shared memory extension for clients on this host (edge/shared_memory.py): off, as in Triton.
    allow_client_shm: bool = False
    # float32 matrix products on CUDA in TF32 (faster, ~10 bits of mantissa): off unless asked for.
    allow_tf32: bool = False
    event_loop: str = "auto"  # auto (uvloop when installed), uvloop or asyncio: eventloop.py
    edge_arena_bytes: int = 64 * 1024 * 1024  # shared memory per edge for requests' tensors in flight
    models: tuple[ModelSettings, ...] = (ModelSettings(),)


@dataclass(frozen=True)
class Option:
    """One setting reachable as --flag and ATTNSERVE_FLAG; `scope` says where it lands."""

    flag: str
    scope: str  # server | model | batching | weights
    type: Any
    help: str

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", "server", str, "address to bind (default 0.0.0.0)"),
    Option("port", "server", int, "gRPC port; 0 picks a free one (default 50051)"),
    Option("metrics-port", "server", int, "Prometheus port; 0 picks a free one, -1 disables (default 9095)"),
    Option("metrics-host", "server", str, "address the metrics endpoint binds (default: --host)"),
    Option("health-port", "server", int, "plaintext port with grpc.health.v1 only, for probes (default -1: off)"),
    Option("metrics-tls-cert", "server", str, "PEM certificate for TLS on the metrics port (default: plain HTTP)"),
    Option("metrics-tls-key", "server", str, "PEM private key of --metrics-tls-cert"),
    Option("metrics-tls-client-ca", "server", str, "PEM CA that scrapers' client certificates must chain to"),
    Option("grace-s", "server", float, "seconds to finish accepted requests on SIGTERM (default 10)"),
    Option(
        "worker-stall-s",
        "server",
        float,
        "a batch computing longer than this means its worker is stuck: the server logs it and exits 1 at once,"
        " for the orchestrator to restart it; 0: never (default 600)",
    ),
    Option("max-message-bytes", "server", int, "largest gRPC message in either direction (default 256 MiB)"),
    Option(
        "max-unsent-bytes",
        "server",
        int,
        "bytes of answers a gRPC process owes, from their requests' admission until they have gone out; past it,"
        " new requests on the connections owed the most are refused RESOURCE_EXHAUSTED (in band on a stream)"
        " until their clients read; 0: no limit (default 1 GiB)",
    ),
    Option(
        "accept-compression",
        "server",
        str,
        "compressed requests accepted: gzip, deflate, a comma list of both, or '' (default: none; a compressed"
        " request is refused UNIMPLEMENTED). gRPC inflates each whole, up to --max-message-bytes, before the"
        " server sees it: a few KiB on the wire can cost that much memory",
    ),
    Option(
        "max-connections",
        "server",
        int,
        "client connections a gRPC process holds at once, each idle one about 14 KiB; one past it is closed as"
        " it connects (its client sees UNAVAILABLE, and may retry or reach another replica); 0: no limit"
        " (default 10000)",
    ),
    Option(
        "max-open-streams",
        "server",
        int,
        "streams a gRPC process keeps open at once, of every service (health watches too); each holds about"
        " 30 KiB; one past it is refused RESOURCE_EXHAUSTED as it opens; 0: no limit (default 4096)",
    ),
    Option(
        "stream-window",
        "server",
        int,
        "requests one stream may have read and not yet answered and sent; past it the server reads no more of"
        " that stream until an answer goes out, and HTTP/2 flow control holds the client's sends"
        f" (default {STREAM_WINDOW})",
    ),
    Option(
        "max-connection-age-s",
        "server",
        float,
        "close each client connection after about this many seconds (gRPC's GOAWAY, +-10%%; calls in progress,"
        " streams included, finish on it), so that clients reconnect and spread over replicas added since; 0:"
        " never (default 0)",
    ),
    Option(
        "keepalive-s",
        "server",
        float,
        "ping a connection after this many seconds without data, and close it if no answer comes in 20 s;"
        " 0: gRPC's default, 2 hours (default 60)",
    ),
    Option(
        "client-ping-min-s",
        "server",
        float,
        "the shortest interval between a client's keepalive pings the server accepts; a client that pings"
        " more often has its connection closed (gRPC's own default: 300) (default 10)",
    ),
    Option("torch-threads", "server", int, "torch intra-op threads for CPU workers (default: torch's)"),
    Option(
        "small-batch-macs",
        "server",
        int,
        "a CPU batch of several requests with fewer multiply-adds runs on one intra-op thread, and so does such"
        f" a lone request that comes amid batches of several; 0 turns this off (default {SMALL_BATCH_MACS})",
    ),
    Option(
        "min-parallel-speedup",
        "server",
        float,
        "a larger CPU batch of several requests, or a lone request over"
        f" {ALONE_FLOOR_MACS // 1_000_000} M multiply-adds, runs on every intra-op thread only while they"
        " compute such batches at least this many times faster than one thread, as measured; 0: always"
        " every thread"
        f" (default {MIN_SPEEDUP})",
    ),
    Option(
        "solo-macs",
        "server",
        int,
        "on a quiet server with one CPU worker, a lone request with at most this many multiply-adds that runs on"
        f" one intra-op thread runs on the event loop, sparing two thread hops; 0 turns this off (default {SOLO_MACS})",
    ),
    Option(
        "idle-spin-ms",
        "server",
        float,
        "for this long after each request, a spinner per CPU at idle priority keeps the CPUs from halting, so"
        " that waking a thread costs no vCPU wake-up; off by itself under a CPU quota below the CPUs; 0 turns"
        f" it off (default {WINDOW_MS:g})",
    ),
    Option(
        "quiet-layout",
        "server",
        bool,
        "while a server with one model on one CPU worker is quiet, the event loop, gRPC's threads and the worker"
        " share one CPU and the worker's OpenMP partners have CPUs of their own; under load every thread is free;"
        " true or false (default true)",
    ),
    Option(
        "allow-client-shm",
        "server",
        bool,
        "serve Triton's system shared memory extension: clients on this host register POSIX shared memory"
        " regions and send tensors and take answers through them instead of in messages; a client that may"
        " register one makes the server read and write a shared memory object of its naming, so only for"
        " clients trusted as the server's user; true or false (default false)",
    ),
    Option("log-level", "server", str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    Option("tls-cert", "server", str, "PEM certificate (chain) for TLS on the gRPC port (default: plaintext)"),
    Option("tls-key", "server", str, "PEM private key of --tls-cert"),
    Option("tls-client-ca", "server", str, "PEM CA that client certificates must chain to: mTLS (default: none)"),
    Option("auth-tokens-file", "server", str, "file of token hashes and their models: bearer tokens required"),
    Option("auth-tokens", "server", str, "token hashes and their models inline, ';' between entries"),
    Option(
        "auth-open",
        "server",
        str,
        "services open without a token when tokens are required: health, reflection, both (default), or ''",
    ),
    Option(
        "edge-processes",
        "server",
        str,
        "gRPC edge processes sharing the port in front of one engine process; 1: one process; auto: with a "
        "model that may run on a GPU one per 4 CPUs, at most 4, else 1 (default auto)",
    ),
    Option("event-loop", "server", str, "auto (uvloop when installed), uvloop or asyncio (default auto)"),
    Option("allow-tf32", "server", bool, "float32 models on CUDA multiply in TF32, true or false (default false)"),
    Option("edge-arena-bytes", "server", int, "shared memory per edge process for tensors in flight (default 64 MiB)"),
    Option("model-name", "model", str, "name of the model (default 'default')"),
    Option("kind", "model", str, "mha (learned projections) or sdpa (bare attention) (default mha)"),
    Option("embed-dim", "model", int, "embedding width E (default 256)"),
    Option("num-heads", "model", int, "attention heads h; E must divide by h (default 8)"),
    Option("kdim", "model", int, "key input width (default E)"),
    Option("vdim", "model", int, "value input width (default E)"),
    Option("bias", "model", bool, "projection biases, true or false (default true)"),
    Option(
        "dtype",
        "model",
        str,
        "auto (bfloat16 on GPUs, float32 on the CPU), float32, float16 or bfloat16 (default auto)",
    ),
    Option("device", "model", str, "auto, cpu, cuda, cuda:N, or a comma list: one worker each (default auto)"),
    Option("cuda-graphs", "model", bool, "replay small unmasked batches as CUDA graphs, true or false (default false)"),
    Option(
        "cpu-matmul",
        "model",
        str,
        "how the CPU multiplies the projections: onednn (weights packed once), aten (torch's own), or auto "
        "(aten on an AMD family 25 CPU without AVX-512, the Zen 3; onednn elsewhere) (default auto)",
    ),
    Option(
        "cpu-fused-bound",
        "model",
        str,
        "what the CPU's fused attention kernel's 1 MiB bound on scores applies to: batch (a larger batch takes the"
        " tiled path), sequence (any batch size), or auto (batch on AMD's family 23, the Zen 2; sequence on other"
        " CPUs where torch computes with AVX2 and not AVX-512; elsewhere sequence for sequences of under 48 M"
        " multiply-adds, batch for larger) (default auto)",
    ),
    Option(
        "cpu-scripted",
        "model",
        bool,
        "the CPU's attention paths other than the fused kernel (masked, causal or large self-attention batches;"
        " cross attention, the bare operation) in one call into torch a batch, and a batch's length groups in one"
        " call, a TorchScript function, true or false (op by op) (default true)",
    ),
    Option(
        "cpu-lanes",
        "model",
        int,
        "batches a CPU worker computes at once, each on its own thread, as Triton's instance count (default 1)",
    ),
    Option(
        "cpu-pair-macs",
        "model",
        int,
        "with one CPU lane: a batch of at least twice this many multiply-adds, taken while no other computes,"
        f" splits into two that compute side by side on half the threads each; 0: never (default {CPU_PAIR_MACS})",
    ),
    Option(
        "optional-inputs",
        "model",
        str,
        "the optional inputs requests may carry: all, none, or a comma list of key_value, key, value,"
        " key_padding_mask, key_lengths; the others are refused and not listed in KServe metadata (default all)",
    ),
    Option("max-query-len", "model", int, "longest query sequence L accepted (default 4096)"),
    Option("max-key-len", "model", int, "longest key sequence S accepted (default 4096)"),
    Option("max-batch-size", "batching", int, "sequences in one batch (default 64)"),
    Option("max-batch-tokens", "batching", int, "padded query tokens in one batch (default 65536)"),
    Option("max-queue-delay-ms", "batching", float, "wait after a batch's first request (default 0)"),
    Option("max-queue-size", "batching", int, "queued requests before RESOURCE_EXHAUSTED (default 1024)"),
    Option("max-queue-bytes", "batching", int, "queued tensor bytes before RESOURCE_EXHAUSTED (default 1 GiB)"),
    Option(
        "max-batch-memory-bytes",
        "batching",
        int,
        "estimated memory one batch may use while it computes; larger requests are refused (default 2 GiB)",
    ),
    Option(
        "pipeline",
        "batching",
        bool,
        "true: a batch takes at most half the requests in play (those the last batch answered plus those"
        " waiting), so answering one half overlaps computing the other; false: all that fit (default true)",
    ),
    Option(
        "pipeline-macs",
        "batching",
        int,
        "with --pipeline, a CPU batch of several requests also closes once it holds this many"
        " multiply-adds and at least 4 sequences (400000000 served L=256 at concurrency 32 1.12x more"
        " on 2 cores, WL 0.93-0.98x); 0: off; never on CUDA"
        f" (default {PIPELINE_MACS})",
    ),
    Option(
        "linger-macs",
        "batching",
        int,
        "under load (requests arrived while the last batch computed), a batch of fewer multiply-adds than"
        " this waits up to --max-linger-ms after its first request for more; 0 turns it off"
        f" (default {LINGER_MACS})",
    ),
    Option(
        "max-linger-ms",
        "batching",
        float,
        "the longest a batch lingers, counted from its first request; it stops sooner once every request in"
        f" play is in (default {MAX_LINGER_MS:g})",
    ),
    Option("weights", "weights", str, "weights file (safetensors); default: seeded random"),
    Option("weights-format", "weights", str, "torch or bert (default torch when --weights is given)"),
    Option(
        "weights-prefix",
        "weights",
        str,
        "key prefix of a BERT attention block, e.g. encoder.layer.0.attention",
    ),
    Option("seed", "weights", int, "seed of random weights (default 0)"),
)
# Option dest -> dataclass field where they differ.
_FIELD = {"model_name": "name", "weights": "path", "weights_format": "format", "weights_prefix": "prefix"}


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:
        raise ConfigError(f"config file {path}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return data


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (inner is int and isinstance(value, str) and value.strip().lower() == "auto"):
            return None  # an optional count's None is its automatic choice (edge_processes, torch_threads)
        try:
            return _convert(value, inner, where)
        except ConfigError:
            if inner is not int:
                raise
            raise ConfigError(f"{where}: expected auto or an integer, got {value!r}") from None
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{where}: expected a name or a list, got {value!r}")
        return tuple(str(item).strip() for item in items)  # (empty: validate() says where that is wrong)
    try:
        if hint is bool:
            return value if isinstance(value, bool) else parse_bool(str(value))
        if hint is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, list | dict):  # str() would take them as they print
            raise ValueError(f"expected {_KIND_NAMES.get(hint, hint.__name__)}, got {value!r}")
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        return hint(value)
    except (TypeError, ValueError):  # int()'s and float()'s own words name neither the kind nor the setting
        raise ConfigError(f"{where}: expected {_KIND_NAMES.get(hint, hint.__name__)}, got {value!r}") from None


def _closest(name: str, known) -> str:
    match = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


def _build(cls: Any, data: Any, where: str) -> Any:
    """`where` is the mapping's path with a trailing dot ("" at the top level, "models[0]." below)."""
    at = where.rstrip(".") or "top level"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{at}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{at}: unknown setting {unknown[0]!r}{_closest(unknown[0], names)} (known: {', '.join(sorted(names))})"
        )
    values = {}
    for key, raw in data.items():
        if cls is ServerSettings and key == "models":
            if not isinstance(raw, list) or not raw:
                raise ConfigError(f"{where}models: expected a non-empty list of models")
            values[key] = tuple(_build(ModelSettings, m, f"{where}models[{i}].") for i, m in enumerate(raw))
        else:
            values[key] = _convert(raw, hints[key], f"{where}{key}")
    return cls(**values)


# ATTNSERVE_* variables that are not settings: the dev script's and the tests' own.
_NOT_SETTINGS = {
    "ATTNSERVE_VENV",
    "ATTNSERVE_TORCH",
    "ATTNSERVE_TEST_DEVICE",
    "ATTNSERVE_TEST_EDGES",
    "ATTNSERVE_TEST_LOOP",
    "ATTNSERVE_ARGS",
    "ATTNSERVE_TOKEN",
}


def misspelt_variables(env: Mapping[str, str]) -> list[str]:
    """A warning for each ATTNSERVE_* variable that is no setting (it would be ignored silently)."""
    known = {opt.env for opt in OPTIONS} | {ENV_PREFIX + "CONFIG"}
    return [
        f"{name} is not an attnserve setting and is ignored{_closest(name, known)}"
        for name in sorted(env)
        if name.startswith(ENV_PREFIX) and name not in known and name not in _NOT_SETTINGS
    ]


def _overrides(env: Mapping[str, str], flags: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Settings given by environment and flags, grouped by scope; flags win."""
    scoped: dict[str, dict[str, Any]] = {"server": {}, "model": {}, "batching": {}, "weights": {}}
    for opt in OPTIONS:
        raw = flags.get(opt.dest)
        if raw is None and opt.env in env:
            raw = env[opt.env]
            where = opt.env
        else:
            where = f"--{opt.flag}"
        if raw is not None:
            scoped[opt.scope][_FIELD.get(opt.dest, opt.dest)] = (raw, where)
    return scoped


def _apply(obj: Any, overrides: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(type(obj))
    changes = {name: _convert(raw, hints[name], where) for name, (raw, where) in overrides.items()}
    return dataclasses.replace(obj, **changes)


def load_settings(
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ServerSettings:
    """Builds and validates the settings. Flags and environment apply to every model."""
    env = {} if env is None else env
    flags = flags or {}
    path = config_path or env.get(ENV_PREFIX + "CONFIG")
    settings = ServerSettings()
    if path:
        try:
            settings = _build(ServerSettings, _read_file(Path(path)), "")
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(
                message if message.startswith("config file") else f"config file {path}: {message}"
            ) from None
    scoped = _overrides(env, flags)
    if scoped["weights"].get("path") and "format" not in scoped["weights"]:
        scoped["weights"]["format"] = ("torch", "--weights")
    models = tuple(
        dataclasses.replace(
            _apply(m, scoped["model"]),
            batching=_apply(m.batching, scoped["batching"]),
            weights=_apply(m.weights, scoped["weights"]),
        )
        for m in settings.models
    )
    settings = dataclasses.replace(_apply(settings, scoped["server"]), models=models)
    validate(settings)
    return settings


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(settings: ServerSettings) -> None:
    _check(0 <= settings.port <= 65535, f"port: expected 0..65535, got {settings.port}")
    for name in ("host", "metrics_host"):
        value = getattr(settings, name)
        _check(
            value is None or not value.startswith("["),
            f"{name}: expected an address without brackets (an IPv6 one as ::1), got {value!r}",
        )
    _check(
        (settings.tls_cert is None) == (settings.tls_key is None),
        "tls_cert, tls_key: give both (TLS) or neither (plaintext)",
    )
    _check(settings.tls_client_ca is None or settings.tls_cert is not None, "tls_client_ca: needs tls_cert and tls_key")
    unknown = sorted({s.strip() for s in settings.auth_open.split(",") if s.strip()} - {"health", "reflection"})
    _check(not unknown, f"auth_open: expected health, reflection or both, got {unknown[0] if unknown else ''!r}")
    _check(
        (settings.metrics_tls_cert is None) == (settings.metrics_tls_key is None),
        "metrics_tls_cert, metrics_tls_key: give both (HTTPS) or neither (HTTP)",
    )
    _check(
        settings.metrics_tls_client_ca is None or settings.metrics_tls_cert is not None,
        "metrics_tls_client_ca: needs metrics_tls_cert and metrics_tls_key",
    )
    for name in ("metrics_port", "health_port"):  # -1: off
        value = getattr(settings, name)
        _check(-1 <= value <= 65535, f"{name}: expected -1 (off) or 0..65535, got {value}")
    _check(bool(settings.host), "host: expected an address to bind (0.0.0.0 for every IPv4 one, :: for every one)")
    _check(settings.grace_s >= 0, f"grace_s: expected >= 0, got {settings.grace_s}")
    _check(
        math.isfinite(settings.worker_stall_s) and settings.worker_stall_s >= 0,
        f"worker_stall_s: expected >= 0, got {settings.worker_stall_s}",
    )
    cpus = affinity_cpus()
    _check(  # past the CPUs: OpenMP only contends, and past the thread limit it aborts the process
        settings.torch_threads is None or 1 <= settings.torch_threads <= cpus,
        f"torch_threads: expected 1..{cpus} (the CPUs this process may run on), got {settings.torch_threads}",
    )
    _check(settings.small_batch_macs >= 0, f"small_batch_macs: expected >= 0, got {settings.small_batch_macs}")
    _check(
        settings.min_parallel_speedup == 0 or settings.min_parallel_speedup >= 1,
        f"min_parallel_speedup: expected 0 or >= 1, got {settings.min_parallel_speedup}",
    )
    _check(settings.solo_macs >= 0, f"solo_macs: expected >= 0, got {settings.solo_macs}")
    _check(
        math.isfinite(settings.idle_spin_ms) and settings.idle_spin_ms >= 0,
        f"idle_spin_ms: expected >= 0, got {settings.idle_spin_ms}",
    )
    _check(
        0 < settings.max_message_bytes <= GRPC_INT_MAX,
        f"max_message_bytes: expected 1..{GRPC_INT_MAX} (gRPC's most), got {settings.max_message_bytes}",
    )
    _check(settings.max_unsent_bytes >= 0, f"max_unsent_bytes: expected >= 0, got {settings.max_unsent_bytes}")
    _check(
        0 <= settings.max_connections <= GRPC_INT_MAX,
        f"max_connections: expected 0..{GRPC_INT_MAX}, got {settings.max_connections}",
    )
    _check(settings.max_open_streams >= 0, f"max_open_streams: expected >= 0, got {settings.max_open_streams}")
    unknown = sorted(set(compression_names(settings.accept_compression)) - set(COMPRESSION_ALGORITHMS))
    got = unknown[0] if unknown else ""
    _check(not unknown, f"accept_compression: expected gzip, deflate, a comma list of both or '', got {got!r}")
    _check(settings.stream_window >= 1, f"stream_window: expected >= 1, got {settings.stream_window}")
    for name in ("max_connection_age_s", "keepalive_s", "client_ping_min_s"):
        value = getattr(settings, name)
        _check(
            math.isfinite(value) and 0 <= value <= GRPC_INT_MAX // 1000,
            f"{name}: expected 0..{GRPC_INT_MAX // 1000} seconds (gRPC counts milliseconds in a 32-bit integer), "
            f"got {value}",
        )
    _check(
        settings.event_loop in EVENT_LOOPS,
        f"event_loop: expected one of {', '.join(EVENT_LOOPS)}, got {settings.event_loop!r}",
    )
    _check(
        settings.edge_processes is None or settings.edge_processes >= 1,
        f"edge_processes: expected auto or >= 1, got {settings.edge_processes}",
    )
    most = MOST_EDGES_PER_CPU * cpus
    _check(
        settings.edge_processes is None or settings.edge_processes <= most,
        f"edge_processes: expected auto or 1..{most} ({MOST_EDGES_PER_CPU} per CPU this process may run on), "
        f"got {settings.edge_processes}",
    )
    _check(
        settings.edge_arena_bytes >= 1 << 20, f"edge_arena_bytes: expected >= 1048576, got {settings.edge_arena_bytes}"
    )
    _check(
        settings.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
        f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {settings.log_level!r}",
    )
    seen: set[str] = set()
    for i, m in enumerate(settings.models):
        at = f"models[{i}] ({m.name!r})"
        _check(
            bool(_NAME_RE.match(m.name)),
            f"{at}.name: expected letters, digits, '_', '.', '-', got {m.name!r}",
        )
        _check(m.name not in seen, f"{at}.name: duplicate model name")
        seen.add(m.name)
        _check(m.kind in KINDS, f"{at}.kind: expected one of {KINDS}, got {m.kind!r}")
        _check(m.dtype in DTYPES, f"{at}.dtype: expected one of {DTYPES}, got {m.dtype!r}")
        _check(
            m.cpu_matmul in CPU_MATMULS,
            f"{at}.cpu_matmul: expected one of {', '.join(CPU_MATMULS)}, got {m.cpu_matmul!r}",
        )
        _check(
            m.cpu_fused_bound in CPU_FUSED_BOUNDS,
            f"{at}.cpu_fused_bound: expected one of {', '.join(CPU_FUSED_BOUNDS)}, got {m.cpu_fused_bound!r}",
        )
        _check(  # a lane is a thread computing on at least one CPU; 10**20 of them never finished starting
            1 <= m.cpu_lanes <= cpus,
            f"{at}.cpu_lanes: expected 1..{cpus} (the CPUs this process may run on), got {m.cpu_lanes}",
        )
        _check(m.cpu_pair_macs >= 0, f"{at}.cpu_pair_macs: expected >= 0, got {m.cpu_pair_macs}")
        _check(m.embed_dim > 0 and m.num_heads > 0, f"{at}: embed_dim and num_heads must be positive")
        _check(
            m.embed_dim % m.num_heads == 0,
            f"{at}.embed_dim: {m.embed_dim} is not divisible by num_heads {m.num_heads}",
        )
        for name in ("kdim", "vdim"):
            dim = getattr(m, name)
            _check(dim is None or dim > 0, f"{at}.{name}: expected a positive width, got {dim}")
        if m.kind == "sdpa":
            _check(
                m.kdim in (None, m.embed_dim),
                f"{at}.kdim: the bare operation needs kdim == embed_dim ({m.embed_dim}), got {m.kdim}",
            )
            vdim = m.vdim or m.embed_dim
            _check(vdim % m.num_heads == 0, f"{at}.vdim: {vdim} is not divisible by num_heads {m.num_heads}")
            _check(m.weights.format == "random", f"{at}.weights: the bare operation has no weights to load")
        _check(bool(m.device), f"{at}.device: expected at least one device, got none")
        for dev in m.device:
            _check(bool(_DEVICE_RE.match(dev)), f"{at}.device: expected auto, cpu, cuda or cuda:N, got {dev!r}")
        _check_optional_inputs(m, at)
        _check(m.max_query_len > 0 and m.max_key_len > 0, f"{at}: max_query_len and max_key_len must be positive")
        b = m.batching
        _check(b.max_batch_size > 0, f"{at}.batching.max_batch_size: expected > 0, got {b.max_batch_size}")
        _check(b.max_queue_size > 0, f"{at}.batching.max_queue_size: expected > 0, got {b.max_queue_size}")
        _check(
            0 <= b.max_queue_delay_ms <= MOST_WAIT_MS,
            f"{at}.batching.max_queue_delay_ms: expected 0..{MOST_WAIT_MS} (a minute), got {b.max_queue_delay_ms}",
        )
        _check(b.linger_macs >= 0, f"{at}.batching.linger_macs: expected >= 0, got {b.linger_macs}")
        _check(b.pipeline_macs >= 0, f"{at}.batching.pipeline_macs: expected >= 0, got {b.pipeline_macs}")
        _check(
            0 <= b.max_linger_ms <= MOST_WAIT_MS,
            f"{at}.batching.max_linger_ms: expected 0..{MOST_WAIT_MS} (a minute), got {b.max_linger_ms}",
        )
        _check(b.max_queue_bytes > 0, f"{at}.batching.max_queue_bytes: expected > 0, got {b.max_queue_bytes}")
        _check(
            b.max_batch_memory_bytes > 0,
            f"{at}.batching.max_batch_memory_bytes: expected > 0, got {b.max_batch_memory_bytes}",
        )
        _check(
            b.max_batch_tokens >= m.max_query_len,
            f"{at}.batching.max_batch_tokens: {b.max_batch_tokens} cannot hold one sequence of "
            f"max_query_len {m.max_query_len}",
        )
        w = m.weights
        _check(  # torch.manual_seed's range
            -(2**63) <= w.seed < 2**64, f"{at}.weights.seed: expected {-(2**63)}..{2**64 - 1}, got {w.seed}"
        )
        _check(
            w.format in WEIGHT_FORMATS,
            f"{at}.weights.format: expected one of {WEIGHT_FORMATS}, got {w.format!r}",
        )
        _check(w.format == "random" or bool(w.path), f"{at}.weights.path: format {w.format!r} needs a file")
        _check(w.format != "bert" or bool(w.prefix), f"{at}.weights.prefix: format 'bert' needs a key prefix")


# gRPC's compression algorithms by name: their bits in grpc.compression_enabled_algorithms_bitset
# (grpc_compression_algorithm: 0 identity, 1 deflate, 2 gzip).
COMPRESSION_ALGORITHMS = {"deflate": 1, "gzip": 2}


def compression_names(accept: str) -> tuple[str, ...]:
    """`accept_compression` as names, in the order given."""
    return tuple(name.strip() for name in accept.split(",") if name.strip())


def compression_bitset(accept: str) -> int:
    """grpc.compression_enabled_algorithms_bitset for `accept_compression`: identity, and the names."""
    return 1 | sum(1 << COMPRESSION_ALGORITHMS[name] for name in set(compression_names(accept)))


def optional_inputs_kept(m: ModelSettings) -> tuple[str, ...] | None:
    """The model's optional_inputs as names (None: all)."""
    if m.optional_inputs == ("all",):
        return None
    return () if m.optional_inputs == ("none",) else m.optional_inputs


def _check_optional_inputs(m: ModelSettings, at: str) -> None:
    e = m.embed_dim
    kdim, vdim = m.kdim or e, m.vdim or e
    allowed = optional_inputs(ModelKind(m.kind), kdim, vdim)
    names = m.optional_inputs
    where = f"{at}.optional_inputs"
    if len(names) > 1:
        _check("all" not in names and "none" not in names, f"{where}: 'all' and 'none' stand alone, got {names}")
    for name in names:
        _check(
            name in ("all", "none", *allowed),
            f"{where}: expected all, none or names among {', '.join(allowed)} (the inputs model {m.name!r}"
            f" may go without), got {name!r}",
        )
    kept = optional_inputs_kept(m)
    if kept is None:
        return
    _check(("key" in kept) == ("value" in kept), f"{where}: key and value go together, got {', '.join(kept)}")
    if "key_value" in allowed and not (kdim == vdim == e and m.kind == "mha"):
        # No self attention: every request needs key_value or key and value.
        _check(
            "key_value" in kept or "key" in kept,
            f"{where}: model {m.name!r} (kdim {kdim}, vdim {vdim}, embed_dim {e}) needs key_value or key and"
            f" value in every request; keep one of them, got {', '.join(kept) or 'none'}",
        )
