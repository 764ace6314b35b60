"""The KServe v2 / Open Inference Protocol edge, driven by the real tritonclient (grpc and grpc.aio)."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton
from tritonclient.grpc import service_pb2_grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from attnserve import Client
from attnserve_server.protocol import open_inference_pb2 as ours

from conftest import FailingWorker, Running, model, running, settings

E, H = 32, 4


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    models = (
        model("default", embed_dim=E, num_heads=H, max_batch_size=8, max_queue_delay_ms=2),
        model("bare", kind="sdpa", embed_dim=E, num_heads=H, vdim=16),
        model("cross", embed_dim=E, num_heads=H, kdim=24, vdim=40),
        model("fp16", embed_dim=E, num_heads=H, dtype="float16"),
        model("bf16", embed_dim=E, num_heads=H, dtype="bfloat16"),
    )
    with running(settings(*models)) as handle:
        yield handle


@pytest.fixture
def client(server: Running) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.target)
    yield c
    c.close()


def x(*shape: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)


def infer_input(name: str, array: np.ndarray, datatype: str | None = None) -> tc.InferInput:
    datatype = datatype or {"float32": "FP32", "float16": "FP16", "bool": "BOOL", "int64": "INT64"}[array.dtype.name]
    tensor = tc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def status_of(err: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return err.value.status()


# -- the wire: our .proto against the descriptors tritonclient ships -------------------------


def _fields(descriptor) -> dict[str, tuple]:
    return {
        f.name: (f.number, f.type, f.is_repeated, f.message_type and f.message_type.full_name)
        for f in descriptor.fields
    }


def _messages(file) -> Iterator:
    def walk(d):
        yield d
        for nested in d.nested_types:
            yield from walk(nested)

    for d in file.message_types_by_name.values():
        yield from walk(d)


def test_every_message_and_field_matches_tritons_numbering() -> None:
    theirs = {}
    for module in (triton, triton_config):
        theirs.update({d.full_name: d for d in _messages(module.DESCRIPTOR)})
    checked = 0
    for d in _messages(ours.DESCRIPTOR):
        assert d.full_name in theirs, f"{d.full_name} is not one of Triton's messages"
        their_fields = _fields(theirs[d.full_name])
        for name, spec in _fields(d).items():
            assert their_fields.get(name) == spec, (
                f"{d.full_name}.{name}: ours {spec}, Triton's {their_fields.get(name)}"
            )
            checked += 1
    assert checked > 100
    for enum in ours.DESCRIPTOR.enum_types_by_name.values():
        their_enum = triton_config.DESCRIPTOR.enum_types_by_name[enum.name]
        assert {v.name: v.number for v in enum.values} == {v.name: v.number for v in their_enum.values}
    service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    their_service = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == their_service.full_name == "inference.GRPCInferenceService"
    for method in service.methods:
        theirs_m = their_service.methods_by_name[method.name]
        assert method.input_type.full_name == theirs_m.input_type.full_name
        assert method.output_type.full_name == theirs_m.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (
            theirs_m.client_streaming,
            theirs_m.server_streaming,
        )


def test_an_unimplemented_triton_method_is_unimplemented(server: Running) -> None:
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        triton_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
            triton.RepositoryModelLoadRequest(model_name="default"), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_cuda_shared_memory_holds_no_region_and_refuses_registration(
    server: Running, client: tc.InferenceServerClient
) -> None:
    """As Triton answers when it holds no CUDA region: perf_analyzer unregisters every region of both
    kinds when it stops, and printed a failure for each run while this answered UNIMPLEMENTED."""
    assert not client.get_cuda_shared_memory_status().regions
    client.unregister_cuda_shared_memory()  # every region: none, nothing to do
    client.unregister_cuda_shared_memory("absent")
    with pytest.raises(InferenceServerException) as err:
        client.get_cuda_shared_memory_status("absent")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert "no CUDA shared memory region named 'absent'" in err.value.message()
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as rpc:
        triton_grpc.GRPCInferenceServiceStub(channel).CudaSharedMemoryRegister(
            triton.CudaSharedMemoryRegisterRequest(name="gpu", raw_handle=b"\0" * 64, byte_size=1024), timeout=10
        )
    assert rpc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "CUDA shared memory is not served" in rpc.value.details()
    assert "cuda_shared_memory" not in client.get_server_metadata().extensions


def test_reflection_lists_both_apis(server: Running) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
        ]
        listed, found = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"attnserve.v1.AttentionService", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    file = descriptor_pb2.FileDescriptorProto.FromString(found.file_descriptor_response.file_descriptor_proto[0])
    assert file.package == "inference" and "ModelInferRequest" in {m.name for m in file.message_type}


# -- health, metadata, configuration ---------------------------------------------------------


def test_health_and_server_metadata(client: tc.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("default") and client.is_model_ready("bare", "1")
    meta = client.get_server_metadata()
    assert meta.name == "attnserve"
    assert {"model_configuration", "statistics"} <= set(meta.extensions)
    index = client.get_model_repository_index()
    assert [(m.name, m.state) for m in index.models] == [
        (n, "READY") for n in ("default", "bare", "cross", "fp16", "bf16")
    ]


def test_model_metadata_names_inputs_and_outputs_with_variable_dims(client: tc.InferenceServerClient) -> None:
    meta = client.get_model_metadata("default")
    assert meta.versions == ["1"] and meta.platform == "attnserve"
    inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
    assert inputs == {
        "query": ("FP32", [-1, -1, E]),
        "key_value": ("FP32", [-1, -1, E]),
        "key": ("FP32", [-1, -1, E]),
        "value": ("FP32", [-1, -1, E]),
        "key_padding_mask": ("BOOL", [-1, -1]),
        "key_lengths": ("INT64", [-1, 1]),
    }
    outputs = {t.name: (t.datatype, list(t.shape)) for t in meta.outputs}
    # attention_weights only when asked for: a client that asks for every listed output (perf_analyzer
    # does) would otherwise pay for the weights in every request
    assert outputs == {"output": ("FP32", [-1, -1, E])}
    bare = {t.name: list(t.shape) for t in client.get_model_metadata("bare").inputs}
    assert bare["key"] == [-1, -1, E] and bare["value"] == [-1, -1, 16] and "key_value" not in bare
    cross = {t.name for t in client.get_model_metadata("cross").inputs}
    assert "key_value" not in cross  # kdim 24 != vdim 40
    assert {t.datatype for t in client.get_model_metadata("bf16").inputs if "key" not in t.name[:3]} >= {"BF16"}


def test_model_config_carries_batching_and_optional_inputs(client: tc.InferenceServerClient) -> None:
    config = client.get_model_config("default").config
    assert config.name == "default" and config.backend == "attnserve"
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.dynamic_batching.default_queue_policy.max_queue_size > 0
    inputs = {i.name: i for i in config.input}
    assert list(inputs["query"].dims) == [-1, E] and not inputs["query"].optional
    assert inputs["key_value"].optional and inputs["key_padding_mask"].optional
    assert inputs["query"].data_type == triton_config.TYPE_FP32
    assert inputs["key_lengths"].data_type == triton_config.TYPE_INT64
    assert [o.name for o in config.output] == ["output"]
    assert config.parameters["optional_outputs"].string_value == "attention_weights"
    assert config.instance_group[0].kind == triton_config.ModelInstanceGroup.KIND_CPU
    assert config.parameters["num_heads"].string_value == str(H)
    bare = {i.name: i for i in client.get_model_config("bare").config.input}
    assert not bare["key"].optional and not bare["value"].optional
    assert client.get_model_config("fp16").config.input[0].data_type == triton_config.TYPE_FP16


# -- inference -------------------------------------------------------------------------------


def native(server: Running, query: np.ndarray, **kw) -> object:
    with Client(server.target, timeout_s=30) as c:
        return c.attend(query, **kw)


def test_raw_fp32_inference_matches_the_native_api(server: Running, client: tc.InferenceServerClient) -> None:
    q, kv = x(2, 5, E), x(2, 7, E)
    result = client.infer("default", [infer_input("query", q), infer_input("key_value", kv)], request_id="r1")
    out = result.as_numpy("output")
    assert out.shape == (2, 5, E) and out.dtype == np.float32
    assert result.get_response().id == "r1" and result.get_response().model_version == "1"
    assert result.as_numpy("attention_weights") is None  # not asked for
    np.testing.assert_allclose(out, native(server, q, key_value=kv).output, rtol=0, atol=1e-6)


def test_weights_are_averaged_by_default_on_both_apis_as_torch_does(
    server: Running, client: tc.InferenceServerClient
) -> None:
    q = x(2, 6, E)
    result = client.infer("default", [infer_input("query", q)], parameters={"need_weights": True})
    ref = native(server, q, need_weights=True)  # the native API, no average_weights given
    assert result.as_numpy("attention_weights").shape == (2, 1, 6, 6)
    np.testing.assert_allclose(result.as_numpy("attention_weights")[:, 0], ref.attention_weights, atol=1e-6)


def test_weights_masks_and_causal_match_the_native_api(server: Running, client: tc.InferenceServerClient) -> None:
    q = x(2, 6, E)
    lengths = np.array([[4], [6]], dtype=np.int64)  # [B, 1], as the config's dims [1] give
    result = client.infer(
        "default",
        [infer_input("query", q), infer_input("key_lengths", lengths)],
        parameters={"average_weights": False},
        outputs=[tc.InferRequestedOutput("output"), tc.InferRequestedOutput("attention_weights")],
    )
    ref = native(server, q, key_lengths=lengths.reshape(2), need_weights=True, average_weights=False)
    np.testing.assert_allclose(result.as_numpy("output"), ref.output, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("attention_weights"), ref.attention_weights, atol=1e-6)
    assert result.as_numpy("attention_weights").shape == (2, H, 6, 6)

    mask = np.zeros((2, 6), dtype=bool)
    mask[1, 3:] = True
    result = client.infer(
        "default",
        [infer_input("query", q), infer_input("key_padding_mask", mask)],
        parameters={"causal": True, "need_weights": True, "average_weights": True},
    )
    ref = native(server, q, key_padding_mask=mask, causal=True, need_weights=True, average_weights=True)
    np.testing.assert_allclose(result.as_numpy("output"), ref.output, atol=1e-6)
    weights = result.as_numpy("attention_weights")
    assert weights.shape == (2, 1, 6, 6)  # averaged: one "head"
    np.testing.assert_allclose(weights[:, 0], ref.attention_weights, atol=1e-6)
    assert np.all(np.triu(weights[0, 0], 1) == 0)


def test_bare_operation_and_cross_widths(server: Running, client: tc.InferenceServerClient) -> None:
    q, k, v = x(1, 4, E), x(1, 9, E), x(1, 9, 16)
    out = client.infer("bare", [infer_input("query", q), infer_input("key", k), infer_input("value", v)])
    ref = native(server, q, model="bare", key=k, value=v)
    np.testing.assert_allclose(out.as_numpy("output"), ref.output, atol=1e-6)
    k, v = x(1, 3, 24), x(1, 3, 40)
    out = client.infer("cross", [infer_input("query", q), infer_input("key", k), infer_input("value", v)])
    assert out.as_numpy("output").shape == (1, 4, E)


def test_fp16_and_bf16_travel_raw(server: Running, client: tc.InferenceServerClient) -> None:
    q16 = x(1, 5, E, dtype=np.float16)
    out = client.infer("fp16", [infer_input("query", q16)]).as_numpy("output")
    assert out.dtype == np.float16 and out.shape == (1, 5, E)
    np.testing.assert_allclose(out, native(server, q16, model="fp16").output, atol=1e-3)

    qbf = x(1, 5, E).astype(ml_dtypes.bfloat16)
    result = client.infer("bf16", [infer_input("query", qbf, "BF16")])
    assert result.get_output("output").datatype == "BF16"
    raw = result.get_response().raw_output_contents[0]
    out = np.frombuffer(raw, dtype=ml_dtypes.bfloat16).reshape(1, 5, E).astype(np.float32)
    ref = native(server, qbf, model="bf16").output.astype(np.float32)
    np.testing.assert_allclose(out, ref, atol=1e-2)


def typed_request(q: np.ndarray, **extra) -> triton.ModelInferRequest:
    request = triton.ModelInferRequest(model_name="default", id="typed", **extra)
    tensor = request.inputs.add(name="query", datatype="FP32", shape=q.shape)
    tensor.contents.fp32_contents.extend(q.ravel().tolist())
    return request


def test_typed_contents_in_typed_contents_out(server: Running) -> None:
    q = x(1, 3, E)
    with grpc.insecure_channel(server.target) as channel:
        response = triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(typed_request(q), timeout=30)
    assert not response.raw_output_contents
    out = np.array(response.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(response.outputs[0].shape)
    np.testing.assert_allclose(out, native(server, q).output, atol=1e-6)
    assert response.parameters["batch_size"].int64_param >= 1


def test_typed_contents_carry_the_weights_typed_too(server: Running) -> None:
    q = x(1, 3, E)
    request = typed_request(q)
    request.parameters["need_weights"].bool_param = True
    with grpc.insecure_channel(server.target) as channel:
        response = triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert not response.raw_output_contents
    assert [(o.name, list(o.shape)) for o in response.outputs] == [
        ("output", [1, 3, E]),
        ("attention_weights", [1, 1, 3, 3]),
    ]
    ref = native(server, q, need_weights=True)
    typed = [np.array(o.contents.fp32_contents, dtype=np.float32).reshape(o.shape) for o in response.outputs]
    np.testing.assert_allclose(typed[0], ref.output, atol=1e-6)
    np.testing.assert_allclose(typed[1].reshape(ref.attention_weights.shape), ref.attention_weights, atol=1e-6)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: r.raw_input_contents.extend([b"\0" * 4, b"\0" * 4]),
            "raw_input_contents: expected one entry per input (1), got 2",
        ),
        (lambda r: r.inputs[0].contents.int_contents.append(1), "FP32 input 'query' goes in fp32_contents"),
        (lambda r: r.inputs[0].contents.fp32_contents.pop(), "expected 96 elements for input 'query'"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP16"), "FP16 input 'query' has no typed field"),
    ],
)
def test_typed_contents_errors(server: Running, mutate, message: str) -> None:
    request = typed_request(x(1, 3, E))
    mutate(request)
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_a_bad_timeout_parameter_is_invalid_argument_and_counted(server: Running) -> None:
    before = server.sample("attnserve_requests_total", model="default", method="ModelInfer", code="INVALID_ARGUMENT")
    cases = (
        (triton.InferParameter(string_param="soon"), "expected int64_param (microseconds), got string_param"),
        (triton.InferParameter(int64_param=-5), "expected a positive number of microseconds, got -5"),
    )
    for param, message in cases:
        request = typed_request(x(1, 3, E))
        request.parameters["timeout"].CopyFrom(param)
        with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
            triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "parameters['timeout']: " in err.value.details() and message in err.value.details()
    after = server.sample("attnserve_requests_total", model="default", method="ModelInfer", code="INVALID_ARGUMENT")
    assert after == before + 2


def test_mixing_raw_and_typed_contents_is_refused(server: Running) -> None:
    request = typed_request(x(1, 3, E))
    request.inputs.add(name="key_value", datatype="FP32", shape=[1, 3, E])
    request.raw_input_contents.extend([b"", x(1, 3, E).tobytes()])
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].contents: input 'query' has typed contents while the request uses raw_input_contents" in (
        err.value.details()
    )


@pytest.mark.parametrize(
    ("model_name", "inputs", "kwargs", "status", "message"),
    [
        ("nope", [("query", x(1, 3, E))], {}, "NOT_FOUND", "model: no model named 'nope'"),
        ("default", [("query", x(1, 3, E))], {"model_version": "2"}, "NOT_FOUND", "has no version '2'"),
        ("default", [("query", x(1, 3, 16))], {}, "INVALID_ARGUMENT", "query.shape[-1]: expected embed_dim 32, got 16"),
        (
            "default",
            [("query", x(1, 3, E, dtype=np.float16))],
            {},
            "INVALID_ARGUMENT",
            "query.dtype: expected FP32 (the dtype of model 'default'), got FP16",
        ),
        ("default", [("query", x(3, E))], {}, "INVALID_ARGUMENT", "query.shape: expected [B, L, E]"),
        (
            "default",
            [("query", x(9, 3, E))],
            {},
            "INVALID_ARGUMENT",
            "9 sequences exceed model 'default' max_batch_size 8",
        ),
        ("default", [("nonsense", x(1, 3, E))], {}, "INVALID_ARGUMENT", "nonsense: not an input of model 'default'"),
        ("bare", [("query", x(1, 3, E))], {}, "INVALID_ARGUMENT", "key: required by model 'bare'"),
        (
            "default",
            [("query", x(1, 3, E)), ("key_value", x(1, 4, E)), ("key", x(1, 4, E)), ("value", x(1, 4, E))],
            {},
            "INVALID_ARGUMENT",
            "key_value: send either key_value or key and value, not both",
        ),
        (
            "default",
            [("query", x(1, 3, E)), ("key_lengths", np.array([[9]], dtype=np.int64))],
            {},
            "INVALID_ARGUMENT",
            "key_lengths: expected lengths in 1..3",
        ),
        (
            "default",
            [("query", x(1, 3, E))],
            {"parameters": {"temperature": 0.5}},
            "INVALID_ARGUMENT",
            "parameters['temperature']: not a parameter attnserve reads",
        ),
        (
            "default",
            [("query", x(1, 3, E))],
            {"parameters": {"causal": "yes"}},
            "INVALID_ARGUMENT",
            "parameters['causal']: expected bool_param, got string_param",
        ),
        (
            "default",
            [("query", x(1, 3, E))],
            {"outputs": [tc.InferRequestedOutput("logits")]},
            "INVALID_ARGUMENT",
            "outputs[0].name: expected 'output' or 'attention_weights', got 'logits'",
        ),
        (
            "default",
            [("query", x(1, 3, E))],
            {"outputs": [tc.InferRequestedOutput("attention_weights")], "parameters": {"need_weights": False}},
            "INVALID_ARGUMENT",
            "'attention_weights' is requested but parameters['need_weights'] is false",
        ),
    ],
)
def test_errors_carry_the_status_and_message_of_the_native_api(
    client: tc.InferenceServerClient, model_name, inputs, kwargs, status, message
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer(model_name, [infer_input(n, a) for n, a in inputs], **kwargs)
    assert status_of(err) == f"StatusCode.{status}"
    assert message in err.value.message()


def test_a_wrong_byte_length_is_invalid_argument(server: Running) -> None:
    request = triton.ModelInferRequest(model_name="default")
    request.inputs.add(name="query", datatype="FP32", shape=[1, 3, E])
    request.raw_input_contents.append(b"\0" * 100)
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as err:
        triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        err.value.details()
        == "raw_input_contents[0] (input 'query'): expected 384 bytes for shape [1, 3, 32] FP32, got 100"
    )


def test_unknown_models_in_metadata_calls_are_not_found(client: tc.InferenceServerClient) -> None:
    for call in (client.get_model_metadata, client.get_model_config, client.is_model_ready):
        with pytest.raises(InferenceServerException) as err:
            call("nope")
        assert status_of(err) == "StatusCode.NOT_FOUND"


def test_the_timeout_parameter_is_a_deadline() -> None:
    # Batches wait a minute for company, so the request stays queued until its timeout.
    with running(settings(model(embed_dim=E, num_heads=H, max_queue_delay_ms=60_000))) as handle:
        c = tc.InferenceServerClient(handle.target)
        with pytest.raises(InferenceServerException) as err:
            c.infer("default", [infer_input("query", x(1, 3, E))], timeout=200_000)  # microseconds
        assert status_of(err) == "StatusCode.DEADLINE_EXCEEDED"
        handle.wait_for(
            lambda: handle.sample("attnserve_dropped_requests_total", model="default", reason="deadline_exceeded") == 1
        )
        assert c.get_inference_statistics("default").model_stats[0].inference_stats.fail.count == 1
        c.close()


def test_a_full_queue_is_resource_exhausted() -> None:
    # Batches wait a minute for company and the queue holds one request.
    config = settings(model(embed_dim=E, num_heads=H, max_queue_delay_ms=60_000, max_queue_size=1))
    with running(config) as handle:
        c = tc.InferenceServerClient(handle.target)
        held: queue.Queue = queue.Queue()
        c.async_infer(
            "default", [infer_input("query", x(1, 3, E))], callback=lambda result, error: held.put((result, error))
        )
        handle.wait_for(lambda: handle.sample("attnserve_queue_depth", model="default") == 1)
        with pytest.raises(InferenceServerException) as err:
            c.infer("default", [infer_input("query", x(1, 3, E))])
        assert status_of(err) == "StatusCode.RESOURCE_EXHAUSTED"
        assert "queue is full" in err.value.message()
        handle.call(handle.server.stop(5.0))  # the drain answers the held request
        result, error = held.get(timeout=30)
        assert error is None and result.as_numpy("output").shape == (1, 3, E)
        c.close()


def test_a_failing_batch_is_internal_and_the_server_keeps_serving() -> None:
    with running(settings(model(embed_dim=E, num_heads=H, max_batch_size=1)), worker_factory=FailingWorker) as handle:
        c = tc.InferenceServerClient(handle.target)
        bad = x(1, 3, E)
        bad[0, 0, 0] = 1234.0  # FailingWorker's injected fault
        with pytest.raises(InferenceServerException) as err:
            c.infer("default", [infer_input("query", bad)])
        assert status_of(err) == "StatusCode.INTERNAL"
        assert c.infer("default", [infer_input("query", x(1, 3, E))]).as_numpy("output").shape == (1, 3, E)
        stats = c.get_inference_statistics("default").model_stats[0].inference_stats
        assert (stats.success.count, stats.fail.count) == (1, 1)
        c.close()


# -- streaming and asyncio -------------------------------------------------------------------


def stream_requests() -> list[dict]:
    return [
        {"model_name": "default", "inputs": [infer_input("query", x(2, 3, E))], "request_id": "a"},
        {"model_name": "default", "inputs": [infer_input("query", x(1, 3, 16))], "request_id": "bad"},
        {
            "model_name": "bare",
            "inputs": [infer_input(n, x(1, 4, w)) for n, w in (("query", E), ("key", E), ("value", 16))],
            "request_id": "c",
        },
    ]


def test_stream_answers_each_request_and_a_bad_one_in_band(client: tc.InferenceServerClient) -> None:
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for request in stream_requests():
        client.async_stream_infer(**request)
    got = [answers.get(timeout=30) for _ in range(3)]
    client.stop_stream()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [e for _, e in got if e is not None]
    assert set(results) == {"a", "c"}
    assert results["a"].as_numpy("output").shape == (2, 3, E)
    assert results["c"].as_numpy("output").shape == (1, 4, 16)
    assert len(errors) == 1 and "query.shape[-1]: expected embed_dim 32, got 16" in errors[0].message()


def test_asyncio_client_infer_and_stream(server: Running) -> None:
    async def main() -> tuple:
        async with tca.InferenceServerClient(server.target) as c:
            assert await c.is_server_ready()
            q = x(1, 4, E)
            inp = tc.InferInput("query", list(q.shape), "FP32")
            inp.set_data_from_numpy(q)
            single = await c.infer("default", [inp])

            async def requests():
                for r in stream_requests():
                    yield r

            streamed = [item async for item in c.stream_infer(requests())]
            return q, single, streamed

    q, single, streamed = asyncio.run(main())
    np.testing.assert_allclose(single.as_numpy("output"), native(server, q).output, atol=1e-6)
    assert len(streamed) == 3
    errors = [e for _, e in streamed if e is not None]
    assert len(errors) == 1 and "expected embed_dim 32" in errors[0].message()


# -- statistics agree with what the clients saw ----------------------------------------------


def test_statistics_and_prometheus_count_what_clients_saw() -> None:
    with running(settings(model(embed_dim=E, num_heads=H, max_batch_size=16, max_queue_delay_ms=5))) as handle:
        c = tc.InferenceServerClient(handle.target)
        ok, sequences = 0, 0
        for b in (1, 2, 3, 1, 4):
            c.infer("default", [infer_input("query", x(b, 5, E))])
            ok, sequences = ok + 1, sequences + b
        answers: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: answers.put(error))
        for i in range(6):
            c.async_stream_infer("default", [infer_input("query", x(2, 3, E))], request_id=str(i))
        assert all(answers.get(timeout=30) is None for _ in range(6))
        c.stop_stream()
        ok, sequences = ok + 6, sequences + 12
        for _ in range(2):
            with pytest.raises(InferenceServerException):
                c.infer("default", [infer_input("query", x(1, 5, 8))])

        stats = c.get_inference_statistics("default").model_stats[0]
        s = stats.inference_stats
        assert s.success.count == ok and s.fail.count == 2
        assert stats.inference_count == sequences
        assert s.queue.count == ok and s.compute_infer.count == ok
        assert s.compute_infer.ns > 0 and s.success.ns >= s.compute_infer.ns / ok
        assert sum(b.compute_infer.count for b in stats.batch_stats) == stats.execution_count
        assert sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats) == sequences
        assert stats.last_inference > 0
        # The same events, as Prometheus sees them.
        prom_ok = sum(
            handle.sample("attnserve_requests_total", model="default", method=m, code="OK")
            for m in ("ModelInfer", "ModelStreamInfer")
        )
        assert prom_ok == ok
        assert (
            handle.sample("attnserve_requests_total", model="default", method="ModelInfer", code="INVALID_ARGUMENT")
            == 2
        )
        assert handle.sample("attnserve_batch_sequences_sum", model="default") == sequences
        assert handle.sample("attnserve_batch_sequences_count", model="default") == stats.execution_count
        c.close()
