"""The real server on 127.0.0.1:0 and the real clients: behaviour users rely on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import shutil
import subprocess
import threading

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from attnserve import AsyncClient, AttnServeError, Client, Request
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve_server.compute.worker import DeviceWorker
from attnserve_server.edge.dispatch import answer_concurrently
from attnserve_server.errors import WorkerLost
from attnserve_server.runtime.watchdog import Watchdog

from conftest import TEST_EDGES, FailingWorker, Running, model, running, settings

E = 32


def x(*shape: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def fp32(a: np.ndarray, shape: list[int] | None = None, dtype: int = pb.DATA_TYPE_FP32) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape if shape is not None else a.shape, data=a.tobytes())


# -- discovery, health, reflection ----------------------------------------------------------


def test_health_for_the_server_the_service_and_each_model(default_server: Running) -> None:
    with Client(default_server.target) as c:
        assert c.health() == "SERVING"
        assert c.health("attnserve.v1.AttentionService") == "SERVING"
        assert c.health("bare") == "SERVING"
        with pytest.raises(AttnServeError) as err:
            c.health("no-such-model")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_health_watch_tells_every_watcher_each_change_even_after_another_watcher_left() -> None:
    # grpc_health's servicer dropped a service's watchers when the first of them left: the others were
    # never told of a change again.
    def watch(channel: grpc.Channel, service: str):
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Watch(request, timeout=30)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with running(settings(model(embed_dim=32, num_heads=4))) as handle, grpc.insecure_channel(handle.target) as ch:
        leaving, staying, model_watch, unknown = watch(ch, ""), watch(ch, ""), watch(ch, "default"), watch(ch, "x")
        assert [next(w).status for w in (leaving, staying, model_watch)] == [serving] * 3
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        leaving.cancel()
        with pytest.raises(grpc.RpcError):
            next(leaving)
        # A call after the cancel on the same connection: the server has seen the cancel when it answers.
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
        stopping = threading.Thread(target=lambda: handle.call(handle.server.stop(5.0)))
        stopping.start()
        assert next(staying).status == not_serving
        assert next(model_watch).status == not_serving
        stopping.join(30)


def test_model_listing_and_metadata(default_server: Running) -> None:
    with Client(default_server.target) as c:
        models = {m.name: m for m in c.models()}
        assert list(models) == ["default", "bare", "cross", "half"]
        cross = c.model("cross")
        first = c.model()  # empty name: the first configured model
    assert first.name == "default"
    assert (cross.kind, cross.embed_dim, cross.num_heads, cross.kdim, cross.vdim) == ("mha", 32, 4, 24, 40)
    assert cross.output_dim == 32 and models["bare"].output_dim == 16 and models["bare"].kind == "sdpa"
    assert models["half"].dtype == "bfloat16" and cross.devices == ("cpu",) and cross.ready
    assert models["default"].max_query_len == 128 and models["default"].max_batch_size == 64


def test_server_reflection_lists_the_services(default_server: Running) -> None:
    with grpc.insecure_channel(default_server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"attnserve.v1.AttentionService", "grpc.health.v1.Health"} <= names


# -- answers ----------------------------------------------------------------------------------


def test_unbatched_and_batched_queries_keep_their_shape(default_server: Running) -> None:
    with Client(default_server.target) as c:
        one = c.attend(x(5, E), need_weights=True, average_weights=False)
        many = c.attend(x(2, 5, E), need_weights=True)
    assert one.output.shape == (5, E) and one.attention_weights.shape == (4, 5, 5)
    assert many.output.shape == (2, 5, E) and many.attention_weights.shape == (2, 5, 5)
    np.testing.assert_allclose(one.attention_weights.sum(-1), 1.0, atol=1e-5)
    t = one.timing
    assert t.batch_size >= 1 and t.batch_sequences >= 1 and 0 < t.compute_s <= t.server_s and t.queue_s >= 0


def test_bfloat16_model_through_the_client(default_server: Running) -> None:
    q = x(3, E)
    with Client(default_server.target) as c:
        got = c.attend(q, model="half", dtype="bfloat16")
        with pytest.raises(AttnServeError, match=r"query.dtype: expected BF16 \(the dtype of model 'half'\), got FP32"):
            c.attend(q, model="half")
    assert got.output.dtype == np.float32 and got.output.shape == (3, E)
    # Same seeded weights as a float32 model of the same shape: bf16 answers within bf16 precision.
    with Client(default_server.target) as c:
        ref = c.attend(q)  # 'default' has the same shape and seed
    np.testing.assert_allclose(got.output, ref.output, atol=0.05)


def test_async_client_has_the_same_methods(default_server: Running) -> None:
    async def main() -> None:
        async with AsyncClient(default_server.target, timeout_s=30) as c:
            assert await c.health() == "SERVING"
            assert [m.name for m in await c.models()] == ["default", "bare", "cross", "half"]
            assert (await c.model("bare")).vdim == 16
            result = await c.attend(x(4, E), causal=True)
            assert result.output.shape == (4, E)
            with pytest.raises(AttnServeError) as err:
                await c.attend(x(4, E), model="nope")
            assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


# -- bad input --------------------------------------------------------------------------------


def base(**fields) -> pb.AttendRequest:
    msg = pb.AttendRequest(model="default", query=fp32(x(2, 4, E)))
    for name, value in fields.items():
        if isinstance(value, pb.Tensor):
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def bools(a: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=a.shape, data=a.astype(np.uint8).tobytes())


BAD = [
    (pb.AttendRequest(model="default"), "query: required"),
    (
        base(query=fp32(x(2, 4, E).astype(np.float16), dtype=pb.DATA_TYPE_FP16)),
        "query.dtype: expected FP32 (the dtype of model 'default'), got FP16",
    ),
    (
        base(query=pb.Tensor(dtype=99, shape=[4, E], data=b"")),
        "query.dtype: expected FP32 (the dtype of model 'default'), got <99>",
    ),
    (base(query=fp32(x(4 * E), [4 * E])), "query.shape: expected [L, E] or [B, L, E], got [128]"),
    (base(query=fp32(x(4, E), [0, 4, E])), "query.shape: dimensions must be positive, got [0, 4, 32]"),
    (
        base(query=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4, E], data=b"\0" * 100)),
        "query.data: expected 512 bytes for shape [4, 32] FP32, got 100",
    ),
    (base(query=fp32(x(4, 16))), "query.shape[-1]: expected embed_dim 32, got 16 (shape [4, 16])"),
    (
        base(query=fp32(x(129, E))),
        "query.shape: sequence length 129 exceeds model 'default' max_query_len 128",
    ),
    (base(query=fp32(x(65, 1, E))), "query.shape: 65 sequences exceed model 'default' max_batch_size 64"),
    (
        base(key_value=fp32(x(2, 97, E))),
        "key_value.shape: key sequence length 97 exceeds model 'default' max_key_len 96",
    ),
    (base(key_value=fp32(x(3, 5, E))), "key_value.shape: expected 2 sequences like query, got 3"),
    (base(key_value=fp32(x(5, E))), "key_value.shape: expected 3 dimensions, got [5, 32]"),
    (
        base(key_padding_mask=bools(np.zeros((2, 5), bool))),
        "key_padding_mask.shape: expected [B, S] = [2, 4], got [2, 5]",
    ),
    (base(key_padding_mask=fp32(x(2, 4))), "key_padding_mask.dtype: expected BOOL, got FP32"),
    (
        base(key_padding_mask=pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=[2, 4], data=bytes([2] * 8))),
        "key_padding_mask.data: BOOL elements must be bytes 0 or 1",
    ),
    (
        base(key_padding_mask=bools(np.array([[0, 0, 0, 0], [1, 1, 1, 1]]))),
        "key_padding_mask: sequence 1 masks every key; at least one must stay visible",
    ),
    (
        base(causal=True, key_padding_mask=bools(np.array([[0, 0, 0, 0], [1, 0, 0, 0]]))),
        "key_padding_mask: with causal=true key 0 must stay visible",
    ),
    (
        base(key_lengths=pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[2], data=np.array([0, 2], np.int64).tobytes())),
        "key_lengths: expected lengths in 1..4 (the key sequence length), got 0",
    ),
    (
        base(key_lengths=pb.Tensor(dtype=pb.DATA_TYPE_INT32, shape=[3], data=np.array([1, 2, 3], np.int32).tobytes())),
        "key_lengths.shape: expected one length per sequence ([2]), got [3]",
    ),
    (
        base(key_lengths=pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[2], data=x(2).tobytes())),
        "key_lengths.dtype: expected INT32 or INT64, got FP32",
    ),
    (
        base(
            key_padding_mask=bools(np.zeros((2, 4), bool)),
            key_lengths=pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[2], data=np.array([1, 1], np.int64).tobytes()),
        ),
        "key_padding_mask, key_lengths: send at most one of the two",
    ),
    (base(average_weights=True), "average_weights: only meaningful with need_weights=true"),
    (
        base(key_value=fp32(x(2, 4, E)), key=fp32(x(2, 4, E))),
        "key_value: send either key_value or key and value, not both",
    ),
    (base(key=fp32(x(2, 4, E))), "value: key and value go together (or neither, for self attention)"),
]


@pytest.mark.parametrize(("msg", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(default_server: Running, msg, message: str) -> None:
    with grpc.insecure_channel(default_server.target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.AttentionServiceStub(channel).Attend(msg, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


@pytest.mark.parametrize(
    ("model_name", "fields", "message"),
    [
        (
            "bare",
            {"key_value": x(4, E)},
            "key_value: model 'bare' is the bare operation (sdpa): send key and value",
        ),
        ("bare", {"key": x(4, E)}, "value: required by model 'bare' (sdpa takes query, key and value)"),
        (
            "cross",
            {},
            "key, value: required by model 'cross': its kdim 24 and vdim 40 differ from embed_dim 32",
        ),
        (
            "cross",
            {"key_value": x(4, 24)},
            "key_value: model 'cross' has kdim 24 != vdim 40; send key and value",
        ),
        (
            "cross",
            {"key": x(4, 24), "value": x(5, 40)},
            "value.shape: expected [1, 4] sequences and positions like key, got [1, 5]",
        ),
        ("cross", {"key": x(4, 23), "value": x(4, 40)}, "key.shape[-1]: expected kdim 24, got 23"),
    ],
)
def test_bad_input_for_each_model_kind(default_server: Running, model_name: str, fields: dict, message: str) -> None:
    with Client(default_server.target) as c, pytest.raises(AttnServeError) as err:
        c.attend(x(4, E), model=model_name, **fields)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message


def test_bad_input_never_reaches_a_worker_and_the_server_keeps_serving(default_server: Running) -> None:
    tokens = default_server.sample("attnserve_tokens_total", model="default")
    invalid = default_server.sample(
        "attnserve_requests_total", model="default", method="Attend", code="INVALID_ARGUMENT"
    )
    with grpc.insecure_channel(default_server.target) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        for msg, _ in BAD:
            with pytest.raises(grpc.RpcError):
                stub.Attend(msg, timeout=30)
    assert default_server.sample("attnserve_tokens_total", model="default") == tokens
    after = default_server.sample("attnserve_requests_total", model="default", method="Attend", code="INVALID_ARGUMENT")
    assert after - invalid == len(BAD)
    with Client(default_server.target) as c:
        assert c.attend(x(3, E)).output.shape == (3, E)


def test_unknown_model_is_not_found(default_server: Running) -> None:
    with Client(default_server.target) as c, pytest.raises(AttnServeError) as err:
        c.attend(x(3, E), model="gpt")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert "no model named 'gpt'; served: bare, cross, default, half" in err.value.message


def test_messages_over_the_size_limit_are_refused() -> None:
    limited = settings(model(embed_dim=E, num_heads=4), max_message_bytes=4096)
    with (
        running(limited) as handle,
        Client(handle.target, max_message_bytes=1 << 20) as c,
        pytest.raises(AttnServeError) as err,
    ):
        c.attend(x(64, E))  # 8 KiB of query
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- streaming --------------------------------------------------------------------------------


def stream_requests() -> list[Request]:
    return [
        Request(query=x(3, E), request_id="a"),
        Request(query=x(3, 16), request_id="bad"),
        Request(query=x(5, E), causal=True),  # gets id "2": its index
        Request(query=x(4, E), model="bare", key=x(6, E), value=x(6, 16), request_id="d"),
    ]


def check_stream(results) -> None:
    by_id = {r.request_id: r for r in results}
    assert set(by_id) == {"a", "bad", "2", "d"}
    assert by_id["a"].output.shape == (3, E) and by_id["2"].output.shape == (5, E)
    assert by_id["d"].output.shape == (4, 16) and by_id["d"].model == "bare"
    error = by_id["bad"].error
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "query.shape[-1]: expected embed_dim 32, got 16" in error.message


def test_stream_answers_every_request_and_a_bad_one_does_not_end_it(default_server: Running) -> None:
    with Client(default_server.target, timeout_s=30) as c:
        check_stream(list(c.attend_stream(stream_requests())))


def test_async_stream(default_server: Running) -> None:
    async def main() -> list:
        async with AsyncClient(default_server.target, timeout_s=30) as c:
            return [r async for r in c.attend_stream(stream_requests())]

    check_stream(asyncio.run(main()))


def test_an_async_client_made_outside_any_loop_serves_each_asyncio_run(default_server: Running) -> None:
    # grpc.aio binds a channel to the loop current when it is made: before, a client made at import
    # failed every call "attached to a different loop", in the first asyncio.run and every later one.
    client = AsyncClient(default_server.target, timeout_s=30)

    async def main() -> list[str]:
        first = await client.attend(x(3, E), request_id="one")
        return [first.request_id] + [r.request_id async for r in client.attend_stream(stream_requests())]

    assert sorted(asyncio.run(main())) == ["2", "a", "bad", "d", "one"]
    assert asyncio.run(client.health()) == "SERVING"
    other = asyncio.new_event_loop()
    try:  # a loop that is still open owns the channel: another loop's call is refused by name
        assert other.run_until_complete(client.health()) == "SERVING"
        with pytest.raises(RuntimeError, match="AsyncClient: its channel belongs to another event loop"):
            asyncio.run(client.health())
        other.run_until_complete(client.close())
    finally:
        other.close()


def test_async_stream_sends_from_an_async_source_as_answers_come_back(default_server: Running) -> None:
    # A conversation: the second request is produced only after the first one's answer arrived,
    # which a list or any blocking iterable could not do on the event loop.
    async def main() -> list:
        first_answered = asyncio.Event()

        async def produce():
            yield {"query": x(3, E), "request_id": "first"}
            await first_answered.wait()
            yield Request(query=x(5, E), causal=True)  # gets id "1": its index

        seen = []
        async with AsyncClient(default_server.target, timeout_s=30) as c:
            async for result in c.attend_stream(produce()):
                seen.append(result)
                first_answered.set()
        return seen

    results = asyncio.run(main())
    assert [r.request_id for r in results] == ["first", "1"]
    assert results[0].output.shape == (3, E) and results[1].output.shape == (5, E)
    assert all(r.error is None for r in results)


class Broke(Exception):
    """The caller's own failure, raised by its iterable of stream requests."""


def breaking_requests():
    yield {"query": x(3, E), "request_id": "a"}
    yield {"query": x(4, E), "request_id": "b"}
    raise Broke("the caller's source of requests failed")


def not_encodable_requests():
    yield {"query": x(3, E), "request_id": "a"}
    yield {"query": "not an array", "request_id": "b"}


async def breaking_async_requests():
    for request in breaking_requests():
        yield request


def test_a_stream_whose_requests_raise_answers_those_sent_then_raises_the_callers_exception(
    default_server: Running,
) -> None:
    # gRPC cancels such a call and reports UNKNOWN "Exception iterating requests!" (grpc.aio: INTERNAL),
    # losing the answers in flight and the caller's exception.
    with Client(default_server.target, timeout_s=30) as c:
        seen = []
        with pytest.raises(Broke, match="source of requests failed"):
            for result in c.attend_stream(breaking_requests()):
                seen.append(result.request_id)
        assert sorted(seen) == ["a", "b"]
        seen.clear()
        with pytest.raises(ValueError, match="query: unsupported dtype"):
            for result in c.attend_stream(not_encodable_requests()):
                seen.append(result.request_id)
        assert seen == ["a"]

    async def main(requests) -> list[str]:
        seen = []
        async with AsyncClient(default_server.target, timeout_s=30) as c:
            with pytest.raises(Broke, match="source of requests failed"):
                async for result in c.attend_stream(requests):
                    seen.append(result.request_id)
        return sorted(seen)

    assert asyncio.run(main(breaking_requests())) == ["a", "b"]
    assert asyncio.run(main(breaking_async_requests())) == ["a", "b"]


def test_a_stream_is_read_at_most_its_window_ahead_of_the_answers_sent() -> None:
    async def main() -> None:
        pulled = 0

        async def messages():
            nonlocal pulled
            for i in range(10):
                pulled += 1
                yield i

        async def answer(message: int) -> int:
            return message

        async def settle() -> None:  # every task runs as far as it can (no clock involved)
            for _ in range(50):
                await asyncio.sleep(0)

        stream = answer_concurrently(messages(), answer, window=3)
        answers = [await anext(stream)]  # taken, not yet sent: it still holds its place
        await settle()
        assert pulled == 3
        answers.append(await anext(stream))  # the first one went out: one more may be read
        await settle()
        assert pulled == 4
        answers += [a async for a in stream]
        assert sorted(answers) == list(range(10))

    asyncio.run(main())


def test_a_stream_that_sends_faster_than_it_is_answered_is_held_back_not_refused() -> None:
    # The queue holds two requests and the window is two: the third request is not read (so not
    # refused RESOURCE_EXHAUSTED) until an answer has gone out. Here that happens only as the server
    # stops, so the third one is either not read at all or read once the first answer went out, and
    # answered UNAVAILABLE in band: the server is stopping.
    with (
        running(held(stream_window=2)) as handle,
        Client(handle.target, timeout_s=60) as c,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):

        def consume() -> tuple[list, AttnServeError | None]:
            results = []
            try:
                for result in c.attend_stream([Request(query=x(3, E)) for _ in range(3)]):
                    results.append(result)
            except AttnServeError as exc:
                return results, exc
            return results, None

        done = pool.submit(consume)
        handle.wait_for(lambda: handle.sample("attnserve_queue_depth", model="default") == 2)
        handle.call(handle.server.stop(10))  # answers the two accepted, then ends the stream
        results, error = done.result(timeout=30)
        answered = {r.request_id: r.error for r in results}
        assert answered["0"] is None and answered["1"] is None
        refused = [answered[i].code for i in answered if answered[i] is not None]
        assert refused in ([], [grpc.StatusCode.UNAVAILABLE]), refused
        assert error is None or error.code == grpc.StatusCode.UNAVAILABLE  # once every request read is answered


def test_many_stream_requests_batch_together(default_server: Running) -> None:
    requests = [Request(query=x(2, E), request_id=str(i)) for i in range(40)]
    with Client(default_server.target, timeout_s=30) as c:
        results = list(c.attend_stream(requests))
    assert sorted(int(r.request_id) for r in results) == list(range(40))
    assert all(r.error is None for r in results)


# -- waiting, deadlines, cancellation, overload ----------------------------------------------


def held(**fields: object) -> object:
    """A model whose batches wait a minute for company: requests stay queued until shutdown."""
    return settings(model(embed_dim=E, num_heads=4, max_queue_delay_ms=60_000, max_queue_size=2), **fields)


def test_a_request_whose_deadline_passes_in_the_queue_is_not_computed() -> None:
    with running(held()) as handle:
        with Client(handle.target) as c, pytest.raises(AttnServeError) as err:
            c.attend(x(3, E), timeout_s=0.3)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        handle.wait_for(
            lambda: handle.sample("attnserve_dropped_requests_total", model="default", reason="deadline_exceeded") == 1
        )
        assert handle.sample("attnserve_queue_depth", model="default") == 0
        assert handle.sample("attnserve_tokens_total", model="default") == 0


def test_a_stream_deadline_applies_to_every_request_in_it() -> None:
    with running(held()) as handle:
        requests = [Request(query=x(3, E)), Request(query=x(4, E))]
        with Client(handle.target) as c, pytest.raises(AttnServeError) as err:
            list(c.attend_stream(requests, timeout_s=0.3))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        handle.wait_for(
            lambda: handle.sample("attnserve_dropped_requests_total", model="default", reason="deadline_exceeded") == 2
        )
        assert handle.sample("attnserve_tokens_total", model="default") == 0


def test_streams_that_end_while_their_requests_compute_leave_the_server_serving() -> None:
    # A stream's requests are answered by tasks that outlive it a moment; reading the call's peer from one
    # of them (to count its answer against the connection) crashed the server with a segmentation fault,
    # every run of this test, before the peer was read once, when the stream started.
    rng = random.Random(0)
    outcomes: dict[str, int] = {}

    async def one(c: AsyncClient) -> None:
        requests = [Request(query=x(64, E), need_weights=True) for _ in range(64)]
        try:
            async for i, _ in aenumerate(c.attend_stream(requests, timeout_s=rng.choice([0.02, 0.05, 0.1, 0.2]))):
                if i == 2 and rng.random() < 0.5:
                    break  # the client walks away
            outcome = "OK"
        except AttnServeError as exc:
            outcome = exc.code.name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def main(target: str) -> None:
        async with AsyncClient(target, retries=False) as c:
            for _ in range(10):
                await asyncio.gather(*(one(c) for _ in range(40)))

    with running(settings(model(embed_dim=E, num_heads=4), edge_processes=1)) as handle:
        asyncio.run(main(handle.target))
        assert set(outcomes) <= {"OK", "DEADLINE_EXCEEDED"} and outcomes.get("DEADLINE_EXCEEDED", 0) > 0, outcomes
        with Client(handle.target, timeout_s=30) as c:
            assert c.attend(x(3, E)).output.shape == (3, E)


async def aenumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


def test_an_async_stream_whose_deadline_passes_as_it_sends_ends_deadline_exceeded(default_server: Running) -> None:
    # Deadlines of a millisecond or so pass while grpc.aio's own task is still writing the requests or
    # half-closing; with the status lost it said INTERNAL "Internal error from Core" (about half of these
    # streams), or cancelled the call so that reading it raised asyncio.CancelledError (client/_aio.py).
    outcomes: dict[str, int] = {}

    async def one(c: AsyncClient, timeout_s: float) -> None:
        requests = [Request(query=x(3, E)), Request(query=x(4, E), causal=True)]
        try:
            answered = [r async for r in c.attend_stream(requests, timeout_s=timeout_s)]
            outcome = "OK" if len(answered) == 2 else f"{len(answered)} answers"
        except AttnServeError as exc:
            outcome = exc.code.name if exc.code != grpc.StatusCode.INTERNAL else f"INTERNAL: {exc.message}"
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
            outcome = "CancelledError"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def main() -> None:
        async with AsyncClient(default_server.target) as c:
            await c.attend(x(3, E), timeout_s=30)  # connected
            for _ in range(10):
                await asyncio.gather(*(one(c, t) for t in [0.0005, 0.001, 0.002, 0.004] * 5))

    asyncio.run(main())
    assert outcomes.get("DEADLINE_EXCEEDED", 0) > 0
    assert set(outcomes) <= {"OK", "DEADLINE_EXCEEDED"}, outcomes
    with Client(default_server.target, timeout_s=30) as c:  # and the server serves on
        assert c.attend(x(3, E)).output.shape == (3, E)


def test_an_async_stream_the_server_ends_while_it_sends_ends_with_the_servers_status() -> None:
    # The server refuses message 20 (over its size limit) and ends the stream while grpc.aio's task is still
    # writing messages 21 on: the failed write replaced the status, so that about a third of these streams
    # ended INTERNAL "status lost" instead of RESOURCE_EXHAUSTED (client/_aio.py).
    outcomes: dict[str, int] = {}

    async def one(c: AsyncClient) -> None:
        requests = [Request(query=x(2048 if i == 20 else 4, E)) for i in range(200)]  # 256 KiB at 20
        try:
            answered = [r async for r in c.attend_stream(requests)]
            outcome = f"OK after {len(answered)}"
        except AttnServeError as exc:
            outcome = f"{exc.code.name}: {exc.message}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def main(target: str) -> None:
        async with AsyncClient(target, timeout_s=60) as c:
            await asyncio.gather(*(one(c) for _ in range(40)))

    with running(settings(model(embed_dim=E, num_heads=4), max_message_bytes=192 << 10)) as handle:
        asyncio.run(main(handle.target))
        with Client(handle.target, timeout_s=30) as c:  # and the server serves on
            assert c.attend(x(3, E)).output.shape == (3, E)
    assert len(outcomes) == 1, outcomes
    outcome = next(iter(outcomes))
    assert outcome.startswith("RESOURCE_EXHAUSTED: ") and "larger than max" in outcome, outcomes


def test_an_answer_grpc_could_not_send_is_one_debug_line_not_an_error_traceback(caplog) -> None:
    # grpc.aio logs it so, at ERROR with a traceback, when a call ended (its deadline passed, say) just as
    # its answer or status went out: a few a second under load with short deadlines (BENCHMARKS.md, the
    # fifty-seventh pass). The race cannot be timed from outside, so the record is made as grpc makes it.
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    method = "/attnserve.v1.AttentionService/Attend"

    def log_as_grpc() -> None:
        try:
            raise RuntimeError('Failed "execute_batch": (<SendStatusFromServerOperation>,)')
        except RuntimeError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]" % method)  # noqa: UP031

    with running(settings(model(embed_dim=E, num_heads=4), edge_processes=1)) as handle:
        with caplog.at_level(logging.INFO):
            log_as_grpc()
            grpc_log.error("any other error of grpc's")
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("ERROR", "any other error of grpc's")]
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            log_as_grpc()
        (record,) = caplog.records
        assert record.levelno == logging.DEBUG and record.exc_info is None and record.exc_text is None
        assert record.getMessage() == (
            f"an answer for [{method}] was not sent: its call had already ended (deadline, cancel or disconnect)"
        )
        with Client(handle.target, timeout_s=30) as c:
            assert c.attend(x(3, E)).output.shape == (3, E)


def test_a_cancelled_call_is_dropped_before_compute() -> None:
    with running(held()) as handle:

        async def main() -> None:
            async with AsyncClient(handle.target) as c:
                task = asyncio.ensure_future(c.attend(x(3, E)))
                while await asyncio.to_thread(handle.sample, "attnserve_queue_depth", model="default") < 1:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        handle.wait_for(
            lambda: handle.sample("attnserve_dropped_requests_total", model="default", reason="cancelled") == 1
        )
        assert handle.sample("attnserve_queue_depth", model="default") == 0
        assert handle.sample("attnserve_tokens_total", model="default") == 0


def test_a_full_queue_answers_resource_exhausted_at_once_and_loses_nothing_accepted() -> None:
    with (
        running(held()) as handle,
        Client(handle.target, timeout_s=60) as c,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        accepted = [pool.submit(c.attend, x(3, E)) for _ in range(2)]
        handle.wait_for(lambda: handle.sample("attnserve_queue_depth", model="default") == 2)
        with pytest.raises(AttnServeError) as err:
            c.attend(x(3, E), timeout_s=5)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full (2 requests waiting)" in err.value.message
        assert handle.sample("attnserve_dropped_requests_total", model="default", reason="queue_full") == 1
        # A graceful stop runs what was accepted at once.
        handle.call(handle.server.stop(10))
        assert [f.result(timeout=30).output.shape for f in accepted] == [(3, E), (3, E)]


def test_a_failing_batch_fails_only_its_requests_and_the_worker_keeps_serving() -> None:
    with running(settings(model(embed_dim=E, num_heads=4, max_batch_size=1)), worker_factory=FailingWorker) as handle:
        bad = x(3, E)
        bad[0, 0] = 1234.0
        with Client(handle.target, timeout_s=30) as c:
            with pytest.raises(AttnServeError) as err:
                c.attend(bad)
            assert err.value.code == grpc.StatusCode.INTERNAL
            assert "the batch failed on its worker: RuntimeError: injected fault" in err.value.message
            assert c.attend(x(3, E)).output.shape == (3, E)
        assert handle.sample("attnserve_batch_failures_total", model="default", device="cpu") == 1


class SmallMemoryWorker(DeviceWorker):
    """Runs out of device memory for a batch of three or more requests (warm-up runs two), and for a query
    whose first element is 999 even alone (faults injected for the test)."""

    def _run(self, requests):  # under DeviceWorker.run, which turns torch's error into the answer
        if len(requests) > 2 or np.frombuffer(requests[0].query.data, dtype="<f4", count=1)[0] == 999.0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super()._run(requests)


@pytest.mark.parametrize(
    ("factory", "marker", "code", "message"),
    [
        # A fault in one request: the batch fails, then that request alone.
        (FailingWorker, 1234.0, "INTERNAL", "alone after its batch of 3 failed: RuntimeError: injected fault"),
        # A batch too large for the device's memory: each request fits alone, but one never does.
        (SmallMemoryWorker, 999.0, "RESOURCE_EXHAUSTED", "ran out of memory for a batch of 1 request(s), 1 sequence"),
    ],
    ids=["fault", "out-of-memory"],
)
def test_a_batch_that_fails_runs_again_a_request_at_a_time_and_only_a_request_that_fails_alone_fails(
    factory, marker: float, code: str, message: str
) -> None:
    # The batch closes at three requests (and never by delay).
    config = settings(model(embed_dim=E, num_heads=4, max_batch_size=3, max_queue_delay_ms=60_000))
    with (
        running(config, worker_factory=factory) as handle,
        Client(handle.target, timeout_s=30) as c,
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        bad = x(3, E)
        bad[0, 0] = marker
        futures = [pool.submit(c.attend, q) for q in (x(3, E) + 1, bad, x(3, E) - 1)]
        with pytest.raises(AttnServeError) as err:
            futures[1].result(timeout=30)
        assert err.value.code.name == code and message in err.value.message
        for future in (futures[0], futures[2]):
            answer = future.result(timeout=30)
            assert answer.timing.batch_size == 1  # answered from its run alone
            assert answer.output.shape == (3, E) and np.isfinite(answer.output).all()
        # The batch of three, then the bad request alone.
        assert handle.sample("attnserve_batch_failures_total", model="default", device="cpu") == 2


def test_the_watchdog_reports_the_first_batch_computing_too_long_once() -> None:
    ages = {"default": 0.0, "other": 0.0}
    stalled: list[tuple[str, float]] = []
    called = threading.Event()

    def on_stall(model: str, age_s: float) -> None:
        stalled.append((model, age_s))
        called.set()

    dog = Watchdog(0.2, [lambda name=name: (name, ages[name]) for name in ages], on_stall)
    dog.start()
    try:
        assert not called.wait(0.5)  # nothing computing: no verdict
        ages["other"] = 0.15  # under the limit
        assert not called.wait(0.3)
        ages["default"], ages["other"] = 4.0, 3.0
        assert called.wait(5)
    finally:
        dog.close()
    assert stalled == [("default", 4.0)]  # one verdict: the process ends with it


class LosingWorker(DeviceWorker):
    """Loses its device at a query whose first element is 4321 (a fault injected for the test)."""

    def run(self, requests):
        if any(np.frombuffer(r.query.data, dtype="<f4", count=1)[0] == 4321.0 for r in requests):
            raise WorkerLost(f"{self.name} can compute no more: RuntimeError: CUDA error: device-side assert")
        return super().run(requests)


class GatedWorker(DeviceWorker):
    """Holds a batch with a query whose first element is 4321 until the test opens `gate`."""

    entered = threading.Event()
    gate = threading.Event()

    def run(self, requests):
        if any(np.frombuffer(r.query.data, dtype="<f4", count=1)[0] == 4321.0 for r in requests):
            GatedWorker.entered.set()
            assert GatedWorker.gate.wait(60), "the test never opened the gate"
        return super().run(requests)


def test_a_request_refused_while_the_server_drains_names_its_model_and_counts_as_a_drop() -> None:
    # With edge processes the edge refused it from the engine's board, in the batcher's words and
    # without the model's name; in one process the model refused it and no drop was counted.
    GatedWorker.entered.clear()
    GatedWorker.gate.clear()
    with (
        running(settings(model(embed_dim=E, num_heads=4), solo_macs=0), worker_factory=GatedWorker) as handle,
        Client(handle.target, timeout_s=30, retries=False) as c,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        try:
            held = pool.submit(c.attend, np.full((3, E), 4321.0, np.float32))
            assert GatedWorker.entered.wait(30)
            stopping = pool.submit(handle.call, handle.server.stop(30))  # drains: waits for the held batch
            handle.wait_for(lambda: c.health() == "NOT_SERVING")
            with pytest.raises(AttnServeError) as refused:
                c.attend(x(3, E))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert "model 'default': the server is shutting down" in refused.value.message, refused.value.message
            assert handle.sample("attnserve_dropped_requests_total", model="default", reason="shutting_down") == 1
        finally:
            GatedWorker.gate.set()
        assert held.result(30).output.shape == (3, E)  # what was accepted is answered
        assert stopping.result(30) is True


def test_a_worker_whose_device_is_lost_fails_the_server_which_answers_unavailable_and_reports_not_serving() -> None:
    tc = pytest.importorskip("tritonclient.grpc")
    with running(settings(model(embed_dim=E, num_heads=4)), worker_factory=LosingWorker) as handle:
        client = tc.InferenceServerClient(handle.target)
        query = tc.InferInput("query", [1, 3, E], "FP32")
        query.set_data_from_numpy(np.full((1, 3, E), 4321.0, np.float32))
        try:
            with pytest.raises(tc.InferenceServerException) as err:
                client.infer("default", [query])
            assert err.value.status() == "StatusCode.UNAVAILABLE"
            assert "cpu can compute no more" in err.value.message()
            # The server stops (`attnserve serve` then exits 1, as when an edge dies), meanwhile refusing.
            handle.wait_for(handle.server.failed.is_set)
            with Client(handle.target, timeout_s=5) as c:
                with pytest.raises(AttnServeError) as refused:
                    c.attend(x(3, E))
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE
                assert "batcher stopped" in refused.value.message
                if TEST_EDGES == 1:  # the model's own health; edges report the server's as one
                    assert c.health("default") == "NOT_SERVING"
        finally:
            client.close()


def test_unreachable_server_is_unavailable_and_wait_for_ready_waits_for_the_deadline() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"127.0.0.1:{port}", timeout_s=5) as c, pytest.raises(AttnServeError) as err:
        c.attend(x(3, E))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(f"127.0.0.1:{port}", wait_for_ready=True) as c, pytest.raises(AttnServeError) as err:
        c.attend(x(3, E), timeout_s=0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


# -- metrics ----------------------------------------------------------------------------------

METRICS = [
    "attnserve_requests_total",
    "attnserve_request_duration_seconds_bucket",
    "attnserve_queue_wait_seconds_bucket",
    "attnserve_compute_duration_seconds_bucket",
    "attnserve_batch_requests_bucket",
    "attnserve_batch_sequences_bucket",
    "attnserve_batch_tokens_bucket",
    "attnserve_batch_padding_ratio_bucket",
    "attnserve_tokens_total",
    "attnserve_cpu_batches_total",
    "attnserve_dropped_requests_total",
    "attnserve_queue_depth",
    "attnserve_inflight_requests",
    "attnserve_model_info",
]


def test_metrics_are_scraped_with_the_requests_counted(default_server: Running) -> None:
    before = default_server.sample("attnserve_requests_total", model="bare", method="Attend", code="OK")
    tokens = default_server.sample("attnserve_tokens_total", model="bare")

    # 2·5·7·(64+16) multiply-adds a request: too few for two threads, so each batch runs on one
    def one_thread() -> float:
        return default_server.sample("attnserve_cpu_batches_total", model="bare", device="cpu", threads="1")

    one_thread_before = one_thread()
    with Client(default_server.target) as c:
        for _ in range(3):
            c.attend(x(2, 5, E), model="bare", key=x(2, 7, E), value=x(2, 7, 16))
    text = default_server.metrics_text()
    for name in METRICS:
        assert f"\n{name}{{" in text, name
    assert default_server.sample("attnserve_requests_total", model="bare", method="Attend", code="OK") == before + 3
    assert default_server.sample("attnserve_tokens_total", model="bare") == tokens + 30
    assert one_thread() == one_thread_before + 3
    assert (
        default_server.sample("attnserve_request_duration_seconds_bucket", model="bare", method="Attend", le="10.0")
        >= 3
    )
    assert default_server.sample("attnserve_model_info", model="bare", kind="sdpa", dtype="float32") == 1
    assert default_server.sample("attnserve_inflight_requests", model="bare") == 0


def test_an_unknown_model_is_counted_under_an_empty_label_in_the_request_series_only(default_server: Running) -> None:
    def not_found() -> float:
        return default_server.sample("attnserve_requests_total", model="", method="Attend", code="NOT_FOUND")

    before = not_found()
    with Client(default_server.target) as c, pytest.raises(AttnServeError) as err:
        c.attend(x(1, 3, E), model="no-such-model")
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    assert not_found() == before + 1
    # It has no queue and never batches: a dashboard summing batch series by model sees no "" model.
    unknown = [
        line
        for line in default_server.metrics_text().splitlines()
        if 'model=""' in line
        and not line.startswith(("attnserve_requests_", "attnserve_request_duration_seconds_", "attnserve_inflight_"))
    ]
    assert not unknown, unknown[:5]


def test_promtool_finds_nothing_to_complain_about(default_server: Running) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (./dev test installs it with apt-get)")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=default_server.metrics_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_device_falls_back_to_the_cpu() -> None:
    with (
        running(settings(model(embed_dim=E, num_heads=4, device=("auto",)))) as handle,
        Client(handle.target) as c,
    ):
        assert c.model().devices == ("cpu",)


def test_a_model_that_fails_to_load_stops_start_and_releases_the_port(tmp_path) -> None:
    import socket

    from attnserve_server import AttnServer
    from attnserve_server.errors import ConfigError
    from attnserve_server.settings import WeightsSettings

    missing = WeightsSettings(format="torch", path=str(tmp_path / "missing.safetensors"))
    server = AttnServer(settings(model(embed_dim=E, num_heads=4, weights=missing)))
    with pytest.raises(ConfigError, match="cannot read"):
        asyncio.run(server.start())
    assert server.port
    with socket.socket() as s:
        s.bind(("127.0.0.1", server.port))  # free again


def test_allow_tf32_turns_tf32_on_for_the_process_and_is_off_by_default() -> None:
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default, and ours
    try:
        with running(settings(model(embed_dim=E, num_heads=4), allow_tf32=True)) as handle, Client(handle.target) as c:
            assert torch.backends.cuda.matmul.allow_tf32
            assert c.model().dtype == "float32"  # auto on the CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def test_float16_on_a_cpu_without_float16_instructions_logs_a_warning(caplog, monkeypatch, tmp_path) -> None:
    from attnserve_server import model as served
    from attnserve_server.compute.devices import cpu_flags, float16_is_slow

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()
    assert float16_is_slow(cpu_flags(str(cpuinfo))) and not float16_is_slow(frozenset({"avx512_fp16"}))

    warning = "float16 on a CPU without float16 matrix instructions"
    for flags, warned in ((frozenset({"avx512f", "avx512_bf16"}), True), (frozenset({"amx_fp16"}), False)):
        monkeypatch.setattr(served, "cpu_flags", lambda flags=flags: flags)
        caplog.clear()
        half = settings(model(embed_dim=E, num_heads=4, dtype="float16", device=("cpu",)))
        with caplog.at_level(logging.WARNING, logger="attnserve_server.model"), running(half):
            pass
        assert any(warning in r.getMessage() for r in caplog.records) == warned


def test_bfloat16_on_an_x86_cpu_without_bfloat16_kernels_logs_a_warning(caplog, monkeypatch) -> None:
    from attnserve_server import model as served
    from attnserve_server.compute.devices import bfloat16_is_slow

    zen2 = frozenset({"sse2", "avx", "avx2", "fma"})  # AMD EPYC Zen 2: AVX2 only
    assert bfloat16_is_slow(zen2)
    assert not bfloat16_is_slow(zen2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert not bfloat16_is_slow(zen2 | {"avx_ne_convert"})
    assert not bfloat16_is_slow(frozenset({"fp", "asimd", "bf16"}))  # not x86: not this rule's to judge

    warning = "bfloat16 on a CPU with none of avx512bw+avx512dq+avx512vl or avx_ne_convert"
    for dtype, flags, warned in (
        ("bfloat16", zen2, True),
        ("float32", zen2, False),
        ("bfloat16", zen2 | {"avx_ne_convert"}, False),
    ):
        monkeypatch.setattr(served, "cpu_flags", lambda flags=flags: flags)
        caplog.clear()
        served_settings = settings(model(embed_dim=E, num_heads=4, dtype=dtype, device=("cpu",)))
        with caplog.at_level(logging.WARNING, logger="attnserve_server.model"), running(served_settings):
            pass
        assert any(warning in r.getMessage() for r in caplog.records) == warned, (dtype, flags)
