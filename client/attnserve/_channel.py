"""Channel settings shared by both clients: targets, message limits, load balancing, retries."""

from __future__ import annotations

import ipaddress
import json
import math
import socket
from collections.abc import Sequence

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# Matches the server's default, so real tensors (and attention matrices) fit.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# HTTP/2 lets a peer send only this much on a stream before the receiver acknowledges it. gRPC's
# default (64 KiB) costs a megabyte answer several round trips: measured on loopback, 1 MiB each way
# took 12.7 ms at the default and 8.6 ms with 16 MiB.
STREAM_LOOKAHEAD_BYTES = 16 * 1024 * 1024

# UNAVAILABLE: a server that is starting, draining or gone (retried on the next address). CANCELLED
# from a server: a call that reached it just as gRPC itself stopped, before any handler took it. gRPC
# core cancels those rather than answering UNAVAILABLE (grpc/grpc#41785); the server answers every
# call it still sees UNAVAILABLE for 0.25 s first, which narrows that window but cannot close it.
# Both are safe to send again: an attention call changes nothing on the server. gRPC never retries a
# call the caller cancelled or whose deadline passed.
_RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.05s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
}


_URI_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds")


def _split_host_port(address: str) -> tuple[str, str]:
    """An address's host (an IPv6 one without its brackets) and port, checked here: gRPC takes a URL
    ("http://host:port") for a host name that fails to resolve, a missing port for 443, and a port past
    65535 for a target it cannot build, each found only when a call fails."""
    address = address.strip()
    if "://" in address:
        scheme = address.split("://", 1)[0]
        raise ValueError(
            f"target: expected host:port, got {address!r}, a URL: drop {scheme + '://'!r} "
            "(TLS is the client's tls=True, the commands' --tls: not a scheme)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target: expected host:port with a port in 1..65535, got {address!r}")
    return host.strip("[]"), port


def resolve_target(target: str | Sequence[str]) -> str:
    """A gRPC target for one address, a target URI, or several addresses to balance over.

    A single "host:port" or URI ("dns:///attnserve-headless:50051", "ipv4:...", "unix:...")
    passes through. Several addresses (a list, or one string with commas) become one
    "ipv4:" or "ipv6:" target, which gRPC balances round-robin; host names among them are
    resolved here, once (for membership that changes, give a dns:/// name instead).
    """
    if isinstance(target, str) and target.split(":", 1)[0] in _URI_SCHEMES:
        return target  # gRPC's own syntax, e.g. "ipv4:10.0.0.1:50051,10.0.0.2:50051"
    addresses = target.split(",") if isinstance(target, str) else list(target)
    if not addresses or not all(a.strip() for a in addresses):
        raise ValueError(f"target: expected an address, a target URI or several addresses, got {target!r}")
    if len(addresses) == 1:
        _split_host_port(addresses[0])
        return addresses[0].strip()
    v4: list[str] = []
    v6: list[str] = []
    for address in addresses:
        host, port = _split_host_port(address)
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ValueError(f"target: cannot resolve {host!r} in {address.strip()!r} ({exc.strerror})") from None
            ips = [ipaddress.ip_address(info[4][0]) for info in infos]
        for ip in dict.fromkeys(ips):
            (v4 if ip.version == 4 else v6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    # One URI holds one address family: IPv4 when there is any, as most clusters are.
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


def channel_options(
    max_message_bytes: int, retries: bool, keepalive_s: float | None = None
) -> list[tuple[str, object]]:
    """gRPC channel options: message limits, round-robin over every address the target resolves to,
    and, when enabled, UNAVAILABLE (and a server's CANCELLED) retried by gRPC itself (on the next
    address); with `keepalive_s`, keepalive pings while calls are in flight (see Client)."""
    if (
        isinstance(max_message_bytes, bool)
        or not isinstance(max_message_bytes, int)
        or not 0 < max_message_bytes < 2**31
    ):
        # gRPC takes it as a C int: past it, an OverflowError; 0 or below, every message refused, or none
        raise ValueError(f"max_message_bytes: expected 1..{2**31 - 1} (gRPC's most), got {max_message_bytes!r}")
    if keepalive_s is not None and not (math.isfinite(keepalive_s) and keepalive_s > 0):
        raise ValueError(f"keepalive_s: expected a number of seconds > 0, got {keepalive_s!r}")
    options: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1 if retries else 0),
        ("grpc.http2.lookahead_bytes", min(max_message_bytes, STREAM_LOOKAHEAD_BYTES)),
        # Each client its own connections: gRPC otherwise shares one per address among all channels
        # of a process, and a server with edge processes spreads load by connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if keepalive_s is not None:
        # A ping after keepalive_s without data while a call is open; one unanswered for keepalive_s
        # closes the connection, failing its calls UNAVAILABLE. No pings while no call is open.
        ms = max(1, round(keepalive_s * 1000))
        options += [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),  # any ping: a keepalive waits on one already in flight
            ("grpc.http2.max_pings_without_data", 0),  # gRPC's default stops after two on an idle stream
        ]
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retries:
        config["methodConfig"] = [
            {
                "name": [
                    {"service": "attnserve.v1.AttentionService"},
                    {"service": "grpc.health.v1.Health"},
                ],
                "retryPolicy": _RETRY_POLICY,
            }
        ]
    options.append(("grpc.service_config", json.dumps(config)))
    return options


def channel_credentials(
    tls: bool, ca: str | None, cert: str | None, key: str | None, credentials: grpc.ChannelCredentials | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files: `ca` to trust (default: the system's roots), and `cert` with
    `key` to present a client certificate (mTLS). Any of them implies TLS; None means plaintext."""
    if credentials is not None:
        return credentials
    if not (tls or ca or cert or key):
        return None
    if (cert is None) != (key is None):
        raise ValueError("cert, key: a client certificate needs both")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def deadline_seconds(timeout_s: float | None) -> float | None:
    """A call's timeout as gRPC takes it: None or infinity is no deadline (gRPC takes infinity for one
    already passed); zero, a negative number or NaN is a mistake, refused here rather than sent as a call
    that fails DEADLINE_EXCEEDED at once."""
    if timeout_s is None or timeout_s == math.inf:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s: expected seconds (a number) or None, got {type(timeout_s).__name__}")
    if not timeout_s > 0:  # NaN too
        raise ValueError(f"timeout_s: expected a number of seconds > 0, or None for no deadline, got {timeout_s!r}")
    return float(timeout_s)


class CallDefaults:
    """The per-call arguments both clients add: the default deadline, wait_for_ready, the bearer
    token (sent as `authorization` metadata, as tritonclient's headers are), and with `trace` the
    current OpenTelemetry context as W3C `traceparent` metadata, so the server's spans join the trace."""

    def __init__(self, timeout_s: float | None, wait_for_ready: bool, token: str | None = None, trace: bool = False):
        self.timeout_s = deadline_seconds(timeout_s)
        self.wait_for_ready = wait_for_ready
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._inject = None
        if trace:
            try:
                from opentelemetry.propagate import inject
            except ImportError as exc:
                raise ImportError("trace=True needs OpenTelemetry: pip install opentelemetry-api") from exc
            self._inject = inject

    def __call__(self, timeout_s: float | None) -> dict[str, object]:
        metadata = self._metadata
        if self._inject is not None:
            carrier: dict[str, str] = {}
            self._inject(carrier)
            metadata = (*(metadata or ()), *carrier.items())
        return {
            "timeout": self.timeout_s if timeout_s is None else deadline_seconds(timeout_s),
            "wait_for_ready": self.wait_for_ready,
            "metadata": metadata,
        }
