"""Client behaviour that needs a controllable peer: retries of UNAVAILABLE (and of a server's CANCELLED)
through the service config."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from attnserve import AttnServeError, Client
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc


class FlakyOnce(pb_grpc.AttentionServiceServicer):
    """Answers `code` (UNAVAILABLE unless a request id starts with "cancelled") to the first attempt of
    every request id, then echoes the query."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.lock = threading.Lock()

    def Attend(self, request: pb.AttendRequest, context: grpc.ServicerContext) -> pb.AttendResponse:
        with self.lock:
            n = self.attempts[request.request_id] = self.attempts.get(request.request_id, 0) + 1
        if n == 1:
            if request.request_id.startswith("cancelled"):
                # what gRPC core answers a call that reached a server as it stopped (grpc/grpc#41785)
                context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return pb.AttendResponse(request_id=request.request_id, output=request.query)


@pytest.fixture
def flaky():
    servicer = FlakyOnce()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize(
    ("request_id", "first_answer"),
    [
        ("r1", grpc.StatusCode.UNAVAILABLE),
        ("cancelled-1", grpc.StatusCode.CANCELLED),  # as gRPC answers a call that reached a stopping server
    ],
)
def test_unavailable_and_a_servers_cancelled_are_retried_by_the_channel(flaky, request_id, first_answer) -> None:
    servicer, target = flaky
    x = np.ones((2, 4), np.float32)
    with Client(target, timeout_s=10) as c:
        result = c.attend(x, request_id=request_id)
    np.testing.assert_array_equal(result.output, x)
    assert servicer.attempts[request_id] == 2
    if first_answer is grpc.StatusCode.CANCELLED:
        with Client(target, timeout_s=10, retries=False) as c, pytest.raises(AttnServeError) as err:
            c.attend(x, request_id="cancelled-2")
        assert err.value.code == grpc.StatusCode.CANCELLED and servicer.attempts["cancelled-2"] == 1


def test_without_retries_unavailable_reaches_the_caller(flaky) -> None:
    servicer, target = flaky
    with Client(target, timeout_s=10, retries=False) as c, pytest.raises(AttnServeError) as err:
        c.attend(np.ones((2, 4), np.float32), request_id="r2")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.message == "try again"
    assert servicer.attempts["r2"] == 1


@pytest.mark.parametrize("keepalive_s", [0, -1.0, float("nan"), float("inf")])
def test_keepalive_must_be_a_positive_number_of_seconds(keepalive_s: float) -> None:
    with pytest.raises(ValueError, match="keepalive_s: expected a number of seconds > 0"):
        Client("127.0.0.1:1", keepalive_s=keepalive_s)


@pytest.mark.parametrize("timeout_s", [0, 0.0, -5, float("nan")])
def test_a_timeout_that_is_no_deadline_is_refused_naming_it(flaky, timeout_s: float) -> None:
    # Before, gRPC took each as a deadline already passed: DEADLINE_EXCEEDED from a call never sent.
    servicer, target = flaky
    with pytest.raises(ValueError, match="timeout_s: expected a number of seconds > 0, or None for no deadline"):
        Client(target, timeout_s=timeout_s)
    with Client(target) as c, pytest.raises(ValueError, match="timeout_s: expected a number of seconds > 0"):
        c.attend(np.ones((2, 4), np.float32), timeout_s=timeout_s)
    assert not servicer.attempts


def test_an_infinite_timeout_is_no_deadline(flaky) -> None:
    # Before, gRPC took infinity for a deadline already passed: DEADLINE_EXCEEDED at once.
    servicer, target = flaky
    with Client(target, timeout_s=float("inf")) as c:
        assert c.attend(np.ones((2, 4), np.float32), request_id="inf").output.shape == (2, 4)
    with Client(target) as c:
        assert c.attend(np.ones((2, 4), np.float32), request_id="inf2", timeout_s=float("inf")).output is not None
    assert servicer.attempts == {"inf": 2, "inf2": 2}  # each retried once past the flaky first answer


@pytest.mark.parametrize("max_message_bytes", [0, -1, 2**31, 2**40, 1.5])
def test_max_message_bytes_must_fit_grpc(max_message_bytes: int) -> None:
    # Before: 2**40 raised OverflowError from gRPC's channel arguments; 0 refused every message at the call.
    with pytest.raises(ValueError, match=r"max_message_bytes: expected 1\.\.2147483647 \(gRPC's most\)"):
        Client("127.0.0.1:1", max_message_bytes=max_message_bytes)
