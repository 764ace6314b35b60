"""Client-side load balancing: several addresses, round-robin, a server that leaves mid-run, and how long
connections live: aged out by the server, kept by clients' keepalive pings."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import queue
import re
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from attnserve import AsyncClient, AttnServeError, Client
from attnserve._channel import resolve_target
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve_server.connect import target as target_argument

from conftest import Running, model, running, settings

E = 16


def served(handle: Running) -> float:
    return handle.sample("attnserve_requests_total", model="default", method="Attend", code="OK")


def test_several_addresses_become_one_balanced_target() -> None:
    assert resolve_target("10.0.0.1:50051") == "10.0.0.1:50051"
    assert resolve_target("dns:///attnserve-headless.ml.svc:50051") == "dns:///attnserve-headless.ml.svc:50051"
    assert resolve_target(["10.0.0.1:1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert resolve_target("ipv4:10.0.0.1:1,10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"  # gRPC's own form
    assert resolve_target("10.0.0.1:1, 10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert resolve_target(["[::1]:1", "[::2]:2"]) == "ipv6:[::1]:1,[::2]:2"
    assert resolve_target(["localhost:7", "127.0.0.1:8"]).startswith("ipv4:127.0.0.1:7,")
    with pytest.raises(ValueError, match="expected host:port"):
        resolve_target(["10.0.0.1", "10.0.0.2:2"])


@pytest.mark.parametrize(
    "target, message",
    [
        # Before, gRPC took each for something else, found only when a call failed: a host name that did
        # not resolve, port 443, a target it could not build (UNKNOWN and an error logged), or a raw
        # socket.gaierror from the client's constructor.
        ("http://127.0.0.1:50051", "expected host:port, got 'http://127.0.0.1:50051', a URL: drop 'http://'"),
        ("127.0.0.1", "expected host:port with a port in 1..65535, got '127.0.0.1'"),
        ("127.0.0.1:50051/", "expected host:port with a port in 1..65535"),
        ("127.0.0.1:1,127.0.0.1:99999", "expected host:port with a port in 1..65535, got '127.0.0.1:99999'"),
        ("127.0.0.1:1,nosuch.invalid:2", "cannot resolve 'nosuch.invalid' in 'nosuch.invalid:2'"),
    ],
)
def test_a_target_that_is_not_an_address_is_refused_naming_it(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^target: {re.escape(message)}"):
        Client(target)
    with pytest.raises(argparse.ArgumentTypeError) as err:  # the commands' --target, in one line
        target_argument(target)
    assert str(err.value).startswith(message)


def test_three_servers_share_the_load_and_one_leaving_mid_run_loses_no_call() -> None:
    x = np.random.default_rng(0).standard_normal((4, E)).astype(np.float32)
    config = settings(model(embed_dim=E, num_heads=2))
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(running(config)) for _ in range(3)]
        with Client([h.target for h in handles], timeout_s=30, wait_for_ready=True) as client:
            for h in handles:
                with Client(h.target, timeout_s=10) as one:
                    assert one.health() == "SERVING"
            for _ in range(90):
                client.attend(x)
            shares = [served(h) for h in handles]
            assert sum(shares) == 90
            assert all(share >= 20 for share in shares), shares  # fair: 30 each when all are ready

            # Stop one server while calls keep coming: every call must still succeed.
            done = threading.Event()
            answered = 0
            errors: list[BaseException] = []

            def load() -> None:
                nonlocal answered
                try:
                    while not done.is_set() or answered < 60:
                        client.attend(x)
                        answered += 1
                        if answered >= 150:
                            break
                except BaseException as exc:  # reported below
                    errors.append(exc)

            worker = threading.Thread(target=load)
            worker.start()
            handles[0].wait_for(lambda: served(handles[0]) >= shares[0] + 5)
            handles[1].call(handles[1].server.stop(2.0))
            done.set()
            worker.join(60)
            assert not worker.is_alive() and errors == []
            after = [served(h) for h in (handles[0], handles[2])]
            assert sum(after) - shares[0] - shares[2] > 0  # the others took the rest


def test_the_async_client_balances_too() -> None:
    import asyncio

    x = np.random.default_rng(1).standard_normal((4, E)).astype(np.float32)
    config = settings(model(embed_dim=E, num_heads=2))
    with running(config) as a, running(config) as b:

        async def main() -> None:
            async with AsyncClient(f"{a.target},{b.target}", timeout_s=30, wait_for_ready=True) as client:
                # One at a time: round-robin spreads calls over the addresses that are connected,
                # and the second connects while the first calls are answered.
                for _ in range(40):
                    await client.attend(x)

        asyncio.run(main())
        assert served(a) + served(b) == 40 and served(a) > 0 and served(b) > 0


def request(request_id: str) -> pb.AttendRequest:
    x = np.zeros((4, E), np.float32).tobytes()
    return pb.AttendRequest(request_id=request_id, query=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4, E], data=x))


def test_connections_age_out_and_calls_and_a_stream_carry_on() -> None:
    # --max-connection-age-s: the server ends each connection (GOAWAY) after about this long, so that
    # clients reconnect, through a Service or a fresh DNS lookup, and reach replicas added since.
    # Calls in progress finish, and a stream opened before keeps its connection until it ends.
    with (
        running(settings(model(embed_dim=E, num_heads=2), max_connection_age_s=0.3)) as handle,
        grpc.insecure_channel(handle.target) as channel,
    ):
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append, try_to_connect=True)
        stub = pb_grpc.AttentionServiceStub(channel)
        outgoing: queue.Queue = queue.Queue()
        stream = stub.AttendStream(iter(outgoing.get, None), timeout=60)
        outgoing.put(request("before"))
        assert next(stream).request_id == "before"

        def aged() -> bool:
            assert stub.Attend(request("unary"), timeout=10).request_id == "unary"  # no call fails meanwhile
            ready, idle = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
            return any(a == ready and b == idle for a, b in itertools.pairwise(states))  # a GOAWAY came

        handle.wait_for(aged)
        assert stub.Attend(request("reconnected"), timeout=10).request_id == "reconnected"
        outgoing.put(request("after"))
        assert next(stream).request_id == "after"
        outgoing.put(None)
        assert list(stream) == []


def test_a_client_that_pings_keeps_its_idle_stream() -> None:
    # Clients behind load balancers and NATs ping idle connections (keepalive). With gRPC's own floor
    # of 5 minutes between a client's pings, the server would close such a connection after three,
    # "too_many_pings", and the stream with it. --client-ping-min-s (here 0.5) sets that floor.
    pings = [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with (
        running(settings(model(embed_dim=E, num_heads=2), client_ping_min_s=0.5)) as handle,
        grpc.insecure_channel(handle.target, pings) as channel,
    ):
        stub = pb_grpc.AttentionServiceStub(channel)
        outgoing: queue.Queue = queue.Queue()
        stream = stub.AttendStream(iter(outgoing.get, None), timeout=60)
        outgoing.put(request("before"))
        assert next(stream).request_id == "before"
        time.sleep(4.0)  # the condition under test: the stream idles while its client pings ~4 times
        outgoing.put(request("after"))
        assert next(stream).request_id == "after"
        outgoing.put(None)
        assert list(stream) == []


class FreezingProxy:
    """A TCP proxy on 127.0.0.1 to a server's port, whose `freeze()` stops forwarding without closing
    anything: to its clients, a server whose host vanished."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self._port))
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if self._frozen.is_set():
                    self._closed.wait()  # hold the bytes, send nothing, close nothing
                    return
                sink.sendall(data)

    def __enter__(self) -> FreezingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        for sock in self._sockets:
            sock.close()


def test_a_client_with_keepalive_ends_a_stream_to_a_server_that_vanished() -> None:
    # Without keepalive the stream below would wait for its deadline (or forever, without one).
    with (
        running(settings(model(embed_dim=E, num_heads=2), client_ping_min_s=0.1)) as handle,
        FreezingProxy(handle.server.port) as proxy,
        Client(proxy.target, keepalive_s=0.5, timeout_s=20) as client,
    ):
        outgoing: queue.Queue = queue.Queue()
        answers = client.attend_stream(iter(outgoing.get, None))
        x = np.zeros((4, E), np.float32)
        outgoing.put({"query": x, "request_id": "before"})
        assert next(answers).request_id == "before"
        proxy.freeze()
        outgoing.put({"query": x, "request_id": "unanswered"})
        with pytest.raises(AttnServeError) as err:
            next(answers)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE  # a keepalive ping went unanswered, not the deadline
        outgoing.put(None)
