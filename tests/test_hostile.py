"""What a hostile or broken client can send, through the real server: bytes that are not a message,
strings without bound, overload. Each answer is a precise status; the server keeps serving."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from attnserve import AsyncClient, AttnServeError, Client
from attnserve.v1 import attention_pb2 as pb
from attnserve_server.edge import front, payload
from attnserve_server.protocol import open_inference_pb2 as v2

from conftest import Running, model, running, settings

ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"
GET_MODEL = "/attnserve.v1.AttentionService/GetModel"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
NOT_A_MESSAGE = b"\xff\xff\xff\xff\xff"
# AttendRequest.model (field 1, a string) holding bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def attend_bytes(e: int = 32, request_id: str = "") -> bytes:
    q = np.random.default_rng(0).standard_normal((4, e)).astype("<f4")
    msg = pb.AttendRequest(request_id=request_id)
    msg.query.dtype, msg.query.data = pb.DATA_TYPE_FP32, q.tobytes()
    msg.query.shape[:] = q.shape
    return msg.SerializeToString()


def raw_unary(target: str, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(body, timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details()
        return grpc.StatusCode.OK, ""


def still_serving(target: str) -> None:
    with Client(target, timeout_s=10) as c:
        assert c.attend(np.ones((2, 32), np.float32)).output.shape == (2, 32)


@pytest.mark.parametrize("method", [ATTEND, GET_MODEL, MODEL_INFER])
@pytest.mark.parametrize("body", [NOT_A_MESSAGE, BAD_UTF8], ids=["not-protobuf", "bad-utf8"])
def test_bytes_that_are_not_a_message_are_invalid_argument_in_one_line(
    default_server: Running, method: str, body: bytes
) -> None:
    name = method.rsplit("/", 1)[1]
    before = refused_unread(default_server, name)
    code, details = raw_unary(default_server.target, method, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request: not a valid ") and "\n" not in details and len(details) < 400
    # An inference request is counted (model "": none could be read from it); GetModel counts in no series.
    assert refused_unread(default_server, name) == before + (name != "GetModel")
    still_serving(default_server.target)


def refused_unread(server: Running, method: str) -> float:
    return server.sample("attnserve_requests_total", model="", method=method, code="INVALID_ARGUMENT")


def _stream(target: str, method: str, bodies: list[bytes]) -> list[bytes]:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        return list(call(iter(bodies), timeout=30))


def test_a_native_stream_answers_an_undecodable_message_in_band_and_goes_on(default_server: Running) -> None:
    before = refused_unread(default_server, "AttendStream")
    answers = [
        pb.AttendResponse.FromString(b)
        for b in _stream(
            default_server.target,
            ATTEND_STREAM,
            [attend_bytes(request_id="a"), NOT_A_MESSAGE, attend_bytes(request_id="c")],
        )
    ]
    assert len(answers) == 3
    good = sorted(a.request_id for a in answers if not a.HasField("error"))
    bad = [a for a in answers if a.HasField("error")]
    assert good == ["a", "c"] and len(bad) == 1
    assert bad[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and bad[0].request_id == ""
    assert bad[0].error.message.startswith("request: not a valid attnserve.v1.AttendRequest")
    assert refused_unread(default_server, "AttendStream") == before + 1


def test_a_kserve_stream_answers_an_undecodable_message_in_band_and_goes_on(default_server: Running) -> None:
    def infer(request_id: str) -> bytes:
        q = np.ones((1, 4, 32), "<f4")
        msg = v2.ModelInferRequest(model_name="default", id=request_id)
        msg.inputs.add(name="query", datatype="FP32", shape=q.shape)
        msg.raw_input_contents.append(q.tobytes())
        return msg.SerializeToString()

    before = refused_unread(default_server, "ModelStreamInfer")
    answers = [
        v2.ModelStreamInferResponse.FromString(b)
        for b in _stream(default_server.target, MODEL_STREAM_INFER, [infer("a"), NOT_A_MESSAGE, infer("c")])
    ]
    assert len(answers) == 3
    assert sorted(a.infer_response.id for a in answers if not a.error_message) == ["a", "c"]
    (bad,) = [a for a in answers if a.error_message]
    assert bad.error_message.startswith("request: not a valid inference.ModelInferRequest")
    assert "no id to echo" in bad.error_message
    assert bad.infer_response.parameters["error_code"].string_param == "INVALID_ARGUMENT"
    assert refused_unread(default_server, "ModelStreamInfer") == before + 1


def test_a_reflection_stream_ends_invalid_argument_on_an_undecodable_message(
    default_server: Running, caplog: pytest.LogCaptureFixture
) -> None:
    # Reflection's servicer took the Undecodable for a request: AttributeError, the stream ended UNKNOWN,
    # and gRPC logged a traceback at ERROR for each such message.
    listing = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with grpc.insecure_channel(default_server.target) as channel:
        call = channel.stream_stream(REFLECTION, request_serializer=None, response_deserializer=None)
        answers = call(iter([listing, NOT_A_MESSAGE, listing]), timeout=30)
        first = reflection_pb2.ServerReflectionResponse.FromString(next(answers))
        assert first.WhichOneof("message_response") == "list_services_response"
        with pytest.raises(grpc.RpcError) as ended:
            next(answers)
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ended.value.details().startswith("request: not a valid grpc.reflection.v1alpha.ServerReflectionRequest")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    still_serving(default_server.target)


@pytest.mark.parametrize(
    "method, message",
    [
        ("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest),
        (GET_MODEL, pb.GetModelRequest),
        ("/inference.GRPCInferenceService/ModelMetadata", v2.ModelMetadataRequest),
        ("/inference.GRPCInferenceService/SystemSharedMemoryStatus", v2.SystemSharedMemoryStatusRequest),
    ],
    ids=["health", "GetModel", "ModelMetadata", "SystemSharedMemoryStatus"],
)
def test_a_request_without_tensors_over_64_kib_is_refused_unparsed(
    default_server: Running, method: str, message: type
) -> None:
    # Each is a few names: protobuf copied and checked a 100 MiB one, and the servicer hashed it, on the
    # event loop (others' slowest W1 request 230-580 ms, against 140-180 for the bytes' receipt alone).
    body = message(**{message.DESCRIPTOR.fields[0].name: "n" * (64 * 1024)}).SerializeToString()
    code, details = raw_unary(default_server.target, method, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        f"request: not a valid {message.DESCRIPTOR.full_name} message ({len(body):,} bytes, where this method takes"
        " at most 65,536)"
    )
    smaller = message(**{message.DESCRIPTOR.fields[0].name: "n" * (60 * 1024)}).SerializeToString()
    assert "where this method takes" not in raw_unary(default_server.target, method, smaller)[1]  # read, answered
    still_serving(default_server.target)


def test_client_strings_in_errors_are_cut_short(default_server: Running) -> None:
    long = "q" * 20000
    with Client(default_server.target, timeout_s=10) as c:
        with pytest.raises(AttnServeError) as err:
            c.attend(np.ones((2, 32), np.float32), model=long)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert len(err.value.message) < 300 and "(20000 characters)" in err.value.message
        with pytest.raises(AttnServeError) as err:
            c.model(long)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and len(err.value.message) < 300
    # KServe: a model name, an input name and a parameter name, each 20,000 characters.
    q = np.ones((1, 4, 32), "<f4").tobytes()
    cases = []
    msg = v2.ModelInferRequest(model_name=long)
    cases.append((msg, grpc.StatusCode.NOT_FOUND))
    msg = v2.ModelInferRequest(model_name="default")
    msg.inputs.add(name=long, datatype="FP32", shape=[1, 4, 32])
    msg.raw_input_contents.append(q)
    cases.append((msg, grpc.StatusCode.INVALID_ARGUMENT))
    msg = v2.ModelInferRequest(model_name="default")
    msg.inputs.add(name="query", datatype="FP32", shape=[1, 4, 32])
    msg.raw_input_contents.append(q)
    msg.parameters[long].bool_param = True
    cases.append((msg, grpc.StatusCode.INVALID_ARGUMENT))
    msg = v2.ModelInferRequest(model_name="default")
    msg.inputs.add(name="query", datatype=long, shape=[1, 4, 32])
    msg.raw_input_contents.append(q)
    cases.append((msg, grpc.StatusCode.INVALID_ARGUMENT))
    for msg, want in cases:
        code, details = raw_unary(default_server.target, MODEL_INFER, msg.SerializeToString())
        assert code == want and len(details) < 400, (code, details[:200])
    still_serving(default_server.target)


def test_a_full_queue_refuses_before_decoding_the_request() -> None:
    # The request is malformed too (wrong byte length): at overload it is refused for the queue,
    # which is checked first, so shedding never pays for decoding.
    held = settings(model(embed_dim=32, num_heads=4, max_queue_delay_ms=60_000, max_queue_size=1))
    with (
        running(held) as handle,
        Client(handle.target, timeout_s=60) as c,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        accepted = pool.submit(c.attend, np.ones((3, 32), np.float32))
        handle.wait_for(lambda: handle.sample("attnserve_queue_depth", model="default") == 1)
        bad = pb.AttendRequest()
        bad.query.dtype, bad.query.data = pb.DATA_TYPE_FP32, b"\0" * 7
        bad.query.shape[:] = [4, 32]
        code, details = raw_unary(handle.target, ATTEND, bad.SerializeToString())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        handle.call(handle.server.stop(10))
        assert accepted.result(timeout=30).output.shape == (3, 32)


def test_an_answer_that_cannot_fit_the_message_limit_is_refused_before_compute() -> None:
    # 1 MiB messages: per-head weights of a [1, 300, 32] query (4 x 300 x 300 float32 = 1.4 MB)
    # cannot be sent; averaged weights (0.36 MB) can.
    with running(settings(model(embed_dim=32, num_heads=4), max_message_bytes=1 << 20)) as handle:
        q = np.ones((300, 32), np.float32)
        with Client(handle.target, timeout_s=30) as c:
            with pytest.raises(AttnServeError) as err:
                c.attend(q, need_weights=True, average_weights=False)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                "the answer would be 1.4 MiB (weights 1.4 MiB) and up to 64.0 KiB of names, shapes and framing, "
                "over the server's max_message_bytes 1.0 MiB"
            ) in err.value.message
            assert c.attend(q, need_weights=True).attention_weights.shape == (300, 300)
        assert handle.sample("attnserve_tokens_total", model="default") == 300  # only the averaged one ran


def test_a_request_over_the_batch_memory_budget_is_refused_and_the_arithmetic_is_named() -> None:
    budget = 4 << 20
    served = settings(model(embed_dim=32, num_heads=4, max_batch_memory_bytes=budget))
    with running(served) as handle, Client(handle.target, timeout_s=30) as c:
        # Scores 4 heads x 600 x 600 x 4 bytes, three copies with weights: 17.3 MB, over 4 MiB.
        with pytest.raises(AttnServeError) as err:
            c.attend(np.ones((600, 32), np.float32), need_weights=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_batch_memory_bytes 4.0 MiB" in err.value.message and "with weights" in err.value.message
        # 300 queries without weights: one copy of 1.4 MB, within the budget.
        assert c.attend(np.ones((300, 32), np.float32)).output.shape == (300, 32)


def _serve_on(flags: dict[str, str]) -> subprocess.CompletedProcess:
    args = [a for flag, value in flags.items() for a in (flag, value)]
    return subprocess.run(
        [sys.executable, "-m", "attnserve_server", "serve", "--host", "127.0.0.1", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_naming(r: subprocess.CompletedProcess, port: int) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("attnserve:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "cannot bind" in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_second_server_on_a_taken_grpc_port_refuses_to_start(default_server: Running) -> None:
    # gRPC's default SO_REUSEPORT would let it start and take part of the first server's traffic.
    _one_line_naming(
        _serve_on({"--port": str(default_server.server.port), "--metrics-port": "-1"}), default_server.server.port
    )
    still_serving(default_server.target)


@pytest.mark.slow
def test_a_taken_metrics_port_fails_at_start_up_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _one_line_naming(_serve_on({"--port": "0", "--metrics-port": str(port)}), port)


class _NonReader:
    """An HTTP/2 client that sends gRPC calls and opens no flow-control window: the server can send it
    headers and trailers, never a byte of an answer, until `read_all` opens the windows."""

    def __init__(self, target: str) -> None:
        pytest.importorskip("h2")  # a test dependency; an environment without it skips these tests
        import h2.config
        import h2.connection
        import h2.settings

        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.sock.sendall(self.h2.data_to_send())
        self.status: dict[int, str] = {}  # stream -> grpc-status, once its trailers came
        self.messages_of_status: dict[int, str] = {}  # stream -> grpc-message, if its trailers had one
        self.received: dict[int, bytearray] = {}  # stream -> the bytes of its answers so far

    def open(self, path: str) -> int:
        stream = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "attnserve")]
        self.h2.send_headers(stream, [*headers, ("content-type", "application/grpc"), ("te", "trailers")])
        return stream

    def send(self, stream: int, body: bytes, end: bool = False) -> None:
        framed = memoryview(b"\0" + len(body).to_bytes(4, "big") + body)
        while framed:
            room = min(self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
            if room <= 0:  # until the server's settings and window updates come
                self.sock.sendall(self.h2.data_to_send())
                self._receive()
                continue
            self.h2.send_data(stream, framed[:room].tobytes())
            framed = framed[room:]
        if end:
            self.h2.end_stream(stream)
        self.sock.sendall(self.h2.data_to_send())

    def call(self, path: str, body: bytes) -> int:
        stream = self.open(path)
        self.send(stream, body, end=True)
        return stream

    def messages(self, stream: int) -> list[bytes]:
        """The gRPC messages received on `stream` so far."""
        data, found = memoryview(self.received.get(stream, bytearray())), []
        while len(data) >= 5:
            size = int.from_bytes(data[1:5], "big")
            if len(data) < 5 + size:
                break
            found.append(data[5 : 5 + size].tobytes())
            data = data[5 + size :]
        return found

    def receive_until(self, done) -> None:
        while not done():
            self._receive()

    def _receive(self) -> None:
        import h2.events

        data = self.sock.recv(1 << 20)
        assert data, "the server closed the connection"
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                headers = dict(event.headers)
                status = headers.get(b"grpc-status")
                if status is not None:
                    self.status[event.stream_id] = status.decode()
                    message = urllib.parse.unquote(headers.get(b"grpc-message", b"").decode())
                    self.messages_of_status[event.stream_id] = message
            elif isinstance(event, h2.events.DataReceived):
                self.received.setdefault(event.stream_id, bytearray()).extend(event.data)
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.sock.sendall(self.h2.data_to_send())

    def read_all(self) -> None:
        import h2.settings

        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24})
        self.h2.increment_flow_control_window(1 << 30)
        self.sock.sendall(self.h2.data_to_send())


def _weights_request(length: int = 256) -> tuple[np.ndarray, bytes]:
    """A query of `length` x 32 and its AttendRequest asking for per-head weights (4 x 256 x 256 float32:
    1 MiB to answer at 256)."""
    request = pb.AttendRequest(need_weights=True, average_weights=False)
    q = np.ones((length, 32), "<f4")
    request.query.dtype, request.query.data = pb.DATA_TYPE_FP32, q.tobytes()
    request.query.shape[:] = q.shape
    return q, request.SerializeToString()


def test_a_client_that_never_reads_its_answers_is_refused_before_the_server_holds_too_many() -> None:
    # Before, every request was computed and its answer held until the client read it: 200 requests for
    # 8 MiB of weights each, from one such client, grew the server to 5.5 GiB (BENCHMARKS.md, 58th pass).
    q, body = _weights_request()
    with running(settings(model(embed_dim=32, num_heads=4), max_unsent_bytes=4 << 20)) as handle:
        stalled = _NonReader(handle.target)
        try:
            streams = [stalled.call(ATTEND, body) for _ in range(10)]
            # Each answer counts from admission; the fourth takes the server to its limit.
            stalled.receive_until(lambda: len(stalled.status) == 6)
            assert set(stalled.status.values()) == {str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])}
            refused = sorted(stalled.status)
            assert refused == streams[4:], (refused, streams)
            still_serving(handle.target)  # another connection is served meanwhile
            with Client(handle.target, timeout_s=10) as other:
                weights = other.attend(q, need_weights=True, average_weights=False).attention_weights
                assert weights.shape == (4, 256, 256)
            assert handle.sample("attnserve_dropped_requests_total", model="default", reason="unsent_answers") == 6
            # The four answers unread, 1 MiB of weights and their calls each (the other connection's are
            # let go once their calls end, just after their clients have them).
            handle.wait_for(lambda: handle.sample("attnserve_unsent_answer_bytes") < 5 << 20)
            assert handle.sample("attnserve_unsent_answer_bytes") >= 4 << 20
            stalled.read_all()  # the four answers go out, and the connection is served again
            stalled.receive_until(lambda: len(stalled.status) == 10)
            for s in streams[:4]:
                (answer,) = stalled.messages(s)
                assert stalled.status[s] == "0"
                assert len(pb.AttendResponse.FromString(answer).attention_weights.data) == 1 << 20
            again = stalled.call(ATTEND, body)
            stalled.receive_until(lambda: again in stalled.status)
            assert stalled.status[again] == "0"
            handle.wait_for(lambda: handle.sample("attnserve_unsent_answer_bytes") == 0)
        finally:
            stalled.sock.close()


def test_a_stream_whose_client_never_reads_is_answered_refusals_in_band_past_the_limit() -> None:
    # Before, a stream read `stream_window` (128) requests ahead and held every answer: four streams of
    # 200 requests for 8 MiB of weights, none read, made the server hold 6 GiB (BENCHMARKS.md, 58th pass).
    _, body = _weights_request()
    with running(settings(model(embed_dim=32, num_heads=4), max_unsent_bytes=4 << 20)) as handle:
        stalled = _NonReader(handle.target)
        try:
            stream = stalled.open(ATTEND_STREAM)
            for _ in range(10):
                stalled.send(stream, body)

            def dropped() -> float:
                return handle.sample("attnserve_dropped_requests_total", model="default", reason="unsent_answers")

            handle.wait_for(lambda: dropped() == 6)
            still_serving(handle.target)
            stalled.read_all()
            stalled.receive_until(lambda: len(stalled.messages(stream)) == 10)
            answers = [pb.AttendResponse.FromString(m) for m in stalled.messages(stream)]
            ok = [a for a in answers if not a.HasField("error")]
            assert len(ok) == 4 and all(len(a.attention_weights.data) == 1 << 20 for a in ok)
            for a in answers:
                if a.HasField("error"):
                    assert a.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                    assert a.error.message.startswith("answers: the server owes this connection "), a.error.message
            stalled.send(stream, body, end=True)  # read, the stream is served again
            stalled.receive_until(lambda: stream in stalled.status)
            assert stalled.status[stream] == "0" and len(stalled.messages(stream)) == 11
            assert not pb.AttendResponse.FromString(stalled.messages(stream)[-1]).HasField("error")
        finally:
            stalled.sock.close()


def test_many_connections_each_with_an_answer_unread_cannot_pile_up_answers_past_twice_the_limit() -> None:
    # A connection owed nothing is served even past the limit (a reader is not refused for the others), so
    # one non-reading connection after another each got its request computed: without bound, before.
    _, body = _weights_request()  # about 1.05 MiB owed each: the eighth takes the server past 8 MiB
    limited = settings(model(embed_dim=32, num_heads=4), max_unsent_bytes=4 << 20, edge_processes=1)
    with running(limited) as handle:
        stalled = [_NonReader(handle.target) for _ in range(10)]
        try:
            calls = [(c, c.call(ATTEND, body)) for c in stalled]
            handle.wait_for(
                lambda: handle.sample("attnserve_dropped_requests_total", model="default", reason="unsent_answers") == 2
            )
            for c, call in calls:
                c.read_all()
                c.receive_until(lambda c=c, call=call: call in c.status)
            statuses = sorted(c.status[call] for c, call in calls)
            assert statuses == ["0"] * 8 + ["8"] * 2, statuses
            refusals = [c.messages_of_status[call] for c, call in calls if c.status[call] == "8"]
            assert all("twice its max_unsent_bytes 4.0 MiB" in m for m in refusals), refusals
            still_serving(handle.target)
        finally:
            for c in stalled:
                c.sock.close()


def test_a_stop_waits_for_answers_to_go_out_and_says_so_when_a_client_never_reads_them() -> None:
    # Before, the stop waited for handlers only: a unary answer not yet read was cancelled 1 s later, and the
    # server still logged "every accepted request answered".
    _, body = _weights_request()
    served = settings(model(embed_dim=32, num_heads=4))
    with running(served) as handle:
        reader = _NonReader(handle.target)
        try:
            calls = [reader.call(ATTEND, body) for _ in range(2)]
            handle.wait_for(lambda: handle.sample("attnserve_requests_total", model="default", method="Attend") == 2)
            stopping = asyncio.run_coroutine_threadsafe(handle.server.stop(20.0), handle.loop)
            reader.read_all()  # within the grace period: both answers go out, and the stop reports them sent
            reader.receive_until(lambda: all(call in reader.status for call in calls))
            assert [reader.status[call] for call in calls] == ["0", "0"]
            assert stopping.result(30) is True
        finally:
            reader.sock.close()
    with running(served) as handle:
        stalled = _NonReader(handle.target)
        try:
            for _ in range(2):
                stalled.call(ATTEND, body)
            handle.wait_for(lambda: handle.sample("attnserve_requests_total", model="default", method="Attend") == 2)
            assert handle.call(handle.server.stop(1.0)) is False  # their answers never went out
        finally:
            stalled.sock.close()


def compressed_unary(target: str, body: bytes, compression: grpc.Compression) -> tuple[grpc.StatusCode, str, bytes]:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary(ATTEND, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", call(body, timeout=10, compression=compression)
        except grpc.RpcError as err:
            return err.code(), err.details(), b""


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate], ids=["gzip", "deflate"])
def test_compressed_requests_are_refused_unless_accepted(
    default_server: Running, compression: grpc.Compression
) -> None:
    # gRPC inflates a compressed message whole before the server sees it: a message of zeros a
    # thousandth of max_message_bytes on the wire would cost all of it. Off unless asked for.
    code, details, _ = compressed_unary(default_server.target, attend_bytes(), compression)
    assert code == grpc.StatusCode.UNIMPLEMENTED, (code, details)
    assert "is disabled" in details, details
    still_serving(default_server.target)


def test_accepted_compression_answers_as_uncompressed_and_inflates_no_more_than_max_message_bytes() -> None:
    limit = 1 << 20
    with running(settings(model(embed_dim=32, num_heads=4), accept_compression="gzip", max_message_bytes=limit)) as h:
        plain = compressed_unary(h.target, attend_bytes(), grpc.Compression.NoCompression)
        gzip = compressed_unary(h.target, attend_bytes(), grpc.Compression.Gzip)
        assert plain[0] == gzip[0] == grpc.StatusCode.OK, (plain, gzip)
        assert pb.AttendResponse.FromString(gzip[2]).output == pb.AttendResponse.FromString(plain[2]).output
        # Deflate was not named: still refused.
        assert compressed_unary(h.target, attend_bytes(), grpc.Compression.Deflate)[0] == grpc.StatusCode.UNIMPLEMENTED
        # 4 MiB of zeros, a few KiB compressed: refused while inflating, at max_message_bytes.
        bomb = pb.AttendRequest()
        bomb.query.dtype, bomb.query.data = pb.DATA_TYPE_FP32, bytes(4 * limit)
        bomb.query.shape[:] = (limit // 32, 32)
        code, details, _ = compressed_unary(h.target, bomb.SerializeToString(), grpc.Compression.Gzip)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        still_serving(h.target)


LONG_ID = "x" * (300 << 10)


def _infer(**fields) -> v2.ModelInferRequest:
    return v2.ModelInferRequest(model_name="default", **fields)


def _with_params(msg, count: int):
    for i in range(count):
        msg.parameters[f"p{i}"].bool_param = True
    return msg


# Each is refused by a count before any entry is read: reading two million empty inputs one by one held
# the event loop (every other client) for 4.7 s; a shape of 20 million dims, 2.7 s; a million parameters, 1.2 s.
@pytest.mark.parametrize(
    ("method", "request_message", "says"),
    [
        (
            MODEL_INFER,
            _infer(
                inputs=[{"name": "key_lengths", "datatype": "INT64", "contents": {"int64_contents": [1] * (5 << 20)}}]
            ),
            "(inputs: 5.0 MiB of typed bool or integer contents, where an input takes at most 4.0 MiB of them; send",
        ),
        # Large: scanned even while the server's parser parses small messages whole (payload.Parser's back-off).
        (MODEL_INFER, _infer(inputs=[{"name": "query"}] * 300, id=LONG_ID), "(more than 256 fields in one message;"),
        (MODEL_INFER, _infer(inputs=[{"name": "query"}] * 7), "inputs: expected at most 6 (query, key_value,"),
        (MODEL_INFER, _infer(outputs=[{"name": "output"}] * 3), "outputs: expected at most 2 (output, attention"),
        (MODEL_INFER, _with_params(_infer(), 7), "parameters: expected at most 6 (causal, need_weights,"),
        (
            MODEL_INFER,
            _infer(inputs=[_with_params(v2.ModelInferRequest.InferInputTensor(name="query"), 4)]),
            "inputs[0].parameters: expected at most 3 (shared_memory_region,",
        ),
        (
            MODEL_INFER,
            _infer(inputs=[{"name": "query", "datatype": "FP32", "shape": [1] * 9}]),
            "inputs[0].shape (input 'query'): expected at most 3 dimensions, got [1, 1, 1, 1, 1, 1, 1, 1, …] (9 dim",
        ),
        (
            ATTEND,
            pb.AttendRequest(query=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[1] * 9)),
            "query.shape: expected at most 3 dimensions, got [1, 1, 1, 1, 1, 1, 1, 1, …] (9 dimensions)",
        ),
        (
            ATTEND,
            pb.AttendRequest(query=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[1] * 20000), request_id=LONG_ID),
            "request: not a valid attnserve.v1.AttendRequest message (query: a tensor with 19.5 KiB besides its",
        ),
        (
            MODEL_INFER,
            _infer(inputs=[{"name": "query", "datatype": "FP32", "shape": [1] * 20000}], id=LONG_ID),
            "request: not a valid inference.ModelInferRequest message (inputs: a tensor with 19.5 KiB besides its",
        ),
    ],
    ids=[
        "typed-int64-5MiB",
        "300-inputs",
        "7-inputs",
        "3-outputs",
        "7-parameters",
        "input-parameters",
        "kserve-9-dims",
        "9-dims",
        "20000-dims",
        "kserve-20000-dims",
    ],
)
def test_counts_past_any_request_are_refused_before_their_entries_are_read(
    default_server: Running, method: str, request_message, says: str
) -> None:
    code, details = raw_unary(default_server.target, method, request_message.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert says in details, details
    still_serving(default_server.target)


@pytest.mark.parametrize("method", [ATTEND, MODEL_INFER])
def test_an_id_longer_than_any_answer_should_echo_is_refused(default_server: Running, method: str) -> None:
    # Every answer echoes its id, which the size the server owes a connection for it does not count
    # (edge/outbox.py): ids of 100 MiB from a client that read no answers held 3.9 GiB, counted as 160 KiB.
    def body(request_id: str) -> bytes:
        if method == ATTEND:
            return attend_bytes(request_id=request_id)
        msg = v2.ModelInferRequest(model_name="default", id=request_id)
        msg.inputs.add(name="query", datatype="FP32", shape=[1, 4, 32])
        msg.raw_input_contents.append(np.ones((4, 32), "<f4").tobytes())
        return msg.SerializeToString()

    field = "request_id" if method == ATTEND else "id"
    longest = payload.MAX_ID_CHARS
    # A head seen with a short id first: a long one then matches it (payload.Repeat) and is checked as well.
    for request_id in ("a", "b" * longest, "c" * (longest + 1), "d", "e" * (8 * longest)):
        code, details = raw_unary(default_server.target, method, body(request_id))
        if len(request_id) <= longest:
            assert code == grpc.StatusCode.OK, (code, details)
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert f"({field}: an id of {len(request_id):,} characters, where one takes at most 16,384)" in details
    still_serving(default_server.target)


def _watch(target: str, service: str = ""):
    channel = grpc.insecure_channel(target)
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
    return channel, stream


def test_a_health_watcher_that_reads_nothing_holds_up_no_status_change() -> None:
    # grpc_health's servicer wrote each watcher's update holding the lock its status changes take: three
    # Watch streams that read nothing held SIGTERM's NOT_SERVING, and the stop, until their connection died
    # (55 s), and every other watcher heard nothing meanwhile.
    with running(settings(model(embed_dim=32, num_heads=4))) as handle:
        stuck = _NonReader(handle.target)
        request = health_pb2.HealthCheckRequest(service="").SerializeToString()
        for _ in range(3):
            stuck.call("/grpc.health.v1.Health/Watch", request)
        channel, watcher = _watch(handle.target)
        with channel:
            assert next(watcher).status == health_pb2.HealthCheckResponse.SERVING
            stopped: list[bool] = []
            stopping = threading.Thread(target=lambda: stopped.append(handle.call(handle.server.stop(5.0))))
            stopping.start()
            assert next(watcher).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stopping.join(30)
            assert stopped == [True]


def _held(queue_: queue.Queue):
    """A stream's requests, as the test puts them; None ends it."""
    while (request := queue_.get()) is not None:
        yield request


def test_streams_past_max_open_streams_are_refused_as_they_open_and_the_rest_is_served() -> None:
    # gRPC takes every stream a client opens: each held about 30 KiB of the server for as long as its
    # client kept it open (20,000 health watches: +430 MiB), idle or not.
    with running(settings(model(embed_dim=32, num_heads=4), max_open_streams=3)) as handle:
        channel = grpc.insecure_channel(handle.target)  # one connection: one process, in either mode
        open_ = channel.stream_stream(ATTEND_STREAM, request_serializer=None, response_deserializer=None)
        held: list[queue.Queue] = []
        streams = []  # each call held: one the client lets go of, it cancels
        for _ in range(2):
            held.append(queue.Queue())
            held[-1].put(attend_bytes())
            streams.append(open_(_held(held[-1]), timeout=30))
            assert pb.AttendResponse.FromString(next(streams[-1])).output.shape == [4, 32]
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # the third stream
        refused = queue.Queue()
        refused.put(attend_bytes())
        watching = health_pb2_grpc.HealthStub(channel).Watch
        for opening in (
            lambda: next(open_(_held(refused), timeout=30)),
            lambda: next(watching(health_pb2.HealthCheckRequest(service=""), timeout=30)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                opening()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == (
                "streams: the server process on this connection has 3 open, the most one keeps (max_open_streams 3); "
                "close one, or retry later"
            )
        with Client(handle.target, timeout_s=10) as client:  # unary calls go on
            assert client.health() == "SERVING"
        still_serving(handle.target)
        assert handle.sample("attnserve_open_streams") == 3
        assert handle.sample("attnserve_refused_streams_total") == 2
        held.pop().put(None)  # a stream ends: one more may open
        deadline = time.monotonic() + 20
        while True:  # the slot frees once the server's handler has seen the stream end
            held.append(queue.Queue())
            held[-1].put(attend_bytes())
            streams.append(open_(_held(held[-1]), timeout=30))
            try:
                assert pb.AttendResponse.FromString(next(streams[-1])).output.shape == [4, 32]
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
        for q in (*held, refused):
            q.put(None)
        watch.cancel()
        channel.close()
        handle.wait_for(lambda: handle.sample("attnserve_open_streams") == 0)


def test_the_clients_see_a_stream_refused_for_max_open_streams_as_resource_exhausted() -> None:
    one = settings(model(embed_dim=32, num_heads=4), max_open_streams=1, edge_processes=1)  # one process: full
    q = np.ones((4, 32), np.float32)
    with running(one) as handle, Client(handle.target, timeout_s=10) as client:
        held: queue.Queue = queue.Queue()
        held.put({"query": q})
        stream = client.attend_stream(_held(held))
        assert next(stream).output.shape == (4, 32)
        with pytest.raises(AttnServeError) as refused:
            list(client.attend_stream([{"query": q}]))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_open_streams 1" in str(refused.value)

        async def asynchronously() -> None:
            async def one_request():
                yield {"query": q}

            async with AsyncClient(handle.target, timeout_s=10) as aio:
                with pytest.raises(AttnServeError) as refused:
                    async for _ in aio.attend_stream(one_request()):
                        pass
                assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

        asyncio.run(asynchronously())
        held.put(None)
        assert list(stream) == []


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # and an empty SETTINGS


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (what it sends meanwhile is dropped)."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def test_a_connection_that_never_shakes_hands_is_closed_after_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # gRPC's own timeout is 120 s: a client that connected and sent nothing held a descriptor that long
    # (and, under max_connections, a connection's place).
    monkeypatch.setattr(front, "HANDSHAKE_TIMEOUT_S", 0.5)
    with running(settings(model(embed_dim=32, num_heads=4), edge_processes=1)) as handle:  # this process's
        with socket.create_connection(("127.0.0.1", handle.server.port)) as silent:
            assert _closed_within(silent, 10)
        still_serving(handle.target)


def test_connections_past_max_connections_are_closed_as_they_connect() -> None:
    # Each idle HTTP/2 connection held ~14 KiB, and a client could open as many as descriptors allowed
    # (5,000: +67 MiB).
    with running(settings(model(embed_dim=32, num_heads=4), max_connections=3, edge_processes=1)) as handle:
        address = ("127.0.0.1", handle.server.port)
        held = [socket.create_connection(address) for _ in range(3)]
        try:
            for connection in held:
                connection.sendall(_PREFACE)
            with socket.create_connection(address) as extra:
                extra.sendall(_PREFACE)
                assert _closed_within(extra, 10)
            with Client(handle.target, timeout_s=5, retries=False) as client, pytest.raises(AttnServeError) as err:
                client.health()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert not any(_closed_within(c, 0.05) for c in held)  # those held stay
            held.pop().close()  # a place frees once the server has seen the close
            deadline = time.monotonic() + 20
            while True:
                try:
                    still_serving(handle.target)
                    break
                except AttnServeError as refused:
                    assert refused.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
        finally:
            for connection in held:
                connection.close()
