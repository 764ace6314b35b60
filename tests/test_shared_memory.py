"""Triton's system shared memory extension (--allow-client-shm), driven by the real tritonclient and
its shared memory helpers: regions registered, inputs read from them, outputs written to them."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as triton
from tritonclient.grpc import service_pb2_grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from conftest import Running, model, run_cli, running, settings

E, H, L = 32, 4, 8
pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    models = (
        model("default", embed_dim=E, num_heads=H, max_batch_size=8, max_queue_delay_ms=2),
        model("bare", kind="sdpa", embed_dim=E, num_heads=H, vdim=16),
        model("half", embed_dim=E, num_heads=H, dtype="bfloat16"),
    )
    with running(settings(*models, allow_client_shm=True)) as handle:
        yield handle


@pytest.fixture
def client(server: Running) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.target)
    yield c
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def region() -> Iterator:
    """A fresh shared memory object of 64 KiB, with a region name and key of its own."""
    tag = uuid.uuid4().hex[:12]
    handle = shm.create_shared_memory_region(f"r-{tag}", f"/attnserve-test-{tag}", 1 << 16)
    yield handle
    shm.destroy_shared_memory_region(handle)


def x(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def reference(client: tc.InferenceServerClient, query: np.ndarray, model_name: str = "default", **inputs) -> dict:
    """The same request with every tensor in the message."""
    tensors = [tc.InferInput("query", list(query.shape), "FP32")]
    tensors[0].set_data_from_numpy(query)
    for name, array in inputs.items():
        t = tc.InferInput(name, list(array.shape), "FP32")
        t.set_data_from_numpy(array)
        tensors.append(t)
    outputs = [tc.InferRequestedOutput("output"), tc.InferRequestedOutput("attention_weights")]
    result = client.infer(model_name, tensors, outputs=outputs if model_name == "default" else None)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def test_server_metadata_names_the_extension(client: tc.InferenceServerClient) -> None:
    assert "system_shared_memory" in client.get_server_metadata().extensions


def test_register_status_and_unregister(server: Running, client: tc.InferenceServerClient, region) -> None:
    name, key = region._triton_shm_name, region._shm_key
    client.register_system_shared_memory(name, key, 4096, offset=1024)
    assert server.sample("attnserve_shared_memory_regions") == 1
    assert server.sample("attnserve_shared_memory_region_bytes") == 4096
    status = client.get_system_shared_memory_status(name)
    assert [(r.name, r.key, r.offset, r.byte_size) for r in status.regions.values()] == [(name, key, 1024, 4096)]
    assert name in client.get_system_shared_memory_status().regions
    with pytest.raises(InferenceServerException) as err:
        client.register_system_shared_memory(name, key, 16)
    assert err.value.status() == "StatusCode.ALREADY_EXISTS"
    client.unregister_system_shared_memory(name)
    assert name not in client.get_system_shared_memory_status().regions
    assert server.sample("attnserve_shared_memory_regions") == 0
    with pytest.raises(InferenceServerException) as err:
        client.get_system_shared_memory_status(name)
    assert err.value.status() == "StatusCode.NOT_FOUND"
    client.unregister_system_shared_memory(name)  # not registered: nothing to do, as in Triton


def test_inputs_and_outputs_in_shared_memory_match_the_message_path(client: tc.InferenceServerClient, region) -> None:
    query = x(2, L, E)
    expected = reference(client, query)
    name = region._triton_shm_name
    shm.set_shared_memory_region(region, [query])
    client.register_system_shared_memory(name, region._shm_key, 1 << 16)
    out_offset, weights_offset = 8192, 16384
    query_in = tc.InferInput("query", list(query.shape), "FP32")
    query_in.set_shared_memory(name, query.nbytes)
    output = tc.InferRequestedOutput("output")
    output.set_shared_memory(name, 8192, offset=out_offset)
    weights = tc.InferRequestedOutput("attention_weights")  # this one comes in the message
    result = client.infer("default", [query_in], outputs=[output, weights])
    response = result.get_response()
    # As Triton answers: the outputs in the order asked, and a raw_output_contents entry for each, the one
    # in shared memory empty (Triton's C++ client, perf_analyzer's, reads an entry for every output).
    assert [o.name for o in response.outputs] == ["output", "attention_weights"]
    assert response.raw_output_contents[0] == b""
    assert len(response.raw_output_contents) == 2
    np.testing.assert_array_equal(result.as_numpy("attention_weights"), expected["attention_weights"])
    placed = response.outputs[0]
    assert list(placed.shape) == [2, L, E]
    assert placed.parameters["shared_memory_region"].string_param == name
    assert placed.parameters["shared_memory_byte_size"].int64_param == expected["output"].nbytes
    assert placed.parameters["shared_memory_offset"].int64_param == out_offset
    got = shm.get_contents_as_numpy(region, np.float32, [2, L, E], offset=out_offset)
    np.testing.assert_array_equal(got, expected["output"])
    # Both outputs in shared memory: the response carries no tensor bytes at all.
    weights.set_shared_memory(name, 4096, offset=weights_offset)
    response = client.infer("default", [query_in], outputs=[output, weights]).get_response()
    assert list(response.raw_output_contents) == [b"", b""]
    got = shm.get_contents_as_numpy(region, np.float32, expected["attention_weights"].shape, offset=weights_offset)
    np.testing.assert_array_equal(got, expected["attention_weights"])


def test_some_inputs_in_shared_memory_and_others_raw(client: tc.InferenceServerClient, region) -> None:
    """The bare operation, key in shared memory at an offset, query and value in the message."""
    q, k, v = x(1, L, E), x(1, 5, E), x(1, 5, 16)
    expected = reference(client, q, "bare", key=k, value=v)
    name = region._triton_shm_name
    shm.set_shared_memory_region(region, [k], offset=512)
    client.register_system_shared_memory(name, region._shm_key, 1 << 16)
    inputs = [
        tc.InferInput("query", [1, L, E], "FP32"),
        tc.InferInput("key", [1, 5, E], "FP32"),
        tc.InferInput("value", [1, 5, 16], "FP32"),
    ]
    inputs[0].set_data_from_numpy(q)
    inputs[1].set_shared_memory(name, k.nbytes, offset=512)
    inputs[2].set_data_from_numpy(v)
    result = client.infer("bare", inputs)
    np.testing.assert_array_equal(result.as_numpy("output"), expected["output"])


def test_a_stream_takes_shared_memory_too(server: Running, region) -> None:
    import queue

    query = x(1, L, E)
    name = region._triton_shm_name
    shm.set_shared_memory_region(region, [query])
    c = tc.InferenceServerClient(server.target)
    try:
        expected = reference(c, query)["output"]
        c.register_system_shared_memory(name, region._shm_key, 1 << 16)
        answers: queue.Queue = queue.Queue()
        c.start_stream(lambda result, error: answers.put((result, error)))
        query_in = tc.InferInput("query", [1, L, E], "FP32")
        query_in.set_shared_memory(name, query.nbytes)
        for i in range(3):
            output = tc.InferRequestedOutput("output")
            output.set_shared_memory(name, expected.nbytes, offset=8192 * (i + 1))
            c.async_stream_infer("default", [query_in], outputs=[output], request_id=str(i))
        for _ in range(3):
            _, error = answers.get(timeout=30)
            assert error is None
        c.stop_stream()
        for i in range(3):
            got = shm.get_contents_as_numpy(region, np.float32, [1, L, E], offset=8192 * (i + 1))
            np.testing.assert_array_equal(got, expected)
    finally:
        c.unregister_system_shared_memory()
        c.close()


def _status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def test_bad_registrations_are_refused_precisely(client: tc.InferenceServerClient, region) -> None:
    name, key = region._triton_shm_name, region._shm_key
    code, message = _status(lambda: client.register_system_shared_memory(name, "/attnserve-test-absent", 16))
    assert code == "StatusCode.INVALID_ARGUMENT" and "cannot open shared memory object" in message
    code, message = _status(lambda: client.register_system_shared_memory(name, key, 1 << 16, offset=1))
    assert code == "StatusCode.INVALID_ARGUMENT" and "past the end" in message and "65536 bytes" in message
    for bad_key in ("/../etc/passwd", "/a/b", ""):
        code, message = _status(lambda k=bad_key: client.register_system_shared_memory(name, k, 16))
        assert code == "StatusCode.INVALID_ARGUMENT" and message.startswith("key:"), message
    code, message = _status(lambda: client.register_system_shared_memory(name, key, 0))
    assert code == "StatusCode.INVALID_ARGUMENT" and "byte_size" in message
    assert name not in client.get_system_shared_memory_status().regions


def test_bad_references_are_invalid_argument_and_the_server_stays_up(client: tc.InferenceServerClient, region) -> None:
    query = x(1, L, E)
    name = region._triton_shm_name
    client.register_system_shared_memory(name, region._shm_key, 4096)

    def infer(size: int = query.nbytes, offset: int = 0, region_name: str = name, out_room: int | None = None):
        q = tc.InferInput("query", [1, L, E], "FP32")
        q.set_shared_memory(region_name, size, offset=offset)
        outputs = None
        if out_room is not None:
            outputs = [tc.InferRequestedOutput("output")]
            outputs[0].set_shared_memory(name, out_room, offset=2048)
        return lambda: client.infer("default", [q], outputs=outputs)

    cases = [
        (infer(region_name="nope"), "no shared memory region named 'nope' is registered"),
        (infer(offset=4000), "lies outside shared memory region"),
        (infer(size=query.nbytes - 4), f"expected {query.nbytes} bytes"),
        (infer(out_room=16), f"output 'output' takes {query.nbytes} bytes, got room for 16"),
    ]
    for call, words in cases:
        code, message = _status(call)
        assert code == "StatusCode.INVALID_ARGUMENT", message
        assert words in message, message
    # The object shrinks under its region: refused, never a crash.
    fd = os.open(f"/dev/shm/{region._shm_key.lstrip('/')}", os.O_RDWR)
    os.ftruncate(fd, query.nbytes // 2)
    os.close(fd)
    code, message = _status(infer())
    assert code == "StatusCode.INVALID_ARGUMENT" and "shrank" in message
    assert client.is_server_live()


def test_contents_and_a_region_for_one_input_are_refused(server: Running, region) -> None:
    query = x(1, L, E)
    name = region._triton_shm_name
    with grpc.insecure_channel(server.target) as channel:
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        stub.SystemSharedMemoryRegister(
            triton.SystemSharedMemoryRegisterRequest(name=name, key=region._shm_key, byte_size=4096), timeout=10
        )
        request = triton.ModelInferRequest(model_name="default")
        tensor = request.inputs.add(name="query", datatype="FP32", shape=[1, L, E])
        tensor.contents.fp32_contents.extend(query.ravel().tolist())
        tensor.parameters["shared_memory_region"].string_param = name
        tensor.parameters["shared_memory_byte_size"].int64_param = query.nbytes
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is in shared memory; send no contents" in err.value.details()
        del tensor.parameters["shared_memory_byte_size"]
        tensor.ClearField("contents")
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=10)
        assert "needs both 'shared_memory_region' and 'shared_memory_byte_size'" in err.value.details()
        stub.SystemSharedMemoryUnregister(triton.SystemSharedMemoryUnregisterRequest(), timeout=10)


def test_off_by_default() -> None:
    with running(settings(model("default", embed_dim=E, num_heads=H))) as handle:
        c = tc.InferenceServerClient(handle.target)
        try:
            assert "system_shared_memory" not in c.get_server_metadata().extensions
            code, message = _status(lambda: c.register_system_shared_memory("r", "/x", 16))
            assert code == "StatusCode.FAILED_PRECONDITION" and "--allow-client-shm" in message
            q = tc.InferInput("query", [1, L, E], "FP32")
            q.set_shared_memory("r", 4 * L * E)
            code, message = _status(lambda: c.infer("default", [q]))
            assert code == "StatusCode.INVALID_ARGUMENT" and "--allow-client-shm" in message
        finally:
            c.close()


def test_every_edge_process_holds_the_regions_a_client_registers(region) -> None:
    """Two edge processes: a region registered over one connection is usable, and then gone, over
    connections the kernel spread over both edges (SO_REUSEPORT), as perf_analyzer's would be."""
    query = x(1, L, E)
    name = region._triton_shm_name
    shm.set_shared_memory_region(region, [query])
    with running(settings(model("default", embed_dim=E, num_heads=H), allow_client_shm=True, edge_processes=2)) as h:
        # Each channel its own connection (gRPC would otherwise share one among channels to one target).
        channels = [grpc.insecure_channel(h.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(12)]
        try:
            stubs = [triton_grpc.GRPCInferenceServiceStub(c) for c in channels]
            stubs[0].SystemSharedMemoryRegister(
                triton.SystemSharedMemoryRegisterRequest(name=name, key=region._shm_key, byte_size=1 << 16), timeout=30
            )
            request = triton.ModelInferRequest(model_name="default")
            tensor = request.inputs.add(name="query", datatype="FP32", shape=[1, L, E])
            tensor.parameters["shared_memory_region"].string_param = name
            tensor.parameters["shared_memory_byte_size"].int64_param = query.nbytes
            outputs = []
            for stub in stubs:
                status = stub.SystemSharedMemoryStatus(triton.SystemSharedMemoryStatusRequest(), timeout=30)
                assert list(status.regions) == [name]
                outputs.append(bytes(stub.ModelInfer(request, timeout=30).raw_output_contents[0]))
            assert len(set(outputs)) == 1
            assert h.sample("attnserve_shared_memory_regions") == 1  # the engine's table, counted once
            stubs[-1].SystemSharedMemoryUnregister(triton.SystemSharedMemoryUnregisterRequest(name=name), timeout=30)
            for stub in stubs:
                status = stub.SystemSharedMemoryStatus(triton.SystemSharedMemoryStatusRequest(), timeout=30)
                assert not status.regions
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(request, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A refusal comes back from the engine with its status and words.
            with pytest.raises(grpc.RpcError) as err:
                stubs[3].SystemSharedMemoryRegister(
                    triton.SystemSharedMemoryRegisterRequest(name=name, key="/attnserve-test-absent", byte_size=8),
                    timeout=30,
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot open shared memory object" in err.value.details()
        finally:
            for c in channels:
                c.close()


def test_bench_sends_through_shared_memory(server: Running, tmp_path) -> None:
    """`attnserve bench --shared-memory`: every request's tensors in shared memory, over the KServe API;
    the regions are unregistered and their objects removed afterwards."""
    import json
    import subprocess

    def bench(*flags: str) -> subprocess.CompletedProcess:
        return run_cli("bench", "--shared-memory", *flags)

    def measured(model_name: str, *flags: str) -> dict:
        out = tmp_path / f"{model_name}.json"
        r = bench("--target", server.target, "--model", model_name, "--duration-s", "0.4", "--warmup-s", "0.1",
                  "--no-inprocess", "--json", str(out), *flags)  # fmt: skip
        assert r.returncode == 0, r.stderr
        (row,) = json.loads(out.read_text())["rows"]
        assert row["requests"] > 0 and row["errors"] == 0
        return row

    before = set(os.listdir("/dev/shm"))
    row = measured("default", "--concurrency", "3", "--processes", "2", "--seq-len", "8,4")
    assert server.sample("attnserve_requests_total", model="default", method="ModelInfer", code="OK") >= row["requests"]
    c = tc.InferenceServerClient(server.target)
    try:
        assert not c.get_system_shared_memory_status().regions
    finally:
        c.close()
    assert set(os.listdir("/dev/shm")) <= before
    measured("half", "--concurrency", "2", "--processes", "1", "--seq-len", "8")  # bfloat16: sent as BF16
    # perf_analyzer takes shared memory only for a model without optional inputs: cross attention has one.
    bad = bench("--perf-analyzer", "true", "--kv-len", "4")  # any binary: refused before it runs
    assert bad.returncode == 2
    assert "cross attention's key_value is one; drop --kv-len" in bad.stderr


def test_the_regions_held_at_once_are_bounded(region) -> None:
    """Each region holds a file descriptor: past the bound a registration is RESOURCE_EXHAUSTED, and the
    regions already held keep working."""
    from attnserve_server.edge.shared_memory import SharedMemoryRegistry
    from attnserve_server.errors import QueueFull

    registry = SharedMemoryRegistry(enabled=True, max_regions=3)
    try:
        for i in range(3):
            registry.add(f"r{i}", region._shm_key, 64 * i, 64)
        with pytest.raises(QueueFull, match="3 shared memory regions are registered, the most this server holds"):
            registry.add("r3", region._shm_key, 0, 64)
        registry.remove("r0")
        registry.add("r3", region._shm_key, 0, 64)
        assert sorted(registry.table()) == ["r1", "r2", "r3"]
    finally:
        registry.close()


def test_the_calls_need_a_token_where_tokens_are_required(region) -> None:
    from attnserve_server.security import token_hash

    tokens = f"{token_hash('only-other')} other"  # a valid token, for another model only
    with running(settings(model("default", embed_dim=E, num_heads=H), allow_client_shm=True, auth_tokens=tokens)) as h:
        c = tc.InferenceServerClient(h.target)
        try:
            code, _ = _status(lambda: c.register_system_shared_memory("r", region._shm_key, 64))
            assert code == "StatusCode.UNAUTHENTICATED"
            auth = {"authorization": "Bearer only-other"}
            c.register_system_shared_memory("r", region._shm_key, 64, headers=auth)
            assert list(c.get_system_shared_memory_status(headers=auth).regions) == ["r"]
            c.unregister_system_shared_memory(headers=auth)
        finally:
            c.close()


def test_an_edge_that_never_takes_the_table_fails_the_call_instead_of_hanging(region, monkeypatch) -> None:
    """The engine's side alone: one edge acknowledges the new table, the other does not, until it recovers."""
    import asyncio

    from attnserve_server.multiprocess import link, supervisor
    from attnserve_server.settings import ServerSettings

    monkeypatch.setattr(supervisor, "SHM_ACK_TIMEOUT_S", 0.2)

    class FakeEdge:
        def __init__(self, sup: supervisor.EdgeSupervisor, index: int, answers: bool) -> None:
            self.sup, self.index, self.answers, self.sent, self.channel = sup, index, answers, [], object()

        def send(self, message: tuple) -> None:
            self.sent.append(message)
            if message[0] == link.SHM_TABLE and self.answers:
                asyncio.get_running_loop().call_soon(self.sup.table_acked, self, message[1])

    async def main() -> list[tuple]:
        sup = supervisor.EdgeSupervisor(ServerSettings(allow_client_shm=True), {}, None, asyncio.Event())
        good, stuck = FakeEdge(sup, 0, True), FakeEdge(sup, 1, False)
        sup.edges = [good, stuck]  # type: ignore[list-item]
        try:
            await sup.shared_memory_call(good, 7, "register", ("r", region._shm_key, 0, 64))  # type: ignore[arg-type]
            stuck.answers = True  # it recovers: the next change goes through
            await sup.shared_memory_call(good, 8, "unregister", ("r",))  # type: ignore[arg-type]
        finally:
            sup.shared_memory.close()
        return [m for m in good.sent if m[0] == link.SHM_REPLY]

    replies = asyncio.run(main())
    assert replies == [
        (link.SHM_REPLY, 7, ("UNAVAILABLE", "edge process(es) 1 did not answer in time")),
        (link.SHM_REPLY, 8, None),
    ]


def test_a_region_unregistered_while_its_request_waits_still_takes_the_answer(region) -> None:
    """The request is decoded (its output place checked) while the region is registered, then waits in
    the queue while the client unregisters the region and the process opens other files. Its answer
    must land in the region's object, not in a file that reused a closed descriptor."""
    import concurrent.futures
    import tempfile

    query = x(1, L, E)
    name = region._triton_shm_name
    shm.set_shared_memory_region(region, [query])
    held_model = model("default", embed_dim=E, num_heads=H, max_batch_size=2, max_queue_delay_ms=60_000)
    with running(settings(held_model, allow_client_shm=True, solo_macs=0)) as h:  # no lone run on the loop
        c = tc.InferenceServerClient(h.target)
        try:
            c.register_system_shared_memory(name, region._shm_key, 1 << 16)
            q = tc.InferInput("query", [1, L, E], "FP32")
            q.set_shared_memory(name, query.nbytes)
            out = tc.InferRequestedOutput("output")
            out.set_shared_memory(name, query.nbytes, offset=8192)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(c.infer, "default", [q], outputs=[out])
                h.wait_for(lambda: h.sample("attnserve_queue_depth", model="default") == 1)
                c.unregister_system_shared_memory(name)
                with contextlib.ExitStack() as files:  # descriptors a closed one would be reused for
                    spares = [files.enter_context(tempfile.TemporaryFile()) for _ in range(8)]
                    company = tc.InferInput("query", [1, L, E], "FP32")
                    company.set_data_from_numpy(query)
                    # It fills the batch, so both run; its answer, in the message, is the one expected.
                    expected = c.infer("default", [company]).as_numpy("output")
                    waiting.result(timeout=30)
                    assert all(os.fstat(f.fileno()).st_size == 0 for f in spares)
            got = shm.get_contents_as_numpy(region, np.float32, [1, L, E], offset=8192)
            np.testing.assert_array_equal(got, expected)
        finally:
            c.close()
